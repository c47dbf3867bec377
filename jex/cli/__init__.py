"""The `jex` command line (typer): a small app that registers one module per command group.

Each command is a thin shell over a function in a room, and imports it inside the command: `python -m
jex stage run ...` on a machine must not import `jex.flows` or prefect. `jex --version` prints the
package version and the git commit; `--install-completion` / `--show-completion` give shell completion.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

# Prefect reads its settings once, when first imported (a command's pre-flight may import it before
# `connect_prefect` runs): the temporary API's defaults are set before anything can import it.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

import typer  # noqa: E402
from typer.core import TyperGroup, TyperOption  # noqa: E402

from jex.cli import (  # noqa: E402
    config,
    engines,
    experiment,
    infra,
    interop,
    ledger,
    overlays,
    probe,
    run,
    score,
    server,
    stage,
    store,
    suite,
)
from jex.cli.common import boundary_error  # noqa: E402
from jex.cli.run import render_spec_from  # noqa: E402

__all__ = ["app", "main", "render_spec_from"]

COMMAND_GROUPS = (run, suite, score, interop, engines, overlays, experiment, ledger, probe, stage, server, infra,
                  store, config)
"""Modules whose `register(app)` adds their commands, in the order `jex --help` lists them."""

BUG_LINE = ("this is a bug in jex, not in your input: please report it with the traceback above "
            "(jex --version, the command line) at the project's issue tracker")


class JexGroup(TyperGroup):
    """The root command group: every command runs inside the error boundary. A user's error prints
    `error: ...` on one line and exits 1 (typer's usage errors keep exit 2); a bug is re-raised.
    Its help, and every subcommand's, is `literal_help`."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        literal_help(self)

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:  # typer's Exit, Abort and usage errors are no user error here: re-raised
            err = boundary_error(exc)
            if err is None or os.environ.get("JEX_TRACEBACK") == "1":
                raise
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(1) from None


def literal_help(command: Any) -> None:
    """`command`'s help, and its subcommands', shows its texts word for word: rich markup is escaped
    (`[engine]` in a help text is a TOML table, not a style). Typer parses every help text as rich markup."""
    from rich.markup import escape
    from typer.core import HAS_RICH

    if not HAS_RICH or getattr(command, "rich_markup_mode", None) != "rich":  # plain click help: as written
        return
    if isinstance(getattr(command, "help", None), str):
        command.help = escape(command.help)
    for param in command.params:
        if isinstance(getattr(param, "help", None), str):
            param.help = escape(param.help)
    for sub in getattr(command, "commands", {}).values():
        literal_help(sub)


def _flag_type(self: TyperOption, ctx: Any) -> str | None:
    """A flag takes no value, so its help shows no type (typer shows `<bool>`)."""
    return None if self.is_flag else _typer_option_type(self, ctx)


if hasattr(TyperOption, "display_type_rich"):  # the typer of constraints.txt; an older one (a GPU image's) lacks it
    _typer_option_type = TyperOption.display_type_rich
    # typer has no per-option hook for this, and the help option is made lazily by click: set on the class
    TyperOption.display_type_rich = _flag_type  # type: ignore[method-assign]

app = typer.Typer(cls=JexGroup, no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
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
    """The console entry (`jex`, `python -m jex`): user errors print one line, never a traceback (exit 1;
    usage errors exit 2). A bug prints its traceback and a line asking to report it.
    `JEX_TRACEBACK=1` shows the traceback of a user error too.
    """
    import atexit
    import gc
    import traceback

    # the interpreter's last collection walks every object a campaign imported (torch, transformers, prefect,
    # polars): 1.5-2 s of a command's exit, for memory the process gives back anyway. Frozen objects are skipped;
    # registered first, the freeze runs after every other exit handler (the temporary Prefect server's stop).
    atexit.register(gc.freeze)
    try:
        app()
    except Exception as exc:  # a bug (or a user error under JEX_TRACEBACK=1): the traceback, then one line
        traceback.print_exc()
        err = boundary_error(exc)
        print(f"error: {err if err is not None else BUG_LINE}", file=sys.stderr)
        sys.exit(1)
