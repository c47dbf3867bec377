"""One engine process per engine slot of a machine, serving every engine job the machine runs.

A machine's jobs (golden replay, fast-pass shards, reason shards) are short client processes, each
under the worker protocol (heartbeat, marker, salvage) as before. Instead of loading an engine
themselves they hand their work to the slot's engine host, which loads each engine once and stays
up between jobs, so a machine pays one engine start per slot instead of one per job:

    python -m jex.tasks.capture.engine_host serve HOME SLOT      (started by the first client that finds none)

`HOME/slot-S/` holds the host's log and pid file (`host.pgid`: the machine's teardown and its
watchdog stop it with the jobs); `HOME/authkey` authenticates clients on the host's socket. Every
engine start is appended to `HOME/starts.jsonl`, which the orchestrator reads into `machines.json`.
Engine loads on one machine are serialised by a lock, because vLLM engines that start together on
one GPU each count the other's memory as their own; a host holds one engine at a time.

A host that dies during a request: the client starts a new host and asks once more (shards
already written are reused), then gives up and the job fails under its marker. A request that
fails inside a live host is reported to the client, and the host exits after replying, so the next
job starts from a fresh engine rather than one a CUDA error or a panic may have left unusable.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from jex.fileio import atomic_path
from jex.tasks.records import EngineStageArgs, FastPassSummary, PartialSummary, ReasonSummary

STARTS = "starts.jsonl"
COMPILE_CACHE = "compile-cache.tar.gz"
"""`HOME/compile-cache.tar.gz`: the machine's engine compile cache (vLLM's `VLLM_CACHE_ROOT`,
`HOME/vllm-cache`), packed after the machine's first engine start; `HOME/compile-cache.in.tar.gz`:
one brought from an earlier machine of the same engine, unpacked before the first start."""
COMPILE_CACHE_IN = "compile-cache.in.tar.gz"
PGID = "host.pgid"
"""Matches `jex.infra.worker_protocol.DETACHED_PGIDS`, through which a machine's teardown finds the hosts."""
IDLE_EXIT_S = 1800.0
"""A host with no request for this long exits (its machine is normally torn down long before)."""
START_TIMEOUT_S = 120.0
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


class EngineStart(BaseModel):
    """One line of `starts.jsonl`."""

    slot: int
    pid: int
    kind: str
    seconds: float
    time: float
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
def _flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
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

    def __init__(self, home: Path, slot: int, idle_exit_s: float = IDLE_EXIT_S, max_requests: int = 0):
        self.home, self.slot, self.idle_exit_s, self.max_requests = home, slot, idle_exit_s, max_requests
        self.pid_file = slot_dir(home, slot) / PGID
        self.starts = 0
        self.last_request = time.monotonic()
        self.busy = False

    def warm(self, request: HostRequest) -> None:
        """Load the request's engine if this host has not yet, one load at a time on this machine."""
        from jex.tasks.capture.engine_pool import get_engine, is_loaded, release_engines

        spec = request.args.engine
        if is_loaded(spec):
            return
        release_engines()  # one engine per host (e.g. a speculative profile, then its audited base): one GPU share
        with _flock(self.home / "engine-start.lock"):
            cache = restore_compile_cache(self.home)
            t0 = time.perf_counter()
            get_engine(spec)
            rec = EngineStart(slot=self.slot, pid=os.getpid(), kind=spec.kind, seconds=time.perf_counter() - t0,
                              time=time.time(), compile_cache=cache)
        if cache != "restored":  # this machine compiled (or found its own cache): offer it to the next ones
            pack_compile_cache(self.home)
        self.starts += 1
        with _flock(self.home / f"{STARTS}.lock"), open(self.home / STARTS, "a") as f:
            f.write(rec.model_dump_json() + "\n")
        print(f"engine host slot {self.slot}: {spec.kind} engine started in {rec.seconds:.1f} s", flush=True)

    def handle(self, request: HostRequest) -> HostReply:
        t0 = time.perf_counter()
        try:
            self.warm(request)
            summary = execute(request)
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

    def serve(self) -> None:
        """Answer requests until `max_requests` (0: no limit) or a failed one: a request that failed
        may have left the engine unusable (a CUDA error, a panic), so the next job gets a new host."""
        listener = Listener(_address(self.home, self.slot), family="AF_UNIX", authkey=_authkey(self.home))
        threading.Thread(target=self._idle_watch, daemon=True).start()
        print(f"engine host slot {self.slot}: serving (pid {os.getpid()})", flush=True)
        served, ok = 0, True
        while ok and (not self.max_requests or served < self.max_requests):
            try:
                conn = listener.accept()
            except (OSError, EOFError, AuthenticationError):  # a client that failed authentication or went away
                continue
            with conn:
                self.busy = True
                try:
                    reply = self._reply(conn)
                    served, ok = served + 1, reply.ok
                    if not ok or served == self.max_requests:
                        listener.close()  # the next client starts a new host instead of finding this one
                    conn.send_bytes(reply.model_dump_json().encode())
                except (OSError, EOFError):
                    pass  # the client died; the work it asked for is in the store or will be asked again
                finally:
                    self.busy, self.last_request = False, time.monotonic()
        self._forget_pid_file()


def execute(request: HostRequest) -> JobSummary:
    """The engine work of one request, in this process (the host's, or a client's with no host)."""
    from jex.tasks.capture.workers import stage_call

    if request.job == "golden":
        from jex.tasks.capture.golden import golden_job

        golden_job(request.args, request.golden_rows, Path(request.golden_out), Path(request.fingerprint_out))
        return GoldenDone(rows=request.golden_rows)
    return stage_call(request.job, request.args, worker=request.worker, workers=request.workers,
                      claim=request.claim)


