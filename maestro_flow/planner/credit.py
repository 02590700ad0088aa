"""Run-ahead gates for an order decided elsewhere (FIFO's, or one refine.py's search changed).

Pure (standard library only). Producer micro-batch k of a replica may start once each replica
of the critical section it feeds has finished enough forwards that at most `credit` of this
producer's outputs, plus one consumer micro-batch, wait there: the memory bound the wavefront's
own orderings keep. Ordering.gates words the same rule for the order it decides itself, and
also loosens a gate to what the consumer had started when that order was decided (so its gates
never delay its own plan); these gates have no such record, so they can be stricter. Both use
the counting helpers here, and the default credit (`default_run_ahead`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.plan import Plan


def default_run_ahead(consumer_micro_batch: int) -> int:
    """Pipeline.run_ahead=None: 4 consumer micro-batches, and at least 16 samples. With small
    consumer micro-batches fewer do not cover the spread of encoder costs: at llm micro-batch 2
    (8 samples) a frozen encoder feeding 4 llm replicas idled both sides, 1.06-1.09x the bound
    at 90% images, against 1.005x with 16."""
    return max(4 * consumer_micro_batch, 16)


def cumulative(mbs: Sequence[Sequence[int]], keep: Callable[[int], bool]) -> list[int]:
    """[0, then for each j the samples `keep` accepts in the first j micro-batches]."""
    counts = [0]
    for mb in mbs:
        counts.append(counts[-1] + sum(map(keep, mb)))
    return counts


def first_covering(cumulative: list[int], need: int) -> int:
    """Smallest j with cumulative[j] >= need (cumulative is non-decreasing, cumulative[0] = 0)."""
    if need <= 0:
        return 0
    return bisect.bisect_left(cumulative, need)


def credit_gates(graph: SectionGraph, plan: Plan, comp: list[str], critical: str, credit: int, *,
                 takes: set[int] | None = None) -> dict[str, tuple]:
    """The gates of every section of `comp` in `plan` (none for a section that does not feed
    `critical`), as Plan.gates holds them. `takes`: the samples `critical` activates on, where
    the caller has them."""
    if takes is None:
        takes = {s.id for s in plan.samples if graph.sections[critical].activates(s.modalities)}
    to = plan.routes[critical]
    out: dict[str, tuple] = {}
    for n in comp:
        if critical not in [e.edge.dst for e in graph.outputs(n)]:
            out[n] = tuple(tuple(() for _ in mbs) for mbs in plan.replicas[n])
            continue
        # Per producer replica and consumer replica: how many of the producer replica's samples
        # the consumer replica's first j micro-batches hold, for every j.
        owner = {sid: pr for pr, mbs in enumerate(plan.replicas[n]) for mb in mbs for sid in mb}
        counts = [[[0] for _ in plan.replicas[critical]] for _ in plan.replicas[n]]
        for ci, cmbs in enumerate(plan.replicas[critical]):
            for cmb in cmbs:
                for per_ci in counts:
                    per_ci[ci].append(per_ci[ci][-1])
                for sid in cmb:
                    pr = owner.get(sid)
                    if pr is not None:
                        counts[pr][ci][-1] += 1
        reps = []
        for mbs, consumed in zip(plan.replicas[n], counts, strict=True):
            sent: dict[int, int] = {}
            per_mb = []
            for mb in mbs:
                into = [to[sid] for sid in mb if sid in takes]
                for ci in into:
                    sent[ci] = sent.get(ci, 0) + 1
                gate = []
                for ci in sorted(set(into)):
                    j = first_covering(consumed[ci], sent[ci] - credit) - 1
                    if j > 0:
                        gate.append((critical, ci, j))
                per_mb.append(tuple(gate))
            reps.append(tuple(per_mb))
        out[n] = tuple(reps)
    return out
