"""Thin Prefect wrappers: caching, retries and progress artifacts around the stage functions.

The cache key of every task is the stage's own content key (inputs' sha256s, parameters, engine
fingerprint, stage version), so Prefect shows a re-run stage as Cached and never serves another
model's capture. The stage functions are also idempotent on the store: if Prefect's cache is cold
(a new PREFECT_HOME) they return the stored summary without loading an engine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from jex.tasks import cpu_stages
from jex.tasks.capture import stages
from jex.tasks.capture.engine_pool import EngineSpec, fingerprint
from jex.tasks.keys import STAGE_VERSIONS
from jex.tasks.store import LocalStore


def _key(context: Any, params: dict[str, Any]) -> str:
    name = context.task.name
    doc = {"task": name, "version": STAGE_VERSIONS.get(name), "params": params}
    if isinstance(params.get("engine"), EngineSpec):
        doc["engine_fingerprint"] = params.get("engine_fp") or fingerprint(params["engine"])
    return f"{name}-" + hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


CACHED = {"cache_key_fn": _key, "persist_result": True, "cache_expiration": None}


def _progress(stage: str):
    """Terminal bar plus a Prefect progress artifact, updated per shard."""
    state: dict[str, Any] = {}

    def update(name: str, done: int, total: int) -> None:
        stages.terminal_progress(name, done, total)
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


@task(name="bundle", **CACHED)
def bundle_task(suite: str, store: str, reference: str | None = None) -> dict[str, Any]:
    return stages.bundle_stage(suite, LocalStore(store), reference=reference)


@task(name="fast_pass", retries=1, **CACHED)
def fast_pass_task(bundle: dict[str, Any], engine: EngineSpec, store: str, shard_rows: int,
                   engine_fp: dict[str, Any] | None = None) -> dict[str, Any]:
    return stages.fast_pass_stage(bundle, engine, LocalStore(store), shard_rows=shard_rows,
                                  progress=_progress("fast_pass"), engine_fp=engine_fp)


@task(name="gate", **CACHED)
def gate_task(bundle: dict[str, Any], fast: dict[str, Any], store: str, coverage: float,
              per_catalog_cap: float | None) -> dict[str, Any]:
    return cpu_stages.gate_stage(bundle, fast, LocalStore(store), coverage=coverage, per_catalog_cap=per_catalog_cap)


@task(name="reason", retries=1, **CACHED)
def reason_task(bundle: dict[str, Any], gate: dict[str, Any], engine: EngineSpec, store: str, max_tokens: int,
                shard_rows: int, engine_fp: dict[str, Any] | None = None) -> dict[str, Any]:
    return stages.reason_stage(bundle, gate, engine, LocalStore(store), max_tokens=max_tokens, shard_rows=shard_rows,
                               progress=_progress("reason"), engine_fp=engine_fp)


@task(name="spec_proof_gate", **CACHED)
def proof_gate_task(bundle: dict[str, Any], gate: dict[str, Any], store: str, rows: int) -> dict[str, Any]:
    from jex.tasks.capture.spec_proof import proof_gate_stage

    return proof_gate_stage(bundle, gate, LocalStore(store), rows=rows)


@task(name="fold", **CACHED)
def fold_task(bundle: dict[str, Any], fast: dict[str, Any], gate: dict[str, Any], reason: dict[str, Any], store: str,
              rule: str, weight: float, draws: int, seed: int) -> dict[str, Any]:
    return cpu_stages.fold_stage(bundle, fast, gate, reason, LocalStore(store), rule=rule,  # type: ignore[arg-type]
                                 weight=weight, draws=draws, seed=seed)


@task(name="calibrate", **CACHED)
def calibrate_task(bundle: dict[str, Any], fold: dict[str, Any], store: str, folds: int) -> dict[str, Any]:
    return cpu_stages.calibrate_stage(bundle, fold, LocalStore(store), folds=folds)


@task(name="overlay", **CACHED)
def overlay_task(calibrated: dict[str, Any], store: str, rules_file: str | None) -> dict[str, Any]:
    from jex.overlays.loading import load_rules

    rules, sha = load_rules(rules_file)
    return cpu_stages.overlay_stage(calibrated, LocalStore(store), rules=rules, rules_sha256=sha)


@task(name="score", **CACHED)
def score_task(bundle: dict[str, Any], overlay: dict[str, Any], fold: dict[str, Any], store: str, draws: int,
               seed: int) -> dict[str, Any]:
    return cpu_stages.score_stage(bundle, overlay, fold, LocalStore(store), draws=draws, seed=seed)


@task(name="report", cache_policy=NO_CACHE)
def report_task(run_dir: str, summaries: dict[str, Any], spec: dict[str, Any], timings: dict[str, float],
                machines: dict[str, Any] | None = None) -> str:
    from jex.tasks.outputs.run_folder import write_run_folder

    report = write_run_folder(Path(run_dir), summaries, spec, timings, machines)
    publish_report(report, Path(run_dir))
    return str(Path(run_dir) / "report.md")


def publish_report(report: str, run_dir: Path) -> None:
    """The report and the per-catalog table as Prefect artifacts, so the UI shows them."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from jex.tasks.cpu_stages import read_json

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
