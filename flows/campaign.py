"""The campaign flow: bundle -> fast pass -> gate -> reason (-> a speculative profile's proof) (-> generate, for
a suite's generative catalogs) -> fold -> calibrate -> overlay -> score -> report; the engine stages and those
before them are `capture_stages`, the next four `decision_stages`.

Every stage is a cached Prefect task keyed by its inputs' content, so running the flow again, a
flow-run retry, or `jex run --resume RUN` recomputes only what is missing: completed stages come back
Cached and an interrupted engine stage resumes at its first missing shard.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar, cast

from prefect import Task, flow

from jex.errors import FlowError, JexError
from jex.fileio import sha256_json, write_json, write_text
from jex.flows.machines.fleet import s3_store
from jex.flows.machines.machines_doc import MachinesDoc, machines_section
from jex.flows.machines.runners import StageRunner, make_runner
from jex.infra.s3 import S3Store, checkpoint
from jex.run_records import (
    CAMPAIGN_FILE,
    ENGINE_STAGES,
    STAGE_NAMES,
    EngineCalls,
    RunStages,
    StageName,
    StageRecord,
)
from jex.settings import JexSettings
from jex.store_layout import SUCCESS

# CampaignSpec and campaign_spec: the campaign flow's form and how settings fill it (deployments read them here)
from jex.tasks.campaign_spec import CampaignSpec, load_spec, sample_suite_dir
from jex.tasks.campaign_spec import campaign_spec as campaign_spec
from jex.tasks.capture.spec_proof import ExactnessProof, prove, write_proof
from jex.tasks.decisions import (
    Decision,
    append_decisions,
    ledger_path,
    model_facts,
    now,
    read_decisions,
    ungated_rules,
)
from jex.tasks.execution import CALLS
from jex.tasks.inputs import (
    BundleInputs,
    CalibrateInputs,
    EngineJob,
    FastPassInputs,
    FoldInputs,
    GateInputs,
    GenerateInputs,
    OverlayInputs,
    ProofSampleInputs,
    ReasonInputs,
    ScoreInputs,
    StageInputs,
)
from jex.tasks.outputs.samples import warm_tokenizer
from jex.tasks.prefect_tasks import (
    bundle_task,
    calibrate_task,
    fast_pass_task,
    fold_task,
    gate_task,
    generate_task,
    overlay_task,
    proof_sample_task,
    reason_task,
    report_task,
    score_task,
)
from jex.tasks.records import (
    BundleSummary,
    CampaignSummaries,
    FastPassSummary,
    FinishedCampaign,
    StageSummary,
)
from jex.tasks.run_store import find_run_store
from jex.tasks.store import LocalStore

S = TypeVar("S", bound=StageSummary)
STAGES = STAGE_NAMES
"""The campaign's stages in order, what `redo` and retry-stage name (a speculative profile adds
`spec_proof_sample` and `spec_proof`, `ProofStageName`)."""


@dataclass
class CampaignRun:
    """One run of the campaign flow: runs its stages one by one, keeps their summaries and timings,
    and records them in the run folder (`stages.json`) and on S3 after each."""

    spec: CampaignSpec
    run_dir: Path
    runner: StageRunner
    redo: list[StageName] = field(default_factory=list)
    s3: S3Store | None = None
    summaries: CampaignSummaries = field(default_factory=CampaignSummaries)
    timings: dict[str, float] = field(default_factory=dict)
    overlays_unverified: bool = False
    """Overlay rules applied under `unverified_overlays` although some rule has no passed gate record."""
    stored_only: bool = False
    """Look every stage up in the store instead of running it (`stored_run`); a missing one raises NotStored."""

    def stage(self, name: str, task: Task[..., S], inputs: StageInputs) -> S:
        """Run one stage task on its inputs record: an engine stage has its missing shards computed by
        the runner first (on machines, whose measured engine fingerprint the inputs then carry).
        Returns the stage's summary, recorded under `name`."""
        if self.stored_only:
            stored = cast(S, stored_summary(self.spec.store, name, inputs))
            setattr(self.summaries, name, stored)
            return stored
        t0 = time.perf_counter()
        if isinstance(inputs, FastPassInputs | ReasonInputs | GenerateInputs):
            if not LocalStore(self.spec.store).stage(inputs.stage, inputs.key()).complete:
                warm_tokenizer(self.spec.engine)  # the report renders prompts with it: loaded while machines compute
            inputs = self.runner.compute(EngineJob(inputs=inputs, store=self.spec.store)).inputs
        call = {"inputs": inputs, "store": self.spec.store}
        out = task.with_options(refresh_cache=True)(**call) if name in self.redo else task(**call)
        if not (Path(out.folder) / SUCCESS).exists():  # Prefect cached a result the store lost
            out = task.with_options(refresh_cache=True)(**call)
        self.timings[name] = time.perf_counter() - t0
        setattr(self.summaries, name, out)
        RunStages({k: StageRecord(key=v.key, folder=v.folder, seconds=round(self.timings[k], 3))
                   for k, v in self.summaries.done().items()}).write(self.run_dir)
        if self.s3 is not None:  # a new orchestrator can resume from here (`jex store pull`, `jex run --resume`)
            checkpoint(self.s3, self.run_dir, out.folder)
        return out


