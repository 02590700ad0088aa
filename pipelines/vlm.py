"""A vision-language model: a ViT encoder feeding a causal LLM, on the demo image-text data.

The vision encoder runs only for samples that carry an image (`activates_on="image"`), decodes
them with NVIDIA DALI (CPU operators here, GPU decoding on CUDA) and sends one embedding per
patch; the LLM replaces each sample's image placeholder with those rows and trains on its text
tokens. Gradients of the LLM loss flow back into the (trainable) encoder. The wavefront
dispatcher orders each global batch so that the LLM starts with text-only samples while the
encoder works. Build the data with `maestro data demo`; run `maestro run pipelines/vlm.py`.
"""

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section

LLM = {"vocab_size": 261, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 320, "init_seed": 11}
VISION = {"patch": 8, "d_model": 48, "n_layers": 2, "n_heads": 4, "max_grid": 8, "project_to": 64,
          "init_seed": 12, "decode": {"max_side": 64}}


def pipeline(**overrides):
    return Pipeline(
        name="vlm",
        data=ArrowData(path="data/demo/vlm.arrow", placeholder_ids={"image": 259}),
        global_batch=24, steps=30, seed=0, schedule="wavefront",
        sections=[
            Section(name="vision", stage="stages.vision:VisionEncoder", config=VISION, activates_on="image",
                    dp=1, micro_batch=8, columns=("image",), optimizer={"name": "adamw", "lr": 1e-3},
                    cost=Cost(per_sample_s=5e-4, per_patch_s=2e-5, per_micro_batch_s=2e-3, padded=True)),
            Section(name="llm", stage="stages.multimodal:MultimodalLM", config=LLM, dp=2, micro_batch=4,
                    columns=("tokens",), optimizer={"name": "adamw", "lr": 3e-3},
                    cost=Cost(per_sample_s=1e-4, per_token_s=1e-5, per_patch_s=1e-5,
                              per_micro_batch_s=1e-3, padded=True)),
        ],
        edges=[Edge(src="vision", dst="llm", tensors=("image_embeds",))],
    ).override(**overrides)
