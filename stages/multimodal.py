"""`MultimodalLM`: the LLM backbone of a multimodal model, trained on text with image/audio embeddings.

For each sample, every placeholder token (ids from `ctx.placeholder_ids`, i.e. the pipeline's
`ArrowData.placeholder_ids`, e.g. {"image": 259, "audio": 260}) is replaced by the rows the sample
received for that modality (input tensor name from config `inputs`), each row one position of the
sequence; a sample carries at most one placeholder per modality. If the producer skipped the
sample (its input entry is None: no image, or an image the decoder could not read) the
placeholder is dropped. The expanded sequence — token embeddings interleaved with the received
rows — runs through the causal Decoder and LM head of transformer.py (one `CausalTransformer`,
named as in `CausalLM`, so a text LM's checkpoint loads).

Loss: next-token cross-entropy summed over TEXT targets only: a position whose next position is
a text token predicts it (the last image row predicts the first text token after the image);
targets that are embedding rows are excluded (placeholders are gone after expansion).
"loss_denominator" is the number of text targets. Gradients flow into the received embeddings
(the runtime sends them back to the encoder section).

Config keys: the LMConfig keys (vocab_size 261 = the byte vocabulary of loaders/text.py with
<pad> <bos> <eos> <image> plus <audio>, d_model, n_layers, n_heads, d_ff, max_seq_len, dropout,
init_seed, checkpoint) and `inputs`: modality -> input tensor name (default
{"image": "image_embeds", "audio": "audio_embeds"}). Received rows must be [n, d_model] (put a
projector on the encoder side). Knows nothing of the encoders or of transfers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from maestro_flow import MicroBatch, Stage, StageContext
from stages.common import Outputs, ce_sum, loss_outputs, pad_right
from stages.encoder import param_like
from stages.lm import build_causal_transformer
from stages.transformer import LMConfig, block_tp_plan, check_block_tp
from stages.weights import check_checkpoint_file

VOCAB_SIZE = 261
DEFAULT_INPUTS = {"image": "image_embeds", "audio": "audio_embeds"}
IGNORE = -100  # label of a position that is not a text token (never a target)


def _input_names(config: dict[str, Any]) -> dict[str, str]:
    """Config `inputs`: modality -> the input tensor that carries its encoder's rows."""
    inputs = config.get("inputs", DEFAULT_INPUTS)
    if not isinstance(inputs, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                               for k, v in inputs.items()):
        raise ValueError(f"inputs must map modality names to input tensor names, got {inputs!r}")
    return dict(inputs)


