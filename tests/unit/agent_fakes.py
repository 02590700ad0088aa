"""Fakes for the agent of a node other than node 0 (runtime/agent.py) on an in-process TCPStore:
a launcher that records the workers it would start, node 0's answering side, and the agent."""

from __future__ import annotations

from maestro_flow.runtime.nodes import Nodes


class Started:
    """A Launcher that records the workers an agent would start (no processes)."""

    boots: list = []

    def __init__(self, entry):
        pass

    def start(self, rank, section, replica, boot):
        Started.boots.append(boot)

    def dead(self):
        return []

    def join(self, timeout):
        pass

    def shutdown(self, grace, kill):
        pass


def until(condition, timeout_s=5.0):
    """Wait (bounded) until `condition()` holds; the assertion after it says what was awaited."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def node0_on(store, secret, run="a1"):
    """Node 0's side of the rendezvous: answers agents' challenges with the run id `run`. Returns
    (the answering thread, to close; this run's key, which seals node 0's values)."""
    from maestro_flow.runtime.sealing import Answers, run_key, store_key

    return Answers(("127.0.0.1", store.port), 2, store_key(secret), run), run_key(store_key(secret), run, store.port)


def agent_on_a_store(monkeypatch, secret=b"s" * 20):
    """(agent module, a fresh store, node 1's agent on it with the Started launcher, its log lines)."""
    import torch.distributed as dist

    from maestro_flow.runtime import agent as agent_mod
    from maestro_flow.timeouts import Timeouts

    Started.boots = []
    monkeypatch.setattr(agent_mod, "Launcher", Started)
    monkeypatch.setattr(agent_mod, "claim", lambda session: type("Owner", (), {"close": lambda self: None})())
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nodes = Nodes(nnodes=2, node_rank=1, endpoint=("127.0.0.1", store.port))
    logged: list[str] = []
    agent = agent_mod.Agent(nodes, secret=secret, host="127.0.0.1", interface=None, timeouts=Timeouts(startup_s=20),
                            worker_log=lambda name: name, log=logged.append)
    return agent_mod, store, agent, logged


INFO = {"node_of": {"0": 0, "1": 1}, "address": "tcp://127.0.0.1:1", "timeouts": {}, "devices": ["cpu", "cpu"],
        "workers": {"1": ["s", 0, "s-0", "s[0]"]}}
