"""Per-section cost model: seconds of compute per sample and per micro-batch from their metadata.

Pure (standard library only). Starts from the pipeline's `Cost` records; the coordinator replaces
a section's coefficients with fitted ones between steps (see `costfit.py`). Forward cost is a
fixed cost per micro-batch plus terms linear in each sample's tokens, patches and frames; a
trainable section's backward is `backward_factor` times its forward; each transfer between
replicas costs `transfer_s` of latency, and where `message_s` says so (the tuner, for CPU
sections) each tensor message its receiver that much of its own time (simulate.py).

Padding: a stage that pads every sample to the micro-batch's longest (`Cost.padded`) computes
on samples x the longest sample's length, so a micro-batch's length terms are charged at that
(`charged`, `CostModel.batch_s`): measured on the demo's CausalLM, a random micro-batch of 8
took 2.01x the time of one of 8 samples of its mean length, for 1.94x the tokens (RESULTS 11.8). Per-sample
costs (`sample_s`: what the planner orders and bounds by) stay each sample's own, a lower
bound of its share of any micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from maestro_flow.config import Cost
from maestro_flow.samples import SampleMeta


def cheapest_pieces(order: Sequence[int], fwd: Mapping[int, float], fixed: float) -> list[list[int]]:
    """`order` (sample ids of a padding stage's micro-batch) cut into the consecutive pieces that
    cost least in all, a piece costing `fixed` + its size x its largest `fwd` (exact dynamic
    programme, O(len^2); fewer pieces, then earlier cuts, on ties)."""
    k = len(order)
    vals = [fwd[sid] for sid in order]
    # best[j]: (cost, pieces, start of the last piece) of the first j samples.
    best: list[tuple[float, int, int]] = [(0.0, 0, 0)] * (k + 1)
    for j in range(1, k + 1):
        top, bj = 0.0, (float("inf"), 0, 0)
        for i in range(j - 1, -1, -1):  # the last piece is order[i:j]; top: its largest
            if vals[i] > top:
                top = vals[i]
            cost, n = best[i][0] + fixed + (j - i) * top, best[i][1] + 1
            if (cost, n) <= bj[:2]:  # down to i = 0: on a tie the smallest i wins
                bj = (cost, n, i)
        best[j] = bj
    pieces, j = [], k
    while j > 0:
        i = best[j][2]
        pieces.append(list(order[i:j]))
        j = i
    return pieces[::-1]


def length_s(c: Cost, sample: SampleMeta) -> float:
    """The sample's length-dependent forward seconds (its token, patch and frame terms)."""
    return c.per_token_s * sample.num_tokens + c.per_patch_s * sample.num_patches + c.per_frame_s * sample.num_frames


def charged(c: Cost, samples: Sequence[SampleMeta]) -> tuple[int, int, int, int]:
    """(samples, tokens, patches, frames) the cost's terms are charged on for one micro-batch:
    the sums, or for a padded stage every sample at the lengths of the micro-batch's longest
    (the sample with the largest length terms; by total length when the cost has none yet)."""
    n = len(samples)
    if not samples:
        return 0, 0, 0, 0
    if not c.padded:
        return (n, sum(s.num_tokens for s in samples), sum(s.num_patches for s in samples),
                sum(s.num_frames for s in samples))
    longest = max(samples, key=lambda s: (length_s(c, s), s.num_tokens + s.num_patches + s.num_frames))
    return n, n * longest.num_tokens, n * longest.num_patches, n * longest.num_frames


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    costs: dict[str, Cost]
    transfer_s: float = 2e-4  # one message between two replicas (measured here: ~0.2 ms over gloo)
    # section -> seconds of a replica's own time per tensor message it receives (its header, its
    # views, the executor gathering a micro-batch's inputs from it): none unless set (the tuner
    # sets it from a cost file; the planner's orderings do not weigh it).
    message_s: dict[str, float] = field(default_factory=dict)

    def sample_s(self, section: str, sample: SampleMeta) -> float:
        """Forward seconds of `section` for one sample (at its own length)."""
        c = self.costs[section]
        return c.per_sample_s + length_s(c, sample)

    def samples_s(self, section: str, samples: Sequence[SampleMeta]) -> dict[int, float]:
        """sample_s of every sample, by id (one lookup of the section's Cost)."""
        c = self.costs[section]
        return {s.id: c.per_sample_s + length_s(c, s) for s in samples}

    def backward_s(self, section: str, sample: SampleMeta) -> float:
        return self.costs[section].backward_factor * self.sample_s(section, sample)

    def micro_batch_s(self, section: str) -> float:
        """A micro-batch's fixed forward seconds (its backward: backward_factor times that)."""
        return self.costs[section].per_micro_batch_s

    def batch_s(self, section: str, samples: Sequence[SampleMeta]) -> float:
        """Forward seconds of one micro-batch of `samples`: the fixed cost plus the terms on
        what `charged` counts (padding included); 0 for an empty one."""
        if not samples:
            return 0.0
        c = self.costs[section]
        n, tokens, patches, frames = charged(c, samples)
        return (c.per_micro_batch_s + c.per_sample_s * n + c.per_token_s * tokens + c.per_patch_s * patches
                + c.per_frame_s * frames)
