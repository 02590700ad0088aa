"""`maestro validate --payloads`: each image checked as the vision section will take it
(stages.vision.image_problem), run over the dataset by runtime/payloads.py, before any worker
starts; without the option nothing reads the images. Each audio clip with its sample rate
(stages.audio.audio_problem, a PayloadCheck reading two columns). And what validate says of a VLM
whose images have nowhere to go (runtime/checks.py)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from pyarrow import ipc

from loaders.dali import num_patches
from loaders.demo import image_demo_table, multimodal_demo_table
from loaders.images import encode_png, photo_jpegs
from maestro_flow.cli import main
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import PayloadCheck, PayloadNote
from stages.audio import AudioEncoder, num_frames
from stages.vision import VisionEncoder

MM = "pipelines/multimodal.py"  # audio: max_frames 512, the default framing (25 ms every 10 ms)
VLM = "pipelines/vlm.py"  # the demo's vision config: patch 8, max_grid 8, decode.max_side 64
CONFIG = {"patch": 8, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_grid": 8, "decode": {"max_side": 64}}


def check(data, patches: int, config: dict | None = None) -> str | None:
    return VisionEncoder.payload_checks(config or CONFIG)["image"](data, SampleMeta(id=7, num_patches=patches))


def png(height: int, width: int) -> bytes:
    return encode_png(np.zeros((height, width, 3), dtype=np.uint8))


def test_an_image_and_its_num_patches_as_the_decoder_takes_them():
    assert check(png(20, 30), num_patches(20, 30, 64, 8)) is None  # 24 x 32: 12 patches
    problem = check(png(20, 30), 1)
    assert problem.startswith("num_patches is 1 but its image (20x30 pixels, decoded to 24x32) gives 12 patches")
    jpeg = photo_jpegs()["china"]  # 427 x 640, shrunk to 40 x 64
    assert check(jpeg, 40) is None and "gives 40 patches" in check(jpeg, 39)
    # The decode settings are the section's: a smaller max_side makes fewer patches.
    assert check(jpeg, 12, {**CONFIG, "decode": {"max_side": 32}}) is None  # 24 x 32


def test_what_the_decoder_would_refuse_is_named():
    assert "GIF" in check(b"GIF89a" + bytes(64), 1)
    assert "not an image" in check(b"hello world, not an image", 1)
    assert "cut short" in check(png(20, 30)[:60], 12)
    assert check(png(20, 30), 12, {**CONFIG, "decode": {"max_side": 64, "max_pixels": 100}}) == (
        "it is 20 x 30 pixels, more than max_pixels=100 (decode.max_pixels)")
    assert "null" in check(None, 1)


def test_pixel_arrays_and_other_decoders():
    pixels = np.zeros((3, 16, 24), dtype=np.float32)
    assert check(pixels, 6) is None and "gives 6 patches" in check(pixels, 5)
    assert "multiples of patch=8" in check(np.zeros((3, 15, 24)), 6)
    assert "max_grid=8" in check(np.zeros((3, 16, 80)), 20)
    # Another decoder (found in review: one that reads GIFs) reads what it reads: only empty bytes.
    other = {**CONFIG, "decoder": "my.decoders:Other"}
    assert check(png(20, 30), 1, other) is None and check(b"GIF87a" + bytes(64), 1, other) is None
    assert check(b"", 1, other) == "its image is empty (0 bytes)"
    # With skip_corrupt the run skips what the decoder refuses: a note, not a failure.
    skip = {**CONFIG, "decode": {"max_side": 64, "skip_corrupt": True}}
    note = check(b"GIF89a" + bytes(64), 1, skip)
    assert isinstance(note, PayloadNote) and note.endswith("(the run skips it: decode.skip_corrupt)")
    assert not isinstance(check(png(20, 30), 1, skip), PayloadNote)  # a wrong num_patches is still wrong


def audio(wave, rate, frames: int, config: dict | None = None) -> str | None:
    found = AudioEncoder.payload_checks(config or {"max_frames": 512})["audio"]
    assert isinstance(found, PayloadCheck) and found.columns == ("sample_rate",)
    return found.check(wave, SampleMeta(id=7, num_frames=frames), {"sample_rate": rate})


def test_an_audio_clip_and_its_num_frames_at_the_sections_framing():
    wave = np.zeros(8880, dtype=np.float32)  # at 8 kHz: 200-sample frames every 80 samples
    assert num_frames(8880, 8000) == 109 and audio(wave, 8000, 109) is None
    assert audio(wave, 8000, 108) == ("num_frames is 108 but its clip (8880 samples at 8000 Hz) makes 109 frames at "
                                      "frame_s=0.025, hop_s=0.01 (the planner's costs and length checks would "
                                      "count 108, the data's num_frames column or, where it has none, the loader's "
                                      "count at frame_s=0.025, hop_s=0.01; give the column as "
                                      "stages.audio.num_frames(n, sample_rate, frame_s, hop_s) counts)")
    # Another framing than the loader's: the data's figure is wrong, and max_frames counts the clip's.
    assert "makes 55 frames at frame_s=0.025, hop_s=0.02" in audio(wave, 8000, 109, {"hop_s": 0.02})
    assert audio(wave, 8000, 55, {"hop_s": 0.02}) is None
    assert audio(wave, 8000, 109, {"hop_s": 0.002, "max_frames": 512}) == (
        "its clip (8880 samples at 8000 Hz) makes 543 frames at frame_s=0.025, hop_s=0.002, more than max_frames=512")
    assert "null" in audio(None, 8000, 109)
    assert audio(wave, None, 109) == "sample_rate must be a positive integer, got None"
    # What the loader checks only in a column named "audio" (found in review: a data.modality_columns
    # column is not type-checked), the check does itself.
    assert audio(np.zeros((2, 4000)), 8000, 109) == "its audio must be a 1-D waveform, got shape [2, 4000]"
    assert "NaN or infinite" in audio(np.array([0.0, np.nan] * 4440), 8000, 109)
    assert "NaN or infinite" in audio([0.5, None] * 4440, 8000, 109)
    assert audio([[0.5, 0.5], [0.5]], 8000, 109) == "its audio is not a 1-D list of numbers"


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))


def write(table: pa.Table, path) -> str:
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return str(path)


def test_validate_payloads_names_each_bad_sample_and_fails(tmp_path):
    table = image_demo_table(num_samples=48, image_share=0.5, seed=3)
    good = write(table, tmp_path / "good.arrow")
    rows = table.to_pylist()
    imaged = [i for i, r in enumerate(rows) if r["image"] is not None]
    rows[imaged[1]]["num_patches"] += 1
    rows[imaged[4]]["image"] = b"GIF89a" + bytes(64)
    bad = write(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / "bad.arrow")
    runner = CliRunner()

    result = runner.invoke(main, ["validate", VLM, "--payloads", "--set", f"data.path={good}"])
    assert result.exit_code == 0, result.output
    assert f"payloads: {len(imaged)} checked (vision: {len(imaged)}), none failing" in result.stderr
    # Without the option the images are not read: the bad file validates.
    assert runner.invoke(main, ["validate", VLM, "--set", f"data.path={bad}"]).exit_code == 0

    result = runner.invoke(main, ["validate", VLM, "--payloads", "--set", f"data.path={bad}"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    first, second = (rows[imaged[k]] for k in (1, 4))
    assert lines[0].startswith(f"sections.vision: sample {first['id']} (row {imaged[1]}): num_patches is "
                               f"{first['num_patches']} but its image")
    assert lines[1].startswith(f"sections.vision: sample {second['id']} (row {imaged[4]}): a GIF")
    assert lines[2] == f"error: 2 payloads of {len(imaged)} checked would fail in the run or mislead its plans (above)"
    # --json: the same problems and error in one object on stdout, the same exit code
    result = runner.invoke(main, ["validate", VLM, "--payloads", "--json", "--set", f"data.path={bad}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    out = json.loads(result.stdout)
    assert out["valid"] is False and out["payloads"] == lines[:2]
    assert out["error"] == lines[2][len("error: "):].replace("(above)", "(in payloads)")

    # With skip_corrupt the GIF is one the run skips; a section that reads no image column is not checked.
    skip = ["--set", f"data.path={bad}", "--set", "sections.vision.config.decode.skip_corrupt=true"]
    result = runner.invoke(main, ["validate", VLM, "--payloads", *skip, "--set", "data.placeholder_ids.image=259"])
    assert result.exit_code == 2 and "(the run skips it: decode.skip_corrupt)" in result.stderr
    assert "error: 1 payload of" in result.stderr  # the num_patches row still fails
    rows[imaged[1]]["num_patches"] -= 1
    only_gif = write(pa.Table.from_pylist(rows, schema=table.schema), tmp_path / "gif.arrow")
    result = runner.invoke(main, ["validate", VLM, "--payloads", "--set", f"data.path={only_gif}",
                                  "--set", "sections.vision.config.decode.skip_corrupt=true"])
    assert result.exit_code == 0, result.output
    assert f"payloads: {len(imaged)} checked (vision: {len(imaged)}), 1 the run tolerates (above), none failing" \
        in result.stderr
    result = runner.invoke(main, ["validate", VLM, "--payloads", "--set", f"data.path={only_gif}",
                                  "--set", "sections.vision.columns=[]", "--set", "sections.vision.config.decoder=null"])
    assert "payloads: 0 checked" in result.stderr


PROJECTED = """
import dataclasses

