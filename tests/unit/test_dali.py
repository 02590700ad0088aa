"""Unit tests of loaders/dali.py: the size rule, and ImageDecoder on the CPU (DALI, no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from loaders.dali import ImageDecoder, num_patches, target_size
from loaders.images import digit_images, encode_png, photo_crops, photo_jpegs

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def normalised(image_hwc: np.ndarray, mean=MEAN, std=STD) -> np.ndarray:
    """The decoder's output for an image that needs no resizing, computed with numpy: CHW float32."""
    return ((image_hwc.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)


def solid_png(height: int, width: int, rgb=(200, 100, 50)) -> bytes:
    return encode_png(np.broadcast_to(np.array(rgb, np.uint8), (height, width, 3)).copy())


@pytest.fixture(scope="module")
def decoder():
    return ImageDecoder(max_side=64, patch=8)


@pytest.fixture(scope="module")
def samples():
    """PNG crops and digits of varied sizes, and the two JPEG photographs (427 x 640)."""
    items = photo_crops(6, seed=1) + digit_images(4, seed=2)
    jpegs = photo_jpegs()
    return ([s.data for s in items] + [jpegs["china"], jpegs["flower"]],
            [(s.height, s.width) for s in items] + [(427, 640), (427, 640)])


# -- the size rule --------------------------------------------------------------------------------

def test_target_size_examples():
    assert target_size(427, 640, 64, 8) == (40, 64)  # shrunk: 42.7 x 64, snapped to the 8-grid
    assert target_size(640, 427, 64, 8) == (64, 40)
    assert target_size(20, 30, 64, 8) == (24, 32)  # small images are not enlarged, only snapped
    assert target_size(64, 64, 64, 8) == (64, 64)
    assert target_size(1, 1000, 64, 8) == (8, 64)  # at least one patch per side
    assert target_size(100, 100, 60, 8) == (56, 56)  # never above max_side
    assert num_patches(427, 640, 64, 8) == 5 * 8 and num_patches(16, 16, 64, 8) == 4
    with pytest.raises(ValueError, match="max_side must be >= patch"):
        target_size(10, 10, 4, 8)
    with pytest.raises(ValueError, match="image size must be positive"):
        target_size(0, 10, 64, 8)


@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 512), st.integers(1, 64))
def test_target_size_rules(height, width, max_side, patch):
    if max_side < patch:
        return
    h, w = target_size(height, width, max_side, patch)
    for side in (h, w):
        assert side % patch == 0 and patch <= side <= max_side
    # Aspect kept up to the grid: each side is within half a patch (plus one pixel of scaling
    # rounding) of the exactly scaled side, unless clamped to one patch or to the largest side.
    scale = min(1.0, max_side / max(height, width))
    cap = max_side // patch * patch
    for side, original in ((h, height), (w, width)):
        if patch < side < cap:
            assert abs(side - original * scale) <= patch / 2 + 1
    assert num_patches(height, width, max_side, patch) == (h // patch) * (w // patch)


# -- decoding ---------------------------------------------------------------------------------------

def test_shapes_follow_target_size(decoder, samples):
    images, sizes = samples
    out = decoder.decode(images, list(range(len(images))))
    assert len(out) == len(images)
    for tensor, (h, w) in zip(out, sizes, strict=True):
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tuple(tensor.shape) == (3, *target_size(h, w, 64, 8))
    patch_counts = {(t.shape[1] // 8) * (t.shape[2] // 8) for t in out}
    assert len(patch_counts) >= 4  # different sizes give different patch counts


def test_solid_colour_is_normalised(decoder):
    # 100 x 150 is shrunk and snapped (to 40 x 64): a solid colour stays exactly that colour.
    (out,) = decoder.decode([solid_png(100, 150)], [0])
    assert tuple(out.shape) == (3, 40, 64)
    expected = normalised(np.array([[[200, 100, 50]]], np.uint8))[:, 0, 0]
    np.testing.assert_allclose(out.numpy(), np.broadcast_to(expected[:, None, None], out.shape), atol=1e-5)


def test_pixels_are_exact_when_no_resize_is_needed(decoder):
    rgb = np.random.default_rng(0).integers(0, 256, (24, 40, 3), dtype=np.uint8)  # on the grid already
    (out,) = decoder.decode([encode_png(rgb)], [0])
    np.testing.assert_allclose(out.numpy(), normalised(rgb), atol=1e-5)  # CHW, RGB order kept


def test_custom_mean_and_std():
    rgb = np.random.default_rng(1).integers(0, 256, (16, 8, 3), dtype=np.uint8)
    dec = ImageDecoder(max_side=32, patch=8, mean=(0.5, 0.5, 0.5), std=(0.5, 0.25, 1.0))
    (out,) = dec.decode([encode_png(rgb)], [0])
    np.testing.assert_allclose(out.numpy(), normalised(rgb, np.float32([0.5] * 3), np.float32([0.5, 0.25, 1.0])),
                               atol=1e-5)


def test_outputs_do_not_alias_dali_buffers(decoder):
    first = decoder.decode([solid_png(16, 16, (0, 0, 0))], [0])[0].clone()
    kept = decoder.decode([solid_png(16, 16, (0, 0, 0))], [0])[0]
    decoder.decode([solid_png(16, 16, (255, 255, 255))], [1])
    assert torch.equal(kept, first)  # a later decode did not overwrite an earlier result


def test_pipeline_is_reused_across_calls_and_batch_sizes(samples):
    images, _ = samples
    dec = ImageDecoder(batch_size=4)
    one_by_one = [dec.decode([img], [i])[0] for i, img in enumerate(images)]
    for n in (3, 12, 1, 4, 0, 9):  # smaller than, equal to and (cut into batches) larger than batch_size
        got = dec.decode(images[:n], list(range(n)))
        assert len(got) == n
        for a, b in zip(got, one_by_one, strict=False):
            assert torch.equal(a, b)
    assert dec.num_builds == 1 and dec.num_corrupt == 0


# -- corrupt images ---------------------------------------------------------------------------------

BAD = [b"definitely not an image" * 4, b"\x89PNG\r\n\x1a\n" + b"\x00" * 40]


@pytest.mark.parametrize("bad", [*BAD, b""])
def test_corrupt_image_raises_naming_the_sample(decoder, bad):
    good = solid_png(16, 24)
    with pytest.raises(ValueError, match=r"^sample 123: cannot decode image: \S") as err:
        decoder.decode([good, good, bad, good], [120, 121, 123, 124])
    assert "\n" not in str(err.value)
    assert decoder.decode([good], [1])[0].shape == (3, 16, 24)  # still usable afterwards


def test_a_truncated_image_says_why_it_failed(decoder):
    # Reproduced before: "Failed to decode sample #0 :" (DALI's position in a one-image batch) and
    # "nvImageCodec failure: '#17'" with no word on what went wrong.
    good = solid_png(16, 24)
    for cut, why in ((good[:len(good) // 2], "a PNG cut short inside chunk IDAT"),
                     (good[:-12], r"a PNG cut short \(no IEND chunk\)")):
        with pytest.raises(ValueError, match=rf"^sample 7: cannot decode image: {why}$"):
            decoder.decode([cut], [7])


def bad_deflate_png(height: int, width: int) -> bytes:
    """A PNG whose chunks are whole and pass their CRCs but whose image data is not a deflate
    stream: only the decoder can tell (image_check cannot)."""
    import struct
    import zlib

    good = solid_png(height, width)
    i = good.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", good[i:i + 4])
    junk = b"IDAT" + bytes(range(7, 7 + length))
    return good[:i + 4] + junk + struct.pack(">I", zlib.crc32(junk)) + good[i + 12 + length:]


def test_an_image_only_the_decoder_can_refuse_says_why(decoder):
    good = solid_png(16, 24)
    with pytest.raises(ValueError, match=r"^sample 7: cannot decode image: .*corrupt or truncated data"):
        decoder.decode([good, bad_deflate_png(16, 24)], [6, 7])
    assert decoder.decode([good], [1])[0].shape == (3, 16, 24)  # DALI's failed pipeline was rebuilt


def test_skip_corrupt_returns_none_and_counts():
    good = solid_png(16, 24)
    dec = ImageDecoder(skip_corrupt=True, batch_size=3)
    out = dec.decode([good, BAD[0], good, b"", good, BAD[1], good], [1, 2, 3, 4, 5, 6, 7])
    assert [t is None for t in out] == [False, True, False, True, False, True, False]
    assert all(t.shape == (3, 16, 24) for t in out if t is not None)
    assert dec.num_corrupt == 3 and dec.corrupt_ids == (2, 4, 6)
    assert dec.decode([BAD[0], good], [9, 10])[1] is not None
    assert dec.corrupt_ids == (2, 4, 6, 9)


def test_bad_arguments():
    assert ImageDecoder(device=torch.device("cpu")).device == torch.device("cpu")
    assert ImageDecoder(device="cuda:1").device == torch.device("cuda", 1)  # nothing touches the GPU yet
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        ImageDecoder(device="tpu")
    with pytest.raises(ValueError, match="max_side must be >= patch"):
        ImageDecoder(max_side=4, patch=8)
    with pytest.raises(ValueError, match="mean and std need 3 values"):
        ImageDecoder(mean=(0.5,))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ImageDecoder(batch_size=0)
    with pytest.raises(ValueError, match="2 images but 1 sample ids"):
        ImageDecoder().decode([b"a", b"b"], [1])


# -- images over max_pixels (found by review: a 730 KB PNG cost its worker 1.7 GB) ---------------

def pillow(height: int, width: int, fmt: str = "TIFF", **options) -> bytes:
    """An image Pillow encodes (TIFF, JPEG 2000, ...)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format=fmt, **options)
    return out.getvalue()


def tiff(height: int, width: int) -> bytes:
    return pillow(height, width)


def big_endian_tiff(height: int, width: int) -> bytes:
    """A one-strip 8-bit grey TIFF in Motorola byte order ("MM"), its width a SHORT, its length a LONG."""
    import struct

    entries = [(256, 3, 1, struct.pack(">HH", width, 0)), (257, 4, 1, struct.pack(">I", height)),
               (258, 3, 1, struct.pack(">HH", 8, 0)), (259, 3, 1, struct.pack(">HH", 1, 0)),
               (262, 3, 1, struct.pack(">HH", 1, 0)), (273, 4, 1, struct.pack(">I", 8 + 2 + 9 * 12 + 4)),
               (277, 3, 1, struct.pack(">HH", 1, 0)), (278, 4, 1, struct.pack(">I", height)),
               (279, 4, 1, struct.pack(">I", height * width))]
    ifd = struct.pack(">H", len(entries)) + b"".join(struct.pack(">HHI", t, k, n) + v for t, k, n, v in entries)
    return b"MM\x00*" + struct.pack(">I", 8) + ifd + b"\0\0\0\0" + bytes((i * 7) % 256 for i in range(height * width))


def bmp(height: int, width: int) -> bytes:
    """A 24-bit BMP (its header read by image_check.header_size, as PNG's and JPEG's)."""
    import struct

    row = (width * 3 + 3) // 4 * 4
    pixels = b"".join(bytes([10, 200, 30] * width) + b"\0" * (row - width * 3) for _ in range(height))
    return (b"BM" + struct.pack("<IHHI", 54 + len(pixels), 0, 0, 54)
            + struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835, 0, 0) + pixels)


def test_header_size_reads_png_and_jpeg_as_dali_does(samples):
    from loaders.image_check import header_size

    images, sizes = samples
    assert [header_size(data) for data in images] == sizes
    assert header_size(np.frombuffer(images[-1], dtype=np.uint8)) == (427, 640)
    assert header_size(bmp(3, 5)) == (3, 5)
    for other in (b"", b"\xff\xd8", b"\xff\xd8\xff\xda\x00\x02", *BAD, tiff(3, 5)[:12], b"MM\x00*\x00\x00\x00\x08",
                  pillow(3, 5, "JPEG2000")[:40], pillow(3, 5, "JPEG2000", no_jp2=True)[:20]):
        assert header_size(other) is None  # DALI tells, or the decoder says why it cannot


def test_header_size_reads_tiff_and_jpeg_2000_as_dali_peeks_them():
    """Found in QA: their sizes went unread, so `validate --payloads` did not check num_patches."""
    from loaders.image_check import header_size

    images = [tiff(30, 50), pillow(31, 17, compression="tiff_lzw"), pillow(9, 300, big_tiff=True),
              big_endian_tiff(12, 7), pillow(30, 50, "JPEG2000"), pillow(33, 21, "JPEG2000", no_jp2=True)]
    sizes = [(30, 50), (31, 17), (9, 300), (12, 7), (30, 50), (33, 21)]
    assert [header_size(data) for data in images] == sizes
    peeked = ImageDecoder(max_pixels=10**6)._peek_sizes([np.frombuffer(data, np.uint8) for data in images])
    assert [tuple(int(x) for x in size) for size in peeked] == sizes


def test_an_image_over_max_pixels_is_refused_before_decoding():
    big = encode_png(np.zeros((2000, 3000, 3), np.uint8))  # 18 KB of file, 18 MB of pixels
    good = solid_png(16, 24)
    dec = ImageDecoder(max_pixels=1000 * 1000)
    with pytest.raises(ValueError, match=r"^sample 8: cannot decode image: it is 2000 x 3000 pixels, more than "
                                         r"max_pixels=1000000 \(the decoder's decode.max_pixels\)$"):
        dec.decode([good, big], [7, 8])
    with pytest.raises(ValueError, match="sample 5: .* 30 x 50 pixels, more than max_pixels=1000 "):
        ImageDecoder(max_pixels=1000).decode([tiff(30, 50)], [5])
    with pytest.raises(ValueError, match="sample 6: .* 30 x 50 pixels, more than max_pixels=1000 "):
        ImageDecoder(max_pixels=1000).decode([bmp(30, 50)], [6])
    skip = ImageDecoder(max_pixels=1000 * 1000, skip_corrupt=True, batch_size=2)
    out = skip.decode([good, big, bmp(30, 50), BAD[0], good], [1, 2, 3, 4, 5])
    assert [None if t is None else tuple(t.shape) for t in out] == [(3, 16, 24), None, (3, 32, 48), None, (3, 16, 24)]
    assert skip.corrupt_ids == (2, 4)
    assert ImageDecoder(max_pixels=None).decode([big], [1])[0].shape == (3, 40, 64)  # no limit


def test_max_pixels_and_a_missing_dali_are_refused_at_construction(monkeypatch):
    for bad in (0, -5, 1.5, True, "8k"):
        with pytest.raises(ValueError, match="max_pixels must be an integer >= 1"):
            ImageDecoder(max_pixels=bad)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nvidia.dali" else real(name, *a))
    with pytest.raises(ImportError, match="needs NVIDIA DALI, which is not installed.*pip install nvidia-dali"):
        ImageDecoder()

    def no_nvidia(name, *a):  # no `nvidia` package at all: find_spec raises for the parent (found by review)
        if name.startswith("nvidia"):
            raise ModuleNotFoundError("No module named 'nvidia'")
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", no_nvidia)
    with pytest.raises(ImportError, match="needs NVIDIA DALI, which is not installed"):
        ImageDecoder()


def test_a_header_not_read_here_is_sized_by_dalis_peek(monkeypatch):
    import loaders.dali

    monkeypatch.setattr(loaders.dali, "header_size", lambda data: None)  # as for a header that does not say
    with pytest.raises(ValueError, match="sample 5: .* 30 x 50 pixels, more than max_pixels=1000 "):
        ImageDecoder(max_pixels=1000).decode([tiff(30, 50)], [5])
    assert ImageDecoder(max_pixels=1000).decode([tiff(20, 30)], [5])[0].shape == (3, 24, 32)  # under it: decoded


def test_close_releases_both_pipelines(monkeypatch):
    import loaders.dali

    monkeypatch.setattr(loaders.dali, "header_size", lambda data: None)  # every size from the peek pipeline
    dec = ImageDecoder()
    dec.decode([tiff(8, 8), solid_png(8, 8)], [1, 2])
    assert dec._pipe is not None and dec._peek is not None
    dec.close()
    assert dec._pipe is None and dec._peek is None


def test_dali_threads_follow_the_cores_the_worker_may_use():
    # Found by review: os.cpu_count() is the machine's, so a worker pinned to one core ran a DALI
    # thread per core of the machine (up to 4), all on its one core.
    import os

    from loaders.dali import _default_threads

    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert _default_threads() == 1 and ImageDecoder().num_threads == 1
    finally:
        os.sched_setaffinity(0, before)
    assert _default_threads() == max(1, min(4, len(before)))
