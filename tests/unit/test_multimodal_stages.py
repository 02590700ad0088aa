"""The multimodal stages (stages/vision.py, audio.py, multimodal.py) against the Stage contract.

Float64 throughout, so that "the same result" can be checked to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maestro_flow import MicroBatch, StageContext
from stages.audio import AudioEncoder, frame_samples, num_frames
from stages.multimodal import MultimodalLM
from stages.transformer import Block, LMConfig
from stages.vision import Projector, VisionEncoder, num_patches

IMAGE, AUDIO, BOS, EOS = 259, 260, 257, 258
CTX = StageContext(section="x", dtype="float64", placeholder_ids={"image": IMAGE, "audio": AUDIO})
ATOL = 1e-10
VISION = {"decoder": None, "init_seed": 1, "d_model": 32, "n_heads": 4, "n_layers": 2, "patch": 8, "max_grid": 8}
AUDIO_CFG = {"init_seed": 2, "d_model": 32, "n_heads": 4, "n_layers": 2, "n_mels": 16}
LLM = {"init_seed": 3, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64}


def make(cls, config, ctx=CTX):
    stage = cls(config, ctx)
    for module in stage.modules().values():  # what the runtime does after construction
        module.to(torch.float64)
    return stage


def batch(ids=None, *, tokens=None, columns=None, modalities=None, **inputs):
    columns = dict(columns or {})
    if tokens is not None:
        columns["tokens"] = [torch.tensor(t, dtype=torch.int64) for t in tokens]
    n = len(next(iter(columns.values()))) if columns else len(next(iter(inputs.values())))
    ids = list(range(n)) if ids is None else ids
    modalities = modalities or [frozenset({"text"})] * n
    return MicroBatch(step=0, index=0, sample_ids=ids, modalities=modalities, columns=columns, inputs=inputs)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(a, b):
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=0, atol=ATOL), (a - b).abs().max()


# -- vision -------------------------------------------------------------------------------


class FakeDecoder:
    """Stands in for loaders.dali:ImageDecoder: b"HxW" -> a [3, H, W] image, b"bad" -> None."""

    built: list[dict] = []

    def __init__(self, max_side, patch, mean=(0.5,) * 3, std=(0.5,) * 3, device="cpu"):
        FakeDecoder.built.append({"max_side": max_side, "patch": patch, "device": device})
        self.calls = []

    def decode(self, images, sample_ids):
        self.calls.append(list(sample_ids))
        out = []
        for data, sid in zip(images, sample_ids, strict=True):
            if data == b"bad":
                out.append(None)
                continue
            h, w = (int(x) for x in data.decode().split("x"))
            out.append(randn(3, h, w, seed=sid).float())
        return out


IMAGES = [randn(3, 16, 24, seed=1), randn(3, 8, 8, seed=2), randn(3, 32, 16, seed=3), randn(3, 64, 64, seed=4)]


def encode_images(stage, images, ids=None):
    return stage.forward(batch(ids, pixels=list(images)))["image_embeds"]


@pytest.mark.parametrize("project_to", [None, 48])
def test_vision_gives_one_row_per_patch(project_to):
    stage = make(VisionEncoder, {**VISION, "project_to": project_to})
    out = encode_images(stage, IMAGES)
    expected = [num_patches(im.shape[1], im.shape[2], 8) for im in IMAGES]
    assert expected == [6, 1, 8, 64]
    assert [tuple(o.shape) for o in out] == [(n, project_to or 32) for n in expected]
    assert VisionEncoder.outputs({}) == ("image_embeds",)


def test_vision_results_do_not_depend_on_the_micro_batch():
    stage = make(VisionEncoder, VISION)
    together = encode_images(stage, IMAGES)
    alone = [encode_images(stage, [im], [i])[0] for i, im in enumerate(IMAGES)]
    reordered = encode_images(stage, [IMAGES[2], IMAGES[0]], [2, 0])
    for t, a in zip(together, alone, strict=True):
        close(t, a)
    close(reordered[0], alone[2])
    close(reordered[1], alone[0])


def test_vision_positions_distinguish_transposed_grids():
    stage = make(VisionEncoder, VISION)
    flat = randn(3, 8, 16, seed=5)
    tall = flat.reshape(3, 8, 2, 8).permute(0, 2, 1, 3).reshape(3, 16, 8)  # same patches, 2x1 grid
    wide, high = encode_images(stage, [flat, tall])
    assert not torch.allclose(wide, high)


def test_vision_decodes_bytes_with_the_configured_decoder():
    FakeDecoder.built.clear()
    stage = make(VisionEncoder, {**VISION, "decoder": f"{__name__}:FakeDecoder", "decode": {"max_side": 32}})
    assert FakeDecoder.built == [{"max_side": 32, "patch": 8, "device": "cpu"}]
    images = [b"16x8", None, b"bad", b"8x8"]
    out = stage.forward(batch([10, 11, 12, 13], columns={"image": images}))["image_embeds"]
    assert stage.decoder.calls == [[10, 12, 13]]  # only samples with bytes are decoded
    assert out[1] is None and out[2] is None  # no image; an image the decoder skipped
    assert (out[0].shape[0], out[3].shape[0]) == (2, 1)
    close(out[0], encode_images(stage, [randn(3, 16, 8, seed=10).float().double()])[0])


def test_only_an_image_the_built_in_decoder_cannot_decode_gets_the_ways_out_note():
    """The note naming `--payloads` and skip_corrupt went on any ValueError of the decoder (found in
    review); it goes on the built-in decoder's CorruptImage alone."""
    import dataclasses

    from loaders.dali import CorruptImage
    from stages.vision import DEFAULT_DECODER

    stage = make(VisionEncoder, {**VISION, "decoder": f"{__name__}:FakeDecoder"})
    stage.vision_config = dataclasses.replace(stage.vision_config, decoder=DEFAULT_DECODER)
    for raised, noted in ((CorruptImage("sample 10: cannot decode image: bad"), True), (ValueError("other"), False)):
        def decode(images, ids, exc=raised):
            raise exc

        stage.decoder.decode = decode
        with pytest.raises(ValueError) as info:
            stage.forward(batch([10], columns={"image": [b"16x8"]}))
        assert any("skip_corrupt=true" in note for note in getattr(info.value, "__notes__", [])) == noted