@flow(name="campaign", log_prints=True, persist_result=True)
def campaign(spec: CampaignSpec = CampaignSpec(), redo: list[StageName] | None = None,  # noqa: B008 - UI form
             recompute: bool = False) -> str:
    """Run (or resume) a campaign; returns the run folder.

    `redo` names stages to compute again although cached (retry-stage): their stage folders from the
    last run of this campaign are set aside (renamed, never deleted; an engine stage keeps its folder
    when no row failed, else computes only its failed rows again: `retire_stages`) and their Prefect
    cache refreshed.
    A stage the run folder records but the store does not hold is refused (`StoresLacking`: the store
    moved, or is another one) unless `recompute` allows computing it again.
    """
    spec = spec.located()
    run_dir = spec.run_dir()
    redo = list(redo or [])
    if unknown := set(redo) - set(STAGES):
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {list(STAGES)}")
    check_stages_held(spec, run_dir, redo=redo, recompute=recompute)
    for warning in spec.gpu_warnings():  # a UI run has no pre-flight: the flow's log says it
        print(f"WARNING: {warning}")
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text(run_dir / CAMPAIGN_FILE, spec.model_dump_json(indent=2))
    retired = retire_stages(run_dir, redo)
    if retired:
        print(f"retry: set aside {len(retired)} stage folder(s) for {redo}: {retired}")
    if spec.reference_min_agreement is not None and not spec.reference:
        raise FlowError("reference_min_agreement is set but no reference rows are given (set `reference`)")
    runner = make_runner(spec.machines, campaign=run_dir.name, store=spec.store,
                         served_run=run_dir if spec.engine.is_served() else None)
    run = CampaignRun(spec, run_dir, runner, redo, s3_store(aws_credentials_block=spec.machines.aws_credentials_block))
    calls_before = dict(CALLS)
    proof = capture_stages(run)
    decision_stages(run)
    stages = [k for k in ENGINE_STAGES if k != "generate" or run.summaries.generate is not None]
    in_process = {k: CALLS[k] - calls_before.get(k, 0) for k in stages}
    calls = run.runner.engine_calls()
    EngineCalls.model_validate({"redo": redo, "retired": retired, "in_process": in_process,
                                "calls": {k: calls.get(k, 0) for k in stages} if calls else in_process}
                               ).write(run_dir)
    if proof is not None:
        write_proof(run_dir, proof, fell_back=not proof.exact)
    report_task(run_dir=str(run_dir), summaries=run.summaries, spec=spec,
                timings=run.timings, machines=run.runner.section())
    upload_to_s3(run.s3, run_dir, run.summaries, spec.store)
    log_to_mlflow(spec, run_dir)
    s = run.summaries.finished()
    if any(run_errors(s).values()):
        print(f"WARNING: error counters are not all zero: {run_errors(s)}")
    enforce_audit(spec, s)
    record_campaign(spec, run_dir, s, unverified=run.overlays_unverified)
    print(f"run folder: {run_dir.resolve()} (retry a stage: the retry-stage deployment with this run_dir)")
    return str(run_dir)


