"""What the nodes of a run compare beyond the pipeline's settings (runtime/fingerprint.py): the
code of maestro_flow, of the stages' packages and of the pipeline file, the data files (sampled),
and the versions. Found in review: a node with other stage code or another copy of the data
joined and trained other maths without a word."""

from __future__ import annotations

import os
import sys
import types

import pytest

from maestro_flow.runtime import fingerprint as fp


def _pipeline(stage: str, data: str, config: dict | None = None):
    section = types.SimpleNamespace(stage=stage, config=config or {})
    return types.SimpleNamespace(sections=[section], data=types.SimpleNamespace(path=data,
                                                                               source="loaders.arrow:ArrowSource"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A user's project: a stage package beside the pipeline file, a data folder."""
    pkg = tmp_path / "mystages"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("class Model: pass\n")
    (pkg / "sub" / "blocks.py").write_text("WIDTH = 4\n")
    os.symlink("someone@host.123:1700000000", pkg / ".#model.py")  # Emacs' lock link beside an edited file
    (tmp_path / "pipe.py").write_text("def pipeline(**o): pass\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.arrow").write_bytes(b"a" * 1000)
    (tmp_path / "data" / "part-1.arrow").write_bytes(b"b" * 1000)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("mystages", None)


def test_a_changed_helper_module_or_pipeline_file_is_named(project):
    pipeline = _pipeline("mystages.model:Model", str(project / "data"))
    before = fp.fingerprint(pipeline, str(project / "pipe.py"))
    assert {"mystages/model.py", "mystages/sub/blocks.py", "pipeline file", "maestro_flow/runtime/agent.py",
            "loaders/arrow.py"} <= set(before["code"])
    assert set(before["data"]) == {"part-0.arrow", "part-1.arrow"} and set(before["versions"]) == {"python", "torch"}
    assert not any(".#" in k for k in before["code"])  # an editor's files are no code (found in review: it raised)
    assert before["versions"]["python"] == "{}.{}".format(*sys.version_info)  # not the patch level
    assert fp.differences(before, before) == []
    (project / "mystages" / "sub" / "blocks.py").write_text("WIDTH = 8\n")  # not the stage's own module
    (project / "pipe.py").write_text("def pipeline(**o): return None\n")
    after = fp.fingerprint(pipeline, str(project / "pipe.py"))
    assert fp.differences(after, before) == ["code: mystages/sub/blocks.py (differs), pipeline file (differs)"]


def test_data_files_that_differ_are_named(project):
    pipeline = _pipeline("mystages.model:Model", str(project / "data"))
    before = fp.fingerprint(pipeline, str(project / "pipe.py"))
    (project / "data" / "part-1.arrow").write_bytes(b"b" * 999 + b"c")
    (project / "data" / "part-2.arrow").write_bytes(b"")
    after = fp.fingerprint(pipeline, str(project / "pipe.py"))
    assert fp.differences(after, before) == ["data files: part-1.arrow (differs), part-2.arrow (not on node 0)"]
    one = fp.data([str(project / "data" / "part-0.arrow")])  # one file: named by its file name
    assert list(one) == ["part-0.arrow"] and one["part-0.arrow"].startswith("size 1000 sha256 ")


def test_a_large_data_file_is_sampled_not_read_whole(tmp_path):
    """Its start, end and 16 blocks between count (and its size); a change elsewhere does not."""
    path = tmp_path / "big.arrow"
    base = bytearray(100_000)
    path.write_bytes(bytes(base))
    same = fp._sampled_hash(str(path), 300)  # 100 bytes at each end, 16 blocks of 6
    sampled = 100 + (100_000 - 200 - 6) * 1 // 17  # the first block between the start and the end
    for at, seen in ((0, True), (100_000 - 1, True), (sampled + 3, True), (50_000 + 400, False)):
        changed = bytearray(base)
        changed[at] = 1
        path.write_bytes(bytes(changed))
        assert (fp._sampled_hash(str(path), 300) != same) is seen, at
    assert fp._sampled_hash(str(path), 0) == "size 100000"


def test_many_data_files_are_bounded_in_reads_and_in_the_record(tmp_path, monkeypatch):
    """Found in review: 300k files made a record the store refuses (8 MiB) and 1000 files of 512
    MiB read 3 GiB. The bytes sampled have one budget, and past DETAIL_FILES one digest stands."""
    reads = []
    real = fp._sampled_hash
    monkeypatch.setattr(fp, "_sampled_hash", lambda p, budget: reads.append(budget) or real(p, budget))
    for i in range(600):
        (tmp_path / f"part-{i:04d}.parquet").write_bytes(b"x" * 10)
    out = fp.data([str(p) for p in tmp_path.iterdir()])
    assert list(out) == ["<600 files>"] and sum(reads) <= fp.DATA_BUDGET
    assert sum(1 for b in reads if b) == 200  # every third file sampled (at most 256), the rest by size
    (tmp_path / "part-0003.parquet").write_bytes(b"y" * 10)  # a sampled file: its bytes count
    changed = fp.data([str(p) for p in tmp_path.iterdir()])
    assert changed != out
    (tmp_path / "part-0001.parquet").write_bytes(b"y" * 11)  # one counted by size: its size counts
    assert fp.data([str(p) for p in tmp_path.iterdir()]) != changed


def test_what_the_loader_does_not_read_is_left_out_and_nothing_blocks(tmp_path):
    """Found in review: a README, _SUCCESS and a log folder beside the Parquet files were compared
    (the source's own files are, where it names them), a FIFO blocked the fingerprint and a
    dangling symlink raised."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loaders.arrow import ArrowSource
    from maestro_flow.config import ArrowData

    n = 4
    table = pa.table({"id": pa.array(range(n), pa.int64()), "modalities": pa.array([["text"]] * n),
                      "tokens": pa.array([[1, 2]] * n, pa.list_(pa.int32()))})
    pq.write_table(table, tmp_path / "part-0.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    source = ArrowSource(ArrowData(path=str(tmp_path)))
    (tmp_path / "README.md").write_text("notes")  # written after it was opened: it reads no README
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "prep.log").write_text("log")
    assert list(fp.data(source.files)) == ["part-0.parquet"]
    os.mkfifo(tmp_path / "pipe")
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    assert fp._sampled_hash(str(tmp_path / "pipe"), 100) == "not a regular file"
    assert fp._sampled_hash(str(tmp_path / "dangling"), 100).startswith("unreadable (")


def test_a_data_folder_with_links_back_up_its_tree_ends_and_names_what_a_copy_would(tmp_path):
    """Found (the last notes' leftover, proven this session): two links to a folder above them (a
    source that names no files of its own) made the walk branch without end. A folder reached by
    two paths without a loop is listed under both (found in review of the first fix, which
    listed it once: a node whose copy of the tree turned the link into a folder was refused)."""
    import shutil

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.bin").write_bytes(b"x")
    (tmp_path / "d" / "sub" / "b.bin").write_bytes(b"y")
    os.symlink(tmp_path / "d" / "sub", tmp_path / "d" / "again")  # a second way to the same folder
    shutil.copytree(tmp_path / "d", tmp_path / "copy")  # the link as a folder (cp -rL)
    os.symlink("..", tmp_path / "d" / "sub" / "up")
    os.symlink(".", tmp_path / "d" / "self")
    files = fp._data_files(str(tmp_path / "d"))
    assert sorted(os.path.relpath(f, tmp_path / "d") for f in files) == ["a.bin", "again/b.bin", "sub/b.bin"]
    copied = fp._data_files(str(tmp_path / "copy"))
    assert sorted(os.path.relpath(f, tmp_path / "copy") for f in copied) == ["a.bin", "again/b.bin", "sub/b.bin"]


def test_code_installed_or_editable_is_the_same_code(project, tmp_path):
    """Found in review: a package installed (not editable) counted by its version, so the same code
    installed two ways was refused and installed copies with other code passed."""
    import shutil

    pipeline = _pipeline("mystages.model:Model", str(project / "data"))
    here = fp.code(pipeline, str(project / "pipe.py"))
    copy = tmp_path / "site-packages"
    shutil.copytree(project / "mystages", copy / "mystages", symlinks=True)
    sys.modules.pop("mystages", None)
    sys.path.insert(0, str(copy))
    try:
        assert fp.code(pipeline, str(project / "pipe.py")) == here  # installed elsewhere: the same files
        (copy / "mystages" / "model.py").write_text("class Model: x = 1\n")
        assert fp.differences({"code": fp.code(pipeline, str(project / "pipe.py"))}, {"code": here}) == [
            "code: mystages/model.py (differs)"]
    finally:
        sys.path.remove(str(copy))


def test_an_installed_package_counts_by_its_version(project):
    """A config value naming a class of an installed package ("module:Attr"): its version, not its files."""
    pipeline = _pipeline("mystages.model:Model", str(project / "data"), {"decoder": {"cls": "torch.nn:Linear"}})
    from importlib import metadata

    code = fp.fingerprint(pipeline, str(project / "pipe.py"))["code"]
    assert code["torch"] == f"version {metadata.version('torch')}"
    assert not any(k.startswith("torch/") for k in code)