# -- the compile cache ------------------------------------------------------------------------------
def restore_compile_cache(home: Path) -> str:
    """Before an engine start: unpack a brought compile cache into an empty cache folder. Returns
    how the start finds its cache (`EngineStart.compile_cache`). The cache only saves time: a
    brought archive that does not unpack is dropped and the start is cold."""
    cache, brought = home / "vllm-cache", home / COMPILE_CACHE_IN
    if cache.is_dir() and any(cache.iterdir()):
        return "warm"
    if not brought.exists():
        return "cold"
    fresh = Path(tempfile.mkdtemp(prefix=".vllm-cache.", dir=home))
    try:
        with tarfile.open(brought, "r:gz") as tar:
            tar.extractall(fresh, filter="data")
        _relocate_cache_index(fresh, cache)
        shutil.rmtree(cache, ignore_errors=True)
        fresh.rename(cache)
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as e:
        print(f"compile cache {brought} not used: {e}", flush=True)
        shutil.rmtree(fresh, ignore_errors=True)
        brought.unlink(missing_ok=True)
        return "cold"
    return "restored"


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


def pack_compile_cache(home: Path) -> Path | None:
    """After a machine's own engine start: pack its cache folder once (None when there is nothing,
    or when packing failed: the cache only saves time, so a failure is printed, never raised)."""
    cache, out = home / "vllm-cache", home / COMPILE_CACHE
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


def _start_host(home: Path, slot: int, key: bytes, device: str | None, max_requests: int) -> Connection:
    sd = slot_dir(home, slot)
    sd.mkdir(parents=True, exist_ok=True)
    _stop_group(sd / PGID)  # a previous host of this slot that no longer listens, and its children
    env = dict(os.environ)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    env[MAX_REQUESTS_ENV] = str(max_requests)
    env["VLLM_CACHE_ROOT"] = str(home / "vllm-cache")  # the machine's own: what a compile-cache artifact carries
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


def _ask(home: Path, slot: int, request: HostRequest, device: str | None, max_requests: int) -> HostReply:
    key = _authkey(home)
    with _flock(slot_dir(home, slot) / "start.lock"):  # one host per slot, however many clients arrive
        conn = _connect(home, slot, key) or _start_host(home, slot, key, device, max_requests)
    with conn:
        try:
            conn.send_bytes(request.model_dump_json().encode())
            return HostReply.model_validate_json(conn.recv_bytes())
        except (EOFError, OSError) as e:
            raise EngineHostDied(f"engine host slot {slot} died during {request.job}: {e}") from e


def submit(home: Path, slot: int, request: HostRequest, *, device: str | None = None, restarts: int = 1,
           max_requests: int = 0) -> HostReply:
    """Run `request` on the slot's host, starting one if none listens (serving `max_requests`
    requests, 0 = any number); a host that dies is replaced `restarts` times before the error
    propagates. The host's log lines for the request are echoed."""
    log = slot_dir(home, slot) / "host.log"
    attempt = 0
    while True:
        offset = log.stat().st_size if log.exists() else 0
        try:
            return _ask(home, slot, request, device, max_requests)
        except EngineHostDied as e:
            if attempt == restarts:
                raise
            attempt += 1
            print(f"{e}; starting a new engine host", flush=True)
        finally:
            _echo_log(log, offset)


def _echo_log(log: Path, offset: int) -> None:
    if log.exists():
        with open(log, "rb") as f:
            f.seek(offset)
            sys.stdout.write(f.read().decode(errors="replace"))
            sys.stdout.flush()


def submit_slots(home: Path, request: HostRequest, *, slots: int, devices: list[str] | None = None,
                 max_requests: int = 0) -> list[HostReply]:
    """Share a stage job (worker w of W) among `slots` hosts: each claims w's next shard when it is
    free, so a host that starts late (engine starts are serialised) or runs slow takes fewer."""
    subs = [request.model_copy(update={"claim": True})] * slots if slots > 1 else [request]

    def one(s: int) -> HostReply:
        return submit(home, s, subs[s], device=devices[s] if devices else None, max_requests=max_requests)

    with ThreadPoolExecutor(len(subs)) as pool:
        return list(pool.map(one, range(len(subs))))


def run_request(request: HostRequest, engine_host: Path | None, *, slots: int = 1,
                devices: list[str] | None = None, max_requests: int = 0) -> list[JobSummary]:
    """A job's engine work: in this process (`engine_host` None), else on the machine's hosts.
    Returns each slot's summary; raises when a host reports a failure."""
    if devices is not None and len(devices) != slots:
        raise ValueError(f"{len(devices)} devices for {slots} engine slot(s): give one per slot")
    if engine_host is None:
        if slots > 1:
            raise ValueError("several engine slots need engine hosts (--engine-host)")
        return [execute(request)]
    replies = submit_slots(engine_host.resolve(), request, slots=slots, devices=devices, max_requests=max_requests)
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
    EngineHost(home, int(argv[2]), float(os.environ.get("JEX_ENGINE_HOST_IDLE_S", IDLE_EXIT_S)),
               int(os.environ.get(MAX_REQUESTS_ENV, "0"))).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["EngineHost", "EngineHostDied", "EngineStart", "HostReply", "HostRequest", "absolute_args",
           "bring_compile_cache", "parse_starts", "read_starts", "run_request", "submit", "submit_slots",
           "take_compile_cache"]