from maestro_flow import Edge
from pipelines.vlm import pipeline as vlm


def pipeline(**overrides):
    p = vlm()
    vision = dataclasses.replace(p.section("vision"), config={**p.section("vision").config, "project_to": None})
    proj = dataclasses.replace(p.section("vision"), name="proj", stage="stages.vision:Projector",
                               config={"d_in": 48, "d_out": 64}, columns=(), cost=p.section("llm").cost)
    return dataclasses.replace(p, sections=[vision, proj, p.section("llm")],
                               edges=[Edge(src="vision", dst="proj", tensors=("image_embeds",)),
                                      Edge(src="proj", dst="llm", tensors=("image_embeds",))]).override(**overrides)
"""


def test_a_vlm_whose_image_rows_would_be_dropped_is_refused_or_warned_of(tmp_path):
    """Found in review: both trained with rc 0 and no word, the LLM as text-only."""
    data = write(image_demo_table(num_samples=48, image_share=0.5, seed=3), tmp_path / "vlm.arrow")
    runner = CliRunner()
    result = runner.invoke(main, ["validate", VLM, "--set", f"data.path={data}", "--set", "data.placeholder_ids={}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: data.placeholder_ids: edge vision -> llm carries 'image_embeds', whose "
                                    "rows stages.multimodal:MultimodalLM puts in place of the image placeholder")
    assert result.stderr.endswith("the rows would be dropped. Add data.placeholder_ids.image\n")
    result = runner.invoke(main, ["validate", VLM, "--set", f"data.path={data}", "--set",
                                  "sections.vision.activates_on=audio", "--set",
                                  'data.placeholder_ids={"image": 259, "audio": 260}'])
    assert result.exit_code == 0, result.output
    images = sum("image" in m for m in image_demo_table(num_samples=48, image_share=0.5, seed=3)["modalities"].to_pylist())
    assert result.stderr == (f"warning: sections.vision.activates_on='audio': no sample of {data} carries 'audio' "
                             "(they carry image, text), so the section never runs\n"
                             # Found in QA: the mirror case said nothing (audio rows trained on a VLM).
                             f"warning: {images} samples of {data} carry 'image' but no section has "
                             "activates_on='image': their image is ignored (a placeholder token for it is read as "
                             "text); add an encoder section for it, or leave those samples out\n")
    # Found in QA: an encoder on every sample (no activates_on) that reads the image column uses
    # the images; they were said to be ignored.
    result = runner.invoke(main, ["validate", VLM, "--set", f"data.path={data}", "--set",
                                  "sections.vision.activates_on=null"])
    assert result.exit_code == 0 and "is ignored" not in result.stderr, result.output
    # Found in review: with a projector section between, the encoder's rows reached the LLM by
    # an edge from a section that activates on nothing, and validate said ok. The LLM's own
    # mapping of tensors to modalities decides now, whatever the producer.
    (tmp_path / "projected.py").write_text(PROJECTED)
    result = runner.invoke(main, ["validate", str(tmp_path / "projected.py"), "--set", f"data.path={data}"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["validate", str(tmp_path / "projected.py"), "--set", f"data.path={data}",
                                  "--set", "data.placeholder_ids={}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: data.placeholder_ids: edge proj -> llm carries 'image_embeds'")


def test_validate_payloads_checks_audio_at_the_sections_framing(tmp_path):
    """Found in review: with hop_s=0.002 validate said ok and the run failed at its first long
    clip (more than max_frames); with hop_s=0.02 it ran with every num_frames twice the clip's."""
    table = multimodal_demo_table(num_samples=48, seed=3)
    data = write(table, tmp_path / "mm.arrow")
    clips = sum(r["audio"] is not None for r in table.to_pylist())
    images = sum(r["image"] is not None for r in table.to_pylist())
    runner = CliRunner()
    result = runner.invoke(main, ["validate", MM, "--payloads", "--set", f"data.path={data}"])
    assert result.exit_code == 0, result.output
    assert (f"payloads: {images + clips} checked (vision: {images}, audio: {clips}), none failing"
            in result.stderr)
    for setting, problem in (("hop_s=0.002", "more than max_frames=512"), ("hop_s=0.02", "num_frames is ")):
        args = ["validate", MM, "--set", f"data.path={data}", "--set", f"sections.audio.config.{setting}"]
        assert runner.invoke(main, args).exit_code == 0  # without --payloads: the metadata only
        result = runner.invoke(main, [*args, "--payloads"])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert all(line.startswith("sections.audio: sample ") for line in lines[:-1])
        assert any(problem in line for line in lines[:-1])
        assert lines[-1].startswith(f"error: {clips} payloads of {images + clips} checked would fail")
    # A section whose columns leave the audio column out is not checked.
    result = runner.invoke(main, ["validate", MM, "--payloads", "--set", f"data.path={data}",
                                  "--set", "sections.audio.config.hop_s=0.02", "--set", "sections.audio.columns=[]"])
    assert f"payloads: {images} checked (vision: {images}), none failing" in result.stderr, result.output


