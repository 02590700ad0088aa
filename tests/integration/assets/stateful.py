"""One loss section whose forward changes a buffer and, with config `dropout`, draws random
numbers (stateful_stages.py): what a recording must capture for a replay to match the run."""

from maestro_flow import ArrowData, Pipeline, Section


def pipeline(**overrides):
    return Pipeline(
        name="stateful",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=4, steps=2, seed=0,
        sections=[Section(name="counter", stage="stateful_stages:Counter", config={"dropout": 0.0}, micro_batch=2,
                          optimizer={"name": "sgd", "lr": 0.1})],
    ).override(**overrides)
