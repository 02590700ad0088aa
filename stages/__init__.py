"""Reusable stages (DESIGN 5.2), named in pipelines as "stages.MODULE:Class".

- `stages.lm:CausalLM` — a GPT-style causal LM, as a teacher ("hidden") or a trainable LM ("loss").
- `stages.distill:KDStudent` — a student LM trained on KL(teacher || student), with the teacher's
  frozen LM head applied in the student section.
- `stages.hf:HFCausalLM` — the same roles around a Hugging Face `transformers` causal LM.
- `stages.chain:TokenEmbedding`, `stages.chain:TransformerLM` — an LM cut in two trainable sections.

The building blocks live in `transformer.py` (modules), `weights.py` (initialisation and checkpoint
reading) and `common.py` (padding and loss sums). Stages use only the public API of maestro_flow.
"""
