"""Per-step bookkeeping shared by section mode and colocated mode: plans out, reports in.

Pure apart from reading no clock itself (callers pass `now`). Turns a Plan into the message each
replica needs, collects loss reports into the global denominator (then says whom to finalize),
collects norm reports into the global gradient norm and clip coefficient (then says whom to
send it), collects done reports into the metrics row of DESIGN 5.4, and feeds the measured
micro-batch timings to the cost fitter, whose model plans the next steps.

A report counts once per rank and step, only for a step that is planned and not finished, and
only from a rank whose section sends that report; anything else raises `Rejected` (the
coordinator drops it and logs why), so a repeated or misplaced report never changes training.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from maestro_flow.graph import SectionGraph
from maestro_flow.optim.clip import clip_coefficient, global_norm
from maestro_flow.planner.cost import CostModel
from maestro_flow.planner.costfit import CostFitter
from maestro_flow.planner.plan import Placement, Plan
from maestro_flow.protocol.auth import Rejected

MiB = float(1 << 20)


def plan_message(plan: Plan, graph: SectionGraph, section: str, replica: int) -> dict[str, Any]:
    """What one replica needs of a plan: its micro-batches, their rows, and neighbours' routes."""
    return PlanMessages(plan, graph).of(section, replica)


class PlanMessages:
    """Every replica's plan message of one plan, each built in time proportional to its own
    samples (the sample index and who waits on whom are built once per plan: the coordinator
    sends a message to every rank every step)."""

    def __init__(self, plan: Plan, graph: SectionGraph) -> None:
        self.plan, self.graph = plan, graph
        self.meta = {s.id: s for s in plan.samples}
        # Sections with per-micro-batch FSDP run their replicas in lockstep (parallel/fsdp.py): they
        # get the step's rounds and a probe sample, and their run-ahead credits change (_gates).
        self.lockstep = {n for n in graph.order if graph.lockstep(n)}
        # Built once per plan, on first use: a lockstep producer's round of each sample, what a
        # consumer replica can run on rounds before k, whether a consumer may be asked at all, and
        # a lockstep section's rounds and probe (the same in every replica's message).
        self._round_of: dict[str, dict[int, int]] = {}
        self._reach: dict[tuple[str, str, int], list[int]] = {}
        self._askable: dict[str, bool] = {}
        self._rounds_of: dict[str, dict[str, Any]] = {}
        self.gates = {(p, r): self._gates(p, r) for p, reps in plan.gates.items() for r in range(len(reps))}
        # Per section and per modality set, once per plan (of() runs for every replica).
        self._neighbours = {n: [e.edge.dst for e in graph.outputs(n)] + [e.edge.src for e in graph.inputs(n)]
                            for n in graph.order}
        self._modalities: dict[frozenset, list[str]] = {}
        self.notify: dict[tuple[str, int], set[tuple[str, int]]] = {}
        for (p, r), rep in self.gates.items():
            for mb in rep:
                for c, ci, _ in mb:
                    self.notify.setdefault((c, ci), set()).add((p, r))

    def of(self, section: str, replica: int) -> dict[str, Any]:
        plan, meta, modalities = self.plan, self.meta, self._modalities
        mbs = plan.micro_batches(section, replica)
        mine = sorted({sid for mb in mbs for sid in mb})
        samples = []
        for sid in mine:
            s = meta[sid]
            names = modalities.get(s.modalities)
            if names is None:
                names = modalities[s.modalities] = sorted(s.modalities)
            samples.append([sid, s.row, names, s.num_tokens, s.num_patches, s.num_frames])
        msg = {
            "t": "plan", "step": plan.step,
            "micro_batches": [list(mb) for mb in mbs],
            "samples": samples,  # (the modality lists are shared between messages: only packed, never changed)
            "routes": {n: {sid: plan.routes[n][sid] for sid in mine} for n in self._neighbours[section]},
            # Run-ahead credits: per micro-batch, (consumer section, replica, forwards it must
            # have finished); and which producer replicas wait on this replica's progress.
            "gates": [[list(g) for g in mb] for mb in self.gates.get((section, replica), plan.gates_of(section, replica))],
            "notify": sorted(self.notify.get((section, replica), ())),
        }
        if section in self.lockstep:
            if section not in self._rounds_of:
                self._rounds_of[section] = self._rounds(section)
            msg.update(self._rounds_of[section])
        return msg

    def _gates(self, producer: str, replica: int) -> list[list[tuple[str, int, int]]]:
        """A replica's run-ahead gates per micro-batch. A gate on a lockstep consumer is dropped:
        a producer waiting on one of its replicas while that replica waits on a peer's gather, and
        the peer on that producer, would be a cycle. A lockstep producer's gate for its round k
        asks a consumer for at most the forwards it can run on outputs of rounds before k (which
        every replica has passed once one starts round k), and only of a consumer that has no
        other producer and no gates of its own; others are dropped. Its run-ahead stays bounded
        without any wait that could close a cycle."""
        out = []
        for k, mb in enumerate(self.plan.gates_of(producer, replica)):
            if producer not in self.lockstep:
                out.append([g for g in mb if g[0] not in self.lockstep])
                continue
            kept = []
            for c, ci, done in mb:
                if c not in self._askable:
                    self._askable[c] = c not in self.lockstep and len(self.graph.inputs(c)) == 1 and not any(
                        g for rep in self.plan.gates.get(c, ()) for mbg in rep for g in mbg)
                if self._askable[c]:
                    reach = self._reachable(producer, c, ci)
                    kept.append((c, ci, min(done, reach[min(k, len(reach) - 1)])))
            out.append(kept)
        return out

    def _reachable(self, producer: str, consumer: str, replica: int) -> list[int]:
        """[k] = the consumer replica's leading micro-batches whose inputs from `producer` all
        come from its rounds (micro-batch indices) before k."""
        key = (producer, consumer, replica)
        if key not in self._reach:
            if producer not in self._round_of:
                self._round_of[producer] = {sid: k for r in range(self.graph.sections[producer].dp)
                                            for k, mb in enumerate(self.plan.micro_batches(producer, r)) for sid in mb}
            rounds = self._round_of[producer]
            needs, latest = [], -1  # needs[m]: the latest round consumer micro-batches 0..m need
            for mb in self.plan.micro_batches(consumer, replica):
                latest = max([latest] + [rounds[s] for s in mb if s in rounds])
                needs.append(latest)
            top = max(rounds.values(), default=0) + 2
            self._reach[key] = [bisect.bisect_right(needs, k - 1) for k in range(top)]  # needs never decrease
        return self._reach[key]

    def _rounds(self, section: str) -> dict[str, Any]:
        """The most micro-batches any replica of `section` runs this step, and a sample of the
        step's for a replica to run when it has no micro-batch of its own left."""
        per_replica = [self.plan.micro_batches(section, r) for r in range(self.graph.sections[section].dp)]
        first = next((mbs[0][0] for mbs in per_replica if mbs), None)
        out: dict[str, Any] = {"rounds": max(len(mbs) for mbs in per_replica)}
        if first is not None:
            s = self.meta[first]
            out["probe"] = [first, s.row, sorted(s.modalities)]
        return out


