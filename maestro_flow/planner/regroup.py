"""Regrouping a padding consumer's micro-batches by length, in its producer's send order
(wavefront.py, step 4).

Pure (standard library only). Found in a VLM's plans (RESULTS 11.2): an LLM that pads each
micro-batch to its longest sample took an encoder micro-batch's images in the encoder's order,
whatever their lengths, and grouped the text it ran after them apart from them, so its
micro-batches held 1.16-1.17 padded positions per real one, where its text-only twin (the same
lengths, no encoder) held 1.10.

The consumer takes each producer's outputs in the order they were sent (it feeds no one and has
one producer section: ordering.keep_order, tests/unit/test_planner.check_pair_order), so its
order can only change with the producer's. Here, for such a consumer `c` that pads and its
producer `p` (a source that feeds `c` alone):
  1. each of p's micro-batches sends c's samples longest first (by c's forward cost), in the
     places c's samples held: the same micro-batches, so p's own costs do not change;
  2. c's places for p's samples are refilled in that new send order;
  3. where consecutive micro-batches i..j of a c replica take p's samples from one p micro-batch
     only (each takes some; with `wide`, i takes some and i+1..j some or none), every sample of
     i..j is there when i starts, so they are sorted longest first across i..j and cut back to
     the micro-batches' sizes, where that pads less (with equal sizes it always pads least; p's
     samples keep their send order, being sorted already). A run stops at a boundary a run-ahead
     gate counts micro-batches to.
A pair whose consumer would not pad less in all (with unequal sizes, step 2 alone can move a
long sample into a larger micro-batch) keeps its order. Nothing of a micro-batch's size or
number changes. A change can still move when gradients reach p (p's samples can move into later
micro-batches, since text joins the sort, and a micro-batch may take longer samples than
before), so wavefront.py keeps a regrouped order only where simulate.py finds its step shorter.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from maestro_flow.graph import SectionGraph
from maestro_flow.planner.plan import MicroBatches


def pairs(graph: SectionGraph, comp: Sequence[str], padded: Mapping[str, bool]) -> list[tuple[str, str]]:
    """(producer, consumer) pairs of `comp` this applies to (module docstring)."""
    out = []
    for c in comp:
        ins = graph.inputs(c)
        if not padded[c] or len(ins) != 1 or graph.outputs(c):
            continue
        p = ins[0].edge.src
        if p in comp and not graph.inputs(p) and len(graph.outputs(p)) == 1:
            out.append((p, c))
    return out


def regroup(graph: SectionGraph, comp: Sequence[str], mbs: Mapping[str, Sequence[Sequence[Sequence[int]]]],
            routes: Mapping[str, Mapping[int, int]], fwd: Mapping[str, Mapping[int, float]],
            padded: Mapping[str, bool], gates: Mapping[str, Sequence[Sequence[Sequence[tuple[str, int, int]]]]],
            wide: bool = False) -> dict[str, tuple[MicroBatches, ...]] | None:
    """Each section's replicas' micro-batches (`mbs`) with every pair's producer and consumer
    regrouped; None where nothing changes. `gates`: the order's run-ahead gates (Ordering.gates).
    A gate (c, r, j) lets a producer micro-batch start once c's replica r has finished j
    micro-batches, counted for what the first j held: a run never spans that boundary, so the
    gates keep their credit."""
    given = {n: tuple(tuple(tuple(mb) for mb in rep) for rep in reps) for n, reps in mbs.items()}
    out = dict(given)
    cuts: dict[tuple[str, int], set[int]] = {}
    for reps in gates.values():
        for rep in reps:
            for gate in rep:
                for c, r, j in gate:
                    cuts.setdefault((c, r), set()).add(j)
    for p, c in pairs(graph, comp, padded):
        key, takes = fwd[c], {sid for rep in out[c] for mb in rep for sid in mb}
        new_p = tuple(tuple(_longest_first(mb, key, takes) for mb in rep) for rep in out[p])
        where = {sid: (r, k) for r, rep in enumerate(new_p) for k, mb in enumerate(rep) for sid in mb}
        new_c = sent_order(new_p, out[c], where.keys(), takes, routes[p], routes[c])
        new_c = tuple(_sorted_runs(rep, where, key, wide, cuts.get((c, r), set())) for r, rep in enumerate(new_c))
        # With unequal micro-batch sizes the new send order alone can pad more (a long sample
        # moving into a larger micro-batch): then the pair keeps its order.
        if sum(_padded(rep, key) for rep in new_c) < sum(_padded(rep, key) for rep in out[c]):
            out[p], out[c] = new_p, new_c
    return out if out != given else None


def _longest_first(mb: Sequence[int], key: Mapping[int, float], takes: set[int]) -> tuple[int, ...]:
    """A producer micro-batch with the consumer's samples (`takes`) longest first (stable), in their places."""
    places = [i for i, sid in enumerate(mb) if sid in takes]
    out = list(mb)
    for i, sid in zip(places, sorted((mb[i] for i in places), key=lambda sid: -key[sid]), strict=True):
        out[i] = sid
    return tuple(out)


