"""One explicit case of each kind of bad input (issue 28): the error boundary, pre-flight, settings,
the fleet's failure path, SSH keys, server auth and bundle size limits."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.errors import InfraError, InputError, JexError, ServerError, user_error
from tests.conftest import row, write_suite

JEX = str(Path(sys.executable).with_name("jex"))


@pytest.fixture(autouse=True)
def clean(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("JEX_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def no_prefect(monkeypatch):
    """A command that reaches Prefect fails the test: pre-flight must refuse first."""
    def reached(settings):
        raise AssertionError("reached Prefect")

    for module in ("jex.cli.run", "jex.cli.engines", "jex.cli.experiment", "jex.cli.common"):
        monkeypatch.setattr(f"{module}.connect_prefect", reached)


# --- 1. one error boundary ---------------------------------------------------------------------------

def test_environment_errors_become_one_line_jex_errors(tmp_path):
    err = user_error(IsADirectoryError(21, "Is a directory", str(tmp_path)))
    assert isinstance(err, InputError)
    assert str(err) == f"file {tmp_path}: Is a directory; expected a file, found a folder"
    assert isinstance(user_error(ConnectionRefusedError(111, "Connection refused")), InfraError)
    assert user_error(RuntimeError("a bug")) is None and user_error(KeyError("x")) is None


def test_a_bug_keeps_its_traceback_and_asks_to_be_reported(monkeypatch, capsys):
    import jex.cli as cli

    monkeypatch.setattr(cli, "app", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and "Traceback" in err and "RuntimeError: boom" in err
    assert "this is a bug in jex" in err.splitlines()[-1]


def test_a_jex_error_inside_a_flow_leaves_the_console_to_jex(capsys):
    """Prefect's console handler drops a run's record of a user's error (its traceback stays in the run's
    log, the API handler); a bug's record still reaches the console."""
    from prefect.logging.handlers import PrefectConsoleHandler

    from jex.cli.common import _UserErrorOnConsole, quiet_user_errors_in_flows

    quiet_user_errors_in_flows()
    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    assert consoles and all(any(isinstance(f, _UserErrorOnConsole) for f in h.filters) for h in consoles)

    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1,
                                 "Encountered exception during execution: %r", (exc,), (type(exc), exc, None))

    assert not _UserErrorOnConsole().filter(record(InputError("bad suite", file="s")))
    assert _UserErrorOnConsole().filter(record(RuntimeError("a bug")))


def test_user_errors_exit_1_and_usage_errors_exit_2(tmp_path):
    bad = CliRunner().invoke(app, ["suite", "ls", str(tmp_path / "missing")])
    usage = CliRunner().invoke(app, ["suite", "ls", "--no-such-flag"])
    assert bad.exit_code == 1 and bad.stderr.startswith("error: ") and len(bad.stderr.splitlines()) == 1
    assert usage.exit_code == 2


# --- 2. pre-flight -----------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--overlays", "--model"])
def test_jex_run_refuses_a_missing_file_in_under_3_s_and_writes_nothing(flag, tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([JEX, "run", flag, "/nonexistent", "--out", str(tmp_path / "runs")], capture_output=True,
                       text=True, env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{flag}: no such" in p.stderr and not (tmp_path / "runs").exists()
    assert took < 3 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)), took  # 3 s on an idle machine


def test_a_rule_file_with_rule_instead_of_rules_is_refused(tmp_path, no_prefect):
    (tmp_path / "rules.toml").write_text('[[rule]]\nid = "r1"\nkind = "abstain_below"\n')
    result = CliRunner().invoke(app, ["run", "--overlays", "rules.toml", "--out", "runs"])
    assert result.exit_code == 1 and "unknown top-level key 'rule'" in result.stderr and "[[rules]]" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_an_empty_suite_and_a_garbage_gguf_are_refused_before_any_flow(tmp_path, no_prefect):
    write_suite(tmp_path / "empty", {"a": []})
    (tmp_path / "m.gguf").write_bytes(b"garbage" * 10)
    empty = CliRunner().invoke(app, ["run", "--suite", "empty", "--out", "runs"])
    gguf = CliRunner().invoke(app, ["run", "--model", "m.gguf", "--out", "runs"])
    assert empty.exit_code == 1 and "the suite has no rows" in empty.stderr
    assert gguf.exit_code == 1 and "not a GGUF file" in gguf.stderr and not (tmp_path / "runs").exists()


