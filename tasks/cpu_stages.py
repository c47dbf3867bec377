"""CPU stages of the campaign: gate, fold, calibrate, overlay, score; keyed and stored like the rest.

Each is a `CachedStage`: call it with the store and its inputs as keywords, e.g.
`gate_stage(store, bundle=bundle, fast=fast, coverage=0.1)`.
"""

from __future__ import annotations

import functools

import polars as pl

from jex.fileio import sha256_file, write_json
from jex.numerics import question_folds
from jex.overlays.apply import apply_overlays, reversibility_check
from jex.overlays.rules import OverlayRuleBase
from jex.tasks.cached_stage import CachedStage
from jex.tasks.keys import stage_key
from jex.tasks.probabilities.calibrate import calibrate
from jex.tasks.probabilities.coverage_gate import coverage_gate, margins
from jex.tasks.probabilities.fold import FoldRule, error_counters, error_rows, fold_counters, fold_predictions
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    OverlaySummary,
    ReasonSummary,
    ScoreSummary,
)
from jex.tasks.scoring.inputs import SuiteTable, load_suite_table
from jex.tasks.scoring.reference_audit import bundle_reference, reference_audit
from jex.tasks.scoring.score import score_with_ci
from jex.tasks.store import LocalStore, StageDir, write_parquet


def _suite(bundle: BundleSummary) -> SuiteTable:
    return _suite_table(bundle.bundle, bundle.sha256)


@functools.lru_cache(maxsize=4)
def _suite_table(path: str, sha256: str) -> SuiteTable:
    """The scored rows of a bundle, read and verified once per process (keyed by content, not path alone)."""
    return load_suite_table(path)


def _panel(bundle: BundleSummary, fast: FastPassSummary) -> pl.DataFrame:
    rows = _suite(bundle).rows
    capture = pl.read_parquet(fast.capture)
    return rows.join(capture, on="run_id", how="left", maintain_order="left")


# -- gate ------------------------------------------------------------------------------------------
def _gate_key(*, fast: FastPassSummary, coverage: float, per_catalog_cap: float | None = None,
              sample_every: int | None = None, **_: object) -> str:
    return stage_key("gate", params={"coverage": coverage, "per_catalog_cap": per_catalog_cap,
                                     "sample_every": sample_every}, inputs={"fast_pass": fast.sha256})


def _gate(out: StageDir, store: LocalStore, *, bundle: BundleSummary, fast: FastPassSummary, coverage: float,
          per_catalog_cap: float | None = None, sample_every: int | None = None) -> GateSummary:
    """Gate the panel; with `sample_every` = k, only a stratified sample is gated: the questions whose
    crc32(question_id) % k == 0 (about 1/k of every catalog, whole clusters)."""
    panel = _panel(bundle, fast)
    if sample_every:
        keep = question_folds(panel["question_id"].to_list(), sample_every) == 0
        panel = panel.filter(pl.Series(keep))
    gated = coverage_gate(panel, coverage=coverage, per_catalog_cap=per_catalog_cap)
    path = out.path / "gated.parquet"
    write_parquet(gated, path)
    return GateSummary(key=out.key, gated=str(path), sha256=sha256_file(path), rows=gated.height, coverage=coverage,
                       panel_rows=panel.height, max_margin=gated["margin"].max() if gated.height else None)


gate_stage = CachedStage("gate", GateSummary, key=_gate_key, body=_gate)


# -- fold ------------------------------------------------------------------------------------------
def _fold_key(*, fast: FastPassSummary, gate: GateSummary, reason: ReasonSummary, rule: FoldRule, weight: float,
              draws: int, seed: int, **_: object) -> str:
    return stage_key("fold", params={"rule": rule, "weight": weight, "draws": draws, "seed": seed},
                     inputs={"fast_pass": fast.sha256, "gate": gate.sha256, "reason": reason.sha256})


def _fold(out: StageDir, store: LocalStore, *, bundle: BundleSummary, fast: FastPassSummary, gate: GateSummary,
          reason: ReasonSummary, rule: FoldRule, weight: float, draws: int, seed: int) -> FoldSummary:
    table = _suite(bundle)
    panel = _panel(bundle, fast)
    reasoned = pl.read_parquet(reason.reasoned)
    folded = fold_predictions(panel, reasoned, pl.read_parquet(gate.gated), rule=rule, weight=weight)
    counters = fold_counters(table.rows, folded, reasoned, table.spec, draws=draws, seed=seed)
    counters["errors"] = error_counters(fast.errors(), reason.errors(), unmatched=0)
    counters["error_rows"] = error_rows(panel, reasoned)
    counters["rule"] = {"rule": rule, "weight": weight}
    counters["rationale_tokens"] = reason.rationale_tokens.model_dump()
    write_parquet(folded, out.path / "folded.parquet")
    write_json(out.path / "fold.json", counters)
    return FoldSummary(key=out.key, folded=str(out.path / "folded.parquet"),
                       sha256=sha256_file(out.path / "folded.parquet"), fold_json=str(out.path / "fold.json"),
                       errors=counters["errors"])


