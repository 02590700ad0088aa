"""Reusable stages (DESIGN 5.2), named in pipelines as "stages.MODULE:Class".

- `stages.lm:CausalLM` — a GPT-style causal LM, as a teacher ("hidden") or a trainable LM ("loss").
- `stages.distill:KDStudent` — a student LM trained on KL(teacher || student), with the teacher's
  frozen LM head applied in the student section.
- `stages.hf:HFCausalLM` — the same roles around a Hugging Face `transformers` causal LM.
- `stages.chain:TokenEmbedding`, `stages.chain:TransformerLM` — an LM cut in two trainable sections.
- `stages.vision:VisionEncoder` — a ViT over variable-size images (decoded with DALI), one
  embedding per patch; `stages.vision:Projector` — an MLP section between encoder and LLM.
- `stages.audio:AudioEncoder` — log-mel front end on raw waveforms + transformer, one embedding
  per frame.
- `stages.multimodal:MultimodalLM` — an LLM that expands each image/audio placeholder into the
  received embeddings and trains on the text tokens only.

The building blocks live in `transformer.py` (modules), `encoder.py` (bidirectional encoder
trunk, projector), `weights.py` (initialisation and checkpoint reading), `hf_model.py` (a
transformers model built from a config) and `common.py` (padding and loss sums). Stages use only the public API of maestro_flow.
"""
