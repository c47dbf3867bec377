"""A run folder finds its store wherever both live (issue 39): a campaign run in folder A, then resumed,
retried and mined from folder B with another HOME, moved to folder C, and pulled from S3 into a fresh
folder D, never computes its capture again; a stage no store here holds is refused, not recomputed.

One campaign (module fixture) through the real CLI; every later step is its own process, as a user's
next command would be. S3 is moto's server on 127.0.0.1, so every resume runs the flow (no stored-run
shortcut) and records its engine calls. The first run's flow reports to Prefect's temporary API (no server
configured, as `make run`); the later places' flows report to the session's Prefect test API (a running
server, as with `jex server start`): one temporary API server (the first run's), not one per flow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from jex.run_records import EngineCalls, RunStages

JEX = str(Path(sys.executable).with_name("jex"))
NO_ENGINE_CALLS = {"fast_pass": 0, "reason": 0}


def home(root: Path) -> Path:
    """A fresh HOME whose Prefect database template is the machine's (a migration costs 13 s, not the point)."""
    path = root / "home"
    (path / ".cache" / "jex").mkdir(parents=True, exist_ok=True)
    template = Path.home() / ".cache" / "jex" / "prefect-db"
    template.mkdir(parents=True, exist_ok=True)
    link = path / ".cache" / "jex" / "prefect-db"
    if not link.exists():
        link.symlink_to(template)
    return path


class Place:
    """A working folder with its own HOME and Prefect home, talking to one S3 bucket; its flows report to
    `api_url` (a running Prefect API), else to a temporary API each flow starts."""

    def __init__(self, root: Path, s3: dict[str, str], api_url: str | None = None):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.s3 = root, s3
        self.env = {**os.environ, **s3, "HOME": str(home(root)), "PREFECT_HOME": str(root / "prefect"),
                    "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        for name in [n for n in self.env if n.startswith("JEX_") and n not in s3]:
            del self.env[name]
        self.env.pop("PREFECT_API_URL", None)
        if api_url:
            self.env["PREFECT_API_URL"] = api_url

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(list(args), capture_output=True, text=True, env=self.env, cwd=self.root, timeout=400)
        assert (p.returncode == 0) == ok, p.stdout[-2000:] + p.stderr[-3000:]
        return p

    def jex(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        return self.run(JEX, *args, ok=ok)


@pytest.fixture(scope="module")
def s3_env(s3_server) -> dict[str, str]:
    import boto3

    bucket = "jex-anywhere"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=bucket)
    return {"JEX_STORE__S3_BUCKET": bucket, "JEX_STORE__S3_PREFIX": "jex", "JEX_STORE__S3_ENDPOINT_URL": s3_server,
            "JEX_INFRA__AWS_ACCESS_KEY_ID": "test", "JEX_INFRA__AWS_SECRET_ACCESS_KEY": "test"}


class FirstRun(NamedTuple):
    run_dir: Path
    predictions: bytes
    capture: bytes
    suite: Path
    model: Path


@pytest.fixture(scope="module")
def first(tmp_path_factory, s3_env, embedded_model_dir) -> FirstRun:
    """A campaign run in folder A, its store in A (relative flags, as a user types them)."""
    from jex.sample_suite import write_sample_suite

    root = tmp_path_factory.mktemp("anywhere")
    suite = write_sample_suite(root / "suite", rows=18, seed=5)
    a = Place(root / "A", s3_env)
    p = a.jex("run", "--suite", str(suite), "--model", str(embedded_model_dir), "--provider", "inprocess",
              "--coverage", "0.2", "--reason-max-tokens", "8", "--shard-rows", "9", "--name", "t", "--out", "runs",
              "--quiet")
    run_dir = Path(p.stdout.strip().splitlines()[-1])
    assert run_dir.is_absolute() and run_dir.parent == a.root / "runs"
    fast_pass = Path(RunStages.read(run_dir).root["fast_pass"].folder)
    assert fast_pass.parent.parent == a.root / "runs" / "store"
    return FirstRun(run_dir, (run_dir / "predictions.parquet").read_bytes(),
                    (fast_pass / "capture.parquet").read_bytes(), suite, embedded_model_dir)


def assert_nothing_recomputed(run_dir: Path, predictions: bytes) -> None:
    calls = EngineCalls.read(run_dir)
    assert calls.calls == NO_ENGINE_CALLS and calls.in_process == NO_ENGINE_CALLS
    assert (run_dir / "predictions.parquet").read_bytes() == predictions


@pytest.mark.slow
def test_a_run_is_resumed_retried_mined_moved_and_pulled_without_computing_its_capture_again(
        first, tmp_path, s3_env, prefect_api_url):
    run_dir, predictions = first.run_dir, first.predictions
    b = Place(tmp_path / "B", s3_env, prefect_api_url)

    # from another folder and HOME, through the default (local) provider: same run folder, no engine call
    p = b.jex("run", "--resume", str(run_dir), "--provider", "local", "--quiet")
    assert Path(p.stdout.strip().splitlines()[-1]) == run_dir
    assert_nothing_recomputed(run_dir, predictions)

    # the retry-stage flow, as the deployment's worker runs it (its own working folder); a retry of an engine
    # stage reads the stages before it from the run's store (test_server.py retries a decision stage)
    b.run(sys.executable, "-c", f"from jex.flows.retry_stage import retry_stage; retry_stage({str(run_dir)!r}, "
          "'reason')")
    assert_nothing_recomputed(run_dir, predictions)
    assert EngineCalls.read(run_dir).redo[0] == "reason"

    # the run folder and its store moved together: mined and resumed where they are now
    c = tmp_path / "C"
    shutil.move(str(run_dir.parent), str(c / "runs"))
    moved = c / "runs" / run_dir.name
    b.jex("overlays", "mine", str(moved), "-o", str(b.root / "mined"))
    assert (b.root / "mined" / "candidates.toml").is_file()
    b.jex("run", "--resume", str(moved), "--quiet")
    assert_nothing_recomputed(moved, predictions)
    assert RunStages.read(moved).root["fast_pass"].folder.startswith(str(c / "runs" / "store"))

    # a store that lacks the recorded stages is refused in one line, not silently recomputed (no S3 to pull from)
    refused = Place(tmp_path / "B2", {}).jex("run", "--resume", str(moved), "--store", str(b.root / "empty-store"),
                                             ok=False)
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "empty-store" in refused.stderr and "--store" in refused.stderr and "--recompute" in refused.stderr

    # another machine: the local store is gone; `jex store pull` brings the run back into a fresh folder
    shutil.rmtree(c)
    d = Place(tmp_path / "D", s3_env, prefect_api_url)
    pulled = Path(d.jex("store", "pull", "--campaign", run_dir.name, "--out", "runs").stdout.strip().splitlines()[-1])
    d.jex("run", "--resume", str(pulled), "--quiet")
    assert_nothing_recomputed(d.root / pulled, predictions)


@pytest.mark.slow
def test_a_bundle_file_gives_the_capture_of_the_suite_it_was_built_from(first, tmp_path, prefect_api_url):
    e = Place(tmp_path / "E", {}, prefect_api_url)
    e.jex("bundle", "build", str(first.suite), "-o", "suite.tar.gz")
    p = e.jex("run", "--suite", "suite.tar.gz", "--model", str(first.model), "--provider", "inprocess",
              "--coverage", "0", "--shard-rows", "4", "--name", "b", "--out", "runs", "--quiet")
    fast_pass = Path(RunStages.read(Path(p.stdout.strip().splitlines()[-1])).root["fast_pass"].folder)
    assert (fast_pass / "capture.parquet").read_bytes() == first.capture