def test_vision_prepare_decodes_ahead_and_forward_takes_its_batch():
    """Stage.prepare: the images decoded once, ahead; forward on the prepared batch gives what
    forward on the encoded one gives, and decodes nothing more."""
    stage = make(VisionEncoder, {**VISION, "decoder": f"{__name__}:FakeDecoder", "decode": {"max_side": 32}})
    raw = batch([10, 11, 12, 13], columns={"image": [b"16x8", None, b"bad", b"8x8"]})
    expected = stage.forward(raw)["image_embeds"]
    stage.decoder.calls.clear()
    ready = stage.prepare(raw)
    assert stage.decoder.calls == [[10, 12, 13]]
    assert raw.columns["image"][0] == b"16x8"  # the batch as read is left as it was (record, replay)
    assert ready.columns["image"][1] is None and ready.columns["image"][2] is None
    out = stage.forward(ready)["image_embeds"]
    assert stage.decoder.calls == [[10, 12, 13]]  # forward decoded nothing again
    assert out[1] is None and out[2] is None
    for got, want in ((out[0], expected[0]), (out[3], expected[3])):
        close(got, want)
    assert stage.prepare(ready) is ready  # nothing left to decode


def test_skipped_images_are_counted_as_trained_not_as_decoded_ahead():
    """Found in review: section mode's count ran a step ahead of colocated mode's, as `prepare`
    decodes the next micro-batches early."""
    stage = make(VisionEncoder, {**VISION, "decoder": f"{__name__}:FakeDecoder", "decode": {"max_side": 32}})
    image, text = frozenset({"text", "image"}), frozenset({"text"})
    raw = batch([10, 11, 12, 13], columns={"image": [b"16x8", None, b"bad", b"8x8"]},
                modalities=[image, text, image, image])
    ready = stage.prepare(raw)
    assert stage.stats() == {"corrupt_images": 0}
    stage.forward(ready)
    assert stage.stats() == {"corrupt_images": 1}