class StepLedger:
    def __init__(self, graph: SectionGraph, placement: Placement, *, adapt_costs: bool = True) -> None:
        self.graph, self.placement = graph, placement
        prior = CostModel(costs={n: s.cost for n, s in graph.sections.items()})
        self.fitter = CostFitter(prior) if adapt_costs else None
        self.prior = prior
        self.losses: dict[int, dict[str, dict[int, float]]] = {}  # step -> section -> rank -> denominator
        self.done: dict[int, dict[int, dict[str, Any]]] = {}
        self.tokens: dict[int, int] = {}
        self.samples: dict[int, int] = {}
        self.started: dict[int, float] = {}
        self.norms: dict[int, dict[int, float]] = {}  # step -> trainable rank -> squared norm share
        self.trainable_ranks = [r for n in graph.order if graph.sections[n].trainable for r in placement.section_ranks(n)]
        self.first_step: int | None = None  # the first step this ledger planned (its timings are not fitted)
        self.trainable_set = set(self.trainable_ranks)
        self.loss_ranks = {r for n in graph.loss_sections() for r in placement.ranks[n]}
        self.all_ranks = range(placement.world_size)

    def planned(self, plan: Plan, now: float) -> None:
        """A plan sent; `now`: when its workers began to wait for it (planning began, or a plan made
        earlier went out), so that the planning they sit idle for counts in the step's time."""
        if self.first_step is None:
            self.first_step = plan.step
        self.tokens[plan.step] = sum(s.num_tokens for s in plan.samples)
        self.samples[plan.step] = len(plan.samples)
        self.started.setdefault(plan.step, now)

    def _check(self, what: str, rank: int, step: int, ranks: Any, seen: Any) -> None:
        if step not in self.started:
            raise Rejected(f"{what} report for step {step + 1}, which is not in progress")
        if rank not in ranks:
            raise Rejected(f"{what} report from rank {rank}, which does not send one")
        if rank in seen:
            raise Rejected(f"repeated {what} report from rank {rank} for step {step + 1}")

    def on_loss(self, rank: int, step: int, loss_sum: float, denominator: float) -> list[tuple[list[int], float]]:
        """Record a loss report; when a loss section is complete, return [(ranks to finalize, D)]."""
        section, _ = self.placement.who(rank)
        per = self.losses.get(step, {}).get(section, {})
        self._check("loss", rank, step, self.loss_ranks, per)
        per = self.losses.setdefault(step, {}).setdefault(section, {})
        per[rank] = denominator
        if len(per) < self.placement.dp(section):
            return []
        total = sum(per[r] for r in sorted(per))
        # The loss section itself sums its denominators with its gradients; only trainable
        # sections upstream wait for this one.
        ranks = [r for name in self.graph.order
                 if name != section and self.graph.sections[name].trainable
                 and self.graph.loss_sections_of(name) == [section]
                 for r in self.placement.section_ranks(name)]
        return [(ranks, total)]

    def on_norm(self, rank: int, step: int, sq: float) -> tuple[list[int], float] | None:
        """Record a replica's share of the squared gradient norm (a report counts once per rank and
        step); when every trainable replica has reported, return (ranks to send it to, clip
        coefficient)."""
        self._check("norm", rank, step, self.trainable_set, self.norms.get(step, {}))
        per = self.norms.setdefault(step, {})
        per[rank] = sq
        if len(per) < len(self.trainable_ranks):
            return None
        norm = global_norm(per.values())  # the reports stay until the step is done: a repeat is refused
        return list(self.trainable_ranks), clip_coefficient(self.graph.pipeline.grad_clip, norm)

    def check_done(self, rank: int, step: int) -> None:
        """Raises Rejected for a done report that would not count (on_done checks the same)."""
        self._check("done", rank, step, self.all_ranks, self.done.get(step, {}))

    def on_done(self, rank: int, step: int, stats: dict[str, Any], now: float) -> dict[str, Any] | None:
        """Record a done report; when every replica is done, return the step's metrics row."""
        self._check("done", rank, step, self.all_ranks, self.done.get(step, {}))
        per = self.done.setdefault(step, {})
        per[rank] = stats
        # A tensor-parallel group times once. The first step's timings hold one-time costs (an
        # image decoder's pipeline built, lazy initialisation, cold caches: a hundred times a
        # micro-batch's cost), which would skew the fit for a whole window: they are left out.
        if self.fitter is not None and self.placement.tp_index(rank) == 0 and step != self.first_step:
            self.fitter.add(self.placement.who(rank)[0], stats.get("timings", ()))
        if len(per) < self.placement.world_size:
            return None
        step_time = now - self.started.pop(step)
        # The next step's time counts from this step's end when its plan went out earlier
        # (lookahead); that is the time the step adds to the run.
        if step + 1 in self.started:
            self.started[step + 1] = max(self.started[step + 1], now)
        sections = {}
        for name in self.graph.order:
            reps = [per[r] for r in self.placement.ranks[name]]
            busy = sum(s["busy_s"] for s in reps)
            sections[name] = {
                "busy_s": busy, "idle_s": max(0.0, step_time * len(reps) - busy),
                "micro_batches": sum(s["micro_batches"] for s in reps), "samples": sum(s["samples"] for s in reps),
                "bytes_sent": sum(s.get("bytes_sent", 0) for s in reps),
                "comm_s": sum(s.get("send_s", 0.0) + s.get("recv_s", 0.0) for s in reps),
                "max_rss_mb": max(s.get("max_rss_kb", 0) for s in reps) / 1024,
            }
            if all("cpu_s" in s for s in reps):  # section mode: its workers' CPU, every thread, summed
                sections[name]["cpu_s"] = sum(s["cpu_s"] for s in reps)
            counters: dict[str, float] = {}
            for s in reps:  # a stage's own counters (stats()), e.g. images it skipped
                for k, v in s.get("stage", {}).items():
                    counters[k] = counters.get(k, 0) + v
            if counters:
                sections[name]["stage"] = counters
            if any("probe_rounds" in s for s in reps):  # lockstep FSDP forwards without samples
                sections[name]["probe_rounds"] = sum(s.get("probe_rounds", 0) for s in reps)
            if "lr" in reps[0]:  # a section with an optimizer: its lr, and its own pre-clip gradient norm
                sections[name]["lr"] = reps[0]["lr"]
                if "lr_groups" in reps[0]:  # one per optimizer of Stage.optimizer_groups
                    sections[name]["lr_groups"] = reps[0]["lr_groups"]
                sections[name]["grad_norm"] = global_norm([s["grad_sq"] for s in reps if "grad_sq" in s])
            sections[name].update(memory_row(reps))
        self.losses.pop(step, None)
        self.norms.pop(step, None)
        # The loss of each loss section, from its replicas' done reports (sum / denominator).
        losses = {}
        for name in self.graph.loss_sections():
            reps = [per[r] for r in self.placement.ranks[name]]
            losses[name] = (sum(s.get("loss_sum", 0.0) for s in reps)
                            / max(sum(s.get("denominator", 0.0) for s in reps), 1e-30))
        loss: Any = next(iter(losses.values())) if len(losses) == 1 else losses or None
        del self.done[step]
        # The pre-clip global gradient norm: every trainable replica's share (DESIGN 4b).
        shares = [per[r]["grad_sq"] for r in self.trainable_ranks if "grad_sq" in per[r]]
        samples, tokens = self.samples.pop(step, 0), self.tokens.pop(step, 0)
        row = {"step": step, "loss": loss, "samples": samples, "tokens": tokens, "step_time_s": step_time,
               # (last note: --metrics-out had no throughput; TensorBoard had it)
               "samples_per_s": samples / step_time if step_time > 0 else None,
               "tokens_per_s": tokens / step_time if step_time > 0 else None,
               "grad_norm": global_norm(shares) if shares else None, "sections": sections}
        if self.fitter is not None:
            row["costs"] = {n: dataclasses.asdict(c) for n, c in self.costs().costs.items()}
        return row

    def costs(self) -> CostModel:
        """The cost model to plan the next step with: the prior refined by every timing so far."""
        return self.fitter.model() if self.fitter is not None else self.prior


