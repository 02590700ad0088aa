"""Builders for the demo datasets (`maestro data`, `python -m loaders.demo OUT_DIR`).

The text demo is real English prose that ships with every Python: the docstrings of a fixed,
sorted list of standard-library modules and of their public classes and functions, cleaned (code
examples and reST directives dropped, lines reflowed, ASCII only) and cut at word boundaries into
samples of long-tailed length, tokenized with the byte-level tokenizer of `loaders.text`
(BOS + bytes + EOS). Nothing is downloaded and no token is random. The output is a deterministic
function of the arguments and the Python version (docstrings change between Python releases).

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loaders.demo", description="Build the demo datasets.")
    parser.add_argument("out_dir", nargs="?", default="data/demo")
    parser.add_argument("--num-samples", type=int, default=2048)
    parser.add_argument("--min-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-parquet", action="store_true", help="write only the Arrow IPC file")
    args = parser.parse_args(argv)
    path = build_text_demo(args.out_dir, num_samples=args.num_samples, min_tokens=args.min_tokens,
                           max_tokens=args.max_tokens, seed=args.seed, parquet=not args.no_parquet)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
