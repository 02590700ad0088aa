"""`maestro tune`'s predictions: against measured steps here, and at published scale in simulation.

(a) Here, on this CPU: for pipelines/distill.py and pipelines/vlm.py, profile every section
    (runtime/profiling.py: in a worker process, pinned to one core), tune for `--devices` CPU
    workers (default: as many as this process has cores), run the chosen configuration in
    section mode (real worker processes, `--pin-cpus`) with the profiled costs, and compare
    the median measured step_time_s (first steps left out) with the predicted step (the
    tuner's: the simulated makespan of the pipeline's schedule's plans plus the end of the step, or where
    steps overlap the busiest replica's time; planner/tune_model.py). The best uniform configuration
    (one dp and micro-batch for every section) is run the same way, alternately with the tuned
    one over several rounds, so the predicted gain can be checked against the measured one (the
    ranking agrees when both gains are on the same side of 1, or both within TIE of 1: a tie;
    where the tuned configuration is the uniform one there is nothing to rank: None).
    The prediction includes the calibrated runtime costs of the cost file (per micro-batch
    runtime overhead, optimizer step per step, planning) and CPU contention (workers sharing
    os.cpu_count() cores; planner/tune_model.py). Each run also reports
    the runtime overhead per micro-batch it implies ("implied runtime ms/mb"): the median over
    steps of (section busy time - profiled compute of the micro-batches it ran - optimizer
    step) / micro-batches — how profiling.RUNTIME_OVERHEAD_S was calibrated. Busy time on a
    contended machine includes time the worker's thread was descheduled, so this figure is an
    upper bound there.

(b) At published scale, simulation only, with synthetic costs from FLOP counts. Assumptions,
    plainly:
      - a GPU achieves 989 TFLOP/s (H100 bf16 dense peak) x 40% MFU = 396 TFLOP/s;
      - forward FLOPs per token = 2 x parameters (attention's quadratic term not modelled),
        backward = 2 x forward (backward_factor 2), so forward + backward = 3 x forward;
      - tensor/pipeline parallelism is not modelled: a "replica" is a group of GPUs sized to hold
        the model, and its throughput is the group's (perfect scaling inside the group):
        frozen 405B teacher, bf16 weights (810 GB) -> 16 x 80 GB GPUs; trainable models need
        16 bytes/parameter (bf16 weights + grads, fp32 master + two Adam states): 80B -> 1.28 TB
        -> 32 GPUs; 405B -> 6.5 TB -> 128 GPUs; a 6B ViT -> 96 GB -> 2 GPUs;
      - a fixed 20 ms per micro-batch (launch, pipeline fill inside the replica), which is what
        makes larger micro-batches worth having; activation memory is not limited here;
      - sequences: log-normal lengths (median 4K tokens) clipped to 256..32K; VLM samples carry
        an image with probability 0.5, 256..4096 patches (dynamic resolution), and the LLM sees
        patches / 4 image tokens (2x2 merge), so per_patch_s = per_token_s / 4;
      - global batch: 512 samples on 64 GPUs, 4096 on 1024 GPUs.
    For each workload and budget: the tuner's best configuration against the best uniform one
    (same dp and micro-batch for every section), and the monolithic baseline as `maestro tune`
    predicts it (planner/monolithic.py): every replica holds all sections (GPUs per replica
    summed, each section running on all of them) and runs them one after another on every
    micro-batch, at its best micro-batch. Each side's replicas are as wide as their sections
    need, and as many run as fit: the GPUs each side leaves idle are reported. A second baseline,
    "spread", puts the monolithic replicas over every GPU (the best count of replicas, each as
    wide as its share), scaled for free: an optimistic bound for the baseline.

Run from the repository root: python -m tools.bench.tune_report [--tiny] [--devices N] [--skip-measured]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import tempfile
import time
from typing import Any

from maestro_flow.config import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.overrides import parse_set
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.tune import Tuner, to_overrides
from maestro_flow.samples import SampleMeta
from tools.bench.common import median, repo_path, table, turns

TIE = 0.03  # predicted or measured gains this close to 1 are ties (run-to-run noise here is a few %)
ACHIEVED_FLOPS = 989e12 * 0.40
OVERHEAD_S = 0.020


# -- (a) measured on this machine -------------------------------------------------------------

def measured(pipeline: str, devices: int, steps: int, warmup: int, sizes: tuple[int, ...] | None,
             repeats: int, sets: dict[str, Any], folder: str, rounds: int = 1) -> dict[str, Any]:
    from maestro_flow.runtime.costfile import read_cost_file
    from maestro_flow.runtime.profiling import ProfileOptions, profile_pipeline
    from maestro_flow.runtime.run import RunOptions, run_pipeline
    from maestro_flow.runtime.tuning import TuneOptions, tune_pipeline

    path = repo_path("pipelines", pipeline)
    costs_file = os.path.join(folder, f"costs-{pipeline}.json")
    t0 = time.perf_counter()
    profile_pipeline(path, ProfileOptions(overrides=dict(sets), out=costs_file, sizes=sizes, repeats=repeats))
    profile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result, _ = tune_pipeline(path, TuneOptions(overrides=dict(sets), devices=devices, costs=costs_file, top=1))
    tune_s = time.perf_counter() - t0
    cost_sets = {f"sections.{n}.cost": dataclasses.asdict(p.cost) for n, p in read_cost_file(costs_file)[1].items()}
    out: dict[str, Any] = {"pipeline": pipeline, "devices": devices, "profile_s": profile_s, "tune_s": tune_s}
    candidates = [(label, cand) for label, cand in (("tuned", result.best[0]), ("uniform", result.uniform))
                  if cand is not None]
    times: dict[str, list[float]] = {label: [] for label, _ in candidates}
    implied: dict[str, list[float]] = {label: [] for label, _ in candidates}
    for r in range(rounds):  # the two configurations alternately, so both see the same machine
        for label, cand in turns(candidates, r):
            overrides = {**sets, **cost_sets, "steps": steps}
            overrides.update(parse_set(to_overrides(cand)))
            run_dir = os.path.join(folder, f"run-{pipeline}-{label}-{r}")
            rows = run_pipeline(path, RunOptions(overrides=overrides, show_progress=False, run_dir=run_dir,
                                                 pin_cpus=True))
            times[label].extend(row["step_time_s"] for row in rows[warmup:])
            implied[label].append(implied_runtime_s(path, sets, run_dir, costs_file, warmup))
    for label, cand in candidates:
        got = median(times[label])
        out[label] = {"layout": [list(x) for x in cand.layout], "predicted_step_s": cand.step_s,
                      "measured_step_s": got, "measured_over_predicted": got / cand.step_s,
                      "implied_runtime_s": median(implied[label])}
    if "uniform" in out:
        out["predicted_gain"] = out["uniform"]["predicted_step_s"] / out["tuned"]["predicted_step_s"]
        out["measured_gain"] = out["uniform"]["measured_step_s"] / out["tuned"]["measured_step_s"]
    return out


def implied_runtime_s(path: str, sets: dict[str, Any], run_dir: str, costs_file: str, warmup: int) -> float:
    """Median over steps and sections of (busy - profiled compute - optimizer step - the cost
    file's message_s for each message received) / micro-batches."""
    import json

    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.simulate import messages_received, micro_batch_task_s
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline
    from maestro_flow.runtime.costfile import read_cost_file

    pipeline, _ = load_pipeline(path, dict(sets))
    meta = {s.id: s for s in check_pipeline(pipeline).metadata}
    profiles = read_cost_file(costs_file)[1]
    with open(os.path.join(run_dir, "plans.jsonl")) as f:
        plans = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    graph = SectionGraph(pipeline)
    values = []
    for plan, m in list(zip(plans, metrics, strict=False))[warmup:]:
        received = messages_received(graph, plan["sections"])
        for name, prof in profiles.items():
            model, mbs, compute = CostModel(costs={name: prof.cost}), 0, 0.0
            for rep in plan["sections"][name]["replicas"]:
                for mb in rep:
                    mbs += 1
                    compute += micro_batch_task_s(graph, model, name, [meta[i] for i in mb])
            replicas = len(plan["sections"][name]["replicas"])
            busy = (m["sections"][name]["busy_s"] - prof.step_overhead_s * replicas
                    - received.get(name, 0) * prof.message_s)
            if mbs:
                values.append((busy - compute) / mbs)
    return median(values) if values else 0.0


# -- (b) published scale, simulated -------------------------------------------------------------

def per_token_s(params: float, gpus: int) -> float:
    return 2 * params / (gpus * ACHIEVED_FLOPS)


def distill_workload(global_batch: int) -> tuple[Pipeline, dict[str, int]]:
    gpus = {"teacher": 16, "student": 32}
    head = 2 * 128_256 * 16_384  # the teacher's LM head, run in the student section (FLOPs per token / 2)
    p = Pipeline(
        name="distill-405b-80b", data=ArrowData(path="synthetic"), global_batch=global_batch,
        sections=[
            Section(name="teacher", stage="synthetic:Teacher", trainable=False,
                    cost=Cost(per_sample_s=0.0, per_token_s=per_token_s(405e9, gpus["teacher"]))),
            Section(name="student", stage="synthetic:Student",
                    cost=Cost(per_sample_s=0.0, per_token_s=per_token_s(80e9 + head / 2, gpus["student"]))),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("hidden",))])
    return p, gpus


