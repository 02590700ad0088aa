"""`VisionEncoder`: a ViT over variable-size images; `Projector`: an MLP section between encoder and LLM.

VisionEncoder turns each image into one embedding row per patch, row-major over the patch grid:
an image [3, H, W] (H, W multiples of `patch`) gives num_patches(H, W, patch) = (H/patch)*(W/patch)
rows. Pipeline: patches flattened and embedded by a Linear (a stride-`patch` convolution), plus a
factorised 2-D position (row embedding + column embedding, so any grid up to max_grid x max_grid
works), then bidirectional transformer blocks with a key-padding mask (images of different sizes
share a micro-batch without changing each other's results), a final LayerNorm, and optionally a
projector MLP to the LLM width (`project_to`).

Where pixels come from: the "pixels" input when the section receives one (per-sample [3, H, W]
tensors from a separate decode section, or a test); else the column that carries images
(`ctx.modality_columns`, i.e. `data.modality_columns["image"]`, default "image"): an entry that is
already a pixel array ([3, H, W] as a tensor, numpy array or nested lists, e.g. a precomputed
`pixel_values` column) is used as it is, an entry of encoded bytes
decoded by an image decoder built at construction from `decoder` ("module:Class", default
"loaders.dali:ImageDecoder", imported only then) with keyword arguments `decode` (default
{"max_side": 64, "patch": patch, "device": ctx.device}) and called as
`decode(images: list[bytes], sample_ids: list[int]) -> list[Tensor | None]` (float32 CHW). A
sample without pixels (no image, or an image the decoder skipped and returned None for) gets None
as its "image_embeds" entry. `decoder: None` builds no decoder (the "pixels" input is then needed).

VisionEncoder config keys: patch (8), d_model (64), n_layers (2), n_heads (4), d_ff (4*d_model),
max_grid (16), project_to (None), feature_layer (-1), init_seed (None), decode ({}), decoder ("loaders.dali:ImageDecoder").
Output: "image_embeds", per sample [num_patches_i, project_to or d_model] or None. Its
`payload_checks` (`maestro validate --payloads`) check each image as this configuration takes it
(`image_problem`), the data's num_patches included.

Projector config keys: input ("image_embeds"), output ("image_embeds"), d_in (64), d_out (64),
d_hidden (d_out), init_seed (None). Reading and writing the same name lets it sit as its own
section between the encoder and the LLM (encoder -> projector -> LLM, both edges carrying
"image_embeds"), so neither neighbour's config changes. With the same `init_seed`, its weights
equal those of the projector built into a VisionEncoder with `project_to` (both are named
"projector.*"). Knows nothing of transfers or gradients across sections (the runtime's job).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from maestro_flow import MicroBatch, Stage, StageContext
from maestro_flow.errors import brief
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import PayloadNote
from stages.common import Outputs, check_keys, lengths_of
from stages.encoder import (
    EncoderConfig,
    EncoderTrunk,
    ProjectorMLP,
    check_int,
    load_class,
    optional_projector,
    param_like,
    scatter,
    seeded,
)
from stages.transformer import block_tp_plan, check_block_tp

DEFAULT_DECODER = "loaders.dali:ImageDecoder"
DEFAULT_MAX_SIDE = 64


def num_patches(height: int, width: int, patch: int) -> int:
    """Embedding rows of a decoded [3, height, width] image (height, width multiples of patch)."""
    return (height // patch) * (width // patch)


@dataclass(frozen=True, kw_only=True, slots=True)
class VisionConfig(EncoderConfig):
    patch: int = 8
    max_grid: int = 16
    decode: dict[str, Any] = field(default_factory=dict)
    decoder: str | None = DEFAULT_DECODER

    def validate(self, where: str = "") -> None:
        EncoderConfig.validate(self, where)
        check_int(self.patch, "patch", where=where)
        check_int(self.max_grid, "max_grid", where=where)
        if not isinstance(self.decode, dict):
            raise ValueError(f"{where}decode must be a dict of the decoder's keyword arguments, got {self.decode!r}")


def patchify(image: Tensor, patch: int) -> tuple[Tensor, int, int]:
    """[3, H, W] -> ([gh * gw, 3 * patch * patch] row-major over the grid, gh, gw)."""
    c, h, w = image.shape
    gh, gw = h // patch, w // patch
    rows = image.reshape(c, gh, patch, gw, patch).permute(1, 3, 0, 2, 4).reshape(gh * gw, c * patch * patch)
    return rows, gh, gw


class ViT(nn.Module):
    """Patch embedding + factorised 2-D positions + EncoderTrunk."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.patch = cfg.patch
        self.patch_emb = nn.Linear(3 * cfg.patch * cfg.patch, cfg.d_model)
        self.row_emb = nn.Embedding(cfg.max_grid, cfg.d_model)
        self.col_emb = nn.Embedding(cfg.max_grid, cfg.d_model)
        self.trunk = EncoderTrunk(cfg)

    def forward(self, images: list[Tensor]) -> list[Tensor]:
        """Per-sample [3, H_i, W_i] (already checked) -> per-sample [num_patches_i, d_model]."""
        patches, rows, cols = [], [], []
        for image in images:
            p, gh, gw = patchify(image, self.patch)
            patches.append(p)
            rows.append(torch.arange(gh, device=p.device).repeat_interleave(gw))
            cols.append(torch.arange(gw, device=p.device).repeat(gh))
        x = self.patch_emb(torch.cat(patches)) + self.row_emb(torch.cat(rows)) + self.col_emb(torch.cat(cols))
        return self.trunk(list(x.split(lengths_of(patches))))


