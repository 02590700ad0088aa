"""Drawing the section graph (maestro_flow/render.py) and `maestro graph -o FILE`.

The graphs are those of pipelines/distill.py and pipelines/vlm.py (built from their config
records; no data is read). SVG/PNG tests need Graphviz's `dot` and skip without it; the
"Graphviz is not installed" path is tested by emptying PATH, and `dot` failing or hanging by a
fake `dot` script on PATH, so those run everywhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from maestro_flow import ArrowData, Edge, Pipeline, PipelineError, Section
from maestro_flow.cli import main
from maestro_flow.graph import SectionGraph
from maestro_flow.render import GraphvizError, check_suffix, render, text_form, to_dot
from pipelines import distill, vlm

ROOT = Path(__file__).resolve().parents[2]
HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="Graphviz `dot` is not installed (apt-get install graphviz)")


@pytest.fixture(autouse=True)
def restore_sys_path(monkeypatch):
    # Loading a pipeline file puts its folder on sys.path (as the CLI must); keep tests independent.
    monkeypatch.setattr(sys, "path", list(sys.path))


def graph_of(module) -> SectionGraph:
    return SectionGraph(module.pipeline())


def box(text: str, name: str) -> dict[str, str]:
    """The rows of section `name`'s box in the text form, as {key: value}."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"+-- {name} -"))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("+"):
            break
        assert line.startswith("| ") and line.endswith(" |"), line
        key, _, value = line[2:-2].strip().partition("  ")
        rows[key] = value.strip()
    return rows


def no_graphviz(monkeypatch, tmp_path) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))
    assert shutil.which("dot") is None


def fake_dot(monkeypatch, tmp_path, body: str) -> None:
    """Put a `dot` on PATH that runs the shell `body` (Graphviz present but misbehaving)."""
    folder = tmp_path / "fake-bin"
    folder.mkdir(exist_ok=True)
    script = folder / "dot"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:/usr/bin:/bin")
    assert shutil.which("dot") == str(script)


# -- the text form ---------------------------------------------------------------------------


@pytest.mark.parametrize("module", [distill, vlm], ids=["distill", "vlm"])
def test_text_form_shows_every_section_and_edge_with_its_facts(module):
    g = graph_of(module)
    text = text_form(g)
    assert text.isascii()
    assert text.splitlines()[0].startswith(f"pipeline {g.pipeline.name}: {len(g.order)} sections, ")
    # Boxes in topological order, one per section, every fact shown.
    starts = [text.index(f"+-- {n} -") for n in g.order]
    assert starts == sorted(starts)
    for name in g.order:
        s = g.sections[name]
        rows = box(text, name)
        assert rows["stage"] == s.stage
        assert rows["mode"] == ("trainable" if s.trainable else "frozen")
        assert rows["activates_on"].split()[0] == (s.activates_on or "all")
        assert rows["dp"].split()[0] == str(s.dp)
        assert rows["micro_batch"] == str(s.micro_batch)
        assert rows["device"] == s.device
    # Every edge: between the boxes with its tensors, factor and gradients, and in the summary.
    for e in g.edges:
        src, dst = e.edge.src, e.edge.dst
        assert f"|  {src} -> {dst}: {', '.join(e.edge.tensors)}" in text
        assert f"  {src} --[{', '.join(e.edge.tensors)}]--> {dst}  " in text
        assert e.edge.src in box(text, dst)["inputs"]
    # All boxes have the same width.
    assert len({len(line) for line in text.splitlines() if line.startswith(("+--", "| "))}) == 1


def test_text_form_of_distill():
    text = text_form(graph_of(distill))
    assert box(text, "teacher")["mode"] == "frozen" and box(text, "student")["mode"] == "trainable"
    assert box(text, "teacher")["micro_batch"] == "8" and box(text, "student")["dp"] == "2 replicas"
    assert "|  fan-out 2: each teacher replica feeds 2 student replicas (dp 1 -> 2)" in text
    assert "|  forward only (no gradients: teacher frozen)" in text
    assert "  teacher --[hidden]--> student  fan-out 2\n" in text  # no "(+grad back)": the teacher is frozen
    assert text.endswith("loss: student")


