"""A byte-level tokenizer: nothing to download, every string round-trips.

Ids 0..255 are the bytes of the UTF-8 encoding; five special ids follow. The demo datasets and the
demo stages share these constants, so a model built with `VOCAB_SIZE` can read any demo file.
Pure (standard library only); knows nothing about datasets or models.

    PAD = 256    padding (never inside a sample)
    BOS = 257    begins every sample
    EOS = 258    ends a sample
    IMAGE = 259  placeholder where an image's embeddings go (set it in ArrowData.placeholder_ids)
    AUDIO = 260  placeholder where an audio clip's embeddings go (likewise)

VOCAB_SIZE = 261. New ids are only ever appended, so a model with an embedding table for fewer
ids (260, before AUDIO) still reads every file that uses none of the newer ids, the text demo
included.
"""

from __future__ import annotations

from collections.abc import Iterable

NUM_BYTES = 256
PAD = 256
BOS = 257
EOS = 258
IMAGE = 259
AUDIO = 260
VOCAB_SIZE = 261
SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", IMAGE: "<image>", AUDIO: "<audio>"}


def encode(text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """UTF-8 bytes of `text` as ids, optionally wrapped in BOS ... EOS."""
    ids = list(text.encode("utf-8"))
    if bos:
        ids.insert(0, BOS)
    if eos:
        ids.append(EOS)
    return ids


def decode(ids: Iterable[int], *, specials: bool = False) -> str:
    """Text of `ids` (a list, numpy array or 1-D tensor); special ids are dropped, or written as
    `<bos>`, `<image>`, `<audio>`, ... with `specials=True`. Invalid UTF-8 becomes U+FFFD."""
    parts: list[str] = []
    buf = bytearray()
    for raw in ids:
        i = int(raw)
        if 0 <= i < NUM_BYTES:
            buf.append(i)
            continue
        if i not in SPECIAL_NAMES:
            raise ValueError(f"token id {i} is outside the byte-level vocabulary (0..{VOCAB_SIZE - 1})")
        if specials:
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(SPECIAL_NAMES[i])
    parts.append(buf.decode("utf-8", errors="replace"))
    return "".join(parts)


__all__ = ["AUDIO", "BOS", "EOS", "IMAGE", "NUM_BYTES", "PAD", "SPECIAL_NAMES", "VOCAB_SIZE", "decode", "encode"]
