"""Per-rank training-state memory of a sharded section: FSDP over dp=4 against plain dp=4, and
tensor parallelism (tp=2) against the bytes its plan should leave on each rank; and a frozen
teacher sharded over dp=4 (FSDP gathering unit by unit in each forward) against plain dp=4.

Runs pipelines/distill.py in section mode (real workers, gloo) with the student section as

    dp4         dp=4, every replica holds the whole student
    dp4-fsdp    dp=4, fsdp=True: parameters, gradients and AdamW state sharded over the 4 replicas
    dp2-tp2     dp=2, tp=2: the student's tp_plan shards its attention and MLP layers over 2 ranks

and the teacher section as

    teacher-dp4       dp=4, every replica holds the whole (frozen) teacher
    teacher-dp4-fsdp  dp=4, fsdp=True: replicas in lockstep, each unit gathered for its forward only

and reads each step's metrics row (DESIGN 5.4): `state_mb` is what a student rank keeps between
steps (parameters, reduced gradients, optimizer state: exact tensor bytes of its own shards,
parallel/memory.py), `step_mb` the most it held at once within a step (the student and the
teacher here run FSDP in lockstep, parallel/fsdp.py: a unit gathered for its forward or backward
only), `max_rss_mb` the process's
peak resident memory (CPU; includes the ~350 MB of Python and torch every worker carries).

The goals: dp4-fsdp's state at most 1/4 + 5% of dp4's, its in-step bytes at most that plus five
units (the unit running and a prefetched one, a unit's gradients, FSDP's retained all-gather and
reduce-scatter buffers: the tuner's model) + 5%; dp2-tp2's state equal to the bytes
expected from the plan (layers it shards at 1/2, the rest whole), computed from the student built
on the meta device; teacher-dp4-fsdp's in-step bytes at most 1/4 of teacher-dp4's plus two
of its largest FSDP units (a transformer block, and FSDP's all-gather buffer of the last one),
+ 5%. In-step bytes are counted from the tensors FSDP holds (parallel/fsdp.py), not read from
an allocator; with the sections on CUDA (`--set sections.student.device=cuda --set
sections.teacher.device=cuda`) the table adds the CUDA allocator's peak per rank
(torch.cuda.max_memory_allocated, weights, activations and workspace included). Run from the
repository root:
    python -m tools.bench.section_memory [--tiny] [--steps N] [--set KEY=VALUE ...]
"""

from __future__ import annotations

from typing import Any

from tools.bench.common import median, pipeline_bench_args, repo_path, table

VARIANTS = {
    "dp4": {"sections.student.dp": 4},
    "dp4-fsdp": {"sections.student.dp": 4, "sections.student.fsdp": True},
    "dp2-tp2": {"sections.student.dp": 2, "sections.student.tp": 2},
}
TEACHER_VARIANTS = {
    "teacher-dp4": {"sections.teacher.dp": 4},
    "teacher-dp4-fsdp": {"sections.teacher.dp": 4, "sections.teacher.fsdp": True},
}
# A student large enough that its state dwarfs rounding (about 3.4M parameters), and a deeper
# teacher (a block is then a smaller part of it); --tiny keeps the demo's.
LARGER = {"sections.student.config.student.d_model": 256, "sections.student.config.student.n_layers": 4,
          "sections.teacher.config.n_layers": 12}
MiB = float(1 << 20)


def run_one(variant: str, steps: int, sets: dict[str, Any]) -> list[dict[str, Any]]:
    from maestro_flow.runtime.run import RunOptions, run_pipeline

    overrides = {"adapt_costs": False, **sets, **{**VARIANTS, **TEACHER_VARIANTS}[variant], "steps": steps}
    return run_pipeline(repo_path("pipelines", "distill.py"), RunOptions(overrides=overrides, show_progress=False))


def expected_tp_mb(sets: dict[str, Any], tp: int) -> float:
    """Bytes a tp rank of the student should keep: each parameter (frozen: itself; trainable:
    itself, its gradient and AdamW's two moments), divided by tp where the plan shards it."""
    from maestro_flow.parallel.tp import sharded, stage_modules
    from maestro_flow.runtime.build import build_stage, load_pipeline

    pipeline, _ = load_pipeline(repo_path("pipelines", "distill.py"), {**sets, **VARIANTS["dp2-tp2"]})
    section = pipeline.section("student")
    stage = build_stage(pipeline, section, 0, "cpu", meta=True)
    modules = stage_modules(stage)
    split = sharded(type(stage).tp_plan(dict(section.config)), modules)
    total = 0.0
    for name, module in modules.items():
        for p in module.parameters(recurse=False):
            copies = 4 if p.requires_grad else 1
            total += copies * p.numel() * p.element_size() / (tp if name in split else 1)
    return total / MiB


def unit_mb(sets: dict[str, Any], section: str) -> float:
    """The section's largest FSDP unit (what `maestro profile` writes as unit_mb), built on the
    meta device."""
    from maestro_flow.parallel.fsdp import largest_unit_bytes
    from maestro_flow.runtime.build import build_stage, load_pipeline

    pipeline, _ = load_pipeline(repo_path("pipelines", "distill.py"), sets)
    return largest_unit_bytes(build_stage(pipeline, pipeline.section(section), 0, "cpu", meta=True)) / (1 << 20)