def capture_stages(run: CampaignRun) -> ExactnessProof | None:
    """bundle -> fast pass -> gate -> reason (-> the speculative profile's proof), the engine stages on
    the campaign's runner; its machines are released at the end, also on failure."""
    spec = run.spec
    proof = None
    try:
        with run.runner:
            bundle = run.stage("bundle", bundle_task, BundleInputs(suite=spec.suite or sample_suite_dir(spec),
                                                                   reference=spec.reference))
            check_overlay_gate(run, bundle)  # before any engine stage: an ungated rule file is refused here
            fast = run.stage("fast_pass", fast_pass_task, spec.fast_pass_inputs(bundle))
            check_overlay_gate(run, bundle, fast)  # and gated on this capture, before the reason stage
            gate = run.stage("gate", gate_task, GateInputs(bundle=bundle, fast=fast, coverage=spec.coverage,
                                                           per_catalog_cap=spec.per_catalog_cap))
            run.stage("reason", reason_task, spec.reason_inputs(bundle, gate))
            if spec.engine.profile != "audit":
                proof = prove_speculation(run)
            if bundle.generate_rows:
                run.stage("generate", generate_task, spec.generate_inputs(bundle))
    finally:
        if (machines := run.runner.report()) is not None:  # also when a machine failed its golden replay
            publish_machines(run.run_dir, machines)
    return proof


def decision_stages(run: CampaignRun) -> None:
    """fold -> calibrate -> overlay -> score, on this process's CPU."""
    spec, s = run.spec, run.summaries
    fold = run.stage("fold", fold_task, FoldInputs(bundle=s.bundle, fast=s.fast_pass, gate=s.gate, reason=s.reason,
                                                   rule=spec.fold_rule, weight=spec.fold_weight,
                                                   draws=spec.bootstrap_draws, seed=spec.bootstrap_seed))
    calibrated = run.stage("calibrate", calibrate_task, CalibrateInputs(bundle=s.bundle, fold=fold,
                                                                        folds=spec.calibration_folds))
    overlay = run.stage("overlay", overlay_task, OverlayInputs.from_file(calibrated, spec.overlays,
                                                                         unverified=run.overlays_unverified))
    run.stage("score", score_task, ScoreInputs(bundle=s.bundle, overlay=overlay, fold=fold, generated=s.generate,
                                               draws=spec.bootstrap_draws, seed=spec.bootstrap_seed))


def prove_speculation(run: CampaignRun) -> ExactnessProof:
    """The audited base engine reasons on a sample of the gated rows; unless every token matches the
    speculative stage's, the whole reason stage is recomputed by the base engine (its summary replaced)."""
    spec, s = run.spec, run.summaries
    assert s.bundle is not None and s.gate is not None and s.reason is not None  # the capture stages ran before
    base = spec.engine.audited_base()
    sample = run.stage("spec_proof_sample", proof_sample_task, ProofSampleInputs(
        bundle=s.bundle, gate=s.gate, rows=spec.spec_proof_rows, golden_rows=spec.machines.golden_rows))
    proved = run.stage("spec_proof", reason_task, spec.reason_inputs(s.bundle, sample, engine=base))
    proof = prove(s.reason, proved, profile=spec.engine.profile)
    print(f"speculative decoding ({spec.engine.profile}): {proof.rows_checked} rows, {proof.tokens_compared} tokens "
          f"compared, {proof.rows_differing} differing" + ("" if proof.exact else
                                                          " -> falling back to the audited base profile"))
    if not proof.exact:
        run.stage("reason", reason_task, spec.reason_inputs(s.bundle, s.gate, engine=base))
    return proof


def check_overlay_gate(run: CampaignRun, bundle: BundleSummary, fast: FastPassSummary | None = None) -> None:
    """The binding overlay gate: each enabled rule of the campaign's rule file needs a passed gate record
    (`jex overlays gate`, in the store's ledger) of its hash on this suite (and, once the fast pass is
    there, this capture). Otherwise the campaign is refused, unless `unverified_overlays` is set: then the
    rules are applied and marked (`OverlayInputs.unverified`)."""
    from jex.overlays.loading import load_rules

    spec = run.spec
    rules, _ = load_rules(spec.overlays)
    if not rules:
        return
    ledger = ledger_path(spec.store)
    missing = ungated_rules(read_decisions(ledger), [(r.id, r.sha256()) for r in rules], suite_sha256=bundle.sha256,
                            capture_sha256=fast.sha256 if fast else None)
    if not missing:
        return
    if not spec.unverified_overlays:
        raise FlowError(f"overlay rules {spec.overlays} are not gated for this {'capture' if fast else 'suite'} "
                        f"({ledger}): {'; '.join(missing)}. Run `jex overlays gate` on a run of this suite and "
                        "engine first, or pass --unverified-overlays (the report and samples then mark them)")
    run.overlays_unverified = True
    print(f"WARNING: applying UNVERIFIED overlays (--unverified-overlays): {'; '.join(missing)}")


