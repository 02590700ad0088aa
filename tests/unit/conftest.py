"""Fixtures shared by the unit tests of several nodes (test_nodes.py, test_rendezvous_seals.py)."""

from __future__ import annotations

import pytest

from tests.unit.agent_fakes import node0_on


@pytest.fixture
def node0():
    """node0_on(store, secret, run) -> this run's key, its answering thread closed after the test."""
    made = []

    def make(store, secret=b"s" * 20, run="a1"):
        made.append(node0_on(store, secret, run))
        return made[-1][1]

    yield make
    for answers, _ in made:
        answers.close()


@pytest.fixture
def abandoning():
    """Tests that make nodes.bounded give a call up: the flag it sets would make the CLI's error
    paths end the test process (nodes.exit_code), so it is cleared after."""
    from maestro_flow.runtime import nodes as nodes_mod

    yield nodes_mod
    nodes_mod.ABANDONED.clear()
