"""The `jex` command line (typer): a small app that registers one module per command group.

Each command is a thin shell over a function in a room, and imports it inside the command: `python -m
jex stage run ...` on a machine must not import `jex.flows` or prefect. `jex --version` prints the
package version and the git commit; `--install-completion` / `--show-completion` give shell completion.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from jex.cli import (
    config,
    engines,
    experiment,
    infra,
    interop,
    overlays,
    probe,
    run,
    score,
    server,
    stage,
    store,
    suite,
)
from jex.cli.run import render_spec_from
from jex.errors import JexError

__all__ = ["app", "main", "render_spec_from"]

COMMAND_GROUPS = (run, suite, score, interop, engines, overlays, experiment, probe, stage, server, infra, store,
                  config)
"""Modules whose `register(app)` adds their commands, in the order `jex --help` lists them."""

app = typer.Typer(no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  help="jex: reproducible LLM benchmark campaigns.")
for group in COMMAND_GROUPS:
    group.register(app)


def version_text() -> str:
    """`jex 0.1.0 (commit <sha>[, modified])`: the package version and the checkout's git commit."""
    import jex
    from jex.provenance import git_commit

    commit = git_commit()
    return f"jex {jex.__version__} (commit {commit['commit']}{', modified' if commit['dirty'] else ''})"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(version_text())
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the version and git commit, then exit")] = False) -> None:
    """jex: reproducible LLM benchmark campaigns."""


def main() -> None:
    """The console entry (`jex`, `python -m jex`): user errors print one line, never a traceback.

    A `JexError` (bad input, machines, S3, flows, server), invalid parameters (pydantic) and a path
    that does not exist are user errors; anything else is a bug and keeps its traceback.
    `JEX_TRACEBACK=1` shows the traceback of a user error too.
    """
    import os

    from pydantic import ValidationError

    try:
        app()
    except (JexError, ValidationError, FileNotFoundError) as e:
        if os.environ.get("JEX_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
