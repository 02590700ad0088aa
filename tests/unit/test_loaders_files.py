"""ArrowSource on the files users have, not only the ones the demo writes: compressed feather,
Parquet folders of many files or of mixed nullability, null rows whose offsets still span values,
corrupt extra columns, null elements in extra integer columns, precomputed counts."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from pyarrow import ipc

from loaders import arrow as arrow_mod
from loaders import arrow_rows
from loaders.demo import text_demo_table, write_arrow
from maestro_flow import PipelineError
from tests.unit.test_loaders import multimodal_table, source


def _write_ipc(table: pa.Table, path, batch_rows: int | None = None) -> str:
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=batch_rows)
    return str(path)


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_compressed_arrow_file_reads_as_the_uncompressed_one_without_holding_it(tmp_path, compression,
                                                                                   monkeypatch):
    table = text_demo_table(num_samples=300, seed=5)
    plain = source(write_arrow(table, tmp_path / "plain.arrow", batch_rows=64))
    path = tmp_path / f"{compression}.arrow"
    feather.write_feather(table, str(path), compression=compression, chunksize=64)
    packed = source(path)
    segs = packed._segments
    assert len(segs) == 5 and all(s.compressed and s.batch is None for s in segs)  # only row counts kept
    assert packed.metadata() == plain.metadata()
    rows = [299, 0, 64, 63, 150, 1]
    got, want = packed.read(rows), plain.read(rows)
    assert all(np.array_equal(a, b) for a, b in zip(got["tokens"], want["tokens"], strict=True))
    assert got["id"] == want["id"] and got["tokens"][0].dtype == np.int32
    assert not any(s.compressed for s in plain._segments)  # an uncompressed file stays zero-copy
    # Only the columns asked for are decompressed, and decoded batches are kept for the reads
    # that follow, up to CACHE_BYTES.
    fresh = source(path)
    fresh.read([70], ["id"])
    cached = fresh._cache[1][1]
    assert cached.column_names == ["id"]
    fresh.read([71, 72], ["id"])
    assert fresh._cache[1][1] is cached  # served from the cache, not decompressed again
    monkeypatch.setattr(arrow_mod, "CACHE_BYTES", 1)
    fresh.read(rows, ["id"])
    assert len(fresh._cache) == 1  # over the bound, the least recently read go


def test_a_parquet_folder_of_many_files_keeps_few_open(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    table = text_demo_table(num_samples=120, seed=2)
    for i in range(40):
        pq.write_table(table.slice(3 * i, 3), folder / f"part-{i:03d}.parquet")
    before = len(os.listdir("/proc/self/fd"))
    src = source(folder)
    assert len(os.listdir("/proc/self/fd")) == before  # footers kept, files closed
    assert [m.id for m in src.metadata()] == table.column("id").to_pylist()
    rows = list(range(119, -1, -7))
    assert src.read(rows, ["id"])["id"] == [table.column("id")[r].as_py() for r in rows]
    assert len(src._parquet_open) <= arrow_mod.MAX_OPEN
    assert len(os.listdir("/proc/self/fd")) <= before + arrow_mod.MAX_OPEN


def test_parquet_files_that_differ_only_in_nullability_form_one_folder(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    table = multimodal_table()
    strict = table.schema.set(0, pa.field("id", pa.int64(), nullable=False))
    pq.write_table(table.slice(0, 2).cast(strict), folder / "a.parquet")
    pq.write_table(table.slice(2, 2), folder / "b.parquet")
    assert [m.id for m in source(folder).metadata()] == [10, 11, 12, 13]
    # Nullability inside a list (its element field) varies between writers too.
    strict_mods = table.schema.set(1, pa.field("modalities", pa.list_(pa.field("element", pa.string(),
                                                                                nullable=False))))
    pq.write_table(table.slice(2, 2).cast(strict_mods), folder / "b.parquet")
    assert [m.id for m in source(folder).metadata()] == [10, 11, 12, 13]
    pq.write_table(table.slice(2, 2).cast(table.schema.set(7, pa.field("caption", pa.large_string()))),
                   folder / "b.parquet")
    with pytest.raises(PipelineError, match="column 'caption' is large_string here, string in the first"):
        source(folder)
    # The same columns in another order: read by name (found in QA: refused)
    pq.write_table(table.slice(2, 2).select(list(reversed(table.column_names))), folder / "b.parquet")
    both = source(folder)
    assert [m.id for m in both.metadata()] == [10, 11, 12, 13]
    assert both.read([1, 2, 3], ["caption", "id", "num_patches"]) == {"caption": ["b", None, "d"], "id": [11, 12, 13],
                                                                       "num_patches": [16, 0, 4]}


def test_an_empty_file_is_named_as_empty(tmp_path):
    """Found in QA: a 0-byte .parquet was "not a readable Arrow IPC or Parquet file", in Arrow's
    words, alone or (found in review) in a folder."""
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(PipelineError, match=r"^data.path: .*empty.parquet is empty \(0 bytes\)"):
        source(tmp_path / "empty.parquet")
    with pytest.raises(PipelineError, match=r"^data.path: .*empty.parquet is empty \(0 bytes\)"):
        source(tmp_path)


def test_a_parquet_folder_with_a_repeated_column_is_refused_in_one_line(tmp_path):
    """Found in review: a name repeated in the files of a folder gave a TypeError (types do not
    sort) or an AssertionError, not the refusal a file alone gets."""
    table = text_demo_table(num_samples=4)
    twice = pa.table([*table.columns, table.column("id")], names=[*table.column_names, "id"])
    pq.write_table(twice, tmp_path / "a.parquet")
    pq.write_table(pa.table([*table.columns, pa.array(["x"] * 4)], names=[*table.column_names, "id"]),
                   tmp_path / "b.parquet")
    with pytest.raises(PipelineError, match=r"^data.path: .*b.parquet has a different schema .*column 'id' is string"):
        source(tmp_path)
    pq.write_table(table, tmp_path / "b.parquet")
    with pytest.raises(PipelineError, match=r"column 'id' appears a different number of times"):
        source(tmp_path)
    pq.write_table(twice, tmp_path / "b.parquet")
    with pytest.raises(PipelineError, match=r"column 'id' appears twice"):
        source(tmp_path)


def _dictionary_encoded(table: pa.Table) -> pa.Table:
    """What pandas' categoricals and polars' List(Categorical) write: id, caption and the
    modalities' strings dictionary-encoded (a null modality name and a null caption included)."""
    mods = table["modalities"].combine_chunks()
    table = table.set_column(1, "modalities", pa.ListArray.from_arrays(mods.offsets, mods.values.dictionary_encode(),
                                                                       mask=mods.is_null()))
    table = table.set_column(0, "id", table["id"].dictionary_encode())
    return table.set_column(7, "caption", table["caption"].dictionary_encode())