def test_suite_validate_refuses_a_catalog_without_rows(tmp_path, no_prefect):
    write_suite(tmp_path / "empty", {"a": []})
    result = CliRunner().invoke(app, ["suite", "validate", "empty"])
    assert result.exit_code == 1 and "catalog 'a' has no rows" in result.output


def test_stage_args_with_an_unknown_record_is_one_line(tmp_path):
    (tmp_path / "args.json").write_text('{"x": 1}')
    result = CliRunner().invoke(app, ["stage", "run", "--args", "args.json"])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: file args.json, field 'inputs'")


def bad(name: str, needle: str, *argv: str, usage: bool = False) -> object:
    """One row of the table: `jex ARGV` is refused, its one error line naming `needle` (exit 2: a usage error)."""
    return pytest.param(list(argv), needle, 2 if usage else 1, id=name)


HF = ("--split", "test", "--question", "question", "--choices", "choices", "--answer", "answer")

def local_task(folder: Path, name: str, extra: str = "") -> None:
    """An lm-eval multiple_choice task YAML reading local JSON rows, with no data files of its own."""
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\noutput_type: multiple_choice\ntest_split: test\n{extra}"
        'doc_to_text: "Q: {{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n')


BAD_INPUTS = [
    # numbers out of range and unknown names
    bad("bootstrap-0", "--bootstrap", "score", "--suite", "s", "--predictions", "p.jsonl", "-o", "out",
        "--bootstrap", "0"),
    bad("seed-negative", "--seed", "score", "--suite", "s", "--predictions", "p.jsonl", "-o", "out", "--seed", "-1"),
    bad("shard-rows-0", "--shard-rows", "bundle", "build", "s", "-o", "b.tar.gz", "--shard-rows", "0"),
    bad("ladder-not-numbers", "--ladder", "bakeoff", "-o", "out", "--ladder", "1,x"),
    bad("unknown-arm", "unknown arm 'nope'", "bakeoff", "-o", "out", "--arms", "hf-bi,nope"),
    # jex run: paths, files, numbers and names (README: run, --resume, what the model reads, machines, throughput)
    bad("run-suite-missing", "file missing: --suite: no such folder", "run", "--suite", "missing", "--out", "runs"),
    bad("run-suite-a-file", "file text.txt: --suite: expected a suite folder", "run", "--suite", "text.txt"),
    bad("run-model-missing", "file /nonexistent: --model", "run", "--model", "/nonexistent", "--out", "runs"),
    bad("run-coverage-over-1", "--coverage", "run", "--coverage", "1.5", "--out", "runs"),
    bad("run-coverage-not-a-number", "'--coverage'", "run", "--coverage", "x", usage=True),
    bad("run-spec-missing", "file missing.toml", "run", "--spec", "missing.toml"),
    bad("run-spec-not-toml", "file bad.toml", "run", "--spec", "bad.toml"),
    bad("run-resume-missing", "file missing: --resume: no such folder", "run", "--resume", "missing"),
    bad("run-resume-a-suite", "file s: --resume: expected a folder holding campaign.json", "run", "--resume", "s"),
    bad("run-chat-template-missing", "--chat-template", "run", "--chat-template", "/nonexistent.jinja"),
    bad("run-render-not-toml", "--render", "run", "--render", "bad.toml", "--out", "runs"),
    bad("run-num-fewshot-negative", "num_fewshot", "run", "--num-fewshot", "-1", "--out", "runs"),
    bad("run-gpu-memory-over", "--gpu-memory-utilization", "run", "--gpu-memory-utilization", "1.5"),
    bad("run-max-model-len-0", "--max-model-len", "run", "--max-model-len", "0", "--out", "runs"),
    bad("run-provider-unknown", "--provider", "run", "--provider", "nope", "--out", "runs"),
    bad("run-workers-0", "--workers", "run", "--workers", "0", "--out", "runs"),
    bad("run-budget-negative", "--budget-usd", "run", "--budget-usd", "-1", "--out", "runs"),
    bad("run-engines-per-gpu-0", "--engines-per-gpu", "run", "--engines-per-gpu", "0", "--out", "runs"),
    bad("run-gpus-per-machine-0", "--gpus-per-machine", "run", "--gpus-per-machine", "0", "--out", "runs"),
    bad("run-batch-size-negative", "--batch-size", "run", "--batch-size", "-1", "--out", "runs"),
    bad("run-max-num-seqs-0", "--max-num-seqs", "run", "--max-num-seqs", "0", "--out", "runs"),
    bad("run-audit-unknown", "--audit", "run", "--audit", "nope", "--out", "runs"),
    bad("run-audit-prompts-0", "--audit-prompts", "run", "--audit-prompts", "0", "--out", "runs"),
    bad("run-out-a-file", "file text.txt: --out", "run", "--out", "text.txt"),
    bad("run-store-under-a-file", "file text.txt/x: --store", "run", "--store", "text.txt/x", "--out", "runs"),
    bad("run-unknown-flag", "--no-such-flag", "run", "--no-such-flag", "1", usage=True),
    bad("run-flag-without-value", "--system-prompt", "run", "--system-prompt", usage=True),
    # jex suite import hf
    bad("hf-mistyped-local-file", "--dataset: no such file: nosuch.jsonl", "suite", "import", "hf", "--dataset",
        "nosuch.jsonl", *HF, "-o", "out"),
    bad("hf-unknown-hub-id-offline", "--dataset someorg/nosuchdata: not in the local Hugging Face cache", "suite",
        "import", "hf", "--dataset", "someorg/nosuchdata", *HF, "-o", "out"),
    bad("hf-no-such-column", "field '--question nope'", "suite", "import", "hf", "--dataset", "rows.jsonl",
        *HF[:2], "--question", "nope", *HF[4:], "-o", "out"),
    bad("hf-no-such-cluster-column", "field '--cluster nope'", "suite", "import", "hf", "--dataset", "rows.jsonl",
        *HF, "--cluster", "nope", "-o", "out"),
    bad("hf-not-a-data-file", "file text.txt: expected Parquet", "suite", "import", "hf", "--dataset", "text.txt",
        *HF, "-o", "out"),
    bad("hf-not-json", "file bad.jsonl: cannot read the dataset", "suite", "import", "hf", "--dataset", "bad.jsonl",
        *HF, "-o", "out"),
    bad("hf-output-not-empty", "file full: output folder exists and is not empty", "suite", "import", "hf",
        "--dataset", "rows.jsonl", *HF, "-o", "full"),
    bad("hf-split-missing", "'--split'", "suite", "import", "hf", "--dataset", "rows.jsonl", *HF[2:], "-o", "out",
        usage=True),
    # jex suite import lm-eval
    bad("lm-eval-local-json-without-data-files", "file nodata.yaml, field 'dataset_kwargs.data_files': task 'nodata' "
        "reads dataset_path: json from local files, and none are given: add --data-files test=FILE", "suite",
        "import", "lm-eval", "--task", "nodata.yaml", "-o", "out"),
    bad("lm-eval-fewshot-split-without-data", "file shots.yaml, field 'fewshot_split': task 'shots' reads split "
        "'train'", "suite", "import", "lm-eval", "--task", "shots.yaml", "--data-files", "test=rows.jsonl", "-o",
        "out"),
    bad("lm-eval-yaml-missing", "file nosuch.yaml: no such task YAML", "suite", "import", "lm-eval", "--task",
        "nosuch.yaml", "-o", "out"),
    bad("lm-eval-yaml-broken", "file broken.yaml: cannot read the task YAML", "suite", "import", "lm-eval",
        "--task", "broken.yaml", "-o", "out"),
    bad("lm-eval-yaml-broken-with-data-files", "file broken.yaml: cannot read the task YAML", "suite", "import",
        "lm-eval", "--task", "broken.yaml", "--data-files", "test=rows.jsonl", "-o", "out"),
    bad("lm-eval-data-files-without-split", "--data-files 'test': expected SPLIT=FILE", "suite", "import",
        "lm-eval", "--task", "nodata.yaml", "--data-files", "test", "-o", "out"),
    bad("lm-eval-data-file-missing", "file nosuch.jsonl: data file does not exist", "suite", "import", "lm-eval",
        "--task", "nodata.yaml", "--data-files", "test=nosuch.jsonl", "-o", "out"),
    bad("lm-eval-data-file-not-data", "--data-files must be Parquet", "suite", "import", "lm-eval", "--task",
        "nodata.yaml", "--data-files", "test=text.txt", "-o", "out"),
    bad("lm-eval-no-such-cluster-field", "field '--cluster nope'", "suite", "import", "lm-eval", "--task",
        "nodata.yaml", "--data-files", "test=rows.jsonl", "--cluster", "nope", "-o", "out"),
    bad("lm-eval-output-not-empty", "file full: output folder exists", "suite", "import", "lm-eval", "--task",
        "nodata.yaml", "--data-files", "test=rows.jsonl", "-o", "full"),
    # jex suite validate | ls | sample, jex bundle build, jex score
    bad("validate-missing", "file missing: SUITE: no such folder", "suite", "validate", "missing"),
    bad("validate-limit-0", "--limit", "suite", "validate", "s", "--limit", "0"),
    bad("ls-a-file", "file text.txt: SUITE: expected a folder", "suite", "ls", "text.txt"),
    bad("sample-rows-0", "--rows", "suite", "sample", "-o", "out", "--rows", "0"),
    bad("sample-seed-negative", "--seed", "suite", "sample", "-o", "out", "--seed", "-1"),
    bad("sample-out-a-file", "file text.txt: --out", "suite", "sample", "-o", "text.txt"),
    bad("bundle-suite-missing", "file missing: SUITE: no such folder", "bundle", "build", "missing", "-o", "b.tar.gz"),
    bad("bundle-reference-missing", "file missing.parquet: --reference", "bundle", "build", "s", "-o", "b.tar.gz",
        "--reference", "missing.parquet"),
    bad("bundle-out-a-folder", "file s: --out: expected a file", "bundle", "build", "s", "-o", "s"),
    bad("score-predictions-missing", "file missing.jsonl: --predictions", "score", "--suite", "s", "--predictions",
        "missing.jsonl", "-o", "out"),
    bad("score-predictions-without-run-id", "file noid.jsonl, row 1, field 'run_id'", "score", "--suite", "s",
        "--predictions", "noid.jsonl", "-o", "out"),
    bad("score-from-source-missing", "SOURCE missing", "score", "--from", "lm-eval", "missing", "-o", "out"),
    # jex calibrate, bakeoff, parity
    bad("calibrate-coverage-over-1", "--coverage", "calibrate", "--coverage", "1.5"),
    bad("calibrate-target-rows-0", "--target-rows", "calibrate", "--target-rows", "0"),
    bad("calibrate-price-negative", "--price", "calibrate", "--price", "-1"),
    bad("calibrate-suite-missing", "file missing: --suite", "calibrate", "--suite", "missing"),
    bad("bakeoff-prompts-0", "--prompts", "bakeoff", "-o", "out", "--prompts", "0"),
    bad("bakeoff-out-a-file", "file text.txt: --out", "bakeoff", "-o", "text.txt"),
    bad("parity-suite-missing", "file missing: --suite", "parity", "--suite", "missing", "-o", "out"),
    bad("parity-engine-unknown", "--engine-a", "parity", "--suite", "s", "-o", "out", "--engine-a", "nope"),
    bad("parity-reference-missing", "file missing.parquet: --reference", "parity", "--suite", "s", "-o", "out",
        "--reference", "missing.parquet"),
    # a run folder's readers: jex show, export, diff, compare, overlays
    bad("show-a-suite-folder", "file s: a suite folder (holds suite.toml), not a run folder: jex run --suite s",
        "show", "s"),
    bad("show-missing", "file missing: RUN: no such folder", "show", "missing"),
    bad("export-a-suite-folder", "file s: a suite folder", "export", "lm-eval", "s", "-o", "out"),
    bad("export-inspect-missing", "file missing", "export", "inspect", "missing", "-o", "out"),
    bad("diff-missing", "file missing: RUN_A", "diff", "missing", "s"),
    bad("compare-missing", "file missing: RUN", "compare", "missing"),
    bad("overlays-mine-missing", "file missing: expected a finished run folder", "overlays", "mine", "missing",
        "-o", "out"),
    bad("overlays-gate-rules-missing", "file missing.toml: --rules", "overlays", "gate", "s", "--rules",
        "missing.toml", "-o", "out"),
    bad("overlays-ladder-rules-not-toml", "file bad.toml", "overlays", "ladder", "s", "--rules", "bad.toml", "-o",
        "out"),
    # jex experiment, stage, server, runs, ledger
    bad("experiment-arms-missing", "file missing.toml: --arms", "experiment", "run", "--arms", "missing.toml", "-o",
        "out"),
    bad("experiment-arms-not-toml", "file text.txt: --arms", "experiment", "run", "--arms", "text.txt", "-o", "out"),
    bad("stage-args-missing", "file missing.json: --args", "stage", "run", "--args", "missing.json"),
    bad("stage-args-not-json", "file bad.json: --args: not valid JSON", "stage", "run", "--args", "bad.json"),
    bad("server-defaults-not-json", "file bad.json: --defaults", "server", "start", "--defaults", "bad.json",
        "--no-worker"),
    bad("runs-limit-0", "--limit", "runs", "--limit", "0"),
    bad("ledger-extra-argument", "(missing)", "ledger", "missing", usage=True),
]
"""Bad inputs to the README's commands, each refused in one line naming it, before anything is written."""


