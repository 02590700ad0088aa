"""The rendezvous store's sealed values (runtime/sealing.py, runtime/attempts.py, runtime/agent.py): what an agent of a
node other than node 0 acts on, and what it ignores or refuses: unsealed or forged values, values
of an earlier run or attempt, another live run's answer, a node whose secret, --nnodes, code or
data differ from node 0's."""

from __future__ import annotations

import json

import pytest

from maestro_flow.errors import PipelineError
from maestro_flow.runtime import attempts
from maestro_flow.runtime.nodes import Nodes
from tests.unit.agent_fakes import INFO, Started, agent_on_a_store, until


def test_an_attempt_the_store_holds_unsealed_starts_nothing(monkeypatch, node0):
    """Found in review: any client of the rendezvous store could publish an attempt (no verifier
    needed) whose workers connected to the client's address and logged to workers/../../FILE."""
    import threading
    import time

    agent_mod, store, agent, logged = agent_on_a_store(monkeypatch)
    key = node0(store)
    forged = {**INFO, "workers": {"1": ["s", 0, "../../../escaped", "x\nINJECTED"]}}
    store.set("maestro/attempt/abc123", json.dumps(forged))
    store.set("maestro/attempt", "abc123")
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    time.sleep(1.0)
    assert running.is_alive() and Started.boots == []  # ignored, said once
    assert sum("ignored maestro/attempt in the rendezvous store" in line for line in logged) == 1, logged
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
    running.join(10)
    assert not running.is_alive() and Started.boots == []
    # A note no one of this run sealed is not a lost worker; one that is sealed is shown escaped.
    store.set("maestro/lost/S9", "worker s[0] on node 1 was killed by SIGKILL")
    assert attempts.lost_error(store, key, "S9") is None
    store.set("maestro/lost/S9", agent_mod.sealed(key, "maestro/lost/S9", "worker x\x1b[2J died"))
    assert str(attempts.lost_error(store, key, "S9")) == "worker x\\x1b[2J died"


def test_a_node_whose_secret_differs_refuses_node_0s_attempt_and_node_0_says_so(monkeypatch, node0):
    """Node 0's answer to the agent's challenge does not open with this node's secret: the agent
    refuses node 0's attempt at once, and node 0 shows the refusal (which it cannot open either)."""
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    key = node0(store, secret=b"t" * 20)  # node 0's secret differs
    attempts.publish_attempt(store, key, "abc123", INFO)
    with pytest.raises(PipelineError, match=r"node 1's control-plane secret differs from node 0's \(the run's attempt"):
        agent.run()
    assert Started.boots == []
    lost = attempts.lost_error(store, key, "abc123")
    assert isinstance(lost, PipelineError) and str(lost).endswith("(or --secret-file). (Said by a note in the "
                                                              "rendezvous store that this node's secret does not open: a "
                                                              "node whose secret differs writes it so; another client of "
                                                              "the store could have, too.)")


def test_a_node_whose_secret_differs_learns_it_from_a_run_node_0_refused(monkeypatch, node0):
    """Node 0 refused the run before any attempt (runtime/meeting.py): its outcome does not open
    here. Found in review: this node ignored it, node 0 waited out its grace for this node's
    goodbye, and this node then said it lost node 0."""
    from maestro_flow.runtime.meeting import end_job

    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    key = node0(store, secret=b"t" * 20)  # node 0's secret differs
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "failed: the run was refused: --resume ..."))
    with pytest.raises(PipelineError, match=r"node 1's control-plane secret differs from node 0's, which ended the run"):
        agent.run()
    assert store.check(["maestro/bye/1"])  # node 0 stops waiting for it
    import time

    began = time.monotonic()
    end_job(store, key, "failed: the run was refused: ...", nnodes=2, wait_s=8.0, claim_grace_s=20.0)
    assert time.monotonic() - began < 1.0