def vlm_workload(llm_params: float, llm_gpus: int, global_batch: int) -> tuple[Pipeline, dict[str, int]]:
    gpus = {"vision": 2, "llm": llm_gpus}
    tok = per_token_s(llm_params, llm_gpus)
    p = Pipeline(
        name=f"vlm-{llm_params / 1e9:.0f}b", data=ArrowData(path="synthetic"), global_batch=global_batch,
        sections=[
            Section(name="vision", stage="synthetic:ViT", activates_on="image",
                    cost=Cost(per_sample_s=0.0, per_patch_s=per_token_s(6e9, gpus["vision"]))),
            Section(name="llm", stage="synthetic:LLM", cost=Cost(per_sample_s=0.0, per_token_s=tok, per_patch_s=tok / 4)),
        ],
        edges=[Edge(src="vision", dst="llm", tensors=("image_embeds",))])
    return p, gpus


def synthetic_samples(n: int, image_share: float, seed: int) -> list[SampleMeta]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = int(min(32_768, max(256, rng.lognormvariate(math.log(4096), 0.9))))
        image = rng.random() < image_share
        out.append(SampleMeta(id=i, modalities=frozenset({"text", "image"} if image else {"text"}), num_tokens=tokens,
                              num_patches=rng.choice((256, 1024, 2304, 4096)) if image else 0))
    return out


