"""`maestro validate` (a click command registered by cli.py): check a pipeline without starting workers.

It prints each warning and one `ok:` line, or the error (exit 2, as every bad input in cli.py).
With --json it prints one JSON object on stdout instead, with the same exit code, for a script or
a scheduler that checks a job before it queues it (found in QA: only plan and tune had --json):

  valid       true, or false with `error` (the line `error: ...` would say)
  pipeline    its name (null where it could not be loaded)
  sections, edges, workers, samples, skipped   the counts the `ok:` line gives (where valid)
  warnings    the warnings, one string each
  payloads    with --payloads: each payload that fails or is tolerated, one string each

Progress (the payload check's) still goes to stderr.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import click

from maestro_flow.cli_sets import set_options
from maestro_flow.errors import MaestroError, exit_code_of
from maestro_flow.overrides import parse_set
from maestro_flow.wording import count, skipped_note


class _JsonUsage(click.Command):
    """With --json, a usage error (a --set-file that cannot be read, a bad option) is the JSON
    object too (found in review: usage text and an empty stdout)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        as_json = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if not as_json:
                raise
            click.echo(json.dumps({**EMPTY, "error": exc.format_message()}, indent=1))
            ctx.exit(exc.exit_code)


EMPTY: dict[str, Any] = {"valid": False, "pipeline": None, "warnings": [], "payloads": [], "error": None}


@click.command(cls=_JsonUsage)
@click.argument("pipeline", type=click.Path(dir_okay=False))
@set_options("global_batch=8, dtype=float64")
@click.option("--payloads", is_flag=True,
              help="Also read every payload a section will read and check it as its stage would take it: for the "
                   "built-in VisionEncoder, each image's format (not a GIF, not cut short), its size against "
                   "decode.max_pixels, and the data's num_patches against the patches it decodes to. Reads every "
                   "image: minutes for a large dataset.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the outcome as one JSON object on stdout, with the same exit code: valid, pipeline, "
                   "the counts, warnings, payloads (with --payloads) and error.")
@click.pass_context
def validate(ctx: click.Context, pipeline: str, sets: tuple[str, ...], payloads: bool, as_json: bool) -> None:
    """Check PIPELINE (fields, graph, stages built from their configs, dataset) without starting workers.

    The dataset check reads the metadata columns of every row; --payloads also reads the payloads
    (images) and lists what is wrong with them, naming the sample id and row (exit code 2)."""
    from maestro_flow.runtime.build import load_pipeline
    from maestro_flow.runtime.checks import check_pipeline

    out: dict[str, Any] = {**EMPTY, "warnings": [], "payloads": []}

    def say(line: str) -> None:  # progress and the payload check's last line
        click.echo(line, err=True)

    try:
        p, _ = load_pipeline(pipeline, parse_set(sets))
        out["pipeline"] = p.name
        checked = check_pipeline(p, build=True)
        out["warnings"] = [*checked.warnings, *checked.data_warnings]
        for warning in () if as_json else out["warnings"]:
            click.echo(f"warning: {warning}", err=True)
        if payloads:
            from maestro_flow.runtime.payloads import check_and_report

            check_and_report(p, checked, echo=say, problem=out["payloads"].append if as_json else say,
                             where="in payloads" if as_json else "above")
        out.update(valid=True, sections=len(checked.graph.order), edges=len(checked.graph.edges),
                   workers=sum(s.dp * s.tp for s in p.sections), samples=len(checked.metadata),
                   skipped=getattr(checked.source, "num_skipped", 0))
    except MaestroError as exc:
        if not as_json:
            from maestro_flow.cli import _fail

            _fail(exc, ctx.obj["debug"])
        if ctx.obj["debug"]:
            traceback.print_exception(exc, file=sys.stderr)
        out["error"] = str(exc)
        click.echo(json.dumps(out, indent=1))
        sys.exit(exit_code_of(exc))
    if as_json:
        click.echo(json.dumps(out, indent=1))
    else:
        click.echo(f"ok: {p.name}: {count(out['sections'], 'section')}, {count(out['edges'], 'edge')}, "
                   f"{count(out['workers'], 'worker')}, {out['samples']} samples" + skipped_note(out["skipped"]))
