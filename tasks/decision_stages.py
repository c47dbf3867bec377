"""The decision stages: what turns the engine's readouts into choices and a score, on the CPU with no
engine: gate, fold, calibrate, overlay, score; keyed and stored like the engine stages
(`tasks/capture/stages.py`). The flow runs the coverage gate among its capture stages (it picks the rows
the reason stage reads) and the other four as `decision_stages` (`flows/campaign.py`).

Each is a `CachedStage` over its inputs record (`tasks/inputs.py`): call it with the store and the
record, or the record's fields as keywords, e.g. `gate_stage(store, bundle=bundle, fast=fast, coverage=0.1)`.
"""

from __future__ import annotations

import polars as pl

from jex.fileio import sha256_file
from jex.numerics import question_folds
from jex.overlays.apply import apply_overlays, reversibility_check
from jex.tasks.bundle.reading import scored_suite
from jex.tasks.bundle.suite_table import FAST_PASS_SCORING_COLUMNS, SuiteTable
from jex.tasks.cached_stage import CachedStage
from jex.tasks.documents import FoldDoc, FoldRuleParams, write_doc
from jex.tasks.inputs import CalibrateInputs, FoldInputs, GateInputs, OverlayInputs, ScoreInputs
from jex.tasks.probabilities.calibrate import calibrate
from jex.tasks.probabilities.coverage_gate import coverage_gate, margins
from jex.tasks.probabilities.fold import error_counters, error_rows, failed_rows, fold_counters, fold_predictions
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    GenerateSummary,
    OverlaySummary,
    ScoreSummary,
)
from jex.tasks.scoring.reference_audit import bundle_reference, reference_audit
from jex.tasks.scoring.score import score_with_ci
from jex.tasks.scoring.verdicts import generation_verdicts
from jex.tasks.store import LocalStore, StageDir, write_parquet


def _choices(bundle: BundleSummary) -> SuiteTable:
    """The bundle's multiple-choice catalogs and rows: what gate, fold and calibration decide on."""
    return scored_suite(bundle).multiple_choice()


def _panel(bundle: BundleSummary, fast: FastPassSummary) -> pl.DataFrame:
    rows = _choices(bundle).rows
    capture = pl.read_parquet(fast.capture)
    return rows.join(capture, on="run_id", how="left", maintain_order="left")


# -- gate ------------------------------------------------------------------------------------------
def _gate(out: StageDir, store: LocalStore, inputs: GateInputs) -> GateSummary:
    """Gate the panel; with `sample_every` = k, only a stratified sample is gated: the questions whose
    crc32(question_id) % k == 0 (about 1/k of every catalog, whole clusters). Rows of loglikelihood and
    verbatim catalogs are never gated (`CatalogSpec.final_at_fast_pass`): `coverage` is a share of the rest."""
    coverage, sample_every = inputs.coverage, inputs.sample_every
    panel = _panel(inputs.bundle, inputs.fast)
    final = [c.id for c in _choices(inputs.bundle).spec.catalogs if c.final_at_fast_pass]
    if final:  # loglikelihood and verbatim catalogs: the fast pass's answer is final (CatalogSpec)
        panel = panel.filter(~pl.col("catalog").is_in(final))
    if sample_every:
        keep = question_folds(panel["question_id"].to_list(), sample_every) == 0
        panel = panel.filter(pl.Series(keep))
    gated = coverage_gate(panel, coverage=coverage, per_catalog_cap=inputs.per_catalog_cap)
    path = out.path / "gated.parquet"
    write_parquet(gated, path)
    return GateSummary(key=out.key, gated=str(path), sha256=sha256_file(path), rows=gated.height, coverage=coverage,
                       panel_rows=panel.height, max_margin=gated["margin"].max() if gated.height else None)


gate_stage = CachedStage(GateInputs, GateSummary, body=_gate)


