"""maestro_flow: a runtime for compound model training (distillation, multimodal LLMs).

The public API. Configuration records import only the standard library; the Stage contract
(which needs torch) is loaded on first use, so that `import maestro_flow.planner` stays pure.
"""

from __future__ import annotations

from typing import Any

from maestro_flow.config import ArrowData, Cost, Edge, Pipeline, Section
from maestro_flow.errors import MaestroError, PipelineError, StageError, SystemFailure

__version__ = "0.1.0"
__all__ = [
    "ArrowData", "Cost", "Edge", "Pipeline", "Section", "Stage", "StageContext", "MicroBatch",
    "MaestroError", "PipelineError", "StageError", "SystemFailure",
]

_LAZY = {"Stage", "StageContext", "MicroBatch"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from maestro_flow import stage

        return getattr(stage, name)
    raise AttributeError(f"module 'maestro_flow' has no attribute {name!r}")
