"""ArrowSource: the SampleSource for Arrow IPC files and Parquet files/folders (DESIGN 5.1b).

Built in the coordinator (which calls `metadata()` once) and in every entry-section worker (which
calls `read(rows)` per micro-batch); it maps row indices to column values, nothing more.

The file is cut into *segments*: the record batches of an Arrow IPC file (memory-mapped, so a
segment is a zero-copy view of the map) or the row groups of the Parquet files (read on demand,
only the requested columns, the latest up to CACHE_BYTES cached). Construction reads only
schemas and footers, except that a compressed Arrow IPC file (LZ4 or ZSTD, feather's default) is
decompressed once, batch by batch, to count its rows: its batches are decompressed again when
read, only the columns asked for, cached as row groups are, and never all held at once. (An
IPC *stream* has no index: its batches are kept, as views of the map where uncompressed.) A
Parquet folder keeps every file's footer and at most MAX_OPEN files open.
`metadata()` scans the cheap parts of every segment — ids, modalities, list lengths from offsets,
null bitmaps — without turning any token into a Python object, and checks every row against the
contract: declared modalities must match the image/audio columns (or the columns
`data.modality_columns` names for them, e.g. precomputed `pixel_values`), ids must be unique.
The row-level checks and column reads are loaders/arrow_rows.py's; the schema's, loaders/arrow_schema.py's.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import ipc

from loaders.arrow_rows import (
    KNOWN_MODALITIES,
    MODALITY_BIT,
    check_unique,
    describe_bad_row,
    extract,
    has_dictionary,
    is_binary,
    plain_type,
    scan_segment,
    token_counts,
    token_rows_outside,
)
from loaders.arrow_schema import check_schema, folder_difference
from maestro_flow import ArrowData, PipelineError
from maestro_flow.errors import brief
from maestro_flow.samples import SampleMeta

_ARROW_MAGIC = b"ARROW1"
_PARQUET_MAGIC = b"PAR1"
MAX_OPEN = 8  # Parquet files of a folder kept open at once (the least recently read one closes)
CACHE_BYTES = 256 << 20  # decoded segments a source keeps for the reads that follow


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of rows [start, start + num_rows): one IPC record batch or one Parquet row group."""

    start: int
    num_rows: int
    batch: pa.RecordBatch | None = None  # Arrow IPC: zero-copy view of the memory map
    file: int = -1  # Parquet: index into the file list
    row_group: int = -1
    index: int = -1  # Arrow IPC: the record batch's index in the file
    compressed: bool = False  # Arrow IPC file: decompressed again whenever read (no `batch` kept)


def _row_group_offset(rg: Any) -> int:
    """Where a Parquet row group's first page starts in its file."""
    col = rg.column(0)
    return min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None and o > 0)


def _as_array(col: pa.Array | pa.ChunkedArray, *, encoded_binary: bool = False) -> pa.Array:
    """One array, dictionary-encoded values decoded (what pandas' categoricals and polars' List(Categorical)
    write): every reader below sees plain values. `encoded_binary`: a dictionary of binary values
    (images) stays encoded, for the scan, which reads only validity and lengths (found in review:
    decoding 4 distinct images over 2000 rows took 400 MB)."""
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks == 1:
            col = col.chunk(0)
        else:
            col = col.combine_chunks() if col.num_chunks else pa.array([], type=col.type)
    if encoded_binary and pa.types.is_dictionary(col.type) and is_binary(col.type.value_type):
        return col
    return col.cast(plain_type(col.type)) if has_dictionary(col.type) else col


