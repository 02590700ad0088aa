"""Per-section cost model: seconds of compute per sample from its metadata.

Pure (standard library only). Starts from the pipeline's `Cost` records; the coordinator replaces
a section's coefficients with fitted ones between steps (see `costfit.py`). Forward cost is a
fixed cost per micro-batch plus terms linear in each sample's tokens, patches and frames; a
trainable section's backward is `backward_factor` times its forward; each transfer between
replicas costs `transfer_s`.
"""

from __future__ import annotations

from dataclasses import dataclass

from maestro_flow.config import Cost
from maestro_flow.samples import SampleMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    costs: dict[str, Cost]
    transfer_s: float = 2e-4  # one message between two replicas (measured here: ~0.2 ms over gloo)

    def sample_s(self, section: str, sample: SampleMeta) -> float:
        """Forward seconds of `section` for one sample."""
        c = self.costs[section]
        return (c.per_sample_s + c.per_token_s * sample.num_tokens + c.per_patch_s * sample.num_patches
                + c.per_frame_s * sample.num_frames)

    def backward_s(self, section: str, sample: SampleMeta) -> float:
        return self.costs[section].backward_factor * self.sample_s(section, sample)

    def micro_batch_s(self, section: str) -> float:
        """A micro-batch's fixed forward seconds (its backward: backward_factor times that)."""
        return self.costs[section].per_micro_batch_s
