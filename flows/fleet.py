"""Engine stages on machines the orchestrator owns: golden replay, detached shards, collection, teardown.

`GpuFleet` starts its machines lazily, the first time a stage has shards to compute, so a cached
campaign never rents one; leaving the `with` block tears every machine down, whatever happened.
Each machine first replays the golden rows against the stored reference (and stops there on a
mismatch), then computes worker i of N of each stage; the shards come back verified and are merged
here by the same stage function that runs in-process, so the capture is the same bytes.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, cast

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jex.engine_spec import EngineSpec
from jex.errors import FlowError, InfraError, JexError
from jex.fileio import write_json
from jex.flows.machines_doc import FingerprintMismatch, FleetMachine, GoldenReplay, MachinesDoc
from jex.infra.ledger import Ledger
from jex.infra.machine import JobFailed, MachineSession, RemoteJob, stack_lock
from jex.infra.providers import Machine
from jex.infra.reaper import make_provider, policy_from_settings
from jex.infra.records import MachineProvenance
from jex.tasks.capture.engine_host import COMPILE_CACHE, STARTS, HostOptions, parse_starts
from jex.tasks.capture.engine_host.protocol import EngineStart
from jex.tasks.capture.engine_pool import compile_cache_key
from jex.tasks.capture.golden import compare_golden, find_reference, store_reference
from jex.tasks.capture.stages import WORK_RECORDS, stage_plan
from jex.tasks.documents import GoldenVerdict
from jex.tasks.inputs import EngineJob, FastPassInputs, ReasonInputs
from jex.tasks.records import EngineFingerprint, StagePlan
from jex.tasks.store import LocalStore

ProviderName = Literal["inprocess", "local", "ssh", "ec2", "command"]


class MachinesSpec(BaseModel):
    """Where the engine stages run; the campaign form's 'machines' section."""

    model_config = ConfigDict(extra="forbid")
    provider: ProviderName = Field("local", description="inprocess = in this process; others rent machines")
    hosts: list[str] = Field(default_factory=list, description="ssh: hosts to use (empty = settings)")
    workers: int = Field(1, ge=1, description="Machines sharing each engine stage (one engine each)")
    budget_usd: float | None = Field(None, ge=0, description="Campaign cost budget (empty = settings)")
    price_per_hour: float | None = Field(None, ge=0, description="Price of one machine (empty = settings)")
    wall_budget_hours: float | None = Field(None, gt=0, description="Max life of a machine (empty = settings)")
    heartbeat_timeout_s: float | None = Field(None, gt=0)
    golden_rows: int = Field(64, ge=1, description="Rows replayed before a machine runs its shards")
    golden_tolerance: float = Field(1e-4, ge=0, description="Max |dp| of the golden replay")
    concurrent: bool = Field(True, description="Machines compute at the same time (off: one after another, e.g. "
                                               "workers emulated on one shared GPU)")
    engine_hosts: bool = Field(True, description="One long-lived engine process per slot serves all of a machine's "
                                                 "jobs (golden, fast pass, reason); off: every job loads its own")
    gpus_per_machine: int = Field(1, ge=1, description="GPUs of each machine (one set of engine slots per GPU)")
    engines_per_gpu: int = Field(1, ge=1, description="Engine processes per GPU, each a data-parallel worker; more "
                                                      "than 1 pays off when one engine leaves the GPU idle (small "
                                                      "models); vLLM engines that profile their KV cache start "
                                                      "one after another, others (kv_cache_memory_gib set, the "
                                                      "HF engine) together")
    host_stall_s: float = Field(600.0, gt=0, description="Seconds an engine host may go without finishing a shard "
                                                         "before its job stops it and starts a new one")
    fresh_processes: bool = Field(False, description="inprocess: compute the engine stages in fresh local processes "
                                                     "(one per worker) instead of this one (a twin audit's check)")

    @model_validator(mode="after")
    def _slots_need_machines(self) -> MachinesSpec:
        if self.provider == "inprocess" and self.slots > 1:
            raise ValueError(f"engines_per_gpu x gpus_per_machine = {self.slots} engine processes need machines "
                             "(provider local, ssh, ec2 or command); inprocess runs one engine in this process")
        return self

    @property
    def slots(self) -> int:
        """Engine processes per machine."""
        return self.gpus_per_machine * self.engines_per_gpu

    def host_options(self, workdir: str, engine: EngineSpec) -> HostOptions:
        """How a machine's jobs hand their engine work to its engine hosts (`jex stage --host-options`)."""
        slots = self.slots
        devices = ([str(s // self.engines_per_gpu) for s in range(slots)]  # slot s sees one GPU: s // engines_per_gpu
                   if engine.device.startswith("cuda") else None)
        return HostOptions(home=f"{workdir}/engines", slots=slots, devices=devices,
                           max_requests=0 if self.engine_hosts else 1, stall_s=self.host_stall_s)


class GoldenMismatch(FlowError):
    """A machine's golden replay is outside the tolerance, or the machine measured another engine
    fingerprint than the fleet's (then nothing was compared): it runs no shard."""

    def __init__(self, machine: str, verdict: GoldenVerdict | FingerprintMismatch):
        if isinstance(verdict, FingerprintMismatch):
            what = f"engine fingerprint {verdict.fingerprint} differs from the fleet's {verdict.expected}"
        else:
            worst = ", ".join(f"{w.run_id} ({w.max_abs_dp:.3g})" for w in verdict.worst[:3])
            what = (f"max |dp| {verdict.max_abs_dp:.3g} > tolerance {verdict.tolerance:.3g}; worst rows: {worst}; "
                    f"{verdict.problems[:3]}")
        super().__init__(f"golden replay on {machine}: {what}")
        self.verdict = verdict


class GpuFleet:
    """N machines for the engine stages of one campaign (see the module docstring)."""

    def __init__(self, spec: MachinesSpec, *, campaign: str, store: str, echo: Any = print, settings: Any = None,
                 on_poll: Any = None):
        from jex.settings import load_settings

        self.spec, self.campaign, self.store, self.echo = spec, campaign, LocalStore(store), echo
        self.settings = settings or load_settings()
        infra = self.settings.infra
        self.state_dir = Path(infra.state_dir)
        self.provider = make_provider(infra, name=spec.provider, hosts=spec.hosts or None)
        over = {k: v for k, v in {"budget_usd": spec.budget_usd, "price_per_hour": spec.price_per_hour,
                                  "heartbeat_timeout_s": spec.heartbeat_timeout_s,
                                  "wall_budget_s": spec.wall_budget_hours * 3600 if spec.wall_budget_hours else None
                                  }.items() if v is not None}
        self.policy = policy_from_settings(infra, **over)
        self.ledger = Ledger(self.state_dir / "ledger.json")
        self.s3 = s3_store(self.settings)
        self.on_poll = on_poll
        self.sessions: list[MachineSession] = []
        self.golden: list[GoldenReplay | FingerprintMismatch] = []
        self.engine: EngineSpec | None = None
        """The engine the machines were started for (the campaign's)."""
        self.engine_fp: EngineFingerprint | None = None
        """Its fingerprint, measured by the first machine's golden replay."""
        self.engine_starts: dict[str, list[EngineStart]] = {}
        self._job_keys: dict[str, str] = {}
        """The first key each engine stage ran under (`_job_name`)."""
        self._lock = threading.Lock()

    def __enter__(self) -> GpuFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        errors = []
        for s in self.sessions:
            try:
                s.teardown("campaign stages done" if exc[0] is None else f"{exc[0].__name__}: {str(exc[1])[:160]}")
            except JexError as e:
                errors.append(str(e))
        if errors and exc[0] is None:
            raise InfraError("; ".join(errors))

    def _machine_credentials(self) -> dict[str, str]:
        """For the machines' watchdogs: temporary credentials limited to this campaign's prefix."""
        if self.s3 is None:
            return {}
        from jex.infra.aws import scoped_credentials

        return scoped_credentials(self.settings.store, self.settings.infra,
                                  key_prefix=self.s3.key("campaigns", self.campaign), ttl_s=self.policy.machine_ttl_s())

    def _python(self) -> str:
        import sys

        return self.settings.infra.worker_python or (sys.executable if self.spec.provider == "local" else "python3")

    def _stack(self, engine: EngineSpec) -> str:
        if engine.kind.startswith("vllm"):
            from jex.tasks.capture.engine_pool import VLLM_PIN

            return stack_lock({"vllm": VLLM_PIN}, with_torch=False)
        return stack_lock()

    def _start(self, job: EngineJob) -> None:
        """Start the machines (once), each replaying the golden rows before it may run shards."""
        if self.sessions:
            return
        self.engine = job.inputs.engine
        golden = EngineJob(inputs=FastPassInputs(bundle=job.inputs.bundle, engine=job.inputs.engine, shard_rows=1),
                           store=job.store)
        for i in range(self.spec.workers):
            session = MachineSession(self.provider, campaign=self.campaign, ledger=self.ledger, policy=self.policy,
                                     label=f"w{i}", python=self._python(), state_dir=self.state_dir,
                                     stack=self._stack(job.inputs.engine), s3=self.s3, echo=self.echo,
                                     on_poll=self.on_poll, pip_args=self.settings.infra.pip_args,
                                     machine_credentials=self._machine_credentials)
            self.sessions.append(session)
            try:
                session.start()
            except JexError as e:  # its real cause, named with the machine that never started
                raise InfraError(f"machine {session.label} of provider {self.provider.name!r} did not start: "
                                 f"{e}") from e
        with ThreadPoolExecutor(len(self.sessions) if self.spec.concurrent else 1) as pool:
            list(pool.map(lambda s: self._golden(s, golden), self.sessions))

    def _golden(self, session: MachineSession, job: EngineJob) -> None:
        host = _machine(session)
        inputs = job.inputs
        rows = min(self.spec.golden_rows, inputs.bundle.rows)
        inbox = self.store.root / ".machines" / host.id / "golden"
        files = _job_files(job, inbox)
        machine = (MachineProvenance.model_validate_json(session.provenance_file.read_text())
                   if session.provenance_file else None)
        cached = compile_cache_path(self.store, inputs.engine, machine)
        brought = cached.exists()
        cache_argv = self._compile_cache_argv(cached, files)
        remote = RemoteJob("golden", ["-m", "jex", "stage", "golden", "--args", "args.json", "--rows", str(rows),
                                      "--out", "golden.parquet", "--fingerprint", "fingerprint.json",
                                      *self._host_options_argv(host, inputs.engine, inbox, files), *cache_argv],
                           ["golden.parquet", "fingerprint.json", COMPILE_CACHE], inbox, files=files)
        self._run(session, remote)
        if not brought and (inbox / COMPILE_CACHE).exists():  # the first machine of this engine compiled: keep it
            with self._lock:
                if not cached.exists():
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    (inbox / COMPILE_CACHE).replace(cached)
        fp = EngineFingerprint.model_validate_json((inbox / "fingerprint.json").read_text())
        replay = pl.read_parquet(inbox / "golden.parquet")
        with self._lock:
            self.engine_fp = self.engine_fp or fp
            if fp != self.engine_fp:
                mismatch = FingerprintMismatch(machine=host.id, fingerprint=fp, expected=self.engine_fp)
                self.golden.append(mismatch)
                raise GoldenMismatch(host.id, mismatch)
            plan = stage_plan(inputs.model_copy(update={"engine_fp": fp}), job.store)
            capture = Path(plan.folder) / "capture.parquet"
            ref, source = find_reference(self.store, inputs.bundle, fp, rows, str(capture))
            if ref is None:
                source = str(store_reference(self.store, inputs.bundle, fp, replay))
                verdict = GoldenReplay(machine=host.id, reference=source, established=True, ok=True, rows=rows,
                                       max_abs_dp=0.0, tolerance=self.spec.golden_tolerance)
            else:
                verdict = GoldenReplay(machine=host.id, reference=source, established=False,
                                       **dict(compare_golden(ref, replay, self.spec.golden_tolerance)))
            self.golden.append(verdict)
        self.echo(f"machine {host.id}: golden replay of {rows} rows: max |dp| {verdict.max_abs_dp:.3g} "
                  f"({'reference established' if verdict.established else 'against ' + source})")
        if not verdict.ok:
            raise GoldenMismatch(host.id, verdict)

    def _host_options_argv(self, host: Machine, engine: EngineSpec, inbox: Path, files: dict[str, Path]) -> list[str]:
        """The job's `HostOptions` as `host-options.json` beside its `args.json` (added to `files`), and
        the option that names it."""
        write_json(inbox / "host-options.json", self.spec.host_options(host.workdir, engine).model_dump(mode="json"))
        files["host-options.json"] = inbox / "host-options.json"
        return ["--host-options", "host-options.json"]

    def _compile_cache_argv(self, cached: Path, files: dict[str, Path]) -> list[str]:
        """The golden job's compile-cache options: bring the store's cache for this engine when there
        is one (adding it to `files`), else ask the machine for the one its first engine start makes."""
        if not self.spec.engine_hosts:
            return []
        if cached.exists():
            files["inputs/compile-cache.tar.gz"] = cached
            return ["--compile-cache-in", "inputs/compile-cache.tar.gz"]
        return ["--compile-cache-out", COMPILE_CACHE]

    def run_stage(self, job: EngineJob) -> EngineJob:
        """Compute the job's missing shards on the machines (then they are local); returns the job as its
        stage task must see it: with the engine fingerprint the machines measured."""
        job = self._measured(job)
        plan = stage_plan(job.inputs, job.store)
        if plan.complete or _all_shards(plan):  # e.g. collected by `jex infra reconcile` after a restart
            return job
        self._start(job)
        job = self._measured(job)
        plan = stage_plan(job.inputs, job.store)
        if not plan.complete:
            self._compute(job, plan)
        return job

    def _measured(self, job: EngineJob) -> EngineJob:
        """The job with the machines' fingerprint of its engine: the fleet's engine, or its audited base
        (a speculative campaign's proof); unchanged before any machine measured one."""
        fp, inputs = self.engine_fp, job.inputs
        if fp is None or self.engine is None:
            return job
        if inputs.engine != self.engine:
            if inputs.engine != self.engine.audited_base():
                return job
            fp = fp.audited()
        return job.model_copy(update={"inputs": inputs.model_copy(update={"engine_fp": fp})})

    def _compute(self, job: EngineJob, plan: StagePlan) -> None:
        """Worker i of N on each machine; the verified shards land in this store's stage folder."""
        n, stage, name = len(self.sessions), job.inputs.stage, self._job_name(job.inputs.stage, plan.key)
        shards = f"store/{stage}/{plan.key}/shards-{job.inputs.shard_rows}"

        def one(i: int) -> None:
            session = self.sessions[i]
            host = _machine(session)
            inbox = self.store.root / ".machines" / host.id / name
            files = _job_files(job, inbox)
            remote = RemoteJob(name, ["-m", "jex", "stage", "run", "--args", "args.json", "--worker", str(i),
                                      "--workers", str(n),
                                      *self._host_options_argv(host, job.inputs.engine, inbox, files)],
                               [f"{shards}/shard-*.parquet", f"{shards}/{WORK_RECORDS}"],
                               self.store.root, files=files, strip_prefix="store/")
            self._run(session, remote)

        with ThreadPoolExecutor(n if self.spec.concurrent else 1) as pool:
            list(pool.map(one, range(n)))
        have = len(list(Path(plan.shards_dir).glob("shard-*.parquet")))
        if have != plan.shards:
            raise FlowError(f"{stage}: {have} of {plan.shards} shards came back under key {plan.key}; the "
                            "machines computed a different key (their engine or its inputs differ)")

    def _job_name(self, stage: str, key: str) -> str:
        """A machine job's name, one per stage key: the stage's name for its first key, then `STAGE-KEY8`
        (a speculative campaign's proof and fallback are reason stages of their own; a job's name is its
        folder on the machine, so two keys never share one)."""
        with self._lock:
            first = self._job_keys.setdefault(stage, key)
        return stage if first == key else f"{stage}-{key[:8]}"

    def _run(self, session: MachineSession, job: RemoteJob) -> None:
        """Run one job; then read the machine's engine starts (its engine hosts append one line per start)."""
        try:
            session.run(job)
        finally:  # never in the way of the job's own outcome: an unreadable record counts no start
            text = session.read_text(f"engines/{STARTS}")
            if text is not None:
                self.engine_starts[_machine(session).id] = parse_starts(text)

    def report(self) -> MachinesDoc:
        """`machines.json`: the machines so far, their golden replays and jobs, and the campaign's cost."""
        machines = [FleetMachine(**dict(s.record()), engine_starts=len(starts), engine_start_records=starts)
                    for s in self.sessions if s.machine is not None  # one whose creation failed never ran
                    for starts in [self.engine_starts.get(s.machine.id, [])]]
        return MachinesDoc(provider=self.provider.name, workers=self.spec.workers, slots=self.spec.slots,
                           engine_hosts=self.spec.engine_hosts, golden=list(self.golden), machines=machines,
                           engine_starts=sum(m.engine_starts for m in machines),
                           ledger=self.ledger.usage(self.campaign))


def _machine(session: MachineSession) -> Machine:
    """The session's machine, there once `start` has run (as for every session a fleet uses)."""
    return cast(Machine, session.machine)


def compile_cache_path(store: LocalStore, engine: EngineSpec, machine: MachineProvenance | None) -> Path:
    """Where the store keeps the compile cache of an engine on a kind of machine: keyed by what
    compiled code depends on (the engine fingerprint less its renderer, the scheduler's token
    budget, and from the machine's `provenance.json` its GPU models, vLLM and Python), so every
    machine of that kind and every campaign of that engine starts from it. vLLM checks its own
    cache keys again on load."""
    kind = {"gpus": sorted(re.findall(r"GPU \d+: ([^(;]+?) \(", machine.gpus if machine else "")),
            "vllm": machine.packages.get("vllm") if machine else None, "python": machine.python if machine else None}
    key = compile_cache_key(engine, kind)
    return store.root / "compile_cache" / key / COMPILE_CACHE


def _all_shards(plan: StagePlan) -> bool:
    return len(list(Path(plan.shards_dir).glob("shard-*.parquet"))) == plan.shards


def _job_files(job: EngineJob, inbox: Path) -> dict[str, Path]:
    """The job's input files for its folder on the machine, and `args.json`: the job with the machine's
    relative paths."""
    files: dict[str, Path] = {"inputs/bundle.tar.gz": Path(job.inputs.bundle.bundle)}
    gated = None
    if isinstance(job.inputs, ReasonInputs):
        gated = "inputs/gated.parquet"
        files[gated] = Path(job.inputs.gate.gated)
    remote = job.with_paths(store="store", bundle="inputs/bundle.tar.gz", gated=gated)
    inbox.mkdir(parents=True, exist_ok=True)
    write_json(inbox / "args.json", remote.model_dump(mode="json"))
    files["args.json"] = inbox / "args.json"
    return files


def s3_store(settings: Any = None) -> Any:
    """The S3 store of the settings (`JEX_STORE__S3_*`), or None when no bucket is set."""
    from jex.settings import load_settings

    settings = settings or load_settings()
    if not settings.store.s3_bucket:
        return None
    from jex.infra.s3 import S3Store

    return S3Store.from_settings(settings.store, settings.infra)


__all__ = ["GoldenMismatch", "GpuFleet", "JobFailed", "MachinesSpec"]
