"""How much memory a block of work takes at its peak, above what was in use when it began: the
method `maestro profile` measures each micro-batch's memory with (runtime/profiling.py).

On CUDA, torch.cuda.max_memory_allocated above the allocation before the block (exact, for the
caching allocator's tensors). On CPU, the process's resident set sampled every millisecond by a
thread during the block, above the resident set before it, after glibc's malloc_trim so memory
freed by earlier blocks does not hide growth (approximate: allocator caching, page granularity,
peaks shorter than a millisecond).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

MB = 1 << 20


def peak_meter(device: torch.device) -> _RssPeak | _CudaPeak:
    """A context manager whose `grown_mb`, after the block, is its peak growth on `device`."""
    return _CudaPeak(device) if device.type == "cuda" else _RssPeak()


class _RssPeak:
    """Peak resident memory above the starting point while the block runs (CPU method)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> _RssPeak:
        _malloc_trim()
        self.start = self.peak = self._rss()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="maestro-rss")
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.peak = max(self.peak, self._rss())

    @property
    def grown_mb(self) -> float:
        return max(0, self.peak - self.start) / MB


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class _CudaPeak:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> _CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)

    @property
    def grown_mb(self) -> float:
        return max(0, self.peak - self.start) / MB
