"""Benchmarks: each module has main(argv) -> dict and a --tiny size (smoke-tested by the suite);
results with date, machine and command are in tools/bench/RESULTS.md.

Transfers and the control plane:
- p2p_bandwidth: the runtime's tensor paths (gloo, shared memory) against raw isend/irecv and memcpy.
- cuda_ipc: CUDA IPC between two workers on one GPU against a device-to-device copy (GPU only).
- control_overhead: control-plane cost per micro-batch and as a share of the distill step.
- coordinator_scale: the coordinator's per-step work with 1024 simulated workers, and startup.

The planner:
- wavefront_sim: simulated makespans of wavefront vs FIFO vs the lower bound over image mixes.
- planning_time: wavefront planning time for a 4096-sample batch over 64 replicas.
- padding: what padding costs a stage, and what planning for it gains in real runs.

Real pipelines:
- vlm_schedules: pipelines/vlm.py step time and LLM idle fraction, wavefront vs FIFO.
- baseline_compare: section mode against the monolithic baseline, on the same cores and data.
- vlm_text_only: the VLM's LLM throughput against a text-only twin, at several image shares.
- vlm_gap: where the VLM's LLM loses against its text-only twin.
- tune_report: `maestro tune`'s predictions against measured steps, and at published scale.

Memory, precision and long jobs:
- teacher_memory: a forward-only section's peak memory at two global batch sizes.
- teacher_throughput: a forward-only teacher's throughput and peak memory against micro-batch size.
- section_memory: per-rank training state of sharded sections (FSDP, tensor parallelism).
- mixed_precision: the distill demo in float32 and bf16 mixed precision, side by side.
- checkpoint_cost: what a checkpoint adds to the distill demo's steps.
"""
