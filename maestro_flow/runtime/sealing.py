"""Values in the rendezvous store that a node can trust: sealed under the run's secret, bound to one run.

Runs in `maestro run` on every node of a multi-node run (runtime/agent.py lists the keys). The
store (a torch TCPStore) is not authenticated: anyone who can reach it may write any key. So
node 0's values and the agents' notes are sealed, an HMAC over the key's name and the value
(`sealed`, `unsealed`), and a node acts on nothing that does not open.

A seal alone would let a value of an earlier run be replayed into a later one with the same
secret (found in review: an old `maestro/job` "done" ended a new run's agents; an old attempt
pointer and record made them start workers for an attempt long gone). So every value is sealed
under a key of this run (`run_key`): node 0 draws a fresh run id at its start, and an agent
learns it only by asking, with a fresh challenge of its own, which node 0 answers sealed under
the secret's store key together with that challenge (`Answers`, `read_answer`). A replayed answer
carries another challenge, and a value of another run does not open under this run's key.

    maestro/ask/<node>     the challenge of that node's agent (a fresh nonce); then it raises
    maestro/asked          a counter, so node 0 looks at the asks only when one changed
    maestro/answer/<node>  node 0's answer: "<challenge> <run id>", sealed under the store key
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from datetime import timedelta

from maestro_flow.protocol.auth import derive_key

NONCE = re.compile(r"[0-9a-f]{1,64}")  # a session, run id or challenge (auth.new_nonce)
ASKED = "maestro/asked"
POLL_S = 0.2


def store_key(secret: bytes) -> bytes:
    """The key of the run's secret for the rendezvous store: it seals node 0's answers only."""
    return derive_key(secret, "rendezvous store")


def run_key(skey: bytes, run: str) -> bytes:
    """The key that seals this run's values in the store (from the store key and the run id)."""
    return derive_key(skey, f"run {run}")


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


def read_answer(skey: bytes, node: int, challenge: str, raw: bytes) -> str | None:
    """The run id in node 0's answer to `challenge`; None where it answered another challenge
    (an earlier agent's, or a replay: wait for this one's), DIFFERS where the answer names this
    challenge but does not open (node 0's secret differs, or another client of the store wrote it)."""
    text = unsealed(skey, answer_name(node), raw)
    if text is None:
        return DIFFERS if body(raw).split(" ")[0] == challenge else None
    said, _, run = text.partition(" ")
    return run if said == challenge and NONCE.fullmatch(run) else None


class Answers:
    """Node 0: answers each agent's challenge with the run id, until `close`. A thread with a store
    connection of its own; it reads the asks only when the counter moved, one key per node."""

    def __init__(self, endpoint: tuple[str, int], nnodes: int, skey: bytes, run: str, timeout_s: float) -> None:
        self.endpoint, self.nnodes, self.skey, self.run = endpoint, nnodes, skey, run
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="maestro-answers")
        self._thread.start()

    def _loop(self) -> None:
        import torch.distributed as dist

        try:
            store = dist.TCPStore(*self.endpoint, is_master=False, timeout=timedelta(seconds=self.timeout_s))
            seen, answered = None, {}
            while not self._stop.is_set():
                asked = store.add(ASKED, 0)
                if asked != seen:
                    seen = asked
                    for node in range(1, self.nnodes):
                        if not store.check([ask_name(node)]):
                            continue
                        challenge = store.get(ask_name(node)).decode("utf-8", "replace")
                        if NONCE.fullmatch(challenge) and answered.get(node) != challenge:
                            store.set(answer_name(node), sealed(self.skey, answer_name(node),
                                                                f"{challenge} {self.run}"))
                            answered[node] = challenge
                self._stop.wait(POLL_S)
        except Exception:  # noqa: BLE001 (the store is this process's own: it fails only as the run ends)
            return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * POLL_S + 1)

