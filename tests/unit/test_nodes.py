"""Several nodes (runtime/nodes.py): torchrun's flags, Slurm's node rank, and rank placement
that keeps a tensor-parallel group on one node."""

from __future__ import annotations

import json

import pytest

from maestro_flow.errors import PipelineError, SystemFailure
from maestro_flow.planner.plan import Placement
from maestro_flow.runtime.nodes import Nodes


def test_flags_and_slurm():
    n = Nodes.from_options(2, 1, "10.0.0.1:29400", None, environ={})
    assert (n.nnodes, n.node_rank, n.endpoint, n.multi) == (2, 1, ("10.0.0.1", 29400), True)
    assert Nodes.from_options(4, None, "h:1", 2, environ={"SLURM_NODEID": "3"}).node_rank == 3
    assert Nodes.from_options(1, None, None, None, environ={}) == Nodes()


@pytest.mark.parametrize(("args", "message"), [
    ((2, None, "h:1", None), "--node-rank is needed"),
    ((2, 2, "h:1", None), "--node-rank 2 is outside 0..1"),
    ((2, 0, None, None), "--rdzv-endpoint HOST:PORT is needed"),
    ((2, 0, "nohost", None), "must be HOST:PORT"),
    ((2, 0, "h:1", 0), "--nproc-per-node must be at least 1"),
    ((1, 1, "h:1", None), "--node-rank 1 is for a run over several nodes: add --nnodes"),  # it trained alone
    ((0, 0, "h:1", None), "--nnodes must be at least 1"),
])
def test_bad_flags_are_refused(args, message):
    with pytest.raises(PipelineError, match=message):
        Nodes.from_options(*args, environ={})


def test_a_tensor_parallel_group_stays_on_one_node():
    # teacher dp 1 (rank 0), student dp 2 x tp 2 (ranks 1 2 | 3 4): 5 ranks on 2 nodes of 3.
    placement = Placement.build(["teacher", "student"], {"teacher": 1, "student": 2}, tp={"student": 2})
    node_of = Nodes(nnodes=2, node_rank=0, endpoint=("h", 1), nproc_per_node=3).assign(placement)
    assert node_of == {0: 0, 1: 0, 2: 0, 3: 1, 4: 1}
    node_of = Nodes(nnodes=3, node_rank=0, endpoint=("h", 1), nproc_per_node=2).assign(placement)
    assert node_of == {0: 0, 1: 1, 2: 1, 3: 2, 4: 2}  # the pair 1 2 is not split across nodes 0 and 1


def test_layouts_that_do_not_fit_are_refused():
    placement = Placement.build(["teacher", "student"], {"teacher": 1, "student": 2}, tp={"student": 2})
    with pytest.raises(PipelineError, match="sections.student.tp=2 does not fit on one node of 1 ranks"):
        Nodes(nnodes=5, node_rank=0, endpoint=("h", 1), nproc_per_node=1).assign(placement)
    with pytest.raises(PipelineError, match="more than 2 nodes of 2 hold"):
        Nodes(nnodes=2, node_rank=0, endpoint=("h", 1), nproc_per_node=2).assign(placement)


def test_what_an_agent_compares_with_node_0():
    """A node whose pipeline or secret differs from node 0's is refused before its workers start,
    naming the keys that differ (runtime/agent.py)."""
    from maestro_flow.runtime.agent import canonical, differences
    from maestro_flow.runtime.sealing import sealed, store_key, unsealed

    node0 = {"steps": 2, "seed": 0, "sections": [{"name": "teacher", "dp": 1}, {"name": "student", "dp": 2}]}
    here = {"steps": 4, "seed": 0, "sections": [{"name": "teacher", "dp": 1}, {"name": "student", "dp": 1}]}
    assert differences(here, node0) == ["sections.student.dp (1 here, 2 on node 0)", "steps (4 here, 2 on node 0)"]
    assert differences(node0, node0) == [] and canonical(node0) == canonical(dict(reversed(node0.items())))
    key = store_key(b"s" * 32)
    value = sealed(key, "maestro/attempt/S", canonical(node0)).encode()
    assert unsealed(key, "maestro/attempt/S", value) == canonical(node0)
    assert unsealed(store_key(b"t" * 32), "maestro/attempt/S", value) is None  # another secret
    assert unsealed(key, "maestro/attempt/T", value) is None  # moved to another key
    assert unsealed(key, "maestro/attempt/S", value.replace(b'"steps": 2', b'"steps": 3')) is None
    assert unsealed(key, "maestro/attempt/S", canonical(node0).encode()) is None  # not sealed at all


