"""Dataset readers and demo data for maestro_flow (uses only the public API of maestro_flow).

- `loaders.arrow`: `ArrowSource`, the SampleSource for Arrow IPC files and Parquet files/folders
  (DESIGN 5.1b); the default `ArrowData.source`.
- `loaders.text`: a byte-level tokenizer (ids 0..255 are bytes; PAD, BOS, EOS, IMAGE, AUDIO follow).
- `loaders.dali`: `ImageDecoder`, PNG/JPEG bytes -> normalised tensors [3, H, W] with NVIDIA DALI
  (CPU or GPU), and the size rule `target_size` / `num_patches` that datasets precompute.
- `loaders.images`: a tiny PNG encoder and the demo image sources (scikit-learn's sample photos
  and handwritten digits, with captions).
- `loaders.demo`: builders for the demo datasets (`build_text_demo`, `build_image_demo`,
  `build_multimodal_demo`), plus `write_arrow` / `write_parquet`; `python -m loaders.demo OUT_DIR`.
"""