def sent_order(producer: Sequence[Sequence[Sequence[int]]], consumer: Sequence[Sequence[Sequence[int]]],
               takes_p: Collection[int], takes_c: Collection[int], route_p: Mapping[int, int],
               route_c: Mapping[int, int]) -> tuple[MicroBatches, ...]:
    """The consumer's micro-batches (per replica) with the samples of each producer replica, in
    the places they hold, put back in the order that replica sends them (`takes_*`: the samples
    each section processes; `route_*`: each sample's replica there). refine.py keeps its changes
    in send order with it too."""
    sent: dict[tuple[int, int], list[int]] = {}  # (producer replica, consumer replica) -> sids
    for pr, rep in enumerate(producer):
        for mb in rep:
            for sid in mb:
                if sid in takes_c:
                    sent.setdefault((pr, route_c[sid]), []).append(sid)
    queues = {pair: iter(sids) for pair, sids in sent.items()}
    return tuple(tuple(tuple(next(queues[(route_p[sid], cr)]) if sid in takes_p else sid for sid in mb)
                       for mb in rep) for cr, rep in enumerate(consumer))


def _sorted_runs(rep: Sequence[Sequence[int]], where: Mapping[int, tuple[int, int]],
                 key: Mapping[int, float], wide: bool, cuts: set[int]) -> MicroBatches:
    """One consumer replica's micro-batches with each run that takes one producer micro-batch's
    samples (module docstring, 3), and spans no gate's boundary (`cuts`: a gate counts the
    micro-batches before index j), sorted longest first and cut back to its sizes, where that
    pads less."""
    out = [tuple(mb) for mb in rep]
    i = 0
    while i < len(out):
        source = {where[sid] for sid in out[i] if sid in where}
        j = i + 1
        if len(source) == 1:
            while j < len(out) and j not in cuts:
                takes = {where[sid] for sid in out[j] if sid in where}
                if not (takes == source or wide and not takes):
                    break
                j += 1
        if j - i > 1:
            ordered = sorted((sid for mb in out[i:j] for sid in mb), key=lambda sid: -key[sid])
            sizes = [len(mb) for mb in out[i:j]]
            starts = [sum(sizes[:m]) for m in range(len(sizes))]
            sorted_run = [tuple(ordered[s:s + n]) for s, n in zip(starts, sizes, strict=True)]
            if _padded(sorted_run, key) < _padded(out[i:j], key):
                out[i:j] = sorted_run
        i = j
    return tuple(out)


def _padded(mbs: Sequence[Sequence[int]], key: Mapping[int, float]) -> float:
    """What padding charges micro-batches beyond their fixed costs (CostModel.batch_s): each
    sample at its micro-batch's longest."""
    return sum(len(mb) * max(key[sid] for sid in mb) for mb in mbs)
