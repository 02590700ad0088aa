"""ArrowSource: the SampleSource for Arrow IPC files and Parquet files/folders (DESIGN 5.1b).

Built as `ArrowSource(data: ArrowData)` in the coordinator (which calls `metadata()` once) and in
every entry-section worker (which calls `read(rows)` per micro-batch). It knows nothing about
sections, plans or tensors: it maps row indices to column values.

The file is cut into *segments*: the record batches of an Arrow IPC file (memory-mapped, so a
segment is a zero-copy view of the map) or the row groups of the Parquet files (read on demand,
only the requested columns, the last one cached). Construction reads only schemas and footers.
`metadata()` scans the cheap parts of every segment — ids, modalities, list lengths from offsets,
null bitmaps — without turning any token into a Python object, and checks every row against the
contract: declared modalities must match the image/audio columns (or the columns
`data.modality_columns` names for them, e.g. precomputed `pixel_values`), ids must be unique.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyarrow import ipc

from maestro_flow import ArrowData, PipelineError
from maestro_flow.samples import SampleMeta

KNOWN_MODALITIES = ("text", "image", "audio")
# One audio "frame" is a 10 ms hop of the waveform (the usual mel-spectrogram hop); used for
# `num_frames` when the dataset has no precomputed `num_frames` column.
AUDIO_FRAME_S = 0.01

_REQUIRED = ("id int64, modalities list<string>, tokens list<int32>")
_BIT = {name: 1 << i for i, name in enumerate(KNOWN_MODALITIES)}
_ARROW_MAGIC = b"ARROW1"
INT32_END = 1 << 31
_PARQUET_MAGIC = b"PAR1"


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


# Column name -> (type check, expected type in words). Required columns first.
_TYPE_RULES: dict[str, tuple[Any, str]] = {
    "id": (pa.types.is_integer, "int64"),
    "modalities": (lambda t: _is_list(t) and _is_string(t.value_type), "list<string>"),
    "tokens": (lambda t: _is_list(t) and pa.types.is_integer(t.value_type), "list<int32>"),
    "image": (_is_binary, "binary"),
    "audio": (lambda t: _is_list(t) and pa.types.is_floating(t.value_type), "list<float32>"),
    "sample_rate": (pa.types.is_integer, "int32"),
    "num_patches": (pa.types.is_integer, "int32"),
    "num_frames": (pa.types.is_integer, "int32"),
}
_REQUIRED_COLUMNS = ("id", "modalities", "tokens")


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of rows [start, start + num_rows): one IPC record batch or one Parquet row group."""

    start: int
    num_rows: int
    batch: pa.RecordBatch | None = None  # Arrow IPC: zero-copy view of the memory map
    file: int = -1  # Parquet: index into the file list
    row_group: int = -1


