"""The pure core stays pure: importing it pulls in no torch, no zmq, and (below the protocol
layer) no msgpack. Checked in a fresh interpreter, since this test process has torch loaded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "zmq", "msgpack", "numpy", "pyarrow")


def imported_after(*modules: str) -> set[str]:
    """Which of HEAVY a fresh interpreter has loaded after importing `modules`."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}:\n"
        "    importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {list(HEAVY)!r} if h in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return set(json.loads(out.stdout))


def test_planner_graph_and_config_import_only_the_standard_library():
    loaded = imported_after("maestro_flow.planner", "maestro_flow.graph", "maestro_flow.config",
                            "maestro_flow.planner.fifo", "maestro_flow.planner.routing", "maestro_flow.planner.cost",
                            "maestro_flow.planner.plan", "maestro_flow.samples", "maestro_flow.errors")
    assert loaded == set(), f"the pure core imported {sorted(loaded)} (torch, zmq and msgpack must stay out)"


@pytest.mark.parametrize("module", [
    "maestro_flow",  # the public API: Stage (which needs torch) loads on first use only
    "maestro_flow.protocol.messages",
    "maestro_flow.runtime.ledger",
    "maestro_flow.runtime.sampler",
    "maestro_flow.timeouts",
])
def test_other_pure_modules(module):
    assert imported_after(module) == set()


def test_the_codec_adds_msgpack_only():
    assert imported_after("maestro_flow.protocol.codec") == {"msgpack"}