def record_campaign(spec: CampaignSpec, run_dir: Path, s: FinishedCampaign, *, unverified: bool) -> None:
    """One ledger entry per finished campaign run: its suite, model, coverage and index (what the
    reopen conditions of earlier decisions are evaluated against)."""
    fp = s.fast_pass.engine
    name, params = model_facts(spec.engine)
    decision = Decision(kind="campaign", subject=run_dir.name, status="UNVERIFIED" if unverified else "DONE",
                        source=str(run_dir.resolve()), date=now(), suite_sha256=s.bundle.sha256,
                        model=sha256_json({"weights": fp.weights_sha256, "tokenizer": fp.tokenizer_sha256}
                                          if fp.weights_sha256 else {"served": [fp.endpoint, fp.served_model,
                                                                                fp.served_revision]}),
                        model_name=name, model_params=params, coverage=spec.coverage, index=s.score.full)
    if append_decisions(ledger_path(spec.store), [decision]):
        print(f"ledger: campaign recorded in {ledger_path(spec.store)}")


def log_to_mlflow(spec: CampaignSpec, run_dir: Path) -> None:
    """The campaign's `mlflow` option: its finished run logged to MLflow after the report (`jex export mlflow`,
    idempotent). A refusal is a warning: the run folder is complete, and `jex export mlflow` logs it later."""
    if spec.mlflow.tracking_uri is None:
        return
    from jex.tasks.outputs.interop.mlflow_run import export_mlflow

    try:
        run_id = export_mlflow([run_dir], spec.mlflow)[0]
    except JexError as e:
        print(f"WARNING: the run is not logged to MLflow: {e} (later: jex export mlflow {run_dir} --tracking-uri "
              f"{spec.mlflow.tracking_uri} --experiment {spec.mlflow.experiment})")
        return
    print(f"logged to MLflow ({spec.mlflow.tracking_uri}, experiment {spec.mlflow.experiment}): run {run_id}")


def run_errors(s: FinishedCampaign) -> dict[str, int]:
    """Every error counter of a run: the fold's (fast pass and reason) and the generate stage's, prefixed."""
    generated: dict[str, int] = {} if s.generate is None else {
        "generate_context_refusals": s.generate.context_refusals, "generate_batch_errors": s.generate.batch_errors}
    return {**s.fold.errors, **generated}


def enforce_audit(spec: CampaignSpec, summaries: FinishedCampaign) -> None:
    """After the report is written: fail the run if the spec requires zero errors or a reference
    agreement that this run does not have."""
    from jex.tasks.probabilities.fold import require_zero

    if spec.require_zero_errors:
        require_zero(run_errors(summaries))
    audit = summaries.score.reference_agreement
    if spec.reference_min_agreement is not None and (audit is None or audit < spec.reference_min_agreement):
        shown = "none (no row compared)" if audit is None else f"{audit:.4f}"
        raise FlowError(f"reference agreement {shown} is below reference_min_agreement "
                        f"{spec.reference_min_agreement} (see the reference audit in report.md)")