def _row_group_offset(rg: Any) -> int:
    """Where a Parquet row group's first page starts in its file."""
    col = rg.column(0)
    return min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None and o > 0)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _as_array(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            return col.chunk(0)
        return col.combine_chunks() if col.num_chunks else pa.array([], type=col.type)
    return col


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return arr.is_valid().to_numpy(zero_copy_only=False)


def _ints(arr: pa.Array) -> np.ndarray:
    """Integer column as int64 numpy, nulls as 0."""
    if arr.null_count:
        arr = pc.fill_null(arr, 0)
    return arr.cast(pa.int64()).to_numpy(zero_copy_only=False)


def _list_lengths(arr: pa.Array) -> np.ndarray:
    """Per-row list lengths from the offsets alone (nulls as 0); never touches the values."""
    return _ints(pc.list_value_length(arr))


class ArrowSource:
    """Reads samples from an Arrow IPC file (`.arrow`) or a Parquet file or folder of `.parquet` files.

    `read()` returns numeric list columns (tokens, audio, ...) as numpy arrays that are read-only
    zero-copy views of the memory map for Arrow IPC files: copy one before mutating it. `tokens`
    always comes back as int32.
    """

    def __init__(self, data: ArrowData) -> None:
        self._data = data
        self._path = os.path.abspath(os.path.expanduser(str(data.path)))
        if not os.path.exists(self._path):
            raise PipelineError(f"data.path: no such file: {self._path}")
        self._parquet_files: list[pq.ParquetFile] = []
        self._parquet_paths: list[str] = []
        self._cache: tuple[int, frozenset[str], pa.Table] | None = None  # last Parquet row group read
        if os.path.isdir(self._path):
            schema, segments = self._open_parquet_folder()
        else:
            schema, segments = self._open_file()
        self._schema: pa.Schema = schema
        self._segments: list[_Segment] = [s for s in segments if s.num_rows > 0]
        self._starts = np.array([s.start for s in self._segments], dtype=np.int64)
        self._num_rows = sum(s.num_rows for s in segments)
        self._check_schema()
        self._scan: tuple[list[SampleMeta], list[int], list[int]] | None = None

    # -- opening -----------------------------------------------------------------------------

    def _open_file(self) -> tuple[pa.Schema, list[_Segment]]:
        try:
            with open(self._path, "rb") as f:
                magic = f.read(6)
        except OSError as exc:
            raise PipelineError(f"data.path: cannot read {self._path} ({_first_line(exc)})") from None
        if magic.startswith(_PARQUET_MAGIC):
            return self._open_parquet([self._path])
        try:
            source = pa.memory_map(self._path, "r")
            self._map_base = source.read_buffer(1).address  # zero-copy: buffers' addresses are in the map
            source.seek(0)
            if magic == _ARROW_MAGIC:
                reader = ipc.open_file(source)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            else:  # the IPC *stream* format has no magic; zero-copy from the map as well
                reader = ipc.open_stream(source)
                batches = list(reader)
            schema = reader.schema
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise PipelineError(
                f"data.path: not a readable Arrow IPC or Parquet file: {self._path} ({_first_line(exc)})"
            ) from None
        segments, start = [], 0
        for batch in batches:
            segments.append(_Segment(start=start, num_rows=batch.num_rows, batch=batch))
            start += batch.num_rows
        return schema, segments

    def _open_parquet_folder(self) -> tuple[pa.Schema, list[_Segment]]:
        names = sorted(n for n in os.listdir(self._path) if n.endswith(".parquet") and not n.startswith("."))
        if not names:
            raise PipelineError(f"data.path: no .parquet files in folder {self._path}")
        return self._open_parquet([os.path.join(self._path, n) for n in names])

    def _open_parquet(self, paths: list[str]) -> tuple[pa.Schema, list[_Segment]]:
        schema: pa.Schema | None = None
        segments, start = [], 0
        for i, path in enumerate(paths):
            try:
                pf = pq.ParquetFile(path, memory_map=True)
                file_schema = pf.schema_arrow
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise PipelineError(
                    f"data.path: not a readable Arrow IPC or Parquet file: {path} ({_first_line(exc)})"
                ) from None
            if schema is None:
                schema = file_schema
            elif not file_schema.remove_metadata().equals(schema.remove_metadata()):
                raise PipelineError(
                    f"data.path: {path} has a different schema from {paths[0]} (all Parquet files of a "
                    "folder must have the same columns and types)"
                )
            self._parquet_files.append(pf)
            self._parquet_paths.append(path)
            for rg in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(rg).num_rows
                segments.append(_Segment(start=start, num_rows=n, file=i, row_group=rg))
                start += n
        assert schema is not None
        return schema, segments

    def _check_schema(self) -> None:
        names = self._schema.names
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise PipelineError(f"data.path: column {dup!r} appears twice in {self._path}")
        for name in _REQUIRED_COLUMNS:
            if name not in names:
                raise PipelineError(
                    f"data.path: required column {name!r} is missing in {self._path} "
                    f"(required: {_REQUIRED}; found: {', '.join(names) or 'none'})"
                )
        for modality, column in self._data.modality_columns.items():
            if column not in names:
                raise PipelineError(f"data.modality_columns.{modality}: no column {column!r} in {self._path} "
                                    f"(columns: {', '.join(names)})")
        for name, (ok, expected) in _TYPE_RULES.items():
            if name in ("image", "audio") and self._data.column_of(name) != name:
                continue  # the modality's payload is in another column; this one is just data
            if name in names and not ok(self._schema.field(name).type):
                raise PipelineError(
                    f"data.path: column {name!r} must be {expected}, got {self._schema.field(name).type} "
                    f"in {self._path}"
                )
        if self._data.column_of("audio") in names and "sample_rate" not in names:
            raise PipelineError(f"data.path: column 'audio' needs a 'sample_rate' column (int32) in {self._path}")

    # -- SampleSource ------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(self._schema.names)

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    def __len__(self) -> int:
        return self._num_rows

    def metadata(self) -> list[SampleMeta]:
        """Metadata of every good row in file order (`row` = index in the file).

        Raises PipelineError on the first bad row unless `data.skip_bad_rows`, in which case bad
        rows are left out and counted in `num_skipped` / `skipped_ids` / `skipped_rows`.
        """
        return list(self._scanned()[0])

    @property
    def num_skipped(self) -> int:
        """How many bad rows `metadata()` left out (scans the file on first use)."""
        return len(self._scanned()[1])

    @property
    def skipped_rows(self) -> tuple[int, ...]:
        return tuple(self._scanned()[1])

    @property
    def skipped_ids(self) -> tuple[int, ...]:
        """Ids of the skipped rows (rows with a null id have none and appear only in `skipped_rows`)."""
        return tuple(self._scanned()[2])

    def read(self, rows: Sequence[int], columns: Sequence[str] | None = None) -> dict[str, list[Any]]:
        """Column name -> one value per requested row, in the requested order.

        Numeric list columns come back as 1-D numpy arrays (tokens as int32), binary columns as
        bytes, strings as str, other lists and scalars as Python values; a null is None.
        """
        names = list(self._schema.names) if columns is None else list(dict.fromkeys(columns))
        for name in names:
            if name not in self._schema.names:
                raise PipelineError(
                    f"data: column {name!r} is not in {self._path} (columns: {', '.join(self._schema.names)})"
                )
        idx = np.asarray(rows, dtype=np.int64).reshape(-1)
        out: dict[str, list[Any]] = {name: [None] * len(idx) for name in names}
        if len(idx) == 0:
            return out
        if idx.min() < 0 or idx.max() >= self._num_rows:
            bad = int(idx[(idx < 0) | (idx >= self._num_rows)][0])
            raise IndexError(f"row {bad} is out of range for {self._path} ({self._num_rows} rows)")
        seg_of = np.searchsorted(self._starts, idx, side="right") - 1
        # One pass per segment (in file order) so that a Parquet row group is read once per call.
        for seg_i in np.unique(seg_of):
            seg = self._segments[seg_i]
            positions = np.nonzero(seg_of == seg_i)[0]
            local = idx[positions] - seg.start
            table = self._segment_columns(int(seg_i), names)
            for name in names:
                values = _extract(_as_array(table.column(name)), local, as_int32=(name == "tokens"))
                col = out[name]
                for p, v in zip(positions.tolist(), values, strict=False):
                    col[p] = v
        return out

    # -- internals ---------------------------------------------------------------------------

    def _segment_columns(self, seg_i: int, names: list[str], *, cache: bool = True) -> pa.RecordBatch | pa.Table:
        seg = self._segments[seg_i]
        if seg.batch is not None:
            return seg.batch.select(names)
        key = frozenset(names)
        if self._cache is not None and self._cache[0] == seg_i and key <= self._cache[1]:
            return self._cache[2]
        try:
            table = self._parquet_files[seg.file].read_row_group(seg.row_group, columns=names)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise PipelineError(f"data.path: {self._parquet_paths[seg.file]} is corrupt: {self._row_group_where(seg)} "
                                f"cannot be read ({_first_line(exc)})") from None
        if cache:
            self._cache = (seg_i, key, table)
        return table

    def rows_with_tokens_outside(self, end: int) -> list[int]:
        """Rows whose tokens hold an id at or above `end` (a stage's vocabulary), in file order."""
        rows: list[int] = []
        for seg_i, seg in enumerate(self._segments):
            table = self._segment_columns(seg_i, ["tokens"], cache=False)
            out = token_rows_outside(_as_array(table.column("tokens")), 0, end)
            rows.extend((seg.start + np.nonzero(out)[0]).tolist())
        return rows

    def _validate(self, seg_i: int, table: pa.RecordBatch | pa.Table) -> None:
        """Every offset and length of a segment checked (a corrupt file must not crash a reader)."""
        try:
            table.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            seg = self._segments[seg_i]
            if seg.batch is not None:
                where = f"record batch {seg_i} (rows {seg.start}..{seg.start + seg.num_rows - 1}"
                offset = self._file_offset(seg.batch)
                where += f", at byte {offset})" if offset is not None else ")"
                path = self._path
            else:
                path, where = self._parquet_paths[seg.file], self._row_group_where(seg)
            raise PipelineError(f"data.path: {path} is corrupt: {where} fails validation ({_first_line(exc)})") from None

    def _row_group_where(self, seg: _Segment) -> str:
        offset = _row_group_offset(self._parquet_files[seg.file].metadata.row_group(seg.row_group))
        return f"row group {seg.row_group} (rows {seg.start}..{seg.start + seg.num_rows - 1}, at byte {offset})"

    def _file_offset(self, batch: pa.RecordBatch) -> int | None:
        """Where a memory-mapped record batch's buffers start in the file."""
        addresses = [b.address for col in batch.columns for b in col.buffers() if b is not None]
        base = getattr(self, "_map_base", None)
        return min(addresses) - base if addresses and base is not None else None

    def _scanned(self) -> tuple[list[SampleMeta], list[int], list[int]]:
        if self._scan is None:
            self._scan = self._scan_rows()
        return self._scan

    def _scan_rows(self) -> tuple[list[SampleMeta], list[int], list[int]]:
        names = self._schema.names
        payload = {m: self._data.column_of(m) for m in ("image", "audio")}
        wanted = list(dict.fromkeys(c for c in ("id", "modalities", "tokens", payload["image"], payload["audio"],
                                                "sample_rate", "num_patches", "num_frames") if c in names))
        metas: list[SampleMeta] = []
        skipped_rows: list[int] = []
        skipped_ids: list[int] = []
        all_ids: list[np.ndarray] = []
        first_bad: str | None = None
        num_bad = 0
        mod_sets = {m: frozenset(k for k, b in _BIT.items() if m & b) for m in range(1 << len(_BIT))}
        for seg_i, seg in enumerate(self._segments):
            table = self._segment_columns(seg_i, wanted, cache=False)
            self._validate(seg_i, table)
            cols = {c: _as_array(table.column(c)) for c in wanted}
            n = seg.num_rows
            scan = _scan_segment(cols, n, payload)
            bad = scan["bad"]
            ids = scan["ids"]
            all_ids.append(ids[scan["id_valid"]])
            if bad.any():
                bad_local = np.nonzero(bad)[0]
                num_bad += len(bad_local)
                if first_bad is None:
                    first_bad = _describe_bad_row(cols, int(bad_local[0]), seg.start + int(bad_local[0]), payload)
                skipped_rows.extend((seg.start + bad_local).tolist())
                skipped_ids.extend(ids[bad_local[scan["id_valid"][bad_local]]].tolist())
            good = np.nonzero(~bad)[0]
            masks, tokens = scan["mask"], scan["num_tokens"]
            patches, frames = scan["num_patches"], scan["num_frames"]
            for j in good.tolist():
                metas.append(SampleMeta(id=int(ids[j]), row=seg.start + j, modalities=mod_sets[int(masks[j])],
                                        num_tokens=int(tokens[j]), num_patches=int(patches[j]),
                                        num_frames=int(frames[j])))
        if num_bad and not self._data.skip_bad_rows:
            more = f" ({num_bad} bad rows in all)" if num_bad > 1 else ""
            raise PipelineError(
                f"data.path: bad row in {self._path}: {first_bad}{more}; fix the data or set "
                "data.skip_bad_rows=True to skip such rows"
            )
        _check_unique(np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64), self._path)
        return metas, skipped_rows, skipped_ids


