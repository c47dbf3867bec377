"""User errors print one line and no traceback, in every command; every deliberate error is a JexError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jex.engine.types import EngineDeadError, EngineError
from jex.errors import FlowError, InfraError, JexError, ServerError

ROOT = Path(__file__).resolve().parent.parent
JEX = str(Path(sys.executable).with_name("jex"))


def test_infra_flow_and_server_errors_share_the_one_root():
    from jex.deployments.server import ServerError as StartError
    from jex.flows.machines.golden import GoldenMismatch
    from jex.infra.cost_ledger import BudgetExceeded
    from jex.infra.machine import JobFailed
    from jex.infra.providers import ProviderError
    from jex.infra.s3 import UploadError
    from jex.infra.shell import ShellError, Unreachable
    from jex.tasks.bundle.bundle_file import BundleError

    for cls in (ShellError, Unreachable, ProviderError, UploadError, BudgetExceeded, JobFailed):
        assert issubclass(cls, InfraError) and issubclass(cls, JexError), cls
    assert issubclass(EngineError, JexError) and issubclass(EngineDeadError, JexError)
    assert issubclass(GoldenMismatch, FlowError) and issubclass(StartError, ServerError)
    assert issubclass(BundleError, JexError)


@pytest.mark.parametrize(("error", "retried"), [(EngineError("device busy"), True),
                                                (EngineDeadError("CUDA error"), False),
                                                (ValueError("a bug"), False), (FlowError("a user's error"), False)])
def test_the_engine_tasks_retry_only_a_recoverable_engine_error(error, retried):
    from prefect.states import Failed

    from jex.tasks.prefect_tasks import fast_pass_task, reason_task, recoverable

    assert recoverable(fast_pass_task, None, Failed(data=error)) is retried
    assert fast_pass_task.retry_condition_fn is reason_task.retry_condition_fn is recoverable


@pytest.mark.parametrize("argv", [
    ["stage", "run", "--args", "/nonexistent/args.json"],
    ["overlays", "mine", "/nonexistent/run", "-o", "{tmp}/out"],
    ["calibrate", "--coverage", "5"],
    ["bundle", "build", "/nonexistent/suite", "-o", "{tmp}/b.tar.gz"],
    ["run", "--provider", "inprocess", "--engines-per-gpu", "2", "--out", "{tmp}/runs"],
], ids=["stage-run", "overlays-mine", "calibrate", "bundle-build", "run-engine-slots-in-process"])
def test_a_user_error_prints_one_line_and_no_traceback(argv, tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never reached: the input is refused first
    p = subprocess.run([JEX, *[a.format(tmp=tmp_path) for a in argv]], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.startswith("error: "), p.stderr


def test_a_prefect_api_that_does_not_answer_is_one_line_naming_it(tmp_path):
    env = {**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    p = subprocess.run([JEX, "run", "--provider", "inprocess", "--out", str(tmp_path / "runs")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: the Prefect API at http://127.0.0.1:9/api does not answer"), p.stderr


def test_jex_traceback_shows_the_traceback_when_asked(tmp_path):
    env = {**os.environ, "JEX_TRACEBACK": "1"}
    p = subprocess.run([JEX, "stage", "run", "--args", "/nonexistent/args.json"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and "Traceback" in p.stderr
