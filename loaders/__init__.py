"""Dataset readers and demo data for maestro_flow (uses only the public API of maestro_flow).

- `loaders.arrow`: `ArrowSource`, the SampleSource for Arrow IPC files and Parquet files/folders
  (DESIGN 5.1b); the default `ArrowData.source`.
- `loaders.text`: a byte-level tokenizer (ids 0..255 are bytes; PAD, BOS, EOS, IMAGE follow).
- `loaders.demo`: builders for the demo datasets (`build_text_demo`), plus `write_arrow` /
  `write_parquet`; `python -m loaders.demo OUT_DIR`.
"""
