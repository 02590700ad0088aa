"""Per-section cost model: seconds of compute per sample from its metadata.

Pure (standard library only). Starts from the pipeline's `Cost` records; the coordinator may
replace a section's coefficients with measured ones between steps (`with_measured`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from maestro_flow.config import Cost
from maestro_flow.samples import SampleMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    costs: dict[str, Cost]

    def sample_s(self, section: str, sample: SampleMeta) -> float:
        c = self.costs[section]
        return (c.per_sample_s + c.per_token_s * sample.num_tokens + c.per_patch_s * sample.num_patches
                + c.per_frame_s * sample.num_frames)

    def with_cost(self, section: str, cost: Cost) -> CostModel:
        return dataclasses.replace(self, costs={**self.costs, section: cost})
