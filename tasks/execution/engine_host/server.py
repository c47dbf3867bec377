"""An engine host: one process per engine slot of a machine, loading each engine once and serving the
machine's jobs one request at a time (`python -m jex.tasks.execution.engine_host serve LAUNCH`).

It listens on its slot's socket before it loads an engine, accepts connections on a thread, and
rewrites `slot-S/progress.json` at each step so a waiting client can tell a slow host from a wedged
one. Every engine start is appended to `HOME/starts.jsonl`. Engines that profile the GPU's memory
start in turn under a machine-wide lock. A request that fails is reported to its client and the host
exits after replying, so the next job starts from a fresh engine.
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import sys
import threading
import time
from contextlib import nullcontext
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from jex.engine.compile_cache import pack_compile_cache, restore_compile_cache
from jex.engine_spec import EngineSpec
from jex.fileio import atomic_path
from jex.tasks.execution.engine_host.protocol import (
    IDLE_EXIT_S,
    PGID,
    PROGRESS,
    STARTS,
    EngineStart,
    GoldenDone,
    HostLaunch,
    HostProgress,
    HostReply,
    HostRequest,
    JobSummary,
    Phase,
    address,
    authkey,
    flock,
    slot_dir,
)

if TYPE_CHECKING:
    from jex.tasks.capture.invariance import StartedProbe
    from jex.tasks.capture.stages import Progress


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
        from jex.tasks.execution.engine_pool import get_engine, is_loaded, preload, release_engines

        if is_loaded(spec):
            return
        release_engines()  # one engine per host (e.g. a speculative profile, then its audited base): one GPU share
        self.progress("starting", f"importing {spec.kind}")
        t_import = time.perf_counter()
        preload(spec)
        imported = time.perf_counter() - t_import
        alone = spec.starts_alone()
        t_queue = time.perf_counter()
        waiting = functools.partial(self.progress, "queued", "waiting for the machine's start lock")
        with flock(self.home / "engine-start.lock", on_wait=waiting) if alone else nullcontext():
            queued = time.perf_counter() - t_queue
            self.progress("starting", f"{spec.kind} engine")
            cache = restore_compile_cache(self.home, self.slot)
            t0 = time.perf_counter()
            engine = get_engine(spec)
            rec = EngineStart(slot=self.slot, pid=os.getpid(), kind=spec.kind, seconds=time.perf_counter() - t0,
                              time=time.time(), compile_cache=cache, queued_s=queued, alone=alone,
                              import_s=imported, effective=engine.effective_settings())
            if cache != "restored":  # this machine compiled (or found its own cache): offer it to the next starts
                pack_compile_cache(self.home, self.slot)
        self.starts += 1
        with flock(self.home / f"{STARTS}.lock"), open(self.home / STARTS, "a") as f:
            f.write(rec.model_dump_json() + "\n")
        print(f"engine host slot {self.slot}: {spec.kind} engine started in {rec.seconds:.1f} s"
              + (f" after {queued:.1f} s waiting for its turn" if queued >= 0.1 else ""), flush=True)

    def handle(self, request: HostRequest) -> HostReply:
        t0 = time.perf_counter()
        probe = None
        try:
            probe = _start_probe(request)  # the audit's control starts with the engine, not after it
            self.warm(request.engine_job.inputs.engine)
            started = time.perf_counter() - t0
            self.progress("computing", request.job)
            summary = execute(request, lambda stage, done, total: self.progress("computing",
                                                                               f"{stage} shard {done}/{total}"),
                              engine_start_s=started, probe=probe)
            return HostReply(ok=True, summary=summary, host_pid=os.getpid(), engine_starts=self.starts,
                             seconds=time.perf_counter() - t0)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - also a Rust panic from a library; the client reports it
            import traceback

            traceback.print_exc()
            return HostReply(ok=False, error=f"{type(e).__name__}: {e}", host_pid=os.getpid(),
                             engine_starts=self.starts, seconds=time.perf_counter() - t0)
        finally:
            if probe is not None:  # the probe stops its control; this is for an engine that never started
                from jex.tasks.capture.invariance import stop_control

                stop_control(probe)

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
        listener = Listener(address(self.home, self.slot), family="AF_UNIX", authkey=authkey(self.home))
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


def _start_probe(request: HostRequest) -> StartedProbe | None:
    """A golden request's settings audit, laid out before its engine starts: its control arm starts now, beside
    the engine's start, unless that engine is already up (or memory says after: `start_probe`)."""
    if request.job != "golden" or request.probe is None:
        return None
    from jex.tasks.capture.invariance import start_probe
    from jex.tasks.execution.engine_pool import is_loaded

    engine = request.engine_job.inputs.engine
    return start_probe(request.probe, Path(request.probe_out), None if is_loaded(engine) else engine)


def execute(request: HostRequest, progress: Progress | None = None, engine_start_s: float = 0.0,
            probe: StartedProbe | None = None) -> JobSummary:
    """The engine work of one request, in this process (the host's, or a client's with no host);
    `engine_start_s`: what starting the engine for it took just before (recorded with the shards); `probe`:
    a golden request's audit as `_start_probe` began it before the engine started."""
    from jex.tasks.capture.stages import ShardShare
    from jex.tasks.execution.engine_job import run_engine_job

    if request.job == "golden":
        from jex.tasks.capture.golden import golden_job

        if request.probe is not None:  # the settings audit, on the engine the campaign then uses
            from jex.tasks.capture.invariance import probe_engine, stop_control
            from jex.tasks.execution.engine_pool import get_engine

            probe = probe or _start_probe(request)
            try:
                probe_engine(get_engine(request.engine_job.inputs.engine), request.probe, Path(request.probe_out),
                             progress, probe)
            finally:
                if probe is not None:
                    stop_control(probe)

        golden_job(request.engine_job, request.golden_rows, Path(request.golden_out), Path(request.fingerprint_out),
                   (request.generation_rows, request.generation_tokens, Path(request.generation_out))
                   if request.generation_rows else None)
        return GoldenDone(rows=request.golden_rows)
    share = ShardShare(worker=request.worker, workers=request.workers, claim=request.claim, progress=progress,
                       engine_start_s=engine_start_s)
    return run_engine_job(request.engine_job, share)


def main(argv: list[str]) -> int:
    """`serve LAUNCH`: serve one slot as the `HostLaunch` (JSON) says, until it retires or idles out."""
    if argv[:1] != ["serve"] or len(argv) != 2:
        print("usage: python -m jex.tasks.execution.engine_host serve LAUNCH_JSON", file=sys.stderr)
        return 2
    launch = HostLaunch.model_validate_json(argv[1])
    home = Path(launch.home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    EngineHost(home, launch.slot, launch.idle_exit_s, launch.max_requests, warm_at_launch=launch.warm).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["EngineHost", "execute", "main"]