PARQUET_SUFFIXES = (".parquet", ".pq", ".parq")
OTHER_DATA = (".arrow", ".arrows", ".feather", ".ipc", ".orc", ".csv", ".tsv", ".jsonl", ".avro")


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
        self._parquet_meta: list[pq.FileMetaData] = []  # every file's footer
        self._parquet_paths: list[str] = []
        self._parquet_open: OrderedDict[int, pq.ParquetFile] = OrderedDict()  # the last MAX_OPEN files read
        # Decoded segments (Parquet row groups, compressed IPC batches): seg -> (columns, table), LRU past CACHE_BYTES.
        self._cache: OrderedDict[int, tuple[frozenset[str], Any]] = OrderedDict()
        self._cached_bytes = 0
        self._ipc_readers: dict[tuple[int, ...], Any] = {}  # a compressed file's readers, by the columns they decode
        if os.path.isdir(self._path):
            schema, segments = self._open_parquet_folder()
        elif not os.path.isfile(self._path):  # found in review: a FIFO with no writer hung validate
            raise PipelineError(f"data.path: {self._path} is not a regular file or a folder (a pipe or a device?)")
        else:
            schema, segments = self._open_file()
        self._schema: pa.Schema = schema
        self.files = list(self._parquet_paths) or [self._path]  # read here: nodes compare them (runtime/fingerprint)
        self._segments: list[_Segment] = [s for s in segments if s.num_rows > 0]
        self._starts = np.array([s.start for s in self._segments], dtype=np.int64)
        self._num_rows = sum(s.num_rows for s in segments)
        check_schema(self._schema, self._data, self._path)
        self._scan: tuple[list[SampleMeta], list[int], list[int]] | None = None

    # -- opening -----------------------------------------------------------------------------

    def _open_file(self) -> tuple[pa.Schema, list[_Segment]]:
        try:
            with open(self._path, "rb") as f:
                magic = f.read(6)
        except OSError as exc:
            raise PipelineError(f"data.path: cannot read {self._path} ({brief(exc)})") from None
        if not magic:  # found in QA: said to be no readable Arrow IPC file, in Arrow's words
            raise PipelineError(f"data.path: {self._path} is empty (0 bytes): an interrupted write or copy?")
        if magic.startswith(_PARQUET_MAGIC):
            return self._open_parquet([self._path])
        segments, start = [], 0
        try:
            source = pa.memory_map(self._path, "r")
            self._map_base = source.read_buffer(1).address  # zero-copy: buffers' addresses are in the map
            map_end = self._map_base + source.size()
            source.seek(0)
            if magic == _ARROW_MAGIC:
                reader = ipc.open_file(source)
                for i in range(reader.num_record_batches):
                    batch = reader.get_batch(i)
                    # A compressed batch (LZ4/ZSTD, feather's default) is decompressed into memory
                    # of its own: keep its row count only, and decompress it again when read.
                    mapped = all(self._map_base <= b.address < map_end for col in batch.columns
                                 for b in col.buffers() if b is not None and b.size)
                    segments.append(_Segment(start=start, num_rows=batch.num_rows, batch=batch if mapped else None,
                                             index=i, compressed=not mapped))
                    start += batch.num_rows
                self._ipc_source = source
            else:  # the IPC *stream* format has no magic or index: its batches are kept (views of the map)
                reader = ipc.open_stream(source)
                for i, batch in enumerate(reader):
                    segments.append(_Segment(start=start, num_rows=batch.num_rows, batch=batch, index=i))
                    start += batch.num_rows
            schema = reader.schema
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise PipelineError(
                f"data.path: not a readable Arrow IPC or Parquet file: {self._path} ({brief(exc)})"
            ) from None
        return schema, segments

    def _open_parquet_folder(self) -> tuple[pa.Schema, list[_Segment]]:
        """Its Parquet files in name order. Other data files and subfolders of Parquet files (hive
        partitions) are refused, not left out (an .arrow file was); a README or _SUCCESS is no data."""
        entries = [n for n in sorted(os.listdir(self._path)) if not n.startswith((".", "_"))]
        folders = [n for n in entries if os.path.isdir(os.path.join(self._path, n))
                   and any(f.lower().endswith(PARQUET_SUFFIXES) for f in os.listdir(os.path.join(self._path, n)))]
        names = [n for n in entries if n.lower().endswith(PARQUET_SUFFIXES) and n not in folders]
        others = [n for n in entries if n.lower().endswith(OTHER_DATA) and n not in folders]
        if others or folders:
            what = f"file {others[0]!r}" if others else f"subfolder {folders[0]!r} (partitions are not read)"
            raise PipelineError(f"data.path: folder {self._path} holds {what} beside its Parquet files: a data "
                                "folder holds Parquet files only (.parquet, .pq, .parq); move the rest out, or "
                                "give one file")
        if not names:
            raise PipelineError(f"data.path: no Parquet files (.parquet, .pq, .parq) in folder {self._path}")
        return self._open_parquet([os.path.join(self._path, n) for n in names])

    def _open_parquet(self, paths: list[str]) -> tuple[pa.Schema, list[_Segment]]:
        schema: pa.Schema | None = None
        segments, start = [], 0
        for i, path in enumerate(paths):
            try:
                if os.path.getsize(path) == 0:  # found in review: in Arrow's words, as a file alone was
                    raise PipelineError(f"data.path: {path} is empty (0 bytes): an interrupted write or copy?")
                pf = pq.ParquetFile(path, memory_map=True)
                file_schema = pf.schema_arrow
            except (pa.ArrowException, OSError, ValueError) as exc:
                raise PipelineError(
                    f"data.path: not a readable Arrow IPC or Parquet file: {path} ({brief(exc)})"
                ) from None
            if schema is None:
                schema = file_schema
            elif (difference := folder_difference(schema, file_schema)) is not None:
                raise PipelineError(
                    f"data.path: {path} has a different schema from {paths[0]} (all Parquet files of a "
                    f"folder must have the same columns and types; {difference})"
                )
            self._parquet_meta.append(pf.metadata)
            self._parquet_paths.append(path)
            pf.close()  # a folder of thousands of files must not hold a descriptor each (_parquet_file reopens)
            for rg in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(rg).num_rows
                segments.append(_Segment(start=start, num_rows=n, file=i, row_group=rg))
                start += n
        assert schema is not None
        return schema, segments

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
        bytes, strings as str, other lists and scalars as Python values; a null is None. A row of
        an integer list column that holds a null element comes back as a list (None there); one
        of a float list column, as an array with NaN there.
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
                column, at = table.column(name), local
                if has_dictionary(column.type):  # decode only the rows asked for
                    column, at = column.take(pa.array(local)), np.arange(len(local))
                values = extract(_as_array(column), at, as_int32=(name == "tokens"))
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
        hit = self._cache.get(seg_i)
        if hit is not None and key <= hit[0]:
            self._cache.move_to_end(seg_i)
            return hit[1]
        try:
            if seg.compressed:  # only the columns asked for are decompressed
                fields = tuple(sorted(self._schema.get_field_index(n) for n in names))
                reader = self._ipc_readers.get(fields)
                if reader is None:
                    reader = self._ipc_readers[fields] = ipc.open_file(
                        self._ipc_source, options=ipc.IpcReadOptions(included_fields=list(fields)))
                table = reader.get_batch(seg.index)
            else:
                table = self._parquet_file(seg.file).read_row_group(seg.row_group, columns=names)
        except (pa.ArrowException, OSError, ValueError) as exc:
            path, where = self._where(seg)
            raise PipelineError(f"data.path: {path} is corrupt: {where} cannot be read ({brief(exc)})") from None
        if cache:
            self._keep(seg_i, key, table)
        return table

    def _keep(self, seg_i: int, key: frozenset[str], table: Any) -> None:
        old = self._cache.pop(seg_i, None)
        if old is not None:
            self._cached_bytes -= old[1].nbytes
        self._cache[seg_i] = (key, table)
        self._cached_bytes += table.nbytes
        while self._cached_bytes > CACHE_BYTES and len(self._cache) > 1:
            self._cached_bytes -= self._cache.popitem(last=False)[1][1].nbytes

    def _parquet_file(self, i: int) -> pq.ParquetFile:
        """Parquet file i, open (its footer parsed once, at construction); at most MAX_OPEN stay open."""
        pf = self._parquet_open.pop(i, None)
        if pf is None:
            pf = pq.ParquetFile(self._parquet_paths[i], memory_map=True, metadata=self._parquet_meta[i])
            if len(self._parquet_open) >= MAX_OPEN:
                self._parquet_open.popitem(last=False)[1].close()
        self._parquet_open[i] = pf
        return pf

    def rows_with_tokens_outside(self, end: int, allowed: tuple[int, ...] = ()) -> list[int]:
        """Rows whose tokens hold an id at or above `end` (a stage's vocabulary) other than the
        `allowed` ones, in file order."""
        rows: list[int] = []
        for seg_i, seg in enumerate(self._segments):
            table = self._segment_columns(seg_i, ["tokens"], cache=False)
            out = token_rows_outside(_as_array(table.column("tokens")), 0, end, allowed)
            rows.extend((seg.start + np.nonzero(out)[0]).tolist())
        return rows

    def token_counts(self, token: int) -> np.ndarray:
        """How many times each row's tokens hold `token` (a placeholder id), by row."""
        counts = np.zeros(sum(seg.num_rows for seg in self._segments), dtype=np.int64)
        for seg_i, seg in enumerate(self._segments):
            table = self._segment_columns(seg_i, ["tokens"], cache=False)
            counts[seg.start:seg.start + seg.num_rows] = token_counts(_as_array(table.column("tokens")), token)
        return counts

    def _validate(self, seg_i: int, table: pa.RecordBatch | pa.Table) -> None:
        """Every offset and length of a segment checked (a corrupt file must not crash a reader).
        A Parquet row group's columns are decoded (and checked by the decoder) whenever read."""
        try:
            table.validate(full=True)
        except (pa.ArrowException, ValueError) as exc:
            path, where = self._where(self._segments[seg_i])
            raise PipelineError(f"data.path: {path} is corrupt: {where} fails validation ({brief(exc)})") from None

    def _where(self, seg: _Segment) -> tuple[str, str]:
        """The file of a segment, and where in it the segment is (for an error)."""
        rows = f"rows {seg.start}..{seg.start + seg.num_rows - 1}"
        if seg.file >= 0:
            offset = _row_group_offset(self._parquet_meta[seg.file].row_group(seg.row_group))
            return self._parquet_paths[seg.file], f"row group {seg.row_group} ({rows}, at byte {offset})"
        offset = self._file_offset(seg.batch) if seg.batch is not None else None
        return self._path, f"record batch {seg.index} ({rows}" + (f", at byte {offset})" if offset is not None else ")")

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
        mod_sets = {m: frozenset(k for k, b in MODALITY_BIT.items() if m & b) for m in range(1 << len(MODALITY_BIT))}
        for seg_i, seg in enumerate(self._segments):
            # An Arrow IPC segment is checked whole: a worker's read() of any column of it (an
            # image, an extra column) must not fault on an offset past its buffers' end.
            if seg.file >= 0:  # Parquet: the columns wanted (their decoder checks what it decodes)
                checked = table = self._segment_columns(seg_i, wanted, cache=False)
            else:
                checked = self._segment_columns(seg_i, names, cache=False)
                table = checked.select(wanted)
            self._validate(seg_i, checked)
            cols = {c: _as_array(table.column(c), encoded_binary=c in payload.values()) for c in wanted}
            n = seg.num_rows
            scan = scan_segment(cols, n, payload)
            bad = scan["bad"]
            ids = scan["ids"]
            all_ids.append(ids[scan["id_valid"]])
            if bad.any():
                bad_local = np.nonzero(bad)[0]
                num_bad += len(bad_local)
                if first_bad is None:
                    first_bad = describe_bad_row(cols, int(bad_local[0]), seg.start + int(bad_local[0]), payload)
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
                "data.skip_bad_rows=true to skip such rows"
            )
        check_unique(np.concatenate(all_ids) if all_ids else np.zeros(0, np.int64), self._path)
        return metas, skipped_rows, skipped_ids


__all__ = ["KNOWN_MODALITIES", "ArrowSource"]
