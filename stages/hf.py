"""`HFCausalLM`: the causal-LM roles around a Hugging Face `transformers` model.

Owns the stage and `build_hf_lm_head`, which rebuilds such a model's LM head for a KD student in
another section (with what the checks need of heads: their width, their equality). Building the
model from a config is stages/hf_model.py's. The KD loss is the one in distill.py; padding and loss
sums are in common.py. Knows nothing of grad modes or normalisation.

Config keys: `model_type` (default "gpt2"), `hf_config` (kwargs of the transformers config; for
gpt2 small dropout-free defaults apply), `attn_implementation` (passed to transformers as given,
e.g. "eager", "sdpa"; default: transformers' own choice; may also sit inside `hf_config`),
`init_seed`, `checkpoint` (keys as in the model's state_dict), `role`: "teacher" (outputs
"hidden": per-sample final hidden states, after gpt2's ln_f), "lm" (outputs "loss" sum of
next-token CE and "loss_denominator"), or "kd_student" (input "hidden"; keys `teacher`,
`temperature`, `alpha` as in KDStudent).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from maestro_flow import MicroBatch, Stage, StageContext
from maestro_flow.parallel.tp import LAYER
from stages.common import (
    Outputs,
    ce_sum,
    check_keys,
    loss_outputs,
    module_device,
    next_token_targets,
    pad_tokens,
    select_predicted,
    unpad,
)
from stages.distill import (
    KD_KEYS,
    KDConfig,
    build_teacher_head,
    check_teacher_sender,
    distillation_outputs,
    same_vocab,
    teacher_head_shape,
    teacher_input_widths,
)
from stages.hf_model import attention_refused, build_hf_model, hf_model_config, is_small, probe_copy, probing
from stages.lm import stage_role
from stages.weights import check_checkpoint_file, on_meta

LOSS = ("loss", "loss_denominator")
ROLES = {"teacher": ("hidden",), "lm": LOSS, "kd_student": LOSS}
MODEL_KEYS = ("model_type", "hf_config", "attn_implementation", "init_seed", "checkpoint")
# transformers' tp-plan styles maestro_flow applies, as its own (parallel/tp.py). Not the others:
# e.g. "replicated_with_grad_allreduce" (qwen3's q_norm) needs its gradients summed over the tp
# ranks, which each see different heads, and the MoE styles shard experts.
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise_rep",
             "colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_split",
             "embedding_rowwise": "rowwise"}


_META: dict[str, nn.Module] = {}  # a transformers config (as JSON) -> its model on the meta device


def _meta_model(hf_config: Any) -> nn.Module:
    """The model `hf_config` describes, on the meta device (shapes only), built once per config:
    tp_plan and the tp check both read it."""
    key = hf_config.to_json_string()
    if key not in _META:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            _META[key] = AutoModelForCausalLM.from_config(hf_config)
    return _META[key]


def _whole_per_head(hf_config: Any) -> str | None:
    """A parameter (by name, layers as `*`, and shape) holding one row per attention head (heads x
    head_dim: cohere's qk norm) that transformers' tp plan does not shard, or None. Each tp rank
    holds some of the heads, so such a weight no longer fits them."""
    heads = {getattr(hf_config, k, None) for k in ("num_attention_heads", "num_key_value_heads")} - {None}
    if not heads:
        return None
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    for name, module in _meta_model(hf_config).named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            continue  # what the plan shards, or leaves whole as a whole layer
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() == 2 and p.shape[0] in heads and p.shape[0] > 1 and p.shape[1] == head_dim:
                return f"{LAYER.sub('*', f'{name}.{pname}')} {tuple(p.shape)}"
    return None


class SoftcappedHead(nn.Linear):
    """An LM head whose logits are soft-capped, cap * tanh(logits / cap), as gemma2's model
    does after its lm_head (`final_logit_softcapping`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, cap: float) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.cap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(super().forward(x) / self.cap) * self.cap


def hf_head_config(config: dict[str, Any], *, where: str = "") -> Any:
    """The transformers config of an HFCausalLM whose LM head another section rebuilds: it must
    fix the weights (`init_seed` or `checkpoint`)."""
    if config.get("init_seed") is None and config.get("checkpoint") is None:
        raise ValueError(
            f"{where}init_seed or {where}checkpoint must be set so that the LM head can be rebuilt "
            "in another section with the same weights"
        )
    return hf_model_config(config, where=where)[0]


_HEAD_WIDTHS: dict[str, int] = {}  # a transformers config (as JSON) and attention -> what its LM head reads


def meta_head_width(hf_config: Any, attn: str | None = None, where: str = "") -> int:
    """The width its LM head reads, of the model `hf_config` describes, built on the meta device
    (shapes only: about a second for billions of parameters), once per config; what transformers
    refuses while building it (a width its heads do not divide, a model type that is no causal
    LM, an unknown attention implementation: found in QA, met in the workers) is a ValueError
    naming the config."""
    key = f"{hf_config.to_json_string()}/{attn}"
    if key not in _HEAD_WIDTHS:
        from transformers import AutoModelForCausalLM

        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(hf_config, **({} if attn is None else {
                    "attn_implementation": attn}))
        except Exception as exc:  # anything transformers raises for a config is the config's
            refused = attention_refused(exc, attn, where)
            if refused is not None:
                raise refused from None
            first = (str(exc).strip().splitlines() or [""])[0]  # (t5's lists every causal LM config class)
            raise ValueError(f"{where}model_type/{where}hf_config: {type(exc).__name__}: {first}") from exc
        head = model.get_output_embeddings()
        _HEAD_WIDTHS[key] = head.in_features if head is not None else hf_config.hidden_size
    return _HEAD_WIDTHS[key]


def hidden_width(hf_config: Any, where: str = "") -> tuple[int, str]:
    """The width of the hidden states the model's LM head reads (what a teacher sends), with the
    hf_config key that sets it (gpt2's n_embd, most models' hidden_size; OPT's
    word_embed_proj_dim where it differs from hidden_size: found in review). `where` prefixes
    the keys of a refusal (a student's copy of its teacher's config: "teacher.")."""
    width = meta_head_width(hf_config, where=where)
    if getattr(hf_config, "hidden_size", None) == width:
        return width, "hf_config." + getattr(hf_config, "attribute_map", {}).get("hidden_size", "hidden_size")
    named = [k for k, v in hf_config.to_dict().items() if v == width and not k.startswith("_") and k.endswith(
        ("_dim", "_size"))]
    # The key that sizes the hidden states, before one that merely holds the same number (found
    # in QA: OPT's ffn_dim was named for its word_embed_proj_dim).
    named.sort(key=lambda k: not any(part in k for part in ("proj", "embed", "hidden", "model")))
    return width, "hf_config." + (named[0] if named else "hidden_size")


def same_lm_head(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
    """Whether two configs give the same LM head (build_hf_lm_head: weights, bias, soft cap),
    built on the CPU; None where either model has over PROBE_MAX_PARAMS parameters (not built).
    For fields whose effect on the head only a build tells (an epsilon, an activation, the rope
    base: found in QA, refused as if they changed it)."""
    from transformers import AutoModelForCausalLM

    # Without an attention implementation the head does not depend on (flash attention may not
    # be there to build with); the global RNG as it was (a new head's own init draws from it:
    # found in review).
    a, b = ({**c, "attn_implementation": None, "hf_config": {k: v for k, v in c.get("hf_config", {}).items()
                                                            if k != "attn_implementation"}} for c in (a, b))
    for config in (a, b):
        with torch.device("meta"):
            if not is_small(AutoModelForCausalLM.from_config(hf_model_config(config)[0])):
                return None
    with torch.device("cpu"), torch.random.fork_rng(devices=[]):
        head_a, head_b = build_hf_lm_head(a, where="teacher."), build_hf_lm_head(b, where="teacher.")
    return (type(head_a) is type(head_b) and getattr(head_a, "cap", None) == getattr(head_b, "cap", None)
            and torch.equal(head_a.weight, head_b.weight)
            and (head_a.bias is None) == (head_b.bias is None)
            and (head_a.bias is None or torch.equal(head_a.bias, head_b.bias)))


def build_hf_lm_head(config: dict[str, Any], *, where: str = "") -> nn.Linear:
    """Exactly what an HFCausalLM with this config computes from its last hidden states to its
    logits, as a standalone nn.Linear: its LM head, soft-capped where the model caps its logits.

    Builds the whole model to get it (transformers initialises from one RNG stream), which is
    fine for the sizes used here; a very large teacher should be given as a checkpoint. Checks
    on a few tokens that the head gives the model's own logits: a model that processes them
    otherwise after its head is refused, naming the model type.
    """
    hf_head_config(config, where=where)
    model = build_hf_model(config, where=where, quiet=True)
    out = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        head: nn.Linear = SoftcappedHead(out.in_features, out.out_features, out.bias is not None, float(cap))
    else:
        head = nn.Linear(out.in_features, out.out_features, bias=out.bias is not None)
    head = head.to(out.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(out.weight)
        if out.bias is not None:
            head.bias.copy_(out.bias)
    if not on_meta(model):
        _check_head(model, head, where)
    elif is_small(model):
        probe_copy(config, where, build_hf_lm_head)
    return head


def _check_head(model: nn.Module, head: nn.Linear, where: str) -> None:
    with probing(model):
        ids = torch.arange(min(4, head.out_features), device=module_device(model)).unsqueeze(0)
        hidden = model.base_model(input_ids=ids).last_hidden_state
        want = model(input_ids=ids).logits
    if not torch.allclose(head(hidden), want, rtol=1e-4, atol=1e-5):
        raise ValueError(f"{where}model_type ({model.config.model_type!r}): the model changes its logits after "
                         "its LM head in a way a KD student's copy of the head does not reproduce; use it as a "
                         "teacher through a stage of your own")


class HFCausalLM(Stage):
    """A transformers causal LM as a teacher, a trainable LM or a KD student (config `role`)."""

    hugging_face_model = "model"  # `maestro export` writes this attribute with save_pretrained

    def __init__(self, config: dict[str, Any], ctx: StageContext) -> None:
        super().__init__(config, ctx)
        self.role = self._check_keys(config)
        self.model = build_hf_model(config, quiet=ctx.replica != 0)
        if self.role == "teacher":  # see forward
            head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
            self._whole = head is not None and embedding is not None and head.weight is embedding.weight
            self._hidden: Any = None
            if self._whole:
                self.model.base_model.register_forward_hook(self._keep_hidden)
                self._one_logit = "logits_to_keep" in inspect.signature(type(self.model).forward).parameters
        if self.role == "kd_student":
            self.kd = KDConfig.from_dict(config)
            self.teacher_head = build_teacher_head(config["teacher"])
            vocab = self.model.get_output_embeddings().out_features
            same_vocab(self.teacher_head.out_features, vocab, "hf_config.vocab_size")

    @staticmethod
    def _check_keys(config: dict[str, Any]) -> str:
        role = stage_role(config, ROLES)
        check_keys(config, ("role", *MODEL_KEYS, *(("teacher", *KD_KEYS) if role == "kd_student" else ())))
        return role

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> None:
        """What __init__ checks before it loads any weights: the role, the keys, the transformers
        config, the model built from it on the meta device, the checkpoint file and, for a KD
        student, the KD keys and the teacher's vocabulary. The checks that need values (a causal
        model, a head that gives the model's logits) run where the model is built with them:
        `validate`, and the workers."""
        role = cls._check_keys(config)
        hf_config, attn = hf_model_config(config)
        meta_head_width(hf_config, attn)
        check_checkpoint_file(config.get("checkpoint"), "checkpoint")
        if role == "kd_student":
            KDConfig.from_dict(config)
            same_vocab(teacher_head_shape(config["teacher"]).vocab, hf_config.vocab_size, "hf_config.vocab_size")

    def _keep_hidden(self, module: Any, args: Any, out: Any) -> None:
        self._hidden = out[0]  # last_hidden_state, whether a ModelOutput or a tuple

    @classmethod
    def outputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ROLES[stage_role(config, ROLES)]

    @classmethod
    def inputs(cls, config: dict[str, Any]) -> tuple[str, ...]:
        return ("hidden",) if stage_role(config, ROLES) == "kd_student" else ()

    @classmethod
    def output_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return {"hidden": hidden_width(hf_model_config(config)[0])}

    @classmethod
    def input_widths(cls, config: dict[str, Any]) -> dict[str, tuple[int, str]]:
        return teacher_input_widths(config) if stage_role(config, ROLES) == "kd_student" else {}

    @classmethod
    def check_senders(cls, config: dict[str, Any], senders: dict[str, Any]) -> None:
        if stage_role(config, ROLES) == "kd_student":
            check_teacher_sender(config, senders)

    @classmethod
    def token_limits(cls, config: dict[str, Any]) -> dict[str, int]:
        hf_config, _ = hf_model_config(config)
        limits = {"vocab_size": hf_config.vocab_size}
        positions = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
        if positions:
            limits["max_tokens"] = positions
        return limits

    @classmethod
    def tp_plan(cls, config: dict[str, Any]) -> dict[str, str] | None:
        """The model's own tp plan, as transformers ships it (`base_model_tp_plan` of its config,
        e.g. llama's q/k/v/gate/up colwise, o/down rowwise), under this stage's `model.<base>.`."""
        hf_config, _ = hf_model_config(config)
        plan = getattr(hf_config, "base_model_tp_plan", None)
        if not plan:
            return None
        base = _meta_model(hf_config).base_model_prefix
        return {f"model.{base}.{name}": HF_STYLES.get(style, style) for name, style in plan.items()}

    @classmethod
    def check_tp(cls, config: dict[str, Any], tp: int) -> None:
        hf_config, _ = hf_model_config(config)
        plan = getattr(hf_config, "base_model_tp_plan", None)
        if not plan:
            raise ValueError(f"model_type ({hf_config.model_type!r}): transformers ships no tensor-parallel plan "
                             f"(base_model_tp_plan) for {type(hf_config).__name__}; use tp=1 or another model type")
        other = sorted({style for style in plan.values() if style not in HF_STYLES})
        if other:  # found in QA: every module of those styles was listed as a problem of the plan
            raise ValueError(f"model_type ({hf_config.model_type!r}): transformers' tensor-parallel plan for "
                             f"{type(hf_config).__name__} uses {', '.join(other)}, which maestro_flow does not apply "
                             f"(it applies {', '.join(HF_STYLES)}); use tp=1, or a model type whose plan it applies "
                             "(e.g. llama, mistral, qwen2, gemma2, starcoder2, phi3, olmo2, gpt_neox)")
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(hf_config, key, None)
            if value is not None and value % tp:
                raise ValueError(f"hf_config.{key} ({value}) is not divisible by tp={tp}: each rank takes whole heads")
        whole = _whole_per_head(hf_config)
        if whole is not None:  # found in QA: cohere's use_qk_norm passed validate and failed in the first forward
            cause = next((f"hf_config.{k}" for k, v in config.get("hf_config", {}).items() if v is True and
                          _whole_per_head(hf_model_config({**config, "hf_config": {**config["hf_config"], k: False}})[0])
                          is None), "hf_config")
            raise ValueError(f"{cause}: {whole} holds one row per attention head, and transformers' tensor-parallel "
                             f"plan for {type(hf_config).__name__} leaves it whole while it splits the heads over the "
                             f"tp ranks; use tp=1{' or turn it off' if cause != 'hf_config' else ''}")

    def forward(self, batch: MicroBatch) -> Outputs:
        tokens = batch.columns["tokens"]
        device = module_device(self.model)
        # Right padding under causal attention: no real position sees a pad, so no padding mask
        # is passed. One would change nothing for real positions, but where a sliding window
        # leaves a pad row no visible key, transformers' eager attention in float64 turns that row
        # into NaN, which then reaches real positions through 0 * NaN in the backward.
        ids, lengths = pad_tokens(tokens, device)
        if self.role == "teacher":
            # The base model's last hidden state is what the LM head reads (gpt2: after ln_f). With
            # the LM head tied to the input embedding, the whole model runs (logits for one
            # position only) and a hook keeps that state: found in QA, the base model alone did
            # not run the model's own forward, which is what gathers the FSDP unit holding a tied
            # weight (the model itself) on a sharded teacher. Untied, the base model alone runs
            # (the head would be one more unit to gather per micro-batch: found in review).
            hidden = None
            if self._whole:
                self.model(input_ids=ids, use_cache=False, **({"logits_to_keep": 1} if self._one_logit else {}))
                hidden, self._hidden = self._hidden, None
                # A model whose forward skips its base model's (OPT's calls the decoder inside
                # it: found in review) leaves none: the base model alone from then on.
                self._whole = hidden is not None
            if hidden is None:
                hidden = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            return {"hidden": unpad(hidden, lengths)}
        # The full model (not base model + head) so that model-specific logit processing applies.
        logits = select_predicted(self.model(input_ids=ids, use_cache=False).logits, lengths)
        if self.role == "kd_student":
            return distillation_outputs(logits, batch, self.teacher_head, self.kd)
        targets = next_token_targets(tokens, device)
        return loss_outputs(ce_sum(logits, targets), targets.numel())
