"""The coordinator's liveness bookkeeping (runtime/liveness.py): silent workers, lost nodes and
hangs are named from heartbeats alone (pure: the clock is passed in)."""

from __future__ import annotations

from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.liveness import Liveness
from maestro_flow.timeouts import Timeouts

PLACEMENT = Placement.build(["teacher", "student"], {"teacher": 1, "student": 2})  # ranks 0 | 1 2


def liveness(node_of=None, **timeouts) -> Liveness:
    return Liveness(PLACEMENT, node_of or {0: 0, 1: 0, 2: 0}, Timeouts(**timeouts), label=lambda r: f"rank {r}")


def test_the_stuck_replica_is_named_not_the_ones_waiting_on_it():
    live = liveness(hang_s=10.0)
    live.progress_at = 0.0
    live.note_status(2, {"state": "forward", "step": 2, "mb": 0}, now=1.0)
    live.note_status(1, {"state": "reducing gradients", "step": 2, "mb": None}, now=0.9)  # seen earlier
    live.note_status(0, {"state": "idle (step done)", "step": 2, "mb": None}, now=0.5)
    live.done(0, 2, now=0.5)
    assert live.hang(2, now=10.0) is None
    err = str(live.hang(2, now=12.0))
    assert err.startswith("rank 2 is hung: in forward of step 3, micro-batch 0 for 11s")  # counted from 1
    assert "no replica finished step 3 for" in err
    assert "waiting on it: rank 1" in err and "MAESTRO_HANG_S" in err


def test_the_hang_timeout_adapts_to_the_slowest_step():
    live = liveness(hang_s=10.0)
    live.step_time(1.0)
    assert live.hang_timeout() == 10.0
    live.step_time(7.0)
    assert live.hang_timeout() == 35.0


def test_a_silent_node_is_named_with_its_ranks():
    live = liveness({0: 0, 1: 1, 2: 1}, heartbeat_timeout_s=3.0)
    for r in range(3):
        live.seen(r, now=0.0)
    live.seen(0, now=5.0)
    assert str(live.silent(now=5.0)).startswith("node 1 (ranks 1, 2) is lost: none of its workers sent anything for 5.0s")
    live.seen(1, now=5.0)  # one of its workers still talks: that is one silent worker, not a lost node
    assert str(live.silent(now=5.0)).startswith("worker rank 2 sent nothing for 5.0s")
    assert str(live.silent(now=5.0)).endswith("if it is just busy)")
    live.note_status(2, {"state": "forward", "step": 8, "mb": 1}, now=0.0)  # found in QA: no step named
    assert str(live.silent(now=5.0)).endswith("; it was last in forward of step 9, micro-batch 1")


def test_time_the_coordinator_was_away_is_not_its_workers_silence():
    # CI caught it: a coordinator paused for 5s (SIGSTOP) read no heartbeat yet on waking (they
    # were still in the kernel's buffers) and named a live worker silent.
    live = liveness(heartbeat_timeout_s=2.0, hang_s=3.0)
    for r in range(3):
        live.seen(r, now=0.0)
    live.progress_at = 0.0
    live.away(5.0)
    assert live.silent(now=5.5) is None and live.hang(0, now=5.5) is None
    assert str(live.silent(now=7.5)).startswith("worker rank 0 sent nothing for 2.5s")


def test_a_worker_that_said_bye_is_not_judged():
    # Reproduced before: a frozen teacher said bye at --save-dir shutdown while the student took
    # longer than the heartbeat timeout to write its weights; the teacher was then named silent
    # and the student stopped in the middle of its write.
    live = liveness({0: 0, 1: 1, 2: 1}, heartbeat_timeout_s=3.0)
    for r in range(3):
        live.seen(r, now=0.0)
        live.note_status(r, {"state": "idle (step done)", "step": 4, "mb": None}, now=0.0)
    live.forget(0)
    live.seen(1, now=10.0)
    assert str(live.silent(now=10.0)).startswith("worker rank 2 sent nothing")
    live.forget(2)
    assert live.silent(now=10.0) is None
    live.forget(1)  # every worker of node 1 left: not a lost node
    assert live.silent(now=100.0) is None and 0 not in live.status


def test_a_worker_is_judged_from_its_init_not_its_hello():
    # Reproduced before: a worker sends nothing between its hello and its init (which goes out once
    # every rank said hello), so with another node's workers starting more than the heartbeat
    # timeout later, a healthy worker of node 0 was named silent instead of the missing node.
    from types import SimpleNamespace

    from maestro_flow.protocol.auth import DropLog, Opener, Sealer, derive_key
    from maestro_flow.protocol.messages import PROTOCOL_VERSION, make
    from maestro_flow.runtime.coordinator_io import CoordinatorIO
    from maestro_flow.transport import zmq_link

    key = derive_key(b"secret" * 4, "session")
    io = CoordinatorIO()
    io.placement, io.node_of, io.nodes = PLACEMENT, {0: 0, 1: 0, 2: 0}, SimpleNamespace(multi=False)
    io.liveness = live = liveness(heartbeat_timeout_s=3.0)
    io.opener, io.drops = Opener(key, "coordinator", zmq_link.CONTROL_MAX_BYTES), DropLog("test")
    io.identity_rank, io.rank_identity, io.sealers, io.key = {}, {}, {}, key
    worker = Sealer(key, "rank0", "coordinator")

    def frame(msg: dict) -> list[bytes]:
        return [b"conn0", worker.seal(zmq_link.encode(msg))]

    hello = make("hello", version=PROTOCOL_VERSION, rank=0, pid=1, data_addr="tcp://127.0.0.1:1")
    assert io._accept(frame(hello)) == (0, hello)
    assert 0 not in live.last_seen and live.silent(now=1e9) is None
    beat = make("heartbeat", rank=0)
    assert io._accept(frame(beat)) == (0, beat)
    assert 0 in live.last_seen


def test_the_hang_clock_starts_again_when_training_goes_on_after_a_checkpoint():
    live = liveness(hang_s=4.0)
    live.done(0, 1, now=0.0)
    live.progress(now=25.0)  # the workers saved a checkpoint for 25s: no step could finish meanwhile
    assert live.hang(2, now=28.0) is None
    assert "is hung" in str(live.hang(2, now=30.0))  # a worker that hangs after it is still caught
