"""Tensor payloads point-to-point over torch.distributed, described by a small msgpack header.

Runs in a worker's channel threads (one sending and one receiving thread per channel, so a slow
pair never blocks another). A message is a list of per-sample tensors; tensors of at least
`COALESCE_BYTES` go as they are (no copy), smaller ones are packed into one flat buffer per
dtype so that many tiny tensors cost one transfer. All sends (or receives) of a message are
posted at once and then awaited. Order per channel is the order of headers, which the sender
emits in its execution order; each channel has its own process group, so matched operations
never interleave with another channel's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

COALESCE_BYTES = 1 << 20
Item = tuple[int, str, "torch.Tensor | None"]  # (sample id, tensor name, tensor or None)


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
            buffers.append(t.detach().contiguous())
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


def allocate(specs: Sequence[Sequence[Any]], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(int(n), dtype=getattr(torch, d), device=device) for d, n in specs]


def unpack(entries: Sequence[Sequence[Any]], buffers: Sequence[torch.Tensor]) -> list[Item]:
    out: list[Item] = []
    for sid, name, _dtype, shape, buf, offset in entries:
        if buf < 0:
            out.append((sid, name, None))
            continue
        flat = buffers[buf]
        numel = 1
        for d in shape:
            numel *= d
        out.append((sid, name, flat[offset:offset + numel].view(shape)))
    return out


def send_buffers(buffers: Sequence[torch.Tensor], peer: int, group: Any) -> None:
    """Post every send of a message at once, then wait for all of them."""
    works = [dist.isend(b, dst=peer, group=group) for b in buffers]
    for w in works:
        w.wait()


def recv_buffers(buffers: Sequence[torch.Tensor], peer: int, group: Any) -> None:
    works = [dist.irecv(b, src=peer, group=group) for b in buffers]
    for w in works:
        w.wait()