def token_rows_outside(arr: pa.Array, low: int, end: int) -> np.ndarray:
    """Per row of a list<int> column: whether any of its values lies outside [low, end)."""
    out = np.zeros(len(arr), dtype=bool)
    values = pc.list_flatten(arr)
    if len(values) == 0:
        return out
    v = _ints(values)
    wrong = (v < low) | (v >= end)
    if wrong.any():
        out[_ints(pc.list_parent_indices(arr))[wrong]] = True
    return out


def _scan_segment(cols: dict[str, pa.Array], n: int, payload: dict[str, str]) -> dict[str, np.ndarray]:
    """Vectorised per-row checks and counts for one segment (no Python loop over rows).
    `payload`: modality -> the column that carries it."""
    id_valid = _valid(cols["id"])
    ids = _ints(cols["id"])
    mods = cols["modalities"]
    mods_valid = _valid(mods)
    # Modality names -> bit per row; an unknown or null name marks the row.
    names = mods.flatten()
    codes = pc.index_in(names, value_set=pa.array(KNOWN_MODALITIES, type=names.type))
    codes_np = _ints(pc.fill_null(codes, -1)) if len(codes) else np.zeros(0, np.int64)
    parents = _ints(pc.list_parent_indices(mods)) if len(codes) else np.zeros(0, np.int64)
    mask = np.zeros(n, dtype=np.int64)
    known = codes_np >= 0
    np.bitwise_or.at(mask, parents[known], np.left_shift(1, codes_np[known]))
    unknown = np.zeros(n, dtype=bool)
    unknown[parents[~known]] = True
    tokens_valid = _valid(cols["tokens"])
    num_tokens = _list_lengths(cols["tokens"])
    # Token ids are read as int32: a wider column must fit, and no id is negative.
    tokens_out = token_rows_outside(cols["tokens"], 0, INT32_END)
    bad = ~id_valid | ~mods_valid | (mask == 0) | unknown | ~tokens_valid | (num_tokens == 0) | tokens_out
    for modality in ("image", "audio"):
        declared = (mask & _BIT[modality]) != 0
        column = payload[modality]
        present = _valid(cols[column]) if column in cols else np.zeros(n, dtype=bool)
        bad |= declared != present
    zeros = np.zeros(n, dtype=np.int64)
    num_frames = _ints(cols["num_frames"]) if "num_frames" in cols else zeros
    if payload["audio"] in cols and "sample_rate" in cols:
        rate_valid = _valid(cols["sample_rate"])
        rate = _ints(cols["sample_rate"])
        has_audio = (mask & _BIT["audio"]) != 0
        bad |= has_audio & (~rate_valid | (rate <= 0))
        if "num_frames" not in cols and _is_list(cols[payload["audio"]].type):
            hop = np.maximum(rate, 1) * AUDIO_FRAME_S
            num_frames = np.where(has_audio, np.ceil(_list_lengths(cols[payload["audio"]]) / hop), 0).astype(np.int64)
    return {"ids": ids, "id_valid": id_valid, "mask": mask, "bad": bad,
            "num_tokens": num_tokens,
            "num_patches": _ints(cols["num_patches"]) if "num_patches" in cols else zeros,
            "num_frames": num_frames}


