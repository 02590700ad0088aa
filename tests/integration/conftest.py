"""Fixtures for the integration tier: real processes on loopback, bounded, leak-checked.

Every test here gets `no_leaks`: after the test, no child process of the test process (or of the
processes it started) may still be running.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parent / "assets"


def descendants(pid: int) -> list[int]:
    """All live descendant pids of `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def worker_pids(pid: int) -> list[int]:
    """The live worker processes (multiprocessing spawn children) below `pid`."""
    return [p for p in descendants(pid) if b"spawn_main" in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _is_resource_tracker(pid: int) -> bool:
    # multiprocessing's resource tracker: one per parent process, lives as long as the parent.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_leaks():
    before = set(descendants(os.getpid()))
    yield
    new = [p for p in descendants(os.getpid()) if p not in before and not _is_resource_tracker(p)]
    left = wait_gone(new, 10.0)
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    from loaders.demo import build_text_demo

    out = tmp_path_factory.mktemp("demo")
    return build_text_demo(out, num_samples=256, parquet=False)


_RUN_DIRS = tempfile.mkdtemp(prefix="maestro-test-runs-")
atexit.register(shutil.rmtree, _RUN_DIRS, ignore_errors=True)


def maestro(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess (the real entry point, real exit codes). A `run` without a
    run dir of its own gets one under a temporary folder, not the checkout's runs/."""
    if args and args[0] == "run" and "--run-dir" not in args and "--no-run-dir" not in args:
        args = (*args, "--run-dir", tempfile.mkdtemp(dir=_RUN_DIRS))
    return subprocess.run([sys.executable, "-m", "maestro_flow.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, **kwargs)


# pipelines/vlm.py reading precomputed pixels: no image decoder (so no DALI), e.g. on a GPU machine
# whose image lacks DALI. Merge with write_pixel_vlm's data.path.
PIXEL_VLM = {"data.modality_columns": {"image": "pixel_values"}, "sections.vision.config.decoder": None,
             "sections.vision.columns": ("pixel_values",)}


def write_pixel_vlm(path: Path, *, num_samples: int = 96, image_share: float = 0.4, seed: int = 0, patch: int = 8,
                    max_side: int = 64) -> Path:
    """An image-text Arrow file whose images are precomputed pixel arrays ([3, H, W], float32
    noise, H and W multiples of `patch` up to `max_side`) in a `pixel_values` column."""
    import numpy as np
    import pyarrow as pa

    from loaders import text
    from loaders.demo import write_arrow

    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {"id": [], "modalities": [], "tokens": [], "pixel_values": [], "num_patches": []}
    for i in range(num_samples):
        words = rng.integers(32, 127, size=int(rng.integers(8, 40))).tolist()
        image = rng.random() < image_share
        h, w = (int(rng.integers(1, max_side // patch + 1)) * patch for _ in range(2))
        cols["id"].append(i)
        cols["modalities"].append(["text", "image"] if image else ["text"])
        cols["tokens"].append([text.BOS, *([text.IMAGE] if image else []), *words, text.EOS])
        cols["pixel_values"].append(rng.standard_normal((3, h, w), dtype=np.float32).tolist() if image else None)
        cols["num_patches"].append((h // patch) * (w // patch) if image else 0)
    types = {"id": pa.int64(), "modalities": pa.list_(pa.string()), "tokens": pa.list_(pa.int32()),
             "pixel_values": pa.list_(pa.list_(pa.list_(pa.float32()))), "num_patches": pa.int32()}
    return write_arrow(pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()}), path)
