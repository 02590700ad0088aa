"""runtime/cpus.py: where the coordinator runs under --pin-cpus (off the cores of the section a
step was busiest in, on those of the sections with time to spare; back on all its cores after),
and where the busiest section's workers run their I/O threads (the spare cores, named in their plans)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.cpus import CoordinatorCores, move_threads, near_busiest, pinned, say_unmoved, spare_cores


def test_spare_cores_are_those_of_the_sections_well_below_the_busiest():
    one_each = {"vision": {0}, "llm": {1}}
    assert spare_cores({"vision": 0.015, "llm": 0.040}, one_each) == (0,)  # the VLM: the LLM is critical
    assert spare_cores({"vision": 0.040, "llm": 0.015}, one_each) == (1,)
    assert spare_cores({"vision": 0.039, "llm": 0.040}, one_each) == ()  # balanced: none to spare
    assert spare_cores({"vision": 0.0, "llm": 0.0}, one_each) == ()
    # Two LLM replicas on cores 1 and 2, both near the busiest (per replica): the encoder's core.
    assert spare_cores({"vision": 0.01, "llm": 0.04}, {"vision": {0}, "llm": {1, 2}}) == (0,)
    # More workers than cores: every worker may run on every core, so none is spare.
    assert spare_cores({"a": 0.01, "b": 0.04}, {"a": {0, 1}, "b": {0, 1}}) == ()
    # The busiest section has no pinned cores here (a GPU section, or another node's): the CPU one's are spare.
    assert spare_cores({"gpu": 0.05, "cpu": 0.01}, {"gpu": set(), "cpu": {0, 1}}) == (0, 1)
    # Hysteresis: at 85% of the busiest, a section is spare unless it was near the busiest the step before.
    assert spare_cores({"vision": 0.034, "llm": 0.040}, one_each) == (0,)
    assert spare_cores({"vision": 0.034, "llm": 0.040}, one_each, stay={"vision"}) == ()
    assert near_busiest({"vision": 0.034, "llm": 0.040}, stay={"vision"}) == {"vision", "llm"}
    assert near_busiest({"vision": 0.031, "llm": 0.040}, stay={"vision"}) == {"llm"}  # under 80%: spare again


def test_the_coordinators_choice_skips_the_first_step_and_does_not_flap_about_the_line():
    """Busy times per replica hovering about 90% of the busiest move nothing once chosen; the first
    step (one-time costs) is not used; without pinned workers nothing is chosen."""
    cores = CoordinatorCores({"enc": {0}, "llm": {1}}, {"enc": 1, "llm": 1}, pinned=(0, 1))
    cores.everywhere = cores.now = (0, 1)
    moves = []
    cores._place = lambda chosen: moves.append(chosen)
    step = lambda enc, llm: cores.step({"enc": {"busy_s": enc}, "llm": {"busy_s": llm}})  # noqa: E731
    step(0.04, 0.01)  # the first step: the encoder looks busiest (its warm-up), and nothing is chosen
    assert moves == [] and cores.spare == () and cores.io_cpus("enc", 0) is None
    for enc in (0.02, 0.035, 0.033, 0.0355, 0.034):  # 80-90% of the busiest, from below: its core stays spare
        step(enc, 0.04)
    assert moves == [(0,)] * 5 and cores.io_cpus("llm", 1) == [0]
    step(0.038, 0.04)  # past it: balanced
    for enc in (0.034, 0.035, 0.033):  # 80-90% again, from above: still balanced, nowhere to move
        step(enc, 0.04)
    assert moves[5:] == [(0, 1)] * 4 and cores.io_cpus("llm", 1) is None
    step(0.031, 0.04)  # well under it: spare again
    assert moves[-1] == (0,) and cores.busiest == {"llm"}
    step(0.0, 0.0)  # a step with no work: nothing changes (nor the hysteresis' memory)
    assert len(moves) == 10 and cores.near == {"llm"} and cores.io_cpus("llm", 1) == [0]
    unpinned = CoordinatorCores({"enc": set(), "llm": set()}, {"enc": 1, "llm": 1})
    unpinned._place = lambda chosen: moves.append(chosen)
    for _ in range(3):
        unpinned.step({"enc": {"busy_s": 0.01}, "llm": {"busy_s": 0.04}})
    assert len(moves) == 10 and unpinned.spare == ()


def test_a_thread_that_cannot_be_moved_is_said_once():
    nowhere = [(os.cpu_count() or 1) + 64]  # a core this machine does not have: the move fails, nothing changes
    before = os.sched_getaffinity(0)
    failed = move_threads(nowhere, lambda tid, name: tid == threading.get_native_id())
    assert len(failed) == 1 and failed[0].startswith(f"thread {threading.get_native_id()}: ")
    assert os.sched_getaffinity(0) == before
    told = []
    said = say_unmoved(failed, nowhere, False, told.append)
    assert said and say_unmoved(failed, nowhere, said, told.append)  # said before: not again
    assert not say_unmoved([], nowhere, False, told.append)
    assert len(told) == 1 and "could not move 1 thread(s)" in told[0] and str(nowhere) in told[0]


def test_each_sections_cores_come_from_its_pinned_workers_tensor_parallel_members_too():
    """A vision worker, an LLM of 2 replicas x tp 2 and a GPU teacher on 6 cores (`pinned`: 5 CPU
    workers of 6 cores: blocks of one or two): each section's cores, busy per replica."""
    placement = Placement.build(["vision", "llm", "teacher"], {"vision": 1, "llm": 2, "teacher": 1},
                                {"teacher": ["cuda:0"]}, tp={"llm": 2})
    boots = pinned([r for r in range(6) if placement.devices[r] == "cpu"], range(6))
    cores = CoordinatorCores.of(boots, placement)
    assert cores.cores_of == {"vision": {0}, "llm": {1, 2, 3, 4, 5}, "teacher": set()}
    assert cores.replicas == {"vision": 1, "llm": 2, "teacher": 1}
    assert CoordinatorCores.of({}, placement).cores_of == {"vision": set(), "llm": set(), "teacher": set()}
    # The LLM busiest: its pinned workers' message threads go to the vision worker's core; the
    # teacher's GPU worker and a worker of another node (not in `pinned`: rank 4 here) keep theirs.
    cores = CoordinatorCores.of({r: boot for r, boot in boots.items() if r != 4}, placement)
    cores.everywhere = cores.now = tuple(range(6))  # (no move: only what it would choose)
    cores._place = lambda chosen: None
    for _ in range(2):  # (the first step chooses nothing)
        cores.step({"vision": {"busy_s": 0.01}, "llm": {"busy_s": 0.08}, "teacher": {"busy_s": 0.02}})
    assert cores.spare == (0,) and cores.busiest == {"llm"}
    assert [cores.io_cpus("llm", r) for r in (1, 2, 3, 4)] == [[0], [0], [0], None]
    assert cores.io_cpus("vision", 0) is None and cores.io_cpus("teacher", 5) is None


