"""Parallelism inside a section: its DeviceMesh (mesh.py), tensor parallelism from a stage's
tp_plan (tp.py), FSDP2 sharding over its data-parallel replicas (fsdp.py) and which rank counts
a sharded or replicated gradient in the global norm (ownership in fsdp.py / tp.py).

Parallelism is applied to a built stage, not written into it (torchtitan's parallelize_*): a
stage declares a plan (`Stage.tp_plan`) or takes full control (`Stage.parallelize`), and the
worker calls `parallelize_section` once, before the optimizer exists. Runs in worker processes.
"""