def _medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step medians of a section's memory figures; `peak_mb` (the CUDA allocator's peak on its
    largest replica) is None on the CPU."""
    out = {key: median([r[key] for r in rows]) for key in ("state_mb", "step_mb", "max_rss_mb")}
    out["peak_mb"] = median([r["peak_mb"] for r in rows]) if all("peak_mb" in r for r in rows) else None
    return out


def _peak(row: dict[str, Any]) -> str:
    return "-" if row["peak_mb"] is None else f"{row['peak_mb']:.1f}"


def main(argv: list[str] | None = None) -> dict:
    args, _, steps, warmup, sets = pipeline_bench_args(argv, "tools.bench.section_memory", __doc__, rounds=1,
                                                       steps=4, warmup=1, tiny_steps=2)
    if not args.tiny:
        sets = {**LARGER, **sets}
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        rows = run_one(variant, steps, sets)
        out[variant] = _medians([r["sections"]["student"] for r in rows[warmup:]])
    base = out["dp4"]["state_mb"]
    out["fsdp_over_dp4_state"] = out["dp4-fsdp"]["state_mb"] / base
    out["fsdp_over_dp4_step"] = out["dp4-fsdp"]["step_mb"] / out["dp4"]["step_mb"]
    # In a step a lockstep student holds its shards and about five units (tuner's MemoryModel).
    out["student_unit_mb"] = unit_mb(sets, "student")
    out["fsdp_step_bound_mb"] = base / 4 + 5 * out["student_unit_mb"]
    out["fsdp_step_over_bound"] = out["dp4-fsdp"]["step_mb"] / out["fsdp_step_bound_mb"]
    out["tp2_expected_state_mb"] = expected_tp_mb(sets, 2)
    out["tp2_over_expected_state"] = out["dp2-tp2"]["state_mb"] / out["tp2_expected_state_mb"]
    out["tp2_over_dp4_state"] = out["dp2-tp2"]["state_mb"] / base
    for variant in TEACHER_VARIANTS:
        rows = run_one(variant, steps, sets)
        out[variant] = _medians([r["sections"]["teacher"] for r in rows[warmup:]])
        out[variant]["step_ms"] = 1e3 * median([r["step_time_s"] for r in rows[warmup:]])
    whole = out["teacher-dp4"]["step_mb"]
    out["teacher_unit_mb"] = unit_mb(sets, "teacher")
    out["teacher_fsdp_step_bound_mb"] = whole / 4 + 2 * out["teacher_unit_mb"]
    out["teacher_fsdp_over_dp4_step"] = out["teacher-dp4-fsdp"]["step_mb"] / whole
    out["teacher_fsdp_step_over_bound"] = out["teacher-dp4-fsdp"]["step_mb"] / out["teacher_fsdp_step_bound_mb"]
    out["config"] = {"steps": steps, "warmup_steps": warmup, "sets": sets}
    print(f"pipelines/distill.py, section mode, {steps} steps per variant; student, per rank (largest replica)")
    print(table(["student", "state MiB/rank", "state / dp4", "in-step MiB/rank", "max RSS MiB", "CUDA peak MiB"],
                [[v, f"{out[v]['state_mb']:.3f}", f"{out[v]['state_mb'] / base:.3f}", f"{out[v]['step_mb']:.3f}",
                  f"{out[v]['max_rss_mb']:.0f}", _peak(out[v])] for v in VARIANTS]))
    print(f"dp4-fsdp / dp4: state {out['fsdp_over_dp4_state']:.3f} (goal <= 0.2625: 1/4 + 5%), "
          f"in-step {out['fsdp_over_dp4_step']:.3f}; in-step {out['dp4-fsdp']['step_mb']:.3f} MiB against 1/4 of "
          f"dp4 + 5 x the largest unit ({out['student_unit_mb']:.3f} MiB) = {out['fsdp_step_bound_mb']:.3f} MiB: "
          f"ratio {out['fsdp_step_over_bound']:.3f} (goal <= 1.05)")
    print(f"dp2-tp2: state {out['dp2-tp2']['state_mb']:.3f} MiB against {out['tp2_expected_state_mb']:.3f} expected "
          f"from the plan (ratio {out['tp2_over_expected_state']:.3f})")
    print("\nteacher (frozen), per rank (largest replica)")
    print(table(["teacher", "state MiB/rank", "in-step MiB/rank", "in-step / dp4", "max RSS MiB", "CUDA peak MiB",
                 "step ms"],
                [[v, f"{out[v]['state_mb']:.3f}", f"{out[v]['step_mb']:.3f}", f"{out[v]['step_mb'] / whole:.3f}",
                  f"{out[v]['max_rss_mb']:.0f}", _peak(out[v]), f"{out[v]['step_ms']:.1f}"] for v in TEACHER_VARIANTS]))
    print(f"teacher-dp4-fsdp in-step {out['teacher-dp4-fsdp']['step_mb']:.3f} MiB against 1/4 of dp4 + 2 x the largest "
          f"unit ({out['teacher_unit_mb']:.3f} MiB) = {out['teacher_fsdp_step_bound_mb']:.3f} MiB: ratio "
          f"{out['teacher_fsdp_step_over_bound']:.3f} (goal <= 1.05)")
    return out


if __name__ == "__main__":
    main()
