"""Image decoding with NVIDIA DALI: encoded PNG/JPEG bytes -> normalised float32 tensors [3, H, W].

Owns one DALI pipeline per `ImageDecoder`, built lazily on the first `decode()` and reused by every
later call (an external source feeds each call's bytes; batches smaller than `batch_size` are fine,
larger lists are cut into batches). It knows nothing about datasets, sections or models: the vision
stage hands it the `image` column of its micro-batch and gets one tensor per sample back.

Runs in the calling thread (a vision-encoder worker's compute loop); DALI's own thread pool
(`num_threads`) does the per-sample work. One decoder must not be used from two threads at once.

The pipeline, and where each operator runs:

    fn.external_source      CPU    the encoded bytes of the batch (uint8, one 1-D sample each)
    fn.peek_image_shape     CPU    height/width from the headers, EXIF orientation applied
    DALI arithmetic         CPU    the target size of each sample (integers only; see `target_size`)
    fn.decoders.image       CPU    device="cpu" (libjpeg-turbo, libpng via nvImageCodec), or
                            mixed  device="cuda[:N]": CPU parses, GPU decodes (nvJPEG, HW JPEG
                                   decoder where present); output on the GPU
    fn.resize               CPU/GPU  linear, antialiased when shrinking; follows the decoder's output
    fn.crop_mirror_normalize  CPU/GPU  uint8 HWC -> float32 CHW, (x - 255 mean) / (255 std)

The size rule is computed inside the pipeline with integer arithmetic that `target_size` repeats
exactly in Python, so the `num_patches` a dataset stores (computed with `num_patches`) always equals
what the decoder produces.

Before DALI sees them, images are screened (loaders/image_check.py): bytes of no image format, a
GIF, and a PNG or JPEG cut short or failing its CRCs are refused like any image that cannot be
decoded, without DALI (whose failing batches cost a rebuild and, now and then, crash the
process). So are images over `max_pixels` (height x width from the header, 8192 x 8192 by
default): a few-KB file can declare a picture of many GB. Headers are read in Python
(image_check.header_size); where one does not say, the size comes from a small DALI pipeline of
`fn.peek_image_shape` alone.

DALI's CPU-only pipeline must be built with `device_id=None`: any other value makes DALI initialise
CUDA, which fails on a machine without a GPU (and wastes a CUDA context on one that has a GPU).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loaders.image_check import framing_problem, header_size

# nvImageCodec reports failures as a bare status number; these are its nvimgcodecStatus_t names.
_CODEC_STATUS = {
    "#2": "invalid parameter",
    "#3": "bad codestream (corrupt or truncated data)",
    "#4": "unsupported codestream (not a PNG/JPEG, or an unrecognised format)",
    "#6": "execution failed",
    "#9": "no decoder implementation for this image",
}
_INVALID_PIPELINE = "Current pipeline object is no longer valid."
MAX_PIXELS = 8192 * 8192  # an image's height x width, from its header, at most (max_pixels=None: no limit)


def target_size(height: int, width: int, max_side: int, patch: int) -> tuple[int, int]:
    """The (H, W) an image of `height` x `width` is resized to.

    The aspect ratio is kept (up to rounding to the patch grid); images whose longer side exceeds
    `max_side` are shrunk so that it fits, smaller images are not enlarged; each side is then
    rounded to the nearest multiple of `patch`, at least one patch and at most `max_side`
    (rounded down to a multiple of `patch`). Integers only, halves rounded up: the DALI pipeline
    computes exactly the same numbers.

    >>> target_size(427, 640, 64, 8)
    (40, 64)
    >>> target_size(20, 30, 64, 8)
    (24, 32)
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    _check_grid(max_side, patch)
    longer = max(height, width)
    limit = min(longer, max_side)
    cap = max_side // patch * patch

    def side(s: int) -> int:
        scaled = (s * limit + longer // 2) // longer
        return min(max((scaled + patch // 2) // patch * patch, patch), cap)

    return side(height), side(width)


def num_patches(height: int, width: int, max_side: int, patch: int) -> int:
    """Number of `patch` x `patch` patches of an image of `height` x `width` after `target_size`."""
    h, w = target_size(height, width, max_side, patch)
    return (h // patch) * (w // patch)


def _check_grid(max_side: int, patch: int) -> None:
    if patch < 1:
        raise ValueError(f"patch must be >= 1, got {patch}")
    if max_side < patch:
        raise ValueError(f"max_side must be >= patch ({patch}), got {max_side}")


def _default_threads() -> int:
    """DALI threads: up to 4, no more than the cores this process may run on (a worker pinned to
    one core, --pin-cpus, gets one, not one per core of the machine)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _dali_reason(exc: BaseException) -> str:
    """The useful line(s) of a DALI pipeline error: what failed, without DALI's traceback echo."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    if "encountered:" in lines:
        lines = lines[len(lines) - lines[::-1].index("encountered:"):]
    lines = [ln for ln in lines if ln and ln != _INVALID_PIPELINE and not ln.startswith("Critical error")]
    reason = "; ".join(lines[:2]) or type(exc).__name__
    if re.fullmatch(r"Failed to decode sample #\d+ ?:?", reason):  # DALI's position in its batch, nothing more
        return "the decoder could not read it (corrupt or truncated data, or not an image)"
    known = [words for code, words in _CODEC_STATUS.items() if f"'{code}'" in reason]
    if known:
        return f"{reason} ({known[0]})"
    if re.search(r"'#\d+'", reason):
        return f"{reason} (the codec could not parse it: corrupt or truncated data, or not an image)"
    return reason


class CorruptImage(ValueError):
    """A sample's image that cannot be decoded (or is over max_pixels), without skip_corrupt."""


class ImageDecoder:
    """Decodes encoded images to normalised float32 tensors [3, H, W] with DALI (see the module doc).

    `device="cpu"` runs everything on the CPU and returns CPU tensors; `device="cuda:N"` (or a
    torch.device; plain "cuda" is torch's current device) decodes with DALI's mixed decoder on
    GPU N and returns tensors on that GPU.
    A sample that cannot be decoded raises CorruptImage (a ValueError) naming its id, or, with
    `skip_corrupt`, comes back as None and is counted in `num_corrupt` / `corrupt_ids`.
    """

    def __init__(self, max_side: int = 64, patch: int = 8, mean: Sequence[float] = (0.485, 0.456, 0.406),
                 std: Sequence[float] = (0.229, 0.224, 0.225), device: str | torch.device = "cpu", skip_corrupt: bool = False,
                 batch_size: int = 32, num_threads: int | None = None, max_pixels: int | None = MAX_PIXELS) -> None:
        try:
            found = importlib.util.find_spec("nvidia.dali") is not None
        except ModuleNotFoundError:  # no `nvidia` package at all: find_spec imports the parent first
            found = False
        if not found:
            raise ImportError("decoding images needs NVIDIA DALI, which is not installed in this environment: "
                              "pip install nvidia-dali-cuda120 (its CPU operators need no GPU), or give the "
                              "vision section precomputed pixels")
        _check_grid(max_side, patch)
        if max_pixels is not None and (isinstance(max_pixels, bool) or not isinstance(max_pixels, int)
                                       or max_pixels < 1):
            raise ValueError(f"max_pixels must be an integer >= 1 (or None: no limit), got {max_pixels!r}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean and std need 3 values (R, G, B), got {len(mean)} and {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std values must be positive, got {tuple(std)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        device = str(device)  # a torch.device works too
        if device == "cpu":
            self._device_id: int | None = None
        elif device == "cuda" or device.startswith("cuda:"):
            index = device.partition(":")[2]
            if index and not index.isdigit():
                raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
            if index:
                self._device_id = int(index)
            else:  # plain "cuda": the current device, as torch reads it
                self._device_id = torch.cuda.current_device() if torch.cuda.is_available() else 0
        else:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
        self.max_side = max_side
        self.patch = patch
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.device = torch.device("cpu" if self._device_id is None else f"cuda:{self._device_id}")
        self.skip_corrupt = skip_corrupt
        self.batch_size = batch_size
        self.num_threads = num_threads or _default_threads()
        self.max_pixels = max_pixels
        self._pipe: Any = None
        self._peek: Any = None  # the header-size pipeline, for images not PNG/JPEG (built when one comes)
        self._in_flight: tuple[Any, Any] | None = None  # (CUDA event, DALI outputs its copies read)
        self._num_builds = 0
        self._corrupt_ids: list[int] = []

    @property
    def num_corrupt(self) -> int:
        """How many samples could not be decoded (and came back as None) over this decoder's life."""
        return len(self._corrupt_ids)

    @property
    def corrupt_ids(self) -> tuple[int, ...]:
        return tuple(self._corrupt_ids)

    @property
    def num_builds(self) -> int:
        """How many times the DALI pipeline was built: 1 after any number of clean calls; a batch
        that fails costs a rebuild (DALI invalidates a pipeline that raised)."""
        return self._num_builds

    def decode(self, images: Sequence[bytes], sample_ids: Sequence[int]) -> list[torch.Tensor | None]:
        """One float32 tensor [3, H, W] per image (H, W from `target_size`), in order, on `self.device`."""
        if len(images) != len(sample_ids):
            raise ValueError(f"decode: {len(images)} images but {len(sample_ids)} sample ids")
        encoded = [np.frombuffer(b"" if data is None else data, dtype=np.uint8) for data in images]
        out: list[torch.Tensor | None] = [None] * len(encoded)
        todo = self._screen(encoded, sample_ids)  # indices to decode
        for start in range(0, len(todo), self.batch_size):
            picked = todo[start:start + self.batch_size]
            batch = [encoded[i] for i in picked]
            try:
                decoded = self._run(batch)
            except RuntimeError:
                # Some sample of the batch is bad: find it (them) by decoding one at a time.
                decoded = [self._decode_one(encoded[i], int(sample_ids[i])) for i in picked]
            for i, tensor in zip(picked, decoded, strict=True):
                out[i] = tensor
        return out

    def _screen(self, encoded: list[np.ndarray], sample_ids: Sequence[int]) -> list[int]:
        """The indices of the images to decode: not refused by image_check, nor over max_pixels.
        The others are corrupt (ValueError, or None and counted), in sample order."""
        problems = {i: framing_problem(enc) for i, enc in enumerate(encoded)}
        if self.max_pixels is not None:
            sizes = {i: header_size(encoded[i]) for i, p in problems.items() if p is None}
            unknown = [i for i, size in sizes.items() if size is None]
            for i, size in zip(unknown, self._peek_sizes([encoded[i] for i in unknown]), strict=True):
                sizes[i] = size
            for i, size in sizes.items():
                if size is not None and size[0] * size[1] > self.max_pixels:
                    problems[i] = (f"it is {size[0]} x {size[1]} pixels, more than max_pixels={self.max_pixels} "
                                   "(the decoder's decode.max_pixels)")
        for i, problem in problems.items():
            if problem is not None:
                self._corrupt(int(sample_ids[i]), problem)
        return [i for i, problem in problems.items() if problem is None]

    def _peek_sizes(self, batch: list[np.ndarray]) -> list[tuple[int, int] | None]:
        """(height, width) of each image by DALI's fn.peek_image_shape; None where it cannot tell
        (the decoder then says why)."""
        sizes: list[tuple[int, int] | None] = []
        for start in range(0, len(batch), self.batch_size):
            chunk = batch[start:start + self.batch_size]
            try:
                sizes.extend(self._peek_run(chunk))
            except RuntimeError:  # some header is unreadable: one at a time
                sizes.extend(self._peek_one(one) for one in chunk)
        return sizes

    def _peek_one(self, encoded: np.ndarray) -> tuple[int, int] | None:
        try:
            return self._peek_run([encoded])[0]
        except RuntimeError:
            return None

    def _peek_run(self, chunk: list[np.ndarray]) -> list[tuple[int, int]]:
        if self._peek is None:
            import nvidia.dali.fn as fn
            import nvidia.dali.types as types
            from nvidia.dali import Pipeline

            pipe = Pipeline(batch_size=self.batch_size, num_threads=1, device_id=None, prefetch_queue_depth=1,
                            exec_dynamic=True)
            with pipe:
                encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, device="cpu")
                pipe.set_outputs(fn.peek_image_shape(encoded, dtype=types.INT64))
            pipe.build()
            self._peek = pipe
        try:
            (shapes,) = self._peek.run(encoded=chunk)
        except RuntimeError:
            self._peek = None  # DALI declares a pipeline that raised invalid
            raise
        return [(int(shape[0]), int(shape[1])) for shape in (np.array(shapes[i]) for i in range(len(chunk)))]

    def close(self) -> None:
        """Releases the DALI pipelines (a later `decode()` builds new ones)."""
        if self._in_flight is not None:
            self._in_flight[0].synchronize()
            self._in_flight = None
        self._pipe = None
        self._peek = None

    # -- internals ---------------------------------------------------------------------------

    def _corrupt(self, sample_id: int, reason: str) -> None:
        if not self.skip_corrupt:
            raise CorruptImage(f"sample {sample_id}: cannot decode image: {reason}")
        self._corrupt_ids.append(sample_id)

    def _decode_one(self, encoded: np.ndarray, sample_id: int) -> torch.Tensor | None:
        try:
            return self._run([encoded])[0]
        except RuntimeError as exc:
            self._corrupt(sample_id, _dali_reason(exc))
            return None

    def _run(self, batch: list[np.ndarray]) -> list[torch.Tensor]:
        if self._pipe is None:
            self._pipe = self._build()
        if self._in_flight is not None:
            # The previous batch's copies may still be queued on torch's stream: keep DALI's
            # buffers alive until they are done (normally long since).
            self._in_flight[0].synchronize()
            self._in_flight = None
        try:
            (images,) = self._pipe.run(encoded=batch)
        except RuntimeError:
            # DALI declares a pipeline that raised invalid: build a fresh one for the next run.
            self._pipe = None
            raise
        if self._device_id is None:
            return [self._copy_cpu(images[i]) for i in range(len(batch))]
        return self._copy_gpu(images, len(batch))

    @staticmethod
    def _copy_cpu(tensor: Any) -> torch.Tensor:
        # A copy, not a view: DALI reuses its output buffers on later runs.
        dst = torch.empty(tensor.shape(), dtype=torch.float32)
        tensor.copy_to_external(ctypes.c_void_p(dst.data_ptr()))
        return dst

    def _copy_gpu(self, images: Any, n: int) -> list[torch.Tensor]:
        from nvidia.dali.plugin.pytorch.torch_utils import feed_ndarray

        # Copies ordered on torch's current stream (after DALI's work, before the caller's kernels),
        # so the host never waits here.
        stream = torch.cuda.current_stream(self.device)
        out = [feed_ndarray(images[i], torch.empty(images[i].shape(), dtype=torch.float32, device=self.device),
                            cuda_stream=stream) for i in range(n)]
        done = torch.cuda.Event()
        done.record(stream)
        self._in_flight = (done, images)
        return out

    def _build(self) -> Any:
        import nvidia.dali.fn as fn
        import nvidia.dali.math as dmath
        import nvidia.dali.types as types
        from nvidia.dali import Pipeline

        on_gpu = self._device_id is not None
        # prefetch_queue_depth=1: inputs are passed to run() directly, one batch per call.
        pipe = Pipeline(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self._device_id,
                        prefetch_queue_depth=1, exec_dynamic=True)
        max_side, patch = self.max_side, self.patch
        with pipe:
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, device="cpu")
            shape = fn.peek_image_shape(encoded, dtype=types.INT64)  # [H, W, C], EXIF orientation applied
            height, width = shape[0], shape[1]
            longer = dmath.max(dmath.max(height, width), 1)  # >= 1: never divide by zero
            limit = dmath.min(longer, max_side)

            def side(s: Any) -> Any:  # target_size(), term by term
                scaled = (s * limit + longer // 2) // longer
                snapped = dmath.max((scaled + patch // 2) // patch * patch, patch)
                return fn.cast(dmath.min(snapped, max_side // patch * patch), dtype=types.FLOAT)

            if on_gpu:
                # Same chroma upsampling as the CPU decoder, so both devices give (nearly) equal pixels.
                image = fn.decoders.image(encoded, device="mixed", output_type=types.RGB,
                                          jpeg_fancy_upsampling=True)
            else:
                image = fn.decoders.image(encoded, device="cpu", output_type=types.RGB)
            image = fn.resize(image, resize_y=side(height), resize_x=side(width), antialias=True)
            image = fn.crop_mirror_normalize(image, dtype=types.FLOAT, output_layout="CHW",
                                             mean=[255.0 * m for m in self.mean],
                                             std=[255.0 * s for s in self.std])
            pipe.set_outputs(image)
        pipe.build()
        self._num_builds += 1
        return pipe


def decode_rgb(images: Sequence[bytes], *, num_threads: int | None = None) -> list[np.ndarray]:
    """Decodes PNG/JPEG bytes to uint8 RGB arrays [H, W, 3] at full size with a one-off CPU DALI
    pipeline (`fn.external_source` -> `fn.decoders.image`, both on the CPU). For building data, not
    for the training path. Raises ValueError if an image cannot be decoded."""
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import Pipeline

    if not images:
        return []
    pipe = Pipeline(batch_size=len(images), num_threads=num_threads or _default_threads(), device_id=None,
                    prefetch_queue_depth=1, exec_dynamic=True)
    with pipe:
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1, device="cpu")
        pipe.set_outputs(fn.decoders.image(encoded, device="cpu", output_type=types.RGB))
    pipe.build()
    try:
        (decoded,) = pipe.run(encoded=[np.frombuffer(b, dtype=np.uint8) for b in images])
    except RuntimeError as exc:
        raise ValueError(f"cannot decode image: {_dali_reason(exc)}") from None
    return [np.array(decoded[i], dtype=np.uint8) for i in range(len(images))]


__all__ = ["ImageDecoder", "decode_rgb", "num_patches", "target_size"]