@pytest.fixture(scope="module")
def bad_world(tmp_path_factory) -> Path:
    """The files the table's rows name: a suite, predictions, data rows, lm-eval tasks, and bad files."""
    w = tmp_path_factory.mktemp("bad-inputs")
    write_suite(w / "s", {"a": [row("a1", "a")]})
    (w / "p.jsonl").write_text('{"run_id": "a1", "choice": 0}\n')
    (w / "noid.jsonl").write_text('{"choice": 0}\n')
    (w / "rows.jsonl").write_text('{"question": "1 + 1?", "choices": ["2", "3"], "answer": 0}\n')
    (w / "bad.jsonl").write_bytes(b"\xff\xfe not json\n")
    (w / "text.txt").write_text("hello\n")
    (w / "bad.toml").write_text("a = = 1\n")
    (w / "bad.json").write_text('{"x": ')
    (w / "full").mkdir()
    (w / "full" / "x").write_text("x")
    local_task(w, "nodata")
    local_task(w, "shots", "fewshot_split: train\nnum_fewshot: 1\n")
    (w / "broken.yaml").write_text("task: [\n")
    return w


@pytest.fixture(scope="module")
def jex_command():
    """The click command of the app, built once (typer builds it again on every `invoke(app)`)."""
    import typer

    return typer.main.get_command(app)


