"""Parallelism inside a section: its layout and DeviceMesh (section.py), tensor parallelism from
a stage's tp_plan (tp.py), FSDP2 sharding over its data-parallel replicas (fsdp.py), and the
bytes of training state each rank holds (memory.py).

Parallelism is applied to a built stage, not written into it (torchtitan's parallelize_*): a
stage declares a plan (`Stage.tp_plan`) or takes full control (`Stage.parallelize`), and the
worker calls `parallelize_section` once, before the optimizer exists. Runs in worker processes.
"""
