"""A worker's own output (runtime/worker_output.py), in a process of its own (it takes over fds
1 and 2): every line reaches the worker's log, and a terminal that cannot be written never
blocks the stage's prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys
from maestro_flow.runtime.worker_output import OutputCapture
cap = OutputCapture("head/0", sys.argv[1])
for i in range(100):
    print(f"line {i} " + "x" * 2000, flush=True)
cap.close()
print("unreachable: fd 1 is closed", file=sys.__stdout__)
"""


def test_a_terminal_that_cannot_be_written_neither_blocks_the_prints_nor_loses_the_log(tmp_path):
    """stderr to /dev/full (ENOSPC on every write): the 200 KB of prints finish and the log has
    every line (before, the output thread died on the first write, the log stayed empty and the
    stage blocked once the pipe was full)."""
    log = tmp_path / "head-0.log"
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], cwd=ROOT, stderr=full, timeout=20)
    assert done.returncode in (0, 1), done.returncode  # 1: the final print to a closed fd 1
    lines = log.read_text().splitlines()
    assert len(lines) == 100 and lines[0].startswith("[head/0] line 0 ") and lines[-1].startswith("[head/0] line 99 ")


NONBLOCKING = """
import fcntl, os, sys, time
fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)
from maestro_flow.runtime.worker_output import OutputCapture
cap = OutputCapture("head/0", sys.argv[1])
for i in range(100):
    print(f"line {i} " + "x" * 2000, flush=True)
time.sleep(3)
print("after the terminal had room again", flush=True)
cap.close()
"""


def test_a_full_nonblocking_terminal_loses_some_lines_not_the_terminal(tmp_path):
    """stderr a non-blocking pipe nobody reads for a while (EAGAIN once 64 KiB wait in it): the
    lines it could not take are dropped and counted, and the terminal shows the later ones
    (before, the first EAGAIN dropped the terminal for good)."""
    import time

    log = tmp_path / "head-0.log"
    proc = subprocess.Popen([sys.executable, "-c", NONBLOCKING, str(log)], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        time.sleep(2.0)  # the 200 KB of prints fill the pipe; nothing reads it yet
        shown = proc.stderr.read().decode()  # drains it, to the end
        proc.wait(timeout=20)
    finally:
        proc.kill()
    assert "[head/0] after the terminal had room again" in shown, shown[-500:]
    assert "lines not shown: the terminal was full)" in shown
    lines = log.read_text().splitlines()
    assert len(lines) == 101 and lines[-1] == "[head/0] after the terminal had room again"


NEVER_READ = """
import fcntl, os, sys, time
fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)
from maestro_flow.runtime.worker_output import OutputCapture
cap = OutputCapture("head/0", sys.argv[1])
t0 = time.monotonic()
for i in range(20000):
    print(f"line {i} " + "x" * 100, flush=True)
took = time.monotonic() - t0
cap.close()
open(sys.argv[2], "w").write(str(took))
"""


def test_a_terminal_that_stays_full_does_not_slow_the_prints(tmp_path):
    """A non-blocking terminal nobody reads: 2 MB of prints finish in about the time they take
    (found by a review: waiting for room on every line made them take 16 s), the log has every
    line, and every line the terminal got is whole and prefixed."""
    import time

    log, took = tmp_path / "head-0.log", tmp_path / "took"
    proc = subprocess.Popen([sys.executable, "-c", NEVER_READ, str(log), str(took)], cwd=ROOT,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)  # nothing reads the pipe meanwhile
        shown = proc.stderr.read().decode()
    finally:
        proc.kill()
    assert float(took.read_text()) < 5.0
    assert len(log.read_text().splitlines()) == 20000
    assert all(line.startswith("[head/0] ") for line in shown.splitlines()), shown[:300]


ONE_PAGE_LEFT = """
import fcntl, os, sys
fcntl.fcntl(2, fcntl.F_SETPIPE_SZ, 8192)  # two pages: one filled here, one left for the lines
os.write(2, b"x" * 4095 + b"\\n")
fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_NONBLOCK)
from maestro_flow.runtime.worker_output import OutputCapture
cap = OutputCapture("head/0", sys.argv[1])
cap.report("a" * 4083 + "\\nb")  # the second line's prefix starts 3 bytes before the page ends
cap.close()
"""


def test_a_full_pipe_never_cuts_a_line_or_its_prefix(tmp_path):
    """A pipe with room for one page, and 4104 bytes of lines to show at once: the first line
    (4093 bytes with its prefix) is shown whole and the second is left out whole (before, a
    write of all of it filled the page and cut the second line after "[he": the flaky test above
    failed that way about once in ten runs)."""
    log = tmp_path / "head-0.log"
    proc = subprocess.Popen([sys.executable, "-c", ONE_PAGE_LEFT, str(log)], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=20)  # nothing reads the pipe until the process has ended
        shown = proc.stderr.read().decode().splitlines()
    finally:
        proc.kill()
    assert shown == ["x" * 4095, "[head/0] " + "a" * 4083], [line[:20] for line in shown]
    assert log.read_text().splitlines() == ["[head/0] " + "a" * 4083, "[head/0] b"]


def test_a_note_that_went_out_alone_is_not_counted_again():
    """The note of dropped lines went out whole, as a piece of its own, and none of the lines
    after it: only those lines are owed (found in review: `written == len(head)` took the
    note-not-sent branch and added the lines already reported again)."""
    from maestro_flow.runtime.worker_output import OutputCapture

    cap = OutputCapture.__new__(OutputCapture)  # the bookkeeping alone: no fds taken over
    cap.unshown, cap.cut, cap.full = 3, False, False
    head, data = b"[head/0] (3 lines not shown: the terminal was full)\n", b"[head/0] " + b"x" * 5000 + b"\n"
    cap._gave_up(head, data, written=len(head))
    assert (cap.unshown, cap.cut, cap.full) == (1, False, True)
    cap.unshown = 3
    cap._gave_up(head, data, written=0)  # nothing went out: the note is owed again, with data's line
    assert cap.unshown == 4
