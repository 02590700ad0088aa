"""ImageDecoder on the GPU (DALI's mixed decoder) against the CPU decoder.

Skipped without CUDA. The two decoders are different implementations (nvJPEG or the hardware JPEG
decoder vs. libjpeg-turbo; GPU vs. CPU resampling), so pixels agree to a few grey levels, not
exactly: one level is 1 / (0.225 * 255) ~ 0.017 after normalisation.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loaders.dali import ImageDecoder
from loaders.images import digit_images, photo_crops, photo_jpegs


def _has_dali() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace package at all
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(not _has_dali(), reason="needs DALI (nvidia-dali-cuda120)")]


@pytest.fixture(scope="module")
def images():
    items = photo_crops(12, seed=0) + digit_images(6, seed=0)
    jpegs = photo_jpegs()
    return {"png": [s.data for s in items], "jpeg": [jpegs["china"], jpegs["flower"]]}


@pytest.mark.parametrize(("kind", "max_diff", "mean_diff"), [("png", 0.07, 0.005), ("jpeg", 0.25, 0.02)])
def test_mixed_decoder_matches_cpu(images, kind, max_diff, mean_diff):
    data = images[kind]
    ids = list(range(len(data)))
    cpu = ImageDecoder(device="cpu", batch_size=8).decode(data, ids)
    gpu = ImageDecoder(device="cuda:0", batch_size=8).decode(data, ids)
    for c, g in zip(cpu, gpu, strict=True):
        assert g.device == torch.device("cuda:0") and g.dtype == torch.float32 and g.shape == c.shape
        diff = (g.cpu() - c).abs()
        assert diff.max().item() <= max_diff and diff.mean().item() <= mean_diff


def test_mixed_decoder_reports_corrupt_images(images):
    good = images["png"][0]
    with pytest.raises(ValueError, match="^sample 7: cannot decode image"):
        ImageDecoder(device="cuda").decode([good, b"not an image" * 8], [6, 7])
    dec = ImageDecoder(device="cuda", skip_corrupt=True)
    out = dec.decode([good, b"not an image" * 8, good], [6, 7, 8])
    assert out[1] is None and out[0].is_cuda and dec.corrupt_ids == (7,)
