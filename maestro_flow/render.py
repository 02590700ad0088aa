"""Drawing the section graph: a text form for the terminal, Graphviz DOT, and SVG/PNG files.

`text_form(graph)` lays the sections out top to bottom in topological order, one ASCII box each
(stage, trainable/frozen, activates_on, dp, tp where > 1, fsdp where set, micro-batch, device,
inputs), with the edges between the boxes (tensors, fan-out/fan-in factor, whether gradients
flow back), then a one-line summary of every edge. `to_dot(graph)` is the same graph in DOT:
frozen sections dashed and grey, conditional sections (`activates_on`) in orange, loss sections
bold, gradient-carrying edges double-headed. `render(dot_text, path)` writes a file whose format
follows the suffix: `.dot`/`.gv` is the DOT itself, `.svg`/`.png` run Graphviz's `dot`; without
Graphviz it writes the DOT next to the requested file and says so in the result's `note` instead
of failing.

Standard library only (Graphviz is an optional external program, found on PATH).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from maestro_flow.errors import MaestroError, PipelineError
from maestro_flow.graph import EdgeInfo, SectionGraph
from maestro_flow.wording import count

DOT_SUFFIXES = (".dot", ".gv")
GRAPHVIZ_SUFFIXES = (".svg", ".png")
SUFFIXES = DOT_SUFFIXES + GRAPHVIZ_SUFFIXES
DOT_TIMEOUT_S = 60.0


class GraphvizError(MaestroError):
    """Graphviz's `dot` was found but failed or timed out."""


# -- facts shared by both forms ------------------------------------------------------------


def mode(graph: SectionGraph, name: str) -> str:
    return "trainable" if graph.sections[name].trainable else "frozen"


def fsdp(graph: SectionGraph, name: str) -> str:
    """How an FSDP section shards (found in QA: the graph did not show fsdp at all)."""
    s = graph.sections[name]
    what = "params, grads, optimizer state" if s.trainable else "params"
    how = "per unit and micro-batch" if graph.lockstep(name) and s.tp == 1 else "for the step"
    return f"{s.dp}-way ({what}), gathered {how}"


def activates(graph: SectionGraph, name: str) -> str:
    on = graph.sections[name].activates_on
    return f"{on} (only samples carrying {on})" if on else "all (every sample)"


def ratio(e: EdgeInfo) -> str:
    """The short form used by SectionGraph.describe(): 'fan-out 2', 'fan-in 2' or '1:1'."""
    if e.fanout > 1:
        return f"fan-out {e.fanout}"
    if e.fanin > 1:
        return f"fan-in {e.fanin}"
    return "1:1"


def ratio_detail(e: EdgeInfo) -> str:
    src, dst = e.edge.src, e.edge.dst
    if e.fanout > 1:
        return f"fan-out {e.fanout}: each {src} replica feeds {e.fanout} {dst} replicas (dp {e.src_dp} -> {e.dst_dp})"
    if e.fanin > 1:
        return f"fan-in {e.fanin}: each {dst} replica takes from {e.fanin} {src} replicas (dp {e.src_dp} -> {e.dst_dp})"
    return f"1:1: replica i of {src} feeds replica i of {dst} (dp {e.src_dp} -> {e.dst_dp})"


def gradient(graph: SectionGraph, e: EdgeInfo) -> str:
    src, dst = e.edge.src, e.edge.dst
    if e.carries_grad:
        return f"gradients flow back {dst} -> {src}"
    frozen = [n for n in (src, dst) if not graph.sections[n].trainable]
    return f"forward only (no gradients: {' and '.join(frozen)} frozen)"


def edge_summary(e: EdgeInfo) -> str:
    """One line per edge, in the form SectionGraph.describe() uses."""
    grad = "  (+grad back)" if e.carries_grad else ""
    return f"{e.edge.src} --[{', '.join(e.edge.tensors)}]--> {e.edge.dst}  {ratio(e)}{grad}"


# -- the terminal form ---------------------------------------------------------------------


def _box(title: str, rows: list[tuple[str, str]], width: int) -> list[str]:
    """An ASCII box `width` characters wide (borders included) with the title in its top border."""
    inner = width - 4
    top = f"+-- {title} "
    lines = [top + "-" * (width - len(top) - 1) + "+"]
    key_w = max(len(k) for k, _ in rows)
    for key, value in rows:
        lines.append(f"| {f'{key:<{key_w}}  {value}':<{inner}} |")
    lines.append("+" + "-" * (width - 2) + "+")
    return lines


