"""pipelines/chain.py at test size, with an LM stage that asks for two optimizer groups
(grouped_stages.GroupedLM): every mode must train with them."""

from maestro_flow import ArrowData, Edge, Pipeline, Section

MODEL = {"vocab_size": 260, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 256, "init_seed": 7}


def pipeline(**overrides):
    return Pipeline(
        name="grouped", data=ArrowData(path="data/demo/text.arrow", shuffle=False),
        global_batch=8, steps=3, seed=0, dtype="float64",
        sections=[
            Section(name="embed", stage="stages.chain:TokenEmbedding", config=MODEL, dp=1, micro_batch=4,
                    optimizer={"name": "adamw", "lr": 3e-3}),
            Section(name="lm", stage="grouped_stages:GroupedLM", config=MODEL, dp=2, micro_batch=2,
                    optimizer={"name": "adamw", "lr": 1e-2, "weight_decay": 0.5}),
        ],
        edges=[Edge(src="embed", dst="lm", tensors=("embeddings",))],
    ).override(**overrides)
