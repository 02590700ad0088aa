"""The same-host path for CPU tensors: reused shared-memory slots, zero-copy on the receiving side.

Runs inside worker processes, under transport/tensor_comm.py. Between two CPU workers on one
host (the same kernel and the same /dev/shm, transport/host.host_key), a message's buffers are copied once,
by the sender, into a slot: a file in /dev/shm that the sender created and keeps for reuse. The
header (over ZeroMQ, as for gloo) names the slot and each buffer's offset; the receiver maps the
slot once and delivers tensors that are views of it, so the bytes are never copied again. When
every view of a message is gone (the executor dropped the tensors), the receiver sends the slot
back ("release") and the sender reuses it for a later message of the same channel.

Slots are never awaited: a sender without a free slot that fits makes a new one, so a consumer
that holds many messages (an LLM keeping a step's image embeddings until its backward) can never
block its producer; spare slots beyond `SPARE` (or `SPARE_BYTES`) per channel are removed, the
smallest first, and so is every slot of a channel that fell back on its process group; a
receiver unmaps the removed slots it holds within SWEEP_S, which is when their memory goes back
to the host. Reuse
is what makes the path fast: a fresh slot's pages are zeroed and faulted in on first touch, which
costs as much as the copy itself. Slot files are named
`maestro-<session>-<rank>-...`, removed by their sender when it closes, and swept by the
coordinator at the end of the run (transport/host.py), so a killed worker leaves nothing behind
either; those of a run whose coordinator was itself killed outright go at the next run's start
(host.sweep_orphans).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from maestro_flow.transport import p2p
from maestro_flow.transport.host import SHM_DIR

ALIGN = 64  # every buffer starts on a cache line (and on its dtype's alignment)
# Slots are at least this large, then powers of two, so sizes repeat and reuse works. Small: a
# slot's pages are committed when it is made, and a consumer may hold many small messages.
MIN_SLOT = 64 << 10
SPARE = 32  # free slots a channel keeps for reuse; more are removed, the smallest first
SPARE_BYTES = 512 << 20  # and at most this many bytes of them (a fresh slot costs its pages' first touch)
MAX_MAPPED = 64  # slots a receiver keeps mapped before it forgets those not in use
SWEEP_S = 1.0  # how often a receiver unmaps idle slots whose sender removed the file (their memory is freed then)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _slot_size(nbytes: int) -> int:
    size = MIN_SLOT
    while size < nbytes:
        size *= 2
    return size


class _Slot:
    def __init__(self, path: str, size: int, create: bool) -> None:
        self.path, self.size, self.name = path, size, os.path.basename(path)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, size)  # fail now (ENOSPC), not with SIGBUS on first touch
                except AttributeError:  # not on every platform
                    os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except OSError:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        # Through numpy: its array holds a buffer export of the mapping, and every tensor view holds
        # the array, so the mapping cannot be closed under a live view (close() then leaves it to
        # the views). torch.frombuffer holds no export: a worker stopping mid-step unmapped a slot
        # its compute thread was reading, which crashed it (SIGSEGV; found in QA).
        self.bytes = torch.from_numpy(np.frombuffer(self.map, dtype=np.uint8))
        self.address = self.bytes.data_ptr()  # where the sender's copies go (SlotWriter.write)

    def close(self) -> None:
        self.bytes = None
        try:
            self.map.close()
        except BufferError:  # views still exported (tensors alive): the mapping goes with them
            pass


class SlotWriter:
    """The sending side of the channels of one worker: slots by channel, free or in use. Used by
    the sending (compute) thread only; releases come in through `released`."""

    # Spare slots kept per channel (cuda_ipc keeps every device slot: its receiver maps each for good).
    spare: float = SPARE
    spare_bytes: float = SPARE_BYTES

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix  # maestro-<session>-<rank>
        self._count = 0
        self._free: dict[tuple[int, str], list[_Slot]] = {}  # channel -> free slots
        self._used: dict[str, _Slot] = {}  # slot name -> slot (sent, not released yet)
        self._channel_of: dict[str, tuple[int, str]] = {}
        self._dropped: set[tuple[int, str]] = set()  # channels gone to their process group (drop)

    def write(self, channel: tuple[int, str], buffers: Sequence[torch.Tensor]) -> tuple[str, list[int]]:
        """Copy `buffers` (CPU tensors) into a slot of `channel` (receiving rank, kind), each
        contiguous in the slot;
        (slot name, byte offset of each)."""
        offsets, sizes, total = [], [], 0
        for b in buffers:
            n = b.numel() * b.element_size()
            offsets.append(total)
            sizes.append(n)
            total = _aligned(total + n)
        slot = self._take(channel, max(total, 1))
        self._used[slot.name] = slot  # before copying: a copy that raises leaves no file behind at close
        address = slot.address  # None for cuda_ipc's device slots
        for b, off, n in zip(buffers, offsets, sizes, strict=True):
            if not n:
                continue
            if address is not None and b.device.type == "cpu" and b.is_contiguous() and not b.is_conj() \
                    and not b.is_neg() and not b._is_zerotensor() and not b.is_quantized:
                # One memmove (the GIL released) instead of three tensor operations per buffer:
                # the bytes of a dense tensor as they are (copy_ resolves a lazy conj/neg, writes
                # an efficient zero tensor's zeros, and refuses a quantized one).
                ctypes.memmove(address + off, b.data_ptr(), n)
            else:
                dst = slot.bytes[off:off + n].view(b.dtype)
                dst.copy_(b.view(-1) if b.is_contiguous() else b.reshape(-1))
        return slot.name, offsets

    def released(self, by: int, names: Sequence[str]) -> None:
        """Rank `by` is done with these slots (names of slots sent to someone else are ignored)."""
        for name in names:
            if name not in self._used or self._channel_of[name][0] != by:
                continue  # not sent to `by`, or released twice: nothing to do
            if self._channel_of[name] in self._dropped:
                self._remove(self._used.pop(name))
                continue
            free = self._free.setdefault(self._channel_of[name], [])
            free.append(self._used.pop(name))
            # Over the limits, the smallest spare slots go first: they cost the least to make again.
            while len(free) > self.spare or (self.spare_bytes != float("inf")
                                             and sum(s.size for s in free) > self.spare_bytes):
                smallest = min(free, key=lambda s: s.size)
                free.remove(smallest)
                self._remove(smallest)

    def drop(self, channel: tuple[int, str]) -> None:
        """The channel sends through its process group from now on (no slot could be made):
        its free slots are removed, and so are those still in use once released, so that the
        shared memory whose shortage caused this goes back to the host."""
        self._dropped.add(channel)
        for slot in self._free.pop(channel, []):
            self._remove(slot)

    def _take(self, channel: tuple[int, str], nbytes: int) -> _Slot:
        free = self._free.setdefault(channel, [])
        best = None  # the smallest free slot that fits
        for s in free:
            if s.size >= nbytes and (best is None or s.size < best.size):
                best = s
        if best is not None:
            free.remove(best)
            return best
        self._count += 1
        slot = self._make(self._count, _slot_size(nbytes))
        self._channel_of[slot.name] = channel
        return slot

    def _make(self, count: int, size: int) -> _Slot:
        """A new slot of `size` bytes, the `count`-th this writer makes (transport/cuda_ipc.py
        makes device slots instead)."""
        path = os.path.join(SHM_DIR, f"{self.prefix}-{count}")
        try:
            return _Slot(path, size, create=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot make a {size >> 20} MiB shared-memory slot in {SHM_DIR} "
                                     f"for tensors to a worker on this host ({exc.strerror}): give the host (or the "
                                     f"container: docker --shm-size) more shared memory, or set MAESTRO_SHM=0 to "
                                     f"send through gloo instead") from None

    def close(self) -> None:
        for slot in list(self._used.values()) + [s for free in self._free.values() for s in free]:
            self._remove(slot)
        self._used.clear()
        self._free.clear()

    def _remove(self, slot: _Slot) -> None:
        self._channel_of.pop(slot.name, None)
        slot.close()
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass


class SlotReader:
    """The receiving side: maps each sender's slots once and hands out views of them; tells
    which slots nothing refers to any more (`reap`). `read` is called by one thread (the header
    thread); `reap` may be called from another."""

    max_mapped: float = MAX_MAPPED  # a device slot's handles come once: cuda_ipc never forgets one
    sweep_s: float = SWEEP_S  # cuda_ipc: never (its sender keeps every slot)

    def __init__(self, prefix: str = "maestro") -> None:
        self.prefix = prefix  # maestro-<session>: a slot of rank r is named maestro-<session>-<r>-<n>
        self._maps: dict[str, _Slot] = {}
        self._swept = time.monotonic()
        # slot name -> (sender rank, the message's view, its storage's Python object)
        self._out: dict[str, tuple[int, torch.Tensor, torch.UntypedStorage]] = {}
        self._lock = threading.Lock()  # guards _out and _maps (read on the header thread, sweep on another)

    def read(self, src: int, name: str, offsets: Sequence[int], specs: Sequence[Sequence]) -> list[torch.Tensor]:
        """The message's buffers as views of slot `name` (specs: [dtype, numel] per buffer)."""
        self.check_name(src, name)  # at every message, a slot mapped already included
        spans = []
        for off, (dtype, numel) in zip(offsets, specs, strict=True):
            dt = p2p.dtype_named(dtype)
            spans.append((off, off + int(numel) * dt.itemsize, dt))
        end = max((e for _, e, _ in spans), default=0)
        gone: list[_Slot] = []
        with self._lock:  # from finding the mapping to holding a view of it: sweep() cannot come between
            slot = self._maps.get(name)
            if slot is None:
                if len(self._maps) >= self.max_mapped:  # senders remove spare slots: forget mappings not in use
                    gone = self._take_idle(lambda slot: True)
                slot = self._maps[name] = self._open(src, name)
            if end > slot.size or any(o < 0 for o, _, _ in spans):
                raise ValueError(f"slot {name} holds {slot.size} bytes, the header asks for bytes up to {end}")
            whole = slot.bytes[:max(end, 1)]  # one storage user for the whole message (see reap)
            out = [whole[start:stop].view(dt) for start, stop, dt in spans]
            storage = whole.untyped_storage()  # made once per message, not at every reap
            self._out[name] = (src, whole, storage)
        for old in gone:
            old.close()
        return out

    def check_name(self, src: int, name: str) -> None:
        """ValueError unless `name` is one of rank `src`'s slots of this run (found in review: any
        maestro-* file was mapped read-write on a header's word, another rank's or another run's)."""
        if "/" in name or not name.startswith(f"{self.prefix}-{src}-"):
            raise ValueError(f"not a slot of rank {src} of this run: {name!r}")

    def _open(self, src: int, name: str) -> _Slot:
        """Map a slot the first time a message names it (transport/cuda_ipc.py opens device slots)."""
        path = os.path.join(SHM_DIR, name)
        return _Slot(path, os.stat(path).st_size, create=False)

    @property
    def outstanding(self) -> int:
        return len(self._out)

    def reap(self) -> dict[int, list[str]]:
        """Slots whose views are all gone, by sender rank (to send back)."""
        done: dict[int, list[str]] = {}
        with self._lock:
            for name, (src, _whole, storage) in list(self._out.items()):
                # Users of the slot's storage with no view of the message alive: the slot's own
                # tensor, the message's base and the storage's Python object kept with it.
                if torch._C._storage_Use_Count(storage._cdata) <= 3:
                    del self._out[name]
                    done.setdefault(src, []).append(name)
        self.sweep()
        return done

    def sweep(self) -> None:
        """At most every sweep_s: unmap the idle slots whose sender removed the file (spares
        over its limits, a channel dropped), whose memory stays the host's until the last
        mapping goes. Called from reap, and by the receiving worker when it has nothing
        outstanding (tensor_comm.reap)."""
        if time.monotonic() - self._swept >= self.sweep_s:
            self._swept = time.monotonic()
            with self._lock:  # read() takes idle slots under it too
                gone = self._take_idle(lambda slot: not os.path.exists(slot.path))
            for slot in gone:
                slot.close()

    def _take_idle(self, which) -> list[_Slot]:
        """The idle slots `which` picks, taken out of the mappings (the lock held): each goes once."""
        idle = [(n, s) for n, s in self._maps.items() if n not in self._out and which(s)]
        for name, _ in idle:
            del self._maps[name]
        return [s for _, s in idle]

    def close(self) -> None:
        with self._lock:
            self._out.clear()
        for slot in self._maps.values():
            slot.close()
        self._maps.clear()
