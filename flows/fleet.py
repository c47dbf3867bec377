"""Engine stages on machines the orchestrator owns: golden replay, detached shards, collection, teardown.

`GpuFleet` starts its machines lazily, the first time a stage has shards to compute, so a cached
campaign never rents one; leaving the `with` block tears every machine down, whatever happened.
Each machine first replays the golden rows against the stored reference (and stops there on a
mismatch), then computes worker i of N of each stage; the shards come back verified and are merged
here by the same stage function that runs in-process, so the capture is the same bytes.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, cast

import polars as pl
from pydantic import BaseModel, ConfigDict, Field, model_validator

from jex.errors import FlowError, InfraError, JexError
from jex.fileio import write_json
from jex.infra.ledger import Ledger
from jex.infra.machine import JobFailed, MachineSession, RemoteJob, stack_lock
from jex.infra.providers import Machine
from jex.infra.reaper import make_provider, policy_from_settings
from jex.tasks.capture.engine_host import COMPILE_CACHE, STARTS, parse_starts
from jex.tasks.capture.engine_pool import EngineSpec
from jex.tasks.capture.golden import compare_golden, find_reference, store_reference
from jex.tasks.capture.stages import stage_plan
from jex.tasks.records import EngineStageArgs, StagePlan
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

    def host_argv(self, workdir: str, engine: EngineSpec) -> list[str]:
        """The `jex stage` options that hand a job's engine work to the machine's engine hosts."""
        argv = ["--engine-host", f"{workdir}/engines", "--host-requests", "0" if self.engine_hosts else "1",
                "--stall-s", str(self.host_stall_s)]
        slots = self.slots
        if slots > 1:
            argv += ["--slots", str(slots)]
        if engine.device.startswith("cuda"):  # slot s sees one GPU: s // engines_per_gpu
            argv += ["--devices", ",".join(str(s // self.engines_per_gpu) for s in range(slots))]
        return argv


class GoldenMismatch(FlowError):
    def __init__(self, machine: str, verdict: dict[str, Any]):
        worst = ", ".join(f"{w['run_id']} ({w['max_abs_dp']:.3g})" for w in verdict["worst"][:3])
        super().__init__(f"golden replay on {machine}: max |dp| {verdict['max_abs_dp']:.3g} > tolerance "
                         f"{verdict['tolerance']:.3g}; worst rows: {worst}; {verdict['problems'][:3]}")
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
        self.golden: list[dict[str, Any]] = []
        self.engine_fp: dict[str, Any] | None = None
        self.engine_starts: dict[str, list[dict[str, Any]]] = {}
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

    def _start(self, args: EngineStageArgs) -> None:
        """Start the machines (once), each replaying the golden rows before it may run shards."""
        if self.sessions:
            return
        for i in range(self.spec.workers):
            session = MachineSession(self.provider, campaign=self.campaign, ledger=self.ledger, policy=self.policy,
                                     label=f"w{i}", python=self._python(), state_dir=self.state_dir,
                                     stack=self._stack(args.engine), s3=self.s3, echo=self.echo,
                                     on_poll=self.on_poll, pip_args=self.settings.infra.pip_args,
                                     machine_credentials=self._machine_credentials)
            self.sessions.append(session)
            session.start()
        with ThreadPoolExecutor(len(self.sessions) if self.spec.concurrent else 1) as pool:
            list(pool.map(lambda s: self._golden(s, args), self.sessions))

    def _golden(self, session: MachineSession, args: EngineStageArgs) -> None:
        host = _machine(session)
        rows = min(self.spec.golden_rows, args.bundle.rows)
        inbox = self.store.root / ".machines" / host.id / "golden"
        files = _job_files(args, inbox)
        machine = json.loads(session.provenance_file.read_text()) if session.provenance_file else None
        cached = compile_cache_path(self.store, args.engine, machine)
        brought = cached.exists()
        cache_argv = self._compile_cache_argv(cached, files)
        job = RemoteJob("golden", ["-m", "jex", "stage", "golden", "--args", "args.json", "--rows", str(rows),
                                   "--out", "golden.parquet", "--fingerprint", "fingerprint.json",
                                   *self.spec.host_argv(host.workdir, args.engine),
                                   *cache_argv],
                        ["golden.parquet", "fingerprint.json", COMPILE_CACHE], inbox, files=files)
        self._run(session, job)
        if not brought and (inbox / COMPILE_CACHE).exists():  # the first machine of this engine compiled: keep it
            with self._lock:
                if not cached.exists():
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    (inbox / COMPILE_CACHE).replace(cached)
        fp = json.loads((inbox / "fingerprint.json").read_text())
        replay = pl.read_parquet(inbox / "golden.parquet")
        with self._lock:
            self.engine_fp = self.engine_fp or fp
            if fp != self.engine_fp:
                raise GoldenMismatch(host.id, {"max_abs_dp": float("inf"), "tolerance": 0, "worst": [],
                                                           "problems": [f"engine fingerprint {fp} differs from "
                                                                        f"{self.engine_fp}"]})
            plan = stage_plan("fast_pass", args.model_copy(update={"shard_rows": 1}), fp)
            capture = Path(plan.folder) / "capture.parquet"
            ref, source = find_reference(self.store, args.bundle, fp, rows, str(capture))
            if ref is None:
                source = str(store_reference(self.store, args.bundle, fp, replay))
                verdict = {"ok": True, "rows": rows, "max_abs_dp": 0.0, "tolerance": self.spec.golden_tolerance,
                           "worst": [], "problems": [], "established": True}
            else:
                verdict = {**compare_golden(ref, replay, self.spec.golden_tolerance).to_dict(), "established": False}
            self.golden.append({"machine": host.id, "reference": source, **verdict})
        self.echo(f"machine {host.id}: golden replay of {rows} rows: max |dp| {verdict['max_abs_dp']:.3g} "
                  f"({'reference established' if verdict['established'] else 'against ' + source})")
        if not verdict["ok"]:
            raise GoldenMismatch(host.id, verdict)

    def _compile_cache_argv(self, cached: Path, files: dict[str, Path]) -> list[str]:
        """The golden job's compile-cache options: bring the store's cache for this engine when there
        is one (adding it to `files`), else ask the machine for the one its first engine start makes."""
        if not self.spec.engine_hosts:
            return []
        if cached.exists():
            files["inputs/compile-cache.tar.gz"] = cached
            return ["--compile-cache-in", "inputs/compile-cache.tar.gz"]
        return ["--compile-cache-out", COMPILE_CACHE]

    def run_stage(self, stage: str, args: EngineStageArgs, engine_fp: dict[str, Any] | None = None) -> StagePlan:
        """Compute the stage's missing shards on the machines; returns the plan (the shards are then local).

        `engine_fp` is the fingerprint of the engine `args` names when it is not the fleet's own (the
        audited base of a speculative profile, which the machines also serve)."""
        plan = stage_plan(stage, args, engine_fp or self.engine_fp)
        if plan.complete or _all_shards(plan):  # e.g. collected by `jex infra reconcile` after a restart
            return plan
        self._start(args)
        plan = stage_plan(stage, args, engine_fp or self.engine_fp)
        if plan.complete:
            return plan
        n = len(self.sessions)

        def one(i: int) -> None:
            session = self.sessions[i]
            host = _machine(session)
            inbox = self.store.root / ".machines" / host.id / stage
            job = RemoteJob(stage, ["-m", "jex", "stage", "run", stage, "--args", "args.json", "--worker", str(i),
                                    "--workers", str(n),
                                    *self.spec.host_argv(host.workdir, args.engine)],
                            [f"store/{stage}/{plan.key}/shards-{args.shard_rows}/shard-*.parquet"],
                            self.store.root, files=_job_files(args, inbox), strip_prefix="store/")
            self._run(session, job)  # the verified shards land in this store's stage folder

        with ThreadPoolExecutor(n if self.spec.concurrent else 1) as pool:
            list(pool.map(one, range(n)))
        have = len(list(Path(plan.shards_dir).glob("shard-*.parquet")))
        if have != plan.shards:
            raise FlowError(f"{stage}: {have} of {plan.shards} shards came back under key {plan.key}; the "
                               "machines computed a different key (engine or code differs)")
        return plan

    def _run(self, session: MachineSession, job: RemoteJob) -> None:
        """Run one job; then read the machine's engine starts (its engine hosts append one line per start)."""
        try:
            session.run(job)
        finally:  # never in the way of the job's own outcome: an unreadable record counts no start
            text = session.read_text(f"engines/{STARTS}")
            if text is not None:
                self.engine_starts[_machine(session).id] = [s.model_dump() for s in parse_starts(text)]

    def report(self) -> dict[str, Any]:
        machines = [{**s.report(), "engine_starts": len(self.engine_starts.get(_machine(s).id, [])),
                     "engine_start_records": self.engine_starts.get(_machine(s).id, [])} for s in self.sessions]
        return {"provider": self.provider.name, "workers": self.spec.workers, "slots": self.spec.slots,
                "engine_hosts": self.spec.engine_hosts, "golden": self.golden, "machines": machines,
                "engine_starts": sum(m["engine_starts"] for m in machines),
                "ledger": self.ledger.report(self.campaign)}


