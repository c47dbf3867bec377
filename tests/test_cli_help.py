"""`jex --help` and every subcommand's `--help` say what their texts say: plain flags show no `<bool>`
type, and no word of a help text is lost to rich markup (`[engine]` is a TOML table, not a style)."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from jex.cli import app


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


COMMANDS = {" ".join(path) or "jex": (path, cmd) for path, cmd in _commands(typer.main.get_command(app))}


def _help(path: tuple[str, ...]) -> str:
    out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert out.exit_code == 0, out.output
    return " ".join(out.output.split())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_no_bool_type_and_every_help_text_whole(name):
    path, command = COMMANDS[name]
    text = _help(path)
    assert "<bool>" not in text
    for param in command.params:
        if param.help:
            shown = " ".join(param.help.replace("\\[", "[").split())
            assert shown in text, f"{name} {param.opts}: help text not shown whole"


def test_the_spec_help_names_its_tables():
    text = _help(("run",))
    assert re.search(r"--spec <path> Campaign TOML: any CampaignSpec field, with \[engine\], \[engine.render\] "
                     r"and \[machines\] tables; flags override", text)