def test_pinned_cores_per_node():
    from maestro_flow.runtime.cpus import pinned

    assert pinned([2, 5], [0, 1, 2, 3]) == {2: {"cpus": [0, 1], "threads": 2}, 5: {"cpus": [2, 3], "threads": 2}}
    assert pinned([], [0, 1]) == {}


def test_nodes_agree_on_what_their_workers_use_not_on_node_0s_planning(tmp_path, monkeypatch):
    """The same data file named relative here and absolute on node 0 is the same pipeline, and so
    are costs only node 0's planner reads (`--costs` there alone); both were refused."""
    from maestro_flow.runtime.agent import comparable, differences

    monkeypatch.chdir(tmp_path)
    node0 = {"data": {"path": str(tmp_path / "d.arrow")}, "plan_search": 0.5, "steps": 2,
             "sections": [{"name": "student", "dp": 2, "cost": {"per_sample_s": 0.002}}]}
    here = {"data": {"path": "d.arrow"}, "plan_search": 0.0, "steps": 2,
            "sections": [{"name": "student", "dp": 2, "cost": {"per_sample_s": 0.0001}}]}
    assert differences(comparable(here), comparable(node0)) == []
    here["sections"][0]["dp"] = 1
    assert differences(comparable(here), comparable(node0)) == ["sections.student.dp (1 here, 2 on node 0)"]


