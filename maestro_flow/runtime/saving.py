"""Writing a trainable section's parameters as `<save_dir>/<section>.safetensors`.

Runs in the process that holds replica 0 of the section (DP replicas hold identical parameters
after every step, so replica 0's copy is the gathered one).
"""

from __future__ import annotations

import os

from safetensors.torch import save_file


def save_stage(stage, save_dir: str, section: str) -> str:
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, f"{section}.safetensors")
    # clone: tied weights share storage, which safetensors refuses to write twice.
    state = {k: v.detach().cpu().clone().contiguous() for k, v in stage.state_dict().items()}
    tmp = path + ".tmp"
    save_file(state, tmp, metadata={"section": section})
    os.replace(tmp, path)
    return path
