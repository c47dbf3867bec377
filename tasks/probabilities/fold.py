"""Fold: the post-thought readout folded into the fast-pass probabilities, and its dry-run counters.

Rules (documented in docs/stages.md):
    replace   log p = log p_post
    mix       log p = normalise((1 - w) * log p_fast + w * log p_post)   (log-linear pool, weight w)
Rows that were not gated keep their fast-pass probabilities. A gated row without a post-thought
readout (refused) keeps them too and is counted `fold_missing`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import polars as pl

from jex.engine.types import RefusalKind
from jex.errors import JexError
from jex.numerics import argmax, true_mass
from jex.tasks.bundle.suite_table import FAST_PASS_SCORING_COLUMNS, ScoreSpec
from jex.tasks.documents import (
    ErrorCounters,
    ErrorRow,
    FoldCatalog,
    FoldCounters,
    FoldOverall,
    FoldRule,
    Interval,
)
from jex.tasks.records import FailedRow, FastPassErrors, FastPassSummary, ReasonErrors, ReasonSummary
from jex.tasks.scoring.bootstrap_ci import paired_bootstrap_ci
from jex.tasks.scoring.index import catalog_chances, scored_frame, skill_of
from jex.tasks.store import refused


def fold_logprobs(fast: list[float], post: list[float], *, rule: FoldRule, weight: float) -> list[float]:
    if rule == "replace":
        return list(post)
    mixed = [(1 - weight) * a + weight * b for a, b in zip(fast, post, strict=True)]
    top = max(mixed)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in mixed))
    return [x - lse for x in mixed]


def fold_predictions(panel: pl.DataFrame, reasoned: pl.DataFrame, gated: pl.DataFrame, *, rule: FoldRule = "mix",
                     weight: float = 0.5) -> pl.DataFrame:
    """Per row: fast and folded log-probs and choices, and whether the row was gated / folded.

    `panel`: run_id, logprobs (fast pass)[, acc_norm_choice: kept as it is][, choice_loglikelihoods and
    true_options: their `true_mass`], in suite order. `reasoned`: run_id, post_logprobs.
    """
    if not 0 <= weight <= 1:
        raise ValueError(f"fold weight must be in [0, 1], got {weight}")
    unmatched = reasoned.join(panel, on="run_id", how="anti").height + reasoned.join(gated, on="run_id",
                                                                                     how="anti").height
    if unmatched:
        raise ValueError(f"{unmatched} reasoned row(s) are not gated panel rows: the capture and the gate disagree")
    post = dict(zip(reasoned["run_id"].to_list(), reasoned["post_logprobs"].to_list(), strict=True))
    gated_ids = set(gated["run_id"].to_list())
    folded_lp, is_folded = [], []
    for rid, lp in zip(panel["run_id"].to_list(), panel["logprobs"].to_list(), strict=True):
        p = post.get(rid)
        if rid in gated_ids and p is not None and lp is not None:
            folded_lp.append(fold_logprobs(lp, p, rule=rule, weight=weight))
            is_folded.append(True)
        else:
            folded_lp.append(lp)
            is_folded.append(False)
    panel = with_true_mass(panel)
    kept = ["run_id", "logprobs"] + [c for c in FAST_PASS_SCORING_COLUMNS if c in panel.columns]
    return panel.select(kept).with_columns(
        pl.Series("folded_logprobs", folded_lp, dtype=pl.List(pl.Float64)),
        pl.col("run_id").is_in(list(gated_ids)).alias("gated"),
        pl.Series("folded", is_folded, dtype=pl.Boolean),
        pl.Series("fast_choice", [argmax(x) for x in panel["logprobs"].to_list()], dtype=pl.Int32),
        pl.Series("choice", [argmax(x) for x in folded_lp], dtype=pl.Int32))


def with_true_mass(panel: pl.DataFrame) -> pl.DataFrame:
    """The panel with `true_mass` (`jex.numerics.true_mass` of each row's continuation log-likelihoods over
    its true options; null where either is missing) when any row lists true options, else as it is."""
    if "true_options" not in panel.columns or "choice_loglikelihoods" not in panel.columns \
            or panel["true_options"].null_count() == panel.height:
        return panel
    masses = [true_mass(ll, true) if ll is not None and true is not None else None
              for ll, true in zip(panel["choice_loglikelihoods"].to_list(), panel["true_options"].to_list(),
                                  strict=True)]
    return panel.with_columns(pl.Series("true_mass", masses, dtype=pl.Float64))


class FoldMeasures(NamedTuple):
    """What `fold_counters` measures; the fold stage adds the error counters, rule and tokens (`FoldDoc`)."""

    overall: FoldOverall
    catalogs: dict[str, FoldCatalog]
    delta_full_ci: Interval
    delta_legs_ci: dict[str, Interval]


def fold_counters(rows: pl.DataFrame, folded: pl.DataFrame, reasoned: pl.DataFrame, spec: ScoreSpec, *,
                  draws: int, seed: int) -> FoldMeasures:
    """The dry-run counters: overall and per catalog, with the paired bootstrap of the index delta.

    The fold changes choices, so its counters and delta are measured by accuracy whatever each
    catalog's scoring kind (the score stage applies the kinds)."""
    spec = spec.as_accuracy()
    df = rows.join(folded, on="run_id", how="left", maintain_order="left").with_columns(
        fast_ok=(pl.col("fast_choice") == pl.col("gold")).fill_null(False),
        ok=(pl.col("choice") == pl.col("gold")).fill_null(False))
    reasoned_ok = reasoned.filter(pl.col("refusal").is_null()).height

    def counts(d: pl.DataFrame) -> FoldCounters:
        gated = d.filter(pl.col("gated"))
        wrong_before = gated.filter(~pl.col("fast_ok")).height
        fixed = gated.filter(~pl.col("fast_ok") & pl.col("ok")).height
        flipped = gated.filter(pl.col("fast_ok") & ~pl.col("ok")).height
        return FoldCounters(panel_rows=d.height, gated=gated.height, folded=gated.filter(pl.col("folded")).height,
                            fold_missing=gated.filter(~pl.col("folded")).height, fixed=fixed, flipped=flipped,
                            gated_wrong_before=wrong_before, fix_rate=fixed / wrong_before if wrong_before else None,
                            baseline_acc=_mean(d["fast_ok"]), policy_acc=_mean(d["ok"]))

    overall = FoldOverall(**dict(counts(df)), reasoned=reasoned_ok)
    if not spec.catalogs:  # a suite of generative catalogs alone: no choice to fold, so none changes
        return FoldMeasures(overall=overall, catalogs={}, delta_full_ci=(0.0, 0.0), delta_legs_ci={})
    fast = df.select("run_id", choice="fast_choice")
    pol = df.select("run_id", "choice")
    base_frame, pol_frame = scored_frame(rows, fast, spec), scored_frame(rows, pol, spec)
    chance = catalog_chances(base_frame, spec)
    ci = paired_bootstrap_ci(base_frame, pol_frame, spec, chance, draws=draws, seed=seed)
    per_catalog = {}
    for c in spec.catalogs:
        sub = counts(df.filter(pl.col("catalog") == c.id))
        delta = skill_of(sub.policy_acc, chance[c.id]) - skill_of(sub.baseline_acc, chance[c.id])
        per_catalog[c.id] = FoldCatalog(**dict(sub), delta_skill=delta, delta_skill_ci=ci["catalogs"][c.id])
    return FoldMeasures(overall=overall, catalogs=per_catalog, delta_full_ci=_interval(ci["full"]),
                        delta_legs_ci={k: _interval(v) for k, v in ci["legs"].items()})


