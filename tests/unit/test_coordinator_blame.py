"""Which failure the coordinator names when several ranks fail together (coordinator_io):
a peer that died without a word is the cause of a system error; a peer that died after
reporting an error of its own is collateral, so the first report stands; a stage's exception
reported meanwhile is the cause."""

from __future__ import annotations

import re
import types
from collections import deque

import pytest

from maestro_flow.errors import StageError, WorkerLost
from maestro_flow.runtime.coordinator_io import CoordinatorIO


class FakeRouter:
    def __init__(self, frames: list) -> None:
        self.frames = deque(frames)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.frames)

    def recv_multipart(self):
        return self.frames.popleft()


class FakeWorker:
    def __init__(self, rank: int, exitcode: int) -> None:
        self.rank, self.label = rank, f"rank {rank}"
        self.process = types.SimpleNamespace(exitcode=exitcode)

    def exit_description(self) -> str:
        return f"exited with code {self.process.exitcode}"


class Coordinator(CoordinatorIO):
    def __init__(self, dead: list[FakeWorker], reports: list[tuple[int, dict]], said_bye: set[int] = frozenset()
                 ) -> None:
        self.said_bye = set(said_bye)
        self.system_errors: dict[int, dict] = {}
        self.timeouts = types.SimpleNamespace(heartbeat_timeout_s=5.0)
        self.nodes = types.SimpleNamespace(multi=False)
        self.launcher = types.SimpleNamespace(dead=lambda: dead)
        self.router = FakeRouter(reports)
        self.placement = types.SimpleNamespace(who=lambda rank: ("student", rank - 1))
        self.training, self.awaited_step = True, 3
        self.pipeline = types.SimpleNamespace(steps=10)
        self.liveness = types.SimpleNamespace(last_done={})

    def _accept(self, frames):
        return frames  # the fake router's "frames" are already (rank, message)


def _error(kind: str) -> dict:
    return {"t": "error", "kind": kind, "step": 3, "phase": "forward", "traceback": f"a {kind} error"}


def test_a_peer_that_died_silently_is_the_cause() -> None:
    with pytest.raises(WorkerLost, match="rank 2 exited with code 1 before reporting any step done, while the run was "
                                         "at step 4 of 10$"):  # counted from 1, as the progress line counts
        Coordinator([FakeWorker(2, 1)], [(2, {"t": "heartbeat"})])._raise_dead_peer(exclude=1)


def test_workers_that_gave_a_stopped_coordinator_up_say_so() -> None:
    """Found in QA: node 0's process stopped (SIGSTOP) and continued said only that a worker
    "exited with code 5"; the worker had given its silent coordinator up, as it should."""
    from maestro_flow.runtime.launcher import GAVE_UP_EXIT, WorkerHandle

    worker = WorkerHandle(rank=2, section="student", replica=1,
                          process=types.SimpleNamespace(exitcode=GAVE_UP_EXIT, pid=77))
    coordinator = Coordinator([worker], [])
    coordinator.timeouts = types.SimpleNamespace(heartbeat_timeout_s=5.0, coordinator_timeout_s=60.0)
    said = "exited with code 5 (it heard nothing from the coordinator for MAESTRO_COORDINATOR_TIMEOUT_S)"
    with pytest.raises(WorkerLost, match=re.escape(said) + " before reporting any step done, while the run was at "
                                         "step 4 of 10$"):
        coordinator._raise_dead_peer(exclude=1)
    import time

    coordinator.stood_still = (58.4, time.monotonic() - 1.0)  # its own loop had not looked at its socket that long
    with pytest.raises(WorkerLost, match=re.escape(said) + ".*; this coordinator .* had just stood still for 58s "
                                         r"\(stopped by SIGSTOP or Ctrl-Z, or starved of CPU\).* the 60s its"):
        coordinator._raise_dead_peer(exclude=1)
    coordinator.stood_still = (58.4, time.monotonic() - 600.0)  # long before: not this death's cause
    with pytest.raises(WorkerLost, match=re.escape(said) + " before reporting any step done, while the run was at "
                                         "step 4 of 10$"):
        coordinator._raise_dead_peer(exclude=1)


def test_a_peer_that_reported_its_own_error_is_not_blamed() -> None:
    # Before: rank 2, which failed because rank 1 did, was named as the cause (WorkerLost).
    Coordinator([FakeWorker(1, 1), FakeWorker(2, 1)], [(2, _error("system"))])._raise_dead_peer(exclude=1)


def _on_two_nodes(coordinator: Coordinator, lost_rank: int) -> WorkerLost:
    """`coordinator` with node 1's agent reporting its worker `lost_rank` dead (by the store)."""
    lost = WorkerLost(f"worker rank {lost_rank} on node 1 exited with code 1")
    lost.rank = lost_rank
    coordinator.nodes = types.SimpleNamespace(multi=True)
    coordinator.node_of = {1: 0, 2: 1}
    coordinator._lost = lambda: lost
    coordinator.liveness = types.SimpleNamespace(last_done={}, lost_node=lambda now: None)
    return lost


