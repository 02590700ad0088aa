"""What the nodes of a run compare beyond the pipeline's settings (runtime/fingerprint.py): the
code of maestro_flow, of the stages' packages and of the pipeline file, the data files (sampled),
and the versions. Found in review: a node with other stage code or another copy of the data
joined and trained other maths without a word."""

from __future__ import annotations

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
    one = fp.data(str(project / "data" / "part-0.arrow"))  # data.path a file: named by its file name
    assert list(one) == ["part-0.arrow"] and one["part-0.arrow"].startswith("size 1000 sha256 ")


def test_a_large_data_file_is_sampled_not_read_whole(tmp_path, monkeypatch):
    """Its start, end and 16 blocks between count (and its size); a change elsewhere does not."""
    monkeypatch.setattr(fp, "HEAD", 64)
    monkeypatch.setattr(fp, "TAIL", 64)
    monkeypatch.setattr(fp, "BLOCK", 16)
    path = tmp_path / "big.arrow"
    base = bytearray(100_000)
    path.write_bytes(bytes(base))
    same = fp.data(str(path))
    sampled = 64 + (100_000 - 64 - 64 - 16) * 1 // 17  # the first block between the head and the tail
    for at, seen in ((0, True), (100_000 - 1, True), (sampled + 3, True), (50_000 + 400, False)):
        changed = bytearray(base)
        changed[at] = 1
        path.write_bytes(bytes(changed))
        assert (fp.data(str(path)) != same) is seen, at


def test_an_installed_package_counts_by_its_version(project):
    """A config value naming a class of an installed package ("module:Attr"): its version, not its files."""
    pipeline = _pipeline("mystages.model:Model", str(project / "data"), {"decoder": {"cls": "torch.nn:Linear"}})
    from importlib import metadata

    code = fp.fingerprint(pipeline, str(project / "pipe.py"))["code"]
    assert code["torch"] == f"version {metadata.version('torch')}"
    assert not any(k.startswith("torch/") for k in code)