# -- fold ------------------------------------------------------------------------------------------
def _fold(out: StageDir, store: LocalStore, inputs: FoldInputs) -> FoldSummary:
    bundle, fast, gate, reason = inputs.bundle, inputs.fast, inputs.gate, inputs.reason
    rule, weight, draws, seed = inputs.rule, inputs.weight, inputs.draws, inputs.seed
    table = _choices(bundle)
    panel = _panel(bundle, fast)
    reasoned = pl.read_parquet(reason.reasoned)
    folded = fold_predictions(panel, reasoned, pl.read_parquet(gate.gated), rule=rule, weight=weight)
    measures = fold_counters(table.rows, folded, reasoned, table.spec, draws=draws, seed=seed)
    doc = FoldDoc(**measures._asdict(), errors=error_counters(fast.errors(), reason.errors(), unmatched=0),
                  error_rows=error_rows(panel, reasoned), rule=FoldRuleParams(rule=rule, weight=weight),
                  rationale_tokens=reason.rationale_tokens, failed_rows=failed_rows(fast, reason))
    write_parquet(folded, out.path / "folded.parquet")
    write_doc(out.path / "fold.json", doc)
    return FoldSummary(key=out.key, folded=str(out.path / "folded.parquet"),
                       sha256=sha256_file(out.path / "folded.parquet"), fold_json=str(out.path / "fold.json"),
                       errors=doc.errors.model_dump())


fold_stage = CachedStage(FoldInputs, FoldSummary, body=_fold)


# -- calibrate -------------------------------------------------------------------------------------
def _calibrate(out: StageDir, store: LocalStore, inputs: CalibrateInputs) -> CalibrateSummary:
    rows = _choices(inputs.bundle).rows
    folded = pl.read_parquet(inputs.fold.folded).join(rows.select("run_id", "catalog", "question_id", "gold"),
                                               on="run_id", how="left", maintain_order="left")
    answered = folded.filter(pl.col("folded_logprobs").is_not_null())
    calibrated, report = calibrate(answered, folds=inputs.folds)
    frame = folded.join(calibrated.select("run_id", "calibrated_logprobs"), on="run_id", how="left",
                        maintain_order="left")
    write_parquet(frame, out.path / "calibrated.parquet")
    write_doc(out.path / "calibration.json", report)
    return CalibrateSummary(key=out.key, calibrated=str(out.path / "calibrated.parquet"),
                            sha256=sha256_file(out.path / "calibrated.parquet"),
                            calibration_json=str(out.path / "calibration.json"))


calibrate_stage = CachedStage(CalibrateInputs, CalibrateSummary, body=_calibrate)


# -- overlay ---------------------------------------------------------------------------------------
def _overlay(out: StageDir, store: LocalStore, inputs: OverlayInputs) -> OverlaySummary:
    rules = inputs.rules
    base = pl.read_parquet(inputs.calibrated.calibrated).with_columns(
        stage=pl.when(pl.col("folded")).then(pl.lit("fold")).otherwise(pl.lit("fast_pass")),
        probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()))
    reversibility_check(base, apply_overlays(base, [])[0])
    frame, applied = apply_overlays(base, rules)
    if inputs.unverified:  # no passed gate record: every row a rule decided says so, as does each rule's record
        frame = frame.with_columns(pl.col("stage").str.replace("^overlay:", "overlay-unverified:"))
        applied = [{**a, "unverified": True} for a in applied]
    predictions = frame.select("run_id", "choice", probs=pl.col("calibrated_logprobs").list.eval(pl.element().exp()),
                               stage="stage")
    if "abstain" in frame.columns:  # only when a rule set it: runs without one keep their bytes
        predictions = predictions.with_columns(frame["abstain"])
    kept = [c for c in FAST_PASS_SCORING_COLUMNS if c in frame.columns]  # lm-eval's per-row scoring, as it is
    predictions = predictions.with_columns(*(frame[c] for c in kept))
    path = out.path / "predictions.parquet"
    write_parquet(predictions, path)
    return OverlaySummary(key=out.key, predictions=str(path), sha256=sha256_file(path), applied=applied)


overlay_stage = CachedStage(OverlayInputs, OverlaySummary, body=_overlay)


