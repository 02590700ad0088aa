"""What `maestro stage` prints about a section's micro-batches: shapes, statistics, timings,
and the differences from recorded outputs (runtime/replay.py)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import torch

from maestro_flow.runtime.record import TextOnly

# -- report ----------------------------------------------------------------------------------------

def _shape_summary(shapes: list[tuple[int, ...]]) -> str:
    if not shapes:
        return "-"
    if all(s == shapes[0] for s in shapes):
        return f"{len(shapes)} x {list(shapes[0])}" if len(shapes) > 1 else str(list(shapes[0]))
    if all(len(s) == len(shapes[0]) for s in shapes):
        dims = []
        for d in range(len(shapes[0])):
            lo, hi = min(s[d] for s in shapes), max(s[d] for s in shapes)
            dims.append(str(lo) if lo == hi else f"{lo}..{hi}")
        return f"{len(shapes)} x [{', '.join(dims)}]"
    return ", ".join(str(list(s)) for s in shapes)


def _stats(tensors: list[torch.Tensor]) -> str:
    values = [t.detach().reshape(-1) for t in tensors if t.numel()]
    if not values:
        return "empty"
    if not all(v.is_floating_point() or v.is_complex() for v in values):
        flat = torch.cat([v.to(torch.int64).cpu() for v in values])
        return f"min {int(flat.min())}  max {int(flat.max())}"
    flat = torch.cat([v.double().cpu() for v in values])
    nan, inf = int(torch.isnan(flat).sum()), int(torch.isinf(flat).sum())
    finite = flat[torch.isfinite(flat)]
    if finite.numel():
        std = float(finite.std()) if finite.numel() > 1 else 0.0
        text = (f"mean {float(finite.mean()):.4g}  std {std:.4g}  min {float(finite.min()):.4g}  "
                f"max {float(finite.max()):.4g}")
    else:
        text = "no finite value"
    flags = f"  NaN {nan}" if nan else ""
    flags += f"  Inf {inf}" if inf else ""
    return text + (flags or "  NaN/Inf none")


def describe_value(value: Any) -> str:
    """Shapes, dtype and statistics of one output (or input/column) value."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            v = value.detach().double()
            bad = "  NaN" if torch.isnan(v) else ("  Inf" if torch.isinf(v) else "")
            return f"scalar {str(value.dtype).removeprefix('torch.')}  value {float(v):.6g}{bad}"
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}  {_stats([value])}"
    if isinstance(value, (list, tuple)):
        tensors = [x for x in value if isinstance(x, torch.Tensor)]
        nones = sum(x is None for x in value)
        others = len(value) - len(tensors) - nones
        if not tensors:
            return f"{len(value)} entries, {nones} None" + (f", {others} other" if others else "")
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        text = f"{_shape_summary([tuple(t.shape) for t in tensors])} {'/'.join(dtypes)}"
        if nones:
            text += f" (+{nones} None)"
        return f"{text}  {_stats(tensors)}"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return repr(value)


def _column_summary(values: list[Any]) -> str:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors})
        nones = sum(v is None for v in values)
        return f"{_shape_summary([tuple(t.shape) for t in tensors])} {'/'.join(dtypes)}" + (
            f" (+{nones} None)" if nones else "")
    blobs = [v for v in values if isinstance(v, (bytes, bytearray))]
    if blobs:
        nones = sum(v is None for v in values)
        return f"{len(blobs)} x bytes ({min(map(len, blobs))}..{max(map(len, blobs))})" + (
            f" (+{nones} None)" if nones else "")
    shown = values if len(values) <= 8 else [*values[:8], "..."]
    return "[" + ", ".join(map(str, shown)) + "]"


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.2f} ms"


# -- comparison ------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True)
class Diff:
    name: str
    max_abs: float = 0.0
    max_rel: float = 0.0
    ok: bool = True
    problem: str = ""
    compared: bool = True  # False: only the recorded value's text was kept (TextOnly)


