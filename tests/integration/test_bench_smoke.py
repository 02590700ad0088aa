"""Every benchmark in tools/bench/ runs at its --tiny size and returns sane numbers.

Real processes on loopback (spawned ranks, and the distill pipeline in section mode), so these
are integration tests; each is bounded by a timeout and checks that no child process is left.
The numbers are not judged against the goals here (a noisy CI machine would make that flaky);
tools/bench/RESULTS.md records full-size runs.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os

import pytest

from tools.bench import (
    checkpoint_cost,
    control_overhead,
    cuda_ipc,
    mixed_precision,
    p2p_bandwidth,
    planning_time,
    section_memory,
    teacher_memory,
    teacher_throughput,
    vlm_schedules,
    wavefront_sim,
)
from tools.bench.common import REPO_ROOT, turns

pytestmark = pytest.mark.integration

DEMO_DIR = os.path.join(REPO_ROOT, "data", "demo")


@pytest.fixture(scope="module")
def demo_data():
    """The benchmarks run the demo pipelines on the demo data (data/demo, git-ignored): build
    what is missing, as `maestro data demo` would."""
    from loaders.demo import build_image_demo, build_text_demo

    if not os.path.exists(os.path.join(DEMO_DIR, "text.arrow")):
        build_text_demo(DEMO_DIR)
    if not os.path.exists(os.path.join(DEMO_DIR, "vlm.arrow")):
        build_image_demo(DEMO_DIR)
    return DEMO_DIR


needs_demo_data = pytest.mark.usefixtures("demo_data")


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(autouse=True)
def no_leftover_children(monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # the pipelines name their data relative to the repository root
    yield
    assert mp.active_children() == [], "a benchmark left child processes running"


@pytest.mark.timeout(60)
def test_alternating_benchmarks_reverse_their_order_every_other_round():
    """Going first (a cold cache, a host speeding up or slowing down) does not always fall on the
    same variant: every one of them ran first in every round before."""
    assert [turns(("a", "b", "c"), r) for r in range(3)] == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]


@pytest.mark.timeout(60)
def test_pipeline_benchmarks_refuse_runs_with_no_step_to_measure(capsys):
    """Found in QA: --steps 1 (not more than the warm-up steps left out) ran a whole round, then
    failed on the median of no steps; --rounds 0 and --steps 0 meant the defaults."""
    from tools.bench.common import pipeline_bench_args

    def parse(*argv):
        return pipeline_bench_args(list(argv), "b", "doc", rounds=3, steps=30, warmup=6, tiny_steps=3)[1:4]

    assert parse() == (3, 30, 6) and parse("--tiny") == (1, 3, 1) and parse("--steps", "7") == (3, 7, 6)
    for argv, why in ((("--steps", "6"), "--steps (6) must be more than the --warmup-steps (6)"),
                      (("--tiny", "--steps", "1"), "--steps (1) must be more than the --warmup-steps (1)"),
                      (("--steps", "0"), "--steps (0) must be more"), (("--rounds", "0"), "--rounds must be at least 1"),
                      (("--warmup-steps", "-1"), "--warmup-steps must be 0 or more")):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert why in capsys.readouterr().err, argv


def test_p2p_bandwidth_tiny():
    out = p2p_bandwidth.main(["--tiny"])
    cases = out["cases"]
    assert [(c["kind"], c["msg_bytes"]) for c in cases] == [("one", 64 * 1024), ("one", 1 << 20),
                                                            ("many", 64 * 16 * 1024)]
    for c in cases:
        for key in ("raw_gibps", "raw_fresh_gibps", "runtime_gibps", "ratio", "ratio_q1", "ratio_q3"):
            assert positive(c[key]), (key, c)
        assert c["ratio_q1"] <= c["ratio"] <= c["ratio_q3"]
        assert c["reps"] == out["config"]["reps"]
        for key in ("shm_gibps", "memcpy_gibps", "shm_over_memcpy", "shm_over_raw"):  # the same-host path
            assert positive(c[key]), (key, c)
    assert positive(out["min_ratio_from_1mib"]) and positive(out["min_shm_over_memcpy_from_1mib"])


@pytest.mark.timeout(240)
def test_cuda_ipc_tiny():
    """Measures where CUDA is (one GPU is enough); elsewhere it says it skipped, and returns so."""
    import torch

    out = cuda_ipc.main(["--tiny"])
    if not torch.cuda.is_available():
        assert out == {"skipped": "no CUDA device"}
        return
    (case,) = out["cases"]
    assert min(case["ipc_gibps"], case["ipc_host_gibps"], case["copy_gibps"], case["staged_gibps"]) > 0
    assert case["ipc_send_us"] > 0 and case["ipc_host_first_us"] > 0 and case["ipc_device_us"] >= 0
    assert not mp.active_children()


@pytest.mark.timeout(30)
def test_cuda_ipc_profile_table_is_in_microseconds_per_send():
    """--profile's table (what the sender's time per message is spent on): own and cumulative
    time per send in µs, calls per send, the heaviest own time first."""
    import cProfile
    import time

    def heavy():
        time.sleep(0.002)

    def light():
        return sum(range(10))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(4):
        heavy()
        light()
    prof.disable()
    lines = cuda_ipc._top(prof, sends=4).splitlines()
    assert lines[0].startswith("4 sends; µs per send")
    first = lines[1].split()
    assert "sleep" in lines[1] and float(first[0]) >= 2000 and float(first[2]) == 1.0
    assert any("light" in line for line in lines[2:])


@pytest.mark.timeout(30)
def test_cuda_ipc_summary_from_stamps(capsys):
    """Without a GPU the benchmark cannot run; its arithmetic and report can: synthetic stamps of
    known bursts (1 GiB in one second for the copy; IPC bursts with known parts) give back the
    bandwidths, ratios and where the time went."""
    from tools.bench.common import GiB

    sizes, warmup, reps = (GiB // 4,), 1, 2
    schedule = cuda_ipc.schedule_for(len(sizes), reps, warmup)
    assert len(schedule) == (warmup + reps) * len(cuda_ipc.MODES)
    send, recv, clock = [], [], 0.0
    for _rep, _i, mode in schedule:  # 4 messages per burst
        seconds = {"copy": 1.0, "ipc": 2.0, "ipc-host": 1.25, "staged": 8.0}[mode]
        send += [clock, clock + (seconds if mode == "copy" else 0.4)]
        if mode != "copy":
            recv += [clock + 0.1, clock + 0.5, clock + seconds]  # first, last delivery, end
        clock += 10.0
    out = cuda_ipc.summarize(sizes, schedule, warmup, {"stamps": send, "n_msgs": {sizes[0]: 4}, "slots_made": 4},
                             {"stamps": recv})
    (case,) = out["cases"]
    assert case["copy_gibps"] == pytest.approx(1.0) and case["staged_gibps"] == pytest.approx(0.125)
    assert case["ipc_over_copy"] == pytest.approx(0.5) and case["ipc_host_over_copy"] == pytest.approx(0.8)
    assert case["ipc_over_staged"] == pytest.approx(4.0)
    assert case["ipc_send_us"] == pytest.approx(0.1e6) and case["ipc_first_us"] == pytest.approx(0.1e6)
    assert case["ipc_behind_us"] == pytest.approx(0.1e6) and case["ipc_device_us"] == pytest.approx(1.5e6)
    cuda_ipc.report(out, "a test device", reps)
    assert out["goal_met"] is True  # judged on the better wait (host: 0.8)
    text = capsys.readouterr().out
    assert "a test device" in text and "receiver waits on" in text and "met" in text


@pytest.mark.timeout(60)
def test_teacher_throughput_tiny():
    """The teacher as its worker runs it, micro-batches 1 and 4: throughput per size and its ratio."""
    out = teacher_throughput.main(["--tiny", "--device", "cpu"])
    rows = out["rows"]
    assert [r["micro_batch"] for r in rows] == [1, 4]
    assert rows[0]["throughput_vs_mb1"] == 1.0
    for r in rows:
        assert positive(r["samples_per_s"]) and math.isclose(r["tokens_per_s"], r["samples_per_s"] * out["seq_len"])


@needs_demo_data
@pytest.mark.timeout(90)
def test_control_overhead_tiny():
    out = control_overhead.main(["--tiny"])
    for name in ("tensors", "plan", "done"):
        m = out["micro"][name]
        assert m["bytes"] > 0
        for key in ("push_pull_us", "round_trip_us", "one_way_us"):
            assert positive(m[key]), (name, key, m)
    pipe = out["pipeline"]
    assert pipe["steps"] == 3
    assert positive(pipe["median_step_time_s"])
    # distill at global batch 16: teacher micro-batches of up to 8 (split where padding costs more
    # than a micro-batch), student 2 replicas, micro-batches of up to 2: what was counted ran.
    assert pipe["micro_batches_per_step"] == pipe["micro_batches_per_step_measured"] >= 2 + 2 * 4
    counts = pipe["messages_per_step"]
    # The students sum their loss denominators with their gradients: no loss/finalize round trip.
    assert counts["plan"] == counts["done"] == 3 and counts["loss"] == counts["finalize"] == 0
    assert counts["tensors"] >= 2  # every teacher micro-batch feeds at least one student replica
    for key in ("messages_per_micro_batch", "overhead_per_micro_batch_us", "overhead_per_step_us",
                "overhead_fraction_of_step"):
        assert positive(pipe[key]), key
    assert set(out["goals"]) == {"per_micro_batch_under_1ms", "under_2pct_of_step"}


@needs_demo_data
@pytest.mark.timeout(90)
def test_teacher_memory_tiny():
    out = teacher_memory.main(["--tiny"])
    assert [(r["global_batch"], r["steps"]) for r in out["runs"]] == [(8, 4), (16, 2)]  # 32 samples each
    for run in out["runs"]:
        for section in ("teacher", "student"):
            assert positive(run[section]["max_rss_mb"])
            assert run[section]["growth_second_half_mb"] >= 0
    assert [r["teacher"]["micro_batches_per_step"] for r in out["runs"]] == [1, 2]
    assert positive(out["teacher_ratio"]) and positive(out["ratios"]["student"])
    assert isinstance(out["goal_met"], bool)


@pytest.mark.timeout(60)
def test_wavefront_sim_tiny():
    out = wavefront_sim.main(["--tiny"])
    assert out["config"]["batch"] == 32 and len(out["config"]["seeds"]) == 2
    cases = out["cases"]
    assert len(cases) == len(wavefront_sim.LAYOUTS) * len(wavefront_sim.ENCODERS) * len(wavefront_sim.MIXES)
    for c in cases:
        for key in ("makespan_wavefront_s", "makespan_fifo_s", "lower_bound_s", "wavefront_over_fifo",
                    "worst_wavefront_over_fifo", "wavefront_over_bound", "fifo_over_bound"):
            assert positive(c[key]), (key, c["layout"], c["encoder"], c["mix"])
        for run in c["runs"]:  # no ordering beats the lower bound
            for schedule in ("wavefront", "fifo"):
                assert run["lower_bound_s"] <= run[schedule]["makespan_s"] * (1 + 1e-9), (schedule, run)
                assert 0 < run[schedule]["critical_busy_fraction"] <= 1 + 1e-9
            assert run["bound"] in run["bound_terms"]  # the simulator's bound is one of the named terms
        assert c["wavefront_over_bound"] >= 1 - 1e-9 and c["fifo_over_bound"] >= 1 - 1e-9
        assert c["critical_section"] in ("vision", "llm")
        assert c["busy_goal_met"] in (True, False, None)
    assert positive(out["median_wavefront_over_bound"])
    assert set(out["goals"]) == {"within_5pct_of_bound", "busy_where_bound_allows"}


@pytest.mark.timeout(60)
def test_plan_fingerprints_are_deterministic_and_tell_plans_apart(tmp_path):
    from tools import plan_fingerprints

    first = plan_fingerprints.main(["--tiny", str(tmp_path / "a.txt")])
    assert first == plan_fingerprints.main(["--tiny"])  # the same plans, run after run
    assert (tmp_path / "a.txt").read_text().splitlines() == first
    simulated = plan_fingerprints.main(["--tiny", "--simulated"])  # the same plans, with their makespan and bound
    assert [s.split(" makespan=")[0] for s in simulated] == first
    for s in simulated:
        if " makespan=" in s:
            makespan, bound = (float(x.split("=")[1]) for x in s.split()[-2:])
            assert 0 <= bound <= makespan * (1 + 1e-9), s
    grid = [line for line in first if not line.startswith("graph ")]
    assert len(grid) == len(plan_fingerprints.cases(tiny=True)) * 2 * 2  # two schedules, two seeds
    graphs = [line for line in first if line.startswith("graph ")]
    assert len({line.split()[1] for line in graphs}) == 20  # --tiny's random section graphs
    assert sum(" wavefront " in line for line in graphs) > 5  # most of them valid, planned
    assert not any(" error " in line for line in first)
    # Any change to a plan changes its fingerprint (here: one micro-batch's order).
    import dataclasses

    from maestro_flow.planner import make_planner
    from tools.bench.wavefront_sim import VISION_COST, build, draw_samples, llm_cost

    graph, costs = build(2, 4, True, llm_cost(), vision=VISION_COST)
    plan = make_planner("wavefront", graph, costs).plan(0, draw_samples(24, 0.33, 0))
    llm = [list(rep) for rep in plan.replicas["llm"]]
    mb = next(i for i, m in enumerate(llm[0]) if len(m) > 1)
    llm[0][mb] = tuple(reversed(llm[0][mb]))
    changed = dataclasses.replace(plan, replicas={**plan.replicas, "llm": tuple(tuple(rep) for rep in llm)})
    assert plan_fingerprints.fingerprint(changed) != plan_fingerprints.fingerprint(plan)


@pytest.mark.timeout(60)
def test_planning_time_tiny():
    out = planning_time.main(["--tiny", "--profile", "--top", "5"])
    assert out["config"]["samples"] == 256 and out["config"]["reps"] == 3
    layouts = out["layouts"]
    assert 64 in [r["replicas"] for r in layouts]  # the goal's "over 64 replicas"
    for r in layouts:
        assert r["replicas"] == r["vision_dp"] + r["llm_dp"]
        assert sum(r["critical"].values()) == 3 and set(r["critical"]) <= {"vision", "llm"}
        for schedule in ("wavefront", "fifo"):
            t = r[schedule]
            assert len(t["times_s"]) == 3 and all(positive(x) for x in t["times_s"])
            assert t["q1_s"] <= t["median_s"] <= t["q3_s"]
    assert isinstance(out["goal_met"], bool)
    assert 1 <= len(out["profile"]) <= 5 and all(positive(p["cumtime_s"]) for p in out["profile"][:1])


@needs_demo_data
@pytest.mark.timeout(120)
def test_vlm_schedules_tiny():
    out = vlm_schedules.main(["--tiny"])
    for schedule in ("wavefront", "fifo"):
        assert positive(out[schedule]["median_step_s"]) and out[schedule]["steps"] == 3
        assert 0 <= out[schedule]["llm_idle_fraction"] <= 1
    assert positive(out["wavefront_over_fifo"])


@needs_demo_data
@pytest.mark.timeout(120)
def test_mixed_precision_tiny():
    out = mixed_precision.main(["--tiny"])
    for mode in ("fp32", "bf16"):
        assert positive(out[mode]["median_step_s"]) and len(out[mode]["loss"]) == 3
        assert all(positive(x) for x in out[mode]["loss"])
    assert out["bf16_over_fp32_bytes"] == 0.5  # the teacher's hidden states cross in bf16
    assert positive(out["bf16_over_fp32_step_time"])


@needs_demo_data
@pytest.mark.timeout(120)
def test_checkpoint_cost_tiny():
    out = checkpoint_cost.main(["--tiny"])
    assert out["checkpoints"] == 2  # after steps 2 and 4
    for key in ("median_step_s", "median_step_s_with_checkpoints", "median_checkpoint_s", "overhead_fraction"):
        assert positive(out[key]), key
    assert out["checkpoint_bytes"] > 100_000
    assert positive(out["checksum_gib_s"]["checksum"]) and positive(out["checksum_gib_s"]["read"])


@needs_demo_data
@pytest.mark.timeout(180)
def test_section_memory_tiny():
    out = section_memory.main(["--tiny"])
    for variant in section_memory.VARIANTS:
        assert all(positive(out[variant][k]) for k in ("state_mb", "step_mb", "max_rss_mb")), variant
    # Exact tensor byte counts, not timings: the goals hold even on a noisy machine.
    assert out["fsdp_over_dp4_state"] <= 0.25 * 1.05
    assert out["tp2_over_expected_state"] == pytest.approx(1.0, rel=0.01)
    assert out["dp4-fsdp"]["step_mb"] > out["dp4-fsdp"]["state_mb"]  # the step gathers units
    assert out["fsdp_step_over_bound"] <= 1.05  # ... one or two at a time
    # A frozen FSDP teacher holds its shard plus the unit it runs, not the whole teacher.
    assert out["teacher_fsdp_step_over_bound"] <= 1.05
    assert out["teacher-dp4-fsdp"]["step_mb"] > out["teacher-dp4-fsdp"]["state_mb"]


@pytest.mark.timeout(120)
def test_gpu_session_script_runs_its_steps_bounded_with_logs(tmp_path):
    """tools/gpu_session.sh (a lent GPU machine's runner) here, with the venv's python3: the
    chosen steps run, each logs to OUT/<step>.log and reports its exit status; without CUDA
    the GPU suite skips and cuda_ipc says so; a step past its limit fails the script."""
    import subprocess
    import sys

    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "STEPS": "gpu_tests cuda_ipc"}
    out = subprocess.run(["bash", "tools/gpu_session.sh", str(tmp_path / "out")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert "== gpu_tests: exit 0" in out.stdout and "== cuda_ipc: exit 0" in out.stdout, out.stdout
    assert "== env" not in out.stdout and "== teacher_throughput" not in out.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cuda_ipc.log", "gpu_tests.log"]
    assert "skipped, no CUDA device" in (tmp_path / "out" / "cuda_ipc.log").read_text()
    # A step over its limit (TEACHER_THROUGHPUT_S): killed, reported, and the script fails.
    env.update(STEPS="teacher_throughput", TEACHER_THROUGHPUT_S="1")
    out = subprocess.run(["bash", "tools/gpu_session.sh", str(tmp_path / "out2")], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "== teacher_throughput: exit 124" in out.stdout, out.stdout
