"""Checkpoints, resume and export: what must survive a run (DESIGN 4b)."""
