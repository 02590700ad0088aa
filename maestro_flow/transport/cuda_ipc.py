"""The same-device path for CUDA tensors: reused device slots shared through CUDA IPC.

Runs inside worker processes, under transport/tensor_comm.py. NCCL refuses two ranks on one
GPU, so when two workers of one host share a device (more ranks than GPUs) their channel goes
through CUDA IPC instead of gloo staged through host memory. It is transport/shm.py's design on
the device: the sender keeps a pool of device slots per channel (uint8 CUDA tensors from its
caching allocator), copies a message's buffers into one (one device-to-device copy on its current
stream) and records the slot's interprocess event after the copy; the header (over ZeroMQ) names
the slot and each buffer's offset, and the first time a slot is sent, its IPC memory handle and
its event's handle (`ipc` in the header). The receiver opens each slot and event once, waits for
the event and delivers views of the slot: the bytes are not copied again. It waits on the device
by default (its default stream waits for the event, no host synchronisation); with
MAESTRO_CUDA_IPC_WAIT=host its header thread polls the event until the copy is done instead, so
that no per-message work of the receiver's CUDA context waits on the sender's (faster in the
one-channel benchmark, but it holds the header thread for each copy; with MPS, one context for
both ranks, the ~100 µs a message below stayed of the same order, so contexts taking turns are
not that cost). Either way the views are read on the default stream.
When no view of a message is left, the receiver records an event on its stream and sends the
slot back ("release", as for shared memory) once that event has completed, so the sender never
overwrites bytes a kernel of the receiver may still read.

The handles come from torch's own CUDA IPC (what torch.multiprocessing uses to share CUDA
tensors: `UntypedStorage._share_cuda_` / `_new_shared_cuda`, `torch.cuda.Event(interprocess=True)`
and `Event.from_ipc_handle`). A header carries them as bytes and integers only; nothing from a
socket is unpickled. Both ranks must be on the same host and the same device
(runtime/topology.ipc_channels). tests/gpu/test_cuda_ipc.py checks it where CUDA is (passed on an
H200, 2026-11-26, an H100, 2026-11-27, and an H200 again, 2026-11-30); tools/bench/cuda_ipc.py
measures it (RESULTS 9.4, H200: in a steady stream, 0.84-0.88x a device copy at 256 MiB but 0.18x
at 16 MiB, where the receiver's ~90 µs a message is the limit. Per-message costs matter here:
the sender looks its stream up cheaply).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from maestro_flow.errors import first_line
from maestro_flow.transport.shm import SlotReader, SlotWriter

PREFIX = "ipc-"  # slot names: ipc-<sender rank>-<count>; releases are routed by it
WAITS = ("device", "host")  # MAESTRO_CUDA_IPC_WAIT: how a receiver waits for the sender's copy


def wait_mode() -> str:
    """MAESTRO_CUDA_IPC_WAIT, checked: "device" (the default, also where empty) or "host"."""
    mode = os.environ.get("MAESTRO_CUDA_IPC_WAIT", "").strip() or "device"
    if mode not in WAITS:
        raise ValueError(f"MAESTRO_CUDA_IPC_WAIT={mode!r}: use one of {', '.join(WAITS)}")
    return mode


class IpcRefused(RuntimeError):
    """CUDA IPC cannot be had for a new slot (its export or its interprocess event refused): the
    channel goes through the host instead. Any other error (a CUDA error surfacing in the copy)
    is not this, and fails the run as it is."""


class _DeviceSlot:
    """A slot of the sender: device bytes, their IPC export and an interprocess event."""

    address = None  # no host address: SlotWriter.write copies into it with torch

    def __init__(self, name: str, size: int, device: torch.device) -> None:
        self.name, self.size = name, size
        self.bytes = torch.empty(size, dtype=torch.uint8, device=device)
        try:
            self.event = torch.cuda.Event(interprocess=True)
            self.event.record(torch.cuda.current_stream(device))  # it has a handle only once recorded
            storage = self.bytes.untyped_storage()
            (dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle,
             event_sync) = storage._share_cuda_()
            # Sent once per slot (the first message through it); bytes and integers only.
            self.export: list[Any] = [int(dev), bytes(handle), int(size_bytes), int(offset_bytes), bytes(ref_handle),
                                      int(ref_offset), bytes(event_handle), bool(event_sync),
                                      bytes(self.event.ipc_handle())]
        except RuntimeError as exc:
            raise IpcRefused(first_line(exc)) from exc
        self.announced = False

    def close(self) -> None:
        self.bytes = None


class _OpenedSlot:
    """A slot as its receiver sees it: a view of the sender's device memory and its event."""

    def __init__(self, name: str, export: Sequence[Any], device: torch.device) -> None:
        if not isinstance(export, (list, tuple)) or len(export) != 9:
            raise ValueError(f"slot {name}: a CUDA IPC export has 9 fields, got {export!r}")
        dev, handle, size_bytes, offset_bytes, ref_handle, ref_offset, event_handle, event_sync, ipc_event = export
        for field in (handle, ref_handle, event_handle, ipc_event):
            if not isinstance(field, bytes):
                raise ValueError(f"slot {name}: CUDA IPC handles are bytes")
        if int(dev) != device.index:
            raise ValueError(f"slot {name} is on cuda:{dev}, this worker on {device}: not the same device")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(int(dev), handle, int(size_bytes), int(offset_bytes),
                                                            ref_handle, int(ref_offset), event_handle,
                                                            bool(event_sync))
            self.event = torch.cuda.Event.from_ipc_handle(device, ipc_event)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot open CUDA IPC slot {name} of another worker on {device} ({exc}); workers "
                               "in separate containers or PID namespaces cannot share device memory: run them in "
                               "one, or set MAESTRO_CUDA_IPC=0 to send through gloo and host memory") from None
        self.name, self.size = name, int(size_bytes)
        # The slot tensor, a message's base and the storage object SlotReader.read keeps with it
        # are the three users SlotReader.reap expects when no view of a message is left (so this
        # storage object goes).
        self.bytes = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (self.size,), (1,))
        del storage

    def close(self) -> None:
        self.bytes = None