def test_values_of_an_earlier_run_with_the_same_secret_are_not_acted_on(monkeypatch, node0):
    """Found in review: sealed store values were not bound to one run, so an earlier run's
    "done" (or attempt) with the same secret, written into a later run's store, ended (or
    redirected) its agents. Each run's values are sealed under a key of that run, which an agent
    learns only from node 0's answer to its own challenge; a replayed answer is not taken."""
    import threading
    import time

    from maestro_flow.runtime.sealing import answer_name, run_key, sealed, store_key

    agent_mod, store, agent, logged = agent_on_a_store(monkeypatch)
    old = run_key(store_key(b"s" * 20), "0ld", store.port)  # the earlier run's key: same secret, another run id
    store.set(answer_name(1), sealed(store_key(b"s" * 20), answer_name(1), f"c0ffee 0ld {store.port}"))  # replayed
    store.set("maestro/job", sealed(old, "maestro/job", "done"))
    attempts.publish_attempt(store, old, "S0", INFO)
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    time.sleep(1.0)
    assert running.is_alive() and Started.boots == [] and agent.rkey is None  # the old answer named another challenge
    key = node0(store, run="a2")
    until(lambda: agent.rkey is not None)
    assert agent.rkey == key
    time.sleep(0.5)
    assert running.is_alive() and Started.boots == []  # the old run's job and attempt do not open
    assert any("ignored maestro/job" in line for line in logged) and any("ignored maestro/attempt" in line
                                                                          for line in logged), logged
    attempts.publish_attempt(store, key, "S1", INFO)
    until(lambda: Started.boots)
    assert [b["session"] for b in Started.boots] == ["S1"]
    attempts.end_attempt(store, key, "S1", "done")
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
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    attempts.publish_attempt(store, node0(store), "S1", {**INFO, "workers": {"1": ["s", 0, "../escaped", "s[0]"]}})
    with pytest.raises(PipelineError, match="names a worker '../escaped', which is not a file name"):
        agent.run()
    assert Started.boots == []


def test_unsealed_values_do_not_stop_a_running_attempt(monkeypatch, node0):
    """Found in review: setting maestro/attempt to anything made node 1's agent stop the workers of
    the running attempt and wait for an attempt that never came; a forged end or job too."""
    import threading
    import time

    agent_mod, store, agent, logged = agent_on_a_store(monkeypatch)
    key = node0(store)
    attempts.publish_attempt(store, key, "S1", INFO)
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        until(lambda: Started.boots)
        assert [b["session"] for b in Started.boots] == ["S1"] and Started.boots[0]["log"] == "s-0"
        store.set("maestro/attempt", "bogus")
        store.set("maestro/end/S1", "failed: forged")
        store.set("maestro/job", "failed: forged")
        time.sleep(1.0)
        assert running.is_alive()  # still in S1
        assert any("ignored maestro/attempt in the rendezvous store" in line for line in logged), logged
        attempts.end_attempt(store, key, "S1", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)
        assert not running.is_alive()
    finally:
        attempts.end_attempt(store, key, "S1", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)


def test_a_node_whose_code_or_data_differs_from_node_0s_is_refused(monkeypatch, node0):
    """The settings agree, the files do not (runtime/fingerprint.py): refused before any worker
    starts, naming them; node 0 shows why."""
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    key = node0(store)
    agent.files = {"code": {"stages/vision.py": "1", "pipeline file": "2"}, "data": {"vlm.arrow": "size 9 sha256 a"},
                   "versions": {"torch": "2.13.0"}}
    theirs = {"code": {"stages/vision.py": "X", "pipeline file": "2"}, "data": {"vlm.arrow": "size 9 sha256 a"},
              "versions": {"torch": "2.11.0"}}
    attempts.publish_attempt(store, key, "S1", {**INFO, "files": theirs})
    with pytest.raises(PipelineError, match=r"node 1's files differ from node 0's \(install the same code and copy "
                                            r"the same data to every node\): code: stages/vision.py \(differs\); "
                                            r"versions: torch 2.13.0 on node 1, 2.11.0 on node 0"):
        agent.run()
    assert Started.boots == []
    assert "node 1's files differ from node 0's" in str(attempts.lost_error(store, key, "S1"))