fold_stage = CachedStage("fold", FoldSummary, key=_fold_key, body=_fold)


# -- calibrate -------------------------------------------------------------------------------------
def _calibrate_key(*, fold: FoldSummary, folds: int, **_: object) -> str:
    return stage_key("calibrate", params={"folds": folds}, inputs={"fold": fold.sha256})


def _calibrate(out: StageDir, store: LocalStore, *, bundle: BundleSummary, fold: FoldSummary,
               folds: int) -> CalibrateSummary:
    rows = _suite(bundle).rows
    folded = pl.read_parquet(fold.folded).join(rows.select("run_id", "catalog", "question_id", "gold"),
                                               on="run_id", how="left", maintain_order="left")
    answered = folded.filter(pl.col("folded_logprobs").is_not_null())
    calibrated, report = calibrate(answered, folds=folds)
    frame = folded.join(calibrated.select("run_id", "calibrated_logprobs"), on="run_id", how="left",
                        maintain_order="left")
    write_parquet(frame, out.path / "calibrated.parquet")
    write_json(out.path / "calibration.json", report)
    return CalibrateSummary(key=out.key, calibrated=str(out.path / "calibrated.parquet"),
                            sha256=sha256_file(out.path / "calibrated.parquet"),
                            calibration_json=str(out.path / "calibration.json"))


calibrate_stage = CachedStage("calibrate", CalibrateSummary, key=_calibrate_key, body=_calibrate)


# -- overlay ---------------------------------------------------------------------------------------
def _overlay_key(*, calibrated: CalibrateSummary, rules: list[OverlayRuleBase], rules_sha256: str | None,
                 **_: object) -> str:
    return stage_key("overlay", params={"rules": [r.record() for r in rules]},
                     inputs={"calibrate": calibrated.sha256, "rules": rules_sha256 or "none"})


def _overlay(out: StageDir, store: LocalStore, *, calibrated: CalibrateSummary, rules: list[OverlayRuleBase],
             rules_sha256: str | None) -> OverlaySummary:
    base = pl.read_parquet(calibrated.calibrated).with_columns(
        stage=pl.when(pl.col("folded")).then(pl.lit("fold")).otherwise(pl.lit("fast_pass")),
        probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()))
    reversibility_check(base, apply_overlays(base, [])[0])
    frame, applied = apply_overlays(base, rules)
    predictions = frame.select("run_id", "choice", probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()),
                               stage="stage")
    if "abstain" in frame.columns:  # only when a rule set it: runs without one keep their bytes
        predictions = predictions.with_columns(frame["abstain"])
    path = out.path / "predictions.parquet"
    write_parquet(predictions, path)
    return OverlaySummary(key=out.key, predictions=str(path), sha256=sha256_file(path), applied=applied)


overlay_stage = CachedStage("overlay", OverlaySummary, key=_overlay_key, body=_overlay)


# -- score -----------------------------------------------------------------------------------------
def _score_key(*, bundle: BundleSummary, overlay: OverlaySummary, fold: FoldSummary, draws: int, seed: int,
               **_: object) -> str:
    return stage_key("score", params={"draws": draws, "seed": seed},
                     inputs={"bundle": bundle.sha256, "predictions": overlay.sha256, "fold": fold.sha256})


def _score(out: StageDir, store: LocalStore, *, bundle: BundleSummary, overlay: OverlaySummary, fold: FoldSummary,
           draws: int, seed: int) -> ScoreSummary:
    table = _suite(bundle)
    preds = pl.read_parquet(overlay.predictions).select(pl.exclude("stage"))  # run_id, choice, probs[, abstain]
    folded = pl.read_parquet(fold.folded)
    fast = folded.select("run_id", choice="fast_choice", probs=pl.col("logprobs").list.eval(pl.element().exp()))
    policy = score_with_ci(table.rows, preds, table.spec, draws=draws, seed=seed)
    baseline = score_with_ci(table.rows, fast, table.spec, draws=draws, seed=seed)
    reference = bundle_reference(bundle.bundle, bundle.sha256)
    agreement = None
    if reference is not None:
        pre = folded.select("run_id", pre_margin=margins(folded["logprobs"]))
        final = pl.read_parquet(overlay.predictions).select("run_id", "choice", "probs")
        policy["reference_audit"] = reference_audit(reference, table.rows, fast=fast.join(pre, on="run_id"),
                                                    final=final.join(pre, on="run_id", how="left"))
        agreement = policy["reference_audit"]["final"]["argmax_agreement"]
    write_json(out.path / "score.json", policy)
    write_json(out.path / "baseline_score.json", baseline)
    return ScoreSummary(key=out.key, score_json=str(out.path / "score.json"),
                        baseline_json=str(out.path / "baseline_score.json"), full=policy["full"],
                        baseline_full=baseline["full"], sha256=sha256_file(out.path / "score.json"),
                        reference_agreement=agreement, reference=reference is not None)


score_stage = CachedStage("score", ScoreSummary, key=_score_key, body=_score)
