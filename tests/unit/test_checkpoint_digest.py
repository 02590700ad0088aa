"""Checksums of a checkpoint's files (checkpoint/digest.py): each rank records what it wrote, and
a file changed since is refused by name before anything reads it."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from maestro_flow.checkpoint import digest
from maestro_flow.checkpoint.manifest import Manifest
from maestro_flow.checkpoint.section_state import SectionState
from maestro_flow.errors import PipelineError
from maestro_flow.optim.stepper import SectionOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_a_file_changed_shortened_or_gone_is_named(tmp_path):
    for name, data in (("a.bin", b"x" * 100), ("b.bin", os.urandom(3 * 1024)), ("c.bin", b"")):
        (tmp_path / name).write_bytes(data)
    files = digest.of_files(str(tmp_path), [str(tmp_path / n) for n in ("a.bin", "b.bin", "c.bin")])
    assert files["a.bin"] == [100, f"{zlib.crc32(b'x' * 100):08x}"] and files["c.bin"] == [0, "00000000"]
    assert digest.problems(str(tmp_path), files) == []
    blob = bytearray((tmp_path / "b.bin").read_bytes())
    blob[1000] ^= 1  # one bit, same size
    (tmp_path / "b.bin").write_bytes(bytes(blob))
    (tmp_path / "a.bin").write_bytes(b"x" * 99)
    (tmp_path / "c.bin").unlink()
    found = digest.problems(str(tmp_path), files)
    assert found[0] == "a.bin: 99 bytes, 100 when saved"
    assert found[1].startswith("b.bin: its bytes changed since it was saved (CRC-32 ")
    assert found[2] == "c.bin: missing"
    with pytest.raises(PipelineError, match=r"^--resume X: 3 of its 3 files are not as saved \(checksums in its "
                                            r"manifest\): a.bin: 99 bytes, 100 when saved; b.bin: .*; c.bin: missing"
                                            r"; before it$"):
        digest.check(str(tmp_path), files, "--resume X", "; before it")
    assert digest.check(str(tmp_path), {}, "--resume X") >= 0  # an older checkpoint: nothing to check


def test_a_save_records_every_file_it_wrote_and_the_manifest_keeps_them(tmp_path):
    """Every file a rank writes (DCP shards, its .metadata, the RNG states) has its checksum, and
    nothing else in the folder is left out."""
    (tmp_path / "rng").mkdir()
    torch.manual_seed(0)
    stage = torch.nn.Linear(3, 2)
    optim = SectionOptimizer({"name": "adamw", "lr": 0.1}, list(stage.parameters()), total_steps=2)
    for p in stage.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    info = SectionState(stage, optim, section="x", replica=0, group=None, device=torch.device("cpu")).save(
        str(tmp_path))
    on_disk = sorted(os.path.relpath(os.path.join(root, f), tmp_path).replace(os.sep, "/")
                     for root, _, names in os.walk(tmp_path) for f in names)
    assert sorted(info["files"]) == on_disk and "x/.metadata" in on_disk and "rng/x-0.pt" in on_disk
    assert digest.problems(str(tmp_path), info["files"]) == []
    manifest = Manifest(step=1, pipeline={}, sections={}, sampler={}, files=info["files"])
    assert Manifest.from_dict(json.loads(manifest.to_json())).files == info["files"]


def test_an_interrupt_stops_the_reads_under_way(tmp_path, monkeypatch):
    """Found in review: an interrupt during --resume's checksums (Ctrl-C, or a SIGTERM, now one)
    waited for the files being read (15 s on 48 GB)."""
    import signal
    import threading
    import time

    calls = []

    class SlowZlib:
        @staticmethod
        def crc32(block, crc=0):
            calls.append(1)
            time.sleep(0.01)
            return zlib.crc32(block, crc)

    monkeypatch.setattr(digest, "zlib", SlowZlib)
    monkeypatch.setattr(digest, "CHUNK", 1024)
    (tmp_path / "big.bin").write_bytes(b"x" * 1024 * 500)  # 500 chunks: 5 s
    main = threading.main_thread().ident
    threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT)).start()  # a real signal wakes the wait
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        digest.problems(str(tmp_path), {"big.bin": [1024 * 500, "00000000"]}, threads=1)
    assert time.monotonic() - start < 2.0 and len(calls) < 200
