"""Refining the cost model from measured micro-batch timings.

Pure (standard library only). Each observation is one micro-batch of one section: how many
samples, tokens, patches and frames it was charged for (cost.charged: for a stage that pads,
every sample at the micro-batch's longest), and how long its forward (and, apart, its
backward) took. The fit works on each window's normal equations, kept up to date as timings come and go
(so the coordinator's work per step does not grow with the window), and is cached until the next
timing. A section's forward cost is fitted as seconds = m + a*samples + b*tokens + c*patches +
d*frames (m the fixed cost of a micro-batch; only the terms its `Cost` uses) by least squares
with non-negative coefficients, pulled towards the pipeline's `Cost`
(ridge towards the prior, so a few noisy timings cannot swing the plan), over a sliding window.
For a loss section the measured task is forward + backward, which is divided by
1 + backward_factor; for other trainable sections the backward factor is the backward window's
measured over modelled seconds (the forward fit's, for the same micro-batches) divided by the
forward window's: the two hold different micro-batches (one may have no backward, or one of fewer
samples: those no consumer sends gradients for).
"""

from __future__ import annotations

import dataclasses
import math
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


K = 1 + len(FEATURES)  # the fitted terms: the fixed cost per micro-batch, then FEATURES


class _Sums:
    """The normal equations of one window of timings (x = 1, samples, tokens, patches, frames),
    kept as timings come and go, so a fit costs O(K^3), not a pass over the window."""

    def __init__(self) -> None:
        self.n = 0
        self.y = 0.0
        self.xx = [[0.0] * K for _ in range(K)]
        self.xy = [0.0] * K

    def update(self, t: Sequence, sign: float) -> None:
        x = (1.0, float(t[1]), float(t[2]), float(t[3]), float(t[4]))
        y = float(t[5]) * sign
        self.n += 1 if sign > 0 else -1
        self.y += y
        # Only the non-zero terms add anything (a text micro-batch has no patches or frames): the
        # coordinator updates these sums twice per timing, thousands of times a step at scale.
        terms = [(i, v) for i, v in enumerate(x) if v]
        for i, xi in terms:
            self.xy[i] += xi * y
            row, xs = self.xx[i], xi * sign
            for j, xj in terms:
                row[j] += xs * xj


