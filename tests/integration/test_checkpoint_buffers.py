"""Buffers in checkpoints: each data-parallel replica's own (a buffer a forward changes differs
between replicas that ran different micro-batches), given back to that replica on resume, and
replica 0's in `--save-dir` and in `maestro export` (a frozen section's: tests/unit/test_section_state.py).

The stage (assets/stateful_stages.py Counter) counts its forwards in a buffer and scales its loss
by it, so a replica resumed with another replica's count computes other gradients. At dp 2 with
five samples a step in micro-batches of one, one replica runs three forwards and the other two.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from maestro_flow.checkpoint import manifest as mf
from tests.integration.conftest import ROOT, maestro

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STATEFUL = str(ROOT / "tests" / "integration" / "assets" / "stateful.py")


def run(demo_data, *more: str) -> None:
    result = maestro("run", STATEFUL, "--quiet", "--no-run-dir", "--steps", "4", "--set", f"data.path={demo_data}",
                     "--set", "adapt_costs=false", "--set", "global_batch=5", "--set", "sections.counter.dp=2",
                     "--set", "sections.counter.micro_batch=1", "--set", "dtype=float64", *more, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]


def test_each_replica_resumes_with_its_own_buffers(demo_data, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(demo_data, "--checkpoint-dir", str(straight / "ck"), "--checkpoint-every", "1", "--save-dir",
        str(straight / "out"))
    step1 = os.path.join(straight / "ck", "step-00000001")
    calls = [torch.load(mf.rng_file(step1, "counter", r, 0), weights_only=True)["buffers"]["emb.calls"]
             for r in (0, 1)]
    assert sorted(c.item() for c in calls) == [2, 3], calls  # the replicas' buffers differ: what is tested here
    run(demo_data, "--resume", step1, "--save-dir", str(resumed))
    a, b = load_file(straight / "out" / "counter.safetensors"), load_file(resumed / "counter.safetensors")
    assert a.keys() == b.keys() == {"emb.weight", "emb.calls"}
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: {a[key]} vs {b[key]}"

    exported = tmp_path / "exported"
    result = maestro("export", str(straight / "ck"), "--section", "counter", "-o", str(exported))
    assert result.returncode == 0, result.stderr
    e = load_file(exported / "counter.safetensors")
    assert all(torch.equal(e[key], a[key]) for key in a)  # replica 0's, as --save-dir


def calls(checkpoint, replica: int) -> float:
    return torch.load(mf.rng_file(str(checkpoint), "counter", replica, 0), weights_only=True)["buffers"]["emb.calls"].item()


def generator(checkpoint, replica: int) -> torch.Tensor:
    return torch.load(mf.rng_file(str(checkpoint), "counter", replica, 0), weights_only=True)["torch"]


def test_replicas_draw_their_own_random_numbers(demo_data, tmp_path):
    """Found in QA: every replica of a section drew the same random stream, so at dp 2 replica
    1's dropout masks repeated replica 0's (the k-th micro-batch of each got the same mask). Each
    replica now seeds its own (build.replica_seed). The stage draws nothing here (no dropout:
    the draws of a dropout would depend on its samples' lengths), so each generator is as the
    replica seeded it: they were equal, and differ now."""
    run(demo_data, "--steps", "1", "--set", "global_batch=4", "--checkpoint-dir", str(tmp_path / "ck"),
        "--checkpoint-every", "1")
    step1 = tmp_path / "ck" / "step-00000001"
    assert calls(step1, 0) == calls(step1, 1) == 2
    assert not torch.equal(generator(step1, 0), generator(step1, 1))


def test_a_replica_added_by_a_larger_dp_starts_from_replica_0s_buffers(demo_data, tmp_path):
    """Resumed at dp 3 from a dp-2 checkpoint: replicas 0 and 1 go on from their own counts,
    replica 2 from replica 0's; each then adds the one or two forwards it runs in step 3."""
    ck, again = tmp_path / "ck", tmp_path / "again"
    run(demo_data, "--steps", "2", "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    step2 = ck / "step-00000002"
    result = maestro("run", STATEFUL, "--no-run-dir", "--steps", "3", "--set", f"data.path={demo_data}",
                     "--set", "adapt_costs=false", "--set", "global_batch=5", "--set", "sections.counter.dp=3",
                     "--set", "sections.counter.micro_batch=1", "--set", "dtype=float64", "--resume", str(step2),
                     "--checkpoint-dir", str(again), "--checkpoint-every", "1", timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("counter replica 2: no RNG state or buffers saved for it (the section's dp or tp changed); using "
            "replica 0's buffers and RNG states seeded for it") in result.stdout + result.stderr
    step3 = again / "step-00000003"
    for replica, start in ((0, calls(step2, 0)), (1, calls(step2, 1)), (2, calls(step2, 0))):
        assert calls(step3, replica) - start in (1, 2), (replica, start, calls(step3, replica))
    # Its random numbers are its own, not replica 0's again (found in QA; the stage draws none here).
    assert len({bytes(generator(step3, r).numpy()) for r in (0, 1, 2)}) == 3
