"""`AudioEncoder`: raw waveforms -> one embedding row per frame, and the `num_frames` rule.

Front end, per sample and at the sample's own sample rate: frames of frame_len samples every hop
samples, where frame_len = frame_samples(frame_s, sample_rate) and hop = frame_samples(hop_s,
sample_rate) (seconds x rate, rounded half up, at least 1); a periodic Hann window; the power
spectrum (rFFT); a triangular mel filterbank (HTK mel scale, `n_mels` filters from 0 Hz to the
Nyquist frequency, built for that rate); log (floored at 1e-10). Because the filterbank maps any
rate's spectrum to the same `n_mels` features, samples with different rates can share a
micro-batch. Then: LayerNorm over the mel features, a Linear to d_model plus a learned position
per frame (at most `max_frames`), bidirectional transformer blocks with a key-padding mask, a
final LayerNorm, and optionally a projector MLP to the LLM width (`project_to`).

Frame count (exact; `num_frames` is public so that a dataset builder computes the `num_frames`
metadata column the same way): with n waveform samples,
    num_frames = max(1, 1 + (n - frame_len) // hop)
i.e. every full frame starting at 0, hop, 2*hop, ...; a clip shorter than one frame is zero-padded
to one frame; trailing samples that do not fill a frame are dropped.

Config keys: frame_s (0.025), hop_s (0.01), n_mels (40), d_model (64), n_layers (2), n_heads (4),
d_ff (4*d_model), max_frames (1024), project_to (None), feature_layer (-1), init_seed (None). Reads the audio column
(1-D float waveforms) and the "sample_rate" column (ints). Output: "audio_embeds", per sample
[num_frames_i, project_to or d_model], or None for a sample without audio. Knows nothing of how
the waveform was stored or of other sections. `payload_checks` (`maestro validate --payloads`)
check each clip's frames at this framing against max_frames and the data's num_frames
(`audio_problem`). The waveforms are in the column that carries audio (`ctx.modality_columns`,
i.e. `data.modality_columns["audio"]`, default "audio").
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from maestro_flow import MicroBatch, Stage, StageContext
from maestro_flow.samples import SampleMeta
from maestro_flow.stage import PayloadCheck
from stages.common import Outputs, lengths_of
from stages.encoder import EncoderConfig, EncoderTrunk, check_int, optional_projector, param_like, scatter, seeded
from stages.transformer import block_tp_plan, check_block_tp

FRAME_S = 0.025
HOP_S = 0.01
LOG_FLOOR = 1e-10


def frame_samples(seconds: float, sample_rate: int) -> int:
    """A duration in whole samples at `sample_rate`: round half up, at least 1."""
    return max(1, math.floor(seconds * sample_rate + 0.5))


def num_frames(num_samples: int, sample_rate: int, frame_s: float = FRAME_S, hop_s: float = HOP_S) -> int:
    """Frames (embedding rows) the AudioEncoder gives for a clip of `num_samples` samples."""
    frame_len, hop = frame_samples(frame_s, sample_rate), frame_samples(hop_s, sample_rate)
    return max(1, 1 + (num_samples - frame_len) // hop)


def mel_filterbank(n_fft: int, sample_rate: int, n_mels: int) -> Tensor:
    """[n_fft // 2 + 1, n_mels] float64: triangular filters, evenly spaced on the HTK mel scale."""
    def to_mel(hz: Tensor) -> Tensor:
        return 2595.0 * torch.log10(1.0 + hz / 700.0)

    freqs = torch.fft.rfftfreq(n_fft, d=1.0 / sample_rate, dtype=torch.float64)
    edges_mel = torch.linspace(0.0, float(to_mel(torch.tensor(sample_rate / 2.0))), n_mels + 2, dtype=torch.float64)
    edges = 700.0 * (10.0 ** (edges_mel / 2595.0) - 1.0)
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    rising = (freqs[:, None] - lower) / (center - lower)
    falling = (upper - freqs[:, None]) / (upper - center)
    return torch.minimum(rising, falling).clamp_min(0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioConfig(EncoderConfig):
    frame_s: float = FRAME_S
    hop_s: float = HOP_S
    n_mels: int = 40
    max_frames: int = 1024

    def validate(self, where: str = "") -> None:
        EncoderConfig.validate(self, where)
        for key in ("frame_s", "hop_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{where}{key} must be a duration in seconds > 0, got {value!r}")
        check_int(self.n_mels, "n_mels", where=where)
        check_int(self.max_frames, "max_frames", where=where)


class LogMel(nn.Module):
    """Waveform [n] at a sample rate -> log-mel features [num_frames, n_mels] (no parameters)."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.frame_s, self.hop_s, self.n_mels = cfg.frame_s, cfg.hop_s, cfg.n_mels
        self._filters: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}

    def _window_and_filters(self, frame_len: int, sample_rate: int, like: Tensor) -> tuple[Tensor, Tensor]:
        key = (sample_rate, like.dtype, like.device)
        if key not in self._filters:
            window = torch.hann_window(frame_len, periodic=True, dtype=torch.float64)
            filters = mel_filterbank(frame_len, sample_rate, self.n_mels)
            self._filters[key] = (window.to(like), filters.to(like))
        return self._filters[key]

    def forward(self, wave: Tensor, sample_rate: int) -> Tensor:
        """In the wave's dtype; a half-precision wave (a bf16 or fp16 pipeline) is transformed in
        float32, which torch.fft needs, and its features cast back."""
        dtype = wave.dtype
        if dtype not in (torch.float32, torch.float64):
            wave = wave.float()
        frame_len, hop = frame_samples(self.frame_s, sample_rate), frame_samples(self.hop_s, sample_rate)
        if wave.shape[0] < frame_len:
            wave = torch.nn.functional.pad(wave, (0, frame_len - wave.shape[0]))
        frames = wave.unfold(0, frame_len, hop)  # exactly num_frames(len, rate) rows
        window, filters = self._window_and_filters(frame_len, sample_rate, wave)
        power = torch.fft.rfft(frames * window, dim=-1).abs().square()
        return (power @ filters).clamp_min(LOG_FLOOR).log().to(dtype)


class AudioTransformer(nn.Module):
    """LogMel -> LayerNorm -> Linear + learned frame positions -> EncoderTrunk."""

    def __init__(self, cfg: AudioConfig) -> None:
        super().__init__()
        self.features = LogMel(cfg)
        self.feature_norm = nn.LayerNorm(cfg.n_mels)
        self.frame_emb = nn.Linear(cfg.n_mels, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_frames, cfg.d_model)
        self.trunk = EncoderTrunk(cfg)

    def forward(self, waves: list[Tensor], sample_rates: list[int]) -> list[Tensor]:
        """Per-sample 1-D waveforms (already checked) -> per-sample [num_frames_i, d_model]."""
        feats = [self.features(w, r) for w, r in zip(waves, sample_rates, strict=True)]
        lengths = lengths_of(feats)
        positions = torch.cat([torch.arange(n, device=feats[0].device) for n in lengths])
        x = self.frame_emb(self.feature_norm(torch.cat(feats))) + self.pos_emb(positions)
        return self.trunk(list(x.split(lengths)))


class AudioEncoder(Stage):
    """Outputs "audio_embeds": per sample [num_frames_i, project_to or d_model], or None."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.audio_config = cfg = AudioConfig.from_dict(config)
        self.encoder = seeded(AudioTransformer(cfg), seed=cfg.init_seed, n_layers=cfg.n_layers, prefix="encoder.")
        self.projector = optional_projector(cfg)

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        AudioConfig.from_dict(config)

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        """Frames its positions cover: a longer clip is refused before any worker starts (found in
        review: only mid-run, by this stage's forward). Only with the loader's framing (FRAME_S,
        HOP_S), which the data's derived num_frames counts in; with another, nothing is declared
        (the forward still refuses a clip too long)."""
        cfg = AudioConfig.from_dict(config)
        return {"max_frames": cfg.max_frames} if (cfg.frame_s, cfg.hop_s) == (FRAME_S, HOP_S) else {}

    @classmethod
    def payload_checks(cls, config: dict[str, Any]) -> dict[str, PayloadCheck]:
        """Each clip with its sample rate, at this configuration's framing (`audio_problem`)."""
        return {"audio": PayloadCheck(functools.partial(audio_problem, AudioConfig.from_dict(config)),
                                      ("sample_rate",))}

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("encoder.trunk.blocks")

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = AudioConfig.from_dict(config)
        check_block_tp(cfg.n_heads, cfg.block_config().ff_dim, tp)

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("audio_embeds",)

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ()

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"audio_embeds": AudioConfig.from_dict(config).out_width()}

    def forward(self, batch: MicroBatch) -> Outputs:
        wave_column = self.ctx.modality_columns.get("audio", "audio")
        for column in (wave_column, "sample_rate"):
            if column not in batch.columns:
                raise ValueError(f"AudioEncoder needs the {column!r} column (check the section's columns=)")
        audio, rates = batch.columns[wave_column], batch.columns["sample_rate"]
        present = [i for i, wave in enumerate(audio) if wave is not None]
        if not present:
            return {"audio_embeds": [None] * len(batch)}
        like = param_like(self.encoder)
        waves, sample_rates = [], []
        for i in present:
            wave = torch.as_tensor(audio[i])
            problem = clip_problem(self.audio_config, tuple(wave.shape), rates[i])
            if problem is not None:
                raise ValueError(f"sample {batch.sample_ids[i]}: {problem}")
            waves.append(wave.to(device=like.device, dtype=like.dtype))
            sample_rates.append(_sample_rate(rates[i]))
        embeds = self.encoder(waves, sample_rates)
        if self.projector is not None:
            embeds = self.projector.per_sample(embeds)
        return {"audio_embeds": scatter(embeds, present, len(batch))}


def audio_problem(cfg: AudioConfig, wave: Any, meta: SampleMeta, row: dict[str, Any]) -> str | None:
    """What `maestro validate --payloads` finds wrong with one sample's clip for this encoder: a
    null clip or sample rate, a clip that is not a 1-D waveform of finite numbers (the loader
    checks that in a column named "audio", not in one data.modality_columns names), more frames at
    this framing (frame_s, hop_s) than max_frames (plain validate checks the data's num_frames
    against it only at the loader's framing; the forward refuses it mid-run), or a data num_frames
    other than the frames the clip makes (a column computed for another framing, or none at a
    framing other than the loader's: the planner's costs and the length checks count that
    figure)."""
    if wave is None:
        return "it carries the audio modality but its audio is null"
    try:
        array = np.asarray(wave, dtype=np.float64)
    except (TypeError, ValueError):
        return "its audio is not a 1-D list of numbers"
    if array.ndim == 1 and not np.isfinite(array).all():
        return "its audio holds a null, NaN or infinite value (the loss would not be finite)"
    problem = clip_problem(cfg, array.shape, row["sample_rate"])
    if problem is not None:
        return problem
    n, rate = len(array), _sample_rate(row["sample_rate"])
    frames = num_frames(n, rate, cfg.frame_s, cfg.hop_s)
    if meta.num_frames != frames:
        return (f"num_frames is {meta.num_frames} but its clip ({n} samples at {rate} Hz) makes {frames} frames at "
                f"frame_s={cfg.frame_s:g}, hop_s={cfg.hop_s:g} (the planner's costs and length checks would count "
                f"{meta.num_frames}, the data's num_frames column or, where it has none, the loader's count at "
                f"frame_s={FRAME_S:g}, hop_s={HOP_S:g}; give the column as stages.audio.num_frames(n, sample_rate, "
                "frame_s, hop_s) counts)")
    return None


def clip_problem(cfg: AudioConfig, shape: tuple[int, ...], sample_rate: Any) -> str | None:
    """Why this encoder cannot take a clip of `shape` at `sample_rate` (not a 1-D waveform, no
    positive integer rate, more frames at its framing than max_frames), else None: what
    `validate --payloads` says before a run and the forward raises in one."""
    if len(shape) != 1:
        return f"its audio must be a 1-D waveform, got shape {list(shape)}"
    rate = _sample_rate(sample_rate)
    if rate is None:
        return f"sample_rate must be a positive integer, got {sample_rate!r}"
    frames = num_frames(shape[0], rate, cfg.frame_s, cfg.hop_s)
    if frames > cfg.max_frames:
        return (f"its clip ({shape[0]} samples at {rate} Hz) makes {frames} frames at frame_s={cfg.frame_s:g}, "
                f"hop_s={cfg.hop_s:g}, more than max_frames={cfg.max_frames}")
    return None


def _sample_rate(value: Any) -> int | None:
    """`value` as a positive int (Python, numpy or 0-d tensor integers), else None."""
    if isinstance(value, bool):
        return None
    try:
        rate = operator.index(value)
    except TypeError:
        return None
    return rate if rate >= 1 else None