def _section_rows(graph: SectionGraph, name: str) -> list[tuple[str, str]]:
    s = graph.sections[name]
    inputs = ", ".join(f"{e.edge.src} ({', '.join(e.edge.tensors)})" for e in graph.inputs(name)) or "- (reads the data)"
    rows = [("stage", s.stage), ("mode", mode(graph, name)), ("activates_on", activates(graph, name)),
            ("dp", count(s.dp, "replica")),
            *([("tp", f"{s.tp} ranks per replica ({s.dp * s.tp} workers)")] if s.tp > 1 else []),
            *([("fsdp", fsdp(graph, name))] if s.fsdp else []),
            ("micro_batch", str(s.micro_batch)), ("device", s.device), ("inputs", inputs)]
    if name in graph.loss_sections():
        rows.append(("loss", "yes (trainable sink)"))
    return rows


def text_form(graph: SectionGraph) -> str:
    """The graph for a terminal: boxes in topological order joined by labelled arrows, plain ASCII."""
    p = graph.pipeline
    n_sec, n_edge = len(graph.order), len(graph.edges)
    workers = sum(s.dp * s.tp for s in graph.sections.values())  # a replica is tp ranks, each a worker
    lines = [f"pipeline {p.name}: {count(n_sec, 'section')}, {count(n_edge, 'edge')}, "
             f"{count(workers, 'worker')} (topological order)", ""]
    rows = {n: _section_rows(graph, n) for n in graph.order}
    content = max(max(len(k) for k, _ in r) + 2 + max(len(v) for _, v in r) for r in rows.values())
    width = max(content + 4, max(len(n) for n in graph.order) + 8, 40)
    for i, name in enumerate(graph.order):
        lines += _box(name, rows[name], width)
        following = graph.order[i + 1] if i + 1 < len(graph.order) else None
        # The edge into the next box last, so its arrow points straight down at it.
        outs = sorted(graph.outputs(name), key=lambda e: e.edge.dst == following)
        for j, e in enumerate(outs):
            lines += ["    |",
                      f"    |  {e.edge.src} -> {e.edge.dst}: {', '.join(e.edge.tensors)}",
                      f"    |  {ratio_detail(e)}",
                      f"    |  {gradient(graph, e)}"]
            if e.edge.dst == following:
                lines.append("    v")
            else:
                lines.append(f"    +--> {e.edge.dst} (below)")
                if j == len(outs) - 1:
                    lines.append("")
        if not graph.outputs(name) and following is not None:
            lines.append("")  # a source or sink without an arrow: keep the boxes apart
    while lines[-1] == "":
        lines.pop()
    lines += ["", "edges:" if graph.edges else "edges: none"]
    lines += [f"  {edge_summary(e)}" for e in graph.edges]
    losses = graph.loss_sections()
    lines.append(f"loss: {', '.join(losses)}" if losses else "loss: none (no trainable sink)")
    return "\n".join(lines)


# -- DOT -----------------------------------------------------------------------------------