@pytest.mark.parametrize("kind", ["arrow", "parquet", "folder"])
def test_dictionary_encoded_columns_read_as_plain_ones(tmp_path, kind):
    """Refused before ('column 'modalities' must be list<string>, got list<dictionary<...>>'):
    they read as the plain file does, rows in any order, across segments; a Parquet folder may mix
    encoded and plain files; a bad row in an encoded column is still named."""
    table = multimodal_table(modalities=[["text"], ["text", "image"], ["audio", "text"], ["image", None]])
    encoded = _dictionary_encoded(table)
    assert pa.types.is_dictionary(encoded.schema.field("modalities").type.value_type)
    plain_path = _write_ipc(table, tmp_path / "plain.arrow")
    if kind == "arrow":
        path = _write_ipc(encoded, tmp_path / "enc.arrow", batch_rows=3)
    elif kind == "parquet":
        pq.write_table(encoded, path := str(tmp_path / "enc.parquet"), row_group_size=3)
    else:
        (path := tmp_path / "parts").mkdir()
        pq.write_table(encoded.slice(0, 2), path / "a.parquet")
        pq.write_table(table.slice(2, 2), path / "b.parquet")
    with pytest.raises(PipelineError, match=r"bad row .*\(id 13\) has unknown modality None"):
        source(path).metadata()
    ours, plain = source(path, skip_bad_rows=True), source(plain_path, skip_bad_rows=True)
    assert ours.metadata() == plain.metadata() and [m.id for m in ours.metadata()] == [10, 11, 12]
    rows = [3, 0, 2, 1, 2]
    got, want = ours.read(rows), plain.read(rows)
    assert got.keys() == want.keys()
    for name in want:
        for a, b in zip(got[name], want[name], strict=True):
            assert np.array_equal(a, b) if isinstance(b, np.ndarray) else a == b, (name, a, b)


