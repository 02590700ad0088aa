"""transport/host.py's owner files: the slots of a run whose coordinator (or node agent) was
killed outright are swept by the next run's start, and only those: not a live run's, not a
session that has no owner file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from maestro_flow.transport import host

pytestmark = pytest.mark.timeout(60)

HOLDER = """
import os, sys, time
from maestro_flow.transport.host import SHM_DIR, SlotOwner
owner = SlotOwner(sys.argv[1])
assert owner.path is not None
for i in range(3):  # what its workers' slots look like
    open(os.path.join(SHM_DIR, f"maestro-{sys.argv[1]}-{i}-1"), "w").close()
print("ready", flush=True)
time.sleep(60)
"""


def _holder(session: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, session], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _files(session: str) -> list[str]:
    return sorted(n for n in os.listdir(host.SHM_DIR) if n.startswith(f"maestro-{session}"))


@pytest.mark.skipif(not os.access(host.SHM_DIR, os.W_OK), reason="no writable /dev/shm")
def test_a_killed_owners_slots_are_swept_a_live_ones_are_not():
    dead, alive, ownerless = (uuid.uuid4().hex for _ in range(3))
    killed, living = _holder(dead), _holder(alive)
    stray = os.path.join(host.SHM_DIR, f"maestro-{ownerless}-0-1")
    open(stray, "w").close()
    try:
        host.sweep_orphans()
        assert len(_files(dead)) == 4 and len(_files(alive)) == 4  # three slots and the owner file each
        killed.send_signal(signal.SIGKILL)  # no cleanup of its own: as a SIGKILLed coordinator
        killed.wait(10)
        assert host.sweep_orphans() >= 3
        assert _files(dead) == []
        assert len(_files(alive)) == 4  # its process still holds its owner file
        assert os.path.exists(stray)  # no owner file: not this mechanism's to judge
    finally:
        for proc in (killed, living):
            proc.kill()
            proc.wait(10)
        os.unlink(stray)
        host.sweep_orphans()
    assert _files(alive) == []  # swept once its holder died too


def test_an_owner_that_ends_removes_the_owner_file_a_killed_one_of_its_session_left():
    """Found in review: node 0's coordinator killed outright beside a node agent of the same
    attempt on its host: the agent swept the slots, but the coordinator's owner file stayed."""
    session = uuid.uuid4().hex
    killed = _holder(session)  # alive while this one claims: its file is locked, left alone
    try:
        owner = host.claim(session)
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert len([n for n in _files(session) if n.endswith(host.OWNER_SUFFIX)]) == 2
        owner.close()
        assert _files(session) == []
    finally:
        killed.kill()
        killed.wait(10)
        host.sweep_orphans()


def test_an_owner_sweeps_its_slots_and_removes_its_file_on_close():
    session = uuid.uuid4().hex
    owner = host.claim(session)
    if owner.path is None:
        pytest.skip("no writable /dev/shm")
    assert os.path.exists(owner.path)
    open(os.path.join(host.SHM_DIR, f"maestro-{session}-0-1"), "w").close()  # a slot a killed worker left
    owner.close()
    owner.close()  # idempotent
    assert _files(session) == []
