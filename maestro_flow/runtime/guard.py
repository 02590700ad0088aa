"""Output that must not take training down: metrics, plans, events, traces, worker logs.

Runs wherever such output is written. A `WriteGuard` runs one output's writes; the first OSError
(a full disk, a removed folder, a read-only mount) is reported once on stderr, naming the output
and the reason, and that output is dropped from then on while training goes on. Checkpoints are
not written through a guard: their failures are the Checkpointer's to report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class WriteGuard:
    def __init__(self, what: str, warn: Callable[[str], None] | None = None) -> None:
        self.what = what
        self.failed: str | None = None  # why writing stopped
        self._warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))

    def __call__(self, fn: Callable[..., Any], *args: Any) -> bool:
        """fn(*args), unless this output already failed; False when it did not write."""
        if self.failed is not None:
            return False
        try:
            fn(*args)
        except OSError as exc:
            self.failed = exc.strerror or str(exc)
            try:
                self._warn(f"maestro: cannot write {self.what} ({self.failed}); the run goes on without it")
            except OSError:
                pass  # nowhere left to say it
            return False
        return True

    def close(self, f: Any) -> None:
        """Close an output file: through the guard (its last buffered bytes may fail too), and
        quietly whatever happened, so the file is closed either way."""
        if not self(f.close):
            try:
                f.close()
            except OSError:
                pass