def test_text_form_of_vlm():
    text = text_form(graph_of(vlm))
    assert box(text, "vision")["activates_on"] == "image (only samples carrying image)"
    assert box(text, "llm")["activates_on"] == "all (every sample)"
    assert box(text, "llm")["loss"].startswith("yes")
    assert "|  gradients flow back llm -> vision\n    v\n+-- llm -" in text
    assert "  vision --[image_embeds]--> llm  fan-out 2  (+grad back)" in text


def test_a_tensor_parallel_section_counts_every_rank():
    # Reproduced before: with student tp=2 the header said 3 workers (the sum of dp) where
    # `maestro validate` said 5 (dp * tp), and no box showed the tp.
    g = SectionGraph(distill.pipeline().override(**{"sections.student.tp": 2}))
    text = text_form(g)
    assert text.splitlines()[0] == "pipeline distill: 2 sections, 1 edge, 5 workers (topological order)"
    assert box(text, "student")["tp"] == "2 ranks per replica (4 workers)"
    assert "tp" not in box(text, "teacher")  # tp 1: no row
    assert "dp=2  tp=2  micro_batch=2  device=cpu" in to_dot(g)


def test_fsdp_sections_say_how_they_shard():
    """Found in QA: `maestro graph` never showed fsdp."""
    g = SectionGraph(distill.pipeline().override(**{"sections.student.tp": 2, "sections.student.fsdp": True,
                                                     "sections.teacher.dp": 2, "sections.teacher.fsdp": True}))
    text = text_form(g)
    assert box(text, "teacher")["fsdp"] == "2-way (params), gathered per unit and micro-batch"
    assert box(text, "student")["fsdp"] == "2-way (params, grads, optimizer state), gathered for the step"
    assert "dp=2  tp=2  fsdp  micro_batch=2" in to_dot(g)
    assert "fsdp" not in box(text_form(SectionGraph(distill.pipeline())), "student")


def test_text_form_branches_and_fan_in():
    S = lambda name, **kw: Section(name=name, stage=f"m:{name.title()}", **kw)  # noqa: E731
    g = SectionGraph(Pipeline(name="fork", data=ArrowData(path="d"),
                              sections=[S("a", trainable=False, dp=4), S("b", dp=2), S("c", dp=2, device="cuda")],
                              edges=[Edge(src="a", dst="c", tensors=("h2", "m")), Edge(src="a", dst="b", tensors=("h",))]))
    text = text_form(g)
    assert g.order == ["a", "c", "b"]
    # a's edge into the box right below it (c, edges[0]) is drawn last, pointing down; the other says where it goes.
    assert "    +--> b (below)\n    |\n    |  a -> c: h2, m\n" in text and "\n    v\n+-- c -" in text
    assert "|  fan-in 2: each c replica takes from 2 a replicas (dp 4 -> 2)" in text
    assert box(text, "c")["device"] == "cuda"
    assert text.endswith("loss: c, b")


# -- DOT -------------------------------------------------------------------------------------


def balanced(text: str) -> bool:
    depth = 0
    for ch in re.sub(r'"(?:[^"\\]|\\.)*"', '""', text):  # braces inside strings do not count
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


@pytest.mark.parametrize("module", [distill, vlm], ids=["distill", "vlm"])
def test_dot_has_every_node_and_edge_with_labels(module):
    g = graph_of(module)
    dot = to_dot(g)
    assert dot.startswith("digraph sections {\n") and dot.endswith("}\n") and balanced(dot)
    nodes = dict(re.findall(r'^  "(\w+)" \[(.*)\];$', dot, re.M))
    edges = {(a, b): attrs for a, b, attrs in re.findall(r'^  "(\w+)" -> "(\w+)" \[(.*)\];$', dot, re.M)}
    assert set(nodes) == set(g.order) and set(edges) == {(e.edge.src, e.edge.dst) for e in g.edges}
    for name, attrs in nodes.items():
        s = g.sections[name]
        assert f"\\n{s.stage}\\n" in attrs and f"dp={s.dp}  micro_batch={s.micro_batch}  device={s.device}" in attrs
        assert f"activates_on={s.activates_on or 'all'}" in attrs
        assert ("dashed" in attrs) == (not s.trainable)
    for e in g.edges:
        attrs = edges[(e.edge.src, e.edge.dst)]
        assert f'label="{", ".join(e.edge.tensors)}\\n' in attrs
        assert ("dir=both" in attrs) == e.carries_grad == ("grad back" in attrs)