def predicted(name: str, pipeline: Pipeline, gpus: dict[str, int], devices: int, image_share: float,
              max_simulations: int) -> dict[str, Any]:
    costs = CostModel(costs={s.name: s.cost for s in pipeline.sections})
    batch = synthetic_samples(pipeline.global_batch, image_share, seed=0)
    if sum(gpus.values()) > devices:
        return {"workload": name, "gpus": devices, "fits": False}
    t0 = time.perf_counter()
    tuner = Tuner(pipeline, costs, [batch], devices=devices, overhead_s={n: OVERHEAD_S for n in gpus},
                  replica_devices=gpus, max_micro_batch=32, max_simulations=max_simulations)
    result = tuner.run(top=1)
    best, uniform = result.best[0], result.uniform
    mono, width = monolithic(pipeline, costs, batch, gpus, devices)
    spread, spread_width = monolithic(pipeline, costs, batch, gpus, devices, spread=True)
    return {"workload": name, "gpus": devices, "fits": True, "tune_s": time.perf_counter() - t0,
            "best": best.to_json_dict(), "uniform": uniform.to_json_dict() if uniform else None,
            "section_gpus": sum(d * gpus[n] for n, d, _ in best.layout),
            "monolithic_step_s": mono.step_s, "monolithic_replicas": mono.devices, "monolithic_width": width,
            "monolithic_micro_batch": mono.micro_batch,
            "spread_step_s": spread.step_s, "spread_replicas": spread.devices, "spread_width": spread_width,
            "spread_micro_batch": spread.micro_batch, "gain_vs_spread": spread.step_s / best.step_s,
            "gain_vs_uniform": uniform.step_s / best.step_s if uniform else None,
            "gain_vs_monolithic": mono.step_s / best.step_s}


