"""Global batches from dataset metadata: a seeded shuffle per epoch, remainder dropped.

Pure (standard library only). Each epoch is a permutation of the rows — seeded by (seed, epoch),
or the file order with `data.shuffle=false` — cut into `len // global_batch` batches; the last
`len % global_batch` rows of the permutation are dropped, so a batch never holds a sample twice.
Step s is batch `s % per_epoch` of epoch `s // per_epoch`: a step's samples depend on the step
alone, which is what makes a resumed run draw exactly the batches the interrupted one would have.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

from maestro_flow.errors import PipelineError
from maestro_flow.samples import SampleMeta


def data_fingerprint(metadata: Sequence[SampleMeta], *, sizes: bool = False) -> str:
    """Which samples, in which rows: a resumed run's sampler position means the same samples only
    on a dataset with this fingerprint (the same count is not enough: a rebuilt dataset). With
    `sizes`, also each sample's modalities and token, patch and frame counts: a dataset rebuilt
    with the same ids (ids 0..n-1, as most builders write them) and other samples differs there."""
    h = hashlib.sha256()
    for m in metadata:
        h.update((f"{m.id}:{m.row}:{','.join(sorted(m.modalities))}:{m.num_tokens}:{m.num_patches}:{m.num_frames};"
                  if sizes else f"{m.id}:{m.row};").encode())
    return h.hexdigest()[:16]


class EpochSampler:
    def __init__(self, metadata: Sequence[SampleMeta], global_batch: int, seed: int, *, shuffle: bool = True) -> None:
        self.metadata = list(metadata)
        if len(self.metadata) < global_batch:
            raise PipelineError(f"global_batch={global_batch} is larger than the dataset ({len(self.metadata)} samples)")
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.per_epoch = len(self.metadata) // global_batch
        self._epoch, self._order = -1, []
        self._fingerprint: str | None = None
        self._sizes: str | None = None

    def batch(self, step: int) -> list[SampleMeta]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self._epoch:
            self._order = list(range(len(self.metadata)))
            if self.shuffle:
                random.Random(self.seed * 7919 + epoch).shuffle(self._order)
            self._epoch = epoch
        rows = self._order[index * self.global_batch:(index + 1) * self.global_batch]
        return [self.metadata[r] for r in rows]

    def position(self, step: int) -> dict[str, Any]:
        """Where the sampler stands before `step` (for a checkpoint): epoch, batch within it, and
        what the position means (a resume must see the same dataset size, batch, seed, shuffle)."""
        epoch, index = divmod(step, self.per_epoch)
        return {"step": step, "epoch": epoch, "batch_in_epoch": index, "batches_per_epoch": self.per_epoch,
                "num_samples": len(self.metadata), "global_batch": self.global_batch, "seed": self.seed,
                "shuffle": self.shuffle, "data_fingerprint": self.fingerprint,
                "data_sizes": self.sizes_fingerprint}

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = data_fingerprint(self.metadata)
        return self._fingerprint

    @property
    def sizes_fingerprint(self) -> str:
        if self._sizes is None:
            self._sizes = data_fingerprint(self.metadata, sizes=True)
        return self._sizes
