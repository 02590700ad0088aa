"""Encoded images screened before DALI sees them (loaders/image_check.py), and the decoder that
relies on it: what is refused there never reaches DALI, so it costs no rebuild.

Found while measuring the cost of corrupt images: one junk image in a batch of 32 PNGs made DALI
2.4's CPU decoder crash the process (SIGSEGV) in 1 to 4 runs out of 5 (the batch failing inside
DALI), and every corrupt image cost a rebuild of the pipeline or two.
"""

from __future__ import annotations

import struct
import zlib

import pytest

from loaders.dali import ImageDecoder
from loaders.image_check import framing_problem, image_format
from loaders.images import image_samples, photo_jpegs


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    """PNGs (digits, photo crops), JPEGs (photo crops and the two whole photos)."""
    return [s.data for s in image_samples(48, seed=1, jpeg_share=0.3)] + list(photo_jpegs().values())


@pytest.fixture(scope="module")
def png(images) -> bytes:
    return next(d for d in images if d[:4] == b"\x89PNG")


def test_whole_images_pass(images):
    assert {image_format(d) for d in images} == {"PNG", "JPEG"}
    assert [framing_problem(d) for d in images] == [None] * len(images)


def test_every_cut_of_a_png_or_jpeg_is_refused(images):
    """Any prefix of a PNG or JPEG is refused (a JPEG: cut anywhere before its end-of-image
    marker), with what is wrong."""
    for data in (next(d for d in images if d[:4] == b"\x89PNG"), next(d for d in images if d[:2] == b"\xff\xd8")):
        step = max(1, len(data) // 300)
        for cut in range(0, len(data) - 1, step):
            problem = framing_problem(data[:cut])
            assert problem is not None, cut
            assert problem == "no image data (0 bytes)" or "cut short" in problem or "not an image" in problem, \
                (cut, problem)


def test_a_png_whose_data_changed_fails_its_crc(png):
    changed = bytearray(png)
    changed[png.index(b"IDAT") + 6] ^= 0x40
    assert framing_problem(bytes(changed)) == "a PNG whose chunk IDAT fails its CRC (corrupt data)"


def test_a_png_without_image_data_is_refused(png):
    i = png.index(b"IDAT") - 4
    (length,) = struct.unpack(">I", png[i:i + 4])
    assert framing_problem(png[:i] + png[i + 12 + length:]) == "a PNG with no image data (no IDAT chunk)"


@pytest.mark.parametrize("data, expected", [
    (b"", "no image data (0 bytes)"),
    (b"<html>not found</html>", "not an image: its first bytes are those of no format the decoder reads"),
    (b"GIF89a" + bytes(40), "a GIF: the decoder does not read GIF images"),
    (b"\xff\xd8\xff\xd9", "a JPEG that ends before its image data"),
    (b"\xff\xd8\x00\x10JFIF", "a JPEG whose headers are corrupt"),
])
def test_what_is_not_an_image_says_so(data, expected):
    assert framing_problem(data).startswith(expected)


def test_other_formats_are_left_to_the_decoder():
    for head, kind in ((b"BM" + bytes(60), "BMP"), (b"II*\x00" + bytes(8), "TIFF"), (b"P6\n3 2\n255\n", "PNM"),
                       (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "WebP"), (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000")):
        assert image_format(head) == kind and framing_problem(head) is None


def test_a_batch_with_corrupt_images_decodes_without_a_rebuild(images):
    """Screened images never reach DALI: the pipeline is built once, and the corrupt ones are
    counted in sample order whatever was refused where (framing, max_pixels)."""
    pngs = [d for d in images if d[:4] == b"\x89PNG"][:32]
    batch = list(pngs)
    batch[3] = b"not an image at all"
    batch[20] = pngs[20][:len(pngs[20]) // 2]
    huge = bytearray(pngs[9])  # an IHDR declaring 100000 x 100000, its CRC fixed: only max_pixels refuses it
    huge[16:24] = struct.pack(">II", 100_000, 100_000)
    huge[29:33] = struct.pack(">I", zlib.crc32(bytes(huge[12:29])))
    batch[9] = bytes(huge)
    decoder = ImageDecoder(skip_corrupt=True, num_threads=1, batch_size=32)
    out = decoder.decode(batch, list(range(100, 132)))
    assert [i for i, t in enumerate(out) if t is None] == [3, 9, 20]
    assert decoder.corrupt_ids == (103, 109, 120) and decoder.num_builds == 1


def test_only_the_critical_chunks_crcs_refuse_a_png(png):
    """Found in review: every chunk's CRC was checked, so a PNG whose text chunk (or IEND) fails
    its CRC was refused, though libpng only warns and DALI decodes it."""
    def chunk(kind: bytes, body: bytes, crc_ok: bool) -> bytes:
        crc = zlib.crc32(kind + body) ^ (0 if crc_ok else 1)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    end = 8 + 25  # signature + IHDR chunk
    with_text = png[:end] + chunk(b"tEXt", b"Comment\x00hello", False) + png[end:]
    bad_iend = png[:-4] + bytes(b ^ 0xFF for b in png[-4:])
    decoder = ImageDecoder(num_threads=1)
    for data in (with_text, bad_iend):
        assert framing_problem(data) is None
        assert decoder.decode([data], [1])[0] is not None  # DALI decodes it
    assert framing_problem(png[:end] + chunk(b"PLTE", bytes(6), False) + png[end:]).startswith(
        "a PNG whose chunk PLTE fails its CRC")


def test_bigtiff_and_a_doubled_jpeg_start_are_told_alike_everywhere(images):
    from loaders.image_check import header_size

    assert image_format(b"II+\x00\x08\x00\x00\x00") == "TIFF" and image_format(b"MM\x00+\x00\x08") == "TIFF"
    jpeg = next(d for d in images if d[:2] == b"\xff\xd8")
    doubled = b"\xff\xd8" + jpeg  # DALI refuses it too
    assert framing_problem(doubled) == "a JPEG whose headers are corrupt (a second start-of-image marker)"
    assert header_size(doubled) is None and header_size(jpeg) is not None


OPTIONS = {"WEBP-lossless": {"lossless": True}, "TIFF-lzw": {"compression": "tiff_lzw"}, "TIFF-big": {"big_tiff": True},
           "JPEG2000-codestream": {"no_jp2": True}}


@pytest.mark.parametrize("fmt", ["WEBP-lossy", "WEBP-lossless", "WEBP-alpha", "BMP", "PPM", "PGM", "TIFF", "TIFF-lzw",
                                 "TIFF-big", "JPEG2000", "JPEG2000-codestream"])
@pytest.mark.parametrize("size", [(37, 300), (300, 9), (1, 1)])
def test_header_size_reads_webp_bmp_pnm_tiff_and_jpeg_2000(fmt, size):
    """Found in QA: only PNG and JPEG sizes were read, so `validate --payloads` let a WebP's or
    BMP's wrong num_patches through, and the decoder's max_pixels guard did not see their size
    (TIFF and JPEG 2000: found later)."""
    import io

    from PIL import Image

    from loaders.image_check import header_size

    height, width = size
    mode = "RGBA" if fmt == "WEBP-alpha" else "L" if fmt == "PGM" else "RGB"
    image = Image.new(mode, (width, height), 128)
    out = io.BytesIO()
    name = fmt.split("-")[0]
    image.save(out, format="PPM" if name == "PGM" else name, **OPTIONS.get(fmt, {}))
    assert header_size(out.getvalue()) == (height, width)


def test_header_size_of_odd_headers():
    from loaders.image_check import header_size

    assert header_size(b"P6\n# a comment 12 34\n 640\n480\n255\n") == (480, 640)
    assert header_size(b"P6\nxx 640 480\n") is None
    bmp_top_down = b"BM" + bytes(12) + (40).to_bytes(4, "little") + (5).to_bytes(4, "little", signed=True) + \
        (-7).to_bytes(4, "little", signed=True)
    assert header_size(bmp_top_down) == (7, 5)
    assert header_size(b"RIFF\x00\x00\x00\x00WEBPVP8 ") is None  # cut short


def test_header_size_never_raises_on_any_cut_or_damage_of_a_tiff_or_jpeg_2000():
    """Every prefix, and every single-byte change of the header area, gives a size or None."""
    import io

    from PIL import Image

    from loaders.image_check import header_size

    for fmt, options in (("TIFF", {}), ("TIFF", {"big_tiff": True}), ("JPEG2000", {}), ("JPEG2000", {"no_jp2": True})):
        out = io.BytesIO()
        Image.new("RGB", (13, 7), 128).save(out, format=fmt, **options)
        data = out.getvalue()
        for cut in range(len(data)):
            size = header_size(data[:cut])
            assert size is None or size == (7, 13)
        for at in range(min(len(data), 300)):
            for value in (0x00, 0x01, 0x10, 0xFF):  # 0x10: a LONG8 type in a classic TIFF's entry (review)
                damaged = data[:at] + bytes([value]) + data[at + 1:]
                size = header_size(damaged)
                assert size is None or (isinstance(size, tuple) and len(size) == 2)
    # Found in review: a classic TIFF whose last entry says LONG8 (8 bytes, in a 4-byte field) raised
    # struct.error, out of the decoder's screen even with skip_corrupt.
    import random
    import struct

    assert header_size(b"II" + struct.pack("<HI", 42, 8) + struct.pack("<H", 1) + struct.pack("<HHII", 256, 16, 1, 5)) \
        is None
    rnd = random.Random(5)
    for order, magic in (("<", 42), (">", 42), ("<", 43), (">", 43)):
        head = (b"II" if order == "<" else b"MM") + struct.pack(order + "H", magic)
        head += struct.pack(order + "I", 8) if magic == 42 else struct.pack(order + "HHQ", 8, 0, 16)
        for _ in range(2000):
            body = bytes(rnd.getrandbits(8) if rnd.random() < 0.3 else rnd.choice((0, 1, 3, 4, 16)) for _ in
                         range(rnd.randrange(0, 60)))
            size = header_size(head + body)
            assert size is None or (isinstance(size, tuple) and len(size) == 2 and min(size) > 0)
