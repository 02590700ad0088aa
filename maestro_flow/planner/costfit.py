"""Refining the cost model from measured micro-batch timings.

Pure (standard library only). Each observation is one micro-batch of one section: how many
samples, tokens, patches and frames it held, and how long its forward (and, apart, its backward)
took. A section's forward cost is fitted as seconds = m + a*samples + b*tokens + c*patches +
d*frames (m the fixed cost of a micro-batch; only the terms its `Cost` uses) by least squares
with non-negative coefficients, pulled towards the pipeline's `Cost`
(ridge towards the prior, so a few noisy timings cannot swing the plan), over a sliding window.
For a loss section the measured task is forward + backward, which is divided by
1 + backward_factor; for other trainable sections the backward factor is the measured ratio.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from maestro_flow.config import Cost
from maestro_flow.planner.cost import CostModel

FEATURES = ("per_sample_s", "per_token_s", "per_patch_s", "per_frame_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """One micro-batch as measured by a worker."""

    kind: str  # "forward", "forward+backward" (a loss section) or "backward"
    samples: int
    tokens: int
    patches: int
    frames: int
    seconds: float

    @property
    def x(self) -> tuple[float, float, float, float]:
        return (float(self.samples), float(self.tokens), float(self.patches), float(self.frames))

    def to_list(self) -> list:
        return [self.kind, self.samples, self.tokens, self.patches, self.frames, self.seconds]

    @staticmethod
    def from_list(v: Sequence) -> Timing:
        return Timing(kind=v[0], samples=int(v[1]), tokens=int(v[2]), patches=int(v[3]), frames=int(v[4]),
                      seconds=float(v[5]))


class CostFitter:
    def __init__(self, prior: CostModel, *, window: int = 256, prior_weight: float = 4.0) -> None:
        self.prior = prior
        self.window = window
        self.prior_weight = prior_weight  # how many "average micro-batches" the prior counts as
        self._obs: dict[tuple[str, str], deque[Timing]] = {}  # (section, kind) -> recent timings

    def add(self, section: str, timings: Iterable[Timing | Sequence]) -> None:
        """Timings as Timing records or in their list form (as workers report them: kept as
        they come, converted only when fitted, since a window keeps only the newest)."""
        for t in timings:
            kind = t.kind if isinstance(t, Timing) else t[0]
            self._obs.setdefault((section, kind), deque(maxlen=self.window)).append(t)

    def state(self) -> list[list]:
        """The observations, as plain data (a checkpoint holds them, so a resumed run plans with
        the cost model the interrupted one had): [[section, kind, [timing lists]], ...]."""
        return [[section, kind, [t.to_list() if isinstance(t, Timing) else list(t) for t in ts]]
                for (section, kind), ts in self._obs.items()]

    def load(self, state: Sequence[Sequence]) -> None:
        self._obs = {}
        for section, kind, timings in state:
            if section in self.prior.costs:  # a section the pipeline no longer has is dropped
                self._obs[(section, kind)] = deque((Timing.from_list(t) for t in timings), maxlen=self.window)

    def model(self) -> CostModel:
        costs = dict(self.prior.costs)
        for name in costs:
            obs = [t if isinstance(t, Timing) else Timing.from_list(t)
                   for (n, _), ts in self._obs.items() if n == name for t in ts]
            if obs:
                costs[name] = self._fit(costs[name], obs)
        return dataclasses.replace(self.prior, costs=costs)

    def _fit(self, prior: Cost, obs: list[Timing]) -> Cost:
        fwd = [o for o in obs if o.kind == "forward"]
        combined = [o for o in obs if o.kind == "forward+backward"]
        bwd = [o for o in obs if o.kind == "backward"]
        factor = prior.backward_factor
        if fwd and bwd:
            factor = max(0.0, sum(o.seconds for o in bwd) / max(sum(o.seconds for o in fwd), 1e-12))
        rows = [(o.x, o.seconds) for o in fwd] + [(o.x, o.seconds / (1.0 + factor)) for o in combined]
        if not rows:
            return dataclasses.replace(prior, backward_factor=factor)
        # The pipeline's Cost says which features drive a section (a vision encoder's time does
        # not depend on its samples' token counts): only those, per_sample_s and the fixed cost
        # per micro-batch (the intercept: what makes small micro-batches dear) are fitted.
        used = [f == "per_sample_s" or getattr(prior, f) > 0 for f in FEATURES]
        rows = [((1.0, *(v if u else 0.0 for v, u in zip(x, used, strict=True))), y) for x, y in rows]
        coef = fit_nonnegative(rows, (prior.per_micro_batch_s, *(getattr(prior, f) for f in FEATURES)),
                               self.prior_weight)
        return dataclasses.replace(prior, backward_factor=factor, per_micro_batch_s=coef[0],
                                   **dict(zip(FEATURES, coef[1:], strict=True)))


def fit_nonnegative(rows: Sequence[tuple[Sequence[float], float]], prior: Sequence[float],
                    prior_weight: float) -> tuple[float, ...]:
    """Ridge least squares towards the prior (rescaled to the data), then active-set clamping
    of negative coefficients.

    The ridge strength per feature is prior_weight times that feature's mean square, so the
    prior weighs like `prior_weight` typical observations whatever the units.
    """
    k = len(prior)
    # Shrink towards the prior's shape at the measured scale: a prior that is 10x off in
    # absolute terms must not drag the fit, only its relative weights should.
    pred = [sum(p * v for p, v in zip(prior, x, strict=True)) for x, _ in rows]
    norm = sum(q * q for q in pred)
    scale = sum(q * y for q, (_, y) in zip(pred, rows, strict=True)) / norm if norm > 0 else 1.0
    prior = [p * max(scale, 0.0) for p in prior]
    active = [i for i in range(k) if any(x[i] for x, _ in rows)]
    coef = list(prior)
    for _ in range(k):
        if not active:
            break
        n = len(active)
        ata = [[0.0] * n for _ in range(n)]
        atb = [0.0] * n
        for x, y in rows:
            xa = [x[i] for i in active]
            for r in range(n):
                atb[r] += xa[r] * y
                for c in range(n):
                    ata[r][c] += xa[r] * xa[c]
        for r, i in enumerate(active):
            lam = prior_weight * ata[r][r] / len(rows)
            ata[r][r] += lam
            atb[r] += lam * prior[i]
        solution = _solve(ata, atb)
        if solution is None:
            break
        for r, i in enumerate(active):
            coef[i] = solution[r]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            break
        for i in negative:
            coef[i] = 0.0
        active = [i for i in active if i not in negative]
    return tuple(max(0.0, c) for c in coef)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
