"""Knowledge distillation: a frozen teacher LM feeding a trainable student, on the demo text.

The teacher (dp=1, micro-batch 8) runs forward only and sends its final hidden states; the
student (dp=2, micro-batch 2, a fan-out of 2) applies the teacher's frozen LM head in its own
section and trains on KL at temperature 2 mixed with cross-entropy. Build the data first with
`maestro data demo`; run with `maestro run pipelines/distill.py`.
"""

from maestro_flow import ArrowData, Cost, Edge, Pipeline, Section

VOCAB = 260  # loaders.text: 256 bytes + PAD, BOS, EOS, IMAGE
TEACHER = {"role": "teacher", "vocab_size": VOCAB, "d_model": 128, "n_layers": 4, "n_heads": 4,
           "max_seq_len": 256, "init_seed": 1234}
STUDENT = {"vocab_size": VOCAB, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256}


def pipeline(**overrides):
    return Pipeline(
        name="distill",
        data=ArrowData(path="data/demo/text.arrow"),
        global_batch=16, steps=30, seed=0,
        sections=[
            Section(name="teacher", stage="stages.lm:CausalLM", config=TEACHER,
                    trainable=False, dp=1, micro_batch=8,
                    cost=Cost(per_sample_s=1e-4, per_token_s=3e-5, per_micro_batch_s=1e-3, padded=True)),
            Section(name="student", stage="stages.distill:KDStudent",
                    config={"student": STUDENT, "teacher": TEACHER, "temperature": 2.0, "alpha": 0.5},
                    trainable=True, dp=2, micro_batch=2, optimizer={"name": "adamw", "lr": 3e-3},
                    cost=Cost(per_sample_s=1e-4, per_token_s=1e-5, per_micro_batch_s=1e-3, padded=True)),
        ],
        edges=[Edge(src="teacher", dst="student", tensors=("hidden",))],
    ).override(**overrides)
