"""An LLM fed by two encoders: images (ViT, DALI decode) and audio (log-mel + transformer).

Each encoder runs only for the samples carrying its modality; a sample with both waits for both.
Uses the demo data `data/demo/mm.arrow` (text, text+image, text+audio, text+image+audio).
"""

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section

LLM = {"vocab_size": 261, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 512, "init_seed": 21}
VISION = {"patch": 8, "d_model": 48, "n_layers": 1, "n_heads": 4, "max_grid": 8, "project_to": 64,
          "init_seed": 22, "decode": {"max_side": 64}}
AUDIO = {"d_model": 48, "n_layers": 1, "n_heads": 4, "project_to": 64, "init_seed": 23, "max_frames": 512}


def pipeline(**overrides):
    return Pipeline(
        name="multimodal",
        data=ArrowData(path="data/demo/mm.arrow", placeholder_ids={"image": 259, "audio": 260}),
        global_batch=16, steps=20, seed=0, schedule="wavefront",
        sections=[
            Section(name="vision", stage="stages.vision:VisionEncoder", config=VISION, activates_on="image",
                    dp=1, micro_batch=8, columns=("image",),
                    cost=Cost(per_patch_s=4e-5, per_micro_batch_s=1e-3, padded=True)),
            Section(name="audio", stage="stages.audio:AudioEncoder", config=AUDIO, activates_on="audio",
                    dp=1, micro_batch=8, columns=("audio", "sample_rate"),
                    cost=Cost(per_frame_s=2e-5, per_micro_batch_s=1e-3, padded=True)),
            Section(name="llm", stage="stages.multimodal:MultimodalLM", config=LLM, dp=2, micro_batch=4,
                    columns=("tokens",), optimizer={"name": "adamw", "lr": 3e-3},
                    cost=Cost(per_token_s=3e-5, per_patch_s=3e-5, per_frame_s=3e-5, per_micro_batch_s=1e-3,
                              padded=True)),
        ],
        edges=[Edge(src="vision", dst="llm", tensors=("image_embeds",)),
               Edge(src="audio", dst="llm", tensors=("audio_embeds",))],
    ).override(**overrides)
