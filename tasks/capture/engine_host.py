"""One engine process per engine slot of a machine, serving every engine job the machine runs.

A machine's jobs (golden replay, fast-pass shards, reason shards) are short client processes, each
under the worker protocol (heartbeat, marker, salvage) as before. Instead of loading an engine
themselves they hand their work to the slot's engine host, which loads each engine once and stays
up between jobs, so a machine pays one engine start per slot instead of one per job:

    python -m jex.tasks.capture.engine_host serve HOME SLOT   (started by the golden job, or the first client
                                                             that finds none listening)

`HOME/slot-S/` holds the host's log, pid file (`host.pgid`: the machine's teardown and its watchdog
stop it with the jobs), progress record (`progress.json`) and vLLM compile cache (`vllm-cache/`);
`HOME/authkey` authenticates clients on the host's socket. Every engine start is appended to
`HOME/starts.jsonl`, which the orchestrator reads into `machines.json`. A host holds one engine at a
time. Engines start together, except those that size their memory by profiling the GPU (vLLM without
a fixed KV cache): vLLM engines that profile together on one GPU each count the other's memory as
their own, so those take turns under a machine-wide lock (their imports happen before it).

The golden job starts every slot's host (`prestart`), so a machine's engines are up when its first
stage job arrives. A host accepts connections on a thread and serves them one at a time.

A host that dies during a request: the client starts a new host and asks once more (shards
already written are reused), then gives up and the job fails under its marker. A host that stays
alive but makes no progress (no finished shard for `stall_s`, no finished start for
`START_STALL_S`: a hung kernel, a deadlock) is stopped by the waiting client and treated as dead.
A request that fails inside a live host is reported to the client, and the host exits after
replying, so the next job starts from a fresh engine rather than one a CUDA error or a panic may
have left unusable.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jex.fileio import atomic_path
from jex.tasks.capture.engine_pool import EngineSpec
from jex.tasks.records import EngineStageArgs, FastPassSummary, PartialSummary, ReasonSummary

if TYPE_CHECKING:
    from jex.tasks.capture.stages import Progress

STARTS = "starts.jsonl"
COMPILE_CACHE = "compile-cache.tar.gz"
"""`HOME/compile-cache.tar.gz`: the machine's engine compile cache (vLLM's `VLLM_CACHE_ROOT`,
`HOME/slot-S/vllm-cache`), packed after the machine's first engine start and unpacked for its later
slots; `HOME/compile-cache.in.tar.gz`: one brought from an earlier machine of the same engine,
unpacked before a slot's first start. Each slot has its own folder: engines that start together
never write one cache at the same time."""
COMPILE_CACHE_IN = "compile-cache.in.tar.gz"
PGID = "host.pgid"
"""Matches `jex.infra.worker_protocol.DETACHED_PGIDS`, through which a machine's teardown finds the hosts."""
IDLE_EXIT_S = 1800.0
"""A host with no request for this long exits (its machine is normally torn down long before)."""
START_TIMEOUT_S = 120.0
"""A new host must listen within this (it listens before it loads an engine)."""
STALL_S = 600.0
"""Default `stall_s`: a request with no finished shard for this long means a wedged host."""
START_STALL_S = 1800.0
"""An engine start that has not finished after this long means a wedged host."""
POLL_S = 2.0
PROGRESS = "progress.json"
WARM_ENV = "JEX_ENGINE_HOST_WARM"
"""An `EngineSpec` as JSON: the host loads this engine as soon as it listens (`prestart`)."""
MAX_REQUESTS_ENV = "JEX_ENGINE_HOST_MAX_REQUESTS"
"""Set to 1 by a client: its host serves one request and exits (each job loads its own engine, the
behaviour before engine hosts, kept for comparison and for engines that must not outlive a job)."""


