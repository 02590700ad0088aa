"""A worker process's own output: its stdout and stderr, prefixed, into the run's worker log.

Runs in the worker process (runtime/worker.py starts it first): file descriptors 1 and 2 become a
pipe that an "output" thread reads, so C libraries' prints are caught as well as Python's; a
crash in native code prints every thread's Python stack (faulthandler) to the terminal. Knows
nothing of sections, plans or the control plane; a log that cannot be written (full disk) is
dropped with one line on the terminal, and the worker goes on; so is a terminal that cannot be
written (a closed pipe, a full disk behind a redirect): the log still gets every line, and the
pipe is still drained, so the stage's prints never block. A non-blocking terminal that stays full
loses only the lines it cannot take, said with the next ones shown (it is waited for once per
time it fills, not per line).
"""

from __future__ import annotations

import faulthandler
import os
import select
import sys
import threading
from collections.abc import Iterator

from maestro_flow.runtime.guard import WriteGuard

SHOW_WAIT_S = 0.5  # how long a line waits for room in a full non-blocking terminal


def _pieces(data: bytes, size: int = select.PIPE_BUF) -> Iterator[bytes]:
    """`data` in pieces of at most `size` bytes that end at a line's end wherever the lines fit: a
    full pipe takes such a write whole or not at all (POSIX, PIPE_BUF), so it never cuts a line or
    its prefix; only a line longer than `size` can be cut, after its first piece."""
    start = 0
    while start < len(data):
        end = start + size
        if end < len(data):
            last = data.rfind(b"\n", start, end)
            end = last + 1 if last >= 0 else end
        yield data[start:end]
        start = end


class OutputCapture:
    """This process's stdout and stderr (Python's and C libraries' alike, at the fd level), each
    line prefixed with "[section/replica] " and written to the run's worker log and, as before,
    to the terminal's stderr."""

    def __init__(self, label: str, log_path: str | None) -> None:
        self.prefix = f"[{label}] ".encode()
        self.terminal = os.dup(2)
        self.log = open(log_path, "ab") if log_path else None  # noqa: SIM115 (closed in close())
        self.log_guard = WriteGuard(f"the worker log {log_path}", lambda text: self._show(self._lines(text)))
        self.terminal_failed: OSError | None = None
        self.unshown = 0  # lines a full non-blocking terminal could not take (since the last shown)
        self.full = False  # it stayed full: drop lines without waiting until select says it has room
        self.cut = False  # the last write stopped inside a line
        self.show_lock = threading.Lock()
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        sys.stdout.reconfigure(line_buffering=True)
        # A crash in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL) dumps every thread's
        # Python stack straight to the terminal: the pipe's reader dies with the process.
        self.faults = open(self.terminal, "w", closefd=False)  # noqa: SIM115 (lives as long as the process)
        faulthandler.enable(self.faults, all_threads=True)
        self.reader = threading.Thread(target=self._pump, args=(read_end,), name="output", daemon=True)
        self.reader.start()

    def _pump(self, fd: int) -> None:
        pending = b""
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            self._write(b"".join(self.prefix + line + b"\n" for line in lines))
        if pending:
            self._write(self.prefix + pending + b"\n")

    def _write(self, data: bytes) -> None:
        self.keep_bytes(data)
        self._show(data)

    def _show(self, data: bytes) -> None:
        """To the terminal, until it fails once (then never again: the log has the lines). A
        non-blocking terminal that is full is waited for SHOW_WAIT_S once; while it stays full,
        lines are dropped at once (never blocking the pump, so never the stage's prints), counted
        and said with the next ones shown. Written in pieces of whole lines (`_pieces`), so a full
        pipe never cuts one; a line cut short elsewhere (a long one, a terminal that is not a pipe)
        is ended first."""
        with self.show_lock:  # the pump thread, and report/detail from the worker's threads
            if self.terminal_failed is not None:
                return
            if self.full and select.select([], [self.terminal], [], 0)[1]:
                self.full = False  # a reader made room: the next time it fills is waited for again
            head = b"\n" if self.cut else b""
            if self.unshown:
                head += self.prefix + f"({self.unshown} lines not shown: the terminal was full)\n".encode()
            written = 0
            try:
                for piece in _pieces(head + data):
                    view = memoryview(piece)
                    while view:
                        try:
                            sent = os.write(self.terminal, view)
                        except BlockingIOError:
                            if self.full or not select.select([], [self.terminal], [], SHOW_WAIT_S)[1]:
                                self._gave_up(head, data, written)
                                return
                            continue
                        view, written = view[sent:], written + sent
                self.unshown, self.cut = 0, False
            except OSError as exc:
                self.terminal_failed = exc

    def _gave_up(self, head: bytes, data: bytes, written: int) -> None:
        """The terminal stayed full: `written` bytes of head + data went out."""
        self.full = True
        if written >= len(head):  # the note went out (alone, at ==): count the lines of data it did not
            self.unshown = data[written - len(head):].count(b"\n")
        else:  # the note did not go out whole: it is owed again, with data's lines added
            self.unshown += data.count(b"\n")
        if written:
            self.cut = (head + data)[written - 1:written] != b"\n"

    def keep_bytes(self, data: bytes) -> None:
        """Into the worker's log; a log that cannot be written (full disk) is dropped, with one
        line on the terminal, and the worker goes on."""
        if self.log is not None:
            self.log_guard(self._append, data)

    def _append(self, data: bytes) -> None:
        self.log.write(data)
        self.log.flush()

    def _lines(self, text: str) -> bytes:
        return b"".join(self.prefix + line.encode() + b"\n" for line in text.rstrip().splitlines())

    def keep(self, text: str) -> None:
        """Into the worker's log, when there is one (the coordinator shows the terminal the text)."""
        self.keep_bytes(self._lines(text))

    def report(self, text: str) -> None:
        """To the terminal and the worker's log at once (the process is about to end)."""
        self._write(self._lines(text))

    def detail(self, text: str) -> None:
        """Details the coordinator's one-line error points to: the worker's log only when there
        is one (the terminal gets the one line), else the terminal."""
        if self.log is not None and self.log_guard.failed is None:
            self.keep(text)
        else:
            self._show(self._lines(text))

    def close(self) -> None:
        """Flush and wait for the last lines (bounded): closing fds 1 and 2 ends the pipe."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(1)
        os.close(2)
        self.reader.join(timeout=2.0)
