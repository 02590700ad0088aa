"""Ctrl-C for every `maestro` command: one line and exit 130, also in the first second.

A KeyboardInterrupt raised while torch (or another native library) was being imported reached
click as "Aborted!" (exit 1), or aborted the process (SIGABRT) when it surfaced inside a pybind11
callback. Every command therefore runs under `interrupts_after_imports`: while such a library's
module is being imported, Ctrl-C is only noted, and sent again to the main thread once the import
is over, where it is raised as usual. A second Ctrl-C while one is held is raised at once (an
import that hangs can still be interrupted). Commands that catch KeyboardInterrupt themselves
(`maestro run` stops its workers first) keep their own message. And a closed pipe on stdout
(`maestro plan ... | head`) ends a command with exit 0 (`reader_gone`), not click's exit 1,
except `maestro run`, which trains on without its output (`OutlivesReader`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from maestro_flow.errors import Terminated

NATIVE = ("torch", "numpy", "pyarrow", "zmq", "nvidia", "transformers", "safetensors")


def importing_native() -> bool:
    """Whether one of NATIVE's modules (or their submodules) is being imported right now."""
    for name, module in list(sys.modules.items()):
        if name.split(".", 1)[0] in NATIVE and getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
    return False


@contextlib.contextmanager
def interrupts_after_imports() -> Iterator[None]:
    held = threading.Event()
    resent = threading.Event()  # the SIGINT on its way is resend()'s, not a second Ctrl-C
    closed = threading.Event()  # the command is over: a late resend is dropped
    main = threading.main_thread().ident
    # A script's background job starts with SIGINT ignored (POSIX): a Ctrl-C meant for the script's
    # foreground stays ignored here too, and only a SIGTERM's interrupt is taken (found in QA).
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def hold() -> None:
        threading.Thread(target=resend, name="held-interrupt", daemon=True).start()

    def resend() -> None:
        while importing_native():
            time.sleep(0.02)
        if held.is_set() and not closed.is_set():  # not into the handler the command ends with
            resent.set()
            signal.pthread_kill(main, signal.SIGINT)

    def on_interrupt(signum: int, frame: object) -> None:
        if ignored and not TERMINATED.is_set():
            return
        if closed.is_set() and resent.is_set():
            return  # the command ended while the interrupt was resent: it was raised already
        if resent.is_set():
            resent.clear()
            if importing_native():  # another native import began since resend() looked: hold it again
                hold()
                return
        elif importing_native() and not held.is_set():
            held.set()
            hold()
            return
        held.clear()
        raise Terminated if TERMINATED.is_set() else KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        yield
        return
    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        closed.set()
        held.clear()  # a resend still pending finds nothing to raise
        signal.signal(signal.SIGINT, previous)


# A SIGTERM came (term_as_interrupt): the interrupt it sent is raised as Terminated, so that
# `maestro run` tells it from a Ctrl-C (found in review: node 0 told the other nodes "Ctrl-C").
TERMINATED = threading.Event()


def term_as_interrupt(signum: int, frame: object) -> None:
    """SIGTERM to a `maestro` command, until it takes SIGTERM its own way (`maestro run`:
    runtime/stops.py): an interrupt, held while a native module is imported as Ctrl-C is (found in
    QA: a SIGTERM in `maestro run`'s first 2 s exited 143 with no word, and later ones 130)."""
    TERMINATED.set()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


def reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (`maestro plan ... | head` that has read its
    lines); if so stdout is pointed at the null device, so the exit flushes nothing more into it."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        gone = any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no stdout, or no poll
        return False
    if gone:
        to_null(sys.stdout.fileno())
    return gone


def to_null(fd: int) -> None:
    """Point descriptor `fd` (open or closed) at the null device, inheritably (os.open's own is
    not: a worker would start with it closed)."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null == fd:  # fd was closed, and took the number
        os.set_inheritable(fd, True)
        return
    os.dup2(null, fd)  # (dup2's copy is inheritable)
    os.close(null)


class OutlivesReader:
    """A text stream (the terminal's stdout or stderr) whose reader may go away while a run trains
    (`maestro run ... 2>&1 | tee log` whose tee dies, a log shipper stopped): the first write that
    finds the pipe closed points its descriptor at the null device, and the output from then on
    is dropped; the run goes on, and ends with the exit code of its training (found in QA: the run
    stopped at the closed pipe, and exited 0). Its run directory still gets everything."""

    def __init__(self, stream: object) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._to_null()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._to_null()

    def _to_null(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # (no descriptor: just dropped)
            to_null(self._stream.fileno())

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def outlive_readers() -> Callable[[], None]:
    """sys.stdout and sys.stderr as OutlivesReader, for a command that must not stop when its
    output's reader goes (`maestro run`); returns what puts them back."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (s if s is None or isinstance(s, OutlivesReader) else OutlivesReader(s) for s in saved)

    def restore() -> None:
        sys.stdout, sys.stderr = saved

    return restore


def reopen_closed_streams() -> None:
    """A command started with stdout or stderr closed (`maestro run ... 2>&-`: Python then has no
    sys.stderr) writes it to the null device (found in QA: the run ended with exit 1 and no word,
    on the missing stream, and its workers could not start). Called as the CLI is imported, before
    any file could take the closed descriptor's number."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
        except OSError:
            to_null(fd)
        setattr(sys, name, open(fd, "w", buffering=1, closefd=False))  # noqa: SIM115 (the process's own)