@pytest.mark.parametrize("kind", ["arrow", "parquet"])
def test_a_dictionary_encoded_image_column_is_scanned_without_decoding(tmp_path, kind, monkeypatch):
    """Found in review: the scan decoded a whole encoded image column per segment (4 distinct
    images over 2000 rows: 400 MB) for its validity and lengths, which the dictionary gives. A
    null or empty image is still a bad row, named as the plain file's is."""
    images = [None, b"\x89PNG-a", b"", b"\x89PNG-a", None, b"\x89PNG-b"]
    n = len(images)
    table = pa.table({"id": pa.array(range(n), pa.int64()),
                      "modalities": [["text"], ["text", "image"], ["text", "image"], ["text", "image"], ["text", "image"],
                                     ["image"]],
                      "tokens": pa.array([[1, 2]] * n, pa.list_(pa.int32())),
                      "image": pa.array(images, pa.binary()), "num_patches": pa.array([0, 4, 4, 4, 4, 4], pa.int32())})
    encoded = table.set_column(3, "image", table["image"].dictionary_encode())
    if kind == "arrow":
        path = _write_ipc(encoded, tmp_path / "enc.arrow", batch_rows=4)
    else:
        pq.write_table(encoded, path := str(tmp_path / "enc.parquet"), row_group_size=4)
    plain_path = _write_ipc(table, tmp_path / "plain.arrow")
    with pytest.raises(PipelineError) as plain_error:
        source(plain_path).metadata()
    with pytest.raises(PipelineError) as error:
        source(path).metadata()
    assert str(error.value).replace(str(path), "X") == str(plain_error.value).replace(plain_path, "X")
    ours, plain = source(path, skip_bad_rows=True), source(plain_path, skip_bad_rows=True)
    decoded = []  # what _as_array casts to plain values (built: only the scan below runs)
    monkeypatch.setattr(arrow_mod, "plain_type", lambda t: decoded.append(t) or arrow_rows.plain_type(t))
    assert ours.metadata() == plain.metadata() and [m.id for m in ours.metadata()] == [0, 1, 3, 5]
    assert decoded == []  # the scan decoded nothing
    assert ours.read([5, 1])["image"] == [b"\x89PNG-b", b"\x89PNG-a"]


@pytest.mark.parametrize("column", ["modalities", "tokens"])
def test_a_null_row_whose_offsets_span_values_is_a_bad_row(tmp_path, column):
    """Arrow lets a null list row keep offsets over values; the flatten leaves them out, so the
    rows the values belong to must come from the lengths (an IndexError before)."""
    table = text_demo_table(num_samples=3, seed=1)
    col = table.column(column).combine_chunks()
    nulled = pa.ListArray.from_arrays(col.offsets, col.values, mask=pa.array([False, True, False]))
    assert pa.compute.list_flatten(nulled).to_pylist() != col.values.to_pylist()  # the values are spanned
    path = _write_ipc(table.set_column(table.schema.get_field_index(column), column, nulled), tmp_path / "n.arrow")
    with pytest.raises(PipelineError, match=f"row 1 \\(id {table.column('id')[1].as_py()}\\) has null {column}"):
        source(path).metadata()
    src = source(path, skip_bad_rows=True)
    assert [m.row for m in src.metadata()] == [0, 2]
    if column == "tokens":
        assert src.rows_with_tokens_outside(1) == [0, 2] and list(src.token_counts(-1)) == [0, 0, 0]