class HostRequest(BaseModel):
    """One piece of engine work for a host. Paths in `args` are absolute."""

    model_config = ConfigDict(frozen=True)
    job: Literal["golden", "fast_pass", "reason"]
    args: EngineStageArgs
    worker: int = 0
    workers: int = 1
    claim: bool = Field(False, description="Share this worker's shards with the machine's other engine hosts, "
                                           "first come first served")
    golden_rows: int = 0
    golden_out: str = ""
    fingerprint_out: str = ""


class GoldenDone(BaseModel):
    stage: Literal["golden"] = "golden"
    rows: int


JobSummary = FastPassSummary | ReasonSummary | PartialSummary | GoldenDone
"""What a host returns for one request: the stage's summary, this worker's share of it, or the replay."""


class HostReply(BaseModel):
    ok: bool
    summary: JobSummary | None = None
    error: str = ""
    host_pid: int
    engine_starts: int = Field(description="Engines this host has loaded so far")
    seconds: float


Phase = Literal["starting", "queued", "computing", "idle"]
"""`queued`: waiting for the machine's start lock (no stall limit: the start it waits on is watched)."""


class HostProgress(BaseModel):
    """`slot-S/progress.json`, rewritten at each step a host makes: a waiting client reads it to tell a
    slow host from a wedged one."""

    pid: int
    phase: Phase
    time: float
    detail: str = ""


class EngineStart(BaseModel):
    """One line of `starts.jsonl`."""

    slot: int
    pid: int
    kind: str
    seconds: float
    time: float
    queued_s: float = Field(0.0, description="Waited for the machine's start lock (engines that start alone)")
    alone: bool = Field(True, description="Started under the start lock; False: alongside other engines")
    compile_cache: str = Field("cold", description="cold | warm (this machine compiled before) | restored "
                                                   "(from an earlier machine's compile-cache artifact)")


class EngineHostDied(RuntimeError):
    """The slot's host exited (or never listened) while a client needed it."""


def slot_dir(home: Path, slot: int) -> Path:
    return home / f"slot-{slot}"


def parse_starts(text: str) -> list[EngineStart]:
    """The records of a `starts.jsonl`; a line that does not parse (torn by a crash) is skipped."""
    starts = []
    for line in text.splitlines():
        try:
            starts.append(EngineStart.model_validate_json(line))
        except ValidationError:
            continue
    return starts


def read_starts(home: Path) -> list[EngineStart]:
    path = home / STARTS
    return parse_starts(path.read_text()) if path.exists() else []


