"""Building a Hugging Face `transformers` causal LM from a stage config alone (no download:
`AutoConfig.for_model` then `AutoModelForCausalLM.from_config`), seeded or from a safetensors
checkpoint, with the build-time checks (a causal model) and the note on sizes left to defaults.
Used by stages/hf.py's stage and LM-head rebuild; knows nothing of roles or sections.

A model size the config leaves out is never taken silently: building the model prints which size
fields came from defaults (ours for gpt2, transformers' otherwise — for most model types those
are the full published size, e.g. llama's 4096 x 32 layers) and the resulting parameter count.
Nor is a key transformers keeps unread (extra_fields): one close to a field the config leaves
unset is refused as a typo (gpt2's `n_layers`), any other announced.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import json
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from stages.common import module_device
from stages.weights import on_meta, read_checkpoint

# Config fields that size a model (canonical names; gpt2's n_embd etc. map to them).
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "n_inner", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")
# Small, dropout-free gpt2 (gpt2's own defaults are 124M parameters with dropout 0.1, and its
# bos/eos ids 50256 would lie outside a small vocabulary).
GPT2_DEFAULTS: dict[str, Any] = {
    "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 260, "n_positions": 256,
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None,
}


def build_hf_model(config: dict[str, Any], *, where: str = "", quiet: bool = False) -> nn.Module:
    """The transformers causal LM a config describes, with its weights. Unless `quiet`, says
    first (on stdout: the worker's log) which size fields came from defaults (describe_size)."""
    from transformers import AutoModelForCausalLM

    hf_config, attn = hf_model_config(config, where=where)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    for note in (describe_size(config, hf_config, where), describe_extra(config, hf_config, where)):
        if note is not None and not quiet:
            print(note, flush=True)
    seed = config.get("init_seed")
    try:
        if seed is None:
            model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
        else:
            # transformers initialises from the global RNG: fork it so the seed fixes the weights
            # without disturbing the runtime's RNG stream.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(hf_config, **kwargs)
    except ValueError as exc:
        refused = attention_refused(exc, attn, where)
        if refused is None:
            raise
        raise refused from None
    if config.get("checkpoint") is not None:
        load_hf_checkpoint(model, config["checkpoint"])
    if not on_meta(model):
        _check_causal(model, hf_config.model_type, where)
    elif is_small(model):
        probe_copy(config, where, functools.partial(build_hf_model, quiet=True))  # on the CPU: checked there
    return model


def attention_refused(exc: Exception, attn: str | None, where: str) -> ValueError | None:
    """transformers' refusal of the attention implementation asked for, in one line naming the
    field (found in QA: gemma2's sdpa refusal went on with a request link and a whisper example),
    or None for any other error."""
    if attn is None or "attention implementation" not in str(exc):
        return None
    return ValueError(f"{where}attn_implementation={attn!r}: {str(exc).split('. ')[0]} (transformers); set "
                      f"{where}attn_implementation to 'eager', or another the model supports")


# On the meta device (`maestro validate`) a model has no values to probe. One of at most this
# many parameters is built again on the CPU (random weights: what the checks test is the
# architecture, not the weights), so the build-time checks refuse it before any worker starts;
# a larger one is checked by its workers as they build it.
PROBE_MAX_PARAMS = 50_000_000


def is_small(model: nn.Module) -> bool:
    return sum(p.numel() for p in model.parameters()) <= PROBE_MAX_PARAMS


def probe_copy(config: dict[str, Any], where: str, build: Any) -> None:
    """`build` (building a model or its LM head) again on the CPU, seeded, without the checkpoint:
    its build-time checks run. The RNG streams are left as they were."""
    with torch.device("cpu"), torch.random.fork_rng(devices=[]):
        build({**config, "checkpoint": None, "init_seed": config.get("init_seed") or 0}, where=where)


@contextlib.contextmanager
def probing(model: nn.Module) -> Iterator[None]:
    """A build-time check's forwards: dropout off (the same forward both ways), no autograd; the
    model's train/eval mode as it was afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _check_causal(model: nn.Module, model_type: str, where: str) -> None:
    """Refuse a model whose earlier positions see later tokens (a bidirectional encoder built as
    a causal LM, e.g. xlnet, or xlm without `causal`): its next-token loss would see the tokens it
    predicts. Two forwards of four tokens differing in the last one, dropout off: a causal model
    gives the same first positions, to rounding (a mixture of experts groups tokens per expert:
    ~1e-7 in float32; a bidirectional model moves them by ~5e-3). In bf16/fp16 only leaks well
    above that precision's rounding are caught."""
    t = max(0, model.get_input_embeddings().num_embeddings // 2 - 4)  # ordinary tokens, not pad or specials
    with probing(model):
        a, b = (model.base_model(input_ids=torch.tensor([[t, t + 1, t + 2, last]], device=module_device(model)))
                .last_hidden_state[0, :3] for last in (t + 3, t + 4))
    tol = 2e-2 if a.dtype in (torch.bfloat16, torch.float16) else 1e-4
    if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * max(1.0, float(a.abs().max()))):
        raise ValueError(f"{where}model_type ({model_type!r}): the model's earlier positions see later tokens "
                         "(bidirectional attention), so a next-token loss would see what it predicts; use a "
                         "causal model type, or the config field that makes this one causal")


def hf_model_config(config: dict[str, Any], *, where: str = "") -> tuple[Any, str | None]:
    """The transformers config a stage config describes, and the attention implementation asked for."""
    from transformers import AutoConfig

    model_type = config.get("model_type", "gpt2")
    if not isinstance(config.get("hf_config", {}), dict):
        raise ValueError(f"{where}hf_config must be a mapping of transformers config fields (e.g. "
                         f"{{'n_layer': 2}}), got {config['hf_config']!r}; the model is named by {where}model_type")
    user, kwargs = _given(config)
    attn = config.get("attn_implementation", config.get("hf_config", {}).get("attn_implementation"))
    try:
        hf_config = AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # (huggingface_hub's validation errors are neither: found in review)
        raise ValueError(f"{where}model_type/{where}hf_config: {exc}") from exc
    _refuse_typos(model_type, kwargs, user, hf_config, where)
    pad, vocab = getattr(hf_config, "pad_token_id", None), getattr(hf_config, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not 0 <= pad < vocab:  # found in QA: an assertion deep down
        given = "as given" if "pad_token_id" in user else f"transformers' default for {model_type}"
        raise ValueError(f"{where}hf_config.pad_token_id ({pad}, {given}) is outside the vocabulary (vocab_size "
                         f"{vocab}): set {where}hf_config.pad_token_id to a token id below {vocab}, or None")
    if hasattr(hf_config, "is_decoder") and "is_decoder" not in user:
        # An encoder family (bert, roberta, ...) is a causal LM only as a decoder: else its
        # attention is bidirectional and the next-token loss sees the tokens it predicts
        # (build_hf_model checks every model for that).
        hf_config.is_decoder = True
    return hf_config, attn


# Keys of transformers 4's PretrainedConfig that config.json files still carry (generation and
# task settings, seq2seq ties; gpt2's n_ctx, in its published config.json): kept unread by a
# causal LM, never a misspelt field, so neither refused nor announced.
LEGACY = ("sep_token_id", "decoder_start_token_id", "tie_encoder_decoder", "cross_attention_hidden_size",
          "finetuning_task", "id2label", "label2id", "task_specific_params", "tokenizer_class", "prefix",
          "architectures", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
          "temperature", "top_k", "top_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
          "bad_words_ids", "num_return_sequences", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "n_ctx")
# Other trainers' names (Megatron, torchtitan, GPT-NeoX, nanoGPT), and gpt2's own in transformers (left
# over when a config's model_type changes), for transformers' size fields, too far for a spelling match
# (found in QA: llama's `num_layers` built the default 32 layers; its `n_embd` too). Each names the fields
# it may mean, the first the config has; torchtitan's `hidden_dim` (the MLP's) is left out as ambiguous.
ELSEWHERE = {"num_layers": ("num_hidden_layers", "n_layer", "n_layers"), "n_layers": ("num_hidden_layers", "n_layer"),
             "n_heads": ("num_attention_heads", "n_head"), "num_heads": ("num_attention_heads", "n_head"),
             "n_kv_heads": ("num_key_value_heads",), "num_kv_heads": ("num_key_value_heads",),
             "num_query_groups": ("num_key_value_heads",), "dim": ("hidden_size", "n_embd"),
             "d_model": ("hidden_size", "n_embd"), "ffn_hidden_size": ("intermediate_size", "n_inner"),
             "max_seq_len": ("max_position_embeddings", "n_positions"),
             "seq_length": ("max_position_embeddings", "n_positions"),
             "norm_eps": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
             "n_embd": ("hidden_size", "d_model"), "n_layer": ("num_hidden_layers", "num_layers", "n_layers"),
             "n_head": ("num_attention_heads", "num_heads"), "n_inner": ("intermediate_size", "ffn_dim"),
             "n_positions": ("max_position_embeddings",), "num_attn_heads": ("num_attention_heads", "n_head"),
             "n_kv_head": ("num_key_value_heads",)}
NOT_NAMES = ("self", "args", "kwargs")
_EXTRA: dict[tuple[str, str], list[str]] = {}  # extra_fields' answers


def _fields(hf_config: Any) -> set[str]:
    """The public fields of a built transformers config: its values, aliases and init arguments."""
    known = set(hf_config.to_dict()) | set(getattr(hf_config, "attribute_map", {})) | _init_args(type(hf_config))
    return {k for k in known if not k.startswith("_")}


@functools.cache
def _init_args(config_class: type) -> frozenset[str]:
    """The argument names of every __init__ along a config class's MRO (but self, args, kwargs)."""
    return frozenset(name for cls in config_class.__mro__ if "__init__" in vars(cls)
                     for name in inspect.signature(cls.__init__).parameters if name not in NOT_NAMES)


def extra_fields(model_type: str, kwargs: dict[str, Any], hf_config: Any) -> list[str]:
    """Keys of `kwargs` (what `hf_config` was built from) that transformers kept as they are and
    did nothing else with: not an init argument or alias of the config class, no field with a
    default (the config built without the key lacks it), and the config built without it is the
    same but for the key (a key converted into others, llama's `rope_theta` into
    `rope_parameters` or gemma3's `sliding_window_pattern` into `layer_types`, changes them:
    found in review). A model reads such a key only if its code looks it up (qwen2's `head_dim`
    does), so a misspelt field (`n_layers`) ends here too."""
    from transformers import AutoConfig

    # The answer follows from model_type and kwargs (hf_config is built from them; is_decoder, set
    # after the build, is left out below). Asked twice per build: the typo check and the note.
    key_of = (model_type, json.dumps(kwargs, sort_keys=True, default=str))
    if key_of in _EXTRA:
        return _EXTRA[key_of]
    kept = hf_config.to_dict()
    out = []
    for key in kwargs:
        if key not in kept or key in getattr(hf_config, "attribute_map", {}) or key in _init_args(type(hf_config)):
            continue
        try:  # (a config that refuses to be built without the key: the key is not idle)
            without = AutoConfig.for_model(model_type, **{k: v for k, v in kwargs.items() if k != key}).to_dict()
        except Exception:
            continue
        rest = ("is_decoder", key)  # (is_decoder: hf_model_config sets it after the build)
        if key not in without and _drop(kept, rest) == _drop(without, rest):
            out.append(key)
    _EXTRA[key_of] = sorted(out)
    return _EXTRA[key_of]


def _drop(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


def _refuse_typos(model_type: str, kwargs: dict[str, Any], user: dict[str, Any], hf_config: Any, where: str) -> None:
    """Refuse an idle key (extra_fields) of the user's that is one letter or so from a field the
    user did not set (found in QA: gpt2 with `n_layers` built the default depth, in silence), or
    another trainer's name for one (ELSEWHERE)."""
    extra = [k for k in extra_fields(model_type, kwargs, hf_config) if k in user and k not in LEGACY]
    if not extra:
        return
    aliases = getattr(hf_config, "attribute_map", {})  # gpt2's num_hidden_layers is its n_layer
    fields = sorted(f for f in _fields(hf_config) - set(user) - set(extra) if aliases.get(f, f) not in user)
    for key in extra:
        near = difflib.get_close_matches(key, fields, n=1, cutoff=0.85) or [f for f in ELSEWHERE.get(key, ())
                                                                             if f in fields][:1]
        if near:
            try:  # a computed attribute may raise other than AttributeError (found in review: dots3's heads)
                value = f" is {getattr(hf_config, near[0])!r}"
            except Exception:
                value = " is left to transformers"
            raise ValueError(f"{where}hf_config.{key}: {type(hf_config).__name__} has no field {key!r}; did you mean "
                             f"{near[0]!r}? As given, {near[0]}{value} (not set in {where}hf_config) and {key} is "
                             "kept unread")


def _given(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stage config's hf_config keys (without attn_implementation, which goes to the model),
    and the keyword arguments the transformers config is built from (gpt2: our small defaults
    under them)."""
    user = {k: v for k, v in config.get("hf_config", {}).items() if k != "attn_implementation"}
    return user, {**(GPT2_DEFAULTS if config.get("model_type", "gpt2") == "gpt2" else {}), **user}


def describe_extra(config: dict[str, Any], hf_config: Any, where: str = "") -> str | None:
    """One line naming the user's idle keys (extra_fields) the model may not read, or None."""
    user, kwargs = _given(config)
    extra = [k for k in extra_fields(config.get("model_type", "gpt2"), kwargs, hf_config)
             if k in user and k not in LEGACY]  # (a transformers 4 key: no misspelling, found in review)
    if not extra:
        return None
    names, one = ", ".join(f"{where}hf_config.{k}" for k in extra), len(extra) == 1
    what, it = ("is not a field", "it") if one else ("are not fields", "them")
    return (f"stages.hf: {names} {what} of {type(hf_config).__name__}: transformers keeps {it} as "
            f"{'an attribute' if one else 'attributes'}, which the model uses only if its code reads {it} (check the "
            "spelling)")


def size_defaults(config: dict[str, Any], hf_config: Any) -> dict[str, Any]:
    """Size fields of `hf_config` that the stage config's `hf_config` did not set and that kept
    their default (fields derived from the ones set, like llama's head_dim, are not defaults):
    name -> value."""
    from transformers import AutoConfig

    bare = AutoConfig.for_model(hf_config.model_type, **(GPT2_DEFAULTS if hf_config.model_type == "gpt2" else {}))
    aliases = dict(getattr(hf_config, "attribute_map", {}))
    given = {aliases.get(k, k) for k in config.get("hf_config", {})} | set(config.get("hf_config", {}))
    out = {}
    for key in SIZE_KEYS:
        name = aliases.get(key, key)
        if key in given or name in given:
            continue
        value = getattr(hf_config, key, None)
        if value is not None and value == getattr(bare, key, None):
            out[name] = value
    return out


def describe_size(config: dict[str, Any], hf_config: Any, where: str = "") -> str | None:
    """One line naming the size fields taken from defaults and the parameter count they give (the
    model is built on the meta device for it: no memory, no time), or None when all were set."""
    from transformers import AutoModelForCausalLM

    defaults = size_defaults(config, hf_config)
    if not defaults:
        return None
    source = "maestro_flow's small gpt2 defaults" if hf_config.model_type == "gpt2" else "transformers' defaults"
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf_config).parameters())
    fields = ", ".join(f"{k}={v}" for k, v in defaults.items())
    size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count:,}"
    return (f"stages.hf: {where}hf_config leaves {fields} to {source} for model_type {hf_config.model_type!r}: "
            f"a model of {size} parameters (set them in {where}hf_config to choose the size)")


def load_hf_checkpoint(model: nn.Module, path: str) -> None:
    """Load a safetensors file into `model`; tied weights (gpt2's lm_head = wte) may be stored once."""
    expected = model.state_dict()
    groups: dict[int, list[str]] = {}
    for key, tensor in expected.items():
        groups.setdefault(tensor.data_ptr(), []).append(key)
    tied = {k for keys in groups.values() if len(keys) > 1 for k in keys}
    state = read_checkpoint(path, expected.keys(), optional=tied, meta=on_meta(model))
    for keys in groups.values():
        if not any(k in state for k in keys):
            raise ValueError(f"checkpoint {path!r} lacks {keys[0]!r}")
    # Copy (not assign) so that ties survive; take the checkpoint's precision first.
    model.to(next(iter(state.values())).dtype)
    model.load_state_dict(state, strict=False)
