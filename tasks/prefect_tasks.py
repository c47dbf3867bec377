"""Thin Prefect wrappers: caching, retries and progress artifacts around the stage functions.

Every stage task takes its stage's inputs record (`tasks/inputs.py`) and the store; its cache key is
the record's key (`StoreKey`: the same key that names the stage folder), so Prefect shows a re-run
stage as Cached and never serves another model's capture. The stages are also idempotent on the
store: if Prefect's cache is cold (a new PREFECT_HOME) they return the stored summary without loading
an engine.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.context import TaskRunContext
from prefect.states import State

from jex.engine.types import EngineError
from jex.progress import shard_progress
from jex.tasks import decision_stages
from jex.tasks.campaign_spec import CampaignSpec
from jex.tasks.capture import stages
from jex.tasks.capture.spec_proof import proof_sample_stage
from jex.tasks.inputs import (
    BundleInputs,
    CalibrateInputs,
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
from jex.tasks.outputs.report import MachinesSection, RunDocs
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    CampaignSummaries,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    GenerateSummary,
    OverlaySummary,
    PartialSummary,
    ReasonSummary,
    ScoreSummary,
    StageSummary,
)
from jex.tasks.store import LocalStore


@dataclass
class StoreKey(CachePolicy):
    """Prefect's cache key for a stage task: the key of the task's inputs record (the key that names
    the stage folder) and which store holds it (a campaign on a fresh store must not be served
    another store's folders)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        stage_inputs: StageInputs = inputs["inputs"]
        where = hashlib.sha256(str(Path(inputs["store"]).resolve()).encode()).hexdigest()[:8]
        return f"{stage_inputs.stage}-{stage_inputs.key()}-{where}"


CACHED: dict[str, Any] = {"cache_policy": StoreKey(), "persist_result": True, "cache_expiration": None}
"""Every stage task caches on its inputs' key (`StoreKey`), for ever (the store decides what exists)."""


def progress_artifact(stage: str) -> Callable[[str, int, int], None]:
    """A shard-progress callback `(name, done, total)`: the terminal bar plus the Prefect progress
    artifact `STAGE-progress` (one per call of this function), updated per call; thread-safe (a
    fleet's machines report from their own task runs)."""
    state: dict[str, Any] = {}
    lock = threading.Lock()

    def update(name: str, done: int, total: int) -> None:
        shard_progress(name, done, total)
        pct = 100.0 * done / max(total, 1)
        try:
            with lock:
                if "id" in state:
                    update_progress_artifact(artifact_id=state["id"], progress=pct)
                    return
                state["id"] = create_progress_artifact(progress=pct, key=f"{stage.replace('_', '-')}-progress",
                                                       description=f"{stage}: shards done")
        except Exception:  # noqa: BLE001 - progress display must never fail a stage
            pass

    return update


def _complete(out: StageSummary | PartialSummary) -> Any:
    if isinstance(out, PartialSummary):
        raise RuntimeError(f"{out.stage}: shards are missing after this process's share")
    return out


@task(name="bundle", **CACHED)
def bundle_task(inputs: BundleInputs, store: str) -> BundleSummary:
    return stages.bundle_stage(LocalStore(store), inputs)


def recoverable(task: Any, task_run: Any, state: State[Any]) -> bool:
    """The engine tasks' retry condition (Prefect's `retry_condition_fn`): only a recoverable engine error
    (`EngineError`) is tried again; a dead engine (`EngineDeadError`, released where it died), a user's
    error or a bug is not."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(error, EngineError)


ENGINE_RETRIES: dict[str, Any] = {"retries": 1, "retry_condition_fn": recoverable}
"""How the engine stage tasks retry: once, and only what can recover."""


@task(name="fast_pass", **ENGINE_RETRIES, **CACHED)
def fast_pass_task(inputs: FastPassInputs, store: str) -> FastPassSummary:
    return _complete(stages.fast_pass_stage.run(LocalStore(store), inputs,
                                                share=stages.ShardShare(progress=progress_artifact("fast_pass"))))


@task(name="gate", **CACHED)
def gate_task(inputs: GateInputs, store: str) -> GateSummary:
    return decision_stages.gate_stage(LocalStore(store), inputs)


@task(name="reason", **ENGINE_RETRIES, **CACHED)
def reason_task(inputs: ReasonInputs, store: str) -> ReasonSummary:
    return _complete(stages.reason_stage.run(LocalStore(store), inputs,
                                             share=stages.ShardShare(progress=progress_artifact("reason"))))


@task(name="generate", **ENGINE_RETRIES, **CACHED)
def generate_task(inputs: GenerateInputs, store: str) -> GenerateSummary:
    return _complete(stages.generate_stage.run(LocalStore(store), inputs,
                                               share=stages.ShardShare(progress=progress_artifact("generate"))))


@task(name="spec_proof_sample", **CACHED)
def proof_sample_task(inputs: ProofSampleInputs, store: str) -> GateSummary:
    return proof_sample_stage(LocalStore(store), inputs)


@task(name="fold", **CACHED)
def fold_task(inputs: FoldInputs, store: str) -> FoldSummary:
    return decision_stages.fold_stage(LocalStore(store), inputs)


@task(name="calibrate", **CACHED)
def calibrate_task(inputs: CalibrateInputs, store: str) -> CalibrateSummary:
    return decision_stages.calibrate_stage(LocalStore(store), inputs)


@task(name="overlay", **CACHED)
def overlay_task(inputs: OverlayInputs, store: str) -> OverlaySummary:
    return decision_stages.overlay_stage(LocalStore(store), inputs)


@task(name="score", **CACHED)
def score_task(inputs: ScoreInputs, store: str) -> ScoreSummary:
    return decision_stages.score_stage(LocalStore(store), inputs)


@task(name="report", cache_policy=NO_CACHE)
def report_task(run_dir: str, summaries: CampaignSummaries, spec: CampaignSpec, timings: dict[str, float],
                machines: MachinesSection | None = None) -> str:
    from jex.tasks.outputs.run_folder import (
        REPORT_MARKER,
        mark_rendered,
        rendered,
        report_key,
        run_docs,
        write_run_folder,
    )

    folder = Path(run_dir)
    key = report_key(folder, summaries, spec)
    if rendered(folder, key):  # an unchanged run: the report of these stages is in the folder already
        print(f"report: cached ({key})")
        return str(folder / "report.md")
    (folder / REPORT_MARKER).unlink(missing_ok=True)
    report = write_run_folder(folder, summaries, spec, timings, machines)
    publish_report(report, folder, run_docs(summaries))
    mark_rendered(folder, key)
    return str(folder / "report.md")


def publish_report(report: str, run_dir: Path, docs: RunDocs) -> None:
    """The report (its plots inlined: the UI cannot open the run folder's files) and the per-catalog
    table as Prefect artifacts, so the UI shows them."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from jex.tasks.outputs.inline_images import inline_images

    create_markdown_artifact(markdown=inline_images(report, run_dir), key="campaign-report",
                             description=f"report of {run_dir.name}")
    fold = docs.fold.catalogs
    table = [{"catalog": c, "scoring": v.kind, "n": v.n, "acc": round(v.acc, 4),
              "value": round(v.value, 4), "skill": round(v.skill, 4),
              "ci_low": round(v.ci[0], 4), "ci_high": round(v.ci[1], 4),
              "gated": fold[c].gated if c in fold else None, "fixed": fold[c].fixed if c in fold else None,
              "flipped": fold[c].flipped if c in fold else None}  # a generative catalog is not folded
             for c, v in docs.policy.catalogs.items()]
    create_table_artifact(table=table, key="campaign-catalogs", description=f"per-catalog results of {run_dir.name}")
    audit = docs.policy.reference_audit
    if audit:
        rows = [{"predictions": name, **a.model_dump(include={"compared", "agree", "flips", "argmax_agreement",
                                                              "mean_abs_dp", "p95_abs_dp", "max_abs_dp"})}
                for name, a in (("fast_pass", audit.fast_pass), ("final", audit.final))]
        rows += [{"predictions": f"final: {c}", **v.model_dump()} for c, v in audit.final.catalogs.items()]
        create_table_artifact(table=rows, key="campaign-reference-audit",
                              description=f"agreement of {run_dir.name} with the bundle's reference rows")
