"""Which processes share memory, and the removal of a run's shared-memory slots.

Standard library only (a worker sends its host key in its hello, before it imports torch).
Used by the worker (`host_key`) and the coordinator (`sweep`); the slots themselves are
transport/shm.py's.
"""

from __future__ import annotations

import os

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