class VisionEncoder(Stage):
    """Outputs "image_embeds": per sample [num_patches_i, project_to or d_model], or None."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.vision_config = cfg = VisionConfig.from_dict(config)
        self.encoder = seeded(ViT(cfg), seed=cfg.init_seed, n_layers=cfg.n_layers, prefix="encoder.")
        self.projector = optional_projector(cfg)
        self.decoder = None
        self._skipped = 0  # image samples trained without their image (corrupt, skipped): stats()
        if cfg.decoder is not None:
            self.decoder = load_class(cfg.decoder, "decoder")(**{"device": str(ctx.device), **_decode_kwargs(cfg)})

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """What __init__ checks before it builds anything: the config, the decode arguments, and
        that the decoder class imports (found in a read-through: a misspelt path reached the
        workers in `maestro run`)."""
        cfg = VisionConfig.from_dict(config)
        if cfg.decoder is not None:
            _decode_kwargs(cfg)
            load_class(cfg.decoder, "decoder")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("image_embeds",)

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("pixels",)  # decoded upstream, in place of the image column

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"image_embeds": VisionConfig.from_dict(config).out_width()}

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        """Patches its position table covers: max_grid a side, so at most max_grid squared an
        image. A sample whose num_patches is more is refused before any worker starts (found in
        QA: `plan --trace-in` planned such samples, which no decode can give this encoder)."""
        default = next(f.default for f in dataclasses.fields(VisionConfig) if f.name == "max_grid")
        return {"max_patches": int(config.get("max_grid", default)) ** 2}

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("encoder.trunk.blocks")

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = VisionConfig.from_dict(config)
        check_block_tp(cfg.n_heads, cfg.block_config().ff_dim, tp)

    def stats(self) -> dict[str, float]:
        """Corrupt images the decoder skipped (with decode.skip_corrupt=True), so far: counted in
        forward, as the samples are trained (found in review: the decoder's own count ran ahead
        in section mode, where `prepare` decodes the next micro-batches early)."""
        return {"corrupt_images": self._skipped} if self.decoder is not None else {}

    def prepare(self, batch: MicroBatch) -> MicroBatch:
        """Decodes the micro-batch's encoded images (the runtime may do it ahead, Stage.prepare):
        the image column then holds pixel tensors, which `forward` takes as they are."""
        column = self.ctx.modality_columns.get("image", "image")
        images = batch.columns.get(column)
        if "pixels" in batch.inputs or images is None or not any(isinstance(d, (bytes, bytearray, memoryview))
                                                                  for d in images):
            return batch
        return dataclasses.replace(batch, columns={**batch.columns, column: self._pixels(batch)})

    def forward(self, batch: MicroBatch) -> Outputs:
        pixels = self._pixels(batch)
        present = [i for i, p in enumerate(pixels) if p is not None]
        if self.decoder is not None:  # an image sample without pixels: its image was skipped as corrupt
            self._skipped += sum(1 for p, m in zip(pixels, batch.modalities, strict=True) if p is None and "image" in m)
        if not present:
            return {"image_embeds": [None] * len(batch)}
        like = param_like(self.encoder)
        images = [self._checked(pixels[i], batch.sample_ids[i]).to(device=like.device, dtype=like.dtype)
                  for i in present]
        embeds = self.encoder(images)
        if self.projector is not None:
            embeds = self.projector.per_sample(embeds)
        return {"image_embeds": scatter(embeds, present, len(batch))}

    def _pixels(self, batch: MicroBatch) -> list[Tensor | None]:
        if "pixels" in batch.inputs:
            return list(batch.inputs["pixels"])
        column = self.ctx.modality_columns.get("image", "image")
        if column not in batch.columns:
            raise ValueError(f"VisionEncoder needs the {column!r} column (encoded bytes or pixel arrays) or a "
                             "'pixels' input (check the section's columns=)")
        images = batch.columns[column]
        if any(data is not None and not isinstance(data, (bytes, bytearray, memoryview)) for data in images):
            return [None if data is None else _as_pixels(data, sid) for data, sid in zip(images, batch.sample_ids,
                                                                                         strict=True)]
        todo = [i for i, data in enumerate(images) if data is not None]
        if not todo:
            return [None] * len(batch)
        if self.decoder is None:
            raise ValueError("VisionEncoder: config 'decoder' is None, so images must arrive decoded "
                             "through a 'pixels' input")
        try:
            decoded = self.decoder.decode([bytes(images[i]) for i in todo], [batch.sample_ids[i] for i in todo])
        except ValueError as exc:  # found in QA: the run's error named neither way out
            from loaders.dali import CorruptImage

            # Another decoder may take no skip_corrupt; the built-in one's other errors are no image's.
            if self.vision_config.decoder != DEFAULT_DECODER or not isinstance(exc, CorruptImage):
                raise
            exc.add_note(f"`maestro validate PIPELINE --payloads` lists every image the run cannot decode; "
                         f"--set sections.{self.ctx.section}.config.decode.skip_corrupt=true trains such samples "
                         "without their image, counted as corrupt_images")
            raise
        if len(decoded) != len(todo):
            raise ValueError(f"image decoder returned {len(decoded)} images for {len(todo)} inputs")
        return scatter(decoded, todo, len(batch))

    def _checked(self, image: Tensor, sample_id: int) -> Tensor:
        problem = grid_problem(tuple(image.shape), self.vision_config.patch, self.vision_config.max_grid)
        if problem is not None:
            raise ValueError(f"sample {sample_id}: {problem}")
        return image

    @classmethod
    def payload_checks(cls, config: dict[str, Any]) -> dict[str, Callable[[Any, SampleMeta], str | None]]:
        """The image column, as this configuration will read it (`image_problem`)."""
        cfg = VisionConfig.from_dict(config)
        return {"image": functools.partial(image_problem, cfg)}


def _decode_kwargs(cfg: VisionConfig) -> dict[str, Any]:
    """The decoder's options (but its device): decode's, over the defaults; refused where its
    max_side makes grids larger than max_grid."""
    kwargs = {"max_side": DEFAULT_MAX_SIDE, "patch": cfg.patch, **cfg.decode}
    side = kwargs["max_side"]
    if isinstance(side, int) and kwargs["patch"] == cfg.patch and side // cfg.patch > cfg.max_grid:
        raise ValueError(f"decode.max_side={side} makes grids of up to {side // cfg.patch} patches of {cfg.patch} "
                         f"pixels a side, more than max_grid={cfg.max_grid}: raise max_grid or lower max_side")
    return kwargs


def grid_problem(shape: tuple[int, ...], patch: int, max_grid: int) -> str | None:
    """Why pixels of `shape` cannot go through the ViT (not [3, H, W] on the patch grid, or a grid
    over max_grid), or None."""
    if len(shape) != 3 or shape[0] != 3 or shape[1] < 1 or shape[2] < 1 or shape[1] % patch or shape[2] % patch:
        return f"image must be [3, H, W] with H, W positive multiples of patch={patch}, got {list(shape)}"
    if shape[1] // patch > max_grid or shape[2] // patch > max_grid:
        return (f"image {shape[1]}x{shape[2]} is a {shape[1] // patch}x{shape[2] // patch} patch grid, larger than "
                f"max_grid={max_grid} (raise max_grid or decode to a smaller max_side)")
    return None


def image_problem(cfg: VisionConfig, data: Any, meta: SampleMeta) -> str | None:
    """What `maestro validate --payloads` finds wrong with one sample's image for this encoder:
    - a pixel array: not [3, H, W] on the patch grid, or its patches not the data's num_patches;
    - encoded bytes, with the built-in decoder (loaders.dali): what it would refuse before
      decoding (not an image, a GIF, a PNG or JPEG cut short or failing its checksums, a header
      over decode.max_pixels; a PayloadNote with decode.skip_corrupt, the run skipping it), and,
      where the header gives the size (PNG, JPEG, WebP, BMP, PNM), a data num_patches other than the patches it
      decodes to (the planner's costs and the length checks count the column's figure). Another
      decoder (or none) reads what it reads: only empty bytes are refused for it."""
    if data is None:
        return "it carries the image modality but its image is null"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        try:
            shape = tuple(_as_pixels(data, meta.id).shape)
        except ValueError as exc:
            return str(exc).split(": ", 1)[-1]
        return grid_problem(shape, cfg.patch, cfg.max_grid) or _patches_differ(meta, num_patches(*shape[1:], cfg.patch),
                                                                              f"{shape[1]}x{shape[2]} pixels")
    if len(data) == 0:
        return "its image is empty (0 bytes)"
    if cfg.decoder != DEFAULT_DECODER:
        return None  # another decoder (or none: pixels by an edge) reads what it reads (found in review)
    from loaders import dali, image_check

    decode = {"max_side": DEFAULT_MAX_SIDE, "patch": cfg.patch, "max_pixels": dali.MAX_PIXELS, **cfg.decode}
    problem = image_check.framing_problem(data)
    size = image_check.header_size(data) if problem is None else None
    if size is not None and decode["max_pixels"] is not None and size[0] * size[1] > decode["max_pixels"]:
        problem = f"it is {size[0]} x {size[1]} pixels, more than max_pixels={decode['max_pixels']} (decode.max_pixels)"
    if problem is not None:  # the decoder refuses it: an error in the run, or skipped and counted
        return PayloadNote(f"{problem} (the run skips it: decode.skip_corrupt)") if decode.get("skip_corrupt") \
            else problem
    if size is None:  # a header that does not say (DALI reads the image at run time)
        return None
    try:
        h, w = dali.target_size(*size, decode["max_side"], decode["patch"])
    except ValueError as exc:
        return str(exc)
    return (grid_problem((3, h, w), cfg.patch, cfg.max_grid)
            or _patches_differ(meta, num_patches(h, w, cfg.patch), f"{size[0]}x{size[1]} pixels, decoded to {h}x{w}"))


def _patches_differ(meta: SampleMeta, patches: int, what: str) -> str | None:
    if meta.num_patches == patches:
        return None
    return (f"num_patches is {meta.num_patches} but its image ({what}) gives {patches} patches: the planner and "
            "the max_seq_len checks count the column; recompute it for this section's patch and decode settings "
            "(loaders.dali.num_patches)")


def _as_pixels(data: Any, sample_id: int) -> Tensor:
    """A precomputed pixel array ([3, H, W] tensor, numpy array or nested lists) as a float tensor."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"sample {sample_id}: the image column mixes encoded bytes and pixel arrays")
    try:
        pixels = data if isinstance(data, Tensor) else torch.as_tensor(data)
    except (ValueError, TypeError, RuntimeError) as exc:  # found in review: ragged lists or text, no sample named
        raise ValueError(f"sample {sample_id}: the image column's value is not a [3, H, W] array of numbers "
                         f"({brief(exc)})") from None
    if not pixels.is_floating_point():
        pixels = pixels.float()
    return pixels