def test_vision_config_and_input_errors():
    with pytest.raises(ValueError, match="unknown config key 'patch_size'"):
        VisionEncoder({"patch_size": 4}, CTX)
    with pytest.raises(ValueError, match="decoder: cannot import 'no_such_module:X'"):
        VisionEncoder({"decoder": "no_such_module:X"}, CTX)
    with pytest.raises(ValueError, match="d_model .* divisible"):
        VisionEncoder({**VISION, "d_model": 30}, CTX)
    stage = make(VisionEncoder, VISION)
    with pytest.raises(ValueError, match="sample 7: image must be .* multiples of patch=8"):
        encode_images(stage, [randn(3, 12, 8)], [7])
    with pytest.raises(ValueError, match="sample 3: .* larger than max_grid=8"):
        encode_images(stage, [randn(3, 72, 8)], [3])
    with pytest.raises(ValueError, match="'decoder' is None"):
        stage.forward(batch(columns={"image": [b"8x8"]}))


def test_projector_section_equals_the_built_in_projector():
    plain = make(VisionEncoder, VISION)
    built_in = make(VisionEncoder, {**VISION, "project_to": 48})
    projector = make(Projector, {"d_in": 32, "d_out": 48, "init_seed": VISION["init_seed"]})
    assert Projector.outputs({}) == ("image_embeds",)
    assert Projector.outputs({"output": "x"}) == ("x",)
    embeds = encode_images(plain, IMAGES[:2]) + [None]
    projected = projector.forward(batch([0, 1, 2], image_embeds=embeds))["image_embeds"]
    assert projected[2] is None
    for p, b in zip(projected[:2], encode_images(built_in, IMAGES[:2]), strict=True):
        close(p, b)
    with pytest.raises(ValueError, match="sample 5: 'image_embeds' must be \\[L, 32\\]"):
        projector.forward(batch([5], image_embeds=[randn(2, 16)]))


def test_init_seed_fixes_encoder_weights_whatever_the_global_rng():
    states = []
    for cls, config in ((VisionEncoder, VISION), (AudioEncoder, AUDIO_CFG)):
        for seed in (0, 1):
            torch.manual_seed(seed)
            states.append(cls(config, CTX).state_dict())
    for a, b in ((states[0], states[1]), (states[2], states[3])):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


# -- audio --------------------------------------------------------------------------------


def test_num_frames_formula():
    assert (frame_samples(0.025, 16000), frame_samples(0.01, 16000)) == (400, 160)
    assert frame_samples(0.01, 22050) == 221  # 220.5 rounds half up
    assert [num_frames(n, 16000) for n in (0, 100, 399, 400, 559, 560, 16000)] == [1, 1, 1, 1, 1, 2, 98]
    assert num_frames(8000, 8000, frame_s=0.05, hop_s=0.025) == 1 + (8000 - 400) // 200


CLIPS = [(randn(1600, seed=1).float(), 16000), (randn(100, seed=2).float(), 16000), (randn(4000, seed=3).float(), 8000),
         (randn(559, seed=4).float(), 16000), (randn(2205, seed=5).float(), 22050)]


def encode_audio(stage, clips, ids=None):
    columns = {"audio": [c for c, _ in clips], "sample_rate": [r for _, r in clips]}
    return stage.forward(batch(ids, columns=columns))["audio_embeds"]


@pytest.mark.parametrize("project_to", [None, 24])
def test_audio_frame_counts_match_num_frames(project_to):
    stage = make(AudioEncoder, {**AUDIO_CFG, "project_to": project_to})
    out = encode_audio(stage, CLIPS)
    assert [o.shape[0] for o in out] == [num_frames(len(c), r) for c, r in CLIPS] == [8, 1, 48, 1, 8]
    assert all(o.shape[1] == (project_to or 32) for o in out)
    assert AudioEncoder.outputs({}) == ("audio_embeds",)