def monolithic(pipeline: Pipeline, costs: CostModel, batch: list[SampleMeta], gpus: dict[str, int],
               devices: int, spread: bool = False) -> tuple[Any, int]:
    """The Megatron-style baseline (planner/monolithic.py) and the GPUs each of its replicas holds:
    every replica holds every section, on `width` GPUs, so a section runs width / gpus[section]
    times faster there than on its own replica in section mode (scaled perfectly, as section mode's
    replicas are); every section a micro-batch holds pays the fixed 20 ms per micro-batch; its best
    micro-batch up to 32. By the rule section mode's replicas follow, a replica is as wide as its
    sections need (sum(gpus)), and devices // width of them run; GPUs left over stay idle, on both
    sides. `spread`: r replicas on devices // r GPUs each, the best r, so that no GPU is left
    over (found in QA: distill at 64 GPUs ran one replica of 48, 16 idle, while section mode used
    all 64); it scales one replica to any width for free, an optimistic bound for the baseline."""
    from maestro_flow.graph import SectionGraph
    from maestro_flow.planner.monolithic import best_monolithic

    group = sum(gpus.values())
    best = None
    for replicas in range(1, devices // group + 1) if spread else [devices // group]:
        width = devices // replicas if spread else group
        scaled = CostModel(costs={n: dataclasses.replace(c, per_sample_s=c.per_sample_s * gpus[n] / width,
                                                         per_token_s=c.per_token_s * gpus[n] / width,
                                                         per_patch_s=c.per_patch_s * gpus[n] / width,
                                                         per_frame_s=c.per_frame_s * gpus[n] / width)
                                  for n, c in costs.costs.items()}, transfer_s=costs.transfer_s)
        step = best_monolithic(SectionGraph(pipeline), scaled, [batch], devices=replicas,
                               micro_batches=(1, 2, 4, 8, 16, 32), overhead_s={n: OVERHEAD_S for n in gpus})
        if best is None or step.step_s < best[0].step_s * (1 - 1e-9):
            best = (step, width)
    assert best is not None, "the sections need more GPUs than there are (checked by the caller)"
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.tune_report", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke size")
    ap.add_argument("--devices", type=int, default=len(os.sched_getaffinity(0)),
                    help="CPU workers for part (a) (default: the cores this process may use, one each)")
    ap.add_argument("--steps", type=int, help="steps per measured run (default 30, tiny 3)")
    ap.add_argument("--rounds", type=int, help="alternating runs of each configuration (default 3, tiny 1)")
    ap.add_argument("--skip-measured", action="store_true", help="only part (b)")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.tiny else 30)
    rounds = args.rounds or (1 if args.tiny else 3)
    warmup = 1 if args.tiny else 3
    out: dict[str, Any] = {"measured": [], "published_scale": []}
    if not args.skip_measured:
        sets = {"global_batch": 8} if args.tiny else {}
        with tempfile.TemporaryDirectory(prefix="maestro-tune-") as folder:
            for pipeline in ("distill.py", "vlm.py"):
                out["measured"].append(measured(pipeline, args.devices, steps, warmup,
                                                (1, 2) if args.tiny else None, 1 if args.tiny else 3, sets, folder,
                                                rounds))
        rows = []
        for m in out["measured"]:
            for label in ("tuned", "uniform"):
                if label in m:
                    r = m[label]
                    rows.append([m["pipeline"], label, " ".join(f"{n}:{d}x{b}" for n, d, b in r["layout"]),
                                 r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3, r["measured_over_predicted"],
                                 r["implied_runtime_s"] * 1e3])
        print(f"(a) predicted vs measured on this machine ({args.devices} CPU workers, {rounds} alternating "
              f"rounds of {steps} steps, first {warmup} of each left out, medians)")
        print(table(["pipeline", "config", "dp x micro-batch", "predicted ms", "measured ms", "measured/predicted",
                     "implied runtime ms/mb"], rows))
        for m in out["measured"]:
            if "uniform" in m:
                # The same order measured as predicted, or a tie (both gains within TIE of 1: the
                # same layout, or two the noise here cannot tell apart).
                same = (m["predicted_gain"] > 1) == (m["measured_gain"] > 1)
                tie = abs(m["predicted_gain"] - 1) <= TIE and abs(m["measured_gain"] - 1) <= TIE
                if list(map(list, m["tuned"]["layout"])) == list(map(list, m["uniform"]["layout"])):
                    # One configuration run twice: nothing to rank, the measured gain is the noise.
                    m["ranking_agrees"] = None
                    verdict = "the same configuration: nothing to rank, the measured gain is this host's noise"
                else:
                    m["ranking_agrees"] = same or tie
                    verdict = "ranking " + ("agrees" if same else f"a tie (both within {TIE:.0%})" if tie
                                            else "DISAGREES")
                print(f"{m['pipeline']}: uniform/tuned predicted {m['predicted_gain']:.3f}, measured "
                      f"{m['measured_gain']:.3f} ({verdict})")
        ratios = [m[label]["measured_over_predicted"] for m in out["measured"] for label in ("tuned", "uniform")
                  if label in m]
        out["worst_error"] = max(abs(r - 1) for r in ratios) if ratios else None
        if ratios:
            print(f"largest |measured/predicted - 1|: {out['worst_error']:.1%} (goal <= 15%)")
    sizes = (64,) if args.tiny else (64, 1024)
    sims = 8 if args.tiny else 40
    for devices in sizes:
        batch = 512 if devices <= 64 else 4096
        if args.tiny:
            batch = 128
        cases = [("distill 405B->80B", *distill_workload(batch), 0.0),
                 ("VLM 6B ViT + 80B LLM", *vlm_workload(80e9, 32, batch), 0.5),
                 ("VLM 6B ViT + 405B LLM", *vlm_workload(405e9, 128, batch), 0.5)]
        for name, pipeline, gpus, share in cases:
            out["published_scale"].append(predicted(name, pipeline, gpus, devices, share, sims))
    rows = []
    for r in out["published_scale"]:
        if not r["fits"]:
            rows.append([r["workload"], r["gpus"], "does not fit", "", "", "", "", "", "", "", ""])
            continue
        lay = lambda c: " ".join(f"{n}:{v['dp']}x{v['micro_batch']}" for n, v in c["sections"].items())  # noqa: E731
        rows.append([r["workload"], r["gpus"], f"{lay(r['best'])} ({r['section_gpus']} GPUs)", r["best"]["step_s"],
                     lay(r["uniform"]) if r["uniform"] else "-", r["uniform"]["step_s"] if r["uniform"] else "-",
                     r["gain_vs_uniform"] or "-", *(f"{r[k + '_step_s']:.3g} ({r[k + '_replicas']} x {r[k + '_width']} "
                                                    f"GPUs, mb {r[k + '_micro_batch']})" for k in ("monolithic", "spread")),
                     r["gain_vs_monolithic"], r["gain_vs_spread"]])
    print("(b) predicted at published scale (synthetic FLOP-count costs; see the docstring); monolithic: replicas as "
          "wide as the sections need, as section mode's; spread: over every GPU, scaled for free")
    print(table(["workload", "GPUs", "tuned (replicas x mb)", "step s", "uniform", "uniform step s",
                 "uniform/tuned", "monolithic step s (replicas x GPUs, mb)", "spread step s (replicas x GPUs, mb)",
                 "monolithic/tuned", "spread/tuned"], rows))
    return out


if __name__ == "__main__":
    main()