def _listing(root: Path) -> set[tuple[str, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


@pytest.mark.parametrize(("argv", "needle", "code"), BAD_INPUTS)
def test_a_bad_input_is_one_line_naming_it(argv, needle, code, bad_world, jex_command, no_prefect, monkeypatch):
    """Exit 1 with one `error:` line naming the input (2 and one line naming the flag for a usage error),
    no traceback, nothing written; offline, so no Hub is asked."""
    import datasets
    from click.testing import CliRunner as ClickRunner
    from huggingface_hub import constants

    monkeypatch.chdir(bad_world)
    for module in (constants, datasets.config):  # read from the variables at import: imported first, kept as they are
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", module.HF_HUB_OFFLINE)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    before = _listing(bad_world)
    result = ClickRunner().invoke(jex_command, argv, env={"COLUMNS": "200"})
    err = result.stderr
    assert result.exit_code == code and "Traceback" not in err + result.stdout, (result.exit_code, err,
                                                                                   result.exception)
    if code == 1:
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and needle in err, err
    else:
        assert sum(needle in line for line in err.splitlines()) == 1, err
    assert _listing(bad_world) == before


def test_a_hub_dataset_on_a_machine_without_a_network_is_refused_at_once_never_retried(tmp_path, monkeypatch,
                                                                                       caplog):
    """No HF_HUB_OFFLINE, but the Hub's host does not resolve: the libraries' own offline switch is on for the
    load, so no request is made, none retried (`huggingface_hub` retries 5 times over ~25 s) and none logged."""
    import socket

    from jex.suite_import import import_hf

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="^--dataset someorg/nosuchdata: not in the local Hugging Face cache, and "
                                         "the Hub is offline"):
        import_hf("someorg/nosuchdata", tmp_path / "out", split="test", question="q", choices="c", answer="a")
    assert time.monotonic() - t0 < 10 and "Retrying" not in caplog.text and not (tmp_path / "out").exists()


def test_an_ssh_host_without_an_ssh_server_is_refused_before_any_flow(tmp_path, no_prefect, monkeypatch):
    import socket

    with socket.socket() as silent:  # accepts connections, says nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setenv("JEX_INFRA__SSH_PORT", str(silent.getsockname()[1]))
        monkeypatch.setattr("jex.cli.preflight.reachable.__defaults__", (0.5,))
        result = CliRunner().invoke(app, ["run", "--provider", "ssh", "--host", "127.0.0.1", "--out", "runs"])
    assert result.exit_code == 1 and "--host 127.0.0.1: no SSH server answers" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()


# --- 3. settings -------------------------------------------------------------------------------------

def test_a_malformed_variable_is_named_and_config_show_still_shows(monkeypatch):
    monkeypatch.setenv("JEX_INFRA__HOSTS", "not-json")
    shown = CliRunner().invoke(app, ["config", "show"])
    other = CliRunner().invoke(app, ["score", "-o", "out"])
    assert shown.exit_code == 1 and '"infra"' in shown.stdout and "JEX_INFRA__HOSTS" in shown.stderr
    assert other.exit_code == 1 and other.stderr.startswith("error: field 'JEX_INFRA__HOSTS': not valid JSON")


def test_a_dotenv_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / ".env").write_bytes(b"JEX_STORE__ROOT=\xff\xfe\n")
    shown = CliRunner().invoke(app, ["config", "show"])
    other = CliRunner().invoke(app, ["runs"])
    assert shown.exit_code == 1 and '"store"' in shown.stdout and "file .env" in shown.stderr
    assert other.exit_code == 1 and "file .env: cannot read the settings file: not UTF-8" in other.stderr