def test_audio_results_do_not_depend_on_the_micro_batch():
    stage = make(AudioEncoder, AUDIO_CFG)
    together = encode_audio(stage, CLIPS)
    for i, clip in enumerate(CLIPS):
        close(together[i], encode_audio(stage, [clip], [i])[0])
    mixed = stage.forward(batch(columns={"audio": [None, CLIPS[0][0]], "sample_rate": [None, 16000]}))
    assert mixed["audio_embeds"][0] is None
    close(mixed["audio_embeds"][1], together[0])


def test_audio_errors_name_the_sample():
    stage = make(AudioEncoder, {**AUDIO_CFG, "max_frames": 4})
    with pytest.raises(ValueError, match=r"sample 9: its clip \(.* makes 8 frames at frame_s=.*, more than max_frames=4$"):
        encode_audio(stage, [CLIPS[0]], [9])
    with pytest.raises(ValueError, match="sample 0: sample_rate must be a positive integer"):
        encode_audio(stage, [(CLIPS[0][0], 0)])
    with pytest.raises(ValueError, match="hop_s must be a duration"):
        AudioEncoder({"hop_s": 0}, CTX)


# -- LLM backbone -------------------------------------------------------------------------


def llm_run(stage, samples, ids=None):
    """samples: (tokens, image rows or None, audio rows or None) per sample."""
    return stage.forward(batch(ids, tokens=[s[0] for s in samples], image_embeds=[s[1] for s in samples],
                               audio_embeds=[s[2] for s in samples]))


def leaf(rows, seed):
    return randn(rows, 32, seed=seed).requires_grad_(True)


def test_llm_places_rows_at_the_placeholder_and_scores_text_only():
    """With image rows equal to the token embeddings of "A B", [BOS, <image>, 10, 11, EOS] is the
    text sequence [BOS, A, B, 10, 11, EOS] with the targets A and B left out of the loss."""
    stage = make(MultimodalLM, LLM)
    model = stage.model
    text = torch.tensor([BOS, 65, 66, 10, 11, EOS])
    rows = model.tok_emb(torch.tensor([65, 66])).detach()
    out = llm_run(stage, [([BOS, IMAGE, 10, 11, EOS], rows, None)])
    per_target = F.cross_entropy(model(text[None])[0, :-1], text[1:], reduction="none")
    assert out["loss_denominator"] == 3
    close(out["loss"], per_target[2:].sum())


def test_llm_denominator_counts_text_targets():
    stage = make(MultimodalLM, LLM)
    samples = [
        ([BOS, IMAGE, 1, 2, 3, EOS], leaf(4, 1), None),  # targets 1 2 3 EOS
        ([BOS, IMAGE, 5, AUDIO, 6, EOS], leaf(2, 2), leaf(3, 3)),  # targets 5 6 EOS
        ([BOS, 7, 8], None, None),  # text only: 7 8
        ([IMAGE, 9, 10], leaf(2, 4), None),  # starts with the image: 9 10
        ([BOS, IMAGE, 11, 12], None, None),  # image skipped: placeholder dropped, 11 12
    ]
    assert llm_run(stage, samples)["loss_denominator"] == 4 + 3 + 2 + 2 + 2


def test_llm_loss_is_a_sum_independent_of_the_micro_batch():
    stage = make(MultimodalLM, LLM)
    samples = [([BOS, IMAGE, 1, 2, 3, EOS], leaf(4, 1), None), ([BOS, 7, 8, 9], None, None),
               ([BOS, AUDIO, 4, IMAGE, 5, EOS], leaf(3, 2), leaf(5, 3)), ([BOS, AUDIO, 6], None, leaf(7, 4))]
    together = llm_run(stage, samples)
    alone = [llm_run(stage, [s], [i]) for i, s in enumerate(samples)]
    close(together["loss"], sum(a["loss"] for a in alone))
    assert together["loss_denominator"] == sum(a["loss_denominator"] for a in alone)
    close(llm_run(stage, samples[::-1], [3, 2, 1, 0])["loss"], together["loss"])


