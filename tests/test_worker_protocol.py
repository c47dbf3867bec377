"""The worker protocol: a detached run writes heartbeats and exactly one marker, last, with checksums."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jex.fileio import sha256_file
from jex.infra.records import Marker
from jex.infra.worker_protocol import FAILED, SUCCESS, read_heartbeat, read_marker

WRAP = [sys.executable, "-m", "jex.infra.worker_protocol"]


def wait_for_marker(run_dir: Path, timeout: float = 300) -> Marker:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (marker := read_marker(run_dir)) is not None:
            return marker
        time.sleep(0.2)
    raise AssertionError(f"no marker in {run_dir} after {timeout} s")


@pytest.mark.slow
def test_detached_stage_run_writes_success_with_verified_artifacts(tmp_path):
    from jex.engine_spec import EngineSpec
    from jex.sample_suite import write_sample_suite
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    run_dir = tmp_path / "machine" / "run-1"
    store = run_dir / "store"
    bundle = bundle_stage(LocalStore(store), suite=write_sample_suite(tmp_path / "suite", rows=18, seed=2))
    args = run_dir / "args.json"
    args.write_text(EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(), shard_rows=6),
                              store=str(store)).model_dump_json())
    cmd = ["setsid", "nohup", *WRAP, str(run_dir), "--heartbeat", "0.5", "--artifacts", "store/fast_pass/**/*.parquet",
           "--", sys.executable, "-m", "jex", "stage", "run", "--args", str(args)]
    subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # not waited on
    marker = wait_for_marker(run_dir)
    assert marker.ok and marker.exit_code == 0 and not (run_dir / FAILED).exists()
    paths = {a.path for a in marker.artifacts}
    assert any(p.endswith("capture.parquet") for p in paths) and sum("shard-" in p for p in paths) == 3
    for a in marker.artifacts:
        assert sha256_file(run_dir / a.path) == a.sha256
    assert read_heartbeat(run_dir).command == sys.executable
    assert "fast_pass" in (run_dir / "run.log").read_text()


def test_failing_command_writes_failed_with_exit_code(tmp_path):
    code = subprocess.run([*WRAP, str(tmp_path), "--", sys.executable, "-c", "import sys; sys.exit(3)"]).returncode
    marker = read_marker(tmp_path)
    assert code == 3 and not marker.ok and marker.exit_code == 3 and marker.reason == "exit code 3"
    assert not (tmp_path / SUCCESS).exists()


def test_success_without_artifacts_is_a_failure(tmp_path):
    subprocess.run([*WRAP, str(tmp_path), "--artifacts", "*.parquet", "--", "true"], check=True)
    marker = read_marker(tmp_path)
    assert not marker.ok and "no artifact matched *.parquet" in marker.reason


def test_killed_worker_process_is_recorded_and_artifacts_salvaged(tmp_path):
    script = "open('part.parquet', 'w').write('x'); import time; time.sleep(60)"
    proc = subprocess.Popen([*WRAP, str(tmp_path), "--heartbeat", "0.2", "--artifacts", "*.parquet", "--",
                             sys.executable, "-c", script])
    deadline = time.time() + 30
    while (read_heartbeat(tmp_path) is None or not (tmp_path / "part.parquet").exists()) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(read_heartbeat(tmp_path).pid, signal.SIGKILL)
    proc.wait(timeout=30)
    marker = read_marker(tmp_path)
    assert not marker.ok and marker.exit_code == -9
    assert [a.path for a in marker.artifacts] == ["part.parquet"]


def test_rerun_clears_the_old_marker_first(tmp_path):
    subprocess.run([*WRAP, str(tmp_path), "--", "false"])
    assert (tmp_path / FAILED).exists()
    (tmp_path / "a.parquet").write_text("x")
    subprocess.run([*WRAP, str(tmp_path), "--artifacts", "*.parquet", "--", "true"], check=True)
    assert read_marker(tmp_path).ok and not (tmp_path / FAILED).exists()


def test_markers_on_disk_keep_their_keys(tmp_path):
    """Other rooms and older tools read the files: SUCCESS.json has no `reason`, FAILED.json has one."""
    (tmp_path / "a.parquet").write_text("x")
    subprocess.run([*WRAP, str(tmp_path), "--artifacts", "*.parquet", "--", "true"], check=True)
    success = json.loads((tmp_path / SUCCESS).read_text())
    assert set(success) == {"exit_code", "artifacts", "seconds", "command"}
    assert success["artifacts"] == [{"path": "a.parquet", "sha256": sha256_file(tmp_path / "a.parquet"), "bytes": 1}]
    subprocess.run([*WRAP, str(tmp_path), "--", "false"])
    failed = json.loads((tmp_path / FAILED).read_text())
    assert set(failed) == {"exit_code", "artifacts", "seconds", "command", "reason"}
    assert set(json.loads((tmp_path / "heartbeat.json").read_text())) == {"time", "pid", "command", "elapsed_s"}


def test_status_prints_the_poll_and_renews_the_lease_of_a_guarded_machine(tmp_path):
    workdir, run_dir = tmp_path / "work", tmp_path / "work" / "jobs" / "j"
    run_dir.mkdir(parents=True)
    (workdir / "watchdog.json").write_text("{}")
    out = subprocess.run([*WRAP, "status", str(run_dir), "--workdir", str(workdir)], capture_output=True, text=True,
                         check=True).stdout
    doc = json.loads(out)
    assert doc["marker"] is None and doc["alive"] is False and doc["gone"] is False and doc["watchdog"] is False
    assert (workdir / "lease").exists()
    bare = json.loads(subprocess.run([*WRAP, "status", str(run_dir)], capture_output=True, text=True).stdout)
    assert "watchdog" not in bare and "gone" not in bare