# --- 4. the fleet's failure path ---------------------------------------------------------------------

def test_a_machine_that_never_started_is_reported_with_its_cause(tmp_path, monkeypatch, prefect_harness):
    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.infra.providers import ProviderError
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_suite(tmp_path / "s", {"a": [row("a1", "a")]}))
    job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=1), store=str(store.root))
    fleet = GpuFleet(MachinesSpec(provider="local"), campaign="c", store=str(store.root), settings=load_settings(),
                     echo=lambda s: None)

    def refuse(campaign, label):
        raise ProviderError("host 10.255.255.1 unreachable: No route to host")

    monkeypatch.setattr(fleet.provider, "create", refuse)
    with pytest.raises(InfraError, match="machine w0 of provider 'local' did not start: host 10.255.255.1"), fleet:
        fleet.run_stage(job)
    assert fleet.report().machines == []  # no None session reaches the report


# --- 5. keys -----------------------------------------------------------------------------------------

def _key_texts():
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    keys = [ed25519.Ed25519PrivateKey.generate(), rsa.generate_private_key(65537, 2048),
            ec.generate_private_key(ec.SECP256R1())]
    return [k.private_bytes(s.Encoding.PEM, fmt, s.NoEncryption()).decode()
            for k in keys for fmt in (s.PrivateFormat.OpenSSH, s.PrivateFormat.PKCS8)]