STAGES = """
from stages.audio import AudioEncoder
from maestro_flow.stage import PayloadCheck


class Loud(AudioEncoder):
    @classmethod
    def payload_checks(cls, config):
        return {"audio": PayloadCheck(lambda wave, meta, row: None, ("loudness",))}


class Spelt(AudioEncoder):
    @classmethod
    def payload_checks(cls, config):
        return {"audio": PayloadCheck(lambda wave, meta, row: None, "sample_rate")}
"""


def test_the_columns_a_payload_check_reads_are_checked_with_the_pipeline(tmp_path):
    """Found in review: with sections.audio.columns=["audio"] validate --payloads read sample_rate
    anyway and said ok, and the run failed (the stage needs it); a check naming a column the data
    lacks was blamed on the data, and a bare string was split into letters."""
    data = write(multimodal_demo_table(num_samples=48, seed=3), tmp_path / "mm.arrow")
    runner = CliRunner()
    for command in (["validate", MM], ["validate", MM, "--payloads"], ["run", MM, "--no-run-dir"]):
        result = runner.invoke(main, [*command, "--set", f"data.path={data}", "--set",
                                      'sections.audio.columns=["audio"]'])
        assert result.exit_code == 2, result.output
        assert result.stderr.endswith("error: sections.audio.columns: stages.audio:AudioEncoder reads 'sample_rate' "
                                      "with the audio column 'audio', and columns= leaves it out (add "
                                      "'sample_rate')\n"), result.stderr
    (tmp_path / "mystages.py").write_text(STAGES)
    (tmp_path / "mm.py").write_text("from pipelines.multimodal import pipeline\n")
    pipe = str(tmp_path / "mm.py")
    result = runner.invoke(main, ["validate", pipe, "--set", f"data.path={data}", "--set",
                                  "sections.audio.stage=mystages:Loud", "--set", "sections.audio.columns=null"])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: sections.audio.stage: mystages:Loud reads column 'loudness' with its audio "
                             f"payload, and {data} has no such column\n")
    result = runner.invoke(main, ["validate", pipe, "--set", f"data.path={data}", "--set",
                                  "sections.audio.stage=mystages:Spelt"])
    assert result.exit_code == 2, result.output
    assert result.stderr == ("error: sections.audio.stage: mystages:Spelt.payload_checks: the audio check's columns "
                             "must be a tuple of column names, got 'sample_rate'\n")


def test_payloads_are_read_a_few_megabytes_at_a_time(monkeypatch):
    """Long audio clips are megabytes each: rows are read as CHUNK_BYTES of them make, not CHUNK."""
    from maestro_flow.config import Pipeline
    from maestro_flow.runtime import payloads
    from pipelines.multimodal import pipeline

    class Source:
        column_names = ("id", "modalities", "tokens", "audio", "sample_rate")
        reads: list[int] = []

        def read(self, rows, columns):
            self.reads.append(len(rows))
            return {"audio": [np.zeros(65536, dtype=np.float32)] * len(rows), "sample_rate": [8000] * len(rows)}

    monkeypatch.setattr(payloads, "CHUNK_BYTES", 1 << 20)  # 256 KiB clips: 4 to a read
    frames = num_frames(65536, 8000)
    metadata = [SampleMeta(id=i, row=i, modalities=frozenset({"text", "audio"}), num_frames=frames) for i in range(40)]
    p: Pipeline = pipeline().override(sections__audio__config__max_frames=1024)
    report = payloads.check_payloads(p, Source(), metadata)
    assert report.checked == 40 and report.found == 0, report.problems
    assert Source.reads == [16, 4, 4, 4, 4, 4, 4]
