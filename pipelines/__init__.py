"""Pipeline definitions users copy: distill.py (teacher -> student), vlm.py (vision -> LLM),
multimodal.py (vision + audio -> LLM), chain.py (an LM cut in two trainable sections)."""