def _mean(flags: pl.Series) -> float | None:
    """The share of True (None for no rows)."""
    m = flags.mean()
    return None if m is None else float(m)  # type: ignore[arg-type]


def _interval(ci: list[float]) -> Interval:
    lo, hi = ci
    return lo, hi


ERROR_COUNTERS = ("context_refusals", "readout_errors", "unmatched_rows", "key_fallbacks", "batch_errors",
                  "mechanism_failures")


def error_counters(fast: FastPassErrors, reason: ReasonErrors, unmatched: int) -> ErrorCounters:
    """Every error of the capture, disjoint per stage (see `docs/stages.md`); all zero on a clean run.

    context_refusals: prompts that do not fit (fast pass, rationale prompts); readout_errors: fast-pass
    rows not read for another reason; key_fallbacks: fast-pass rows whose labels were read through
    the continuation fallback; batch_errors: rows whose engine batch still failed after retry and
    split (both stages); mechanism_failures: rationales that could not be re-read; unmatched_rows.
    """
    return ErrorCounters(context_refusals=fast["context_refusals"] + reason["context_refusals"],
                         readout_errors=fast["readout_errors"], unmatched_rows=unmatched,
                         key_fallbacks=fast["key_fallbacks"],
                         batch_errors=fast["batch_errors"] + reason["batch_errors"],
                         mechanism_failures=reason["mechanism_failures"])


def failed_rows(fast: FastPassSummary, reason: ReasonSummary) -> dict[str, list[FailedRow]] | None:
    """Every row behind `batch_errors`, by engine stage, as the stage summaries record them (run_id,
    attempts, last error); None when none failed."""
    by_stage = {"fast_pass": fast.failed_rows, "reason": reason.failed_rows}
    return {stage: rows for stage, rows in by_stage.items() if rows} or None


def error_rows(panel: pl.DataFrame, reasoned: pl.DataFrame, limit: int = 50) -> dict[str, list[ErrorRow]]:
    """The rows behind the non-zero counters (first `limit` of each): run_id and why."""
    refusal, batch = pl.col("refusal"), refused(RefusalKind.BATCH_ERROR)
    fast_batch = batch
    picks = {
        "key_fallbacks": panel.filter(pl.col("logprobs").is_not_null() & pl.col("label_mass").is_null())
        .select("run_id", why=pl.lit("labels read through the continuation fallback")),
        "readout_errors": panel.filter(refusal.is_not_null() & ~refused(RefusalKind.CONTEXT) & ~fast_batch)
        .select("run_id", why=refusal),
        "batch_errors": pl.concat([panel.filter(fast_batch).select("run_id", why=pl.format("fast pass: {}", refusal)),
                                   reasoned.filter(batch)
                                   .select("run_id", why=pl.format("reason: {}", refusal))]),
        "mechanism_failures": reasoned.filter(pl.col("finish_reason").is_in(["stop", "length"])
                                              & pl.col("post_logprobs").is_null()
                                              & ~batch)
        .select("run_id", why=refusal.fill_null("no re-read")),
    }
    return {k: [ErrorRow(**r) for r in v.head(limit).to_dicts()] for k, v in picks.items() if v.height}


class ErrorCountersNotZero(JexError):
    """The campaign asked for every error counter to be zero (`require_zero_errors`) and one is not."""


def require_zero(errors: dict[str, int]) -> None:
    """Raise `ErrorCountersNotZero` naming every non-zero counter."""
    bad = {k: v for k, v in errors.items() if v}
    if bad:
        raise ErrorCountersNotZero(f"error counters must all be zero (require_zero_errors): {bad}; "
                                   "see fold.json and report.md for the rows")