@pytest.mark.parametrize(("here", "node_0"), [(("--checkpoint-dir", "--resume"), []),
                                              (("--save-dir", "--record"), ["--save-dir"])])
def test_a_node_given_node_0s_options_node_0_lacks_is_refused(monkeypatch, node0, here, node_0):
    """Found in QA: --checkpoint-dir or --resume given to node 1 alone were dropped in silence (no
    checkpoint written; a run trained from step 0), with a message saying node 0 had them."""
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    key = node0(store)
    agent.given = list(here)
    attempts.publish_attempt(store, key, "S1", {**INFO, "given": node_0})
    missing = [flag for flag in here if flag not in node_0]
    with pytest.raises(PipelineError, match=rf"^node 1 was given {', '.join(missing)} and node 0 was not: node 0 runs "
                                            r"the coordinator, .* give every node the same options$"):
        agent.run()
    assert Started.boots == []
    assert f"node 1 was given {', '.join(missing)}" in str(attempts.lost_error(store, key, "S1"))


def test_another_live_run_with_the_same_secret_cannot_answer_for_this_one(monkeypatch, node0):
    """Found in review: a store client copied the agent's challenge into another live run's store
    (same secret), and that run's answer and "done" back: the agent took the other run's key and
    ended. The answer names its store's port, and the run key is bound to it."""
    import threading
    import time

    import torch.distributed as dist

    from maestro_flow.runtime.sealing import answer_name, ask_name, sealed

    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    other = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # run A, live
    key_a = node0(other, run="a9")
    other.set("maestro/job", sealed(key_a, "maestro/job", "done"))
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    until(lambda: store.check([ask_name(1)]))
    other.set(ask_name(1), store.get(ask_name(1)))  # the relay
    until(lambda: other.check([answer_name(1)]))
    store.set(answer_name(1), other.get(answer_name(1)))
    store.set("maestro/job", other.get("maestro/job"))
    time.sleep(1.0)
    assert running.is_alive() and agent.rkey is None  # before: ended on run A's "done"
    key = node0(store, run="b2")  # this run's node 0 answers
    until(lambda: agent.rkey is not None)
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

    _, store, _, _ = agent_on_a_store(monkeypatch)
    node0(store)  # nnodes 2
    agent = agent_mod.Agent(Nodes(nnodes=3, node_rank=2, endpoint=("127.0.0.1", store.port)), secret=b"s" * 20,
                            host="127.0.0.1", interface=None, timeouts=Timeouts(startup_s=60),
                            worker_log=lambda name: name, log=lambda text: None)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"node 2 was started with --nnodes 3, node 0 with --nnodes 2 \(so the "
                                            r"rendezvous store says\): give every node the same --nnodes"):
        agent.run()
    assert time.monotonic() - start < 10 and Started.boots == []


def test_node_0_answers_after_a_store_client_wrote_garbage(monkeypatch, node0):
    """Found in review: a counter of asks set to something not a number ended node 0's answering
    thread for good (there is no counter now); nor does garbage in another node's ask stop it."""
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    store.set("maestro/asked", "not a number")
    store.set("maestro/ask/0", "../x")
    key = node0(store)
    attempts.publish_attempt(store, key, "S1", INFO)
    attempts.end_attempt(store, key, "S1", "done")
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
    agent.run()  # answered, read the end: returns
    assert agent.rkey == key


