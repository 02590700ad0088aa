"""A causal LM cut into two trainable sections, so gradients cross an edge.

`embed` (token embeddings, dp=1, micro-batch 4) feeds `lm` (transformer + LM head, dp=2,
micro-batch 3): a fan-out of 2 with unequal micro-batch sizes. The gradient of the LM loss with
respect to the embeddings flows back to `embed`, which runs its backward once every gradient of
its micro-batch has returned. The same weights as one CausalLM (shared init_seed).
"""

from maestro_flow import ArrowData, Edge, Pipeline, Section

MODEL = {"vocab_size": 260, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256, "init_seed": 7}


def pipeline(**overrides):
    return Pipeline(
        name="chain",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=12, steps=20, seed=0,
        sections=[
            Section(name="embed", stage="stages.chain:TokenEmbedding", config=MODEL,
                    dp=1, micro_batch=4, optimizer={"name": "adamw", "lr": 3e-3}),
            Section(name="lm", stage="stages.chain:TransformerLM", config=MODEL,
                    dp=2, micro_batch=3, optimizer={"name": "adamw", "lr": 3e-3}),
        ],
        edges=[Edge(src="embed", dst="lm", tensors=("embeddings",))],
    ).override(**overrides)
