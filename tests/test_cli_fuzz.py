"""Every command, fed bad input (property-based): never a traceback, exit 1 (bad input) or 2 (usage),
and nothing written.

Each case is one command with valid arguments but one flag (or the settings) made bad: a missing path,
a folder where a file belongs and the reverse, a binary, corrupt or empty file, a number out of range,
an unknown name, a broken `JEX_*` variable or `.env`. The commands run in this process (typer's
CliRunner) with Prefect fenced off: a case that got past pre-flight to a flow fails the test.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jex.cli import app
from tests.conftest import row, write_suite

BAD_FILES = ["/nonexistent/x.json", "{w}/dir", "{w}/binary.bin", "{w}/bad.json", "{w}/bad.toml", "{w}/empty",
             "{w}/text.txt/x", "{w}/list.json"]
"""Where a readable file of some format belongs."""
NONEMPTY_BAD_FILES = [f for f in BAD_FILES if "empty" not in f]
"""The same, less the empty file (an empty TOML file is a valid, empty table)."""
BAD_DIRS = ["/nonexistent/dir", "{w}/text.txt", "{w}/binary.bin", "{w}/dir", "{w}/emptysuite", "{w}/badsuite",
            "{w}/text.txt/x"]
"""Where a suite (or run) folder belongs."""
BAD_OUTS = ["{w}/text.txt", "{w}/text.txt/x", "{w}/binary.bin/out"]
"""Where an output folder belongs."""
BAD_MODELS = ["/nonexistent/model", "{w}/dir", "{w}/text.txt", "{w}/fake.gguf", "not a hub id", "org/"]
BAD_COUNTS = ["0", "-1", "-100"]
BAD_SEEDS = ["-1", "-99999999999"]
BAD_SHARES = ["-0.1", "1.5", "7"]
NOT_NUMBERS = ["x", "1,2", ""]
BAD_NAMES = ["nope", "", "HF"]

ENV_BAD = [{"JEX_INFRA__HOSTS": "not-json"}, {"JEX_BOOTSTRAP_DRAWS": "x"}, {"JEX_INFRA__SSH_PORT": "abc"},
           {"JEX_ENGINE__KIND": "zzz"}, {"JEX_INFRA": "{"}, {"JEX_BOOTSTRAP_SEED": "-5"}]


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    """Valid arguments (`{w}`: the world folder, `{o}`: an output path, `{arg}`: the positional argument)."""
    slots: tuple[tuple[str, tuple[str, ...]], ...]
    """(flag, bad values) pairs: one is set per case; the flag `ARG` is the positional argument."""
    settings: bool = True
    """Whether the command reads settings (a broken variable is then a bad input too)."""
    arg: str = "{w}/suite"
    """The positional argument when it is not the one made bad."""


def _cmd(*argv: str, settings: bool = True, arg: str = "{w}/suite", **slots: list[str]) -> Command:
    flags = tuple((k if k == "ARG" else k.replace("_", "-"), tuple(v)) for k, v in slots.items())
    return Command(argv, flags, settings, arg)


RUN_SLOTS = dict(__model=BAD_MODELS, __overlays=BAD_FILES + ["{w}/rule.toml", "{w}/rules_list.toml"],
                 __suite=BAD_DIRS, __spec=NONEMPTY_BAD_FILES, __render=NONEMPTY_BAD_FILES, __reference=BAD_FILES,
                 __resume=BAD_DIRS, __chat_template=["{w}/binary.bin", "{w}/dir", "/nonexistent/t.jinja"],
                 __coverage=BAD_SHARES + NOT_NUMBERS, __shard_rows=BAD_COUNTS, __workers=BAD_COUNTS,
                 __provider=BAD_NAMES, __engine=BAD_NAMES, __out=BAD_OUTS, __store=BAD_OUTS,
                 __reason_max_tokens=BAD_COUNTS, __batch_size=["-1"], __unknown_flag=["1"])

COMMANDS = {
    "run": _cmd("run", "--provider", "inprocess", "--out", "{o}", **RUN_SLOTS),
    "run-ssh-host": _cmd("run", "--provider", "ssh", "--out", "{o}", __host=["", "bad host", "a b:22", "-x"]),
    "calibrate": _cmd("calibrate", "--out", "{o}", __suite=BAD_DIRS, __coverage=BAD_SHARES,
                      __sample_every=BAD_COUNTS, __target_rows=BAD_COUNTS, __price=["-1"], __out=BAD_OUTS),
    "experiment-run": _cmd("experiment", "run", "--arms", "{w}/arms.toml", "-o", "{o}", __arms=BAD_FILES,
                           __suite=BAD_DIRS, __model=BAD_MODELS, __coverage=BAD_SHARES, __provider=BAD_NAMES,
                           __sample_rows=["0", "5"], __out=BAD_OUTS),
    "probe": _cmd("probe", "early-exit", "--suite", "{w}/suite", "-o", "{o}", settings=False, __suite=BAD_DIRS,
                  __model=BAD_MODELS, __rows=BAD_COUNTS, __every=BAD_COUNTS, __max_tokens=BAD_COUNTS,
                  __out=BAD_OUTS),
    "parity": _cmd("parity", "--suite", "{w}/suite", "-o", "{o}", settings=False, __suite=BAD_DIRS,
                   __model=BAD_MODELS, __engine_a=BAD_NAMES, __engine_b=BAD_NAMES, __rows=["-1"],
                   __batch_size=BAD_COUNTS, __reference=BAD_FILES, __out=BAD_OUTS),
    "bakeoff": _cmd("bakeoff", "-o", "{o}", settings=False, __arms=["nope", "hf-bi,zzz", ","],
                    __ladder=["1,x", "0", "", "1,,-2"], __prompts=BAD_COUNTS, __tokens=BAD_COUNTS,
                    __repeats=BAD_COUNTS, __reference_prompts=BAD_COUNTS, __model=BAD_MODELS, __out=BAD_OUTS),
    "score": _cmd("score", "--suite", "{w}/suite", "--predictions", "{w}/preds.jsonl", "-o", "{o}",
                  __bootstrap=BAD_COUNTS, __seed=BAD_SEEDS, __suite=BAD_DIRS, __predictions=BAD_FILES,
                  __out=BAD_OUTS),
    "score-from": _cmd("score", "--from", "lm-eval", "{w}/binary.bin", "-o", "{o}", __map_by=BAD_NAMES,
                       __from=BAD_NAMES),
    "bundle-build": _cmd("bundle", "build", "{arg}", "-o", "{o}/b.tar.gz", settings=False, ARG=BAD_DIRS,
                         __shard_rows=BAD_COUNTS, __reference=BAD_FILES, __out=["{w}/dir", "{w}/text.txt/x"]),
    "stage-run": _cmd("stage", "run", "--args", "{w}/x1.json", settings=False, __args=BAD_FILES,
                      __host_options=BAD_FILES),
    "stage-golden": _cmd("stage", "golden", "--args", "{w}/x1.json", settings=False, __args=BAD_FILES),
    "store-pull": _cmd("store", "pull", "--campaign", "c", __out=BAD_OUTS, __store=BAD_OUTS),
    "runs": _cmd("runs", __limit=BAD_COUNTS + NOT_NUMBERS),
    "suite-ls": _cmd("suite", "ls", "{arg}", settings=False, ARG=[d for d in BAD_DIRS if "empty" not in d]),
    "suite-validate": _cmd("suite", "validate", "{arg}", settings=False,
                           ARG=[d for d in BAD_DIRS if "empty" not in d]),
    "suite-sample": _cmd("suite", "sample", "-o", "{o}", settings=False, __out=BAD_OUTS, __seed=BAD_SEEDS),
    "show": _cmd("show", "{arg}", settings=False, ARG=BAD_DIRS + ["{w}/badrun"]),
    "export-lm-eval": _cmd("export", "lm-eval", "{arg}", "-o", "{o}", settings=False, ARG=BAD_DIRS),
    "overlays-mine": _cmd("overlays", "mine", "{arg}", "-o", "{o}", settings=False, ARG=BAD_DIRS + ["{w}/badrun"]),
    "overlays-gate": _cmd("overlays", "gate", "{w}/badrun", "--rules", "{w}/rules.toml", "-o", "{o}",
                          __rules=BAD_FILES + ["{w}/rule.toml"], __permutations=BAD_COUNTS, __seed=BAD_SEEDS,
                          __alpha=["0", "1.5"], __out=BAD_OUTS),
    "overlays-ladder": _cmd("overlays", "ladder", "{w}/badrun", "--rules", "{w}/rules.toml", "-o", "{o}",
                            settings=False, __gate=BAD_FILES, __rules=BAD_FILES, __out=BAD_OUTS),
    "experiment-ledger": _cmd("experiment", "ledger", "{arg}", settings=False, ARG=BAD_DIRS),
    "server-start": _cmd("server", "start", "--no-worker", __defaults=BAD_FILES),
    "infra-ledger": _cmd("infra", "ledger"),
    "config-show": _cmd("config", "show"),
}


def _world(root: Path) -> Path:
    """The files the cases point at: good ones (a suite, predictions, rules, arms) and bad ones."""
    w = root / "world"
    write_suite(w / "suite", {"a": [row(f"a{i}", "a") for i in range(4)]})
    write_suite(w / "emptysuite", {"a": []})
    (w / "badsuite").mkdir()
    (w / "badsuite" / "suite.toml").write_text("[legs\n")
    (w / "dir").mkdir()
    (w / "text.txt").write_text("hello\n")
    (w / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (w / "bad.json").write_text('{"x": ')
    (w / "list.json").write_text("[1, 2]")
    (w / "x1.json").write_text('{"x": 1}')
    (w / "bad.toml").write_text("a = = 1\n")
    (w / "empty").write_text("")
    (w / "fake.gguf").write_bytes(b"NOPE" + bytes(64))
    (w / "rule.toml").write_text('[[rule]]\nid = "r"\nkind = "abstain_below"\n')
    (w / "rules_list.toml").write_text("rules = [1]\n")
    (w / "rules.toml").write_text("")
    (w / "arms.toml").write_text('[[arms]]\nname = "p"\nkind = "placebo"\n')
    (w / "preds.jsonl").write_text("".join(f'{{"run_id": "a{i}", "choice": 0}}\n' for i in range(4)))
    (w / "badrun").mkdir()
    (w / "badrun" / "provenance.json").write_text('{"no": "stages"}')
    (w / "badrun" / "samples.parquet").write_bytes(b"PAR1" + bytes(100))
    (w / "badrun" / "predictions.parquet").write_bytes(b"garbage")
    (w / "badenv").mkdir()
    (w / "badenv" / ".env").write_bytes(b"JEX_X=\xff\xfe\n")
    (w / "state").mkdir()
    (w / "state" / "ledger.json").write_text('{"machines": [')
    return w


def _listing(root: Path) -> set[tuple[str, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


@pytest.fixture(scope="module")
def command():
    """The click command of the app, built once (typer builds it again on every `invoke(app)`)."""
    return typer.main.get_command(app)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return _world(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="module")
def fenced():
    """Prefect fenced off: a bad input that reached a flow fails the case."""
    import jex.cli.common as common

    def reached(*a, **k):
        raise AssertionError("pre-flight let a bad input through to Prefect")

    mp = pytest.MonkeyPatch()
    mp.setattr(common, "connect_prefect", reached)
    for module in ("jex.cli.run", "jex.cli.engines", "jex.cli.experiment", "jex.cli.infra"):
        mp.setattr(f"{module}.connect_prefect", reached)
    yield
    mp.undo()


@st.composite
def cases(draw):
    name = draw(st.sampled_from(sorted(COMMANDS)))
    cmd = COMMANDS[name]
    kinds = ["flag"] * bool(cmd.slots) + ["env"] * cmd.settings + ["dotenv"] * cmd.settings
    kind = draw(st.sampled_from(kinds))
    if kind == "flag":
        flag, values = draw(st.sampled_from(cmd.slots))
        return name, flag, draw(st.sampled_from(values)), {}
    if kind == "env":
        return name, None, None, draw(st.sampled_from(ENV_BAD))
    return name, None, None, {"DOTENV": "1"}


def _argv(name: str, flag: str | None, value: str | None, w: Path, out: Path) -> list[str]:
    """The command line of a case: the command's valid arguments, with `flag` set to the bad `value`."""
    cmd = COMMANDS[name]
    arg = value if flag == "ARG" and value is not None else cmd.arg
    argv = [a.format(w=w, o=out, arg=arg.format(w=w)) for a in cmd.argv]
    if flag is not None and flag != "ARG" and value is not None:
        argv += [flag, value.format(w=w, o=out)]
    return argv