def _describe_bad_row(cols: dict[str, pa.Array], j: int, row: int, payload: dict[str, str]) -> str:
    """One line on why row `row` (local index `j`) is bad; called only for the first bad row."""
    rid = cols["id"][j].as_py()
    if rid is None:
        return f"row {row} has a null id"
    where = f"row {row} (id {rid})"
    mods = cols["modalities"][j].as_py()
    if mods is None:
        return f"{where} has null modalities"
    if not mods:
        return f"{where} declares no modalities"
    unknown = [m for m in mods if m not in KNOWN_MODALITIES]
    if unknown:
        return f"{where} has unknown modality {unknown[0]!r} (known: {', '.join(KNOWN_MODALITIES)})"
    if not cols["tokens"][j].is_valid:
        return f"{where} has null tokens"
    tokens = cols["tokens"][j].values
    if len(tokens) == 0:
        return f"{where} has no tokens"
    outside = [t for t in tokens.to_pylist() if not 0 <= t < INT32_END]
    if outside:
        return f"{where} has token id {outside[0]}, outside 0..{INT32_END - 1} (token ids are read as int32)"
    for modality in ("image", "audio"):
        column = payload[modality]
        present = column in cols and cols[column][j].is_valid
        if modality in mods and not present:
            what = f"column {column!r} is null" if column in cols else f"there is no {column!r} column"
            return f"{where} declares modality {modality!r} but {what}"
        if present and modality not in mods:
            return f"{where} has a value in column {column!r} but {modality!r} is not in its modalities"
    if "audio" in mods:
        return f"{where} has audio but no positive sample_rate"
    return f"{where} is inconsistent"


