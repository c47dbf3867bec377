"""Nothing left running after a crash: every server jex starts on this host is recorded with its owner in the
state folder, and whatever a killed owner left running is stopped by reconcile, a reused PID never."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from jex.infra.processes import PROCESSES, OwnedProcess, orphans_line, record_process, stop_orphans
from jex.record import write_record

OWNER = """
from jex.flows.local_api import ensure_local_api
from prefect.client.orchestration import get_client

assert ensure_local_api()  # as every command that runs a flow does first (jex/cli/common.py: connect_prefect)
get_client(sync_client=True)  # what a flow's first API call does with no server configured: start the temporary one
"""


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def gone_owner() -> tuple[int, float]:
    """The PID and start time of a process that has ended."""
    p = subprocess.Popen(["true"])
    started = psutil.Process(p.pid).create_time()
    p.wait()
    return p.pid, started


def record_orphan(state: Path, proc: subprocess.Popen, *, started_at: float | None = None) -> None:
    """A record of `proc` as a killed owner leaves it."""
    owner, owner_started = gone_owner()
    write_record(state / PROCESSES / f"{proc.pid}.json", OwnedProcess(
        kind="worker", pid=proc.pid, started_at=started_at or psutil.Process(proc.pid).create_time(), port=None,
        command=["sleep", "60"], owner_pid=owner, owner_started_at=owner_started))


def test_the_temporary_prefect_server_of_a_killed_orchestrator_is_stopped_by_reconcile(tmp_path):
    """The owner is killed while its server starts (recorded as it is spawned, not once it answers)."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "JEX_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), JEX_INFRA__STATE_DIR=str(state))
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list((state / PROCESSES).glob("*.json")) and owner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    (path,) = (state / PROCESSES).glob("*.json")
    server = OwnedProcess.model_validate_json(path.read_bytes())
    assert server.kind == "prefect-server" and server.owner_pid == owner.pid and server.port
    assert "prefect.server.api.server:create_app" in server.command
    assert running(server.pid), "the server outlives its owner: the orphan this guards against"
    stopped = stop_orphans(state)
    assert [p.pid for p in stopped] == [server.pid] and not running(server.pid)
    assert not list((state / PROCESSES).glob("*.json"))
    assert orphans_line(stopped) == (f"processes: stopped 1 left running by a jex process that is gone: prefect-server "
                                     f"pid {server.pid} port {server.port} (owner pid {owner.pid})")


def test_a_process_whose_owner_runs_is_left_alone(tmp_path):
    proc = sleeper()
    try:
        record_process(tmp_path, kind="worker", pid=proc.pid, port=None, command=["sleep", "60"])  # owner: this test
        assert stop_orphans(tmp_path) == [] and running(proc.pid)
        assert (tmp_path / PROCESSES / f"{proc.pid}.json").exists()
    finally:
        proc.kill()
        proc.wait()


def test_a_pid_reused_by_another_process_is_never_killed(tmp_path):
    proc = sleeper()
    try:
        record_orphan(tmp_path, proc, started_at=psutil.Process(proc.pid).create_time() - 100)  # another start
        assert stop_orphans(tmp_path) == [] and running(proc.pid)
        assert not list((tmp_path / PROCESSES).glob("*.json"))  # the stale record is forgotten
    finally:
        proc.kill()
        proc.wait()


def test_the_next_run_stops_what_a_killed_one_left_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from jex.flows.local_api import ensure_local_api

    proc = sleeper()
    record_orphan(tmp_path, proc)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # a configured server: no temporary one
    assert ensure_local_api(tmp_path) is False
    proc.wait(timeout=10)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"processes: stopped 1 left running by a jex process that is gone: "
                                                   f"worker pid {proc.pid}")


AHEAD = """
import json
from prefect.client.orchestration import get_client
from jex.flows.local_api import ensure_local_api, start_temporary_api
from jex.infra.processes import PROCESSES
from jex.settings import load_settings
from pathlib import Path

assert ensure_local_api(ahead=True)
api = start_temporary_api()  # as `jex run` does before it imports its flows
api.ready()
state = Path(load_settings().infra.state_dir) / PROCESSES
with get_client(sync_client=True) as client:
    answers, used = client.api_healthcheck() is None, str(client.api_url)
recorded = [json.loads(p.read_text())["pid"] for p in state.glob("*.json")]
pid = api.server.server_process.pid
api.stop()
print(json.dumps({"client": used, "server": api.server.api_url, "answers": answers,
                  "recorded": recorded, "pid": pid, "left": [p.name for p in state.glob("*.json")]}))
"""


def test_a_temporary_server_started_ahead_of_the_flows_is_the_one_they_use_and_is_recorded_until_stopped(tmp_path):
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "JEX_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), JEX_INFRA__STATE_DIR=str(state))
    out = subprocess.run([sys.executable, "-c", AHEAD], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["answers"] and seen["client"].rstrip("/") == seen["server"].rstrip("/")
    assert seen["recorded"] == [seen["pid"]] and seen["left"] == [] and not running(seen["pid"])


NOT_NEEDED = """
import json, time
from jex.flows.local_api import ensure_local_api, start_temporary_api
from jex.infra.processes import PROCESSES
from jex.settings import load_settings
from pathlib import Path

assert ensure_local_api(ahead=True)
api = start_temporary_api()
t0 = time.monotonic()
api.stop()  # a campaign stored in full: no flow will ask for it
state = Path(load_settings().infra.state_dir) / PROCESSES
print(json.dumps({"stop_s": time.monotonic() - t0, "stopped": api.process.poll() is not None,
                  "left": [p.name for p in state.glob("*.json")]}))
"""


def test_a_temporary_server_no_flow_needs_is_stopped_without_waiting_for_it_to_answer(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "JEX_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), JEX_INFRA__STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-c", NOT_NEEDED], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["stopped"] and seen["left"] == []
    assert seen["stop_s"] < 5, "a server starts in ~5-10 s here: stopping it must not wait for that"
