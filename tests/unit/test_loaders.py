"""Unit tests of loaders/: ArrowSource over Arrow IPC and Parquet, the demo builder, the tokenizer."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders import text
from loaders.arrow import ArrowSource
from loaders.demo import build_text_demo, text_demo_table, write_arrow, write_parquet
from maestro_flow import ArrowData, PipelineError
from stages.audio import num_frames


def source(path, **kw) -> ArrowSource:
    return ArrowSource(ArrowData(path=str(path), **kw))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """200 demo samples, written with small batches/row groups so that reads cross segments."""
    out = tmp_path_factory.mktemp("demo")
    table = text_demo_table(num_samples=200, seed=3)
    return table, write_arrow(table, out / "text.arrow", batch_rows=64), \
        write_parquet(table, out / "text.parquet", row_group_rows=48)


def multimodal_table(**replace) -> pa.Table:
    """Four rows: text, image, audio, image+audio; `replace` swaps whole columns (as Python lists)."""
    cols = {
        "id": [10, 11, 12, 13],
        "modalities": [["text"], ["text", "image"], ["audio", "text"], ["image", "audio"]],
        "tokens": [[257, 1, 2], [257, 259, 3], [257, 4, 5, 6], [259, 7]],
        "image": [None, b"\x89PNG-a", None, b"\x89PNG-b"],
        "audio": [None, None, [0.5] * 1600, [0.25] * 800],
        "sample_rate": [None, None, 16000, 8000],
        "num_patches": [0, 16, 0, 4],
        "caption": ["a", "b", None, "d"],
    }
    cols.update(replace)
    types = {"id": pa.int64(), "modalities": pa.list_(pa.string()), "tokens": pa.list_(pa.int32()),
             "image": pa.binary(), "audio": pa.list_(pa.float32()), "sample_rate": pa.int32(),
             "num_patches": pa.int32(), "caption": pa.string()}
    return pa.table({k: pa.array(v, type=types.get(k)) for k, v in cols.items() if v is not None})


# -- reading the demo back ------------------------------------------------------------------------

def test_arrow_and_parquet_give_same_metadata_and_rows(demo):
    table, arrow_path, parquet_path = demo
    a, p = source(arrow_path), source(parquet_path)
    assert len(a) == len(p) == 200
    assert a.column_names == p.column_names == ("id", "modalities", "tokens")
    assert a.metadata() == p.metadata()
    rows = list(range(200))
    ra, rp = a.read(rows), p.read(rows)
    assert ra["id"] == rp["id"] == table.column("id").to_pylist()
    assert ra["modalities"] == rp["modalities"] == [["text"]] * 200
    for x, y, z in zip(ra["tokens"], rp["tokens"], table.column("tokens").to_pylist(), strict=False):
        assert x.dtype == y.dtype == np.int32
        assert x.tolist() == y.tolist() == z


def test_metadata_counts_match_real_lengths(demo):
    _, arrow_path, _ = demo
    src = source(arrow_path)
    metas = src.metadata()
    tokens = src.read([m.row for m in metas], columns=["tokens"])["tokens"]
    assert [m.row for m in metas] == list(range(200))
    assert [m.num_tokens for m in metas] == [len(t) for t in tokens]
    assert all(32 <= m.num_tokens <= 128 and m.modalities == {"text"} for m in metas)
    assert all(t[0] == text.BOS and t[-1] == text.EOS for t in tokens)
    assert len({m.num_tokens for m in metas}) > 20  # lengths vary


@pytest.mark.parametrize("which", [1, 2])
def test_read_returns_requested_rows_in_order(demo, which):
    table, path = demo[0], demo[which]
    src = source(path)
    rows = [150, 3, 64, 63, 3, 199, 0]  # crosses batches / row groups, repeats a row
    got = src.read(rows, columns=["tokens", "id"])
    assert list(got) == ["tokens", "id"]
    assert got["id"] == rows
    expected = table.column("tokens").to_pylist()
    assert [t.tolist() for t in got["tokens"]] == [expected[r] for r in rows]
    assert src.read([]) == {"id": [], "modalities": [], "tokens": []}
    with pytest.raises(PipelineError, match="column 'nope' is not in"):
        src.read([0], columns=["nope"])
    with pytest.raises(IndexError, match="row 200 is out of range"):
        src.read([0, 200])


def test_arrow_reads_are_zero_copy_views_of_the_map(demo):
    _, arrow_path, _ = demo
    src = source(arrow_path)
    before = pa.total_allocated_bytes()
    tokens = src.read(range(200), columns=["tokens"])["tokens"]
    assert pa.total_allocated_bytes() - before < 4096  # nothing copied into Arrow's memory pool
    assert not tokens[0].flags.writeable and not tokens[0].flags.owndata


def test_parquet_folder_reads_files_in_name_order(tmp_path):
    table = text_demo_table(num_samples=90, seed=1)
    write_parquet(table.slice(50), tmp_path / "part-1.parquet", row_group_rows=16)
    write_parquet(table.slice(0, 50), tmp_path / "part-0.parquet", row_group_rows=16)
    src = source(tmp_path)
    assert len(src) == 90
    assert [m.id for m in src.metadata()] == list(range(90))
    assert [t.tolist() for t in src.read([89, 0, 49, 50])["tokens"]] == \
        [table.column("tokens")[i].as_py() for i in (89, 0, 49, 50)]


def test_int64_tokens_are_read_as_int32(tmp_path):
    path = write_arrow(pa.table({"id": pa.array([1], pa.int64()), "modalities": [["text"]],
                                 "tokens": pa.array([[257, 65, 258]], pa.list_(pa.int64()))}),
                       tmp_path / "t.arrow")
    tokens = source(path).read([0])["tokens"][0]
    assert tokens.dtype == np.int32 and tokens.tolist() == [257, 65, 258]


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_fixed_size_list_column_is_read_as_arrays(tmp_path, fmt):
    """Found in review: a fixed_size_list column (an embedding, precomputed pixels) reached the
    stage as a Python list, where a list column gives an array (a tensor to the stage)."""
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.float32)), 3)
    table = pa.table({"id": pa.array([1, 2, 3, 4], pa.int64()), "modalities": [["text"]] * 4,
                      "tokens": pa.array([[257, 65]] * 4, pa.list_(pa.int32())), "embedding": embedding})
    path = (write_arrow if fmt == "arrow" else write_parquet)(table, tmp_path / f"t.{fmt}")
    rows = source(path).read([3, 1], ["embedding"])["embedding"]
    assert all(isinstance(r, np.ndarray) and r.dtype == np.float32 for r in rows)
    assert [r.tolist() for r in rows] == [[9.0, 10.0, 11.0], [3.0, 4.0, 5.0]]


@pytest.mark.parametrize(("value", "expected"), [(None, "a null element"), (float("nan"), "a NaN or infinite value")])
def test_a_fixed_size_list_payload_is_checked_as_a_list_is(tmp_path, value, expected):
    """Found in review: with fixed_size_list columns read as arrays, a null in precomputed pixels
    trained as NaN (the row checks looked at list columns only)."""
    pixels = pa.FixedSizeListArray.from_arrays(pa.array([0.1, 0.2, 0.3, 0.4, value, 0.6], pa.float32()), 3)
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "modalities": [["image"], ["image"]],
                      "tokens": pa.array([[259, 65]] * 2, pa.list_(pa.int32())),
                      "num_patches": pa.array([1, 1], pa.int32()), "pixel_values": pixels})
    src = source(write_arrow(table, tmp_path / "t.arrow"), modality_columns={"image": "pixel_values"})
    with pytest.raises(PipelineError, match=rf"row 1 \(id 2\) has {expected} in column 'pixel_values'"):
        src.metadata()


def test_int64_tokens_that_do_not_fit_int32_are_refused_not_truncated(tmp_path):
    # Reproduced before: 2**32 + 65 came back as 65.
    path = write_arrow(pa.table({"id": pa.array([1, 2], pa.int64()), "modalities": [["text"], ["text"]],
                                 "tokens": pa.array([[257, 65], [257, 2**32 + 65]], pa.list_(pa.int64()))}),
                       tmp_path / "t.arrow")
    with pytest.raises(PipelineError, match=r"row 1 \(id 2\) has token id 4294967361, outside 0..2147483647"):
        source(path).metadata()


def corrupt(path, at: int, data: bytes):
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_a_corrupt_arrow_file_is_refused_naming_the_file_and_offset(demo, tmp_path):
    # Reproduced before: 8 bytes overwritten in an offsets buffer aborted validate and run
    # (a failed C++ check, SIGABRT) instead of an error.
    import shutil
    import struct

    path = tmp_path / "corrupt.arrow"
    shutil.copy(demo[1], path)
    with pa.memory_map(str(path), "r") as m:
        base = m.read_buffer(1).address
        m.seek(0)
        batch = pa.ipc.open_file(m).get_batch(1)
        at = batch.column("tokens").buffers()[1].address - base
    corrupt(path, at + 4 * 10, struct.pack("<ii", 0x7FFFF000, 0x7FFFF000))
    with pytest.raises(PipelineError, match=rf"{path} is corrupt: record batch 1 \(rows 64..127, at byte \d+\) "
                                            r"fails validation .*offset"):
        source(path).metadata()


def test_a_corrupt_parquet_row_group_is_refused_naming_it(demo, tmp_path):
    import shutil

    path = tmp_path / "corrupt.parquet"
    shutil.copy(demo[2], path)
    from loaders.arrow import _row_group_offset

    start = _row_group_offset(pq.ParquetFile(str(path)).metadata.row_group(1))
    corrupt(path, start, b"\xff" * 64)
    with pytest.raises(PipelineError, match=rf"{path} is corrupt: row group 1 \(rows 48..95, at byte {start}\)"):
        source(path).metadata()


# -- multimodal rows and extra columns ------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_multimodal_metadata_and_values(tmp_path, fmt):
    table = multimodal_table()
    path = (write_arrow if fmt == "arrow" else write_parquet)(table, tmp_path / f"mm.{fmt}")
    src = source(path)
    metas = src.metadata()
    assert [sorted(m.modalities) for m in metas] == [["text"], ["image", "text"], ["audio", "text"],
                                                     ["audio", "image"]]
    assert [m.num_tokens for m in metas] == [3, 3, 4, 2]
    assert [m.num_patches for m in metas] == [0, 16, 0, 4]
    # No num_frames column: derived from the waveform length and sample rate as the audio encoder
    # frames it (25 ms windows every 10 ms: 0.1 s is 8 frames at either rate).
    assert [m.num_frames for m in metas] == [0, 0, 8, 8]
    assert [m.num_frames for m in metas[2:]] == [num_frames(800, 8000), num_frames(1600, 16000)]
    got = src.read([3, 1, 0, 2])
    assert got["image"] == [b"\x89PNG-b", b"\x89PNG-a", None, None]
    assert got["audio"][0].dtype == np.float32 and got["audio"][0].shape == (800,) and got["audio"][1] is None
    assert got["sample_rate"] == [8000, None, None, 16000]
    assert got["caption"] == ["d", "b", "a", None]
    assert got["modalities"][0] == ["image", "audio"]


def test_num_frames_column_wins(tmp_path):
    table = multimodal_table().append_column("num_frames", pa.array([0, 0, 7, 3], pa.int32()))
    metas = source(write_arrow(table, tmp_path / "f.arrow")).metadata()
    assert [m.num_frames for m in metas] == [0, 0, 7, 3]


# -- bad input ------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(PipelineError, match=r"^data\.path: no such file: .*nothing\.arrow$"):
        source(tmp_path / "nothing.arrow")


def test_unreadable_file(tmp_path):
    (tmp_path / "junk.arrow").write_bytes(b"this is not arrow at all" * 10)
    with pytest.raises(PipelineError, match="not a readable Arrow IPC or Parquet file: .*junk.arrow"):
        source(tmp_path / "junk.arrow")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PipelineError, match=r"no Parquet files \(.parquet, .pq, .parq\) in folder"):
        source(tmp_path / "empty")


def test_a_parquet_folder_refuses_what_it_would_leave_out(tmp_path):
    """Found in review: a folder's .arrow file (half the data) was skipped without a word, and
    .pq files were not read."""
    import os

    import pyarrow.parquet as pq

    from loaders.demo import text_demo_table

    folder = tmp_path / "data"
    folder.mkdir()
    table = text_demo_table(num_samples=20)
    pq.write_table(table.slice(0, 10), folder / "a.parquet")
    pq.write_table(table.slice(10, 10), folder / "b.PQ")
    (folder / "_SUCCESS").write_text("")  # what Spark leaves: not data
    (folder / "README.md").write_text("a dataset card")  # nor this (found in review: refused)
    (folder / "part-0.parquet.crc").write_bytes(b"x")
    (folder / "images").mkdir()
    assert len(source(folder).metadata()) == 20
    (folder / "c.arrow").write_bytes(b"x")
    with pytest.raises(PipelineError, match=r"holds file 'c.arrow' beside its Parquet files"):
        source(folder)
    os.remove(folder / "c.arrow")
    (folder / "part=1").mkdir()
    pq.write_table(table.slice(0, 1), folder / "part=1" / "x.parquet")
    with pytest.raises(PipelineError, match=r"holds subfolder 'part=1' \(partitions are not read\)"):
        source(folder)


def test_a_path_that_is_neither_file_nor_folder_is_refused_not_waited_on(tmp_path):
    """Found in review: a FIFO with no writer hung `maestro validate`."""
    import os

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(PipelineError, match=r"is not a regular file or a folder \(a pipe or a device\?\)"):
        source(tmp_path / "fifo")


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_missing_required_column(tmp_path, fmt):
    table = multimodal_table(tokens=None)
    path = (write_arrow if fmt == "arrow" else write_parquet)(table, tmp_path / f"x.{fmt}")
    with pytest.raises(PipelineError) as err:
        source(path)
    msg = str(err.value)
    assert "required column 'tokens' is missing" in msg and str(path) in msg and "\n" not in msg


def test_wrong_column_type(tmp_path):
    table = multimodal_table().set_column(2, "tokens", pa.array([["a"], ["b"], ["c"], ["d"]]))
    path = write_arrow(table, tmp_path / "x.arrow")
    with pytest.raises(PipelineError, match=r"column 'tokens' must be a list of integers \(list<int32>\), got list<item: string>"):
        source(path)


def test_audio_needs_sample_rate_column(tmp_path):
    path = write_arrow(multimodal_table().drop_columns(["sample_rate"]), tmp_path / "x.arrow")
    with pytest.raises(PipelineError, match="'audio' needs a 'sample_rate' column"):
        source(path)


@pytest.mark.parametrize(("replace", "expected"), [
    ({"image": [None, None, None, b"x"]}, r"row 1 \(id 11\) declares modality 'image' but column 'image' is null"),
    ({"image": [b"x", b"y", None, b"z"]}, r"row 0 \(id 10\) has a value in column 'image' but 'image' is not"),
    ({"modalities": [["text"], ["text", "image"], ["video"], ["image", "audio"]]},
     r"row 2 \(id 12\) has unknown modality 'video'"),
    ({"modalities": [["text"], ["text", "image"], ["text"], ["image", "audio"]]},
     r"row 2 \(id 12\) has a value in column 'audio'"),
    ({"modalities": [[], ["text", "image"], ["audio"], ["image", "audio"]]}, r"row 0 \(id 10\) declares no modal"),
    ({"sample_rate": [None, None, None, 8000]}, r"row 2 \(id 12\) has audio but no positive sample_rate"),
    ({"id": [10, None, 12, 13]}, r"row 1 has a null id"),
    ({"tokens": [[257, 1, 2], [], [257, 4, 5, 6], [259, 7]]}, r"row 1 \(id 11\) has no tokens"),
    ({"tokens": [[257, 1, 2], [257, -3], [257, 4, 5, 6], [259, 7]]},
     r"row 1 \(id 11\) has token id -3, outside 0..2147483647"),
    # Reproduced before: a null inside the list was read as -2147483648 and passed every check.
    ({"tokens": [[257, 1, 2], [257, None, 3], [257, 4, 5, 6], [259, 7]]},
     r"row 1 \(id 11\) has a null token id \(at position 1\)"),
    ({"audio": [None, None, [0.5, None] * 800, [0.25] * 800]}, r"row 2 \(id 12\) has a null element in column 'audio'"),
    # Found in review: one NaN (or inf) sample made the loss of every later step NaN, exit 0.
    ({"audio": [None, None, [0.5] * 800, [0.25] * 799 + [float("nan")]]},
     r"row 3 \(id 13\) has a NaN or infinite value in column 'audio'"),
    ({"audio": [None, None, [float("-inf")] + [0.5] * 799, [0.25] * 800]},
     r"row 2 \(id 12\) has a NaN or infinite value in column 'audio'"),
    # Found in review: an empty clip trained as one silent frame; an empty image failed only at run time.
    ({"audio": [None, None, [], [0.25] * 800]}, r"row 2 \(id 12\) has an empty audio in column 'audio'"),
    ({"image": [None, b"", None, b"x"]}, r"row 1 \(id 11\) has an empty image in column 'image'"),
    # Found in review: a sample count given as the rate framed the clip into windows of millions of samples (OOM).
    ({"sample_rate": [None, None, 2**31 - 1, 8000]}, r"row 2 \(id 12\) has sample_rate 2147483647, above 768000 Hz"),
    # Found in QA: kHz given as Hz framed each 25 ms window as one sample, and trained.
    ({"sample_rate": [None, None, 16000, 16]}, r"row 3 \(id 13\) has sample_rate 16, below 1000 Hz \(kHz given as Hz\?\)"),
    ({"sample_rate": [None, None, 16000, 500]}, r"row 3 \(id 13\) has sample_rate 500, below 1000 Hz;"),  # no kHz hint
])
def test_rows_whose_modalities_do_not_match_their_columns(tmp_path, replace, expected):
    path = write_arrow(multimodal_table(**replace), tmp_path / "bad.arrow")
    src = source(path)  # construction stays cheap: the rows are checked by metadata()
    with pytest.raises(PipelineError, match=expected) as err:
        src.metadata()
    assert "data.skip_bad_rows=true" in str(err.value)


def test_declared_modality_without_its_column(tmp_path):
    table = multimodal_table(audio=None, sample_rate=None,
                             modalities=[["text"], ["text", "image"], ["audio"], ["image"]])
    with pytest.raises(PipelineError, match=r"row 2 \(id 12\) declares modality 'audio' but there is no 'audio'"):
        source(write_arrow(table, tmp_path / "x.arrow")).metadata()


def test_skip_bad_rows_skips_and_counts(tmp_path):
    table = multimodal_table(image=[None, None, None, b"x"], modalities=[["text"], ["text", "image"], ["video"],
                                                                        ["image", "audio"]])
    path = write_parquet(table, tmp_path / "bad.parquet", row_group_rows=2)
    with pytest.raises(PipelineError, match=r"row 1 \(id 11\).*\(2 bad rows in all\)"):
        source(path).metadata()
    src = source(path, skip_bad_rows=True)
    metas = src.metadata()
    assert [(m.id, m.row) for m in metas] == [(10, 0), (13, 3)]
    assert src.num_skipped == 2 and src.skipped_ids == (11, 12) and src.skipped_rows == (1, 2)
    assert len(src) == 4


@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_duplicate_ids(tmp_path, fmt):
    table = text_demo_table(num_samples=100, seed=0)
    ids = list(range(100))
    ids[70] = 5
    table = table.set_column(0, "id", pa.array(ids, pa.int64()))
    path = (write_arrow if fmt == "arrow" else write_parquet)(table, tmp_path / f"d.{fmt}", **(
        {"batch_rows": 32} if fmt == "arrow" else {"row_group_rows": 32}))
    with pytest.raises(PipelineError, match="id 5 appears more than once"):
        source(path, skip_bad_rows=True).metadata()


# -- the demo builder and the tokenizer -----------------------------------------------------------

def test_demo_is_real_text_and_deterministic(tmp_path):
    a = build_text_demo(tmp_path / "a", num_samples=200)
    b = build_text_demo(tmp_path / "b", num_samples=200)
    c = build_text_demo(tmp_path / "c", num_samples=200, seed=1, parquet=False)
    assert a.name == "text.arrow" and (tmp_path / "a" / "text.parquet").exists()
    assert not (tmp_path / "c" / "text.parquet").exists()
    assert a.read_bytes() == b.read_bytes()
    assert (tmp_path / "a" / "text.parquet").read_bytes() == (tmp_path / "b" / "text.parquet").read_bytes()
    assert a.read_bytes() != c.read_bytes()
    tokens = source(a).read(range(200), columns=["tokens"])["tokens"]
    prose = " ".join(text.decode(t) for t in tokens)
    words = prose.lower().split()
    for common in ("the", "a", "of", "to", "is", "and"):
        assert common in words
    assert all(int(t.max()) <= text.EOS and ((t == text.BOS).sum(), (t == text.EOS).sum()) == (1, 1)
               for t in tokens)
    assert prose.isascii()
    lengths = [len(t) for t in tokens]
    assert min(lengths) >= 32 and max(lengths) <= 128 and np.median(lengths) < 80  # long-tailed


def test_demo_table_schema_and_bounds():
    table = text_demo_table(num_samples=50, min_tokens=8, max_tokens=16, seed=2)
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("id").type == pa.int64()
    lengths = [len(t) for t in table.column("tokens").to_pylist()]
    assert min(lengths) >= 8 and max(lengths) <= 16
    with pytest.raises(ValueError):
        text_demo_table(num_samples=5, min_tokens=10, max_tokens=9)


def test_parquet_written_by_demo_has_row_groups(tmp_path):
    path = write_parquet(text_demo_table(num_samples=100), tmp_path / "t.parquet", row_group_rows=30)
    assert pq.ParquetFile(path).metadata.num_row_groups == 4


@given(st.text())
def test_tokenizer_round_trip(s):
    ids = text.encode(s, bos=True, eos=True)
    assert ids[0] == text.BOS and ids[-1] == text.EOS
    assert all(0 <= i < text.VOCAB_SIZE for i in ids)
    assert text.decode(ids) == s


def test_tokenizer_specials():
    assert (text.PAD, text.BOS, text.EOS, text.IMAGE, text.AUDIO, text.VOCAB_SIZE) == (256, 257, 258, 259, 260, 261)
    ids = [text.BOS, text.IMAGE, text.AUDIO, *text.encode("héllo"), text.EOS, text.PAD]
    assert text.decode(ids) == "héllo"
    assert text.decode(ids, specials=True) == "<bos><image><audio>héllo<eos><pad>"
    assert text.decode(np.array(ids, dtype=np.int32)) == "héllo"
    with pytest.raises(ValueError, match=r"outside the byte-level vocabulary \(0\.\.260\)"):
        text.decode([261])


def pixel_table(**replace) -> pa.Table:
    """Image samples given as precomputed pixel arrays ([3, H, W] nested lists), no encoded bytes."""
    pixels = [np.full((3, 8, 16), 0.5, dtype=np.float32).tolist(), None, np.zeros((3, 16, 8), np.float32).tolist()]
    cols = {"id": [1, 2, 3], "modalities": [["text", "image"], ["text"], ["image"]],
            "tokens": [[257, 259, 5], [257, 6], [259]], "pixel_values": pixels, "num_patches": [2, 0, 2], **replace}
    types = {"id": pa.int64(), "modalities": pa.list_(pa.string()), "tokens": pa.list_(pa.int32()),
             "pixel_values": pa.list_(pa.list_(pa.list_(pa.float32()))), "num_patches": pa.int32()}
    return pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})


def test_a_modality_column_carries_precomputed_pixels(tmp_path):
    path = write_arrow(pixel_table(), tmp_path / "px.arrow")
    with pytest.raises(PipelineError, match=r"row 0 \(id 1\) declares modality 'image' but there is no 'image' column"):
        source(path).metadata()
    src = source(path, modality_columns={"image": "pixel_values"})
    assert [sorted(m.modalities) for m in src.metadata()] == [["image", "text"], ["text"], ["image"]]
    value = src.read([0], ["pixel_values"])["pixel_values"][0]
    assert np.asarray(value).shape == (3, 8, 16)
    bad = write_arrow(pixel_table(modalities=[["text"], ["text"], ["image"]]), tmp_path / "bad.arrow")
    with pytest.raises(PipelineError, match=r"row 0 \(id 1\) has a value in column 'pixel_values' but 'image' is not"):
        source(bad, modality_columns={"image": "pixel_values"}).metadata()
    with pytest.raises(PipelineError, match=r"data.modality_columns.image: no column 'pixels'"):
        source(path, modality_columns={"image": "pixels"})
    # Found in review: without a num_patches column every image counted 0 patches, silently.
    counted = write_arrow(pixel_table().drop_columns(["num_patches"]), tmp_path / "uncounted.arrow")
    with pytest.raises(PipelineError, match=r"sample id 1 has an image, and the data has no 'num_patches' column"):
        source(counted, modality_columns={"image": "pixel_values"}).metadata()


def test_token_ids_past_int64_are_a_bad_row_not_a_crash(tmp_path):
    # Reproduced before: a uint64 token column with a value >= 2**63 raised ArrowInvalid (a traceback).
    table = multimodal_table().set_column(2, "tokens", pa.array([[257, 1], [257, 2**63 + 5], [257, 4], [259, 7]],
                                                                 pa.list_(pa.uint64())))
    with pytest.raises(PipelineError, match=r"row 1 \(id 11\) has token id 9223372036854775813, outside"):
        source(write_arrow(table, tmp_path / "big.arrow")).metadata()


def test_non_finite_values_are_found_in_nested_lists():
    """Precomputed pixel_values are lists of lists: a NaN deep inside names its row."""
    import pyarrow as pa

    from loaders.arrow_rows import rows_with_non_finite

    pixels = pa.array([[[1.0, 2.0], [3.0]], None, [[4.0], [float("nan")]], [[float("inf")]], []],
                      type=pa.list_(pa.list_(pa.float32())))
    assert rows_with_non_finite(pixels).tolist() == [False, False, True, True, False]
    assert rows_with_non_finite(pixels.slice(2, 2)).tolist() == [True, True]
    assert rows_with_non_finite(pa.array([[1, 2], [3]], type=pa.list_(pa.int32()))).tolist() == [False, False]


def test_a_modality_section_on_data_without_its_column_says_to_take_it_out(tmp_path):
    """Found in QA: the multimodal pipeline on data without audio said only that the column is missing."""
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    table = multimodal_table(modalities=[["text"], ["text", "image"], ["text"], ["image"]], audio=None,
                             sample_rate=None)
    path = write_arrow(table, tmp_path / "no_audio.arrow")
    pipeline = load_pipeline("pipelines/multimodal.py", {"data.path": str(path), "global_batch": 4})[0]
    with pytest.raises(PipelineError, match=r"^sections\.audio\.columns: dataset .* has no column 'audio' \(its "
                                            r"columns: id, modalities, tokens, image, num_patches, caption\); without "
                                            r"audio data, take section 'audio' and its edges out of the pipeline$"):
        check_pipeline(pipeline)