@contextmanager
def _flock(path: Path, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on `path`; while another process holds it, `on_wait()` every `POLL_S`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        if on_wait is None:
            fcntl.flock(f, fcntl.LOCK_EX)
        else:
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    on_wait()
                    time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _authkey(home: Path) -> bytes:
    """The machine's key for the hosts' sockets (mode 0600). Never empty: with an empty key
    `multiprocessing` would skip authentication altogether."""
    path = home / "authkey"
    with _flock(home / "authkey.lock"):
        key = path.read_text().strip() if path.exists() else ""
        if len(key) != 64:
            with atomic_path(path) as tmp:  # mkstemp: created 0600
                tmp.write_text(secrets.token_hex(32))
            key = path.read_text().strip()
    return key.encode()


def _stop_group(pid_file: Path) -> None:
    """Kill the process group a pid file names (a previous host of the slot, and any children)."""
    try:
        os.killpg(int(pid_file.read_text().strip()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


# -- the host ----------------------------------------------------------------------------------------
class EngineHost:
    """Serves requests one at a time (an engine is not shared between threads)."""

    def __init__(self, home: Path, slot: int, idle_exit_s: float = IDLE_EXIT_S, max_requests: int = 0,
                 warm_at_launch: EngineSpec | None = None):
        self.home, self.slot, self.idle_exit_s, self.max_requests = home, slot, idle_exit_s, max_requests
        self.warm_at_launch = warm_at_launch
        self.pid_file = slot_dir(home, slot) / PGID
        self.starts = 0
        self.retired = False
        self.last_request = time.monotonic()
        self.busy = False

    def progress(self, phase: Phase, detail: str = "") -> None:
        record = HostProgress(pid=os.getpid(), phase=phase, time=time.time(), detail=detail)
        with atomic_path(slot_dir(self.home, self.slot) / PROGRESS) as tmp:
            tmp.write_text(record.model_dump_json())

    def warm(self, spec: EngineSpec) -> None:
        """Load `spec`'s engine if this host has not yet; an engine that profiles the GPU's memory
        waits for its turn on the machine (`EngineSpec.starts_alone`)."""
        from jex.tasks.capture.engine_pool import get_engine, is_loaded, preload, release_engines

        if is_loaded(spec):
            return
        release_engines()  # one engine per host (e.g. a speculative profile, then its audited base): one GPU share
        self.progress("starting", f"importing {spec.kind}")
        preload(spec)
        alone = spec.starts_alone()
        t_queue = time.perf_counter()
        waiting = functools.partial(self.progress, "queued", "waiting for the machine's start lock")
        with _flock(self.home / "engine-start.lock", on_wait=waiting) if alone else nullcontext():
            queued = time.perf_counter() - t_queue
            self.progress("starting", f"{spec.kind} engine")
            cache = restore_compile_cache(self.home, self.slot)
            t0 = time.perf_counter()
            get_engine(spec)
            rec = EngineStart(slot=self.slot, pid=os.getpid(), kind=spec.kind, seconds=time.perf_counter() - t0,
                              time=time.time(), compile_cache=cache, queued_s=queued, alone=alone)
            if cache != "restored":  # this machine compiled (or found its own cache): offer it to the next starts
                pack_compile_cache(self.home, self.slot)
        self.starts += 1
        with _flock(self.home / f"{STARTS}.lock"), open(self.home / STARTS, "a") as f:
            f.write(rec.model_dump_json() + "\n")
        print(f"engine host slot {self.slot}: {spec.kind} engine started in {rec.seconds:.1f} s"
              + (f" after {queued:.1f} s waiting for its turn" if queued >= 0.1 else ""), flush=True)

    def handle(self, request: HostRequest) -> HostReply:
        t0 = time.perf_counter()
        try:
            self.warm(request.args.engine)
            self.progress("computing", request.job)
            summary = execute(request, lambda stage, done, total: self.progress("computing",
                                                                               f"{stage} shard {done}/{total}"))
            return HostReply(ok=True, summary=summary, host_pid=os.getpid(), engine_starts=self.starts,
                             seconds=time.perf_counter() - t0)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - also a Rust panic from a library; the client reports it
            import traceback

            traceback.print_exc()
            return HostReply(ok=False, error=f"{type(e).__name__}: {e}", host_pid=os.getpid(),
                             engine_starts=self.starts, seconds=time.perf_counter() - t0)

    def _forget_pid_file(self) -> None:
        """On exit: no pid file may name this (soon reusable) pid for teardown to kill later."""
        if self.pid_file.exists() and self.pid_file.read_text().strip() == str(os.getpid()):
            self.pid_file.unlink(missing_ok=True)

    def _idle_watch(self) -> None:
        while True:
            time.sleep(min(5.0, self.idle_exit_s / 4))
            idle = time.monotonic() - self.last_request
            if not self.home.exists() or (not self.busy and idle > self.idle_exit_s):
                self._forget_pid_file()
                os._exit(0)

    def _reply(self, conn: Connection) -> HostReply:
        try:
            request = HostRequest.model_validate_json(conn.recv_bytes())
        except ValidationError as e:
            return HostReply(ok=False, error=f"not a HostRequest: {e}", host_pid=os.getpid(),
                             engine_starts=self.starts, seconds=0.0)
        return self.handle(request)

    def _accept(self, listener: Listener, pending: queue.Queue[Connection]) -> None:
        """Accept (and authenticate) clients as they come, so none waits on a busy host to connect."""
        while not self.retired:
            try:
                pending.put(listener.accept())
            except (OSError, EOFError, AuthenticationError):  # a client that went away mid-handshake, or retired
                continue

    def _retire(self, listener: Listener) -> None:
        """Stop listening now, so the next client starts a new host. `close()` alone would leave the
        socket bound while the accept thread waits in `accept()`; `shutdown` wakes it."""
        self.retired = True
        sock = getattr(getattr(listener, "_listener", None), "_socket", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        listener.close()

    def _start_at_launch(self, spec: EngineSpec, listener: Listener) -> bool:
        """Load the engine before the first request; False (and this host retired) when it fails: the
        next client starts a fresh host, which loads it again and reports the error if it fails again."""
        self.busy = True
        try:
            self.warm(spec)
            self.progress("idle", "engine up")
            return True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - also a Rust panic from a library
            import traceback

            traceback.print_exc()
            self._retire(listener)
            return False
        finally:
            self.busy, self.last_request = False, time.monotonic()

    def serve(self) -> None:
        """Answer requests until `max_requests` (0: no limit) or a failed one: a request that failed
        may have left the engine unusable (a CUDA error, a panic), so the next job gets a new host."""
        listener = Listener(_address(self.home, self.slot), family="AF_UNIX", authkey=_authkey(self.home))
        pending: queue.Queue[Connection] = queue.Queue()
        threading.Thread(target=self._accept, args=(listener, pending), daemon=True).start()
        threading.Thread(target=self._idle_watch, daemon=True).start()
        print(f"engine host slot {self.slot}: serving (pid {os.getpid()})", flush=True)
        ok = self.warm_at_launch is None or self._start_at_launch(self.warm_at_launch, listener)
        served = 0
        while ok and (not self.max_requests or served < self.max_requests):
            conn = pending.get()
            with conn:
                self.busy = True
                try:
                    reply = self._reply(conn)
                    served, ok = served + 1, reply.ok
                    if not ok or served == self.max_requests:
                        self._retire(listener)
                    conn.send_bytes(reply.model_dump_json().encode())
                except (OSError, EOFError):
                    pass  # the client died; the work it asked for is in the store or will be asked again
                finally:
                    self.busy, self.last_request = False, time.monotonic()
                    self.progress("idle")
        while not pending.empty():  # accepted before the retirement: their clients see the host gone and retry
            pending.get().close()
        self._forget_pid_file()


def execute(request: HostRequest, progress: Progress | None = None) -> JobSummary:
    """The engine work of one request, in this process (the host's, or a client's with no host)."""
    from jex.tasks.capture.workers import stage_call

    if request.job == "golden":
        from jex.tasks.capture.golden import golden_job

        golden_job(request.args, request.golden_rows, Path(request.golden_out), Path(request.fingerprint_out))
        return GoldenDone(rows=request.golden_rows)
    return stage_call(request.job, request.args, worker=request.worker, workers=request.workers,
                      claim=request.claim, progress=progress)


# -- the compile cache ------------------------------------------------------------------------------
def cache_dir(home: Path, slot: int) -> Path:
    """The slot's vLLM cache folder (`VLLM_CACHE_ROOT` of its host)."""
    return slot_dir(home, slot) / "vllm-cache"


def restore_compile_cache(home: Path, slot: int) -> str:
    """Before a slot's engine start: fill its empty cache folder from the machine's packed cache (an
    earlier slot compiled: `warm`) or from one brought from an earlier machine (`restored`). Returns
    how the start finds its cache (`EngineStart.compile_cache`). The cache only saves time: an
    archive that does not unpack is dropped and the start goes on without it."""
    cache = cache_dir(home, slot)
    if cache.is_dir() and any(cache.iterdir()):
        return "warm"
    for archive, how in ((home / COMPILE_CACHE, "warm"), (home / COMPILE_CACHE_IN, "restored")):
        if archive.exists() and _unpack_cache(archive, cache):
            return how
    return "cold"


def _unpack_cache(archive: Path, cache: Path) -> bool:
    cache.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".vllm-cache.", dir=cache.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(fresh, filter="data")
        _relocate_cache_index(fresh, cache)
        shutil.rmtree(cache, ignore_errors=True)
        fresh.rename(cache)
        return True
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as e:
        print(f"compile cache {archive} not used: {e}", flush=True)
        shutil.rmtree(fresh, ignore_errors=True)
        archive.unlink(missing_ok=True)
        return False


CACHE_ROOT_FILE = ".jex-cache-root"
"""Inside a packed compile cache: the absolute folder it was packed from. vLLM's index of compiled
artifacts (`vllm_compile_cache.py`) names each artifact by absolute path, so a cache restored under
another folder has those paths rewritten to its new folder (without that, the start fails with
FileNotFoundError on the first machine's path, as found on the H200)."""
_CACHE_INDEX = "vllm_compile_cache.py"


def _relocate_cache_index(unpacked: Path, cache: Path) -> None:
    """Point the absolute paths in an unpacked cache's artifact indexes at `cache`, its final folder."""
    marker = unpacked / CACHE_ROOT_FILE
    if not marker.exists():
        return
    old, new = marker.read_text().strip().rstrip("/") + "/", str(cache.resolve()) + "/"
    marker.unlink()
    for index in unpacked.rglob(_CACHE_INDEX):
        text = index.read_text()
        if old in text:
            index.write_text(text.replace(old, new))


def pack_compile_cache(home: Path, slot: int) -> Path | None:
    """After a machine's own engine start: pack the slot's cache folder, once per machine (None when
    there is nothing, or when packing failed: the cache only saves time, so a failure is printed,
    never raised)."""
    cache, out = cache_dir(home, slot), home / COMPILE_CACHE
    files = sorted(p for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else []
    if out.exists() or not files:
        return out if out.exists() else None
    try:
        with atomic_path(out) as tmp, tarfile.open(tmp, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=p.relative_to(cache).as_posix())
            root = str(cache.resolve()).encode()
            info = tarfile.TarInfo(CACHE_ROOT_FILE)
            info.size = len(root)
            tar.addfile(info, io.BytesIO(root))
    except (tarfile.TarError, OSError) as e:
        print(f"compile cache not packed: {e}", flush=True)
        return None
    return out


def bring_compile_cache(home: Path, path: Path) -> None:
    """Place a compile cache from an earlier machine where this machine's first engine start finds it."""
    target = home / COMPILE_CACHE_IN
    if path.exists() and not target.exists():
        with atomic_path(target) as tmp:
            shutil.copyfile(path, tmp)


def take_compile_cache(home: Path, dest: Path) -> bool:
    """Copy this machine's packed compile cache to `dest` (a job artifact); False when there is none."""
    packed = home / COMPILE_CACHE
    if not packed.exists():
        return False
    with atomic_path(dest) as tmp:
        shutil.copyfile(packed, tmp)
    return True


# -- the client --------------------------------------------------------------------------------------
def _address(home: Path, slot: int) -> str:
    """An abstract socket name (Linux): no file to go stale and no 108-byte path limit."""
    return f"\0jex-engine-{hashlib.sha256(str(home).encode()).hexdigest()[:16]}-{slot}"


def _connect(home: Path, slot: int, key: bytes) -> Connection | None:
    """A connection to the slot's host, or None when no live host listens (never started, or died)."""
    try:
        return Client(_address(home, slot), family="AF_UNIX", authkey=key)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError, EOFError):
        return None


@dataclass(frozen=True)
class HostPolicy:
    """How a job uses its machine's engine hosts."""

    max_requests: int = 0
    """Requests a host this job starts serves before it exits (0: any; 1: each job loads its own engine)."""
    stall_s: float = STALL_S
    """A host that finishes no shard for this long is stopped and counted as dead."""
    restarts: int = 1
    """Hosts that die (or stall) during a request are replaced this many times before the job fails."""


def _start_host(home: Path, slot: int, key: bytes, device: str | None, max_requests: int,
                warm: EngineSpec | None = None) -> Connection:
    sd = slot_dir(home, slot)
    sd.mkdir(parents=True, exist_ok=True)
    _stop_group(sd / PGID)  # a previous host of this slot that no longer listens, and its children
    (sd / PROGRESS).unlink(missing_ok=True)
    env = dict(os.environ)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    env[MAX_REQUESTS_ENV] = str(max_requests)
    env["VLLM_CACHE_ROOT"] = str(cache_dir(home, slot))
    if warm is not None:
        env[WARM_ENV] = warm.model_dump_json()
    with open(sd / "host.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jex.tasks.capture.engine_host", "serve", str(home), str(slot)],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=home, start_new_session=True)
    (sd / PGID).write_text(str(proc.pid))  # its own session: it outlives the job that started it
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if (conn := _connect(home, slot, key)) is not None:
            return conn
        if proc.poll() is not None:
            raise EngineHostDied(f"engine host slot {slot} exited {proc.returncode} at start; see {sd / 'host.log'}")
        time.sleep(0.1)
    _stop_group(sd / PGID)
    raise EngineHostDied(f"engine host slot {slot} did not listen within {START_TIMEOUT_S:.0f} s")


def read_progress(home: Path, slot: int) -> HostProgress | None:
    try:
        return HostProgress.model_validate_json((slot_dir(home, slot) / PROGRESS).read_text())
    except (OSError, ValidationError):
        return None


def _await_reply(conn: Connection, home: Path, slot: int, stall_s: float) -> HostReply:
    """The host's reply; a host whose last step is older than its phase allows (and than the
    request) is stopped, and `EngineHostDied` raised."""
    asked = time.time()
    while not conn.poll(POLL_S):
        progress = read_progress(home, slot)
        if progress is None:
            continue
        if progress.phase == "queued":  # alive, waiting for another engine's start (watched by its own client)
            continue
        budget = START_STALL_S if progress.phase == "starting" else stall_s
        quiet = time.time() - max(progress.time, asked)
        if quiet > budget:
            _stop_group(slot_dir(home, slot) / PGID)
            raise EngineHostDied(f"engine host slot {slot} made no progress for {quiet:.0f} s "
                                 f"({progress.phase}: {progress.detail or '-'}); stopped it")
    return HostReply.model_validate_json(conn.recv_bytes())


def _host(home: Path, slot: int, device: str | None, max_requests: int, warm: EngineSpec | None = None
          ) -> Connection:
    """A connection to the slot's host, starting one when none listens (one host per slot, however
    many clients arrive)."""
    key = _authkey(home)
    with _flock(slot_dir(home, slot) / "start.lock"):
        return _connect(home, slot, key) or _start_host(home, slot, key, device, max_requests, warm=warm)


def _ask(home: Path, slot: int, request: HostRequest, device: str | None, policy: HostPolicy) -> HostReply:
    conn = _host(home, slot, device, policy.max_requests)
    with conn:
        try:
            conn.send_bytes(request.model_dump_json().encode())
            return _await_reply(conn, home, slot, policy.stall_s)
        except (EOFError, OSError) as e:
            raise EngineHostDied(f"engine host slot {slot} died during {request.job}: {e}") from e


def submit(home: Path, slot: int, request: HostRequest, *, device: str | None = None,
           policy: HostPolicy = HostPolicy()) -> HostReply:
    """Run `request` on the slot's host, starting one if none listens; a host that dies or stalls
    is replaced `policy.restarts` times before the error propagates. The host's log lines for the
    request are echoed."""
    log = slot_dir(home, slot) / "host.log"
    attempt = 0
    while True:
        offset = log.stat().st_size if log.exists() else 0
        try:
            return _ask(home, slot, request, device, policy)
        except EngineHostDied as e:
            if attempt == policy.restarts:
                raise
            attempt += 1
            print(f"{e}; starting a new engine host", flush=True)
        finally:
            _echo_log(log, offset)


def prestart(home: Path, engine: EngineSpec, slots: Sequence[int], devices: list[str] | None = None) -> None:
    """Start the hosts of `slots` (those not yet listening), each loading `engine` at once rather
    than at its first request; returns as soon as they listen."""
    for s in slots:
        _host(home, s, devices[s] if devices else None, 0, warm=engine).close()


def _echo_log(log: Path, offset: int) -> None:
    if log.exists():
        with open(log, "rb") as f:
            f.seek(offset)
            sys.stdout.write(f.read().decode(errors="replace"))
            sys.stdout.flush()


def submit_slots(home: Path, request: HostRequest, *, slots: int, devices: list[str] | None = None,
                 policy: HostPolicy = HostPolicy()) -> list[HostReply]:
    """Share a stage job (worker w of W) among `slots` hosts: each claims w's next shard when it is
    free, so a host that starts late or runs slow takes fewer."""
    subs = [request.model_copy(update={"claim": True})] * slots if slots > 1 else [request]

    def one(s: int) -> HostReply:
        return submit(home, s, subs[s], device=devices[s] if devices else None, policy=policy)

    with ThreadPoolExecutor(len(subs)) as pool:
        return list(pool.map(one, range(len(subs))))


def run_request(request: HostRequest, engine_host: Path | None, *, slots: int = 1,
                devices: list[str] | None = None, policy: HostPolicy = HostPolicy()) -> list[JobSummary]:
    """A job's engine work: in this process (`engine_host` None), else on the machine's hosts.
    Returns each slot's summary; raises when a host reports a failure."""
    if devices is not None and len(devices) != slots:
        raise ValueError(f"{len(devices)} devices for {slots} engine slot(s): give one per slot")
    if engine_host is None:
        if slots > 1:
            raise ValueError("several engine slots need engine hosts (--engine-host)")
        return [execute(request)]
    replies = submit_slots(engine_host.resolve(), request, slots=slots, devices=devices, policy=policy)
    failed = [f"slot {s}: {r.error}" for s, r in enumerate(replies) if not r.ok]
    if failed:
        raise RuntimeError(f"{request.job} failed on the engine host: " + "; ".join(failed))
    return [r.summary for r in replies if r.summary is not None]


def absolute_args(args: EngineStageArgs | dict[str, Any], base: Path) -> EngineStageArgs:
    """A job's args (or their JSON) with the relative paths (store, bundle, gated rows) made absolute
    against `base`."""
    args = EngineStageArgs.model_validate(args)

    def under(p: str) -> str:
        return str(p if Path(p).is_absolute() else (base / p).resolve())

    gate = args.gate.model_copy(update={"gated": under(args.gate.gated)}) if args.gate else None
    return args.model_copy(update={"store": under(args.store), "gate": gate,
                                   "bundle": args.bundle.model_copy(update={"bundle": under(args.bundle.bundle)})})


def main(argv: list[str]) -> int:
    if argv[:1] != ["serve"] or len(argv) != 3:
        print("usage: python -m jex.tasks.capture.engine_host serve HOME SLOT", file=sys.stderr)
        return 2
    home = Path(argv[1]).resolve()
    home.mkdir(parents=True, exist_ok=True)
    warm = os.environ.get(WARM_ENV)
    EngineHost(home, int(argv[2]), float(os.environ.get("JEX_ENGINE_HOST_IDLE_S", IDLE_EXIT_S)),
               int(os.environ.get(MAX_REQUESTS_ENV, "0")),
               warm_at_launch=EngineSpec.model_validate_json(warm) if warm else None).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["EngineHost", "EngineHostDied", "EngineStart", "HostPolicy", "HostProgress", "HostReply", "HostRequest",
           "absolute_args", "bring_compile_cache", "parse_starts", "prestart", "read_progress", "read_starts",
           "run_request", "submit", "submit_slots", "take_compile_cache"]
