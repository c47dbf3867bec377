"""Engine stages on machines the orchestrator owns: golden replay, detached shards, collection, teardown.

`GpuFleet` starts its machines lazily, the first time a stage has shards to compute, so a cached
campaign never rents one; leaving the `with` block tears every machine down, whatever happened.
Each machine first replays the golden rows (and stops there on a mismatch) against the store's golden
reference (or the head of this engine's fast-pass capture); with neither, the first machine's replay
becomes the reference, or, on a fleet of one, the first rows of the fast pass it computes (`_golden`).
Then each computes worker i of N of each stage, through its engine hosts; the shards come back
verified and the stage's task merges them in the flow's process with the same stage function that
runs in-process, so the capture is the same bytes.

Each machine's life is one Prefect task run, `machine-LABEL` (`machine_life`), submitted to Prefect's
thread-pool task runner: it takes the steps the fleet hands it (bootstrap, golden replay, each
engine job with its collection) one by one, each a child task run `LABEL-STEP`, and always ends with
its teardown step. So the UI shows the fleet, each machine's state and its logs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from functools import partial
from pathlib import Path
from typing import Any, cast

from prefect.task_runners import ThreadPoolTaskRunner

from jex.engine_identity import EngineFingerprint
from jex.engine_spec import EngineSpec
from jex.errors import FlowError, InfraError, JexError
from jex.fileio import sha256_json, write_json
from jex.flows.machines.audit import (
    AuditPlan,
    SettingsAudit,
    audited,
    effective_mismatch,
    judge_probe,
    plan_audit,
)
from jex.flows.machines.golden import (
    PROBE_OUT,
    GoldenReplays,
    job_files,
)
from jex.flows.machines.machine_life import (
    MachineLife,
    failure_reason,
    machine_gpus,
    machine_life,
    machine_of,
    machine_provenance,
)
from jex.flows.machines.machines_doc import FingerprintMismatch, FleetMachine, GoldenReplay, MachinesDoc
from jex.infra.cost_ledger import CostLedger
from jex.infra.machine import JobFailed, MachineSession, RemoteJob, required_tools, stack_lock
from jex.infra.providers import Machine
from jex.infra.reaper import check_results_survive, make_provider, policy_from_settings
from jex.infra.s3 import S3Store
from jex.lab.jobs import MACHINE_OUT, OUTPUTS, LabJob
from jex.settings import JexSettings
from jex.store_layout import machine_inbox, shards_dir, stage_dir
from jex.tasks.campaign_spec import MachinesSpec
from jex.tasks.capture.stages import WORK_RECORDS, stage_plan
from jex.tasks.execution import (
    STARTS,
    EngineStart,
    kernel_settings,
    model_shape,
    parse_starts,
)
from jex.tasks.inputs import EngineJob, FastPassInputs
from jex.tasks.prefect_tasks import progress_artifact
from jex.tasks.records import StagePlan
from jex.tasks.store import FAILED_ROWS, LocalStore


class EngineSettingsMismatch(FlowError):
    """A machine's engine ran with settings its audit did not measure (read back from the engine)."""

    def __init__(self, machine: str, problems: list[str]):
        super().__init__(f"machine {machine}: its engine runs with settings the audit did not measure: "
                         + "; ".join(problems))