def test_llm_gradients_reach_the_received_embeddings():
    stage = make(MultimodalLM, LLM)
    image, audio = leaf(4, 1), leaf(3, 2)
    samples = [([BOS, IMAGE, 1, AUDIO, 2, EOS], image, audio), ([BOS, 3, 4], None, None)]
    llm_run(stage, samples)["loss"].backward()
    assert image.grad is not None and audio.grad is not None
    assert image.grad.abs().sum() > 0 and audio.grad.abs().sum() > 0
    # Batch-independent gradients too: the text-only neighbour changes nothing.
    image2, audio2 = leaf(4, 1), leaf(3, 2)
    llm_run(stage, [([BOS, IMAGE, 1, AUDIO, 2, EOS], image2, audio2)])["loss"].backward()
    close(image.grad, image2.grad)
    close(audio.grad, audio2.grad)


def test_llm_skipped_image_drops_the_placeholder():
    stage = make(MultimodalLM, LLM)
    skipped = llm_run(stage, [([BOS, IMAGE, 1, 2, EOS], None, None)])
    text = llm_run(stage, [([BOS, 1, 2, EOS], None, None)])
    empty = llm_run(stage, [([BOS, IMAGE, 1, 2, EOS], randn(0, 32), None)])  # zero rows: the same
    for out in (skipped, empty):
        close(out["loss"], text["loss"])
        assert out["loss_denominator"] == text["loss_denominator"] == 3


def test_encoders_feed_the_llm_end_to_end():
    vision = make(VisionEncoder, {**VISION, "project_to": 32})
    audio = make(AudioEncoder, {**AUDIO_CFG, "project_to": 32})
    llm = make(MultimodalLM, LLM)
    image_rows = encode_images(vision, IMAGES[:1])[0]
    audio_rows = encode_audio(audio, CLIPS[:1])[0]
    out = llm_run(llm, [([BOS, IMAGE, 1, AUDIO, 2, EOS], image_rows, audio_rows)])
    out["loss"].backward()
    assert vision.encoder.patch_emb.weight.grad.abs().sum() > 0
    assert audio.encoder.frame_emb.weight.grad.abs().sum() > 0


def test_llm_errors_name_the_sample():
    stage = make(MultimodalLM, {**LLM, "max_seq_len": 8})
    # found in QA: nothing said where the rows came from (a wrong num_patches, which validate trusts)
    with pytest.raises(ValueError, match=r"sample 4: 10 positions after expanding its placeholders \(4 tokens, 7 encoder "
                                         r"rows\) exceed max_seq_len=8; if its num_patches .* `maestro validate "
                                         r"PIPELINE --payloads` finds such samples"):
        llm_run(stage, [([BOS, IMAGE, 1, 2], leaf(7, 1), None)], [4])
    with pytest.raises(ValueError, match="sample 0: 2 image placeholders"):
        llm_run(stage, [([IMAGE, IMAGE], leaf(1, 1), None)])
    with pytest.raises(ValueError, match="sample 0: received 'image_embeds' but its tokens have no image"):
        llm_run(stage, [([BOS, 1], leaf(1, 1), None)])
    with pytest.raises(ValueError, match=r"sample 0: 'audio_embeds' must be \[n, 32\]"):
        llm_run(stage, [([AUDIO, 1], None, randn(2, 16))])
    with pytest.raises(ValueError, match="receives no 'image_embeds' input"):
        stage.forward(batch(tokens=[[BOS, IMAGE, 1]]))
    with pytest.raises(ValueError, match="unknown config key"):
        MultimodalLM({"vocab": 3}, CTX)
    # Found in review: with no image placeholder id the received rows were dropped unseen.
    text_only = make(MultimodalLM, LLM, StageContext(section="x", dtype="float64", placeholder_ids={"audio": AUDIO}))
    with pytest.raises(ValueError, match="sample 0: received 'image_embeds' .* gives no 'image' placeholder id"):
        llm_run(text_only, [([BOS, IMAGE - 200, 1], leaf(1, 1), None)])
    llm_run(text_only, [([BOS, 1, 2], None, None)])  # nothing received: nothing to drop
    assert MultimodalLM.outputs({}) == ("loss", "loss_denominator")