def test_every_key_format_loads_and_every_corrupted_key_is_one_line(tmp_path):
    from jex.infra.shell import load_private_key

    for text in _key_texts():
        assert load_private_key(text) is not None
        lines = text.splitlines()
        for i in range(1, len(lines) - 1):  # one byte changed in each line of the body
            line = lines[i]
            broken = "\n".join([*lines[:i], line[:5] + ("A" if line[5] != "A" else "B") + line[6:], *lines[i + 1:]])
            try:
                load_private_key(broken)
            except InfraError:
                pass  # one line; any other exception fails the test


def test_a_broken_key_path_is_refused_before_the_first_connection(tmp_path):
    from jex.infra.providers import SSHProvider

    (tmp_path / "key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nAAAA\n-----END OPENSSH PRIVATE KEY-----\n")
    with pytest.raises(InfraError, match="SSH private key file .*key"):
        SSHProvider(str(tmp_path), ["127.0.0.1"], key_path=tmp_path / "key")
    with pytest.raises(InfraError, match="cannot be read"):
        SSHProvider(str(tmp_path), ["127.0.0.1"], key_path=tmp_path / "missing")


# --- 6. server auth ----------------------------------------------------------------------------------

@pytest.mark.parametrize("auth", [":", "user:", ":pw", "nocolon", "admin:short-password"])
def test_weak_or_empty_credentials_are_refused_off_loopback(auth):
    from jex.deployments.server import check_auth_string

    with pytest.raises(ServerError, match="AUTH_STRING"):
        check_auth_string(auth, loopback=False)
    check_auth_string("admin:a-password-of-22-ch", loopback=False)
    check_auth_string("admin:short", loopback=True)


