"""Global batches from dataset metadata, reshuffled every epoch, deterministic from the seed.

Pure (standard library only). Each epoch is a seeded permutation of the rows cut into
`len // global_batch` batches (the remainder is dropped, so a batch never holds a sample twice);
step s is batch `s % per_epoch` of epoch `s // per_epoch`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from maestro_flow.errors import PipelineError
from maestro_flow.samples import SampleMeta


class EpochSampler:
    def __init__(self, metadata: Sequence[SampleMeta], global_batch: int, seed: int) -> None:
        self.metadata = list(metadata)
        if len(self.metadata) < global_batch:
            raise PipelineError(f"global_batch={global_batch} is larger than the dataset ({len(self.metadata)} samples)")
        self.global_batch = global_batch
        self.seed = seed
        self.per_epoch = len(self.metadata) // global_batch
        self._epoch, self._order = -1, []

    def batch(self, step: int) -> list[SampleMeta]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._order = list(range(len(self.metadata)))
            random.Random(self.seed * 7919 + epoch).shuffle(self._order)
            self._epoch = epoch
        rows = self._order[index * self.global_batch:(index + 1) * self.global_batch]
        return [self.metadata[r] for r in rows]
