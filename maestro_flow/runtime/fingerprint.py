"""What the nodes of a run must share beyond the pipeline's settings: its code, its data, its versions.

Runs in `maestro run` on every node of a multi-node run, before any worker starts. Node 0 puts
its fingerprint in the attempt's record (runtime/attempts.py) and every other node compares its own
with it, refusing to join, naming the files that differ: a node that trained with other stage
code or another copy of the data would give other maths without a word.

- Code: every Python file of maestro_flow, of the packages (or single modules) the pipeline's
  stages, data source and "module:Attr" config values come from, and the pipeline file itself,
  each by its SHA-256, wherever it is installed (editable or not: the same files give the same
  fingerprint). A package of more than MAX_PACKAGE_FILES Python files (a model library) counts
  by its distribution's version instead.
- Data: the files the data source reads (its `files`, else data.path's regular files), each by
  its size and a SHA-256 of sampled bytes: its start, its end and 16 blocks between, within
  DATA_BUDGET bytes for all files together (no node reads a large dataset whole). At most
  MAX_DATA_FILES files are sampled, evenly spread; the others count by size. Two copies that
  differ only elsewhere are not told apart. Past DETAIL_FILES files the record carries one digest
  of them all (a store value is at most 8 MiB), and a difference is named as that digest's.
- Versions: Python's (major.minor) and torch's (in full: builds for other CUDA versions differ).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

DATA_BUDGET = 48 << 20  # bytes sampled from all data files together
FILE_BUDGET = 3 << 20  # and from one file at most
BLOCKS = 16  # blocks sampled between a file's start and end
MAX_DATA_FILES = 256
DETAIL_FILES = 256
MAX_PACKAGE_FILES = 1000
_ATTR_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def fingerprint(pipeline: Any, pipeline_file: str, source: Any = None) -> dict[str, dict[str, str]]:
    """{"code": {file: hash}, "data": {file: hash}, "versions": {name: version}} as seen on this node
    (`source`: the opened data source, whose `files` are the data files when it has them)."""
    import torch

    files = getattr(source, "files", None)
    return {"code": code(pipeline, pipeline_file),
            "data": data(files if isinstance(files, (list, tuple)) else _data_files(pipeline.data.path)),
            "versions": {"python": "{}.{}".format(*sys.version_info), "torch": torch.__version__}}


def differences(mine: dict[str, dict[str, str]], node0: dict[str, dict[str, str]], me: str = "here") -> list[str]:
    """What differs, one line per kind: the files (or versions) named, a few at most. `me`: where
    `mine` are ("on node 1": the text is shown on node 0 too)."""
    out = []
    for kind, what in (("code", "code"), ("data", "data files"), ("versions", "versions")):
        here, there = mine.get(kind, {}), node0.get(kind, {})
        names = sorted(k for k in set(here) | set(there) if here.get(k) != there.get(k))
        if not names:
            continue
        shown = [f"{n} ({f'not {me}' if n not in here else 'not on node 0' if n not in there else 'differs'})"
                 if kind != "versions" else f"{n} {here.get(n)} {me}, {there.get(n)} on node 0" for n in names[:5]]
        out.append(f"{what}: {', '.join(shown)}" + (f", and {len(names) - 5} more" if len(names) > 5 else ""))
    return out


def code(pipeline: Any, pipeline_file: str) -> dict[str, str]:
    paths = [s.stage for s in pipeline.sections] + [pipeline.data.source]
    paths += [v for s in pipeline.sections for v in _strings(s.config) if _ATTR_PATH.fullmatch(v)]
    tops = {"maestro_flow"} | {p.partition(":")[0].split(".")[0] for p in paths}  # "module:Attr" -> its top package
    out = {"pipeline file": _file_hash(Path(pipeline_file))}
    for top in sorted(tops):
        out.update(_module_hashes(top))
    return out


def data(paths: Sequence[str]) -> dict[str, str]:
    """{name: size and sampled hash} of each data file, named relative to their common folder; one
    "<N files>" digest in place of them past DETAIL_FILES."""
    files = sorted(os.path.abspath(p) for p in paths)
    if not files:
        return {}
    base = os.path.dirname(files[0]) if len(files) == 1 else os.path.commonpath(files)
    cut = len(base.rstrip(os.sep)) + 1  # names relative to base (os.path.relpath: most of the time, found in review)
    step = max(1, -(-len(files) // MAX_DATA_FILES))  # every step-th file sampled, the others by size
    budget = min(FILE_BUDGET, DATA_BUDGET // min(len(files), MAX_DATA_FILES))
    out = {p[cut:]: _sampled_hash(p, budget if i % step == 0 else 0) for i, p in enumerate(files)}
    if len(out) <= DETAIL_FILES:
        return out
    digest = hashlib.sha256("\n".join(f"{k}\0{v}" for k, v in sorted(out.items())).encode()).hexdigest()[:16]
    return {f"<{len(out)} files>": digest}


def _data_files(path: str) -> list[str]:
    """A data.path's files where the source does not say: the path itself, or a folder's regular
    files (symlinks followed), those starting with "." or "_" left out (README-like files count).
    A link to a folder above it is not followed (found: two such links made the walk branch
    without end); a folder reached by two paths without a loop is listed under both, as a copy
    of the tree made with `cp -rL` or `rsync -L` would be (found in review)."""
    root = os.path.expanduser(path)
    if not os.path.isdir(root):
        return [root]
    out: list[str] = []
    todo: list[tuple[str, frozenset]] = [(root, frozenset())]
    while todo:
        folder, above = todo.pop()
        try:
            st = os.stat(folder)
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in above:
            continue
        above = above | {(st.st_dev, st.st_ino)}
        for entry in entries:
            if entry.name.startswith((".", "_")):
                continue
            try:
                is_dir = entry.is_dir()  # through a link
            except OSError:
                is_dir = False
            if is_dir:
                todo.append((entry.path, above))
            else:
                out.append(entry.path)
    return out


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def _module_hashes(top: str) -> dict[str, str]:
    """{top/relative file: hash} of a top-level module or package found on sys.path (not imported),
    wherever it is installed; {top: "version X"} for a package too large to read; {} where it is
    not found."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return {}
    if not spec.submodule_search_locations:
        return {f"{top}.py": _file_hash(Path(spec.origin))}
    files = []
    for location in spec.submodule_search_locations:
        for folder, dirs, names in os.walk(location):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            # Not an editor's hidden files (found in review: Emacs' lock link .#lm.py, dangling, raised)
            files += [(location, os.path.join(folder, n)) for n in names if n.endswith(".py")
                      and not n.startswith((".", "#"))]
            if len(files) > MAX_PACKAGE_FILES:
                return {top: f"version {_version(top)}"}
    return {f"{top}/{os.path.relpath(p, base)}": _file_hash(Path(p)) for base, p in sorted(files)}


def _version(top: str) -> str:
    from importlib import metadata

    dists = metadata.packages_distributions().get(top, [])
    try:
        return metadata.version(dists[0] if dists else top)
    except metadata.PackageNotFoundError:
        return "unknown"


def _file_hash(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError as exc:  # it then differs from a node that can read it
        return f"unreadable ({exc.strerror or type(exc).__name__})"


def _sampled_hash(path: str, budget: int) -> str:
    """Its size, and a hash of up to `budget` bytes of it (0: the size alone); what cannot be read
    says so (it then differs from a node that can)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a pipe would block the read (found in review)
            return "not a regular file"
        size = st.st_size
        if not budget:
            return f"size {size}"
        h = hashlib.sha256()
        with open(path, "rb") as f:
            if size <= budget:
                h.update(f.read())
            else:
                end, block = budget // 3, budget // 3 // BLOCKS
                spots = [(0, end)] + [(end + (size - 2 * end - block) * (i + 1) // (BLOCKS + 1), block)
                                      for i in range(BLOCKS)] + [(size - end, end)]
                for at, n in spots:
                    f.seek(at)
                    h.update(f.read(n))
        return f"size {size} sha256 {h.hexdigest()[:16]}"
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
