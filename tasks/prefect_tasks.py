"""Thin Prefect wrappers: caching, retries and progress artifacts around the stage functions.

The cache key of every task is its stage's store key (`StoreKey`: the same `CachedStage.key` that
names the stage folder), so Prefect shows a re-run stage as Cached and never serves another model's
capture. The stages are also idempotent on the store: if Prefect's cache is cold (a new
PREFECT_HOME) they return the stored summary without loading an engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.context import TaskRunContext

from jex.progress import shard_progress
from jex.tasks import cpu_stages
from jex.tasks.cached_stage import CachedStage
from jex.tasks.capture import stages
from jex.tasks.capture.engine_pool import EngineSpec
from jex.tasks.capture.spec_proof import proof_gate_stage
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    CampaignSummaries,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    OverlaySummary,
    PartialSummary,
    ReasonSummary,
    ScoreSummary,
    StageSummary,
)
from jex.tasks.store import LocalStore


@dataclass
class StoreKey(CachePolicy):
    """Prefect's cache key for a stage task: the stage's store key, from the task's inputs, and which
    store holds it (a campaign on a fresh store must not be served another store's folders)."""

    stage: CachedStage[Any] | None = None
    stage_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """The stage's inputs from the task's, where they differ (the overlay task reads its rule file)."""

    def compute_key(self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        assert self.stage is not None
        given = {k: v for k, v in inputs.items() if k != "store"}
        where = hashlib.sha256(str(Path(inputs["store"]).resolve()).encode()).hexdigest()[:8]
        return f"{self.stage.name}-{self.stage.key(**(self.stage_inputs or dict)(given))}-{where}"


def cached(stage: CachedStage[Any], stage_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
           ) -> dict[str, Any]:
    return {"cache_policy": StoreKey(stage=stage, stage_inputs=stage_inputs), "persist_result": True,
            "cache_expiration": None}


def _overlay_inputs(given: dict[str, Any]) -> dict[str, Any]:
    from jex.overlays.loading import load_rules

    rules, sha = load_rules(given["rules_file"])
    return {"calibrated": given["calibrated"], "rules": rules, "rules_sha256": sha}


def _progress(stage: str):
    """Terminal bar plus a Prefect progress artifact, updated per shard."""
    state: dict[str, Any] = {}

    def update(name: str, done: int, total: int) -> None:
        shard_progress(name, done, total)
        pct = 100.0 * done / max(total, 1)
        try:
            if "id" not in state:
                state["id"] = create_progress_artifact(progress=pct, key=f"{stage.replace('_', '-')}-progress",
                                                       description=f"{stage}: shards done")
            else:
                update_progress_artifact(artifact_id=state["id"], progress=pct)
        except Exception:  # noqa: BLE001 - progress display must never fail a stage
            pass

    return update


def _complete(out: StageSummary | PartialSummary) -> Any:
    if isinstance(out, PartialSummary):
        raise RuntimeError(f"{out.stage}: shards are missing after this process's share")
    return out


@task(name="bundle", **cached(stages.bundle_stage))
def bundle_task(suite: str, store: str, reference: str | None = None) -> BundleSummary:
    return stages.bundle_stage(LocalStore(store), suite=suite, reference=reference)


@task(name="fast_pass", retries=1, **cached(stages.fast_pass_stage))
def fast_pass_task(bundle: BundleSummary, engine: EngineSpec, store: str, shard_rows: int,
                   engine_fp: dict[str, Any] | None = None) -> FastPassSummary:
    return _complete(stages.fast_pass_stage.run(LocalStore(store), bundle=bundle, engine=engine, shard_rows=shard_rows,
                                                progress=_progress("fast_pass"), engine_fp=engine_fp))


@task(name="gate", **cached(cpu_stages.gate_stage))
def gate_task(bundle: BundleSummary, fast: FastPassSummary, store: str, coverage: float,
              per_catalog_cap: float | None) -> GateSummary:
    return cpu_stages.gate_stage(LocalStore(store), bundle=bundle, fast=fast, coverage=coverage,
                                 per_catalog_cap=per_catalog_cap)


@task(name="reason", retries=1, **cached(stages.reason_stage))
def reason_task(bundle: BundleSummary, gate: GateSummary, engine: EngineSpec, store: str, max_tokens: int,
                shard_rows: int, engine_fp: dict[str, Any] | None = None) -> ReasonSummary:
    return _complete(stages.reason_stage.run(LocalStore(store), bundle=bundle, gate=gate, engine=engine,
                                             max_tokens=max_tokens, shard_rows=shard_rows,
                                             progress=_progress("reason"), engine_fp=engine_fp))


@task(name="spec_proof_gate", **cached(proof_gate_stage))
def proof_gate_task(bundle: BundleSummary, gate: GateSummary, store: str, rows: int) -> GateSummary:
    return proof_gate_stage(LocalStore(store), bundle=bundle, gate=gate, rows=rows)


@task(name="fold", **cached(cpu_stages.fold_stage))
def fold_task(bundle: BundleSummary, fast: FastPassSummary, gate: GateSummary, reason: ReasonSummary, store: str,
              rule: str, weight: float, draws: int, seed: int) -> FoldSummary:
    return cpu_stages.fold_stage(LocalStore(store), bundle=bundle, fast=fast, gate=gate, reason=reason, rule=rule,
                                 weight=weight, draws=draws, seed=seed)


@task(name="calibrate", **cached(cpu_stages.calibrate_stage))
def calibrate_task(bundle: BundleSummary, fold: FoldSummary, store: str, folds: int) -> CalibrateSummary:
    return cpu_stages.calibrate_stage(LocalStore(store), bundle=bundle, fold=fold, folds=folds)


@task(name="overlay", **cached(cpu_stages.overlay_stage, _overlay_inputs))
def overlay_task(calibrated: CalibrateSummary, store: str, rules_file: str | None) -> OverlaySummary:
    return cpu_stages.overlay_stage(LocalStore(store), **_overlay_inputs({"calibrated": calibrated,
                                                                          "rules_file": rules_file}))


@task(name="score", **cached(cpu_stages.score_stage))
def score_task(bundle: BundleSummary, overlay: OverlaySummary, fold: FoldSummary, store: str, draws: int,
               seed: int) -> ScoreSummary:
    return cpu_stages.score_stage(LocalStore(store), bundle=bundle, overlay=overlay, fold=fold, draws=draws,
                                  seed=seed)


@task(name="report", cache_policy=NO_CACHE)
def report_task(run_dir: str, summaries: CampaignSummaries, spec: dict[str, Any], timings: dict[str, float],
                machines: dict[str, Any] | None = None) -> str:
    from jex.tasks.outputs.run_folder import write_run_folder

    report = write_run_folder(Path(run_dir), summaries, spec, timings, machines)
    publish_report(report, Path(run_dir))
    return str(Path(run_dir) / "report.md")


def publish_report(report: str, run_dir: Path) -> None:
    """The report and the per-catalog table as Prefect artifacts, so the UI shows them."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from jex.fileio import read_json

    create_markdown_artifact(markdown=report, key="campaign-report", description=f"report of {run_dir.name}")
    fold = read_json(run_dir / "fold.json")
    score = read_json(run_dir / "score.json")
    table = [{"catalog": c, "scoring": v["kind"], "n": v["n"], "acc": round(v["acc"], 4),
              "value": round(v["value"], 4), "skill": round(v["skill"], 4),
              "ci_low": round(v["ci"][0], 4), "ci_high": round(v["ci"][1], 4),
              "gated": fold["catalogs"][c]["gated"], "fixed": fold["catalogs"][c]["fixed"],
              "flipped": fold["catalogs"][c]["flipped"]} for c, v in score["catalogs"].items()]
    create_table_artifact(table=table, key="campaign-catalogs", description=f"per-catalog results of {run_dir.name}")
    audit = score.get("reference_audit")
    if audit:
        rows = [{"predictions": name, **{k: a[k] for k in ("compared", "agree", "flips", "argmax_agreement",
                                                          "mean_abs_dp", "p95_abs_dp", "max_abs_dp")}}
                for name, a in audit.items()]
        rows += [{"predictions": f"final: {c}", **v} for c, v in audit["final"]["catalogs"].items()]
        create_table_artifact(table=rows, key="campaign-reference-audit",
                              description=f"agreement of {run_dir.name} with the bundle's reference rows")