def test_a_node_is_held_by_one_live_agent_for_the_whole_run(monkeypatch):
    """An agent holds its node from its start to the run's end, its beat raised by a thread of
    its own (so no teardown between attempts lets a second agent in). A second agent with the
    same node rank stops at its claim, having done nothing; an agent whose holder's beat stands
    still takes the node over (a killed node that comes back), and an agent that finds its node
    taken over (its beat stood still while it ran on) ends, saying so."""
    import threading

    import torch.distributed as dist

    from maestro_flow.runtime import agent as agent_mod
    from maestro_flow.runtime.nodes import rendezvous
    from maestro_flow.timeouts import Timeouts

    monkeypatch.setattr(agent_mod, "BEAT_WAIT_S", 1.0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", store.port))
    answers, rkey = _node0(store, b"s")

    def agent():
        return agent_mod.Agent(nodes, secret=b"s", host="127.0.0.1", interface=None, timeouts=Timeouts(),
                               worker_log=lambda name: None, log=lambda text: None)

    first, ended = agent(), []

    def run_first():
        try:
            first.run()
        except Exception as exc:  # noqa: BLE001 (what the agent ends with is the point)
            ended.append(exc)

    running = threading.Thread(target=run_first, daemon=True)
    running.start()
    try:
        _until(lambda: store.check(["maestro/node/1"]))
        assert store.get("maestro/node/1").decode() == first.me
        second = agent()
        with pytest.raises(PipelineError, match=r"node 1 of this run already has an agent \(.*\): give each node"):
            second._claim(rendezvous(nodes, 10))
        assert store.get("maestro/node/1").decode() == first.me
        store.set("maestro/node/1", "a killed agent")  # nothing beats for it
        back = agent()
        back._claim(rendezvous(nodes, 10))
        assert store.get("maestro/node/1").decode() == back.me
        running.join(10)  # before: it ran on beside the agent that took its node over
        assert not running.is_alive()
        assert len(ended) == 1 and isinstance(ended[0], SystemFailure), ended
        assert "node 1 was taken over by another agent (" in str(ended[0])
    finally:
        store.set("maestro/job", agent_mod.sealed(rkey, "maestro/job", "done"))
        running.join(10)
        answers.close()
    assert not running.is_alive()


@pytest.mark.parametrize("lost", ["running", "ended"])
def test_an_agent_taking_a_node_over_joins_only_a_later_attempt(monkeypatch, lost):
    """A killed agent's node taken over: the attempt it ran workers for is lost, still running
    (node 0 has not noticed yet) or ended; the newcomer starts workers for the next one only
    (it started them for the lost attempt, beside its ranks' dead ones)."""
    import threading
    import time

    import torch.distributed as dist

    from maestro_flow.runtime import agent as agent_mod
    from maestro_flow.timeouts import Timeouts

    _Started.boots = []
    monkeypatch.setattr(agent_mod, "BEAT_WAIT_S", 0.5)
    monkeypatch.setattr(agent_mod, "Launcher", _Started)
    monkeypatch.setattr(agent_mod, "claim", lambda session: type("Owner", (), {"close": lambda self: None})())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    info = {"node_of": {"0": 0, "1": 1}, "address": "tcp://127.0.0.1:1", "timeouts": {}, "devices": ["cpu", "cpu"],
            "workers": {"1": ["s", 0, "s0", "s[0]"]}}
    store.set("maestro/node/1", "a killed agent")  # nothing beats for it
    answers, key = _node0(store, b"s")
    agent_mod.publish_attempt(store, key, "S1", info)
    if lost == "running":
        store.set("maestro/in/1", "S1")  # it had started S1's workers
    else:
        agent_mod.end_attempt(store, key, "S1", "failed: a worker of node 1 died")
    nodes = Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", store.port))
    agent = agent_mod.Agent(nodes, secret=b"s", host="127.0.0.1", interface=None, timeouts=Timeouts(),
                            worker_log=lambda name: None, log=lambda text: None)
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        time.sleep(1.5)
        assert _Started.boots == [] and store.get("maestro/node/1").decode() == agent.me
        agent_mod.publish_attempt(store, key, "S2", info)
        _until(lambda: _Started.boots)
        assert [b["session"] for b in _Started.boots] == ["S2"]
    finally:
        agent_mod.end_attempt(store, key, "S2", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)
        answers.close()
    assert not running.is_alive()


class _Started:
    """A Launcher that records the workers an agent would start (no processes)."""

    boots: list = []

    def __init__(self, entry):
        pass

    def start(self, rank, section, replica, boot):
        _Started.boots.append(boot)

    def dead(self):
        return []

    def join(self, timeout):
        pass

    def shutdown(self, grace, kill):
        pass


def _until(condition, timeout_s=5.0):
    """Wait (bounded) until `condition()` holds; the assertion after it says what was awaited."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def _node0(store, secret, run="a1"):
    """Node 0's side of the rendezvous: answers agents' challenges with the run id `run`. Returns
    (the answering thread, to close; this run's key, which seals node 0's values)."""
    from maestro_flow.runtime.sealing import Answers, run_key, store_key

    return Answers(("127.0.0.1", store.port), 2, store_key(secret), run), run_key(store_key(secret), run, store.port)


@pytest.fixture
def node0():
    """_node0, closed after the test."""
    made = []

    def make(store, secret=b"s" * 20, run="a1"):
        made.append(_node0(store, secret, run))
        return made[-1][1]

    yield make
    for answers, _ in made:
        answers.close()


def _agent_on_a_store(monkeypatch, secret=b"s" * 20):
    import torch.distributed as dist

    from maestro_flow.runtime import agent as agent_mod
    from maestro_flow.timeouts import Timeouts

    _Started.boots = []
    monkeypatch.setattr(agent_mod, "Launcher", _Started)
    monkeypatch.setattr(agent_mod, "claim", lambda session: type("Owner", (), {"close": lambda self: None})())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", store.port))
    logged: list[str] = []
    agent = agent_mod.Agent(nodes, secret=secret, host="127.0.0.1", interface=None, timeouts=Timeouts(startup_s=20),
                            worker_log=lambda name: name, log=logged.append)
    return agent_mod, store, agent, logged


INFO = {"node_of": {"0": 0, "1": 1}, "address": "tcp://127.0.0.1:1", "timeouts": {}, "devices": ["cpu", "cpu"],
        "workers": {"1": ["s", 0, "s-0", "s[0]"]}}


def test_an_attempt_the_store_holds_unsealed_starts_nothing(monkeypatch, node0):
    """Found in review: any client of the rendezvous store could publish an attempt (no verifier
    needed) whose workers connected to the client's address and logged to workers/../../FILE."""
    import threading
    import time

    agent_mod, store, agent, logged = _agent_on_a_store(monkeypatch)
    key = node0(store)
    forged = {**INFO, "workers": {"1": ["s", 0, "../../../escaped", "x\nINJECTED"]}}
    store.set("maestro/attempt/abc123", json.dumps(forged))
    store.set("maestro/attempt", "abc123")
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    time.sleep(1.0)
    assert running.is_alive() and _Started.boots == []  # ignored, said once
    assert sum("ignored maestro/attempt in the rendezvous store" in line for line in logged) == 1, logged
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
    running.join(10)
    assert not running.is_alive() and _Started.boots == []
    # A note no one of this run sealed is not a lost worker; one that is sealed is shown escaped.
    store.set("maestro/lost/S9", "worker s[0] on node 1 was killed by SIGKILL")
    assert agent_mod.lost_error(store, key, "S9") is None
    store.set("maestro/lost/S9", agent_mod.sealed(key, "maestro/lost/S9", "worker x\x1b[2J died"))
    assert str(agent_mod.lost_error(store, key, "S9")) == "worker x\\x1b[2J died"


def test_a_node_whose_secret_differs_refuses_node_0s_attempt_and_node_0_says_so(monkeypatch, node0):
    """Node 0's answer to the agent's challenge does not open with this node's secret: the agent
    refuses node 0's attempt at once, and node 0 shows the refusal (which it cannot open either)."""
    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    key = node0(store, secret=b"t" * 20)  # node 0's secret differs
    agent_mod.publish_attempt(store, key, "abc123", INFO)
    with pytest.raises(PipelineError, match=r"node 1's control-plane secret differs from node 0's \(the run's attempt"):
        agent.run()
    assert _Started.boots == []
    lost = agent_mod.lost_error(store, key, "abc123")
    assert isinstance(lost, PipelineError) and "not sealed with this node's secret" in str(lost)


def test_values_of_an_earlier_run_with_the_same_secret_are_not_acted_on(monkeypatch, node0):
    """Found in review: sealed store values were not bound to one run, so an earlier run's
    "done" (or attempt) with the same secret, written into a later run's store, ended (or
    redirected) its agents. Each run's values are sealed under a key of that run, which an agent
    learns only from node 0's answer to its own challenge; a replayed answer is not taken."""
    import threading
    import time

    from maestro_flow.runtime.sealing import answer_name, run_key, sealed, store_key

    agent_mod, store, agent, logged = _agent_on_a_store(monkeypatch)
    old = run_key(store_key(b"s" * 20), "0ld", store.port)  # the earlier run's key: same secret, another run id
    store.set(answer_name(1), sealed(store_key(b"s" * 20), answer_name(1), f"c0ffee 0ld {store.port}"))  # replayed
    store.set("maestro/job", sealed(old, "maestro/job", "done"))
    agent_mod.publish_attempt(store, old, "S0", INFO)
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    time.sleep(1.0)
    assert running.is_alive() and _Started.boots == [] and agent.rkey is None  # the old answer named another challenge
    key = node0(store, run="a2")
    _until(lambda: agent.rkey is not None)
    assert agent.rkey == key
    time.sleep(0.5)
    assert running.is_alive() and _Started.boots == []  # the old run's job and attempt do not open
    assert any("ignored maestro/job" in line for line in logged) and any("ignored maestro/attempt" in line
                                                                          for line in logged), logged
    agent_mod.publish_attempt(store, key, "S1", INFO)
    _until(lambda: _Started.boots)
    assert [b["session"] for b in _Started.boots] == ["S1"]
    agent_mod.end_attempt(store, key, "S1", "done")
    store.set("maestro/job", sealed(key, "maestro/job", "done"))
    running.join(10)
    assert not running.is_alive()


def test_node_0s_answer_is_bound_to_the_agents_challenge():
    from maestro_flow.runtime.sealing import DIFFERS, answer_name, read_answer, sealed, store_key

    skey = store_key(b"s" * 20)
    good = sealed(skey, answer_name(1), "c0ffee a1 29400").encode()
    assert read_answer(skey, 1, "c0ffee", 29400, good) == "a1"
    assert read_answer(skey, 1, "beef", 29400, good) is None  # another agent's (or a replayed) answer: wait
    assert read_answer(skey, 1, "c0ffee", 29401, good) is None  # another store's, relayed (review): wait
    assert read_answer(store_key(b"t" * 20), 1, "c0ffee", 29400, good) == DIFFERS  # this node's secret differs
    assert read_answer(skey, 2, "c0ffee", 29400, good) == DIFFERS  # moved to node 2's key: does not open either
    assert read_answer(skey, 1, "c0ffee", 29400, sealed(skey, answer_name(1), "c0ffee ../x 29400").encode()) is None


def test_a_sealed_attempt_with_a_worker_name_that_is_not_a_file_name_is_refused(monkeypatch, node0):
    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    agent_mod.publish_attempt(store, node0(store), "S1", {**INFO, "workers": {"1": ["s", 0, "../escaped", "s[0]"]}})
    with pytest.raises(PipelineError, match="names a worker '../escaped', which is not a file name"):
        agent.run()
    assert _Started.boots == []


def test_unsealed_values_do_not_stop_a_running_attempt(monkeypatch, node0):
    """Found in review: setting maestro/attempt to anything made node 1's agent stop the workers of
    the running attempt and wait for an attempt that never came; a forged end or job too."""
    import threading
    import time

    agent_mod, store, agent, logged = _agent_on_a_store(monkeypatch)
    key = node0(store)
    agent_mod.publish_attempt(store, key, "S1", INFO)
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        _until(lambda: _Started.boots)
        assert [b["session"] for b in _Started.boots] == ["S1"] and _Started.boots[0]["log"] == "s-0"
        store.set("maestro/attempt", "bogus")
        store.set("maestro/end/S1", "failed: forged")
        store.set("maestro/job", "failed: forged")
        time.sleep(1.0)
        assert running.is_alive()  # still in S1
        assert any("ignored maestro/attempt in the rendezvous store" in line for line in logged), logged
        agent_mod.end_attempt(store, key, "S1", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)
        assert not running.is_alive()
    finally:
        agent_mod.end_attempt(store, key, "S1", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)


@pytest.fixture
def abandoning():
    """Tests that make nodes.bounded give a call up: the flag it sets would make the CLI's error
    paths end the test process (nodes.exit_code), so it is cleared after."""
    from maestro_flow.runtime import nodes as nodes_mod

    yield nodes_mod
    nodes_mod.ABANDONED.clear()


def test_an_agent_gives_up_on_a_store_that_stops_answering(abandoning):
    """Found in review: with node 0 frozen (SIGSTOP) or cut off without a reset, an agent's store
    call blocked for good: node 1 ran on after its workers had left."""
    import threading
    import time

    from maestro_flow.runtime.agent import Agent
    from maestro_flow.timeouts import Timeouts

    agent = Agent(Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", 1)), secret=b"s" * 20, host="127.0.0.1",
                  interface=None, timeouts=Timeouts(coordinator_timeout_s=1.0), worker_log=lambda name: None)
    frozen = threading.Event()
    start = time.monotonic()
    with pytest.raises(SystemFailure, match=r"lost node 0 .*its rendezvous store did not answer for 1s"):
        agent._ask(lambda keys: frozen.wait(), ["maestro/job"])
    assert time.monotonic() - start < 5 and abandoning.ABANDONED.is_set()
    frozen.set()


def test_joining_an_endpoint_where_something_else_listens_is_bounded(abandoning):
    """Found in review: a listener that accepts and never answers (not node 0's store) held node 1's
    connect for good; node 0 alone was reported only after twice its startup timeout."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        start = time.monotonic()
        with pytest.raises(PipelineError, match=r"node 0 did not answer within 2s"):
            abandoning.rendezvous(Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", silent.getsockname()[1])), 2.0)
        assert time.monotonic() - start < 10
    finally:
        silent.close()


def test_a_node_started_with_another_nnodes_is_refused(monkeypatch, node0):
    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    agent_mod.publish_attempt(store, node0(store), "S1", {**INFO, "nnodes": 3})
    with pytest.raises(PipelineError, match="node 1 was started with --nnodes 2, node 0 with --nnodes 3"):
        agent.run()
    assert _Started.boots == []


def test_an_interrupted_agent_tells_node_0_within_a_bound(monkeypatch, abandoning):
    """Ctrl-C on node I > 0 while node 0 does not answer: the agent's note to node 0 is given up
    after a bound (it waited for good), and the interrupt goes on."""
    import threading
    import time
    import types

    agent_mod, _, agent, _ = _agent_on_a_store(monkeypatch)
    frozen = threading.Event()

    class Store:  # node 0's store, answering until the interrupt, then frozen
        def check(self, keys):
            return False

        def get(self, name):
            return agent.me.encode()

        def set(self, name, value):
            if name.startswith(("maestro/lost/", "maestro/bye/")):
                frozen.wait()

    def interrupted(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(agent_mod, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=interrupted))
    monkeypatch.setattr(agent_mod, "INTERRUPT_STORE_S", 0.5)
    agent.rkey = b"k" * 32
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        agent._attempt(Store(), "S1", INFO)
    assert time.monotonic() - start < 5 and [b["session"] for b in _Started.boots] == ["S1"]
    frozen.set()


def test_a_node_whose_code_or_data_differs_from_node_0s_is_refused(monkeypatch, node0):
    """The settings agree, the files do not (runtime/fingerprint.py): refused before any worker
    starts, naming them; node 0 shows why."""
    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    key = node0(store)
    agent.files = {"code": {"stages/vision.py": "1", "pipeline file": "2"}, "data": {"vlm.arrow": "size 9 sha256 a"},
                   "versions": {"torch": "2.13.0"}}
    theirs = {"code": {"stages/vision.py": "X", "pipeline file": "2"}, "data": {"vlm.arrow": "size 9 sha256 a"},
              "versions": {"torch": "2.11.0"}}
    agent_mod.publish_attempt(store, key, "S1", {**INFO, "files": theirs})
    with pytest.raises(PipelineError, match=r"node 1's files differ from node 0's \(install the same code and copy "
                                            r"the same data to every node\): code: stages/vision.py \(differs\); "
                                            r"versions: torch 2.13.0 here, 2.11.0 on node 0"):
        agent.run()
    assert _Started.boots == []
    assert "node 1's files differ from node 0's" in str(agent_mod.lost_error(store, key, "S1"))


def test_a_bug_after_a_given_up_store_call_ends_with_os_exit(monkeypatch, abandoning):
    """After nodes.bounded gave a store call up, any error ends `maestro run` with os._exit (its
    traceback shown first), not only a MaestroError: a normal exit with the given-up call still
    inside torch's C++ code can abort."""
    import os

    from click.testing import CliRunner

    from maestro_flow import cli
    from maestro_flow.runtime import run as run_mod

    given_up = [False, True]  # the first run gives a store call up, the second does not

    def run_pipeline(path, options):
        if given_up.pop():
            abandoning.ABANDONED.set()
        raise RuntimeError("a bug in the run")

    def os_exit(code):
        raise SystemExit(f"os._exit({code})")

    monkeypatch.setattr(run_mod, "run_pipeline", run_pipeline)
    monkeypatch.setattr(os, "_exit", os_exit)
    result = CliRunner().invoke(cli.main, ["run", "pipelines/distill.py", "--no-run-dir", "--quiet"])
    assert result.exit_code == 1 and "os._exit(1)" in str(result.exception), (result.output, result.exception)
    assert "RuntimeError: a bug in the run" in result.output
    abandoning.ABANDONED.clear()
    result = CliRunner().invoke(cli.main, ["run", "pipelines/distill.py", "--no-run-dir", "--quiet"])
    assert isinstance(result.exception, RuntimeError)  # no call given up: raised as before


def test_another_live_run_with_the_same_secret_cannot_answer_for_this_one(monkeypatch, node0):
    """Found in review: a store client copied the agent's challenge into another live run's store
    (same secret), and that run's answer and "done" back: the agent took the other run's key and
    ended. The answer names its store's port, and the run key is bound to it."""
    import threading
    import time

    import torch.distributed as dist

    from maestro_flow.runtime.sealing import answer_name, ask_name, sealed

    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # run A, live
    key_a = node0(other, run="a9")
    other.set("maestro/job", sealed(key_a, "maestro/job", "done"))
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    _until(lambda: store.check([ask_name(1)]))
    other.set(ask_name(1), store.get(ask_name(1)))  # the relay
    _until(lambda: other.check([answer_name(1)]))
    store.set(answer_name(1), other.get(answer_name(1)))
    store.set("maestro/job", other.get("maestro/job"))
    time.sleep(1.0)
    assert running.is_alive() and agent.rkey is None  # before: ended on run A's "done"
    key = node0(store, run="b2")  # this run's node 0 answers
    _until(lambda: agent.rkey is not None)
    assert agent.rkey == key and running.is_alive()
    store.set("maestro/job", sealed(key, "maestro/job", "done"))
    running.join(10)
    assert not running.is_alive()


def test_a_node_ranked_past_node_0s_nnodes_is_refused_at_once(monkeypatch, node0):
    """Found in review: node 0 answers nodes 1..nnodes-1 only, so a node started with a larger
    --nnodes and a rank past node 0's count waited out startup and checkpoint timeouts."""
    import time

    from maestro_flow.runtime import agent as agent_mod
    from maestro_flow.timeouts import Timeouts

    _, store, _, _ = _agent_on_a_store(monkeypatch)
    node0(store)  # nnodes 2
    agent = agent_mod.Agent(Nodes(nnodes=3, node_rank=2, endpoint=("127.0.0.1", store.port)), secret=b"s" * 20,
                            host="127.0.0.1", interface=None, timeouts=Timeouts(startup_s=60),
                            worker_log=lambda name: name, log=lambda text: None)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"node 2 was started with --nnodes 3, node 0 with --nnodes 2 \(so the "
                                            r"rendezvous store says\): give every node the same --nnodes"):
        agent.run()
    assert time.monotonic() - start < 10 and _Started.boots == []


