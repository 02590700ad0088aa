"""The overrides every `maestro` command that loads a pipeline takes: `--set KEY=VALUE`, repeated,
and `--set-file FILE`, the same overrides read from a file (what `maestro tune --write` writes).

A command decorated with `set_options` gets them as one `sets` tuple, the files' first (in the
order given) and then each `--set`, so a `--set` on the command line wins over a file's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import click

from maestro_flow.errors import PipelineError
from maestro_flow.overrides import parse_set, set_key_problem

SET_FILE_HELP = ("Overrides from FILE, one 'KEY=VALUE' or '--set KEY=VALUE' a line (lines starting with '#' are "
                 "comments), as `maestro tune --write` writes them; a --set given here wins over the file's.")


def set_options(example: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Add --set (its help showing `example` top-level fields) and --set-file to a command."""
    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(command)
        def merged(*args: Any, set_files: tuple[list[str], ...] = (), sets: tuple[str, ...] = (),
                   **kwargs: Any) -> Any:
            return command(*args, sets=(*(s for items in set_files for s in items), *sets), **kwargs)

        merged = click.option("--set-file", "set_files", multiple=True, metavar="FILE", callback=_read,
                              type=click.Path(dir_okay=False), help=SET_FILE_HELP)(merged)
        return click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
                            help=f"Override a field: top-level ({example}) or sections.NAME.FIELD=value "
                                 "(JSON values).")(merged)
    return decorate


def _read(ctx: click.Context, param: click.Parameter, paths: tuple[str, ...]) -> tuple[list[str], ...]:
    return tuple(read_set_file(p) for p in paths)


def read_set_file(path: str) -> list[str]:
    """The KEY=VALUE items of a --set-file, each checked as --set checks it; a bad line is a
    click.BadParameter naming the file and line."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is not part of the first key
            lines = f.read().splitlines()
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint="--set-file") from None
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})",
                                 param_hint="--set-file") from None
    items = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("--set "):
            text = text[len("--set "):].strip()
        elif text.startswith("--set="):
            text = text[len("--set="):]
        try:
            parse_set([text])
        except PipelineError:
            why = set_key_problem(text.split("=", 1)[0].strip())  # found in QA: '--sett a.b=1' was read as the key '--sett a.b'
            why = f" ({why})" if why else ""
            raise click.BadParameter(f"{os.fspath(path)} line {number}: expected KEY=VALUE or --set KEY=VALUE, "
                                     f"got {line.strip()!r}{why}", param_hint="--set-file") from None
        items.append(text)
    return items
