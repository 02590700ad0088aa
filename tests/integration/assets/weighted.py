"""plain.py with a second tensor on the edge: a per-sample float weight from the data, which
needs no gradient (it flows back through "feat" only)."""

from maestro_flow import ArrowData, Edge, Pipeline, Section


def pipeline(**overrides):
    return Pipeline(
        name="weighted",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=8, steps=2, seed=0,
        sections=[
            Section(name="embed", stage="plain_stages:Embedder", config={"weights": True}, dp=1, micro_batch=4),
            Section(name="head", stage="plain_stages:Regressor", dp=2, micro_batch=2),
        ],
        edges=[Edge(src="embed", dst="head", tensors=("feat", "weight"))],
    ).override(**overrides)
