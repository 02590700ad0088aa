"""Benchmarks: each module has main(argv) -> dict and a --tiny size (smoke-tested by the suite);
results with date, machine and command are in tools/bench/RESULTS.md.

- p2p_bandwidth: the runtime's tensor path against raw torch.distributed isend/irecv.
- control_overhead: control-plane cost per micro-batch and as a share of the distill step.
- teacher_memory: a forward-only section's peak memory at two global batch sizes.
- wavefront_sim: simulated makespans of wavefront vs FIFO vs the lower bound over image mixes.
- planning_time: wavefront planning time for a 4096-sample batch over 64 replicas.
- vlm_schedules: pipelines/vlm.py step time and LLM idle fraction, wavefront vs FIFO, for real.
"""
