"""Which processes share memory, and the removal of a run's shared-memory slots.

Standard library only (a worker sends its host key in its hello, before it imports torch).
Used by the worker (`host_key`), the coordinator and node agents (`claim`, `SlotOwner`); the
slots themselves are transport/shm.py's.

A coordinator (or node agent) sweeps its attempt's slots when it ends. One that is killed
outright (SIGKILL, the OOM killer) cannot, and its workers die with it (PR_SET_PDEATHSIG), so
their slots would stay in /dev/shm, in memory, until the host reboots. So each such process
marks its attempt as alive on its host with an owner file, `maestro-<session>.<pid>.owner`,
held under an exclusive flock that the kernel drops however the process dies; every attempt's
start (`claim`) sweeps the slots of the sessions whose owners are all dead (`sweep_orphans`). Slots of a session
with no owner file at all (a version before owner files, a test's own prefix) are left alone.
"""

from __future__ import annotations

import fcntl
import os
import re

SHM_DIR = "/dev/shm"


def host_key() -> str | None:
    """Names the shared memory this process reaches: equal for two processes exactly when they
    can share /dev/shm (the same boot of the same kernel, the same /dev/shm mount). None when
    there is no usable /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return None
    if not os.access(SHM_DIR, os.W_OK):
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def sweep(session: str) -> int:
    """Remove every slot of a run's attempt left in /dev/shm (the coordinator, at the end)."""
    removed = 0
    prefix = f"maestro-{session}-"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed += 1
            except OSError:
                pass
    return removed


OWNER_SUFFIX = ".owner"
_OWNER = re.compile(r"maestro-([0-9a-f]{32})\.[0-9]+\.owner")  # a session is 32 hex digits (auth.new_nonce)


class SlotOwner:
    """This process's owner file for one attempt's slots on this host (see the module docstring):
    made under a temporary name no sweeper looks at, locked, then renamed, so no sweeper ever
    sees it unlocked while this process lives. `close` sweeps the attempt's slots (those a killed
    worker could not remove), then removes the file. Without a writable /dev/shm there is no
    file (no slots are made there either)."""

    def __init__(self, session: str) -> None:
        self.session = session
        self.path: str | None = None
        self._fd: int | None = None
        final = os.path.join(SHM_DIR, f"maestro-{session}.{os.getpid()}{OWNER_SUFFIX}")
        temp = os.path.join(SHM_DIR, f"maestro-owner-{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temp, final)
        except OSError:
            os.close(fd)
            try:
                os.unlink(temp)
            except OSError:
                pass
            return
        self.path, self._fd = final, fd

    def close(self) -> None:
        sweep(self.session)  # before the mark goes: no sweeper may judge the attempt dead meanwhile
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None
        # Found in review: the owner file of another process of this attempt on this host that was
        # killed outright (node 0's coordinator beside a node's agent) stayed until a later run.
        sweep_orphans()


def claim(session: str) -> SlotOwner:
    """An attempt's start on this host: sweep the slots of runs killed outright, then mark this one."""
    sweep_orphans()
    return SlotOwner(session)


def sweep_orphans() -> int:
    """Remove the slots (and owner files) of every session on this host whose owner files are all
    unlocked and this user's: their coordinator or agent died without sweeping. A session whose
    owner file went meanwhile is left alone (its owner ended and swept). Returns how many slots
    went."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    owners: dict[str, list[str]] = {}
    for name in names:
        match = _OWNER.fullmatch(name)
        if match:
            owners.setdefault(match.group(1), []).append(name)
    removed = 0
    for session, files in owners.items():
        fds: list[int] = []
        try:
            alive = False
            for name in files:
                try:
                    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
                except OSError:  # gone meanwhile (its owner ended and swept), or another user's
                    alive = True
                    break
                fds.append(fd)
                try:
                    if os.fstat(fd).st_uid != os.geteuid():
                        raise PermissionError  # another user's run: not ours to judge
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    alive = True  # its process holds it
                    break
            if not alive:
                removed += sweep(session)
                for name in files:
                    try:
                        os.unlink(os.path.join(SHM_DIR, name))
                    except OSError:
                        pass
        finally:
            for fd in fds:
                os.close(fd)
    return removed
