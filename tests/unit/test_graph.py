"""The section graph (maestro_flow/graph.py): structural checks, order, routing helpers, losses.

Graphs are written as edge lists; `S(...)` is a section with a stage path that is never imported.
"""

from __future__ import annotations

import pytest

from maestro_flow import ArrowData, Edge, Pipeline, PipelineError, Section
from maestro_flow.graph import SectionGraph


def S(name: str, **kw) -> Section:
    return Section(name=name, stage=f"stages.fake:{name.title()}", **kw)


def E(src: str, dst: str, *tensors: str) -> Edge:
    return Edge(src=src, dst=dst, tensors=tensors or (f"{src}_out",))


def graph(sections, edges=()) -> SectionGraph:
    return SectionGraph(Pipeline(name="g", data=ArrowData(path="d"), sections=sections, edges=edges))


def distill(teacher_dp: int = 1, student_dp: int = 2) -> SectionGraph:
    return graph([S("teacher", trainable=False, dp=teacher_dp, micro_batch=8), S("student", dp=student_dp)],
                 [E("teacher", "student", "hidden")])


# -- structural errors ---------------------------------------------------------------------


@pytest.mark.parametrize(("sections", "edges", "message"), [
    pytest.param([S("a"), S("a")], [], r"^sections: duplicate section name 'a'$", id="duplicate-section"),
    pytest.param([S("a", trainable=False), S("b")], [E("a", "ghost")],
                 r"^edges\[0\] \(a -> ghost\)\.dst: unknown section 'ghost' \(sections: a, b\)$",
                 id="unknown-dst"),
    pytest.param([S("a", trainable=False), S("b")], [E("a", "b"), E("ghost", "b")],
                 r"^edges\[1\] \(ghost -> b\)\.src: unknown section 'ghost'", id="unknown-src"),
    pytest.param([S("a")], [E("a", "a")], r"^edges\[0\] \(a -> a\): an edge cannot connect a section to itself",
                 id="self-edge"),
    pytest.param([S("a", trainable=False), S("b")], [E("a", "b", "x"), E("a", "b", "y")],
                 r"^edges\[1\] \(a -> b\): duplicate edge", id="duplicate-edge"),
    pytest.param([S("a", trainable=False), S("b")], [Edge(src="a", dst="b", tensors=())],
                 r"^edges\[0\] \(a -> b\)\.tensors must name at least one tensor", id="no-tensors"),
    pytest.param([S("a", trainable=False), S("b", trainable=False), S("c", trainable=False)],
                 [E("a", "b"), E("b", "c"), E("c", "b")],
                 r"^edges: the section graph has a cycle through b, c$", id="cycle"),
    pytest.param([S("a", trainable=False, dp=2), S("b", dp=3)], [E("a", "b")],
                 r"^edges\[0\] \(a -> b\): sections\.a\.dp=2 and sections\.b\.dp=3 must be multiples of one another",
                 id="dp-2-3"),
    pytest.param([S("a", trainable=False, dp=4), S("b", dp=6)], [E("a", "b")],
                 r"sections\.a\.dp=4 and sections\.b\.dp=6", id="dp-4-6"),
    pytest.param([S("enc"), S("head", trainable=False)], [E("enc", "head")],
                 r"^sections\.enc: trainable, but no loss downstream", id="trainable-without-loss"),
    pytest.param([S("enc"), S("llm"), S("aux")], [E("enc", "llm"), E("enc", "aux", "z")],
                 r"^sections\.enc: receives gradients from several losses \(llm, aux\)", id="two-losses"),
    pytest.param([S("src", trainable=False), S("x", trainable=False), S("y", trainable=False), S("sink")],
                 [E("src", "x"), E("src", "y", "w"), E("x", "sink"), E("y", "sink")],
                 r"^edges: y->sink closes an undirected cycle", id="diamond"),
    pytest.param([S("a", trainable=False), S("b", trainable=False), S("c")],
                 [E("a", "c", "h"), E("b", "c", "h")],
                 r"^edges: tensor 'h' reaches 'c' from both 'a' and 'b'; rename one of them$", id="tensor-twice"),
    pytest.param([S("a", trainable=False), S("c")], [E("a", "c", "h", "h")],  # found in QA: "rename one of them"
                 r"^edges\[0\] \(a -> c\)\.tensors: 'h' listed twice; list each tensor once$", id="tensor-twice-in-one"),
])
def test_structural_errors_name_what_to_change(sections, edges, message):
    with pytest.raises(PipelineError, match=message):
        graph(sections, edges)


def test_pipeline_validate_runs_the_graph_checks():
    p = Pipeline(name="g", data=ArrowData(path="d"), sections=[S("a"), S("a")])
    with pytest.raises(PipelineError, match="duplicate section name 'a'"):
        p.validate()


@pytest.mark.parametrize(("src_dp", "dst_dp"), [(1, 1), (1, 2), (1, 4), (2, 4), (4, 2), (4, 1), (3, 6), (6, 2)])
def test_multiple_or_divisor_dp_degrees_are_accepted(src_dp, dst_dp):
    distill(src_dp, dst_dp)