def _tensor_diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, bool, str]:
    if tuple(a.shape) != tuple(b.shape):
        return math.inf, math.inf, False, f"shape {list(a.shape)} vs recorded {list(b.shape)}"
    if a.numel() == 0:
        return 0.0, 0.0, True, ""
    x, y = a.detach().cpu().double(), b.detach().cpu().double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    same_inf = torch.isinf(x) & (x == y)
    diff = (x - y).abs()
    diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    rel = diff / y.abs().clamp_min(1e-12)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    ok = bool((diff <= atol + rtol * y.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)).all())
    return float(diff.max()), float(rel.max()), ok, ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number_diff(value: float, ref: float, atol: float, rtol: float) -> tuple[float, float, bool]:
    """As `_tensor_diff` for one number: NaN against a recorded NaN (or the same infinity) is equal."""
    if (math.isnan(value) and math.isnan(ref)) or (math.isinf(ref) and value == ref):
        return 0.0, 0.0, True
    diff = abs(value - ref)
    if math.isnan(diff):
        return math.inf, math.inf, False
    rel = diff / max(abs(ref), 1e-12) if diff else 0.0
    return diff, rel, diff <= atol + rtol * (abs(ref) if math.isfinite(ref) else 0.0)


def _kind(value: Any) -> str:
    return "a tensor" if isinstance(value, torch.Tensor) else repr(value)


def compare_outputs(got: dict[str, Any], want: dict[str, Any], atol: float, rtol: float) -> list[Diff]:
    """Per output name: the largest absolute/relative difference from the recorded value and
    whether every element is within atol + rtol * |recorded| (tensors, numbers and the numbers
    of a list alike; NaN where the recording has NaN counts as equal)."""
    diffs = []
    for name, ref in want.items():
        d = Diff(name=name)
        diffs.append(d)
        if name not in got:
            d.ok, d.problem = False, "missing from the replayed outputs"
            continue
        mine = got[name]
        if isinstance(ref, TextOnly):
            d.compared, d.problem = False, "recorded as text only: not compared"
        elif isinstance(ref, list):
            if not isinstance(mine, (list, tuple)) or len(mine) != len(ref):
                d.ok, d.problem = False, (f"{len(mine) if isinstance(mine, (list, tuple)) else type(mine).__name__} "
                                          f"entries vs recorded {len(ref)}")
                continue
            text_only = 0
            for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
                if isinstance(b, TextOnly):
                    text_only += 1
                elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                    ma, mr, ok, problem = _tensor_diff(a, b, atol, rtol)
                    d.max_abs, d.max_rel = max(d.max_abs, ma), max(d.max_rel, mr)
                    if not ok:
                        d.ok = False
                        d.problem = d.problem or (f"entry {i}: {problem}" if problem else "")
                elif _is_number(a) and _is_number(b):
                    ma, mr, ok = _number_diff(float(a), float(b), atol, rtol)
                    d.max_abs, d.max_rel = max(d.max_abs, ma), max(d.max_rel, mr)
                    if not ok:
                        d.ok = False
                        d.problem = d.problem or f"entry {i}: {a!r} vs recorded {b!r}"
                elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
                    d.ok, d.problem = False, f"entry {i}: {_kind(a)} vs recorded {_kind(b)}"
                    break
            if text_only and d.ok:
                d.compared = text_only < len(ref)
                d.problem = f"{text_only} of {len(ref)} entries recorded as text only: not compared"
        elif isinstance(ref, torch.Tensor):
            if not isinstance(mine, torch.Tensor):
                d.ok, d.problem = False, f"{type(mine).__name__} vs a recorded tensor"
                continue
            d.max_abs, d.max_rel, d.ok, d.problem = _tensor_diff(mine, ref, atol, rtol)
        elif _is_number(ref):
            value = float(mine) if isinstance(mine, (int, float, torch.Tensor)) and (
                not isinstance(mine, torch.Tensor) or mine.numel() == 1) else None
            if value is None:
                d.ok, d.problem = False, f"{type(mine).__name__} vs recorded number {ref}"
                continue
            d.max_abs, d.max_rel, d.ok = _number_diff(value, float(ref), atol, rtol)
        elif mine != ref:
            d.ok, d.problem = False, f"{mine!r} vs recorded {ref!r}"
    return diffs
