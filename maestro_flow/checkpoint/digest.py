"""Checksums of a checkpoint's files, so that bytes changed after a save are refused on resume.

Each worker records the size and CRC-32 of every file it wrote into a checkpoint (its DCP shard
files, the section's `.metadata` where its rank wrote it, its RNG states), read back once after
writing (about 3 GB/s a core, from the page cache); the coordinator keeps them all in the
manifest (`Manifest.files`). `--resume` checks them before any worker starts, over several
threads, so a file flipped, overwritten or cut short on disk is refused naming it, instead of
failing deep in torch's loader or, worse, training on from damaged values. CRC-32 finds damage,
not tampering: a checkpoint is as trusted as the folder it is in.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from maestro_flow.errors import PipelineError

CHUNK = 16 << 20  # bytes read at a time (zlib releases the GIL for each)


class Stopped(Exception):
    """A read given up (`of`'s `stop` set): the caller was interrupted."""


def of(path: str, stop: threading.Event | None = None) -> list[int | str]:
    """[size in bytes, CRC-32 as 8 hex digits] of a file; Stopped, between two chunks, once `stop`
    is set."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            if stop is not None and stop.is_set():
                raise Stopped(path)
            crc, size = zlib.crc32(block, crc), size + len(block)
    return [size, f"{crc:08x}"]


def of_files(root: str, paths: list[str]) -> dict[str, list[int | str]]:
    """Relative path (with '/') -> `of` it, for files given by their paths under `root`."""
    return {os.path.relpath(p, root).replace(os.sep, "/"): of(p) for p in paths}


def problems(root: str, files: dict[str, list[int | str]], threads: int | None = None) -> list[str]:
    """What differs in `root` from the recorded `files` (relative path -> [size, crc]), one line
    each, in path order; empty when every file is as it was written."""

    def check(item: tuple[str, list[int | str]]) -> str | None:
        rel, (size, crc) = item
        path = os.path.join(root, *rel.split("/"))
        try:
            now = os.path.getsize(path)
            if now != size:
                return f"{rel}: {now} bytes, {size} when saved"
            now_crc = of(path, stop)[1]
            if now_crc != crc:
                return f"{rel}: its bytes changed since it was saved (CRC-32 {now_crc}, {crc} when saved)"
        except FileNotFoundError:
            return f"{rel}: missing"
        except OSError as exc:
            return f"{rel}: cannot be read ({exc.strerror or exc})"
        return None

    # An interrupt (Ctrl-C, SIGTERM) stops the reads under way (found in review: it waited for them,
    # 15 s on 48 GB of files).
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        try:
            found = list(pool.map(check, sorted(files.items())))
        except BaseException:
            stop.set()
            raise
    return [line for line in found if line is not None]


def check(folder: str, files: dict[str, list[int | str]], what: str, hint: str = "") -> float:
    """Refuse (PipelineError, `what` first, `hint` last) a checkpoint folder whose `files` are not
    as they were written; returns the seconds the check took. Nothing to check (a checkpoint
    written before checksums were kept) passes."""
    start = time.monotonic()
    found = problems(folder, files)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        verb = "is" if len(found) == 1 else "are"
        raise PipelineError(f"{what}: {len(found)} of its {len(files)} files {verb} not as saved (checksums in its "
                            f"manifest): {'; '.join(found[:3])}{more}{hint}")
    return time.monotonic() - start