class GpuFleet(GoldenReplays):
    """N machines for the engine stages of one campaign (see the module docstring)."""

    def __init__(self, spec: MachinesSpec, *, campaign: str, store: str, echo: Callable[[str], None] = print,
                 settings: JexSettings | None = None,
                 on_poll: Callable[[MachineSession, RemoteJob, int], None] | None = None):
        from jex.flows.credentials import with_block_credentials
        from jex.settings import load_settings

        self.spec, self.campaign, self.store, self.echo = spec, campaign, LocalStore(store), echo
        self.settings = with_block_credentials(settings or load_settings(),
                                               aws_credentials_block=spec.aws_credentials_block)
        infra = self.settings.infra
        self.state_dir = Path(infra.state_dir)
        self.provider = make_provider(infra, name=spec.provider, hosts=spec.hosts or None)
        over = {k: v for k, v in {"budget_usd": spec.budget_usd, "price_per_hour": spec.price_per_hour,
                                  "heartbeat_timeout_s": spec.heartbeat_timeout_s, "budget_hours": spec.budget_hours
                                  }.items() if v is not None}
        self.policy = policy_from_settings(infra, **over)
        # before any machine: one whose orchestrator disappears powers off, and its disk may go with it
        # (a run from the Prefect UI has had no CLI pre-flight)
        check_results_survive(self.provider.name, keeps_disk=self.provider.keeps_disk,
                              bucket=self.settings.store.s3_bucket, watchdog=self.policy.watchdog)
        self.ledger = CostLedger(self.state_dir / "ledger.json")
        self.s3 = s3_store(self.settings)
        self.on_poll = on_poll
        self.sessions: list[MachineSession] = []
        self.golden: list[GoldenReplay | FingerprintMismatch] = []
        self.audit: SettingsAudit | None = None
        self.engine: EngineSpec | None = None
        """The engine the machines were started for (the campaign's)."""
        self.engine_fp: EngineFingerprint | None = None
        """Its fingerprint, measured by the first machine's golden replay."""
        self.engine_starts: dict[str, list[EngineStart]] = {}
        self._reference_due = 0
        """Rows of golden reference the next fast pass computed here establishes (`_golden`)."""
        self._job_keys: dict[str, str] = {}
        """The first key each engine stage ran under (`_job_name`)."""
        self._lock = threading.Lock()
        self._lives: list[MachineLife] = []
        self._task_runner: ThreadPoolTaskRunner | None = None
        """Prefect's runner of the machines' life task runs, from the first start to `__exit__`."""

    def __enter__(self) -> GpuFleet:
        return self

    def __exit__(self, *exc: Any) -> None:
        """Each machine's life ends with its teardown (those that failed ended so already); an
        undeletable machine fails a fleet that had no other error."""
        reason = "campaign stages done" if exc[1] is None else failure_reason(exc[1])
        for life in self._lives:
            life.close(reason)
        for life in self._lives:
            if life.run is not None:
                life.run.wait()
        if self._task_runner is not None:
            self._task_runner.__exit__(None, None, None)
            self._task_runner = None
        errors = [life.teardown_error for life in self._lives if life.teardown_error]
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

    def _start(self, job: EngineJob) -> None:
        """Start the machines (once), each replaying the golden rows before it may run shards; the first one's
        golden job runs the settings audit's probe first when no stored audit covers the engine."""
        if self.sessions:
            return
        self.engine = job.inputs.engine
        golden = EngineJob(inputs=FastPassInputs(bundle=job.inputs.bundle, engine=job.inputs.engine, shard_rows=1),
                           store=job.store)
        self._start_machines(stack_lock(job.inputs.engine.kind), tools=required_tools(job.inputs.engine.kind))
        plan = self._plan_audit(job) if audited(self.spec.audit, job.inputs.engine) else None
        self._each_machine("golden", lambda i, s: self._golden(s, golden, plan if i == 0 else None))
        self._check_effective()

    def _plan_audit(self, job: EngineJob) -> AuditPlan | None:
        """The stored audit that covers the engine's settings on these machines' GPUs, stack and model shape
        (then `self.audit`, and None), else the plan whose probe the first golden job runs
        (flows/machines/audit.py); a stored failed audit raises `SettingsNotAudited` here."""
        engine = job.inputs.engine
        plan = plan_audit(engine, store_root=self.store.root, gpus=machine_gpus(machine_provenance(self.sessions[0])),
                          stack_lock=stack_lock(engine.kind), shape=model_shape(engine), kernel=kernel_settings(engine),
                          prompts=self.spec.audit_prompts, tokens=self.spec.audit_tokens)
        if plan.probe is not None:
            return plan
        self.audit = plan.stored
        assert self.audit is not None
        self.echo(self.audit.line())
        return None

    def _judge_probe(self, plan: AuditPlan, inbox: Path) -> None:
        self.audit = judge_probe(plan, inbox / PROBE_OUT, self.spec.audit)
        self.echo(self.audit.line() + ("" if self.audit.status == "proven" else
                                       ": the control arm never diverged, so this audit proves nothing"))

    def _check_effective(self) -> None:
        """Every machine's engines ran with the settings the audit measured (read back from each engine):
        else `EngineSettingsMismatch`, naming the machine and the setting, before any shard."""
        if self.audit is None or self.engine is None:
            return
        for machine, starts in self.engine_starts.items():
            for start in starts:
                if start.kind == self.engine.kind and (problems := effective_mismatch(self.audit, start.effective)):
                    raise EngineSettingsMismatch(machine, problems)

    def _start_machines(self, stack: str, tools: tuple[str, ...] = ()) -> None:
        """Create and bootstrap the machines with `stack` installed and `tools` on PATH, each as its life task run."""
        self._task_runner = ThreadPoolTaskRunner(max_workers=self.spec.workers).__enter__()
        for i in range(self.spec.workers):
            session = MachineSession(self.provider, campaign=self.campaign, ledger=self.ledger, policy=self.policy,
                                     label=f"w{i}", python=self._python(), state_dir=self.state_dir,
                                     stack=stack, s3=self.s3, echo=self.echo,
                                     on_poll=self.on_poll, pip_args=self.settings.infra.pip_args,
                                     machine_credentials=self._machine_credentials, tools=tools)
            self.sessions.append(session)
            life = MachineLife(session)
            life.run = self._task_runner.submit(cast(Any, machine_life),  # mypy misses the sync overload
                                                parameters={"label": session.label, "life": life})
            # a life run that ends without taking its steps (its task run could not begin) fails them, not hangs
            life.run.add_done_callback(life.run_ended)
            self._lives.append(life)
        # one machine after another, as the budget guard and the ledger expect; none after a failed one
        self._each_machine("bootstrap", lambda i, s: self._boot(s), one_at_a_time=True)

    def _boot(self, session: MachineSession) -> None:
        try:
            session.start()
        except JexError as e:  # its real cause, named with the machine that never started
            raise InfraError(f"machine {session.label} of provider {self.provider.name!r} did not start: "
                             f"{e}") from e

    def _each_machine(self, step: str, work: Callable[[int, MachineSession], None], *,
                      one_at_a_time: bool = False) -> None:
        """Hand `work(i, session)` to machine i's life as its step `step`, on every machine (one after
        another unless the spec is concurrent); returns when all are done, raising the first failure in
        machine order (a failed machine's life has torn it down)."""
        serial = one_at_a_time or not self.spec.concurrent
        orders: list[Future[None]] = []
        for i, life in enumerate(self._lives):
            orders.append(life.order(step, partial(work, i, life.session)))
            if serial and orders[-1].exception() is not None:  # waits for it
                break
        wait(orders)
        for order in orders:
            order.result()

    def _host_options_argv(self, host: Machine, engine: EngineSpec, inbox: Path, files: dict[str, Path]) -> list[str]:
        """The job's `HostOptions` as `host-options.json` beside its `args.json` (added to `files`), and
        the option that names it."""
        write_json(inbox / "host-options.json", self.spec.host_options(host.workdir, engine).model_dump(mode="json"))
        files["host-options.json"] = inbox / "host-options.json"
        return ["--host-options", "host-options.json"]

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
            self._establish_reference(job, plan)
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

    def run_lab(self, job: LabJob) -> None:
        """Run a lab job (`jex.lab.jobs`) as the next step of the first machine (started here when
        none is; no golden replay: a lab job measures engines, it adds no rows to the store) and collect
        its outputs into `job.out`."""
        if not self.sessions:
            vllm = next((k for k in job.engine_kinds() if k.startswith("vllm")), "hf")
            self._start_machines(stack_lock(vllm), tools=required_tools(vllm))
        session, name = self.sessions[0], self._job_name(f"lab-{job.kind}", sha256_json(job.model_dump(mode="json")))
        inbox = machine_inbox(self.store.root, machine_of(session).id, name)
        inbox.mkdir(parents=True, exist_ok=True)
        write_json(inbox / "args.json", job.on_machine().model_dump(mode="json"))
        remote = RemoteJob(name, ["-m", "jex.lab.jobs", "args.json"],
                           [f"{MACHINE_OUT}/{pattern}" for pattern in OUTPUTS[job.kind]], Path(job.out),
                           files={**job.machine_files(), "args.json": inbox / "args.json"},
                           strip_prefix=f"{MACHINE_OUT}/")
        self._lives[0].order(name, partial(self._run, session, remote)).result()

    def _compute(self, job: EngineJob, plan: StagePlan) -> None:
        """Worker i of N on each machine; the verified shards land in this store's stage folder (the
        stage's progress artifact counts them as each machine's job is collected)."""
        self._check_effective()  # engines started since the golden jobs (other slots, replaced hosts) too
        n, stage, name = len(self.sessions), job.inputs.stage, self._job_name(job.inputs.stage, plan.key)
        shards = shards_dir(stage_dir("store", stage, plan.key), job.inputs.shard_rows).as_posix()
        progress = progress_artifact(stage)

        def one(i: int, session: MachineSession) -> None:
            host = machine_of(session)
            inbox = machine_inbox(self.store.root, host.id, name)
            files = job_files(job, inbox)
            remote = RemoteJob(name, ["-m", "jex", "stage", "run", "--args", "args.json", "--worker", str(i),
                                      "--workers", str(n),
                                      *self._host_options_argv(host, job.inputs.engine, inbox, files)],
                               [f"{shards}/shard-*.parquet", f"{shards}/{FAILED_ROWS}", f"{shards}/{WORK_RECORDS}"],
                               self.store.root, files=files, strip_prefix="store/")
            self._run(session, remote)
            progress(name, len(list(Path(plan.shards_dir).glob("shard-*.parquet"))), plan.shards)

        self._each_machine(name, one)
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
                self.engine_starts[machine_of(session).id] = parse_starts(text)

    def report(self) -> MachinesDoc:
        """`machines.json`: the machines so far, their golden replays and jobs, and the campaign's cost."""
        machines = [FleetMachine(**dict(s.record()), engine_starts=len(starts), engine_start_records=starts)
                    for s in self.sessions if s.machine is not None  # one whose creation failed never ran
                    for starts in [self.engine_starts.get(s.machine.id, [])]]
        return MachinesDoc(provider=self.provider.name, workers=self.spec.workers,
                           slots=self.spec.engine_slots(self.engine), engine_hosts=self.spec.engine_hosts,
                           golden=list(self.golden), audit=self.audit, machines=machines,
                           engine_starts=sum(m.engine_starts for m in machines),
                           ledger=self.ledger.usage(self.campaign))


def _all_shards(plan: StagePlan) -> bool:
    return len(list(Path(plan.shards_dir).glob("shard-*.parquet"))) == plan.shards


def s3_store(settings: JexSettings | None = None, *, aws_credentials_block: str | None = None) -> S3Store | None:
    """The S3 store of the settings (`JEX_STORE__S3_*`), or None when no bucket is set; its keys from the
    named credential blocks first (`jex.flows.credentials`)."""
    from jex.settings import load_settings

    settings = settings or load_settings()
    if not settings.store.s3_bucket:
        return None
    from jex.flows.credentials import with_block_credentials

    settings = with_block_credentials(settings, aws_credentials_block=aws_credentials_block)

    return S3Store.from_settings(settings.store, settings.infra)


__all__ = ["GpuFleet", "JobFailed", "s3_store"]
