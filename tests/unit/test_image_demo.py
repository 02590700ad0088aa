"""Unit tests of loaders/images.py and of the image and multimodal demos in loaders/demo.py."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

from loaders import text
from loaders.arrow import ArrowSource
from loaders.dali import ImageDecoder, decode_rgb, num_patches
from loaders.demo import (
    AUDIO_SAMPLE_RATE,
    audio_num_frames,
    build_image_demo,
    build_multimodal_demo,
    main,
    tone_waveform,
)
from loaders.images import DIGIT_WORDS, box_downscale, digit_images, encode_png, image_samples, photo_crops
from maestro_flow import ArrowData

CAPTION = re.compile(r"^[a-z][a-z ,-]*[a-z]$")
SUBJECTS = ("temple", "flower", *DIGIT_WORDS)


def mentions_subject(caption: str) -> bool:
    return bool(set(re.findall(r"[a-z]+", caption)) & set(SUBJECTS))


def source(path) -> ArrowSource:
    return ArrowSource(ArrowData(path=str(path)))


# -- loaders.images -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 13, 3), (48, 33, 3)])
def test_png_round_trips_through_dali(shape):
    rgb = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    data = encode_png(rgb)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    np.testing.assert_array_equal(decode_rgb([data])[0], rgb)


def test_encode_png_rejects_other_arrays():
    for bad in (np.zeros((4, 4), np.uint8), np.zeros((4, 4, 3), np.float32), np.zeros((0, 4, 3), np.uint8)):
        with pytest.raises(ValueError, match=r"uint8 array \[H, W, 3\]"):
            encode_png(bad)


def test_box_downscale_averages_blocks():
    image = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    out = box_downscale(image, 2, 3)
    expected = np.rint(image.reshape(2, 2, 3, 2, 3).astype(np.float64).mean(axis=(1, 3))).astype(np.uint8)
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="shrinks only"):
        box_downscale(image, 5, 3)


def test_image_sources_are_deterministic_and_sized_as_declared():
    crops, digits = photo_crops(5, seed=3), digit_images(5, seed=3)
    assert crops == photo_crops(5, seed=3) and digits == digit_images(5, seed=3)
    assert crops != photo_crops(5, seed=4)
    decoded = decode_rgb([s.data for s in crops + digits])
    for sample, array in zip(crops + digits, decoded, strict=True):
        assert array.shape == (sample.height, sample.width, 3)
        assert CAPTION.match(sample.caption) and mentions_subject(sample.caption)
    for sample in digits:
        assert sample.height == sample.width and 16 <= sample.height <= 48 and sample.source == "digits"
    for sample in crops:
        assert max(sample.height, sample.width) <= 96 and sample.source in ("china", "flower")
    mix = image_samples(40, seed=0)
    assert Counter(s.format for s in mix) == {"png": 38, "jpeg": 2}
    assert {s.source for s in mix} == {"digits", "china", "flower"}


# -- the image demo ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("share", "num_images"), [(0.0, 0), (0.33, 21), (1.0, 64)])
def test_image_demo_share_and_layout(tmp_path, share, num_images):
    src = source(build_image_demo(tmp_path, num_samples=64, image_share=share))
    metas = src.metadata()
    assert [m.id for m in metas] == list(range(64))
    with_image = [m for m in metas if "image" in m.modalities]
    assert len(with_image) == num_images
    assert all(m.modalities == {"text"} and m.num_patches == 0 for m in metas if m not in with_image)
    rows = src.read(range(64))
    for i, m in enumerate(metas):
        tokens, caption = rows["tokens"][i], rows["caption"][i]
        assert tokens[0] == text.BOS and tokens[-1] == text.EOS and text.AUDIO not in tokens
        if m in with_image:
            assert tokens[1] == text.IMAGE and (tokens == text.IMAGE).sum() == 1
            assert text.decode(tokens) == caption and CAPTION.match(caption)
            assert mentions_subject(caption)
        else:
            assert rows["image"][i] is None and caption is None and text.IMAGE not in tokens
            assert len(text.decode(tokens).split()) >= 3  # prose from the docstrings


@pytest.mark.parametrize(("max_side", "patch"), [(64, 8), (32, 16)])
def test_image_demo_num_patches_match_the_decoder(tmp_path, max_side, patch):
    src = source(build_image_demo(tmp_path, num_samples=64, image_share=0.5, seed=5, max_side=max_side,
                                  patch=patch))
    metas = [m for m in src.metadata() if "image" in m.modalities]
    images = src.read([m.row for m in metas], columns=["image"])["image"]
    decoded = ImageDecoder(max_side=max_side, patch=patch).decode(images, [m.id for m in metas])
    assert [(t.shape[1] // patch) * (t.shape[2] // patch) for t in decoded] == [m.num_patches for m in metas]
    assert len({m.num_patches for m in metas}) > 2


def test_image_demo_is_deterministic(tmp_path):
    a = build_image_demo(tmp_path / "a", num_samples=48, parquet=True)
    b = build_image_demo(tmp_path / "b", num_samples=48)
    c = build_image_demo(tmp_path / "c", num_samples=48, seed=1)
    assert a.name == "vlm.arrow" and a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert source(tmp_path / "a" / "vlm.parquet").metadata() == source(a).metadata()
    with pytest.raises(ValueError, match="image_share must be in"):
        build_image_demo(tmp_path, num_samples=8, image_share=1.5)


# -- the multimodal demo ------------------------------------------------------------------------------

def test_tone_waveform_and_frames():
    wave = tone_waveform("ab c")
    assert wave.dtype == np.float32 and wave.shape == (4 * 240,)  # 30 ms per character at 8 kHz
    assert np.abs(wave[480:720]).max() == 0.0 and 0.4 < np.abs(wave[:240]).max() <= 0.5  # space = silence
    assert not np.array_equal(wave[:240], wave[240:480])  # pitch follows the byte
    assert audio_num_frames(240, 8000) == 1 + (240 - 200) // 80 == 1
    assert audio_num_frames(8000, 8000) == 98 and audio_num_frames(10, 8000) == 1


def test_multimodal_demo_mix(tmp_path):
    path = build_multimodal_demo(tmp_path, num_samples=60, image_share=0.3, audio_share=0.4, both_share=0.1)
    assert path.name == "mm.arrow"
    src = source(path)
    metas = src.metadata()
    mix = Counter(frozenset(m.modalities) for m in metas)
    assert mix == {frozenset({"text"}): 24, frozenset({"text", "image"}): 12, frozenset({"text", "audio"}): 18,
                   frozenset({"text", "image", "audio"}): 6}
    rows = src.read(range(60))
    for i, m in enumerate(metas):
        tokens, audio, caption = rows["tokens"][i], rows["audio"][i], rows["caption"][i]
        assert ("image" in m.modalities) == (rows["image"][i] is not None) == (m.num_patches > 0)
        assert ("audio" in m.modalities) == (audio is not None) == (m.num_frames > 0)
        assert (tokens == text.IMAGE).sum() == ("image" in m.modalities)
        assert (tokens == text.AUDIO).sum() == ("audio" in m.modalities)
        if audio is not None:
            assert audio.dtype == np.float32 and rows["sample_rate"][i] == AUDIO_SAMPLE_RATE
            assert len(audio) == 240 * len(caption) and m.num_frames == audio_num_frames(len(audio), 8000)
            np.testing.assert_array_equal(audio, tone_waveform(caption))
        if "image" in m.modalities:
            assert m.num_patches == num_patches(*decode_rgb([rows["image"][i]])[0].shape[:2], 64, 8)
        if m.modalities != {"text"}:
            assert text.decode(tokens) == caption and len(caption.split()) >= 2
    assert len({len(a) for a in rows["audio"] if a is not None}) > 5  # clip lengths vary
    with pytest.raises(ValueError, match="both_share <= image_share"):
        build_multimodal_demo(tmp_path, num_samples=10, image_share=0.1, audio_share=0.5, both_share=0.2)


def test_main_builds_the_requested_demos(tmp_path, capsys):
    assert main([str(tmp_path), "--only", "vlm", "--only", "mm", "--vlm-samples", "12", "--mm-samples", "12",
                 "--no-parquet"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "vlm.arrow"), str(tmp_path / "mm.arrow")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mm.arrow", "vlm.arrow"]
    assert len(source(tmp_path / "mm.arrow").metadata()) == 12
