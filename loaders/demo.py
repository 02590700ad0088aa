"""Builders for the demo datasets (`maestro data`, `python -m loaders.demo OUT_DIR`).

- `text.arrow` (`build_text_demo`): text only, for distillation and LM pipelines.
- `vlm.arrow` (`build_image_demo`): text samples mixed with captioned images.
- `mm.arrow` (`build_multimodal_demo`): text, captioned images, spoken-as-tones audio clips, and
  images with audio.

The text demo is real English prose that ships with every Python: the docstrings of a fixed,
sorted list of standard-library modules and of their public classes and functions, cleaned (code
examples and reST directives dropped, lines reflowed, ASCII only) and cut at word boundaries into
samples of long-tailed length, tokenized with the byte-level tokenizer of `loaders.text`
(BOS + bytes + EOS). Nothing is downloaded and no token is random. The output is a deterministic
function of the arguments and the Python version (docstrings change between Python releases).

Image samples (`loaders.images`: scikit-learn's sample photographs, crops of them and its
handwritten digits, PNG or JPEG) hold BOS + IMAGE + caption + EOS; `num_patches` is what
`loaders.dali.ImageDecoder` with the same `max_side` / `patch` produces. Audio clips are
synthesised from their text, each character a 30 ms tone whose pitch follows its byte value (a
space is silence), so an audio encoder has something learnable to hear; they hold BOS + AUDIO +
text + EOS (BOS + IMAGE + AUDIO + caption + EOS when the clip speaks an image's caption).

Knows nothing about the runtime: it only writes files in the format of DESIGN 5.1b.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import ipc

from loaders import text
from loaders.arrow_rows import audio_frames

# Pure-Python standard-library modules present on every CPython build (no optional C extensions
# such as tkinter, sqlite3, curses or readline). Kept sorted; a module that still fails to import
# is skipped, so a stripped-down build yields a smaller corpus rather than an error.
STDLIB_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "code", "codecs", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext",
    "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "imaplib", "inspect", "io",
    "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "mailbox", "mimetypes",
    "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "poplib", "pprint",
    "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "signal", "smtplib", "socket", "socketserver", "statistics", "string", "struct", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "trace", "traceback", "types",
    "unittest", "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile",
)

TEXT_SCHEMA = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("modalities", pa.list_(pa.string())),
    pa.field("tokens", pa.list_(pa.int32())),
])

IMAGE_SCHEMA = pa.schema([
    *TEXT_SCHEMA,
    pa.field("image", pa.binary()),
    pa.field("num_patches", pa.int32()),
    pa.field("caption", pa.string()),  # the text after the placeholder(s); null for text samples
])
MULTIMODAL_SCHEMA = pa.schema([
    *IMAGE_SCHEMA,
    pa.field("audio", pa.list_(pa.float32())),
    pa.field("sample_rate", pa.int32()),
    pa.field("num_frames", pa.int32()),
])

DEMOS = ("text", "vlm", "mm")  # what `python -m loaders.demo` builds, by file stem
AUDIO_SAMPLE_RATE = 8000
TONE_S = 0.03  # seconds of tone per character

_SPACE = re.compile(r"\s")
_CODE_LINE = re.compile(r"^(>>>|\.\.\.|\.\. |::|\s{2,}|[-=~*^]{3,}\s*$|[|+])")


def _clean_paragraph(par: str) -> str | None:
    """One reflowed ASCII line of prose, or None for code, tables, directives and fragments."""
    lines = par.splitlines()
    if any(_CODE_LINE.match(line) for line in lines) or par.rstrip().endswith("::"):
        return None
    flat = " ".join(" ".join(line.split()) for line in lines)
    flat = flat.encode("ascii", "ignore").decode("ascii")
    if len(flat) < 40 or len(flat.split()) < 6 or not any(c.isalpha() for c in flat[:3]):
        return None
    return flat


def _clean_doc(doc: str) -> str | None:
    pars = [p for p in (_clean_paragraph(p) for p in re.split(r"\n\s*\n", inspect.cleandoc(doc))) if p]
    return "\n".join(pars) if pars else None


def stdlib_corpus(modules: Sequence[str] = STDLIB_MODULES) -> list[str]:
    """Cleaned docstrings (module first, then its public classes and functions by name), deduplicated."""
    docs: list[str] = []
    seen: set[str] = set()
    for name in sorted(modules):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(name)
            except Exception:  # noqa: BLE001, S112 - a module that fails to import only shrinks the corpus
                continue
            raw = [module.__doc__]
            for attr, obj in sorted(vars(module).items()):
                if attr.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                    continue
                if getattr(obj, "__module__", None) == module.__name__:
                    raw.append(obj.__doc__)
        for doc in raw:
            cleaned = _clean_doc(doc) if isinstance(doc, str) else None
            if cleaned and cleaned not in seen:
                seen.add(cleaned)
                docs.append(cleaned)
    return docs


def _sample_lengths(rng: random.Random, n: int, min_tokens: int, max_tokens: int) -> list[int]:
    # u**3 puts most samples near min_tokens with a long tail up to max_tokens (density ~ x^(-2/3)),
    # the shape of real sequence-length distributions; `random.Random` keeps it stable across
    # Python versions, unlike numpy's distribution methods.
    span = max_tokens - min_tokens + 1
    return [min(max_tokens, min_tokens + int(span * rng.random() ** 3)) for _ in range(n)]


def text_demo_table(*, num_samples: int = 2048, min_tokens: int = 32, max_tokens: int = 128, seed: int = 0,
                    first_id: int = 0) -> pa.Table:
    """The text demo as an in-memory table (schema `TEXT_SCHEMA`); each sample is BOS + bytes + EOS
    with min_tokens <= len <= max_tokens."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not 3 <= min_tokens <= max_tokens:
        raise ValueError(f"need 3 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    rng = random.Random(seed)
    docs = stdlib_corpus()
    if not docs:
        raise RuntimeError("no standard-library docstrings found (is Python running with -OO?)")
    rng.shuffle(docs)
    corpus = "\n\n".join(docs)
    lengths = _sample_lengths(rng, num_samples, min_tokens, max_tokens)
    chunks: list[bytes] = []
    cursor = 0
    for length in lengths:
        budget = length - 2  # BOS and EOS
        if cursor + budget > len(corpus):
            cursor = 0  # wrap around: only for datasets larger than the corpus (~400 KB)
        chunk = corpus[cursor:cursor + budget]
        end = cursor + len(chunk)
        if end < len(corpus) and not corpus[end].isspace():
            # Cut at the last word boundary, as long as the sample stays >= min_tokens.
            lo = max(min_tokens - 2, budget // 2)
            cut = max(chunk.rfind(" ", lo), chunk.rfind("\n", lo))
            if cut > 0:
                chunk = chunk[:cut]
            else:  # no boundary to back off to (a short sample): run on to the next one, up to max_tokens
                nxt = _SPACE.search(corpus, end, cursor + max_tokens - 1)
                if nxt is not None:
                    chunk = corpus[cursor:nxt.start()]
        cursor += len(chunk)
        while cursor < len(corpus) and corpus[cursor].isspace():
            cursor += 1
        chunks.append(chunk.encode("ascii"))
    sizes = np.array([len(c) + 2 for c in chunks], dtype=np.int64)
    offsets = np.zeros(num_samples + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    values = np.empty(int(offsets[-1]), dtype=np.int32)
    for start, chunk in zip(offsets[:-1].tolist(), chunks, strict=False):
        values[start] = text.BOS
        values[start + 1:start + 1 + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
        values[start + 1 + len(chunk)] = text.EOS
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return pa.table({
        "id": pa.array(np.arange(first_id, first_id + num_samples, dtype=np.int64)),
        "modalities": pa.array([["text"]] * num_samples, type=pa.list_(pa.string())),
        "tokens": tokens,
    }, schema=TEXT_SCHEMA)


def write_arrow(table: pa.Table, path: str | os.PathLike[str], *, batch_rows: int = 512) -> Path:
    """Writes an Arrow IPC *file* (uncompressed, so readers can memory-map it zero-copy), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=batch_rows)
    os.replace(tmp, path)
    return path


def write_parquet(table: pa.Table, path: str | os.PathLike[str], *, row_group_rows: int = 512) -> Path:
    """Writes a Parquet file with row groups of `row_group_rows` (the unit a worker reads), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, str(tmp), row_group_size=row_group_rows)
    os.replace(tmp, path)
    return path


def build_text_demo(out_dir: str | os.PathLike[str], *, num_samples: int = 2048, min_tokens: int = 32,
                    max_tokens: int = 128, seed: int = 0, parquet: bool = True) -> Path:
    """Writes `out_dir/text.arrow` (and, with `parquet`, the same rows as `out_dir/text.parquet`);
    returns the path of the Arrow file."""
    table = text_demo_table(num_samples=num_samples, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed)
    out = Path(out_dir)
    if parquet:
        write_parquet(table, out / "text.parquet")
    return write_arrow(table, out / "text.arrow")


# -- image and multimodal demos --------------------------------------------------------------

def audio_num_frames(num_samples: int, sample_rate: int) -> int:
    """Frames of a clip of `num_samples` samples: the audio encoder's default framing, as
    ArrowSource derives `num_frames` where a dataset has no such column (arrow_rows.audio_frames)."""
    return int(audio_frames(np.int64(num_samples), np.int64(sample_rate)))


def tone_waveform(message: str, *, sample_rate: int = AUDIO_SAMPLE_RATE, tone_s: float = TONE_S) -> np.ndarray:
    """`message` as float32 audio: per byte a `tone_s` sine at 110 Hz * 2**((byte - 32) / 24) (quarter
    tones upwards from the space, so printable ASCII spans 110..1670 Hz), a space as silence, each
    tone faded in and out over 3 ms to avoid clicks."""
    n = round(tone_s * sample_rate)
    data = message.encode("utf-8")
    if not data:
        return np.zeros(0, dtype=np.float32)
    t = np.arange(n) / sample_rate
    fade = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / max(1.0, 0.003 * sample_rate))
    freqs = 110.0 * 2.0 ** ((np.clip(np.frombuffer(data, dtype=np.uint8), 32, 127) - 32) / 24.0)
    tones = 0.5 * np.sin(2.0 * np.pi * freqs[:, None] * t[None, :]) * fade[None, :]
    tones[np.frombuffer(data, dtype=np.uint8) == ord(" ")] = 0.0
    return tones.reshape(-1).astype(np.float32)


def _count(num_samples: int, share: float, name: str) -> int:
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {share}")
    return round(num_samples * share)


def _kinds(counts: dict[str, int], num_samples: int, rng: random.Random) -> list[str]:
    kinds = [k for k, c in counts.items() for _ in range(c)]
    kinds += ["text"] * (num_samples - len(kinds))
    rng.shuffle(kinds)
    return kinds


def _text_rows(num: int, seed: int) -> list[list[int]]:
    return text_demo_table(num_samples=num, seed=seed).column("tokens").to_pylist() if num else []


def _transcript(tokens: list[int], rng: random.Random) -> str:
    """A few words (2..8, at most 48 characters) of a text sample, for an audio clip to speak."""
    words = text.decode(tokens).split()
    start = rng.randrange(max(1, len(words) - 8))
    phrase = " ".join(words[start:start + rng.randint(2, 8)])
    return phrase[:48].rsplit(" ", 1)[0] if len(phrase) > 48 else phrase


def image_demo_table(*, num_samples: int = 1024, image_share: float = 0.33, seed: int = 0, max_side: int = 64,
                     patch: int = 8) -> pa.Table:
    """The image demo as an in-memory table (schema `IMAGE_SCHEMA`): round(num_samples *
    image_share) image samples at deterministic random positions, text samples elsewhere."""
    from loaders.dali import num_patches
    from loaders.images import image_samples

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    rng = random.Random(seed)
    kinds = _kinds({"image": _count(num_samples, image_share, "image_share")}, num_samples, rng)
    images = iter(image_samples(kinds.count("image"), seed=rng.randrange(2**32)))
    texts = iter(_text_rows(kinds.count("text"), seed))
    cols: dict[str, list] = {name: [] for name in IMAGE_SCHEMA.names}
    for i, kind in enumerate(kinds):
        cols["id"].append(i)
        if kind == "image":
            img = next(images)
            row = (["text", "image"], [text.BOS, text.IMAGE, *text.encode(img.caption), text.EOS], img.data,
                   num_patches(img.height, img.width, max_side, patch), img.caption)
        else:
            row = (["text"], next(texts), None, 0, None)
        for name, value in zip(IMAGE_SCHEMA.names[1:], row, strict=True):
            cols[name].append(value)
    return pa.table(cols, schema=IMAGE_SCHEMA)


def build_image_demo(out_dir: str | os.PathLike[str], *, num_samples: int = 1024, image_share: float = 0.33,
                     seed: int = 0, max_side: int = 64, patch: int = 8, parquet: bool = False) -> Path:
    """Writes `out_dir/vlm.arrow` (and, with `parquet`, `out_dir/vlm.parquet`); returns the Arrow path.
    `max_side` / `patch` must match the vision stage's ImageDecoder for `num_patches` to be right."""
    table = image_demo_table(num_samples=num_samples, image_share=image_share, seed=seed, max_side=max_side,
                             patch=patch)
    out = Path(out_dir)
    if parquet:
        write_parquet(table, out / "vlm.parquet")
    return write_arrow(table, out / "vlm.arrow")


def multimodal_demo_table(*, num_samples: int = 512, image_share: float = 0.33, audio_share: float = 0.33,
                          both_share: float = 0.05, seed: int = 0, max_side: int = 64, patch: int = 8,
                          sample_rate: int = AUDIO_SAMPLE_RATE) -> pa.Table:
    """The multimodal demo as an in-memory table (schema `MULTIMODAL_SCHEMA`). round(n * image_share)
    samples carry an image and round(n * audio_share) an audio clip, round(n * both_share) of them
    both (a clip speaking the image's caption); the rest are text."""
    from loaders.dali import num_patches
    from loaders.images import image_samples

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    num_both = _count(num_samples, both_share, "both_share")
    counts = {"image": _count(num_samples, image_share, "image_share") - num_both,
              "audio": _count(num_samples, audio_share, "audio_share") - num_both, "both": num_both}
    if min(counts.values()) < 0 or sum(counts.values()) > num_samples:
        raise ValueError(f"need both_share <= image_share, audio_share and image_share + audio_share - both_share "
                         f"<= 1, got {image_share}, {audio_share} and {both_share}")
    rng = random.Random(seed)
    kinds = _kinds(counts, num_samples, rng)
    images = iter(image_samples(counts["image"] + counts["both"], seed=rng.randrange(2**32)))
    num_text = kinds.count("text")
    rows = _text_rows(num_text + counts["audio"], seed)
    texts, spoken = iter(rows[:num_text]), iter(rows[num_text:])
    cols: dict[str, list] = {name: [] for name in MULTIMODAL_SCHEMA.names}
    for i, kind in enumerate(kinds):
        img = next(images) if kind in ("image", "both") else None
        if img is not None:
            caption = img.caption
        else:
            caption = _transcript(next(spoken), rng) if kind == "audio" else None
        audio = tone_waveform(caption, sample_rate=sample_rate) if kind in ("audio", "both") else None
        if kind == "text":
            tokens = next(texts)
        else:
            placeholders = [text.IMAGE] * (img is not None) + [text.AUDIO] * (audio is not None)
            tokens = [text.BOS, *placeholders, *text.encode(caption), text.EOS]
        values = {
            "id": i,
            "modalities": ["text"] + ["image"] * (img is not None) + ["audio"] * (audio is not None),
            "tokens": tokens,
            "image": None if img is None else img.data,
            "num_patches": 0 if img is None else num_patches(img.height, img.width, max_side, patch),
            "caption": caption,
            "audio": audio,
            "sample_rate": None if audio is None else sample_rate,
            "num_frames": 0 if audio is None else audio_num_frames(len(audio), sample_rate),
        }
        for name, value in values.items():
            cols[name].append(value)
    return pa.table(cols, schema=MULTIMODAL_SCHEMA)


def build_multimodal_demo(out_dir: str | os.PathLike[str], *, num_samples: int = 512, image_share: float = 0.33,
                          audio_share: float = 0.33, both_share: float = 0.05, seed: int = 0, max_side: int = 64,
                          patch: int = 8, sample_rate: int = AUDIO_SAMPLE_RATE, parquet: bool = False) -> Path:
    """Writes `out_dir/mm.arrow` (and, with `parquet`, `out_dir/mm.parquet`); returns the Arrow path."""
    table = multimodal_demo_table(num_samples=num_samples, image_share=image_share, audio_share=audio_share,
                                  both_share=both_share, seed=seed, max_side=max_side, patch=patch,
                                  sample_rate=sample_rate)
    out = Path(out_dir)
    if parquet:
        write_parquet(table, out / "mm.parquet")
    return write_arrow(table, out / "mm.arrow")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loaders.demo", description="Build the demo datasets.")
    parser.add_argument("out_dir", nargs="?", default="data/demo")
    parser.add_argument("--only", choices=DEMOS, action="append",
                        help="build only this demo (repeatable); default: all of " + ", ".join(DEMOS))
    parser.add_argument("--num-samples", type=int, default=2048, help="samples of the text demo")
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vlm-samples", type=int, default=1024, help="samples of the image demo")
    parser.add_argument("--mm-samples", type=int, default=512, help="samples of the multimodal demo")
    parser.add_argument("--max-side", type=int, default=64, help="image size limit of the vision stage")
    parser.add_argument("--patch", type=int, default=8, help="patch size of the vision stage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-parquet", action="store_true", help="write only the Arrow IPC files")
    args = parser.parse_args(argv)
    parquet = not args.no_parquet
    for demo in args.only or DEMOS:
        if demo == "text":
            path = build_text_demo(args.out_dir, num_samples=args.num_samples, min_tokens=args.min_tokens,
                                   max_tokens=args.max_tokens, seed=args.seed, parquet=parquet)
        elif demo == "vlm":
            path = build_image_demo(args.out_dir, num_samples=args.vlm_samples, seed=args.seed,
                                    max_side=args.max_side, patch=args.patch, parquet=parquet)
        else:
            path = build_multimodal_demo(args.out_dir, num_samples=args.mm_samples, seed=args.seed,
                                         max_side=args.max_side, patch=args.patch, parquet=parquet)
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
