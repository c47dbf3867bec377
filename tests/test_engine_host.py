"""Engine hosts: one engine process per machine slot serves every job; a host that dies is replaced once.

Real components: the HF engine (batch-invariant mode) in a detached `tasks.capture.engine_host` process,
reached over its Unix socket by the same client a machine's jobs use.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from jex.fileio import sha256_file
from jex.tasks.execution.engine_host import EngineHostDied, HostPolicy, HostRequest, prestart
from jex.tasks.execution.engine_host.client import submit
from jex.tasks.execution.engine_host.protocol import read_starts, slot_dir


@pytest.fixture
def engine_home(tmp_path):
    """A machine's engine folder; every host started under it is stopped at the end."""
    home = tmp_path / "engines"
    yield home
    for pid_file in home.glob("slot-*/host.pgid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory):
    from jex.sample_suite import write_sample_suite

    return write_sample_suite(tmp_path_factory.mktemp("host-suite") / "suite", rows=24, seed=6)


def _fast_pass_request(suite: Path, store: Path) -> HostRequest:
    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    bundle = bundle_stage(LocalStore(store), suite=suite)
    return HostRequest(job="fast_pass", engine_job=EngineJob(inputs=FastPassInputs(bundle=bundle, engine=EngineSpec(),
                                                                                   shard_rows=1), store=str(store)))


def _kill_host_after_its_first_shard(home: Path, store: Path) -> int:
    deadline = time.monotonic() + 300
    while not list(store.glob("fast_pass/*/shards-1/shard-*.parquet")):
        assert time.monotonic() < deadline, "the host wrote no shard"
        time.sleep(0.02)
    pid = int((slot_dir(home, 0) / "host.pgid").read_text())
    os.killpg(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_a_host_that_dies_mid_job_is_replaced_once_and_the_capture_is_unchanged(engine_home, suite_dir, tmp_path):
    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage
    from jex.tasks.store import LocalStore

    store = tmp_path / "store"
    request = _fast_pass_request(suite_dir, store)
    replies = []
    client = threading.Thread(target=lambda: replies.append(submit(engine_home, 0, request)))
    client.start()
    killed = _kill_host_after_its_first_shard(engine_home, store)
    client.join(timeout=600)
    (reply,) = replies
    assert reply.ok and reply.host_pid != killed
    assert [s.pid for s in read_starts(engine_home)] == [killed, reply.host_pid]
    assert 0 < len(reply.summary.computed_shards) < 24, "the new host reused the shards the dead one wrote"
    one = LocalStore(tmp_path / "one")
    alone = fast_pass_stage(one, bundle=bundle_stage(one, suite=suite_dir), engine=EngineSpec(), shard_rows=1)
    assert sha256_file(reply.summary.capture) == sha256_file(alone.capture)


@pytest.mark.slow
def test_a_host_that_dies_again_fails_the_job_with_its_slot_named(engine_home, suite_dir, tmp_path):
    store = tmp_path / "store"
    request = _fast_pass_request(suite_dir, store)
    errors = []

    def ask() -> None:
        try:
            submit(engine_home, 0, request, policy=HostPolicy(restarts=0))
        except EngineHostDied as e:
            errors.append(str(e))

    client = threading.Thread(target=ask)
    client.start()
    _kill_host_after_its_first_shard(engine_home, store)
    client.join(timeout=600)
    assert errors and "engine host slot 0 died during fast_pass" in errors[0]


@pytest.mark.slow
def test_a_host_that_stops_making_progress_is_stopped_and_replaced(engine_home, suite_dir, tmp_path):
    """Alive but wedged (here: SIGSTOP, as a hung kernel looks from outside): no finished shard for
    `stall_s`, so the waiting client kills it and asks a new host."""
    store = tmp_path / "store"
    request = _fast_pass_request(suite_dir, store)
    replies = []
    client = threading.Thread(target=lambda: replies.append(submit(engine_home, 0, request,
                                                                   policy=HostPolicy(stall_s=3))))
    client.start()
    while not list(store.glob("fast_pass/*/shards-1/shard-*.parquet")):
        time.sleep(0.02)
    wedged = int((slot_dir(engine_home, 0) / "host.pgid").read_text())
    started = _start_time(wedged)
    os.kill(wedged, signal.SIGSTOP)
    client.join(timeout=600)
    (reply,) = replies
    assert reply.ok and reply.host_pid != wedged
    assert _start_time(wedged) != started  # gone (or its pid reused by a later process): never left running


def _start_time(pid: int) -> str | None:
    """A process's start time (/proc/PID/stat field 22), None when no live process has this pid (a zombie
    counts as gone: killed, waiting to be reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.slow
def test_prestarted_hosts_have_their_engines_up_before_the_first_request(engine_home, suite_dir, tmp_path):
    from jex.engine_spec import EngineSpec

    prestart(engine_home, EngineSpec(), [0, 1])
    deadline = time.monotonic() + 300
    while len(read_starts(engine_home)) < 2:
        assert time.monotonic() < deadline, "the prestarted hosts loaded no engine"
        time.sleep(0.1)
    reply = submit(engine_home, 1, _fast_pass_request(suite_dir, tmp_path / "store"))
    assert reply.ok and reply.engine_starts == 1
    assert {s.slot for s in read_starts(engine_home)} == {0, 1}
    assert [s.pid for s in read_starts(engine_home) if s.slot == 1] == [reply.host_pid]


def test_a_retired_host_refuses_new_clients_at_once(tmp_path):
    """Retiring (after its last request, or a failed one) must not leave the socket accepting clients
    whose requests would then be dropped: they find no host and start a new one."""
    import queue
    from multiprocessing.connection import Listener

    from jex.tasks.execution.engine_host.client import _connect
    from jex.tasks.execution.engine_host.protocol import address, authkey
    from jex.tasks.execution.engine_host.server import EngineHost

    home = tmp_path / "engines"
    home.mkdir()
    host, key = EngineHost(home, 0), authkey(home)
    listener = Listener(address(home, 0), family="AF_UNIX", authkey=key)
    pending: queue.Queue = queue.Queue()
    acceptor = threading.Thread(target=host._accept, args=(listener, pending), daemon=True)
    acceptor.start()
    _connect(home, 0, key).close()
    host._retire(listener)
    acceptor.join(timeout=5)
    assert not acceptor.is_alive() and _connect(home, 0, key) is None


@pytest.mark.slow
def test_a_host_whose_engine_fails_at_launch_exits_and_the_job_reports_the_error(engine_home, suite_dir, tmp_path):
    from jex.engine_spec import EngineSpec

    broken = EngineSpec(model=str(tmp_path / "no-such-model"))
    prestart(engine_home, broken, [0])
    launched = int((slot_dir(engine_home, 0) / "host.pgid").read_text())
    request = _fast_pass_request(suite_dir, tmp_path / "store")
    job = request.engine_job
    request = request.model_copy(update={"engine_job": job.model_copy(update={
        "inputs": job.inputs.model_copy(update={"engine": broken, "engine_fp": job.inputs.fingerprint()})})})
    reply = submit(engine_home, 0, request)
    assert not reply.ok and "no-such-model" in reply.error and reply.host_pid != launched
    assert read_starts(engine_home) == []


def test_only_an_engine_that_profiles_the_gpu_s_memory_starts_alone():
    from jex.engine_spec import EngineSpec

    assert EngineSpec(kind="vllm").starts_alone()
    assert not EngineSpec(kind="vllm", kv_cache_memory_gib=8).starts_alone()
    assert not EngineSpec(kind="hf").starts_alone()


@pytest.mark.slow
def test_one_host_serves_successive_jobs_with_one_engine_start(engine_home, suite_dir, tmp_path):
    first = submit(engine_home, 0, _fast_pass_request(suite_dir, tmp_path / "a"))
    second = submit(engine_home, 0, _fast_pass_request(suite_dir, tmp_path / "b"))
    assert first.ok and second.ok and first.host_pid == second.host_pid
    assert len(read_starts(engine_home)) == 1 and second.engine_starts == 1
    assert sha256_file(first.summary.capture) == sha256_file(second.summary.capture)


@pytest.mark.slow
def test_the_first_machine_s_compile_cache_is_restored_on_the_next_machine_of_the_engine(tmp_path, monkeypatch,
                                                                                       suite_dir, prefect_harness):
    """The carry path of vLLM's compile cache, on CPU: the HF engine compiles nothing, so the test puts
    a file where vLLM writes its cache (`VLLM_CACHE_ROOT`) on the first machine before its engine starts."""
    import shutil
    import sys
    import tarfile

    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.flows.machines.golden import compile_cache_path
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    for k, v in {"JEX_INFRA__STATE_DIR": str(tmp_path / "infra"), "JEX_INFRA__POLL_S": "0.3",
                 "JEX_INFRA__WORKER_PYTHON": sys.executable}.items():
        monkeypatch.setenv(k, v)
    store = LocalStore(tmp_path / "store")
    job = EngineJob(inputs=FastPassInputs(bundle=bundle_stage(store, suite=suite_dir), engine=EngineSpec(),
                                          shard_rows=12), store=str(store.root))
    spec = MachinesSpec(provider="local", golden_rows=4)

    def compile_on_first_poll(session, job, polls) -> None:
        graph = (Path(session.machine.workdir) / "engines" / "slot-0" / "vllm-cache" / "torch_compile_cache" / "g"
                 / "graph.bin")
        if job.name == "golden" and polls == 1:
            graph.parent.mkdir(parents=True, exist_ok=True)
            graph.write_bytes(b"compiled")

    with GpuFleet(spec, campaign="first", store=str(store.root), settings=load_settings(), echo=lambda s: None,
                  on_poll=compile_on_first_poll) as first:
        first.run_stage(job)
    cached = compile_cache_path(store, job.inputs.engine, first.report().machines[0].provenance)
    with tarfile.open(cached) as tar:
        assert tar.getnames() == ["torch_compile_cache/g/graph.bin", ".jex-cache-root"]
    shutil.rmtree(store.root / "fast_pass")  # the next campaign must rent a machine again
    with GpuFleet(spec, campaign="second", store=str(store.root), settings=load_settings(),
                  echo=lambda s: None) as second:
        second.run_stage(job)
    (machine,) = second.report().machines
    assert [r.compile_cache for r in machine.engine_start_records] == ["restored"]
    golden = [j for j in machine.jobs if j.job == "golden"][0]
    assert "compile-cache.tar.gz" not in {a.path for a in golden.artifacts}, "asked only of the first machine"


def test_a_restored_compile_cache_names_its_artifacts_under_its_new_folder(tmp_path):
    """vLLM's artifact index holds absolute paths; on another machine (another folder) they must be
    that machine's, or the engine start fails looking for the first machine's files."""
    import ast

    from jex.engine.compile_cache import (
        COMPILE_CACHE,
        bring_compile_cache,
        pack_compile_cache,
        restore_compile_cache,
    )

    first, second = tmp_path / "m1" / "engines", tmp_path / "m2" / "engines"
    backbone = first / "slot-0" / "vllm-cache" / "torch_compile_cache" / "h" / "rank_0_0" / "backbone"
    backbone.mkdir(parents=True)
    (backbone / "artifact_0").write_bytes(b"compiled")
    (backbone / "vllm_compile_cache.py").write_text(repr({(1, 0): str(backbone.resolve() / "artifact_0")}))
    second.mkdir(parents=True)
    bring_compile_cache(second, pack_compile_cache(first, 0) or first / COMPILE_CACHE)

    assert restore_compile_cache(second, 0) == "restored"
    moved = second / "slot-0" / "vllm-cache" / "torch_compile_cache" / "h" / "rank_0_0" / "backbone"
    index = ast.literal_eval((moved / "vllm_compile_cache.py").read_text())
    assert index == {(1, 0): str(moved.resolve() / "artifact_0")}
    assert not (second / "slot-0" / "vllm-cache" / ".jex-cache-root").exists()


def test_a_machine_s_later_slots_start_from_the_cache_its_first_slot_compiled(tmp_path):
    from jex.engine.compile_cache import cache_dir, pack_compile_cache, restore_compile_cache

    home = tmp_path / "engines"
    graph = cache_dir(home, 0) / "torch_compile_cache" / "g" / "graph.bin"
    graph.parent.mkdir(parents=True)
    graph.write_bytes(b"compiled")
    assert restore_compile_cache(home, 0) == "warm" and pack_compile_cache(home, 0) is not None

    assert restore_compile_cache(home, 1) == "warm"
    assert (cache_dir(home, 1) / "torch_compile_cache" / "g" / "graph.bin").read_bytes() == b"compiled"
    assert restore_compile_cache(tmp_path / "other", 0) == "cold"


def test_engine_hosts_share_shards_by_claims_and_take_over_the_claim_of_a_dead_process(tmp_path):
    import subprocess
    import sys

    import polars as pl

    from jex.tasks.store import run_sharded

    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / ".shard-00001.claim").write_text(str(os.getppid()))  # a live engine process computes shard 1
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (folder / ".shard-00002.claim").write_text(str(gone.pid))  # this one died while computing shard 2
    stats = run_sharded(list(range(8)), shard_rows=2, folder=folder, claim=True,
                        compute=lambda chunk: pl.DataFrame({"x": list(chunk)}))
    assert stats.computed == [0, 2, 3]
    assert sorted(p.name for p in folder.glob("shard-*.parquet")) == ["shard-00000.parquet", "shard-00002.parquet",
                                                                        "shard-00003.parquet"]


def test_the_fleet_hands_its_jobs_one_host_options_record_the_stage_command_validates():
    """Every setting of the hosts travels as one `HostOptions` (`jex stage --host-options FILE`), not as
    flags or environment variables; a misspelt key or a device list of the wrong length is refused."""
    import pydantic

    from jex.engine_spec import EngineSpec
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.execution.engine_host import HostOptions

    spec = MachinesSpec(provider="local", gpus_per_machine=2, engines_per_gpu=2, engine_hosts=False, host_stall_s=90)
    options = spec.host_options("/work", EngineSpec(device="cuda"))
    assert HostOptions.model_validate_json(options.model_dump_json()) == options
    assert (options.home, options.slots, options.devices, options.max_requests, options.stall_s) == (
        "/work/engines", 4, ["0", "0", "1", "1"], 1, 90.0)
    assert options.first_slots(1).devices == ["0"]
    assert MachinesSpec(provider="local").host_options("/w", EngineSpec()).devices is None
    with pytest.raises(pydantic.ValidationError, match="one per slot"):
        HostOptions(home="h", slots=2, devices=["0"])
    with pytest.raises(pydantic.ValidationError):
        HostOptions.model_validate({"home": "h", "stall": 3})