def test_an_earlier_attempts_pointer_written_back_is_ignored(monkeypatch, node0):
    """Found in review: within one run, a copy of attempt 1's pointer written back opened and
    stopped attempt 2's workers. The pointer carries the attempt's number."""
    import threading
    import time

    agent_mod, store, agent, logged = agent_on_a_store(monkeypatch)
    key = node0(store)
    # (a run resumed from a checkpoint that an earlier run's restart wrote: attempt 1, none of its own;
    # found in review: said to be an automatic restart)
    attempts.publish_attempt(store, key, "S1", {**INFO, "attempt": 1, "restarts": 0})
    running = threading.Thread(target=agent.run, daemon=True)
    running.start()
    try:
        until(lambda: len(Started.boots) == 1)
        first = store.get("maestro/attempt")
        attempts.end_attempt(store, key, "S1", "failed: a worker died")
        attempts.publish_attempt(store, key, "S2", {**INFO, "attempt": 2, "restarts": 1})
        until(lambda: len(Started.boots) == 2)
        store.set("maestro/attempt", first)  # the replay
        time.sleep(1.0)
        assert [b["session"] for b in Started.boots] == ["S1", "S2"] and agent.attempt == 2
        assert running.is_alive() and any("an earlier attempt's (1), written back" in line for line in logged), logged
        # found in QA: a restart read on node 1 as a second start, unexplained
        started = [line for line in logged if "starting ranks" in line]
        assert started[0].startswith("node 1: starting ranks 1 ")
        assert started[1].startswith("node 1: automatic restart 1 (node 0 says why): starting ranks 1 "), started
    finally:
        attempts.end_attempt(store, key, "S2", "done")
        store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
        running.join(10)
    assert not running.is_alive()


def test_a_node_started_with_another_nnodes_is_refused(monkeypatch, node0):
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    attempts.publish_attempt(store, node0(store), "S1", {**INFO, "nnodes": 3})
    with pytest.raises(PipelineError, match="node 1 was started with --nnodes 2, node 0 with --nnodes 3"):
        agent.run()
    assert Started.boots == []


def test_an_answer_overwritten_in_the_store_is_given_again(monkeypatch, node0):
    """Found in review: node 0 answered each challenge once, so an answer a store client overwrote
    (a relay) left the agent waiting out its timeout, blaming node 0."""
    from maestro_flow.runtime import sealing

    monkeypatch.setattr(sealing, "REASK_S", 0.3)
    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)
    store.set(sealing.ask_name(1), agent.challenge)
    key = node0(store)
    until(lambda: store.check([sealing.answer_name(1)]))
    store.set(sealing.answer_name(1), "0" * 64 + ":" + agent.challenge[:4])  # overwritten before the agent read it
    attempts.publish_attempt(store, key, "S1", INFO)
    attempts.end_attempt(store, key, "S1", "done")
    store.set("maestro/job", agent_mod.sealed(key, "maestro/job", "done"))
    agent.run()  # answered again: it learns the run and reads its end
    assert agent.rkey == key


@pytest.mark.parametrize("signal", ["ctrl-c", "sigterm"])
def test_ctrl_c_on_a_node_stops_the_run_and_sigterm_restarts_it(monkeypatch, signal):
    """Found in review: a node stopped with Ctrl-C was restarted, and node 0 waited out its startup
    for it. Ctrl-C is a person's: the run stops. SIGTERM is as likely a preemption or an eviction:
    a lost node, which --max-restarts restarts once it is back."""
    import time
    import types

    from maestro_flow.errors import SystemFailure, Terminated, WorkerLost

    agent_mod, store, agent, _ = agent_on_a_store(monkeypatch)

    def interrupted(seconds):
        raise Terminated if signal == "sigterm" else KeyboardInterrupt

    monkeypatch.setattr(agent_mod, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=interrupted))
    agent.rkey = b"k" * 32
    store.set("maestro/node/1", agent.me)
    with pytest.raises(KeyboardInterrupt):
        agent._attempt(store, "S1", INFO)
    lost = attempts.lost_error(store, agent.rkey, "S1")
    if signal == "sigterm":
        assert type(lost) is WorkerLost and "node 1 was terminated (SIGTERM or SIGHUP there" in str(lost)
    else:
        assert type(lost) is SystemFailure and str(lost).startswith("node 1 was interrupted (Ctrl-C there)")
