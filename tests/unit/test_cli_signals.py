"""Ctrl-C held while a native library is imported (maestro_flow/cli_signals.py), driven by calling
the installed handler directly: no real signal is sent."""

from __future__ import annotations

import signal
import time

import pytest

from maestro_flow import cli_signals


def test_a_held_interrupt_resent_into_another_import_is_held_again(monkeypatch):
    """The held Ctrl-C is sent again once the import is over; where another native import began
    in between, it arrived there and was raised inside it (a second Ctrl-C's treatment): the
    "Aborted!" or SIGABRT the module exists to prevent. It is held again now."""
    importing = [True]
    sent = []
    monkeypatch.setattr(cli_signals, "importing_native", lambda: importing[0])
    monkeypatch.setattr(cli_signals.signal, "pthread_kill", lambda thread, signum: sent.append(signum))

    def resent(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(sent) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sent) == n

    with cli_signals.interrupts_after_imports():
        handler = signal.getsignal(signal.SIGINT)
        handler(signal.SIGINT, None)  # Ctrl-C during an import: held
        importing[0] = False
        resent(1)
        importing[0] = True  # another import began before the resent signal came
        handler(signal.SIGINT, None)  # held again, not raised
        importing[0] = False
        resent(2)
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, None)  # no import now: raised
        importing[0] = True
        handler(signal.SIGINT, None)  # a new Ctrl-C during an import: held
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, None)  # a second one while held: raised at once
        importing[0] = False


def test_the_interrupt_a_sigterm_sends_is_raised_as_terminated(monkeypatch):
    """A SIGTERM before `maestro run` takes it its own way is sent on as an interrupt
    (term_as_interrupt), raised as Terminated, not as a Ctrl-C (found in review: node 0 told the
    other nodes a SIGTERM at its checks was a Ctrl-C); a Ctrl-C alone stays a KeyboardInterrupt."""
    from maestro_flow.errors import Terminated

    monkeypatch.setattr(cli_signals, "importing_native", lambda: False)
    monkeypatch.setattr(cli_signals, "TERMINATED", cli_signals.threading.Event())
    sent = []
    monkeypatch.setattr(cli_signals.signal, "pthread_kill", lambda thread, signum: sent.append(signum))
    with cli_signals.interrupts_after_imports():
        handler = signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt) as ctrl_c:
            handler(signal.SIGINT, None)
        assert type(ctrl_c.value) is KeyboardInterrupt
        cli_signals.term_as_interrupt(signal.SIGTERM, None)
        assert sent == [signal.SIGINT]
        with pytest.raises(Terminated):
            handler(signal.SIGINT, None)


def test_an_ignored_ctrl_c_stays_ignored_and_a_sigterm_still_interrupts(monkeypatch):
    """Found in QA: a script's background job (SIGINT ignored, as POSIX starts it) was stopped by a
    Ctrl-C once the command ran; a SIGTERM must still end it (its interrupt is a SIGINT)."""
    from maestro_flow.errors import Terminated

    monkeypatch.setattr(cli_signals, "importing_native", lambda: False)
    monkeypatch.setattr(cli_signals, "TERMINATED", cli_signals.threading.Event())
    monkeypatch.setattr(cli_signals.signal, "pthread_kill", lambda thread, signum: None)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with cli_signals.interrupts_after_imports():
            handler = signal.getsignal(signal.SIGINT)
            handler(signal.SIGINT, None)  # ignored: no KeyboardInterrupt
            cli_signals.term_as_interrupt(signal.SIGTERM, None)
            with pytest.raises(Terminated):
                handler(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stream_outlives_its_reader():
    """OutlivesReader (maestro run's stdout and stderr): a closed pipe is pointed at the null
    device at the first write that finds it closed, and the writes after it are dropped."""
    import io
    import os

    from maestro_flow.cli_signals import OutlivesReader

    read_end, write_end = os.pipe()
    stream = OutlivesReader(io.TextIOWrapper(open(write_end, "wb", buffering=0), line_buffering=True))
    stream.write("seen\n")
    assert os.read(read_end, 100) == b"seen\n"
    os.close(read_end)
    assert stream.write("lost\n") == 5 and stream.gone
    stream.write("also lost\n")
    stream.flush()
    assert os.readlink(f"/proc/self/fd/{write_end}") == os.devnull
    assert stream.isatty() is False  # the rest is the stream's own
    stream.close()
