"""A teacher feeding a student that can fail on purpose (see faulty_stages.py)."""

from maestro_flow import ArrowData, Edge, Pipeline, Section

TEACHER = {"role": "teacher", "vocab_size": 260, "d_model": 32, "n_layers": 1, "n_heads": 2, "init_seed": 1}
STUDENT = {"role": "lm", "vocab_size": 260, "d_model": 32, "n_layers": 1, "n_heads": 2}


def pipeline(**overrides):
    return Pipeline(
        name="faulty",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=8, steps=4, seed=0,
        sections=[
            Section(name="teacher", stage="stages.lm:CausalLM", config=TEACHER, trainable=False, dp=1, micro_batch=4),
            Section(name="student", stage="faulty_stages:Faulty", config=STUDENT, dp=2, micro_batch=2),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("hidden",))],
    ).override(**overrides)
