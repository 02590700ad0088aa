"""Sample metadata and the SampleSource protocol that dataset readers implement.

Pure (standard library only). The coordinator reads only metadata (cheap columns); workers read
payload rows by row index through a SampleSource of their own. Concrete readers live in
`loaders/` and are named by `ArrowData.source` ("module:Class").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

MODALITIES = ("text", "image", "audio")  # what a sample may carry (a dataset's modalities column)


@dataclass(frozen=True, kw_only=True, slots=True)
class SampleMeta:
    """The cheap part of a sample: what the planner and the cost model need."""

    id: int
    row: int = -1  # row index in the dataset (-1 when the sample comes from a trace)
    modalities: frozenset[str] = frozenset({"text"})
    num_tokens: int = 0
    num_patches: int = 0
    num_frames: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "row": self.row, "modalities": sorted(self.modalities),
                "num_tokens": self.num_tokens, "num_patches": self.num_patches, "num_frames": self.num_frames}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> SampleMeta:
        """From a JSON object (a trace line): ValueError naming the field for modalities that are not a
        list of known names, or for an id, row or count that is not an integer (counts: >= 0)."""
        modalities = d.get("modalities", ("text",))
        if not isinstance(modalities, (list, tuple)) or not modalities \
                or not all(isinstance(m, str) and m in MODALITIES for m in modalities):
            raise ValueError(f"modalities must be a non-empty list of {', '.join(MODALITIES)}, got {modalities!r}")
        return SampleMeta(id=_integer(d, "id"), row=_integer(d, "row", -1), modalities=frozenset(modalities),
                          num_tokens=_integer(d, "num_tokens", 0, low=0),
                          num_patches=_integer(d, "num_patches", 0, low=0),
                          num_frames=_integer(d, "num_frames", 0, low=0))


def _integer(d: dict[str, Any], key: str, default: int | None = None, *, low: int | None = None) -> int:
    """`d[key]` as an int: an integer, or a float with an integral value (JSON writers may write 5.0), at
    least `low`; `default` where absent or null (no default: KeyError where absent). A ValueError naming
    `key` otherwise: 1e400 (inf), NaN, 2.5, "5", true."""
    value = d[key] if default is None else d.get(key)
    if value is None and default is not None:
        value = default
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or (low is not None and value < low):
        raise ValueError(f"{key} must be an integer{f' >= {low}' if low is not None else ''}, got {value!r}")
    return int(value)


class SampleSource(Protocol):
    """A dataset reader, built as `Source(data: ArrowData)` in the coordinator and in each worker.

    Construction must be cheap and must fail with `PipelineError` (naming the path or column)
    when the dataset is missing or lacks a required column.
    """

    @property
    def column_names(self) -> tuple[str, ...]: ...

    def __len__(self) -> int: ...

    def metadata(self) -> list[SampleMeta]:
        """Metadata of every row, in file order (row = index)."""
        ...

    def read(self, rows: Sequence[int], columns: Sequence[str] | None = None) -> dict[str, list[Any]]:
        """Column name -> one value per requested row (list columns as numpy arrays)."""
        ...