def test_a_corrupt_extra_column_is_refused_before_a_read_faults(tmp_path):
    """An offset past the end in a column metadata() does not need: refused there, naming the
    batch (before, a worker reading the column died of SIGBUS)."""
    table = multimodal_table()
    path = _write_ipc(table, tmp_path / "c.arrow")
    data = bytearray(open(path, "rb").read())
    offsets = np.array([0, 1, 2, 2, 3], dtype=np.int32).tobytes()  # caption's offsets: "a", "b", null, "d"
    at = data.find(offsets)
    assert at > 0
    data[at + 8:at + 12] = np.int32(1 << 30).tobytes()
    open(path, "wb").write(bytes(data))
    with pytest.raises(PipelineError, match=r"is corrupt: record batch 0 \(rows 0..3, at byte \d+\) fails validation"):
        source(path).metadata()


def test_an_integer_list_with_a_null_element_keeps_its_integers(tmp_path):
    big = 2 ** 60 + 1
    table = multimodal_table(labels=[[7, None], [big, 3], [big, 3], [1]])
    labels = source(_write_ipc(table, tmp_path / "l.arrow")).read([0, 1, 3], ["labels"])["labels"]
    assert labels[0] == [7, None]
    assert labels[1].dtype == np.int64 and labels[1].tolist() == [big, 3] and labels[2].tolist() == [1]


def test_precomputed_counts_are_checked_where_the_modality_is(tmp_path):
    for patches, said in (([0, -3, 0, 4], "num_patches -3"), ([0, None, 0, 4], "num_patches None"),
                          ([0, 0, 0, 4], r"num_patches 0 \(an image gives 1 patch or more")):  # found in QA: trained
        path = _write_ipc(multimodal_table(num_patches=patches), tmp_path / "p.arrow")
        with pytest.raises(PipelineError, match=f"row 1 \\(id 11\\) has image but {said}"):
            source(path).metadata()
    # On a row without an image the column is not read: its count is 0 whatever it holds.
    path = _write_ipc(multimodal_table(num_patches=[5, 16, -1, 4]), tmp_path / "q.arrow")
    assert [m.num_patches for m in source(path).metadata()] == [0, 16, 0, 4]


@pytest.mark.parametrize(("args", "said"), [
    (["--only", "text", "--samples", "0"], "Invalid value for '--samples': 0 is not in the range x>=1"),
    (["--only", "vlm", "--image-share", "1.5"], "Invalid value for '--image-share'"),
    # The CLI's contract (an error you can fix: "error: ..." and exit 2); it said "Error:", rc 1.
    (["--only", "text", "--out", "/proc/no/such/folder"], "error: data demo (text): "),
])
def test_maestro_data_demo_refuses_bad_options_in_one_line(args, said):
    from click.testing import CliRunner

    from maestro_flow.cli import main

    result = CliRunner().invoke(main, ["data", "demo", *args])
    assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, (ValueError, OSError)), result.exception


def test_maestro_data_demo_names_every_file_it_writes(tmp_path):
    """Found in review: it said only 'wrote .../text.arrow' while writing text.parquet too."""
    from click.testing import CliRunner

    from maestro_flow.cli import main

    result = CliRunner().invoke(main, ["data", "demo", "--out", str(tmp_path), "--only", "text", "--samples", "16"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {tmp_path / 'text.arrow'} and {tmp_path / 'text.parquet'}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text.arrow", "text.parquet"]
