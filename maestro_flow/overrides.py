"""`--set KEY=VALUE` overrides as strings: how every command that loads a pipeline reads them
into the dotted-key dict `Pipeline.override` applies (config.py checks the keys against
the records' fields), the one global batch a command may add to them, and the reverse:
nested mappings as dotted keys (`dotted`). Standard library only.
"""

from __future__ import annotations

import json
from typing import Any

from maestro_flow.errors import PipelineError


def set_key_problem(key: str) -> str:
    """Why `key` (stripped) cannot be a --set key, or "": one starting like a flag, or with a space
    in its field names, would otherwise be reported as an unknown field or "sections is not a
    mapping". A stage's config is the user's own dict: a key of it may hold a space."""
    if key.startswith("-"):
        return "its key starts like a flag other than --set"
    return "its key holds a space" if len(key.split(".config.", 1)[0].split()) > 1 else ""


def parse_set(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Parse `key.path=value` strings; values parse as JSON when they can, else stay strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        why = set_key_problem(key.strip())
        if not eq or not key.strip() or why:  # found in review: "=3" said "unknown pipeline field ''"
            raise PipelineError(f"--set expects key.path=value, got {item!r}{f' ({why})' if why else ''}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def with_global_batch(sets: list[str] | tuple[str, ...], global_batch: int | None) -> list[str]:
    """The `--set` items given, with `global_batch=N` for a command given another global batch
    (found in QA: written after a `global_batch=` given, not in its place): the same job."""
    keep = [s for s in sets if global_batch is None or s.partition("=")[0].strip() != "global_batch"]
    return [*keep, *([f"global_batch={global_batch}"] if global_batch is not None else [])]


def dotted(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys ("config.student.d_model"), other values as they are (an
    empty mapping as none)."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    return {k: v for key, sub in value.items() for k, v in dotted(sub, f"{prefix}.{key}" if prefix else str(key)).items()}