def test_node_0_answers_after_a_store_client_wrote_garbage(monkeypatch, node0):
    """Found in review: a counter of asks set to something not a number ended node 0's answering
    thread for good (there is no counter now); nor does garbage in another node's ask stop it."""
    agent_mod, store, agent, _ = _agent_on_a_store(monkeypatch)
    store.set("maestro/asked", "not a number")
    store.set("maestro/ask/0", "../x")
    key = node0(store)
    agent_mod.publish_attempt(store, key, "S1", INFO)
    agent_mod.end_attempt(store, key, "S1", "done")
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
    agent.run()  # answered, read the end: returns
    assert agent.rkey == key


def test_an_earlier_attempts_pointer_written_back_is_ignored(monkeypatch, node0):
    """Found in review: within one run, a copy of attempt 1's pointer written back opened and
    stopped attempt 2's workers. The pointer carries the attempt's number."""
    import threading
    import time

    agent_mod, store, agent, logged = _agent_on_a_store(monkeypatch)
    key = node0(store)
    agent_mod.publish_attempt(store, key, "S1", {**INFO, "attempt": 0})
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        _until(lambda: len(_Started.boots) == 1)
        first = store.get("maestro/attempt")
        agent_mod.end_attempt(store, key, "S1", "failed: a worker died")
        agent_mod.publish_attempt(store, key, "S2", {**INFO, "attempt": 1})
        _until(lambda: len(_Started.boots) == 2)
        store.set("maestro/attempt", first)  # the replay
        time.sleep(1.0)
        assert [b["session"] for b in _Started.boots] == ["S1", "S2"] and agent.attempt == 1
        assert running.is_alive() and any("an earlier attempt's (0), written back" in line for line in logged), logged
    finally:
        agent_mod.end_attempt(store, key, "S2", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)
    assert not running.is_alive()
