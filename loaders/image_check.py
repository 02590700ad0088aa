"""What can be told about encoded image bytes without decoding them: the format (from the first
bytes), the size its header declares (PNG, JPEG, WebP, BMP, PNM, TIFF, JPEG 2000), and whether a
PNG or JPEG is whole.

The image decoder (loaders/dali.py) asks these before DALI sees an image. A file that is not an
image, or a PNG or JPEG that is cut short or whose image data fails its checksums (a PNG's
critical chunks: libpng only warns about the others), is refused here: DALI would fail on it
too, but a batch that fails inside DALI costs a rebuild of its pipeline, and DALI 2.4's CPU
decoder crashes the process (SIGSEGV) now and then while failing such a batch (seen here: one
junk image among 32 PNGs crashed 1 to 4 runs in 5). Pure Python and cheap: a PNG's chunk CRCs
(zlib.crc32, GB/s) and a walk over a JPEG's segment headers.

What is not checked: a PNG whose compressed data is corrupt yet passes its CRCs (crafted), a
JPEG whose entropy-coded data is corrupt (libjpeg-turbo decodes it with a warning), and formats
other than PNG and JPEG beyond their first bytes and the size their header declares: the rest is
left to DALI.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import numpy as np

PNG = b"\x89PNG\r\n\x1a\n"
_PNG_CRITICAL = {b"IHDR", b"PLTE", b"IDAT"}
JPEG_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# The first bytes of each format DALI's image decoder reads (nvImageCodec: PNG, JPEG, JPEG 2000,
# TIFF, BMP, PNM, WebP), and of GIF, which it does not read, to say so.
_MAGIC = ((PNG, "PNG"), (b"\xff\xd8", "JPEG"), (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
          (b"\xff\x4f\xff\x51", "JPEG 2000"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
          (b"II+\x00", "TIFF"), (b"MM\x00+", "TIFF"), (b"BM", "BMP"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"))
_PNM = {b"P1", b"P2", b"P3", b"P4", b"P5", b"P6"}


def image_format(data: bytes | np.ndarray) -> str | None:
    """The image format `data` starts like ("PNG", "JPEG", ..., "WebP"), or None."""
    head = bytes(memoryview(data)[:16])
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    if head[:2] in _PNM and len(head) > 2 and head[2:3].isspace():
        return "PNM"
    return None


def framing_problem(data: bytes | np.ndarray) -> str | None:
    """Why `data` is not a whole image, as the reason to show ("a PNG cut short inside chunk
    IDAT"); None when nothing here says it is not one."""
    view = memoryview(data)
    if len(view) == 0:
        return "no image data (0 bytes)"
    kind = image_format(view)
    if kind is None:
        return ("not an image: its first bytes are those of no format the decoder reads "
                "(PNG, JPEG, JPEG 2000, TIFF, BMP, PNM, WebP)")
    if kind == "GIF":
        return "a GIF: the decoder does not read GIF images (convert them to PNG)"
    if kind == "PNG":
        return _png_problem(view)
    if kind == "JPEG":
        return _jpeg_problem(view)
    return None


def _png_problem(data: memoryview) -> str | None:
    i, first, seen_data = len(PNG), True, False
    while True:
        if i + 8 > len(data):
            return "a PNG cut short (no IEND chunk)"
        (length,) = struct.unpack(">I", data[i:i + 4])
        kind = bytes(data[i + 4:i + 8])
        name = kind.decode("latin-1")
        if first and kind != b"IHDR":
            return "a PNG whose first chunk is not IHDR (corrupt data)"
        if i + 12 + length > len(data):
            return f"a PNG cut short inside chunk {name}"
        (crc,) = struct.unpack(">I", data[i + 8 + length:i + 12 + length])
        # libpng refuses a critical chunk that fails its CRC, and only warns for the others
        # (ancillary chunks, and IEND, which holds nothing): so does this check.
        if kind in _PNG_CRITICAL and zlib.crc32(data[i + 4:i + 8 + length]) != crc:
            return f"a PNG whose chunk {name} fails its CRC (corrupt data)"
        seen_data |= kind == b"IDAT"
        if kind == b"IEND":
            return None if seen_data else "a PNG with no image data (no IDAT chunk)"
        first, i = False, i + 12 + length


class _Bad(Exception):
    """A JPEG's headers are corrupt or cut short (the message says which)."""


def _jpeg_segments(data: memoryview) -> Iterator[tuple[int, int, int]]:
    """(marker, offset, length) of each JPEG segment that has a length, after SOI, up to and
    including the start of scan (0xDA), whose entropy-coded data follows; _Bad when the headers
    end or break first. Segments are 0xFF, the marker and a big-endian length counting itself."""
    i = 2
    while True:
        if i + 2 > len(data):
            raise _Bad("a JPEG cut short in its headers")
        if data[i] != 0xFF:
            raise _Bad("a JPEG whose headers are corrupt (no marker where one must be)")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # no length follows
            i += 2
            continue
        if marker in (0xD8, 0xD9):
            raise _Bad("a JPEG that ends before its image data" if marker == 0xD9
                       else "a JPEG whose headers are corrupt (a second start-of-image marker)")
        if i + 4 > len(data):
            raise _Bad("a JPEG cut short in its headers")
        (length,) = struct.unpack(">H", data[i + 2:i + 4])
        if length < 2 or i + 2 + length > len(data):
            raise _Bad("a JPEG cut short in its headers")
        yield marker, i, length
        if marker == 0xDA:
            return
        i += 2 + length


def _jpeg_problem(data: memoryview) -> str | None:
    try:
        *_, (_, i, length) = _jpeg_segments(data)
    except _Bad as exc:
        return str(exc)
    except ValueError:  # no segment at all: SOI then the end
        return "a JPEG cut short in its headers"
    # Entropy-coded data, in which 0xFF is always escaped: an end-of-image marker after it means
    # the scan data is whole (trailing bytes after it are fine, as for the decoder).
    if bytes(data[i + 2 + length:]).rfind(b"\xff\xd9") < 0:
        return "a JPEG cut short (no end-of-image marker after its image data)"
    return None


def header_size(data: bytes | np.ndarray) -> tuple[int, int] | None:
    """(height, width) a PNG, JPEG, WebP, BMP, PNM, TIFF or JPEG 2000 declares in its header (a
    TIFF: its first image); None for another format, or a header that does not say (DALI then
    tells, or fails to decode it). Found in QA: a WebP's or BMP's size went unread, so `validate
    --payloads` did not check its num_patches, nor the decoder its max_pixels; a TIFF's and a JPEG
    2000's were not read until later."""
    data = memoryview(data)  # no copy; a JPEG's frame header may follow 64 KB segments of metadata
    if data[:8] == PNG and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return height, width
    if data[:2] != b"\xff\xd8":
        return _webp_size(data) or _bmp_size(data) or _pnm_size(data) or _tiff_size(data) or _jpeg2000_size(data)
    try:
        for marker, i, _ in _jpeg_segments(data):
            if marker in JPEG_SOF:
                if i + 9 > len(data):
                    return None
                height, width = struct.unpack(">HH", data[i + 5:i + 9])
                return (height, width) if height else None  # 0: the height comes later (DNL)
    except _Bad:
        pass
    return None  # image data before any frame header, or headers cut short


def _webp_size(data: memoryview) -> tuple[int, int] | None:
    """A WebP's canvas (extended format, VP8X), or its one frame's size (lossy VP8, lossless VP8L)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WEBP" or len(data) < 30:
        return None
    chunk = bytes(data[12:16])
    if chunk == b"VP8X":
        return 1 + int.from_bytes(data[27:30], "little"), 1 + int.from_bytes(data[24:27], "little")
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return height & 0x3FFF, width & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + ((bits >> 14) & 0x3FFF), 1 + (bits & 0x3FFF)
    return None


def _bmp_size(data: memoryview) -> tuple[int, int] | None:
    """A BMP's size from its DIB header (a negative height: rows stored top-down)."""
    if data[:2] != b"BM" or len(data) < 26:
        return None
    if struct.unpack("<I", data[14:18])[0] == 12:  # the OS/2 core header: 16-bit sizes
        width, height = struct.unpack("<HH", data[18:22])
        return height, width
    width, height = struct.unpack("<ii", data[18:26])
    return (abs(height), width) if width > 0 and height else None


def _pnm_size(data: memoryview) -> tuple[int, int] | None:
    """A PNM's (P1-P6) width and height: the header's first two numbers after the magic, past any
    whitespace and # comments."""
    if bytes(data[:2]) not in _PNM:
        return None
    head = bytes(data[2:1026])
    numbers: list[int] = []
    for line in head.split(b"\n"):
        for word in line.split(b"#", 1)[0].split():
            if not word.isdigit():
                return None
            numbers.append(int(word))
            if len(numbers) == 2:
                return numbers[1], numbers[0]
    return None


def _tiff_size(data: memoryview) -> tuple[int, int] | None:
    """A TIFF's first image as stored: the ImageLength (257) and ImageWidth (256) entries of its
    first directory, in classic TIFF (32-bit offsets) or BigTIFF (64-bit), either byte order. An
    Orientation tag is not applied (DALI's peek applies it): a turned image's height and width
    swap, which changes neither its pixels nor its patches."""
    order = {b"II": "<", b"MM": ">"}.get(bytes(data[:2]))
    if order is None or len(data) < 16:
        return None
    magic = struct.unpack(order + "H", data[2:4])[0]
    if magic == 42:  # offset, then count: 2 bytes, entries of 12 (tag, type, count: 4, value: 4)
        offset, count_fmt, entry, value_at = struct.unpack(order + "I", data[4:8])[0], "H", 12, 8
        kinds = {3: "H", 4: "I"}  # (a LONG8 has no room in a classic entry: found in review, read past it)
    elif magic == 43:  # BigTIFF: count 8 bytes, entries of 20 (count: 8, value: 8)
        offset, count_fmt, entry, value_at = struct.unpack(order + "Q", data[8:16])[0], "Q", 20, 12
        kinds = _TIFF_UINT
    else:
        return None
    count_size = struct.calcsize(count_fmt)
    if offset + count_size > len(data):
        return None
    n = struct.unpack(order + count_fmt, data[offset:offset + count_size])[0]
    sides: dict[int, int] = {}
    for i in range(min(n, (len(data) - offset - count_size) // entry)):
        at = offset + count_size + i * entry
        tag, kind = struct.unpack(order + "HH", data[at:at + 4])
        if tag in (256, 257) and kind in kinds:
            fmt = kinds[kind]
            sides[tag] = struct.unpack(order + fmt, data[at + value_at:at + value_at + struct.calcsize(fmt)])[0]
    return (sides[257], sides[256]) if sides.get(256) and sides.get(257) else None


_TIFF_UINT = {3: "H", 4: "I", 16: "Q"}  # SHORT, LONG, LONG8: the types a TIFF's width and length take


def _jpeg2000_size(data: memoryview) -> tuple[int, int] | None:
    """A JPEG 2000 codestream's image area (its SIZ segment: Xsiz - XOsiz by Ysiz - YOsiz), or a
    JP2 file's, from the image header box (ihdr) inside its header box (jp2h)."""
    if data[:4] == b"\xff\x4f\xff\x51" and len(data) >= 24:
        xsiz, ysiz, x0, y0 = struct.unpack(">IIII", data[8:24])
        return (ysiz - y0, xsiz - x0) if xsiz > x0 and ysiz > y0 else None
    if data[:12] != b"\x00\x00\x00\x0cjP  \r\n\x87\n":
        return None
    box = _jp2_box(data, 12, len(data), b"jp2h")
    ihdr = _jp2_box(data, box[0], box[1], b"ihdr") if box is not None else None
    if ihdr is None or ihdr[1] - ihdr[0] < 8:
        return None
    height, width = struct.unpack(">II", data[ihdr[0]:ihdr[0] + 8])
    return (height, width) if height and width else None


def _jp2_box(data: memoryview, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    """The contents (start, end) of the first box of type `kind` between `start` and `end`."""
    at = start
    while at + 8 <= end:
        length, box = struct.unpack(">I", data[at:at + 4])[0], bytes(data[at + 4:at + 8])
        head = 8
        if length == 1:  # a 64-bit length follows
            if at + 16 > end:
                return None
            length, head = struct.unpack(">Q", data[at + 8:at + 16])[0], 16
        elif length == 0:  # to the end
            length = end - at
        if length < head:
            return None
        if box == kind:
            return at + head, min(at + length, end)
        at += length
    return None