def test_jex_runs_without_a_server_is_one_line(monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    result = CliRunner().invoke(app, ["runs"])
    assert result.exit_code == 1 and result.stderr.startswith("error: no Prefect API answers at")


# --- 7. bundle limits --------------------------------------------------------------------------------

def test_a_bundle_over_its_size_limits_is_refused_before_a_byte_is_written(tmp_path, monkeypatch):
    from jex.tasks.bundle.bundle_file import BundleError, BundleLimits, build_bundle, open_bundle

    suite = write_suite(tmp_path / "s", {"a": [row(f"a{i}", "a") for i in range(20)]})
    build_bundle(suite, tmp_path / "b.tar.gz")
    with pytest.raises(BundleError, match="over the limit of 100 per member"):
        open_bundle(tmp_path / "b.tar.gz", tmp_path / "x", limits=BundleLimits(member_bytes=100))
    with pytest.raises(BundleError, match="add up to .* over the limit of 1000"):
        open_bundle(tmp_path / "b.tar.gz", tmp_path / "x", limits=BundleLimits(total_bytes=1000))
    monkeypatch.setenv("JEX_STORE__BUNDLE_MEMBER_MAX_BYTES", "100")
    with pytest.raises(BundleError, match="JEX_STORE__BUNDLE_MEMBER_MAX_BYTES"):
        open_bundle(tmp_path / "b.tar.gz", tmp_path / "x")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.*"))
    monkeypatch.delenv("JEX_STORE__BUNDLE_MEMBER_MAX_BYTES")
    assert open_bundle(tmp_path / "b.tar.gz", tmp_path / "y").rows().height == 20


def test_a_member_that_grows_past_its_declared_size_is_cut_off(tmp_path):
    import io
    import tarfile

    from jex.tasks.bundle.bundle_file import BundleError, _extract

    class Growing:
        """A tar whose member's data stream gives more than its header declared."""

        def extractfile(self, member):
            return io.BytesIO(bytes(10 << 20))

    member = tarfile.TarInfo("rows/a.bin")
    member.size = 4
    with pytest.raises(BundleError, match="grows past its declared 4 bytes; cut off"):
        _extract(Growing(), [member], tmp_path, Path("b.tar.gz"))  # type: ignore[arg-type]
    assert (tmp_path / "rows" / "a.bin").stat().st_size <= 4


def test_jex_error_is_the_root_of_settings_errors():
    from jex.errors import SettingsError

    assert issubclass(SettingsError, InputError) and issubclass(SettingsError, JexError)


# --- 8. models and keys that only look right -----------------------------------------------------------

def _gguf(version: int, tensors: int = 0, keys: int = 0, body: bytes = b"garbage" * 20) -> bytes:
    import struct

    return struct.pack("<4sIQQ", b"GGUF", version, tensors, keys) + body


@pytest.mark.parametrize("data, problem", [
    (b"GGUF" + bytes(4) + b"garbage" * 20, "GGUF version 0; jex reads versions 2 and 3"),
    (_gguf(3, 2**40, 2**40), "a corrupt or truncated GGUF file: its header declares 1099511627776 tensors"),
    (b"GGUF\x03", "a GGUF file cut short: 5 bytes"),
], ids=["version-0", "counts", "cut-short"])
def test_a_gguf_with_a_bad_header_is_one_line_naming_it_before_any_flow(data, problem, tmp_path):
    (tmp_path / "garbage.gguf").write_bytes(data)
    t0 = time.monotonic()
    p = subprocess.run([JEX, "run", "--model", "garbage.gguf", "--out", str(tmp_path / "runs")], capture_output=True,
                       text=True, env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}, timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"error: file garbage.gguf: --model: {problem}"), p.stderr
    assert not (tmp_path / "runs").exists()
    assert took < 3 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)), took  # 3 s on an idle machine