# -- score -----------------------------------------------------------------------------------------
def fast_pass_predictions(folded: pl.DataFrame) -> pl.DataFrame:
    """The fast-pass baseline as predictions (run_id, choice, probs and lm-eval's per-row scoring columns)
    from the fold stage's `folded.parquet`: what the baseline score, and a panel's projection, compare with."""
    kept = [c for c in FAST_PASS_SCORING_COLUMNS if c in folded.columns]
    return folded.select("run_id", *kept, choice="fast_choice", probs=pl.col("logprobs").list.eval(pl.element().exp()))


def generative_predictions(bundle: BundleSummary, generated: GenerateSummary, store: LocalStore) -> pl.DataFrame:
    """The generative rows' predictions: run_id, their `exact_match` verdict (`tasks/scoring/verdicts.py`), stage
    `generate`, and their `pass_at_k` when a catalog is scored by it."""
    from jex.tasks.bundle.bundle_file import open_bundle

    verdicts = bundle_verdicts(bundle, generated, store)
    catalogs = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key)).suite_manifest().catalogs
    passes = ["pass_at_k"] if any(c.scoring == "pass_at_k" for c in catalogs) else []
    return verdicts.select("run_id", "exact_match", *passes, stage=pl.lit("generate"))


def bundle_verdicts(bundle: BundleSummary, generated: GenerateSummary, store: LocalStore) -> pl.DataFrame:
    """Every generative row's generation, answers and verdicts (`VERDICT_SCHEMA`), in suite order."""
    from jex.tasks.bundle.bundle_file import open_bundle

    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    return generation_verdicts(opened.generation_rows(), pl.read_parquet(generated.generated),
                               opened.suite_manifest().catalogs)


def _with_generated(predictions: pl.DataFrame, generative: pl.DataFrame | None) -> pl.DataFrame:
    """Multiple-choice predictions followed by the generative rows' verdicts (none: as they are)."""
    if generative is None:
        return predictions
    return pl.concat([predictions, generative.select(pl.col(c) for c in generative.columns
                                                     if c in predictions.columns or c in ("exact_match", "pass_at_k"))],
                     how="diagonal_relaxed")


def _score(out: StageDir, store: LocalStore, inputs: ScoreInputs) -> ScoreSummary:
    bundle, overlay, fold, draws, seed = inputs.bundle, inputs.overlay, inputs.fold, inputs.draws, inputs.seed
    table = scored_suite(bundle)
    generative = generative_predictions(bundle, inputs.generated, store) if inputs.generated else None
    written = _with_generated(pl.read_parquet(overlay.predictions), generative)
    preds = written.select(pl.exclude("stage"))  # run_id, choice, probs[, abstain][, exact_match]
    folded = pl.read_parquet(fold.folded)
    fast = _with_generated(fast_pass_predictions(folded), generative)
    policy = score_with_ci(table.rows, preds, table.spec, draws=draws, seed=seed)
    baseline = score_with_ci(table.rows, fast, table.spec, draws=draws, seed=seed)
    reference = bundle_reference(bundle.bundle, bundle.sha256)
    agreement = None
    if reference is not None:
        pre = folded.select("run_id", pre_margin=margins(folded["logprobs"]))
        final = pl.read_parquet(overlay.predictions).select("run_id", "choice", "probs")
        audit = reference_audit(reference, _choices(bundle).rows, fast=fast.join(pre, on="run_id"),
                                final=final.join(pre, on="run_id", how="left"))
        policy = policy.model_copy(update={"reference_audit": audit})
        agreement = audit.final.argmax_agreement
    write_doc(out.path / "score.json", policy)
    write_doc(out.path / "baseline_score.json", baseline)
    predictions = None
    if generative is not None:  # the run's predictions: the overlay's and the generative rows' verdicts
        predictions = str(out.path / "predictions.parquet")
        write_parquet(written, out.path / "predictions.parquet")
    return ScoreSummary(key=out.key, score_json=str(out.path / "score.json"), predictions=predictions,
                        baseline_json=str(out.path / "baseline_score.json"), full=policy.full,
                        baseline_full=baseline.full, sha256=sha256_file(out.path / "score.json"),
                        reference_agreement=agreement, reference=reference is not None)


score_stage = CachedStage(ScoreInputs, ScoreSummary, body=_score)
