"""Usage errors click words too tersely for the user to see the cause.

An option with an optional value (`--trace [FILE]`) takes the next argument as its value, so
`maestro run --trace pipelines/vlm.py` gives the pipeline to --trace, and click then says only
"Missing argument 'PIPELINE'". `OptionalValueCommand` says which option took it.
"""

from __future__ import annotations

from typing import Any

import click


class OptionalValueCommand(click.Command):
    """A command whose missing argument was taken as an optional-value option's value is refused
    naming that option and the value it took."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # click consumes the list it parses
        try:
            return super().parse_args(ctx, args)
        except click.MissingParameter as exc:
            if not isinstance(exc.param, click.Argument):
                raise
            taken = _taken(self.params, given)
            if taken is None:
                raise
            flag, value, metavar = taken
            name = (exc.param.metavar or exc.param.name or "").upper()
            raise click.UsageError(f"Missing argument '{name}': {flag} took '{value}' as its {metavar}. Put {flag} "
                                   f"after {name}, or write {flag}={metavar}.", ctx) from exc


def _taken(params: list[click.Parameter], args: list[str]) -> tuple[str, str, str] | None:
    """The first optional-value option in `args` followed by a separate value: its flag, the value
    and the value's name in --help."""
    flags = {opt: (p.metavar or "VALUE").strip("[]") for p in params
             if isinstance(p, click.Option) and _optional_value(p) for opt in p.opts}
    for i, arg in enumerate(args[:-1]):
        if arg == "--":
            return None
        if arg in flags and not args[i + 1].startswith("-"):
            return arg, args[i + 1], flags[arg]
    return None


def _optional_value(option: Any) -> bool:
    return not option.is_flag and getattr(option, "_flag_needs_value", False)