def _q(text: str) -> str:
    """A DOT double-quoted string (labels use \\n for line breaks, added after quoting)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _label(*lines: str) -> str:
    return _q("\n".join(lines)).replace("\n", "\\n")


TRAINABLE_FILL = "#dbe9f6"
FROZEN_FILL = "#eeeeee"
CONDITIONAL_COLOR = "#d9730d"
GRAD_COLOR = "#1f4e79"
FORWARD_COLOR = "#555555"


def to_dot(graph: SectionGraph) -> str:
    """The graph in Graphviz DOT, styled: frozen dashed/grey, activates_on orange, gradients double-headed."""
    p = graph.pipeline
    legend = ("blue = trainable, dashed grey = frozen", "orange border = activates_on a modality, bold = loss",
              "double-headed blue edge = gradients flow back")
    lines = [
        "digraph sections {",
        "  rankdir=LR;",
        f"  graph [label={_label(f'pipeline {p.name}', *legend)}, labelloc=b, fontname=\"Helvetica\", fontsize=10];",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11, margin="0.2,0.1"];',
        '  edge [fontname="Helvetica", fontsize=10];',
    ]
    losses = set(graph.loss_sections())
    for n in graph.order:
        s = graph.sections[n]
        label = _label(n + ("  (loss)" if n in losses else ""), s.stage,
                       f"{mode(graph, n)}, activates_on={s.activates_on or 'all'}",
                       f"dp={s.dp}{f'  tp={s.tp}' if s.tp > 1 else ''}{'  fsdp' if s.fsdp else ''}  "
                       f"micro_batch={s.micro_batch}  "
                       f"device={s.device}")
        attrs = [f"label={label}"]
        if s.trainable:
            attrs.append(f'fillcolor="{TRAINABLE_FILL}"')
        else:
            attrs += ['style="rounded,filled,dashed"', f'fillcolor="{FROZEN_FILL}"']
        if s.activates_on:
            attrs += [f'color="{CONDITIONAL_COLOR}"', "penwidth=2"]
        if n in losses:
            attrs.append("penwidth=2.5")
        lines.append(f"  {_q(n)} [{', '.join(attrs)}];")
    for e in graph.edges:
        label = _label(", ".join(e.edge.tensors), f"{ratio(e)} (dp {e.src_dp} -> {e.dst_dp})",
                       *(["+ grad back"] if e.carries_grad else []))
        attrs = [f"label={label}"]
        if e.carries_grad:
            attrs += ["dir=both", "arrowtail=onormal", f'color="{GRAD_COLOR}"', f'fontcolor="{GRAD_COLOR}"']
        else:
            attrs += [f'color="{FORWARD_COLOR}"']
        lines.append(f"  {_q(e.edge.src)} -> {_q(e.edge.dst)} [{', '.join(attrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- files ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rendered:
    """What `render` wrote: the file, its format, and a note when it fell back to DOT."""

    path: Path
    format: str  # "dot", "svg" or "png"
    note: str | None = None  # set when the requested format could not be produced


def check_suffix(path: str | os.PathLike[str]) -> str:
    """The output format for `path` from its suffix; a PipelineError for one we cannot write."""
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise PipelineError(f"--output {os.fspath(path)}: unsupported file type {suffix or '(no suffix)'!r}; "
                            f"use one of {', '.join(SUFFIXES)}")
    return "dot" if suffix in DOT_SUFFIXES else suffix[1:]


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as export -o does (found in review: refused)
        path.write_text(text)
    except OSError as exc:
        raise PipelineError(f"cannot write {path}: {exc.strerror or exc}") from exc


def render(dot_text: str, path: str | os.PathLike[str], *, timeout_s: float = DOT_TIMEOUT_S) -> Rendered:
    """Write `dot_text` to `path` in the format its suffix names (.dot/.gv, .svg, .png).

    SVG and PNG need Graphviz's `dot` on PATH. Without it the DOT is written to `path` with `.dot`
    added (g.svg.dot: found in QA, g.dot replaced a file of that name, perhaps edited by hand), and
    the returned `note` says so (no exception: the DOT is still the graph). A `dot` that fails or runs past `timeout_s` raises GraphvizError, leaving no partial file.
    """
    out = Path(path)
    fmt = check_suffix(out)
    if fmt == "dot":
        _write(out, dot_text)
        return Rendered(out, "dot")
    exe = shutil.which("dot")
    if exe is None:
        fallback = out.with_name(out.name + ".dot")
        _write(fallback, dot_text)
        return Rendered(fallback, "dot", note=(
            f"Graphviz is not installed (no `dot` on PATH), so {out} was not drawn; the DOT was written to "
            f"{fallback} instead (install graphviz, then: dot -T{fmt} {fallback} -o {out})"))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run([exe, f"-T{fmt}", "-o", str(out)], input=dot_text.encode(), capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out.unlink(missing_ok=True)
        raise GraphvizError(f"Graphviz `dot -T{fmt}` did not finish within {timeout_s:g}s drawing {out}") from exc
    except OSError as exc:
        raise GraphvizError(f"could not run Graphviz `{exe}`: {exc}") from exc
    if proc.returncode != 0:
        out.unlink(missing_ok=True)
        detail = proc.stderr.decode(errors="replace").strip().splitlines()
        raise GraphvizError(f"Graphviz `dot -T{fmt}` failed (exit {proc.returncode}) drawing {out}"
                            + (f": {detail[-1]}" if detail else ""))
    return Rendered(out, fmt)