def test_a_worker_of_another_node_is_named_by_its_own_report_not_its_exit() -> None:
    """Found in QA: node 1's worker reported a system error and exited; node 0 named its agent's
    note of the exit ("exited with code 1") and the traceback was in node 1's log alone. Its
    report stands, whether it was read before the note (_raise_dead_peer) or after (_tick)."""
    from maestro_flow.errors import SystemFailure

    first = Coordinator([], [])
    lost = _on_two_nodes(first, 2)
    first._raise_dead_peer(exclude=2)  # returns: the caller raises rank 2's own report
    late = Coordinator([], [(2, _error("system"))])
    _on_two_nodes(late, 2)
    with pytest.raises(SystemFailure, match=r"system error in section 'student' replica 1 \(rank 2, node 1\) during "
                                            r"forward at step 4:\na system error$"):
        late._raise_own_report(lost)
    silent = Coordinator([], [])  # no report of its own: the agent's note is the cause
    _on_two_nodes(silent, 2)
    silent._raise_own_report(lost)
    # Found in review: a peer of node 0 killed without a word is the cause there too, as it is
    # for a report read first (a WorkerLost, which --max-restarts restarts; a report is not).
    collateral = Coordinator([FakeWorker(1, -9)], [(2, _error("system"))])
    _on_two_nodes(collateral, 2)
    with pytest.raises(WorkerLost, match="rank 1 exited with code -9"):
        collateral._raise_own_report(lost)


def test_a_stage_error_reported_meanwhile_is_the_cause() -> None:
    with pytest.raises(StageError, match="a stage error"):
        Coordinator([FakeWorker(2, 1)], [(2, _error("stage"))])._raise_dead_peer(exclude=1)


def test_a_worker_that_left_normally_is_never_the_cause() -> None:
    Coordinator([FakeWorker(2, 0)], [], said_bye={2})._raise_dead_peer(exclude=1)


def test_a_worker_that_exited_with_code_0_without_saying_bye_is_the_cause() -> None:
    # Found in review: exit code 0 was taken for a normal exit, so os._exit(0) mid-step left the
    # peer whose all-reduce it broke to be blamed.
    with pytest.raises(WorkerLost, match="rank 2 exited with code 0"):
        Coordinator([FakeWorker(2, 0)], [])._raise_dead_peer(exclude=1)


def test_a_collectives_failure_inside_stage_code_is_not_the_stages_fault() -> None:
    """FSDP's hooks run collectives inside stage.forward: a peer's death shows there as a gloo
    error, which the worker reports as a system error (collateral), not as the stage's: the
    coordinator then blames the peer's own report (it named the survivor's stage). A stage's own
    error that merely names gloo or NCCL stays the stage's."""
    import torch

    from maestro_flow.runtime.executor_state import StageFault

    def fault(exc: BaseException) -> StageFault:
        try:
            raise exc
        except Exception:
            return StageFault("forward", 3, "Traceback ...")

    assert fault(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                              "[127.0.0.1]:12345")).collateral
    assert fault(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited")).collateral
    assert fault(torch.distributed.DistBackendError("a peer is gone")).collateral
    for own in (KeyError("NCCL_SOCKET_IFNAME"), FileNotFoundError("/data/configs/gloo/tokenizer.json"),
                ValueError("the NCCL-style fused kernel got 4 channels"), RuntimeError("shapes (2, 3) and (4,)")):
        assert not fault(own).collateral, own


def test_an_agent_names_a_worker_killed_by_a_signal_before_one_that_exited_with_an_error() -> None:
    """An agent writes one note for its node's dead workers: with one killed (the OOM killer) and
    one that exited after reporting an error (collateral, as likely), it named the lower rank, and
    node 0 took that one's report for the cause (not restarted) over the kill (restarted)."""
    from maestro_flow.runtime.agent import cause

    errored, killed, other = FakeWorker(1, 1), FakeWorker(2, -9), FakeWorker(3, 1)
    assert cause([errored, killed, other]) is killed
    assert cause([other, errored]) is errored
    assert cause([FakeWorker(4, -6), errored]) is errored  # SIGABRT: a watchdog's, as likely collateral
    with pytest.raises(WorkerLost, match="rank 2 exited with code -9"):  # node 0's own workers alike
        Coordinator([errored, killed], [])._raise_dead_peer(exclude=3)


def test_a_worker_that_cannot_be_reached_is_named_by_why() -> None:
    """A send to a worker whose connection is gone names why it is gone: its report (or a peer's),
    its death, or, on another node, its node's loss once the heartbeat timeout shows it. Found by
    CI: a worker of a killed node was awaited as if it could still report, and the run ended
    "timed out after 1.9s waiting for the error report of a worker that left" (the node's loss was
    named only when the heartbeat timeout came first)."""
    import zmq

    from maestro_flow.errors import SystemFailure

    gone = zmq.ZMQError(zmq.EHOSTUNREACH)
    remote = Coordinator([], [(1, {"t": "heartbeat"})])
    _on_two_nodes(remote, 2)
    remote._lost = lambda: None  # node 1's agent was killed with it: no note by the store
    looks = []
    node_lost = WorkerLost("node 1 (ranks 2) is lost: none of its workers sent anything for 3.1s")
    remote.liveness.lost_node = lambda now: node_lost if looks.append(now) or len(looks) > 3 else None
    with pytest.raises(WorkerLost) as raised:
        remote._unreachable(2, gone)
    assert raised.value is node_lost and len(looks) == 4
    assert "exited with code -9" in str(Coordinator([FakeWorker(2, -9)], [])._unreachable(2, gone))
    reported = Coordinator([FakeWorker(2, 1)], [(2, _error("system"))])._unreachable(2, gone)
    assert isinstance(reported, SystemFailure) and "a system error" in str(reported), reported
    with pytest.raises(StageError, match="a stage error"):
        Coordinator([], [(3, _error("stage"))])._unreachable(2, gone)
    # Found in review: of two ranks that reported and died, the second was named (collateral).
    both = Coordinator([FakeWorker(1, 1), FakeWorker(2, 1)], [(1, _error("system")), (2, _error("system"))])
    first = both._unreachable(1, gone)
    assert isinstance(first, SystemFailure) and "(rank 1)" in str(first), first
    unknown = Coordinator([], [])._unreachable(2, gone)  # after a grace of 1s on one node
    assert str(unknown).startswith("cannot reach section 'student' replica 1 (rank 2): "), unknown
