"""Two trainable sections of user stages that declare no outputs (plain_stages.py)."""

from maestro_flow import ArrowData, Edge, Pipeline, Section


def pipeline(**overrides):
    return Pipeline(
        name="plain",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=8, steps=2, seed=0,
        sections=[
            Section(name="embed", stage="plain_stages:Embedder", dp=1, micro_batch=4),
            Section(name="head", stage="plain_stages:Regressor", dp=2, micro_batch=2),
        ],
        edges=[Edge(src="embed", dst="head", tensors=("feat",))],
    ).override(**overrides)
