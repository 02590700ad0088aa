"""Control-plane messages and their msgpack codec (maestro_flow/protocol/).

Every message type round-trips with plausible fields; malformed frames fail with ProtocolError;
integer map keys (sample ids, ranks) survive; nothing that is not plain data can be encoded, so
nothing is ever pickled.
"""

from __future__ import annotations

import msgpack
import pytest

from maestro_flow import ArrowData, Edge, Pipeline, Section
from maestro_flow.graph import SectionGraph
from maestro_flow.planner import Placement, make_planner
from maestro_flow.protocol.codec import decode, encode
from maestro_flow.protocol.messages import FIELDS, OPTIONAL, PROTOCOL_VERSION, ProtocolError, check, make
from maestro_flow.runtime.ledger import plan_message
from maestro_flow.samples import SampleMeta
from maestro_flow.timeouts import Timeouts

PIPELINE = Pipeline(
    name="distill", data=ArrowData(path="data/demo/text.arrow"), global_batch=8,
    sections=[Section(name="teacher", stage="stages.lm:CausalLM", config={"role": "teacher"}, trainable=False,
                      dp=1, micro_batch=4),
              Section(name="student", stage="stages.distill:KDStudent", dp=2, micro_batch=2)],
    edges=[Edge(src="teacher", dst="student", tensors=("hidden",))],
)
GRAPH = SectionGraph(PIPELINE)
PLACEMENT = Placement.build(GRAPH.order, {"teacher": 1, "student": 2})
PLAN = make_planner("fifo", GRAPH).plan(
    4, [SampleMeta(id=i, row=100 + i, modalities=frozenset({"text", "image"} if i % 3 == 0 else {"text"}),
                   num_tokens=10 + i) for i in range(8)])

# One plausible message of every type, as its sender builds it (lists, not tuples: msgpack
# gives lists back).
MESSAGES = {
    "hello": {"version": PROTOCOL_VERSION, "rank": 2, "pid": 4242, "data_addr": "tcp://127.0.0.1:40123",
              "host_key": "0b5e4c1a:23:1"},
    "ready": {"rank": 2},
    "heartbeat": {"rank": 0},
    "loss": {"rank": 1, "step": 4, "loss_sum": 123.25, "denominator": 517.0},
    "done": {"rank": 1, "step": 4, "stats": {"busy_s": 0.25, "micro_batches": 2, "samples": 4, "tokens": 300,
                                             "bytes_sent": 0, "max_rss_kb": 812345}},
    "error": {"rank": 1, "kind": "stage", "section": "student", "replica": 0, "step": 4, "phase": "forward",
              "traceback": 'Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad'},
    "bye": {"rank": 2},
    "init": {"rank": 1, "pipeline": PIPELINE.to_dict(), "placement": PLACEMENT.to_dict(),
             "store": ["127.0.0.1", 29500, ""], "peers": {0: "tcp://127.0.0.1:5001", 1: "tcp://127.0.0.1:5002"},
             "timeouts": Timeouts().to_dict(), "paths": ["/work/pipelines", "/work"], "epoch": 1.7e9, "now": None, "trace": False,
             "record": None, "resume": None, "shm": [[0, 1, "fwd"]], "ipc": [[1, 2, "bwd"]]},
    "plan": {k: v for k, v in plan_message(PLAN, GRAPH, "student", 1).items() if k != "t"},
    "finalize": {"step": 4, "denominator": 1034.0},
    "norm": {"rank": 1, "step": 4, "sq": 0.0625},
    "clip": {"step": 4, "coef": 0.5},
    "stop": {"save_dir": None},
    "checkpoint": {"step": 8, "path": "/ckpt/step-00000008"},
    "saved": {"rank": 1, "step": 8, "info": {"params": {"model.head.weight": [260, 64]}}, "error": None},
    "tensors": {"src": 0, "kind": "fwd", "edge": 0, "step": 4,
                "entries": [[3, "hidden", "float32", [7, 16], 0, 0], [5, "hidden", "float32", [9, 16], 0, 112]],
                "buffers": [["float32", 256]], "shm": ["maestro-3f2a-0-7", [0, 448]]},
    "progress": {"src": 2, "step": 4, "finished": 3},
    "release": {"src": 1, "slots": ["maestro-3f2a-0-7"]},
    "ping": {},
}


def test_every_message_type_has_a_sample_here():
    assert set(MESSAGES) == set(FIELDS)


@pytest.mark.parametrize("t", sorted(FIELDS))
def test_round_trip(t):
    msg = make(t, **MESSAGES[t])
    assert {"t", *FIELDS[t]} <= set(msg) <= {"t", *FIELDS[t], *OPTIONAL.get(t, ())}
    frame = encode(msg)
    assert isinstance(frame, bytes)
    assert decode(frame) == msg


def test_init_carries_what_a_worker_rebuilds():
    back = decode(encode(make("init", **MESSAGES["init"])))
    assert Pipeline.from_dict(back["pipeline"]) == PIPELINE
    assert Placement.from_dict(back["placement"]) == PLACEMENT
    assert Timeouts(**back["timeouts"]) == Timeouts()