@dataclass(frozen=True, kw_only=True, slots=True)
class ProjectorConfig:
    input: str = "image_embeds"
    output: str = "image_embeds"
    d_in: int = 64
    d_out: int = 64
    d_hidden: int | None = None
    init_seed: int | None = None

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ProjectorConfig:
        check_keys(config, {f.name for f in dataclasses.fields(cls)})
        cfg = cls(**config)
        for key in ("input", "output"):
            if not isinstance(getattr(cfg, key), str) or not getattr(cfg, key):
                raise ValueError(f"{key} must be a tensor name, got {getattr(cfg, key)!r}")
        check_int(cfg.d_in, "d_in")
        check_int(cfg.d_out, "d_out")
        check_int(cfg.d_hidden, "d_hidden", optional=True)
        if cfg.init_seed is not None and (not isinstance(cfg.init_seed, int) or isinstance(cfg.init_seed, bool)):
            raise ValueError(f"init_seed must be an integer or None, got {cfg.init_seed!r}")
        return cfg


class Projector(Stage):
    """Maps each received [L_i, d_in] tensor to [L_i, d_out] with a 2-layer MLP (None stays None)."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.projector_config = cfg = ProjectorConfig.from_dict(config)
        self.projector = seeded(ProjectorMLP(cfg.d_in, cfg.d_out, cfg.d_hidden), seed=cfg.init_seed, n_layers=1,
                                prefix="projector.")

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        ProjectorConfig.from_dict(config)

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return (config.get("output", "image_embeds"),)

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return (ProjectorConfig.from_dict(config).input,)

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        cfg = ProjectorConfig.from_dict(config)
        return {cfg.input: (cfg.d_in, "d_in")}

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        cfg = ProjectorConfig.from_dict(config)
        return {cfg.output: (cfg.d_out, "d_out")}

    def forward(self, batch: MicroBatch) -> Outputs:
        name = self.projector_config.input
        received = batch.inputs.get(name)
        if received is None:
            raise ValueError(f"Projector needs the input tensor {name!r} (config 'input')")
        like = param_like(self.projector)
        present = [i for i, e in enumerate(received) if e is not None]
        d_in = self.projector.fc_in.in_features
        for i in present:
            if received[i].dim() != 2 or received[i].shape[1] != d_in:
                raise ValueError(f"sample {batch.sample_ids[i]}: {name!r} must be [L, {d_in}], "
                                 f"got {list(received[i].shape)}")
        out = self.projector.per_sample([received[i].to(device=like.device, dtype=like.dtype) for i in present])
        return {self.projector_config.output: scatter(out, present, len(batch))}
