"""What the nodes of a run must share beyond the pipeline's settings: its code, its data, its versions.

Runs in `maestro run` on every node of a multi-node run, before any worker starts. Node 0 puts
its fingerprint in the attempt's record (runtime/agent.py) and every other node compares its own
with it, refusing to join, naming the files that differ: a node that trained with other stage
code or another copy of the data would give other maths without a word.

- Code: every Python file of maestro_flow, of the packages (or single modules) the pipeline's
  stages, data source and "module:Attr" config values come from, and the pipeline file itself,
  each by its SHA-256. A package installed in site-packages counts by its version instead (a
  model library's thousands of files are not read).
- Data: every file under `data.path` (a file or a folder), by its size and a SHA-256 of sampled
  bytes: the first and last MiB and 16 blocks of 64 KiB spread between them (no node reads a
  large dataset whole). Two copies that differ only elsewhere are not told apart.
- Versions: Python's and torch's.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEAD = TAIL = 1 << 20  # bytes of each data file hashed at its start and end
BLOCKS, BLOCK = 16, 64 << 10  # and blocks spread between
MAX_DATA_FILES = 4096  # files under data.path sampled; the rest count by size only
_ATTR_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def fingerprint(pipeline: Any, pipeline_file: str) -> dict[str, dict[str, str]]:
    """{"code": {file: hash}, "data": {file: hash}, "versions": {name: version}} as seen on this node."""
    import torch

    return {"code": code(pipeline, pipeline_file), "data": data(pipeline.data.path),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__}}


def differences(mine: dict[str, dict[str, str]], node0: dict[str, dict[str, str]]) -> list[str]:
    """What differs, one line per kind: the files (or versions) named, a few at most."""
    out = []
    for kind, what in (("code", "code"), ("data", "data files"), ("versions", "versions")):
        here, there = mine.get(kind, {}), node0.get(kind, {})
        names = sorted(k for k in set(here) | set(there) if here.get(k) != there.get(k))
        if not names:
            continue
        shown = [f"{n} ({'not here' if n not in here else 'not on node 0' if n not in there else 'differs'})"
                 if kind != "versions" else f"{n} {here.get(n)} here, {there.get(n)} on node 0" for n in names[:5]]
        out.append(f"{what}: {', '.join(shown)}" + (f", and {len(names) - 5} more" if len(names) > 5 else ""))
    return out


def code(pipeline: Any, pipeline_file: str) -> dict[str, str]:
    tops = {"maestro_flow"}
    tops.update(s.stage.partition(":")[0].split(".")[0] for s in pipeline.sections)
    tops.add(pipeline.data.source.partition(":")[0].split(".")[0])
    for section in pipeline.sections:
        tops.update(v.partition(":")[0].split(".")[0] for v in _strings(section.config) if _ATTR_PATH.fullmatch(v))
    out = {"pipeline file": _file_hash(Path(pipeline_file))}
    for top in sorted(tops):
        out.update(_module_hashes(top))
    return out


def data(path: str) -> dict[str, str]:
    root = Path(os.path.expanduser(path))
    if root.is_file():
        return {root.name: _sampled_hash(root)}
    files = sorted(p for p in _files(root))
    step = max(1, -(-len(files) // MAX_DATA_FILES))  # every step-th file sampled, the others by size
    return {str(p.relative_to(root)): _sampled_hash(p) if i % step == 0 else f"size {p.stat().st_size}"
            for i, p in enumerate(files)}


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _files(root: Path) -> Iterator[Path]:
    if not root.is_dir():
        return
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            if not name.startswith("."):
                yield Path(folder) / name


def _module_hashes(top: str) -> dict[str, str]:
    """{relative file: hash} of a top-level module or package found on sys.path (not imported);
    {name: "version X"} where it is installed in site-packages; {} where it is not found."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return {}
    origin = Path(spec.origin)
    if any(part in ("site-packages", "dist-packages") for part in origin.parts):
        from importlib import metadata

        try:
            return {top: f"version {metadata.version(top)}"}
        except metadata.PackageNotFoundError:
            return {top: "installed, no version"}
    if not spec.submodule_search_locations:
        return {origin.name: _file_hash(origin)}
    out = {}
    for location in spec.submodule_search_locations:
        base = Path(location)
        for p in sorted(_files(base)):
            if p.suffix == ".py":
                out[f"{top}/{p.relative_to(base)}"] = _file_hash(p)
    return out


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _sampled_hash(path: Path) -> str:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= HEAD + TAIL + BLOCKS * BLOCK:
            h.update(f.read())
        else:
            spots = [0] + [HEAD + (size - HEAD - TAIL - BLOCK) * (i + 1) // (BLOCKS + 1) for i in range(BLOCKS)]
            for at, n in [(s, HEAD if s == 0 else BLOCK) for s in spots] + [(size - TAIL, TAIL)]:
                f.seek(at)
                h.update(f.read(n))
    return f"size {size} sha256 {h.hexdigest()[:16]}"