def test_block_key_padding_mask_hides_pads():
    """transformer.Block's key_padding_mask: unchanged causal results; bidirectional = unpadded."""
    cfg = LMConfig(d_model=32, n_heads=4)
    x = randn(2, 5, 32)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    causal = Block(cfg).double()
    close(causal(x, mask)[0], causal(x)[0])
    close(causal(x, mask)[1, :3], causal(x)[1, :3])
    bidirectional = Block(cfg, causal=False).double()
    close(bidirectional(x, mask)[1, :3], bidirectional(x[1:, :3])[0])
    assert not torch.allclose(bidirectional(x)[1, :3], bidirectional(x[1:, :3])[0])


def test_vision_takes_precomputed_pixels_from_the_modality_column():
    """data.modality_columns={"image": "pixel_values"}: no decoder, no encoded bytes."""
    ctx = StageContext(section="vision", dtype="float64", modality_columns={"image": "pixel_values"})
    stage = VisionEncoder({**VISION, "decoder": None}, ctx)
    pixels = [torch.rand(3, 8, 16, dtype=torch.float64), None, torch.rand(3, 16, 8, dtype=torch.float64)]
    as_lists = [None if p is None else p.tolist() for p in pixels]
    image, text = frozenset({"text", "image"}), frozenset({"text"})
    mods = [image, text, image]
    out = stage.forward(MicroBatch(step=0, index=0, sample_ids=[1, 2, 3], modalities=mods,
                                   columns={"pixel_values": as_lists}))["image_embeds"]
    expected = stage.forward(MicroBatch(step=0, index=0, sample_ids=[1, 2, 3], modalities=mods,
                                        columns={}, inputs={"pixels": pixels}))["image_embeds"]
    assert out[1] is None and out[0].shape == out[2].shape == (2, 32)  # 1x2 and 2x1 patch grids, d_model 32
    assert torch.equal(out[0], expected[0]) and torch.equal(out[2], expected[2])


@pytest.mark.parametrize("value", [[[[0.5, 0.5], [0.5]]], "pixels"], ids=["ragged", "text"])
def test_precomputed_pixels_that_are_no_array_name_their_sample(value):
    """Found in review: a ragged list or a string failed with torch's own message, naming no sample."""
    ctx = StageContext(section="vision", dtype="float64", modality_columns={"image": "pixel_values"})
    stage = VisionEncoder({**VISION, "decoder": None}, ctx)
    with pytest.raises(ValueError, match=r"^sample 4: the image column's value is not a \[3, H, W\] array"):
        stage.forward(MicroBatch(step=0, index=0, sample_ids=[4], modalities=[frozenset({"text", "image"})],
                                 columns={"pixel_values": [value]}))


def test_audio_comes_from_the_modality_column():
    """Found in review: data.modality_columns={"audio": "wave"} was ignored (the encoder read the
    "audio" column, which validate --payloads did not check, or failed without one)."""
    stage = make(AudioEncoder, AUDIO_CFG, StageContext(section="x", dtype="float64", modality_columns={"audio": "wave"}))
    columns = {"wave": [c for c, _ in CLIPS[:2]], "sample_rate": [r for _, r in CLIPS[:2]]}
    got = stage.forward(batch(columns=columns))["audio_embeds"]
    want = encode_audio(make(AudioEncoder, AUDIO_CFG), CLIPS[:2])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="AudioEncoder needs the 'wave' column"):
        stage.forward(batch(columns={"audio": columns["wave"], "sample_rate": columns["sample_rate"]}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_audio_in_a_half_precision_pipeline(dtype):
    """A bf16 or fp16 pipeline's audio encoder computes its log-mel features in float32 (torch.fft
    has no half kernels on CPU: a RuntimeError in forward before) and hands them on in its dtype."""
    stage = AudioEncoder(AUDIO_CFG, CTX)
    for module in stage.modules().values():
        module.to(dtype)
    full = make(AudioEncoder, AUDIO_CFG)
    [got] = encode_audio(stage, CLIPS[:1])
    [want] = encode_audio(full, CLIPS[:1])
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 0.1  # the same features, to half precision
