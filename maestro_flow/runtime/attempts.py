"""The attempts of a run as node 0 publishes them in the rendezvous store, and what the other
nodes' agents (runtime/agent.py) write back: the store's keys, the sealed values' readers and
writers, and how two nodes' pipelines are compared.

Node 0's coordinator hosts the rendezvous store (a torch.distributed TCPStore) and publishes in
it each attempt of the run (its first, and one per automatic restart):

    maestro/attempt            the current attempt's session (a fresh nonce, not a secret) and number
    maestro/attempt/<session>  where the coordinator listens, the timeouts, which node runs which
                               rank, each rank's section, replica and worker names
    maestro/stopping/<session> set when the coordinator asks the workers to stop at the end: from
                               then on a worker that exits with code 0 has left normally
    maestro/end/<session>      "done" or "failed", when the attempt ends
    maestro/lost/<session>     set by an agent: one of its workers died, or the agent was
                               interrupted (the coordinator stops the attempt, naming it), or
                               "refused: ..." when this node cannot join (a pipeline or secret
                               that differs from node 0's: the run fails, no restart)
    maestro/job                "done" or "failed: <why>", when the whole run is over
    maestro/bye/<node>         set by an agent once it read maestro/job (node 0 waits for it where
                               an agent claimed the node, bounded)

Node 0's values (the attempt, its record, stopping, end, job) and the agents' lost notes are
sealed under a key of this run and its secret (runtime/sealing.py: a value that does not open is
not acted on, nor is one of an earlier run), which an agent learns by asking node 0 first. Found
in review: a store client made an agent start workers that connected to the client's address and
wrote logs outside the run directory, and a forged `maestro/attempt` made it stop the workers of
a running attempt. Such a value is ignored (said once); a node whose secret differs from node
0's cannot open node 0's answer, refuses the attempt, and its refusal (which node 0 cannot open
either) is shown by node 0 as such. Deleting or overwriting keys can still stop a run: the store
is as available as the network it is on.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from maestro_flow.errors import MaestroError, PipelineError, SystemFailure, WorkerLost
from maestro_flow.runtime import sealing
from maestro_flow.runtime.sealing import printable, sealed, unsealed
from maestro_flow.wording import ABSENT, changed_keys, cut


def publish_attempt(store: Any, key: bytes, session: str, info: dict[str, Any]) -> None:
    for node in sorted(set(info["node_of"].values()) - {0}):  # a goodbye said in an earlier attempt is stale
        store.delete_key(f"maestro/bye/{node}")
    store.set(f"maestro/attempt/{session}", sealed(key, f"maestro/attempt/{session}", json.dumps(info)))
    # The attempt's number too: an earlier attempt's pointer written back is then told apart
    # (found in review: it opened, and stopped the current attempt's workers).
    store.set("maestro/attempt", sealed(key, "maestro/attempt", f"{session} {int(info.get('attempt', 0))}"))


def stopping(store: Any, key: bytes, session: str) -> None:
    """The workers are asked to stop: their exits with code 0 from here on are normal."""
    store.set(f"maestro/stopping/{session}", sealed(key, f"maestro/stopping/{session}", "1"))


def end_attempt(store: Any, key: bytes, session: str, outcome: str) -> None:
    try:
        store.set(f"maestro/end/{session}", sealed(key, f"maestro/end/{session}", outcome))
    except Exception:  # noqa: BLE001 (the store is ours: it fails only when this process is going down)
        pass


REFUSED = "refused: "
# The note an agent writes for a dead worker (launcher.WorkerHandle.label names its rank), read back by lost_error.
_DEAD_WORKER = re.compile(r"worker section .*? \(rank (\d+), pid \d+\) on node ")
STOPPED = "stopped: "  # a node stopped by Ctrl-C: the run stops, no restart


def file_name(name: Any) -> bool:
    """A worker's name as its log file's (workers/NAME.log): one path component, printable."""
    return isinstance(name, str) and 0 < len(name) <= 200 and name.isprintable() and not name.startswith(".") \
        and not any(c in name for c in "/\\")


def lost_error(store: Any, key: bytes, session: str) -> MaestroError | None:
    """What an agent reported for this attempt, as the error node 0 stops with: a node that
    cannot join is bad input (no restart helps), a node stopped on purpose a failure no restart
    follows either, anything else a lost worker (restarted with --max-restarts). A note that does
    not open is a refusal of a node whose secret differs (shown as such), or ignored."""
    name = f"maestro/lost/{session}"
    if not store.check([name]):
        return None
    raw = store.get(name)
    text = unsealed(key, name, raw)
    if text is None:
        said = sealing.body(raw)
        if not said.startswith(REFUSED):
            return None  # not an agent of this run's: a worker it names is not taken as lost
        # found in QA: the note's word on its seal, put after the note's own advice, read as garbled
        return PipelineError(f"{printable(said.removeprefix(REFUSED))}. (Said by a note in the rendezvous store "
                             "that this node's secret does not open: a node whose secret differs writes it so; "
                             "another client of the store could have, too.)")
    text = printable(text)
    if text.startswith(STOPPED):  # found in review: restarted, then waited out the startup for the node
        return SystemFailure(text.removeprefix(STOPPED))
    if text.startswith(REFUSED):
        return PipelineError(text.removeprefix(REFUSED))
    lost = WorkerLost(text)
    named = _DEAD_WORKER.match(text)  # the rank of a dead worker's note (below): the coordinator says how far it got
    lost.rank = int(named.group(1)) if named else None
    return lost


def canonical(pipeline: dict[str, Any]) -> str:
    """A pipeline's dict as text that two nodes can compare."""
    return json.dumps(pipeline, sort_keys=True, default=str)


NODE0_ONLY = ("adapt_costs", "plan_search", "lookahead_steps")  # planning: node 0's alone (with sections' cost)


def comparable(pipeline: dict[str, Any]) -> dict[str, Any]:
    """What of a pipeline every node must agree on, as this node sees it: the data path resolved
    here (where this node's workers open node 0's path), without what only node 0's planner reads
    (the sections' costs, as `--costs` sets them, and the planning options)."""
    out = {k: v for k, v in pipeline.items() if k not in NODE0_ONLY}
    if isinstance(out.get("data"), dict) and isinstance(out["data"].get("path"), str):
        out["data"] = {**out["data"], "path": os.path.realpath(out["data"]["path"])}
    if isinstance(out.get("sections"), list):
        out["sections"] = [{k: v for k, v in x.items() if k != "cost"} if isinstance(x, dict) else x
                           for x in out["sections"]]
    return out


def differences(mine: Any, theirs: Any, me: str = "here") -> list[str]:
    """The keys (dotted, as --set names them) where two pipeline dicts differ, with both values.
    `me`: where `mine` is ("on node 1": found in QA, node 0 showed the text as its own, "here")."""
    out = []
    for where, a, b in changed_keys(mine, theirs):
        if ABSENT in (a, b):  # found in QA: a whole section was printed; found in review: None == absent
            value, side = (a, f"{me} only") if b is ABSENT else (b, "on node 0 only")
            out.append(f"{where} ({side})" if isinstance(value, dict) else f"{where} ({_short(value)} {side})")
        else:
            out.append(f"{where} ({_short(a)} {me}, {_short(b)} on node 0)")
    return out


def _short(value: Any) -> str:
    return cut(repr(value), 80)