def test_a_gguf_whose_header_reads_but_whose_body_does_not_is_the_engines_one_line_error(tmp_path):
    """What the pre-flight cannot see (it reads the header only) the engine names in one line, as its own
    fatal error, not as a ValueError from inside transformers' reader."""
    from jex.engine.models import resolve_model
    from jex.engine.types import EngineDeadError

    (tmp_path / "m.gguf").write_bytes(_gguf(3, 0, 2, b"\x05" * 60))
    with pytest.raises(EngineDeadError) as err:
        resolve_model(tmp_path / "m.gguf", tmp_path / "cache")
    assert str(err.value).startswith(f"{tmp_path / 'm.gguf'}: not a GGUF model transformers can load (")
    assert "\n" not in str(err.value) and not list((tmp_path / "cache").rglob("m-*"))  # nothing half-converted
    (tmp_path / "v0.gguf").write_bytes(b"GGUF" + bytes(4) + b"garbage" * 20)
    with pytest.raises(EngineDeadError, match="v0.gguf: GGUF version 0; jex reads versions 2 and 3"):
        resolve_model(tmp_path / "v0.gguf", tmp_path / "cache")


@pytest.mark.parametrize("kind", ["RSA", "EC"])
@pytest.mark.parametrize("source", ["file", "variable"])
def test_a_pem_key_header_over_garbage_is_one_line_naming_where_the_key_came_from(kind, source, tmp_path,
                                                                                  no_prefect, monkeypatch):
    import base64
    import textwrap

    body = "\n".join(textwrap.wrap(base64.b64encode(b"garbage, not a key " * 12).decode(), 64))
    text = f"-----BEGIN {kind} PRIVATE KEY-----\n{body}\n-----END {kind} PRIVATE KEY-----\n"
    if source == "file":
        (tmp_path / "id_key").write_text(text)
        monkeypatch.setenv("JEX_INFRA__SSH_KEY_PATH", str(tmp_path / "id_key"))
        where = f"the SSH private key file {tmp_path / 'id_key'}"
    else:
        monkeypatch.setenv("JEX_INFRA__SSH_PRIVATE_KEY", text)
        where = "JEX_INFRA__SSH_PRIVATE_KEY"
    result = CliRunner().invoke(app, ["run", "--provider", "ssh", "--host", "127.0.0.1", "--out", "runs"])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {where} ({'ssh-rsa' if kind == 'RSA' else 'ecdsa'}) could not be loaded (")
    assert "Traceback" not in result.stderr and "The data may be in an incorrect format" not in result.stderr
    assert len(result.stderr) < 400 and not (tmp_path / "runs").exists()