class IpcWriter(SlotWriter):
    """The sending side of one worker's CUDA IPC channels (shm.SlotWriter's pool, device slots).
    Used by the sending (compute) thread only. Its slots stay until it closes: the receiver maps
    each for good, and torch frees a shared block only once every mapping of it is closed, so a
    slot removed early would leak (a channel holds as many as its most messages in flight)."""

    spare = spare_bytes = float("inf")

    def __init__(self, rank: int, device: torch.device) -> None:
        super().__init__(f"{PREFIX}{rank}")
        self.device = device
        self._streams: dict[Any, torch.cuda.Stream] = {}  # torch's current-stream data -> its Stream

    def _current_stream(self) -> torch.cuda.Stream:
        """torch.cuda.current_stream(device), without its Python per call (several µs, a
        message's budget at 16 MiB): the stream is looked up by torch's own data for it."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        data = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type)
        stream = self._streams.get(data)
        if stream is None:
            stream = self._streams[data] = torch.cuda.current_stream(self.device)
        return stream

    def _make(self, count: int, size: int) -> _DeviceSlot:
        return _DeviceSlot(f"{self.prefix}-{count}", size, self.device)

    def write(self, channel: tuple[int, str], buffers: Sequence[torch.Tensor]) -> tuple[str, list[int]]:
        name, offsets = super().write(channel, buffers)  # copies on the current stream
        # After the copy, on the stream that ran it: the receiver's stream waits for this event.
        self._used[name].event.record(self._current_stream())
        return name, offsets

    def _remove(self, slot: _DeviceSlot) -> None:
        self._channel_of.pop(slot.name, None)
        slot.close()

    def export(self, name: str) -> list[Any] | None:
        """The slot's handles if its receiver has not seen them yet (then never again)."""
        slot = self._used[name]
        if slot.announced:
            return None
        slot.announced = True
        return slot.export


class IpcReader(SlotReader):
    """The receiving side: opens each sender slot once, waits for its event (on the default stream,
    or on the host), hands out views; gives a slot back only once the default stream is past every
    use of those views."""

    max_mapped = sweep_s = float("inf")  # a slot's handles come once: a mapping forgotten could not be opened again

    def __init__(self, device: torch.device, wait: str = "device", timeout_s: float = 600.0) -> None:
        super().__init__(PREFIX.removesuffix("-"))  # names ipc-<sender rank>-<count>: check_name
        self.device = device
        self.wait = wait  # "device": the default stream waits for the sender's copy; "host": this thread does
        self.timeout_s = timeout_s  # the longest a host wait for one copy may take
        self._exports: dict[str, Sequence[Any]] = {}
        self._draining: list[tuple[int, str, torch.cuda.Event]] = []  # views gone, stream not yet past them
        self._drain_lock = threading.Lock()
        self._default: torch.cuda.Stream | None = None  # the device's default stream, looked up once

    def _default_stream(self) -> torch.cuda.Stream:
        if self._default is None:
            self._default = torch.cuda.default_stream(self.device)
        return self._default

    def read_ipc(self, src: int, name: str, offsets: Sequence[int], specs: Sequence[Sequence],
                 export: Sequence[Any] | None) -> list[torch.Tensor]:
        self.check_name(src, name)  # before its handles are kept
        if export is not None:
            self._exports[name] = export
        out = self.read(src, name, offsets, specs)
        event = self._maps[name].event
        if self.wait == "host":
            self._copied(src, name, event)
        else:
            # The executor computes on the device's default stream (and so must a stage): its
            # use of the views comes after the sender's copy.
            event.wait(self._default_stream())
        return out

    def _copied(self, src: int, name: str, event: Any) -> None:
        """Wait on this thread until the sender's copy into slot `name` is done, within timeout_s
        (polling: a GPU that never gets there must not hold the header thread for good). The
        views are then read on the default stream like any other (reap() counts on it)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout_s:.0f}s for rank {src}'s copy into CUDA IPC slot {name}; "
                                   "its GPU is stuck (raise MAESTRO_COLLECTIVE_S if copies can be that slow)")
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 1e-3)  # a few polls at once, then at most every millisecond

    def _open(self, src: int, name: str) -> _OpenedSlot:
        export = self._exports.pop(name, None)
        if export is None:
            raise ValueError(f"rank {src} sent CUDA IPC slot {name} without its handles")
        return _OpenedSlot(name, export, self.device)

    @property
    def outstanding(self) -> int:
        return super().outstanding + len(self._draining)

    def reap(self) -> dict[int, list[str]]:
        """Slots with no view left and whose uses on the device are done, by sender rank."""
        done: dict[int, list[str]] = {}
        with self._drain_lock:
            stream = self._default_stream()  # where the views were used (read_ipc)
            for src, names in super().reap().items():
                for name in names:
                    event = torch.cuda.Event()
                    event.record(stream)
                    self._draining.append((src, name, event))
            keep = []
            for src, name, event in self._draining:
                if event.query():
                    done.setdefault(src, []).append(name)
                else:
                    keep.append((src, name, event))
            self._draining = keep
        return done