CHILD = textwrap.dedent("""
    import json, os, threading
    from maestro_flow.runtime.cpus import CoordinatorCores

    def threads():
        return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}

    everywhere = sorted(os.sched_getaffinity(0))
    a, b = everywhere[0], everywhere[1]
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)
    early.start()
    cores = CoordinatorCores({"enc": {a}, "llm": {b}}, {"enc": 1, "llm": 1}, pinned=(0, 1))  # ranks 0, 1
    out = {"everywhere": everywhere}
    cores.step({"enc": {"busy_s": 0.04}, "llm": {"busy_s": 0.01}})  # the first step moves nothing
    out["first"] = threads()
    cores.step({"enc": {"busy_s": 0.01}, "llm": {"busy_s": 0.04}})
    out["llm_critical"] = threads()
    out["io"] = [cores.io_cpus("llm", 1), cores.io_cpus("enc", 0)]
    late = threading.Thread(target=stop.wait, daemon=True)
    late.start()
    out["late"] = sorted(os.sched_getaffinity(late.native_id))
    cores.step({"enc": {"busy_s": 0.04}, "llm": {"busy_s": 0.01}})
    out["enc_critical"] = threads()
    cores.step({"enc": {"busy_s": 0.04}, "llm": {"busy_s": 0.04}})
    out["balanced"] = threads()
    out["io_balanced"] = [cores.io_cpus("llm", 1), cores.io_cpus("enc", 0)]
    cores.step({"enc": {"busy_s": 0.01}, "llm": {"busy_s": 0.04}})
    cores.restore()
    out["restored"] = threads()
    stop.set()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 cores")
@pytest.mark.timeout(60)
def test_the_coordinator_moves_every_thread_to_the_spare_cores_and_back():
    """In a process of its own (the test process keeps its cores): every thread, and one started
    after the move, follows the spare cores; a balanced step and restore() give them all back."""
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=50,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    a, b = out["everywhere"][:2]
    assert set(map(tuple, out["first"].values())) == {tuple(out["everywhere"])}
    assert len(out["llm_critical"]) >= 2 and set(map(tuple, out["llm_critical"].values())) == {(a,)}
    assert out["late"] == [a]
    assert out["io"] == [[a], None] and out["io_balanced"] == [None, None]  # the LLM's I/O threads go to a
    assert set(map(tuple, out["enc_critical"].values())) == {(b,)}
    for key in ("balanced", "restored"):
        assert set(map(tuple, out[key].values())) == {tuple(out["everywhere"])}


IO_CHILD = textwrap.dedent("""
    import json, os, threading, time
    import zmq
    from maestro_flow.runtime.cpus import IoThreads

    def where():
        out = {}
        for t in os.listdir("/proc/self/task"):
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            kind = ("ZMQbg" if name.startswith("ZMQbg") else "main" if int(t) == threading.get_native_id()
                    else "python" if int(t) in python else "other")
            out.setdefault(kind, set()).add(tuple(sorted(os.sched_getaffinity(int(t)))))
        return {k: sorted(v) for k, v in out.items()}

    own = sorted(os.sched_getaffinity(0))
    ctx = zmq.Context()
    ctx.socket(zmq.PUSH).bind("inproc://x")  # ZeroMQ's I/O threads start with the context's first socket
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="control", daemon=True)
    worker.start()
    stages = threading.Thread(target=stop.wait, name="a-stage-pool", daemon=True)  # not the runtime's: stays
    stages.start()
    python = {worker.native_id}
    io = IoThreads()
    for _ in range(100):  # ZeroMQ names its threads as they start
        if any(open(f"/proc/self/task/{t}/comm").read().startswith("ZMQbg/IO") for t in os.listdir("/proc/self/task")):
            break
        time.sleep(0.01)
    io.place([own[0]])
    out = {"own": own, "moved": where()}
    io.place(None)
    out["back"] = where()
    stop.set()
    ctx.destroy(linger=0)
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 cores")
@pytest.mark.timeout(60)
def test_a_workers_io_threads_move_to_the_cores_its_plan_names_and_its_compute_thread_stays():
    done = subprocess.run([sys.executable, "-c", IO_CHILD], capture_output=True, text=True, timeout=50,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    own, first = out["own"], [out["own"][0]]
    assert out["moved"]["main"] == [own] and out["moved"]["python"] == [first]
    assert out["moved"]["ZMQbg"] == [first] and out["moved"]["other"] == [own]  # the stage's thread stays
    assert all(v == [own] for v in out["back"].values())
