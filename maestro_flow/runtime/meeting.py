"""Node 0's side of the rendezvous: hosting the store, answering the agents, ending the job.

Runs in `maestro run` on node 0 of a multi-node run (runtime/run.py). Node 0 hosts the store
(runtime/nodes.py) as soon as its own node's checks pass, before the checks of what only node 0
is given (the nodes' layout, --resume, --checkpoint-dir, the output paths): a refusal there is
then written to the store as the job's outcome, so the other nodes stop with it (found in QA:
they waited out MAESTRO_STARTUP_S and said node 0 did not answer). The keys are in
runtime/attempts.py; their seals in runtime/sealing.py.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from maestro_flow.runtime.nodes import Nodes, rendezvous
from maestro_flow.runtime.sealing import POLL_S, Answers, run_key, sealed, store_key

CLAIM_GRACE_S = 2.0  # how long the run's end waits for an agent to claim a node none has claimed
REFUSAL_GRACE_S = 20.0  # the same for a run refused at its start: the other nodes may be starting still
REFUSED_RUN = "the run was refused: "  # how node 0's refusal starts; node I exits 2 on it, as node 0 does


def end_job(store: Any, key: bytes, outcome: str, nnodes: int, wait_s: float, lost: set[int] = frozenset(),
            claim_grace_s: float = CLAIM_GRACE_S) -> None:
    """The run is over: tell the agents, and keep the store up (bounded) until each has read it: not
    those of the `lost` nodes, nor, after `claim_grace_s`, of nodes no agent claimed (none answers)."""
    try:
        store.set("maestro/job", sealed(key, "maestro/job", outcome))
        began = time.monotonic()
        waiting = [n for n in range(1, nnodes) if n not in lost]
        while waiting and time.monotonic() < began + max(wait_s, claim_grace_s):
            waiting = [n for n in waiting if not store.check([f"maestro/bye/{n}"]) and (  # a refusing node's: at once
                time.monotonic() < began + claim_grace_s or
                (store.check([f"maestro/node/{n}"]) and time.monotonic() < began + wait_s))]
            if waiting:
                time.sleep(POLL_S)
    except Exception:  # noqa: BLE001 (the store is ours: it fails only when this process is going down)
        pass


class Meeting:
    """The store node 0 hosts for the whole job, the run's key for its values, and the thread that
    answers the agents' challenges (until `close`)."""

    def __init__(self, nodes: Nodes, secret: bytes, startup_s: float) -> None:
        from maestro_flow.protocol.auth import new_nonce

        assert nodes.endpoint is not None
        self.nnodes = nodes.nnodes
        self.store = rendezvous(nodes, startup_s)
        run_id, skey = new_nonce(), store_key(secret)
        self.key = run_key(skey, run_id, nodes.endpoint[1])
        self.answers = Answers(nodes.endpoint, nodes.nnodes, skey, run_id)
        self.ended = False

    def end(self, outcome: str, wait_s: float, lost: set[int] = frozenset(),
            claim_grace_s: float = CLAIM_GRACE_S) -> None:
        self.ended = True
        end_job(self.store, self.key, outcome, self.nnodes, wait_s, lost, claim_grace_s)

    def refuse(self, why: str, wait_s: float) -> None:
        """The run ends before its first attempt: the nodes that join within REFUSAL_GRACE_S are told
        why (Ctrl-C, or SIGTERM where the caller takes it as an interrupt, stops waiting for them).
        Said first, even with --quiet (found in review: the reason came only after the wait)."""
        print(f"node 0: {why}; telling the other nodes (waiting up to {REFUSAL_GRACE_S:.0f}s for those not yet "
              "joined; Ctrl-C skips)", file=sys.stderr, flush=True)
        try:
            self.end(f"failed: {why}", wait_s, claim_grace_s=REFUSAL_GRACE_S)
        except KeyboardInterrupt:
            pass

    def close(self) -> None:
        self.answers.close()