def _check_unique(ids: np.ndarray, path: str) -> None:
    if len(ids) < 2:
        return
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.nonzero(sorted_ids[1:] == sorted_ids[:-1])[0]
    if len(dup):
        # Report the duplicate whose second occurrence comes first in file order.
        first = dup[np.argmin(order[dup + 1])]
        raise PipelineError(f"data.path: id {int(sorted_ids[first])} appears more than once in {path} "
                            "(ids must be unique)")


def _extract(arr: pa.Array, local: np.ndarray, *, as_int32: bool = False) -> list[Any]:
    """Values of `arr` at `local` indices: numeric lists as numpy views, everything else via as_py."""
    t = arr.type
    if _is_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_floating(t.value_type)):
        offsets = arr.offsets.to_numpy(zero_copy_only=False)  # absolute positions into arr.values
        values = arr.values
        flat = values.to_numpy(zero_copy_only=values.null_count == 0)
        valid = _valid(arr)
        rows = [flat[offsets[j]:offsets[j + 1]] if valid[j] else None for j in local.tolist()]
        if as_int32 and flat.dtype != np.int32:  # cast only the rows asked for, not the whole segment
            rows = [None if r is None else r.astype(np.int32) for r in rows]
        return rows
    return [arr[j].as_py() for j in local.tolist()]


__all__ = ["AUDIO_FRAME_S", "KNOWN_MODALITIES", "ArrowSource"]
