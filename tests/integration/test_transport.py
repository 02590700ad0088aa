"""The transfer paths: one contract over TensorComm (gloo + ZeroMQ, and shared-memory slots +
ZeroMQ, real processes) and LocalComm.

The contract: every message arrives once, in the order sent per channel, with the same names,
dtypes, shapes and values (small tensors coalesced, big ones sent as they are, missing entries
as None); sending and receiving at once on both sides does not deadlock; a slow pair does not
hold up another pair. Shared memory besides: slots are reused once the receiver drops its views,
a receiver holding every message never blocks its sender, no slot file outlives its sender, and
where no slot can be made ("shm-full") the channel falls back on gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch.distributed as dist

from tests.integration.transport_peers import local_exchange, messages, peer_main, plain

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


PATHS = ("gloo", "shm", "shm-full")


def spawn(world: int, target, make_args) -> dict[int, tuple]:
    """`target(*make_args(rank, port, results))` in `world` spawned processes, each putting
    (rank, *result) on `results` once: {rank: result}."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=make_args(r, store.port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = {rank: tuple(rest) for rank, *rest in (results.get(timeout=90) for _ in range(world))}
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def run_world(world: int, plan, delay_s=None, path: str = "gloo", hold: bool = False,
              pace_s: float = 0.0) -> dict[int, tuple]:
    """peer_main on every rank: {rank: (time, received, errors, slots)}."""
    return spawn(world, peer_main, lambda r, port, results: (r, world, port, plan, delay_s or {}, results, path,
                                                             hold, pace_s))


def expected_from(src: int, dst: int) -> list:
    return [plain(items) for items in messages(seed=dst * 100 + src)]


def check_contract(received: dict[int, list], plan) -> None:
    for src, dst, kind in plan:
        got = [items for _, k, s, items in received[dst] if s == src and k == kind]
        assert got == expected_from(src, dst), f"{src}->{dst} {kind}"


@pytest.mark.parametrize("path", PATHS)
def test_both_directions_at_once_match_local_comm(path):
    plan = [(0, 1, "fwd"), (1, 0, "bwd")]  # each side sends and receives concurrently
    out = run_world(2, plan, path=path)
    for _, _, errors, _ in out.values():
        assert not errors, errors
    check_contract({r: received for r, (_, received, _, _) in out.items()}, plan)
    check_contract(local_exchange(plan), plan)
    if path == "shm":  # a burst: at most a slot per message (releases come back a few ms later)
        assert all(1 <= slots <= len(messages(0)) for *_, slots in out.values()), out


def test_shared_memory_slots_are_reused():
    """Messages spaced out, each dropped on arrival: its slot comes back before the next send,
    so one slot (two: the messages with a 1.2 MB tensor need a larger one) serves them all."""
    plan = [(0, 1, "fwd")]
    out = run_world(2, plan, path="shm", pace_s=0.1)
    check_contract({1: out[1][1]}, plan)
    assert 1 <= out[0][3] <= 2, out[0][3]


@pytest.mark.parametrize("path", PATHS)
def test_a_slow_pair_does_not_block_another(path):
    # Rank 0 sends to 2 first, but rank 2 posts no receive for 4 s; rank 1 must not wait for it.
    plan = [(0, 2, "fwd"), (0, 1, "fwd")]
    out = run_world(3, plan, delay_s={2: 4.0}, path=path)
    done_1, _, _, _ = out[1]
    done_2, _, _, _ = out[2]
    assert done_2 - done_1 > 2.0, "rank 1 finished only after the slow rank 2"
    check_contract({r: received for r, (_, received, _, _) in out.items() if r != 0}, plan)


def test_a_receiver_holding_every_message_never_blocks_its_sender():
    """Shared memory: the receiver keeps every view until all arrived (as an LLM keeps a step's
    image embeddings until its backward); the sender makes a slot per message instead of
    waiting, and nothing is left in /dev/shm afterwards."""
    plan = [(0, 1, "fwd")]
    out = run_world(2, plan, path="shm", hold=True)
    assert not out[0][2] and not out[1][2]
    check_contract({1: out[1][1]}, plan)
    assert out[0][3] == len(messages(0))  # one slot per held message, then all given back
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("maestro-transport-test-")]


def test_a_tensor_parallel_relay_carries_every_dtype_an_edge_does():
    """The relay broadcasts bytes: a typed gloo broadcast refused int16, uint16, uint32 and float8,
    which isend carries (a tp > 1 consumer of such an output failed where tp = 1 worked)."""
    from tests.integration.transport_peers import relay_main

    out = spawn(2, relay_main, lambda r, port, results: (r, port, results))
    assert not isinstance(out[1][0], str), out[1][0]
    assert out[1][0] == out[0][1]  # what the member got is, byte for byte, what the leader sent


def test_a_channel_that_falls_back_on_gloo_gives_its_shared_memory_back():
    """A channel whose next slot cannot be made goes through gloo from then on; its slots in use
    at that moment are removed by the sender once given back, and the receiver unmaps them
    (before, the sender kept them until it closed: it looked at releases only when sending
    through a slot, and the receiver swept only while it held a slot's views)."""
    from tests.integration.transport_peers import fallback_main

    out = spawn(2, fallback_main, lambda r, port, results: (r, port, results))
    assert out[0] == (3, 0), out  # three slots made, none left
    assert out[1][1] == 0, out  # none still mapped by the receiver