def publish_machines(run_dir: Path, machines: MachinesDoc) -> None:
    """`machines.json` in the run folder and the machines section as a Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact

    write_json(run_dir / "machines.json", machines.model_dump(mode="json"))
    try:
        create_markdown_artifact(markdown="\n".join(machines_section(machines)), key="campaign-machines",
                                 description=f"machines of {run_dir.name}")
    except Exception as e:  # noqa: BLE001 - the JSON is written; a display failure must not hide the run's own error
        print(f"could not publish the machines artifact: {e}")


def check_stages_held(spec: CampaignSpec, run_dir: Path, *, redo: list[StageName], recompute: bool) -> None:
    """Refuse (`StoresLacking`) to compute again a stage the run folder records but the campaign's store
    does not hold, unless `recompute`; stages in `redo` are computed again on purpose."""
    search = find_run_store(run_dir, given=spec.store)
    missing = search.missing(but=frozenset(redo))
    if missing and not recompute:
        raise search.refusal(missing)
    if missing:
        print(f"recompute: {sorted(missing)} are not in the store {spec.store}: computing them again")


def resume_spec(run_dir: str | Path, *, store: str | Path | None = None) -> CampaignSpec:
    """The campaign of a run folder, to go on with from any working folder or machine: its run folders
    where the run folder is now, its store the one that holds its recorded stages (`find_run_store`:
    `store` when given; else the recorded one, the one beside the run folder, ...)."""
    spec = load_spec(run_dir)
    run_dir = Path(run_dir).absolute()
    search = find_run_store(run_dir, given=store, recorded=spec.store)
    return spec.model_copy(update={"out": str(run_dir.parent), "store": str(search.store)})


def retire_stages(run_dir: Path, stages: list[StageName]) -> list[str]:
    """Rename the stage folders the last run of this campaign used for `stages` (nothing is deleted).

    An engine stage computes only its failed rows again: its folder is kept as it is when no row failed
    (its shards are verified and batch invariant: computing them again would give the same bytes), and
    with failed rows it leaves its shards to a fresh folder under its key (`carry_failed_rows`), so the
    engine gets those rows alone."""
    from jex.tasks.store import carry_failed_rows, holds_failed_rows

    done = RunStages.read(run_dir).root
    retired = []
    for name in stages:
        folder = Path(done[name].folder) if name in done else Path()
        if name in ENGINE_STAGES and folder.is_dir() and not holds_failed_rows(folder):
            print(f"retry: {name} has no failed row: its stage folder is kept, no engine call")
            continue
        if folder.name and folder.exists():
            stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6:06d}"
            target = folder.with_name(f"{folder.name}.retired-{stamp}")
            folder.rename(target)
            if carried := carry_failed_rows(target, folder):
                print(f"retry: {name} computes only its {carried} failed row(s) again")
            retired.append(str(target))
    return retired


def upload_to_s3(s3: S3Store | None, run_dir: Path, summaries: CampaignSummaries, store: str) -> None:
    """With an S3 store (`s3_store`: JEX_STORE__S3_BUCKET set), copy the stage folders and the run folder
    to S3 (verified)."""
    if s3 is None:
        return
    from jex.infra.s3 import push_campaign

    manifest = push_campaign(s3, run_dir, summaries.done(), Path(store))
    print(f"uploaded {sum(o.uploaded for o in manifest.objects)} of {len(manifest.objects)} objects to "
          f"s3://{manifest.bucket}/{manifest.prefix}")


class NotStored(LookupError):
    """A stage of the campaign is not in the store (`stored_run`): the flow must run."""


def stored_summary(store: str, name: str, inputs: StageInputs) -> StageSummary:
    """The summary of stage `name` (a CampaignSummaries field) for `inputs`, from the store's complete
    stage folder of their key; NotStored if there is none."""
    if not LocalStore(store).holds(inputs.stage, inputs.key()):
        raise NotStored(name)
    return LocalStore(store).stage(inputs.stage, inputs.key()).read(CampaignSummaries.summary_type(name))


def stored_run(spec: CampaignSpec, settings: JexSettings) -> Path | None:
    """The run folder of `spec` when a flow run would find everything cached: every stage in the store
    under the keys the flow would compute, the folder's report rendered from them, no S3 to upload to.
    Found with the flow's own composition (`capture_stages`, `decision_stages`) looking stages up, so no
    Prefect API is needed. A run that fails the audit settings fails here as in the flow. None otherwise."""
    from jex.flows.machines.runners import InProcessRunner
    from jex.tasks.outputs.run_folder import rendered, report_key

    spec = spec.located()
    run_dir = spec.run_dir()
    if settings.store.s3_bucket or not (run_dir / CAMPAIGN_FILE).exists():
        return None
    run = CampaignRun(spec, run_dir, InProcessRunner(), stored_only=True)
    try:
        capture_stages(run)
        decision_stages(run)
    except NotStored:
        return None
    if not rendered(run_dir, report_key(run_dir, run.summaries, spec)):
        return None
    enforce_audit(spec, run.summaries.finished())
    print(f"every stage stored: nothing to run (report: {run_dir / 'report.md'})")
    log_to_mlflow(spec, run_dir)
    return run_dir


def run_campaign(spec: CampaignSpec, *, recompute: bool = False, redo: list[StageName] | None = None) -> Path:
    """Run the flow in this process (Prefect's local API unless PREFECT_API_URL is set)."""
    return Path(campaign(spec, redo=redo, recompute=recompute))