def test_plan_message_round_trips_with_integer_sample_ids():
    msg = plan_message(PLAN, GRAPH, "teacher", 0)
    back = decode(encode(msg))
    assert back == msg
    assert all(isinstance(sid, int) for routes in back["routes"].values() for sid in routes)


def test_a_plan_may_name_the_cores_for_a_workers_message_threads_checked():
    plan = {**MESSAGES["plan"], "io_cpus": [0, 1]}
    assert decode(encode(make("plan", **plan)))["io_cpus"] == [0, 1]
    with pytest.raises(ProtocolError, match="field 'io_cpus' is int, not list"):
        decode(msgpack.packb({"t": "plan", **plan, "io_cpus": 0}))


def test_a_lockstep_plan_carries_its_rounds_and_probe_checked():
    plan = {**MESSAGES["plan"], "rounds": 3, "probe": [7, 107, ["text"]]}
    assert decode(encode(make("plan", **plan)))["probe"] == [7, 107, ["text"]]
    with pytest.raises(ProtocolError, match="field 'rounds' is str, not int"):
        decode(msgpack.packb({"t": "plan", **plan, "rounds": "3"}))


def test_integer_map_keys_survive():
    msg = make("init", **{**MESSAGES["init"], "peers": {0: "a", 7: "b", -1: "c"}})
    assert decode(encode(msg))["peers"] == {0: "a", 7: "b", -1: "c"}


def test_sets_encode_as_sorted_lists_and_tuples_as_lists():
    msg = make("done", rank=0, step=1, stats={"ids": {5, 1, 3}, "mods": frozenset({"text", "audio", "image"}),
                                              "shape": (2, 3)})
    assert decode(encode(msg))["stats"] == {"ids": [1, 3, 5], "mods": ["audio", "image", "text"], "shape": [2, 3]}


def test_bytes_stay_bytes():
    msg = make("done", rank=0, step=1, stats={"blob": b"\x00\xff"})
    assert decode(encode(msg))["stats"]["blob"] == b"\x00\xff"


class Opaque:
    pass


@pytest.mark.parametrize("value", [Opaque(), object(), ValueError("x"), 1 + 2j, Opaque])
def test_objects_cannot_be_encoded(value):
    # Nothing is pickled: anything that is not plain data is refused at the sender.
    with pytest.raises(TypeError, match="cannot encode"):
        encode({"t": "done", "rank": 0, "step": 0, "stats": {"x": value}})


@pytest.mark.parametrize("frame", [
    b"", b"\xc1", b"\x93\x01", b"\x01\x02", b"\x81", b"\xff" * 16,
    b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94.",  # a pickle: never unpickled
], ids=["empty", "never-used-byte", "truncated-array", "extra-data", "truncated-map", "junk", "pickle"])
def test_garbage_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


@pytest.mark.parametrize(("value", "message"), [
    ([1, 2], "not a message"),
    ({"rank": 1}, "not a message"),
    ("hello", "not a message"),
    ({"t": "bogus", "rank": 1}, "unknown message type 'bogus'"),
    ({"t": None}, "unknown message type None"),
    ({"t": "loss", "rank": 1, "step": 2}, "message 'loss' lacks loss_sum, denominator"),
    ({"t": "loss", "rank": "1", "step": 2, "loss_sum": 1.0, "denominator": 2.0}, "field 'rank' is str, not int"),
    ({"t": "done", "rank": 1, "step": 2.5, "stats": {}}, "field 'step' is float, not int"),
    ({"t": "done", "rank": 1, "step": 2, "stats": [1]}, "field 'stats' is list, not dict"),
    ({"t": "error", "rank": 0, "kind": "stage", "section": "s", "replica": 0, "step": 1, "phase": "p",
      "traceback": None}, "field 'traceback' is NoneType, not str"),
])
def test_valid_msgpack_that_is_not_a_message_raises_protocol_error(value, message):
    with pytest.raises(ProtocolError, match=message):
        decode(msgpack.packb(value))


def test_make_checks_fields_and_extra_fields_are_allowed():
    with pytest.raises(ProtocolError, match="message 'hello' lacks pid, data_addr"):
        make("hello", version=PROTOCOL_VERSION, rank=0)
    with pytest.raises(ProtocolError, match="unknown message type 'helo'"):
        make("helo", rank=0)
    assert check({"t": "ready", "rank": 0, "note": "extra fields are carried"})["note"] == "extra fields are carried"


def test_unhashable_type_tag_raises_protocol_error():
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"t": [1]}))


def test_a_cuda_ipc_header_carries_its_handles_as_bytes_and_round_trips():
    """transport/cuda_ipc.py: the first message through a device slot carries its IPC handles
    (bytes and integers only), later ones None in their place."""
    first = make("tensors", src=0, kind="fwd", edge=0, step=4, entries=[[3, "hidden", "float32", [7, 16], 0, 0]],
                 buffers=[["float32", 112]], ipc=["ipc-0-1", [0], [0, b"\x01" * 64, 1 << 20, 0, b"ref", 0, b"", True,
                                                                  b"\x02" * 64]])
    assert decode(encode(first)) == first
    later = {**first, "ipc": ["ipc-0-1", [0], None]}
    assert check(decode(encode(later))) == later
    with pytest.raises(ProtocolError):
        check({**first, "ipc": "ipc-0-1"})
