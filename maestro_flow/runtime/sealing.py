"""Values in the rendezvous store that a node can trust: sealed under the run's secret, bound to one run.

Runs in `maestro run` on every node of a multi-node run (runtime/attempts.py lists the keys). The
store (a torch TCPStore) is not authenticated: anyone who can reach it may write any key. So
node 0's values and the agents' notes are sealed, an HMAC over the key's name and the value
(`sealed`, `unsealed`), and a node acts on nothing that does not open.

A seal alone would let a value of an earlier run be replayed into a later one with the same
secret (found in review: an old `maestro/job` "done" ended a new run's agents; an old attempt
pointer and record made them start workers for an attempt long gone). So every value is sealed
under a key of this run (`run_key`): node 0 draws a fresh run id at its start, and an agent
learns it only by asking, with a fresh challenge of its own, which node 0 answers sealed under
the secret's store key together with that challenge and the store's port (`Answers`,
`read_answer`). A replayed answer carries another challenge, and a value of another run does not
open under this run's key. Another run with the same secret, live at the same time, answers a
challenge copied into its store too; its answer names its own port, and its values are sealed
for it (found in review: such a relay made an agent take the other run's "done"). Two runs on
one port of two hosts with one secret remain relayable: give each job its own secret.

    maestro/nnodes         node 0's --nnodes, in clear (a node ranked past it is never answered)
    maestro/ask/<node>     the challenge of that node's agent (a fresh nonce); node 0 looks for an
                           unanswered node's every POLL_S, for a new one (an agent that took the
                           node over) every REASK_S
    maestro/answer/<node>  node 0's answer: "<challenge> <run id> <port>", sealed under the store key
"""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from maestro_flow.errors import brief
from maestro_flow.protocol.auth import derive_key

NONCE = re.compile(r"[0-9a-f]{1,64}")  # a session, run id or challenge (auth.new_nonce)
NNODES = "maestro/nnodes"
POLL_S = 0.2  # how often the job's store is polled: answers here, beats and waits in agent.py and nodes.py
REASK_S = 2.0
STORE_S = 5.0  # the answering thread's store calls give up after this (a key deleted under it)


def store_key(secret: bytes) -> bytes:
    """The key of the run's secret for the rendezvous store: it seals node 0's answers only."""
    return derive_key(secret, "rendezvous store")


def run_key(skey: bytes, run: str, port: int) -> bytes:
    """The key that seals this run's values in the store (from the store key, the run id and the
    store's port)."""
    return derive_key(skey, f"run {run} port {port}")


def sealed(key: bytes, name: str, text: str) -> str:
    """`text` as stored under `name`: its MAC (over the name and the text), then the text."""
    return f"{_mac(key, name, text)}:{text}"


def unsealed(key: bytes | None, name: str, raw: bytes) -> str | None:
    """The text of a value `sealed` stored under `name`; None where it was not sealed with `key`
    (or there is no key yet)."""
    mac, sep, text = raw.decode("utf-8", "replace").partition(":")
    return text if key is not None and sep and hmac.compare_digest(mac, _mac(key, name, text)) else None


def body(raw: bytes) -> str:
    """What a value that does not open says: the text after its MAC, or all of it where it has none."""
    text = raw.decode("utf-8", "replace")
    return text.partition(":")[2] if ":" in text else text


def _mac(key: bytes, name: str, text: str) -> str:
    return hmac.new(key, name.encode() + b"\x00" + text.encode(), hashlib.sha256).hexdigest()


def printable(text: str, limit: int = 2000) -> str:
    """Text from the store as it may be shown: control characters escaped, bounded."""
    escaped = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return escaped[:limit] + ("..." if len(text) > limit or len(escaped) > limit else "")


def ask_name(node: int) -> str:
    return f"maestro/ask/{node}"


def answer_name(node: int) -> str:
    return f"maestro/answer/{node}"


DIFFERS = "differs"  # read_answer: an answer to this challenge that does not open (another secret)


def read_answer(skey: bytes, node: int, challenge: str, port: int, raw: bytes) -> str | None:
    """The run id in node 0's answer to `challenge`; None where it answered another challenge
    or is another store's (an earlier agent's, a replay, a relay: wait for this one's), DIFFERS
    where the answer names this challenge but does not open (node 0's secret differs, or another
    client of the store wrote it: the node then refuses to join, which any store client could
    always make it do)."""
    text = unsealed(skey, answer_name(node), raw)
    if text is None:
        return DIFFERS if body(raw).split(" ")[0] == challenge else None
    said, run, at = (text.split(" ") + ["", ""])[:3]
    return run if said == challenge and at == str(port) and NONCE.fullmatch(run) else None


class Answers:
    """Node 0: answers each agent's challenge with the run id, until `close`. A thread with a store
    connection of its own, one key per node (no counter: a store client could make it unreadable,
    and the store drops the connection of whoever then adds to it)."""

    def __init__(self, endpoint: tuple[str, int], nnodes: int, skey: bytes, run: str) -> None:
        self.endpoint, self.nnodes, self.skey, self.run = endpoint, nnodes, skey, run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="maestro-answers")
        self._thread.start()

    def _loop(self) -> None:
        """Never ends before `close` (found in review: one unexpected value ended it, and no agent
        was answered after): a failed call is tried again at the next poll."""
        import torch.distributed as dist

        store, answered, looked, said = None, {}, 0.0, False
        while not self._stop.is_set():
            try:
                if store is None:
                    store = dist.TCPStore(*self.endpoint, is_master=False, timeout=timedelta(seconds=STORE_S))
                every = time.monotonic() - looked >= REASK_S
                if every:  # what a store client may have overwritten meanwhile is written again
                    looked = time.monotonic()
                    store.set(NNODES, str(self.nnodes))
                for node in range(1, self.nnodes):
                    if every or node not in answered:
                        self._answer(store, node, answered)
            except Exception as exc:  # noqa: BLE001 (torch raises several types; the next poll tries again)
                store = None
                if not said and not self._stop.is_set():  # once: agents would only say node 0 did not answer
                    said = True
                    print(f"maestro: node 0 cannot use its rendezvous store at {self.endpoint[0]}:{self.endpoint[1]} "
                          f"to answer the other nodes ({brief(exc)}"
                          "); trying again", file=sys.stderr, flush=True)
            self._stop.wait(POLL_S)

    def _answer(self, store: Any, node: int, answered: dict[int, tuple[str, str]]) -> None:
        """Answer node `node`'s challenge, a new one, or again where the answer in the store is no
        longer this one's (found in review: overwritten, the agent waited out its timeout)."""
        if not store.check([ask_name(node)]):
            return
        challenge = store.get(ask_name(node)).decode("utf-8", "replace")
        if not NONCE.fullmatch(challenge):
            return
        said = answered.get(node)
        value = said[1] if said and said[0] == challenge else sealed(
            self.skey, answer_name(node), f"{challenge} {self.run} {self.endpoint[1]}")
        if said is None or said[0] != challenge or not store.check([answer_name(node)]) or \
                store.get(answer_name(node)).decode("utf-8", "replace") != value:
            store.set(answer_name(node), value)
            answered[node] = (challenge, value)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * POLL_S + 1)

