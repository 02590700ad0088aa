"""Tensor payloads point-to-point over torch.distributed, described by a small msgpack header.

Runs in a worker's channel threads (one sending and one receiving thread per channel, so a slow
pair never blocks another). A message is a list of per-sample tensors; tensors of at least
`COALESCE_BYTES` go as they are (no copy), smaller ones are packed into one flat buffer per
dtype so that many tiny tensors cost one transfer. All sends (or receives) of a message are
posted at once and then awaited. Order per channel is the order of headers, which the sender
emits in its execution order; the channels of one edge and direction share a process group
(runtime/topology.process_groups) in which each rank pair has one channel, so matched
operations never interleave with another channel's. CUDA tensors crossing a gloo group (a CPU section's
edge, or ranks that share one GPU) are staged through pinned host memory (`to_host`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

COALESCE_BYTES = 1 << 20
Item = tuple[int, str, "torch.Tensor | None"]  # (sample id, tensor name, tensor or None)


def pack_each(items: Sequence[Item]) -> tuple[list[list[Any]], list[list[Any]], list[torch.Tensor]]:
    """Like `pack`, but every tensor its own buffer, never concatenated: the shared-memory path
    copies each buffer into its slot once, so coalescing would copy small tensors twice."""
    entries: list[list[Any]] = []
    buffers: list[torch.Tensor] = []
    specs: list[list[Any]] = []
    for sid, name, t in items:
        if t is None:
            entries.append([sid, name, None, None, -1, 0])
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append([sid, name, dtype, list(t.shape), len(buffers), 0])
        buffers.append(t.detach())
        specs.append([dtype, t.numel()])
    return entries, specs, buffers


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` as plain bytes a process group can send: a lazy conjugate or negative resolved, an
    efficient zero tensor made real, contiguous (torch.cat does all this for the coalesced
    small tensors; shared memory copies with copy_, which does it too)."""
    t = t.detach()
    if t._is_zerotensor():
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return t.resolve_conj().resolve_neg().contiguous()


def pack(items: Sequence[Item]) -> tuple[list[list[Any]], list[list[Any]], list[torch.Tensor]]:
    """Items -> (header entries, buffer specs, buffers to send)."""
    entries: list[list[Any]] = []
    buffers: list[torch.Tensor] = []
    specs: list[list[Any]] = []
    small: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for sid, name, t in items:
        if t is None:
            entries.append([sid, name, None, None, -1, 0])
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        entry = [sid, name, dtype, list(t.shape), -1, 0]
        entries.append(entry)
        if t.numel() * t.element_size() >= COALESCE_BYTES:
            entry[4] = len(buffers)
            buffers.append(dense(t))
            specs.append([dtype, t.numel()])
        else:
            small.setdefault(t.dtype, []).append((len(entries) - 1, t))
    for dtype, group in small.items():
        offset = 0
        for idx, t in group:
            entries[idx][4], entries[idx][5] = len(buffers), offset
            offset += t.numel()
        buffers.append(torch.cat([t.detach().reshape(-1) for _, t in group]))
        specs.append([str(dtype).removeprefix("torch."), offset])
    return entries, specs, buffers


_DTYPES: dict[str, torch.dtype] = {}


def dtype_named(name: str) -> torch.dtype:
    """A dtype from its name in a header (only torch dtypes: never an arbitrary attribute)."""
    dt = _DTYPES.get(name) if isinstance(name, str) else None
    if dt is None:
        dt = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"not a dtype: {name!r}")
        _DTYPES[name] = dt
    return dt


def allocate(specs: Sequence[Sequence[Any]], device: torch.device,
             pool: BufferPool | None = None) -> list[torch.Tensor]:
    if pool is not None:
        return [pool.take(dtype_named(d), _count(n), device) for d, n in specs]
    return [torch.empty(_count(n), dtype=dtype_named(d), device=device) for d, n in specs]


def _count(n: Any) -> int:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"not an element count: {n!r}")
    return n


class BufferPool:
    """Reuses large receive buffers once nothing refers to them any more.

    Delivered tensors are views of a flat receive buffer; the buffer is free again when its
    storage has no user but the pool (the executor dropped every view). Reuse matters for large
    messages: a fresh allocation above the allocator's mmap threshold page-faults and zeroes
    every page, which halves the bandwidth of 64 MiB transfers here. Used by one thread.
    """

    MIN_BYTES = 1 << 20
    PER_SIZE = 4

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int, torch.device], list[torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        if numel * torch.empty((), dtype=dtype).element_size() < self.MIN_BYTES:
            return torch.empty(numel, dtype=dtype, device=device)
        buffers = self._free.setdefault((dtype, numel, torch.device(device)), [])
        for buf in buffers:
            # 2 users: the pool's tensor and the temporary storage object of this check. The
            # caller gets a view, which counts as a user until it and every tensor cut from it
            # (the delivered per-sample tensors) are gone, receive in flight included.
            if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2:
                return buf[:]
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(buffers) < self.PER_SIZE:
            buffers.append(buf)
        return buf[:]


def unpack(entries: Sequence[Sequence[Any]], buffers: Sequence[torch.Tensor]) -> list[Item]:
    out: list[Item] = []
    for sid, name, _dtype, shape, buf, offset in entries:
        if buf == -1:
            out.append((sid, name, None))
            continue
        flat = buffers[buf]
        numel = 1
        for d in shape:
            numel *= d
        if offset == 0 and numel == flat.numel():  # the whole buffer (pack_each's, a large tensor's)
            out.append((sid, name, flat.view(shape)))
        else:
            out.append((sid, name, flat[offset:offset + numel].view(shape)))
    return out


def through_host(group: Any, device: torch.device) -> bool:
    """Whether CUDA tensors must cross `group` through host memory: gloo moves host memory only
    (it carries the edges between a CPU and a CUDA section, and ranks sharing one GPU, which
    NCCL refuses)."""
    return device.type == "cuda" and dist.get_backend(group) == "gloo"


def to_host(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Pinned host copies of CUDA buffers (copied asynchronously, then one stream sync)."""
    out, devices = [], set()
    for b in buffers:
        if b.is_cuda:
            host = torch.empty(b.shape, dtype=b.dtype, pin_memory=True)
            host.copy_(b, non_blocking=True)
            devices.add(b.device)
            out.append(host)
        else:
            out.append(b)
    for d in devices:
        torch.cuda.current_stream(d).synchronize()
    return out


def post_sends(buffers: Sequence[torch.Tensor], peer: int, group: Any) -> list[Any]:
    """Post every send of a message at once; the caller waits on the returned works."""
    return [dist.isend(b, dst=peer, group=group) for b in buffers]


def post_recvs(buffers: Sequence[torch.Tensor], peer: int, group: Any) -> list[Any]:
    return [dist.irecv(b, src=peer, group=group) for b in buffers]


def post_broadcasts(buffers: Sequence[torch.Tensor], src: int, group: Any) -> list[Any]:
    """A tensor-parallel leader relaying to its group (src = the leader), or a member receiving.
    As bytes: a typed broadcast refuses dtypes (int16, uint16, uint32, float8) that isend carries."""
    return [dist.broadcast(b.view(torch.uint8), src=src, group=group, async_op=True) for b in buffers]


def wait_all(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()