class CostFitter:
    def __init__(self, prior: CostModel, *, window: int = 256, prior_weight: float = 4.0) -> None:
        self.prior = prior
        self.window = window
        self.prior_weight = prior_weight  # how many "average micro-batches" the prior counts as
        self._obs: dict[tuple[str, str], deque[list]] = {}  # (section, kind) -> recent timings (list form)
        self._sums: dict[tuple[str, str], _Sums] = {}
        self._model: CostModel | None = None  # the last fit, until a timing comes

    def add(self, section: str, timings: Iterable[Timing | Sequence]) -> None:
        """Timings as Timing records or in their list form (as workers report them). One that is
        not finite is left out: the running sums would keep its NaN after it left the window."""
        for t in timings:
            t = t.to_list() if isinstance(t, Timing) else list(t)
            if not all(math.isfinite(float(v)) for v in t[1:6]):
                continue
            key = (section, t[0])
            window = self._obs.setdefault(key, deque())
            sums = self._sums.setdefault(key, _Sums())
            if len(window) == self.window:
                sums.update(window.popleft(), -1.0)
            window.append(t)
            sums.update(t, 1.0)
            self._model = None

    def state(self) -> list[list]:
        """The observations, as plain data (a checkpoint holds them, so a resumed run plans with
        the cost model the interrupted one had): [[section, kind, [timing lists]], ...]."""
        return [[section, kind, [list(t) for t in ts]] for (section, kind), ts in self._obs.items()]

    def load(self, state: Sequence[Sequence]) -> None:
        self._obs, self._sums, self._model = {}, {}, None
        for section, _kind, timings in state:  # each timing names its kind
            if section in self.prior.costs:  # a section the pipeline no longer has is dropped
                self.add(section, timings)

    def model(self) -> CostModel:
        """The prior with every section's coefficients fitted to its window (cached until the
        next timing)."""
        if self._model is None:
            costs = dict(self.prior.costs)
            for name in costs:
                mine = {kind: sums for (n, kind), sums in self._sums.items() if n == name and sums.n > 0}
                if mine:
                    costs[name] = self._fit(costs[name], mine)
            self._model = dataclasses.replace(self.prior, costs=costs)
        return self._model

    def _fit(self, prior: Cost, sums: dict[str, _Sums]) -> Cost:
        fwd, combined, bwd = sums.get("forward"), sums.get("forward+backward"), sums.get("backward")
        factor, forward = prior.backward_factor, None
        if fwd and bwd:
            # The two windows hold different micro-batches (a micro-batch may have no backward, or
            # one of fewer samples), so their seconds are not compared directly: each is divided by
            # what the fitted forward model gives its own micro-batches (row 0 of the normal
            # equations holds their count and each feature's sum), which also cancels the fit's bias.
            forward = self._coef(prior, [(fwd, 1.0)])
            modelled = [sum(c * v for c, v in zip(forward, s.xx[0], strict=True)) for s in (fwd, bwd)]
            if min(modelled) > 0 and fwd.y > 0:
                factor = max(0.0, (bwd.y / modelled[1]) / (fwd.y / modelled[0]))
        parts = [(s, w) for s, w in ((fwd, 1.0), (combined, 1.0 / (1.0 + factor))) if s is not None]
        if not parts:
            return dataclasses.replace(prior, backward_factor=factor)
        coef = forward if forward is not None and combined is None else self._coef(prior, parts)
        return dataclasses.replace(prior, backward_factor=factor, per_micro_batch_s=coef[0],
                                   **dict(zip(FEATURES, coef[1:], strict=True)))

    def _coef(self, prior: Cost, parts: list[tuple[_Sums, float]]) -> tuple[float, ...]:
        """The fixed cost per micro-batch and FEATURES' coefficients fitted to the windows in
        `parts`, each one's seconds scaled by its weight."""
        # The forward rows, and a loss section's forward+backward rows divided by 1 + factor.
        xx = [[sum(s.xx[i][j] for s, _ in parts) for j in range(K)] for i in range(K)]
        xy = [sum(s.xy[i] * w for s, w in parts) for i in range(K)]
        n = sum(s.n for s, _ in parts)
        # The pipeline's Cost says which features drive a section (a vision encoder's time does
        # not depend on its samples' token counts): only those, per_sample_s and the fixed cost
        # per micro-batch (the intercept: what makes small micro-batches dear) are fitted.
        used = [True] + [f == "per_sample_s" or getattr(prior, f) > 0 for f in FEATURES]
        xx = [[xx[i][j] if used[i] and used[j] else 0.0 for j in range(K)] for i in range(K)]
        xy = [v if u else 0.0 for v, u in zip(xy, used, strict=True)]
        return fit_from_sums(xx, xy, n, (prior.per_micro_batch_s, *(getattr(prior, f) for f in FEATURES)),
                             self.prior_weight)


def fit_nonnegative(rows: Sequence[tuple[Sequence[float], float]], prior: Sequence[float],
                    prior_weight: float) -> tuple[float, ...]:
    """Ridge least squares towards the prior (rescaled to the data), then active-set clamping
    of negative coefficients (see fit_from_sums), from the rows (x, y) themselves."""
    k = len(prior)
    xx = [[sum(x[i] * x[j] for x, _ in rows) for j in range(k)] for i in range(k)]
    xy = [sum(x[i] * y for x, y in rows) for i in range(k)]
    return fit_from_sums(xx, xy, len(rows), prior, prior_weight)


def fit_from_sums(xx: Sequence[Sequence[float]], xy: Sequence[float], n: int, prior: Sequence[float],
                  prior_weight: float) -> tuple[float, ...]:
    """Ridge least squares towards the prior (rescaled to the data), then active-set clamping
    of negative coefficients, from the normal equations (xx = sum of x x^T, xy = sum of x y over
    n rows).

    The ridge strength per feature is prior_weight times that feature's mean square, so the
    prior weighs like `prior_weight` typical observations whatever the units.
    """
    k = len(prior)
    if n <= 0:
        return tuple(max(0.0, p) for p in prior)
    # Shrink towards the prior's shape at the measured scale: a prior that is 10x off in
    # absolute terms must not drag the fit, only its relative weights should.
    norm = sum(prior[i] * xx[i][j] * prior[j] for i in range(k) for j in range(k))
    scale = sum(p * v for p, v in zip(prior, xy, strict=True)) / norm if norm > 0 else 1.0
    prior = [p * max(scale, 0.0) for p in prior]
    active = [i for i in range(k) if xx[i][i] > 0]
    coef = list(prior)
    for _ in range(k):
        if not active:
            break
        ata = [[xx[i][j] for j in active] for i in active]
        atb = [xy[i] for i in active]
        for r, i in enumerate(active):
            lam = prior_weight * xx[i][i] / n
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