def test_dot_facts_of_distill_and_vlm():
    d = to_dot(graph_of(distill))
    assert '"teacher" -> "student" [label="hidden\\nfan-out 2 (dp 1 -> 2)", color=' in d
    assert 'trainable, activates_on=all' in d and 'frozen, activates_on=all' in d
    v = to_dot(graph_of(vlm))
    assert '"vision" -> "llm" [label="image_embeds\\nfan-out 2 (dp 1 -> 2)\\n+ grad back", dir=both' in v
    assert re.search(r'"vision" \[label="vision\\n.*activates_on=image.*color="#d9730d"', v)
    assert '"llm" [label="llm  (loss)\\n' in v


def test_dot_quotes_strings():
    g = SectionGraph(Pipeline(name='say "hi" {x}', data=ArrowData(path="d"),
                              sections=[Section(name="a", stage='m:A"\\')]))
    dot = to_dot(g)
    assert 'pipeline say \\"hi\\" {x}' in dot and 'm:A\\"\\\\' in dot and balanced(dot)


@needs_dot
@pytest.mark.parametrize("module", [distill, vlm], ids=["distill", "vlm"])
def test_graphviz_accepts_the_dot(module):
    out = subprocess.run(["dot", "-Tcanon"], input=to_dot(graph_of(module)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and not out.stderr, out.stderr


# -- render(dot, path) -----------------------------------------------------------------------


def test_check_suffix():
    assert [check_suffix(p) for p in ("g.dot", "g.GV", "g.svg", "dir/g.png")] == ["dot", "dot", "svg", "png"]
    with pytest.raises(PipelineError, match=r"unsupported file type '.pdf'; use one of .dot, .gv, .svg, .png"):
        check_suffix("g.pdf")
    with pytest.raises(PipelineError, match=r"'\(no suffix\)'"):
        check_suffix("graph")


def test_render_dot(tmp_path):
    done = render("digraph g {}\n", tmp_path / "g.dot")
    assert (done.path, done.format, done.note) == (tmp_path / "g.dot", "dot", None)
    assert done.path.read_text() == "digraph g {}\n"
    assert render("digraph g {}\n", tmp_path / "missing" / "g.dot").path.is_file()  # its folder made
    (tmp_path / "file").write_text("")
    with pytest.raises(PipelineError, match="cannot write"):
        render("digraph g {}\n", tmp_path / "file" / "g.dot")


@pytest.mark.parametrize("suffix", [".svg", ".png"])
def test_render_without_graphviz_writes_dot_instead(tmp_path, monkeypatch, suffix):
    no_graphviz(monkeypatch, tmp_path)
    (tmp_path / "g.dot").write_text("digraph mine {}\n")  # found in QA: replaced without a word
    done = render("digraph g {}\n", tmp_path / f"g{suffix}")
    fallback = tmp_path / f"g{suffix}.dot"
    assert done.path == fallback and done.format == "dot" and done.path.read_text() == "digraph g {}\n"
    assert not (tmp_path / f"g{suffix}").exists() and (tmp_path / "g.dot").read_text() == "digraph mine {}\n"
    assert "Graphviz is not installed" in done.note and f"written to {fallback}" in done.note
    assert f"dot -T{suffix[1:]} {fallback} -o {tmp_path / f'g{suffix}'}" in done.note


def test_render_reports_a_failing_dot(tmp_path, monkeypatch):
    fake_dot(monkeypatch, tmp_path, 'echo "Error: <stdin>: syntax error in line 1" >&2; exit 1')
    with pytest.raises(GraphvizError, match=r"`dot -Tsvg` failed \(exit 1\) .*: Error: <stdin>: syntax error"):
        render("digraph {", tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


def test_render_times_out_a_hanging_dot(tmp_path, monkeypatch):
    fake_dot(monkeypatch, tmp_path, "exec sleep 30")
    with pytest.raises(GraphvizError, match=r"did not finish within 0.5s"):
        render("digraph g {}\n", tmp_path / "g.png", timeout_s=0.5)


@needs_dot
def test_render_svg_and_png(tmp_path):
    dot = to_dot(graph_of(vlm))
    svg = render(dot, tmp_path / "g.svg")
    assert (svg.format, svg.note) == ("svg", None)
    text = svg.path.read_text()
    assert "<svg" in text and "image_embeds" in text and "stages.vision:VisionEncoder" in text
    png = render(dot, tmp_path / "g.png")
    assert png.path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


# -- maestro graph ---------------------------------------------------------------------------


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_graph_prints_the_text_form():
    result = invoke("graph", ROOT / "pipelines" / "vlm.py")
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == text_form(graph_of(vlm))


def test_cli_graph_warns_of_a_stage_it_cannot_import():
    """Found in QA: drawn in silence, exit 0; it is still drawn (graph shows what is written)."""
    result = invoke("graph", ROOT / "pipelines" / "distill.py", "--set", "sections.student.stage=nowhere:Missing")
    assert result.exit_code == 0, result.output
    assert "+-- student" in result.stdout
    assert result.stderr.startswith("warning: sections.student.stage: cannot import 'nowhere:Missing'")
    assert invoke("graph", ROOT / "pipelines" / "distill.py").stderr == ""


def test_cli_graph_writes_dot(tmp_path):
    out = tmp_path / "x.dot"
    result = invoke("graph", ROOT / "pipelines" / "distill.py", "--set", "sections.student.dp=4", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(f"wrote {out}\n") and "fan-out 4" in result.stdout
    dot = out.read_text()
    assert dot == to_dot(SectionGraph(distill.pipeline(sections__student__dp=4)))
    assert '"teacher" -> "student" [label="hidden\\nfan-out 4 (dp 1 -> 4)"' in dot


@needs_dot
def test_cli_graph_writes_svg(tmp_path):
    out = tmp_path / "x.svg"
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(f"wrote {out}\n") and result.stderr == ""
    assert "<svg" in out.read_text() and not (tmp_path / "x.dot").exists()


def test_cli_graph_without_graphviz_falls_back_to_dot(tmp_path, monkeypatch):
    no_graphviz(monkeypatch, tmp_path)
    out = tmp_path / "x.svg"
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("warning: Graphviz is not installed (no `dot` on PATH)")
    assert f"the DOT was written to {tmp_path / 'x.svg.dot'}" in result.stderr
    assert result.stdout.endswith(f"wrote {tmp_path / 'x.svg.dot'}\n")
    assert not out.exists() and (tmp_path / "x.svg.dot").read_text() == to_dot(graph_of(vlm))


def test_cli_graph_refuses_an_unknown_suffix(tmp_path):
    out = tmp_path / "x.pdf"
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", out)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: --output {out}: unsupported file type '.pdf'; use one of .dot, .gv, .svg, .png"]
    assert not out.exists()


def test_cli_graph_makes_the_folders_of_its_output_and_refuses_a_path_it_cannot_write(tmp_path):
    """Found in review: a missing folder was an error after the whole graph was printed."""
    out = tmp_path / "new" / "deeper" / "x.dot"
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_text() == to_dot(graph_of(vlm))
    (tmp_path / "file").write_text("")
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", tmp_path / "file" / "x.dot")
    assert result.exit_code == 2 and result.stdout == ""  # refused before the graph is printed
    assert result.stderr == f"error: --output {tmp_path / 'file' / 'x.dot'}: {tmp_path / 'file'} is a file, not a folder\n"


def test_cli_graph_reports_a_failing_dot(tmp_path, monkeypatch):
    fake_dot(monkeypatch, tmp_path, "echo boom >&2; exit 3")
    result = invoke("graph", ROOT / "pipelines" / "vlm.py", "-o", tmp_path / "x.png")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip().endswith("failed (exit 3) drawing " + str(tmp_path / "x.png") + ": boom")
