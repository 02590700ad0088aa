"""Images for the demo datasets: a tiny PNG encoder and image sources that ship with packages.

Nothing is downloaded. Two sources come with scikit-learn:

- its two sample photographs (`sklearn/datasets/images/china.jpg`, a Chinese temple, and
  `flower.jpg`, a close-up of a flower, both 427 x 640): used whole as JPEG bytes, and as crops
  of varied position, size and aspect ratio, box-downscaled and re-encoded as PNG. The photos are
  decoded once per process, with DALI on the CPU (`loaders.dali.decode_rgb`);
- its handwritten digits (`load_digits`: 8 x 8, grey levels 0..16), upscaled (nearest neighbour)
  to 16..48 pixels, dark ink on white, as RGB PNG.

Each image comes with a caption from what it shows ("a handwritten digit seven", "a photo of a
chinese temple", ...). Everything is a deterministic function of the arguments. Knows nothing
about datasets or the runtime; scikit-learn is needed only by the sources, not by `encode_png`.
"""

from __future__ import annotations

import functools
import os
import random
import struct
import zlib
from dataclasses import dataclass

import numpy as np

PHOTO_NAMES = ("china", "flower")
PHOTO_SUBJECTS = {"china": "a chinese temple", "flower": "a flower"}
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_DIGIT_TEMPLATES = ("a handwritten digit {}", "the number {}, written by hand", "a scan of a handwritten {}")
_PHOTO_TEMPLATES = {  # (whole or large crop, small crop)
    "china": (("a photo of a chinese temple", "a picture of an old chinese temple"),
              ("a detail from a photo of a chinese temple", "part of a chinese temple")),
    "flower": (("a close-up photo of a flower", "a photo of a flower in bloom"),
               ("a detail from a close-up photo of a flower", "part of a flower, close up")),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageSample:
    """One encoded image and what it shows. `height` x `width` is the decoded size."""

    data: bytes
    format: str  # "png" | "jpeg"
    height: int
    width: int
    caption: str
    source: str  # "digits" | "china" | "flower"


def encode_png(image: np.ndarray, *, level: int = 6) -> bytes:
    """An 8-bit RGB PNG of `image` (uint8, [H, W, 3]); pure Python (zlib + struct), no filtering."""
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or 0 in image.shape:
        raise ValueError(f"encode_png needs a non-empty uint8 array [H, W, 3], got {image.dtype} {image.shape}")
    height, width = image.shape[:2]
    # Each scanline starts with its filter type byte (0: none).
    raw = np.zeros((height, 1 + 3 * width), dtype=np.uint8)
    raw[:, 1:] = image.reshape(height, 3 * width)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour, no interlace
    return (_PNG_SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
            + chunk(b"IEND", b""))


def photo_path(name: str) -> str:
    """Path of one of scikit-learn's sample photographs (`PHOTO_NAMES`)."""
    if name not in PHOTO_NAMES:
        raise ValueError(f"unknown photo {name!r} (known: {', '.join(PHOTO_NAMES)})")
    import sklearn.datasets

    return os.path.join(os.path.dirname(sklearn.datasets.__file__), "images", f"{name}.jpg")


@functools.lru_cache(maxsize=1)
def photo_jpegs() -> dict[str, bytes]:
    """The JPEG bytes of scikit-learn's sample photographs, by name."""
    out = {}
    for name in PHOTO_NAMES:
        with open(photo_path(name), "rb") as f:
            out[name] = f.read()
    return out


@functools.lru_cache(maxsize=1)
def _decoded_photos() -> dict[str, np.ndarray]:
    from loaders.dali import decode_rgb

    jpegs = photo_jpegs()
    arrays = decode_rgb([jpegs[n] for n in PHOTO_NAMES])
    for a in arrays:
        a.flags.writeable = False  # shared by every caller through the cache
    return dict(zip(PHOTO_NAMES, arrays, strict=True))


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images.astype(np.float32), bunch.target.astype(np.int64)


def box_downscale(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Area-average `image` ([h, w, C] uint8, h >= height, w >= width) down to [height, width, C]."""
    h, w = image.shape[:2]
    if not (1 <= height <= h and 1 <= width <= w):
        raise ValueError(f"box_downscale shrinks only: {h}x{w} -> {height}x{width}")
    rows = (np.arange(height) * h) // height
    cols = (np.arange(width) * w) // width
    sums = np.add.reduceat(np.add.reduceat(image.astype(np.float64), rows, axis=0), cols, axis=1)
    counts = np.outer(np.diff(rows, append=h), np.diff(cols, append=w))[:, :, None]
    return np.rint(sums / counts).astype(np.uint8)


def photo_crops(num: int, *, seed: int = 0, min_side: int = 16, max_side: int = 96) -> list[ImageSample]:
    """`num` PNG crops of the sample photographs: random position, aspect ratio 1:2..2:1, longer
    output side in [min_side, max_side], each covering 1x..(as much as fits) the output size."""
    if not 8 <= min_side <= max_side:
        raise ValueError(f"need 8 <= min_side <= max_side, got {min_side} and {max_side}")
    rng = random.Random(seed)
    photos = _decoded_photos()
    out = []
    for _ in range(num):
        name = rng.choice(PHOTO_NAMES)
        photo = photos[name]
        ph, pw = photo.shape[:2]
        longer = rng.randint(min_side, max_side)
        aspect = 2.0 ** rng.uniform(-1.0, 1.0)  # width / height
        if aspect >= 1.0:
            oh, ow = max(8, round(longer / aspect)), longer
        else:
            oh, ow = longer, max(8, round(longer * aspect))
        scale = rng.uniform(1.0, min(ph / oh, pw / ow))
        ch, cw = min(ph, round(oh * scale)), min(pw, round(ow * scale))
        top, left = rng.randint(0, ph - ch), rng.randint(0, pw - cw)
        crop = box_downscale(photo[top:top + ch, left:left + cw], oh, ow)
        large = ch * cw >= 0.25 * ph * pw
        caption = rng.choice(_PHOTO_TEMPLATES[name][0 if large else 1])
        out.append(ImageSample(data=encode_png(crop), format="png", height=oh, width=ow, caption=caption,
                               source=name))
    return out


def whole_photos(num: int, *, seed: int = 0) -> list[ImageSample]:
    """`num` of the sample photographs as they ship (JPEG bytes, 427 x 640), chosen at random."""
    rng = random.Random(seed)
    jpegs = photo_jpegs()
    photos = _decoded_photos()
    out = []
    for _ in range(num):
        name = rng.choice(PHOTO_NAMES)
        h, w = photos[name].shape[:2]
        out.append(ImageSample(data=jpegs[name], format="jpeg", height=h, width=w,
                               caption=rng.choice(_PHOTO_TEMPLATES[name][0]), source=name))
    return out


def digit_images(num: int, *, seed: int = 0, min_side: int = 16, max_side: int = 48) -> list[ImageSample]:
    """`num` handwritten digits from scikit-learn, square, side in [min_side, max_side], as RGB PNG."""
    if not 8 <= min_side <= max_side:
        raise ValueError(f"need 8 <= min_side <= max_side, got {min_side} and {max_side}")
    rng = random.Random(seed)
    images, labels = _digits()
    out = []
    for _ in range(num):
        k = rng.randrange(len(images))
        side = rng.randint(min_side, max_side)
        src = (np.arange(side) * 8) // side  # nearest-neighbour upscaling
        grey = np.rint(255.0 - images[k][np.ix_(src, src)] * (255.0 / 16.0)).astype(np.uint8)
        caption = rng.choice(_DIGIT_TEMPLATES).format(DIGIT_WORDS[int(labels[k])])
        out.append(ImageSample(data=encode_png(np.repeat(grey[:, :, None], 3, axis=2)), format="png",
                               height=side, width=side, caption=caption, source="digits"))
    return out


def image_samples(num: int, *, seed: int = 0, photo_share: float = 0.45, jpeg_share: float = 0.05
                  ) -> list[ImageSample]:
    """`num` images in a deterministic shuffled mix: `photo_share` photo crops (PNG), `jpeg_share`
    whole photos (JPEG) and digits for the rest."""
    if not (0.0 <= photo_share and 0.0 <= jpeg_share and photo_share + jpeg_share <= 1.0):
        raise ValueError(f"need photo_share, jpeg_share >= 0 with a sum <= 1, got {photo_share} and {jpeg_share}")
    if num == 0:
        return []  # without touching scikit-learn or DALI
    num_jpeg = round(num * jpeg_share)
    num_photo = min(num - num_jpeg, round(num * photo_share))
    rng = random.Random(seed)
    items = (photo_crops(num_photo, seed=rng.randrange(2**32)) + whole_photos(num_jpeg, seed=rng.randrange(2**32))
             + digit_images(num - num_photo - num_jpeg, seed=rng.randrange(2**32)))
    rng.shuffle(items)
    return items


__all__ = ["DIGIT_WORDS", "PHOTO_NAMES", "ImageSample", "box_downscale", "digit_images", "encode_png",
           "image_samples", "photo_crops", "photo_jpegs", "photo_path", "whole_photos"]