# -- order and structure -------------------------------------------------------------------


def test_topological_order_follows_edges_then_declaration_order():
    g = graph([S("llm"), S("audio", trainable=False), S("vision", trainable=False), S("tok", trainable=False)],
              [E("vision", "llm"), E("tok", "vision"), E("audio", "llm")])
    assert g.order == ["audio", "tok", "vision", "llm"]
    assert g.sinks() == ["llm"] and g.loss_sections() == ["llm"]
    assert [e.edge.src for e in g.inputs("llm")] == ["vision", "audio"]
    assert [e.edge.dst for e in g.outputs("tok")] == ["vision"]


def test_disconnected_sections_are_allowed_and_each_sink_is_a_loss():
    g = graph([S("a"), S("b")])
    assert g.order == ["a", "b"] and g.loss_sections() == ["a", "b"]


def test_frozen_sinks_are_not_losses():
    g = distill()
    assert g.sinks() == ["student"] and g.loss_sections() == ["student"]
    g = graph([S("teacher", trainable=False)])
    assert g.sinks() == ["teacher"] and g.loss_sections() == []


def test_carries_grad_only_between_trainable_ends():
    g = graph([S("teacher", trainable=False), S("enc"), S("llm")],
              [E("teacher", "llm", "t"), E("enc", "llm", "e")])
    carries = {e.edge.name: e.carries_grad for e in g.edges}
    assert carries == {"teacher->llm": False, "enc->llm": True}
    assert [e.edge.name for e in g.needs_grad_from("enc")] == ["enc->llm"]
    assert g.needs_grad_from("teacher") == []


def test_loss_sections_of():
    g = graph([S("vision"), S("proj"), S("llm"), S("teacher", trainable=False), S("aux")],
              [E("vision", "proj"), E("proj", "llm"), E("teacher", "llm")])
    assert g.loss_sections_of("vision") == ["llm"]
    assert g.loss_sections_of("proj") == ["llm"]
    assert g.loss_sections_of("llm") == ["llm"]
    assert g.loss_sections_of("teacher") == []
    assert g.loss_sections_of("aux") == ["aux"]


# -- fan-out / fan-in routing helpers ------------------------------------------------------


@pytest.mark.parametrize(("src_dp", "dst_dp", "fanout", "fanin", "producer_of", "consumers_of"), [
    # producer_of: consumer replica -> allowed producers; consumers_of: producer replica -> allowed consumers
    (1, 2, 2, 1, [[0], [0]], [[0, 1]]),
    (1, 4, 4, 1, [[0], [0], [0], [0]], [[0, 1, 2, 3]]),
    (2, 4, 2, 1, [[0], [0], [1], [1]], [[0, 1], [2, 3]]),
    (4, 2, 1, 2, [[0, 1], [2, 3]], [[0], [0], [1], [1]]),
    (4, 1, 1, 4, [[0, 1, 2, 3]], [[0], [0], [0], [0]]),
    (2, 2, 1, 1, [[0], [1]], [[0], [1]]),
])
def test_fanout_fanin_routing(src_dp, dst_dp, fanout, fanin, producer_of, consumers_of):
    (e,) = distill(src_dp, dst_dp).edges
    assert (e.src_dp, e.dst_dp, e.fanout, e.fanin) == (src_dp, dst_dp, fanout, fanin)
    assert [list(e.producer_of(r)) for r in range(dst_dp)] == producer_of
    assert [list(e.consumers_of(r)) for r in range(src_dp)] == consumers_of


@pytest.mark.parametrize(("src_dp", "dst_dp"), [(1, 2), (1, 4), (2, 4), (4, 2), (4, 1), (3, 6), (6, 3), (2, 2)])
def test_producer_of_and_consumers_of_are_inverse(src_dp, dst_dp):
    (e,) = distill(src_dp, dst_dp).edges
    for p in range(src_dp):
        for c in range(dst_dp):
            assert (c in e.consumers_of(p)) == (p in e.producer_of(c))
    # Every consumer has a producer and every producer a consumer: no replica is left out.
    assert all(len(e.producer_of(c)) >= 1 for c in range(dst_dp))
    assert all(len(e.consumers_of(p)) >= 1 for p in range(src_dp))


# -- readable forms ------------------------------------------------------------------------


def test_describe():
    assert distill().describe() == (
        "[teacher] stages.fake:Teacher  frozen  activates_on=all  dp=1  micro_batch=8  device=cpu\n"
        "[student] stages.fake:Student  trainable  activates_on=all  dp=2  micro_batch=1  device=cpu\n"
        "  teacher --[hidden]--> student  fan-out 2"
    )


def test_describe_marks_fan_in_and_gradients():
    g = graph([S("vision", dp=4, activates_on="image"), S("llm", dp=2)], [E("vision", "llm", "patches", "mask")])
    assert g.describe().splitlines()[-1] == "  vision --[patches, mask]--> llm  fan-in 2  (+grad back)"
    assert "activates_on=image" in g.describe().splitlines()[0]