def _env(extra: dict[str, str], w: Path) -> dict[str, str | None]:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("JEX_")}
    env.update({"PREFECT_API_URL": "http://127.0.0.1:9/api", "JEX_INFRA__STATE_DIR": str(w / "state"),
                "COLUMNS": "200"})
    env.update({k: v for k, v in extra.items() if k != "DOTENV"})
    return env


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_a_bad_input_is_one_line_never_a_traceback(case, world, fenced, command):
    name, flag, value, env = case
    out = world.parent / "out-never-written"
    argv = _argv(name, flag, value, world, out)
    before = _listing(world.parent)
    cwd = os.getcwd()
    os.chdir(world / ("badenv" if "DOTENV" in env else "dir"))
    try:
        result = CliRunner().invoke(command, argv, env=_env(env, world))
    finally:
        os.chdir(cwd)
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code in (1, 2), f"{argv} {env}: exit {result.exit_code}\n{text}\n{result.exception!r}"
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{argv} {env}: {result.exception!r}")
    assert "Traceback" not in text, f"{argv} {env}:\n{text}"
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors or result.exit_code == 2 or name == "suite-validate", f"{argv} {env}: no error line\n{text}"
    assert _listing(world.parent) == before, f"{argv} {env}: wrote {_listing(world.parent) - before}"
