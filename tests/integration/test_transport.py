"""The transfer paths: one contract over TensorComm (gloo + ZeroMQ, real processes) and LocalComm.

The contract: every message arrives once, in the order sent per channel, with the same names,
dtypes, shapes and values (small tensors coalesced, big ones sent as they are, missing entries
as None); sending and receiving at once on both sides does not deadlock; a slow pair does not
hold up another pair.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch.distributed as dist

from tests.integration.transport_peers import local_exchange, messages, peer_main, plain

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def run_world(world: int, plan, delay_s=None) -> dict[int, tuple]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=peer_main, args=(r, world, store.port, plan, delay_s or {}, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(world):
            rank, t, received, errors = results.get(timeout=90)
            out[rank] = (t, received, errors)
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def expected_from(src: int, dst: int) -> list:
    return [plain(items) for items in messages(seed=dst * 100 + src)]


def check_contract(received: dict[int, list], plan) -> None:
    for src, dst, kind in plan:
        got = [items for _, k, s, items in received[dst] if s == src and k == kind]
        assert got == expected_from(src, dst), f"{src}->{dst} {kind}"


def test_gloo_both_directions_at_once_match_local_comm():
    plan = [(0, 1, "fwd"), (1, 0, "bwd")]  # each side sends and receives concurrently
    out = run_world(2, plan)
    for _, _, errors in out.values():
        assert not errors, errors
    check_contract({r: received for r, (_, received, _) in out.items()}, plan)
    check_contract(local_exchange(plan), plan)


def test_a_slow_pair_does_not_block_another():
    # Rank 0 sends to 2 first, but rank 2 posts no receive for 4 s; rank 1 must not wait for it.
    plan = [(0, 2, "fwd"), (0, 1, "fwd")]
    out = run_world(3, plan, delay_s={2: 4.0})
    done_1, _, _ = out[1]
    done_2, _, _ = out[2]
    assert done_2 - done_1 > 2.0, "rank 1 finished only after the slow rank 2"
    check_contract({r: received for r, (_, received, _) in out.items() if r != 0}, plan)
