"""Where a stage's weights come from: seeded initialisation and safetensors checkpoints.

Owns two rules that let a module be rebuilt *piecewise* in another section with identical values
(the KD student rebuilds only the teacher's LM head):
- with a seed, every parameter is drawn from its own generator, seeded by (seed, full parameter
  name), so a parameter's value depends on its name alone, not on what else was built before it;
- a checkpoint is read key by key, so one part of a model can be loaded without the rest.
Knows nothing of stages or sections.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

# GPT-2's initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers).
INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.fc_out.weight")
# `maestro run --save-dir` writes a stage's state_dict, whose keys carry the module's attribute name.
SAVED_STAGE_PREFIX = "model."


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator seeded from (seed, name) by a stable hash (not Python's salted `hash`)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return generator


@torch.no_grad()
def init_weights(module: nn.Module, *, seed: int | None, n_layers: int, prefix: str = "") -> None:
    """GPT-2 style initialisation of every parameter of `module`, named `prefix + name`.

    With `seed=None` the global RNG is used (the runtime seeds it with ctx.seed).
    """
    for module_name, sub in module.named_modules():
        for param_name, param in sub.named_parameters(recurse=False):
            full_name = prefix + (f"{module_name}." if module_name else "") + param_name
            if isinstance(sub, nn.LayerNorm):
                param.fill_(1.0 if param_name == "weight" else 0.0)
            elif param_name == "bias":
                param.zero_()
            else:
                std = INIT_STD / math.sqrt(2 * n_layers) if full_name.endswith(RESIDUAL_PROJECTIONS) else INIT_STD
                generator = None if seed is None else parameter_generator(seed, full_name)
                param.normal_(0.0, std, generator=generator)


def check_checkpoint_file(path: Any, key: str) -> None:
    """Refuse (ValueError naming config key `key`) a checkpoint that names no file, for
    Stage.check_config: found in QA, `maestro run` met it in the workers, with a traceback."""
    if path is not None and not (isinstance(path, str) and os.path.isfile(path)):
        raise ValueError(f"{key}: no such file {path!r} (a .safetensors file)")


def read_checkpoint(path: str, keys: Iterable[str], *, prefix: str = "",
                    optional: Iterable[str] = (), meta: bool = False) -> dict[str, Tensor]:
    """The tensors for `keys` from a .safetensors file, keyed without `prefix`. `meta`: their
    shapes and dtypes only, on the meta device, from the file's header (`maestro validate` builds
    stages there: a checkpoint of many GB is checked without being read).

    The file's keys are `prefix + key`, or `"model." + prefix + key` as in a stage's saved
    state_dict. Keys in `optional` may be absent (e.g. tied weights saved once).
    """
    from safetensors import safe_open

    check_checkpoint_file(path, "checkpoint")
    keys, optional = list(keys), set(optional)
    with safe_open(path, framework="pt") as f:
        stored = set(f.keys())
        required = [k for k in keys if k not in optional]
        for lead in (prefix, SAVED_STAGE_PREFIX + prefix):
            if all(lead + k in stored for k in required):
                if meta:
                    return {k: _meta_tensor(f.get_slice(lead + k)) for k in keys if lead + k in stored}
                return {k: f.get_tensor(lead + k) for k in keys if lead + k in stored}
    missing = [prefix + k for k in required if prefix + k not in stored]
    raise ValueError(f"checkpoint {path!r} lacks {len(missing)} weights, e.g. {missing[:3]}")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _meta_tensor(view: Any) -> Tensor:
    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype(), torch.float32)
    return torch.empty(view.get_shape(), dtype=dtype, device="meta")


def on_meta(module: nn.Module) -> bool:
    """Whether `module` is being built on the meta device (shapes only: `maestro validate`)."""
    return any(t.is_meta for t in module.state_dict().values())


def load_weights(module: nn.Module, path: str, *, prefix: str = "") -> None:
    """Load every entry of `module.state_dict()` from the checkpoint (see `read_checkpoint`).

    Tensors keep the checkpoint's dtype (`assign=True`), so a float64 checkpoint stays exact when
    the runtime later casts the module to ctx.dtype. On the meta device only the file's header is
    read (the keys and shapes are checked all the same).
    """
    state = read_checkpoint(path, module.state_dict().keys(), prefix=prefix, meta=on_meta(module))
    module.load_state_dict(state, assign=True)