def memory_row(reps: list[dict[str, Any]]) -> dict[str, float]:
    """Per-rank training state of a section (the largest replica; parallel/memory.py), in MiB:
    `state_mb` kept between steps (parameters, reduced gradients, optimizer state), `step_mb`
    held within a step (parameters as used, gradients before reduction, optimizer state), and
    `peak_mb`, the device's allocation peak (CUDA only)."""
    mem = [s.get("memory", {}) for s in reps]
    out: dict[str, float] = {}
    if all("rest_params" in m for m in mem):
        out["state_mb"] = max(m["rest_params"] + m["rest_grads"] + m.get("optimizer", 0) for m in mem) / MiB
        out["step_mb"] = max(m["step_params"] + m["step_grads"] + m.get("optimizer", 0) for m in mem) / MiB
    peaks = [m["peak_mb"] for m in mem if m.get("peak_mb") is not None]
    if peaks:
        out["peak_mb"] = max(peaks)
    return out


def carry_counters(row: dict[str, Any], carried: dict[str, dict[str, float]]) -> None:
    """Add to a step row's stage counters (Stage.stats, counted in the workers since they started)
    those the checkpoint the run resumed from recorded, so that they count over the whole training
    across restarts and resumes (found in review: they started again at 0)."""
    for name, counts in carried.items():
        section = row["sections"].get(name)
        if section is None:
            continue
        stage = section.setdefault("stage", {})
        for key, value in counts.items():
            stage[key] = stage.get(key, 0) + value