def _machine(session: MachineSession) -> Machine:
    """The session's machine, there once `start` has run (as for every session a fleet uses)."""
    return cast(Machine, session.machine)


def compile_cache_path(store: LocalStore, engine: EngineSpec, machine: dict[str, Any] | None) -> Path:
    """Where the store keeps the compile cache of an engine on a kind of machine: keyed by what
    compiled code depends on (the engine fingerprint less its renderer, the scheduler's token
    budget, and from the machine's `provenance.json` its GPU models, vLLM and Python), so every
    machine of that kind and every campaign of that engine starts from it. vLLM checks its own
    cache keys again on load."""
    from jex.tasks.capture.engine_pool import engine_fingerprint
    from jex.tasks.keys import stage_key

    spec = engine
    fp = {k: v for k, v in engine_fingerprint(spec).items() if k != "renderer"}
    machine = machine or {}
    kind = {"gpus": sorted(re.findall(r"GPU \d+: ([^(;]+?) \(", machine.get("gpus") or "")),
            "vllm": (machine.get("packages") or {}).get("vllm"), "python": machine.get("python")}
    key = stage_key("compile_cache", params={"max_num_batched_tokens": spec.max_num_batched_tokens, "machine": kind},
                    inputs={}, engine=fp)
    return store.root / "compile_cache" / key / COMPILE_CACHE


def _all_shards(plan: StagePlan) -> bool:
    return len(list(Path(plan.shards_dir).glob("shard-*.parquet"))) == plan.shards


def _job_files(args: EngineStageArgs, inbox: Path) -> dict[str, Path]:
    """The stage's inputs for the job folder, with `args.json` rewritten to the machine's relative paths."""
    files: dict[str, Path] = {"inputs/bundle.tar.gz": Path(args.bundle.bundle)}
    remote = args.model_copy(update={"store": "store",
                                     "bundle": args.bundle.model_copy(update={"bundle": "inputs/bundle.tar.gz"})})
    if args.gate is not None:
        files["inputs/gated.parquet"] = Path(args.gate.gated)
        remote = remote.model_copy(update={"gate": args.gate.model_copy(update={"gated": "inputs/gated.parquet"})})
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
