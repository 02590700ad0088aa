"""The section graph: sections as nodes, edges carrying named per-sample tensors.

Pure (standard library only). Owns the structural checks (duplicate names, unknown edge ends,
cycles, dp degrees across an edge) and the derived facts the planner and runtime need
(topological order, fan-out/fan-in factors, which edges carry gradients, which sections end in a
loss). Knows nothing of processes, devices or data.
"""

from __future__ import annotations

from dataclasses import dataclass

from maestro_flow.config import Edge, Pipeline, Section
from maestro_flow.errors import PipelineError


@dataclass(frozen=True, kw_only=True, slots=True)
class EdgeInfo:
    """An edge plus the facts derived from its two ends."""

    index: int
    edge: Edge
    src_dp: int
    dst_dp: int
    carries_grad: bool  # both ends trainable: gradients flow dst -> src

    @property
    def fanout(self) -> int:
        """Consumer replicas per producer replica (1 when fan-in or equal)."""
        return max(1, self.dst_dp // self.src_dp)

    @property
    def fanin(self) -> int:
        """Producer replicas per consumer replica (1 when fan-out or equal)."""
        return max(1, self.src_dp // self.dst_dp)

    def producer_of(self, dst_replica: int) -> range:
        """Producer replicas allowed to serve consumer replica `dst_replica` (default routing)."""
        if self.src_dp <= self.dst_dp:
            return range(dst_replica // self.fanout, dst_replica // self.fanout + 1)
        return range(dst_replica * self.fanin, (dst_replica + 1) * self.fanin)

    def consumers_of(self, src_replica: int) -> range:
        """Consumer replicas that producer replica `src_replica` may serve (default routing)."""
        if self.src_dp <= self.dst_dp:
            return range(src_replica * self.fanout, (src_replica + 1) * self.fanout)
        return range(src_replica // self.fanin, src_replica // self.fanin + 1)


class SectionGraph:
    """Validated structure of a pipeline's sections and edges."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.sections: dict[str, Section] = {}
        for s in pipeline.sections:
            if s.name in self.sections:
                raise PipelineError(f"sections: duplicate section name {s.name!r}")
            self.sections[s.name] = s
        self.edges: list[EdgeInfo] = []
        seen: set[tuple[str, str]] = set()
        for i, e in enumerate(pipeline.edges):
            where = f"edges[{i}] ({e.src} -> {e.dst})"
            for end in ("src", "dst"):
                name = getattr(e, end)
                if name not in self.sections:
                    raise PipelineError(
                        f"{where}.{end}: unknown section {name!r} (sections: {', '.join(self.sections)})"
                    )
            if e.src == e.dst:
                raise PipelineError(f"{where}: an edge cannot connect a section to itself")
            if (e.src, e.dst) in seen:
                raise PipelineError(f"{where}: duplicate edge; list all its tensors in one Edge")
            seen.add((e.src, e.dst))
            if isinstance(e.tensors, str):
                raise PipelineError(f"{where}.tensors must be a tuple of names, got the string {e.tensors!r} "
                                    f"(write tensors=({e.tensors!r},))")
            if not e.tensors or not all(isinstance(t, str) and t for t in e.tensors):
                raise PipelineError(f"{where}.tensors must name at least one tensor")
            twice = sorted({t for t in e.tensors if e.tensors.count(t) > 1})  # found in QA: "rename one of them"
            if twice:
                raise PipelineError(f"{where}.tensors: {', '.join(map(repr, twice))} listed twice; list each tensor once")
            src, dst = self.sections[e.src], self.sections[e.dst]
            if src.dp % dst.dp and dst.dp % src.dp:
                raise PipelineError(
                    f"{where}: sections.{e.src}.dp={src.dp} and sections.{e.dst}.dp={dst.dp} must be "
                    "multiples of one another (fan-out or fan-in); change one of them"
                )
            self.edges.append(EdgeInfo(index=i, edge=e, src_dp=src.dp, dst_dp=dst.dp,
                                       carries_grad=src.trainable and dst.trainable))
        for name in self.sections:
            arriving: dict[str, str] = {}
            for e in self.inputs(name):
                for t in e.edge.tensors:
                    if t in arriving:
                        raise PipelineError(f"edges: tensor {t!r} reaches {name!r} from both {arriving[t]!r} "
                                            f"and {e.edge.src!r}; rename one of them")
                    arriving[t] = e.edge.src
        self.order = self._topological_order()
        self._losses = tuple(n for n in self.order if not self.outputs(n) and self.sections[n].trainable)
        self._check_routing_tree()
        self._check_loss_groups()

    # -- structure -------------------------------------------------------------------------

    def inputs(self, name: str) -> list[EdgeInfo]:
        return [e for e in self.edges if e.edge.dst == name]

    def outputs(self, name: str) -> list[EdgeInfo]:
        return [e for e in self.edges if e.edge.src == name]

    def carried(self, name: str) -> dict[str, str]:
        """Each tensor section `name`'s outgoing edges carry -> the name of the edge carrying it
        (what stage.output_problem checks a forward's outputs for)."""
        return {t: e.edge.name for e in self.outputs(name) for t in e.edge.tensors}

    def sinks(self) -> list[str]:
        """Sections with no outgoing edge, in topological order."""
        return [n for n in self.order if not self.outputs(n)]

    def lockstep(self, name: str) -> bool:
        """Whether section `name`'s FSDP gathers per micro-batch, its replicas in lockstep
        (parallel/fsdp.py): fsdp at tp=1, and either frozen and fed by no other section (a
        teacher) or a loss section (each forward's backward follows at once: a student, an LLM)."""
        section = self.sections[name]
        if not section.fsdp or section.tp != 1:
            return False
        return name in self._losses if section.trainable else not self.inputs(name)

    def loss_sections(self) -> list[str]:
        """Trainable sinks: each must return a loss (checked against the stage in runtime/checks)."""
        return list(self._losses)

    def drops_loss(self, name: str) -> bool:
        """Whether a "loss" section `name` returns is read by nothing: a trainable section that is
        not a loss section, and sends no "loss" on an edge (the checks warn of a declared one, the
        executor and the baseline of one returned)."""
        return self.sections[name].trainable and name not in self._losses and "loss" not in self.carried(name)

    def _topological_order(self) -> list[str]:
        indegree = {n: 0 for n in self.sections}
        for e in self.edges:
            indegree[e.edge.dst] += 1
        ready = [n for n in self.sections if indegree[n] == 0]
        order: list[str] = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for e in self.outputs(n):
                indegree[e.edge.dst] -= 1
                if indegree[e.edge.dst] == 0:
                    ready.append(e.edge.dst)
        if len(order) != len(self.sections):
            stuck = [n for n in self.sections if n not in order]
            raise PipelineError(f"edges: the section graph has a cycle through {', '.join(stuck)}")
        return order

    def _check_routing_tree(self) -> None:
        # Routing derives every section's replica from its neighbour's along the edges. With an
        # undirected cycle (a diamond) two paths could demand different replicas for one sample.
        parent = {n: n for n in self.sections}

        def find(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for e in self.edges:
            a, b = find(e.edge.src), find(e.edge.dst)
            if a == b:
                raise PipelineError(
                    f"edges: {e.edge.name} closes an undirected cycle in the section graph; "
                    "routing across such cycles is not supported yet (merge the parallel paths into one edge)"
                )
            parent[a] = b

    def _check_loss_groups(self) -> None:
        # Gradients are divided by the global loss denominator after the backward passes. A
        # trainable section whose gradients come from two different losses would need two
        # different denominators, so it must reach exactly one loss through trainable edges.
        for name in self.order:
            if not self.sections[name].trainable:
                continue
            losses = self.loss_sections_of(name)
            if not losses:
                raise PipelineError(
                    f"sections.{name}: trainable, but no loss downstream sends it gradients "
                    "(set trainable=False, or connect it to a trainable consumer)"
                )
            if len(losses) > 1:
                raise PipelineError(
                    f"sections.{name}: receives gradients from several losses ({', '.join(losses)}); "
                    "only one loss per trainable section is supported"
                )

    def loss_sections_of(self, name: str) -> list[str]:
        """The loss sections whose gradients reach `name` (itself if it is one)."""
        if name in self.loss_sections():
            return [name]
        found: list[str] = []
        for e in self.outputs(name):
            if e.carries_grad:
                for loss in self.loss_sections_of(e.edge.dst):
                    if loss not in found:
                        found.append(loss)
        return found

    def needs_grad_from(self, name: str) -> list[EdgeInfo]:
        """Outgoing edges whose consumer sends gradients back to `name`."""
        return [e for e in self.outputs(name) if e.carries_grad]

    def describe(self) -> str:
        """A readable text form of the graph (for `maestro graph` and error messages)."""
        lines = []
        for n in self.order:
            s = self.sections[n]
            mode = "trainable" if s.trainable else "frozen"
            act = s.activates_on or "all"
            lines.append(f"[{n}] {s.stage}  {mode}  activates_on={act}  dp={s.dp}  micro_batch={s.micro_batch}"
                         f"  device={s.device}")
        for e in self.edges:
            ratio = f"fan-out {e.fanout}" if e.fanout > 1 else f"fan-in {e.fanin}" if e.fanin > 1 else "1:1"
            grad = "  (+grad back)" if e.carries_grad else ""
            lines.append(f"  {e.edge.src} --[{', '.join(e.edge.tensors)}]--> {e.edge.dst}  {ratio}{grad}")
        return "\n".join(lines)