class MultimodalLM(Stage):
    """Outputs "loss" (sum of next-token CE over text targets) and "loss_denominator"."""

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.input_names = _input_names(config)
        self.model_config = LMConfig.from_dict({"vocab_size": VOCAB_SIZE, **config}, ignore=("inputs",))
        self.model = build_causal_transformer(self.model_config)

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        _input_names(config)
        check_checkpoint_file(LMConfig.from_dict({"vocab_size": VOCAB_SIZE, **config}, ignore=("inputs",)).checkpoint,
                              "checkpoint")

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("loss", "loss_denominator")

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return tuple(_input_names(config).values())

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        d_model = LMConfig.from_dict({"vocab_size": VOCAB_SIZE, **config}, ignore=("inputs",)).d_model
        return {name: (d_model, "d_model") for name in _input_names(config).values()}

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        """The vocabulary (placeholder ids exempt: they are replaced, never looked up) and
        max_seq_len as "max_positions": counted after each placeholder's expansion."""
        limits = LMConfig.token_limits({"vocab_size": VOCAB_SIZE, **config})
        return {"vocab_size": limits["vocab_size"], "max_positions": limits["max_tokens"]}

    @classmethod
    def placeholder_inputs(cls, config: dict[str, Any]) -> dict[str, str]:
        return _input_names(config)

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str]:
        return block_tp_plan("model.decoder.blocks")

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        cfg = LMConfig.from_dict({"vocab_size": VOCAB_SIZE, **config}, ignore=("inputs",))
        check_block_tp(cfg.n_heads, cfg.ff_dim, tp)

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = [t.to(torch.int64) for t in batch.columns["tokens"]]
        like = param_like(self.model)
        cuts = [self._cuts(batch, i, t) for i, t in enumerate(tokens)]
        # One embedding call for the whole micro-batch; placeholder ids (maybe outside the
        # vocabulary) are looked up as 0 and their rows are cut out below.
        text_ids = [t.clone() for t in tokens]
        for t, sample_cuts in zip(text_ids, cuts, strict=True):
            for pos, _ in sample_cuts:
                t[pos] = 0
        embedded = self.model.tok_emb(torch.cat(text_ids).to(like.device)).split([len(t) for t in tokens])

        seqs, labels = [], []
        for sample_id, t, emb, sample_cuts in zip(batch.sample_ids, tokens, embedded, cuts, strict=True):
            segs, labs, start = [], [], 0
            for pos, rows in sample_cuts:
                segs.append(emb[start:pos])
                labs.append(t[start:pos])
                if rows is not None:
                    segs.append(rows.to(like))
                    labs.append(torch.full((rows.shape[0],), IGNORE, dtype=torch.int64))
                start = pos + 1
            segs.append(emb[start:])
            labs.append(t[start:])
            seq = torch.cat(segs)
            if seq.shape[0] > self.model_config.max_seq_len:
                # validate checked the data's num_patches/num_frames against max_seq_len: the encoders
                # sent more rows than those said (found in QA: a cryptic end to a run on such data).
                rows = sum(r.shape[0] for _, r in sample_cuts if r is not None)
                raise ValueError(f"sample {sample_id}: {seq.shape[0]} positions after expanding its placeholders "
                                 f"({len(t)} tokens, {rows} encoder rows) exceed max_seq_len="
                                 f"{self.model_config.max_seq_len}; if its num_patches or num_frames column says "
                                 "fewer rows, it is wrong: `maestro validate PIPELINE --payloads` finds such samples "
                                 "for encoders that declare payload_checks (the built-in ones do)")
            seqs.append(seq)
            labels.append(torch.cat(labs))

        hidden = self.model.decoder(pad_right(seqs, 0.0))
        # Position j predicts position j + 1: targets are the labels shifted left by one.
        targets = pad_right([lab[1:] for lab in labels], IGNORE).to(like.device)
        predicting = targets != IGNORE
        logits = self.model.head(hidden[:, : targets.shape[1]][predicting])
        return loss_outputs(ce_sum(logits, targets[predicting]), int(predicting.sum()))

    def _cuts(self, batch: MicroBatch, i: int, tokens: Tensor) -> list[tuple[int, Tensor | None]]:
        """(placeholder position, rows that replace it or None) of sample i, by position."""
        sample_id, d_model = batch.sample_ids[i], self.model_config.d_model
        for modality, name in self.input_names.items():  # rows with no placeholder would be dropped unseen
            received = batch.inputs.get(name)
            if modality not in self.ctx.placeholder_ids and received is not None and received[i] is not None:
                raise ValueError(f"sample {sample_id}: received {name!r} ({modality} rows) but data.placeholder_ids "
                                 f"gives no {modality!r} placeholder id to put them in place of")
        cuts = []
        for modality, placeholder in self.ctx.placeholder_ids.items():
            positions = (tokens == placeholder).nonzero().flatten().tolist()
            name = self.input_names.get(modality)
            received = batch.inputs.get(name) if name is not None else None
            rows = received[i] if received is not None else None
            if not positions:
                if rows is not None:
                    raise ValueError(f"sample {sample_id}: received {name!r} but its tokens have no {modality} "
                                     f"placeholder (id {placeholder})")
                continue
            if len(positions) > 1:
                raise ValueError(f"sample {sample_id}: {len(positions)} {modality} placeholders (id {placeholder}); "
                                 "a sample carries at most one per modality")
            if name is None:
                raise ValueError(f"sample {sample_id} has a {modality} placeholder (id {placeholder}) but config "
                                 f"'inputs' names no input for {modality!r}")
            if received is None:
                raise ValueError(f"sample {sample_id} has a {modality} placeholder but the stage receives no "
                                 f"{name!r} input (an edge from the {modality} encoder must carry it)")
            if rows is not None and (rows.dim() != 2 or rows.shape[1] != d_model):
                raise ValueError(f"sample {sample_id}: {name!r} must be [n, {d_model}] (d_model), "
                                 f"got {list(rows.shape)}")
            cuts.append((positions[0], rows))
        return sorted(cuts, key=lambda cut: cut[0])
