"""Scoring: chance-normalised skill per catalog, weighted leg indices and the composite.

Definitions (the contract; `docs/suite-and-scoring.md` has them with examples):
    per catalog  scored rows = rows minus exclusions. Each catalog has a scoring kind:
                 accuracy             value = correct / n (a missing or null choice is wrong)
                 acc_norm             value = mean [acc_norm_choice == gold] (lm-eval's length-normalised
                                      choice; a missing one is wrong); `acc_norm` is also reported beside
                                      `acc` for every loglikelihood catalog
                 calibrated_accuracy  value = mean p[gold] (the expected accuracy of the forecast)
                 brier                value = mean over rows of sum_i (p_i - [i = gold])^2
                 log_loss             value = mean -ln max(p[gold], 1e-15)
                 true_mass            value = mean true_mass (the softmax of the options' log-likelihoods
                                      summed over the row's true options: lm-eval's TruthfulQA mc2)
                 exact_match          value = mean exact_match (a generative row's verdict: its extracted
                                      answer equals the reference, as lm-eval's exact_match; a missing
                                      verdict is wrong); `correct` counts the matches
                 maj_at_k             value = mean exact_match, the verdict of the majority answer of a row's
                                      first k samples (lm-eval's take_first_k, majority_vote); as exact_match
                 pass_at_k            value = mean pass_at_k, the unbiased estimator 1 - C(n-c, k) / C(n, k)
                                      of a row's n samples, c of them right (a missing one is 0); `correct`
                                      counts the rows whose primary verdict (first sample) matches
                 A row without the prediction its kind reads (choice; acc_norm_choice; true_mass; probs
                 for the other kinds) is counted `unsupported`: wrong for the accuracy kinds, the uniform
                 forecast for the others (1/k; t/k for true_mass, t the row's true options). A
                 row flagged `abstain` in a catalog that declares the secondary field `abstain` is
                 scored as if it had no prediction and counted `abstained`.
                 chance = the value of the uniform guess: c = the manifest's value or mean 1/k for the
                 accuracy kinds (mean t/k for true_mass); 1 - c for brier; -ln c (manifest) or mean ln k
                 for log_loss; the manifest's value or 0 for the generative kinds (no answer matches by chance).
                 best = 1 for the accuracy kinds, 0 for the losses.
                 skill = (value - chance) / (best - chance); acc (accuracy of the choice) is always kept
    per leg      index = 100 * sum(weight * skill) / sum(weight); raw likewise with acc
    composite    full = sum(leg_weight * leg_index) / sum(leg_weight)

Sums over rows, catalogs and legs are correctly rounded (`math.fsum`, or exact rationals rounded
once), so the result does not depend on summation order: the plain scorer (`tasks/scoring/plain.py`)
reproduces it bit for bit, and `score.py: score_twice` compares the two on every score.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import polars as pl

from jex.tasks.bundle.suite_table import FAST_PASS_SCORING_COLUMNS, ScoreSpec

if TYPE_CHECKING:  # the shape only: the plain scorer shares no code with this one
    from jex.tasks.scoring.plain import PlainCatalogScore, PlainScore

LOG_LOSS_FLOOR = 1e-15
BEST = {"accuracy": 1.0, "acc_norm": 1.0, "calibrated_accuracy": 1.0, "brier": 0.0, "log_loss": 0.0,
        "true_mass": 1.0, "exact_match": 1.0, "maj_at_k": 1.0, "pass_at_k": 1.0}
COUNTED_KINDS = ("accuracy", "acc_norm", "exact_match", "maj_at_k")
VERDICT_KINDS = ("exact_match", "maj_at_k")
"""The generative kinds whose value is the share of rows whose verdict (`exact_match`) matches."""
"""The kinds whose value is a count of correct rows over n (exact integers in the bootstrap)."""


@dataclass(frozen=True)
class CatalogScore:
    n: int
    correct: int
    unsupported: int
    acc: float
    chance: float
    skill: float
    weight: float
    leg: str
    kind: str = "accuracy"
    value: float = 0.0
    abstained: int = 0
    acc_norm: float | None = None
    """lm-eval's length-normalised accuracy (`acc_norm_choice == gold`), for the catalogs that report it."""

    def to_json(self) -> PlainCatalogScore:
        out: PlainCatalogScore = {"n": self.n, "correct": self.correct, "unsupported": self.unsupported,
                                  "acc": self.acc, "chance": self.chance, "skill": self.skill, "weight": self.weight,
                                  "leg": self.leg, "kind": self.kind, "value": self.value, "abstained": self.abstained}
        if self.acc_norm is not None:
            out["acc_norm"] = self.acc_norm
        return out


@dataclass(frozen=True)
class Score:
    full: float
    full_raw: float
    legs: dict[str, dict[str, float]]  # leg -> {"index", "raw"}
    catalogs: dict[str, CatalogScore]

    def to_json(self) -> PlainScore:
        """The plain scorer's shape (`tasks/scoring/plain.py`), to compare the two key by key."""
        return {"full": self.full, "full_raw": self.full_raw,
                "legs": {k: {"index": v["index"], "raw": v["raw"]} for k, v in self.legs.items()},
                "catalogs": {k: v.to_json() for k, v in self.catalogs.items()}}


def skill_of(value: Any, chance: float, best: float = 1.0) -> Any:
    """(value - chance) / (best - chance): 0 at chance, 1 at the best value (floats or arrays)."""
    return (value - chance) / (best - chance)


def aggregate(spec: ScoreSpec, value: dict[str, float], chance: dict[str, float],
              acc: dict[str, float] | None = None) -> tuple[float, float, dict]:
    """Leg indices and the composite from per-catalog values, chances and accuracies (shared by the
    bootstrap, which passes no `acc`: raw is then computed from `value`)."""
    acc = value if acc is None else acc
    legs: dict[str, dict[str, float]] = {}
    for leg in spec.legs:
        cats = [c for c in spec.catalogs if c.leg == leg]
        wsum = math.fsum(c.weight for c in cats)
        legs[leg] = {
            "index": 100.0 * math.fsum(c.weight * skill_of(value[c.id], chance[c.id], BEST[c.scoring])
                                       for c in cats) / wsum,
            "raw": 100.0 * math.fsum(c.weight * acc[c.id] for c in cats) / wsum,
        }
    lsum = math.fsum(spec.legs.values())
    full = math.fsum(w * legs[leg]["index"] for leg, w in spec.legs.items()) / lsum
    full_raw = math.fsum(w * legs[leg]["raw"] for leg, w in spec.legs.items()) / lsum
    return full, full_raw, legs


def scored_frame(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec) -> pl.DataFrame:
    """Suite rows minus exclusions with the predictions joined: `choice`, `probs` (null when the
    predictions carry none or the row abstained in a catalog that declares `abstain`), boolean
    `abstained` and `correct`, and the per-row `value` of the catalog's kind (what the bootstrap
    resamples; the point estimate is summed exactly in `score_predictions`)."""
    excluded = [rid for c in spec.catalogs for rid in c.exclusions]
    cols = ["run_id", "choice"] + [c for c in ("probs", "abstain", "exact_match", "pass_at_k",
                                               *FAST_PASS_SCORING_COLUMNS) if c in predictions.columns]
    frame = (rows.filter(~pl.col("run_id").is_in(excluded))
             .join(predictions.select(cols), on="run_id", how="left", maintain_order="left"))
    for name, dtype in (("true_options", pl.List(pl.Int32)), ("true_mass", pl.Float64), ("exact_match", pl.Boolean),
                        ("pass_at_k", pl.Float64)):
        if name not in frame.columns:
            frame = frame.with_columns(pl.lit(None, dtype=dtype).alias(name))
    frame = frame.with_columns(n_true=pl.col("true_options").list.len().cast(pl.Int32))
    if "probs" not in frame.columns:
        frame = frame.with_columns(probs=pl.lit(None, dtype=pl.List(pl.Float64)))
    if "acc_norm_choice" not in frame.columns:
        frame = frame.with_columns(acc_norm_choice=pl.lit(None, dtype=pl.Int32))
    declared = [c.id for c in spec.catalogs if "abstain" in c.secondary]
    abstained = (pl.col("abstain").fill_null(False) & pl.col("catalog").is_in(declared)) \
        if "abstain" in frame.columns else pl.lit(False)
    frame = frame.with_columns(abstained=abstained).with_columns(
        choice=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("choice")),
        probs=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("probs")),
        acc_norm_choice=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("acc_norm_choice")),
        true_mass=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("true_mass")),
        exact_match=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("exact_match")),
        pass_at_k=pl.when(pl.col("abstained")).then(None).otherwise(pl.col("pass_at_k")))
    generative = [c.id for c in spec.catalogs if c.generative]
    frame = frame.with_columns(correct=pl.when(pl.col("catalog").is_in(generative))
                               .then(pl.col("exact_match").fill_null(False))
                               .otherwise((pl.col("choice") == pl.col("gold")).fill_null(False)),
                               correct_norm=(pl.col("acc_norm_choice") == pl.col("gold")).fill_null(False))
    return frame.with_columns(value=_row_value(spec))


def _p_gold() -> pl.Expr:
    """p[gold], or 1/k for a row without probabilities."""
    return pl.col("probs").list.get(pl.col("gold"), null_on_oob=True).fill_null(1.0 / pl.col("n_options"))


def _row_value(spec: ScoreSpec) -> pl.Expr:
    p_gold = _p_gold()
    sum_sq = pl.col("probs").list.eval(pl.element() * pl.element()).list.sum()
    brier = pl.when(pl.col("probs").is_null()).then(1.0 - 1.0 / pl.col("n_options")) \
        .otherwise(sum_sq - 2.0 * p_gold + 1.0)
    by_kind = {"accuracy": pl.col("correct").cast(pl.Float64), "acc_norm": pl.col("correct_norm").cast(pl.Float64),
               "exact_match": pl.col("correct").cast(pl.Float64), "maj_at_k": pl.col("correct").cast(pl.Float64),
               "pass_at_k": pl.col("pass_at_k").fill_null(0.0),
               "calibrated_accuracy": p_gold, "brier": brier,
               "true_mass": pl.col("true_mass").fill_null(pl.col("n_true") / pl.col("n_options")),
               "log_loss": -(pl.max_horizontal(p_gold, pl.lit(LOG_LOSS_FLOOR)).log())}
    expr = pl.lit(None, dtype=pl.Float64)
    for c in spec.catalogs:
        expr = pl.when(pl.col("catalog") == c.id).then(by_kind[c.scoring]).otherwise(expr)
    return expr


def catalog_chances(frame: pl.DataFrame, spec: ScoreSpec) -> dict[str, float]:
    """The uniform guess's value per catalog, by kind (see the module docstring), rounded once."""
    counts = frame.group_by("catalog", "n_options").len()
    hist: dict[str, Counter[int]] = {c.id: Counter() for c in spec.catalogs}
    for cat, k, n in counts.iter_rows():
        if cat in hist:
            hist[cat][k] += n
    shares: dict[str, Counter[tuple[int, int]]] = {c.id: Counter() for c in spec.catalogs}
    for cat, t, k, n in frame.group_by("catalog", "n_true", "n_options").len().iter_rows():
        if cat in shares and t is not None:
            shares[cat][t, k] += n
    return {c.id: true_mass_chance(c.chance, shares[c.id]) if c.scoring == "true_mass" else
            (c.chance or 0.0) if c.generative else
            chance_of(c.scoring, c.chance, hist[c.id]) for c in spec.catalogs}


def true_mass_chance(manifest_chance: float | None, shares: dict[tuple[int, int], int]) -> float:
    """Chance level of a true_mass catalog: the manifest's value, or the mean of t/k (the uniform
    forecast's mass on a row's t true options of k) from a histogram {(t, k): rows}, rounded once."""
    if manifest_chance is not None:
        return manifest_chance
    total = sum(shares.values())
    return float(sum((Fraction(t * n, k) for (t, k), n in shares.items()), Fraction(0)) / total)


def chance_of(kind: str, manifest_chance: float | None, hist: dict[int, int]) -> float:
    """Chance level of one catalog from the manifest's value or its histogram {n_options: rows}."""
    total = sum(hist.values())
    if kind == "log_loss":
        if manifest_chance is not None:
            return -math.log(manifest_chance)
        return float(sum((n * Fraction(math.log(k)) for k, n in hist.items()), Fraction(0)) / total)
    if manifest_chance is not None:
        return 1.0 - manifest_chance if kind == "brier" else manifest_chance
    inv = sum((Fraction(n, k) for k, n in hist.items()), Fraction(0)) / total
    return float(1 - inv) if kind == "brier" else float(inv)


def catalog_value(kind: str, sub: pl.DataFrame) -> float:
    """The exact point value of one catalog's scored rows (correctly rounded sums)."""
    n = sub.height
    if kind in ("accuracy", "acc_norm"):
        return int(sub["correct" if kind == "accuracy" else "correct_norm"].sum()) / n
    if kind in ("true_mass", "pass_at_k"):
        return math.fsum(sub["value"].to_list()) / n
    p_gold = sub.select(_p_gold())["probs"].to_list()
    if kind == "calibrated_accuracy":
        return math.fsum(p_gold) / n
    if kind == "log_loss":
        return math.fsum(-math.log(max(p, LOG_LOSS_FLOOR)) for p in p_gold) / n
    read = sub.filter(pl.col("probs").is_not_null()).select("gold", "probs").with_row_index("r").explode("probs")
    d = pl.col("probs") - (pl.int_range(pl.len()).over("r") == pl.col("gold")).cast(pl.Float64)
    terms = read.select(t=d * d)["t"].to_list()
    for k, m in Counter(sub.filter(pl.col("probs").is_null())["n_options"].to_list()).items():
        u = 1.0 / k
        terms += [(u - 1.0) * (u - 1.0)] * m + [u * u] * (m * (k - 1))
    return math.fsum(terms) / n


def catalog_shares(spec: ScoreSpec) -> dict[str, float]:
    """Each catalog's share of the composite's weight: (leg weight / all legs) x (weight / its leg's weights).
    The shares sum to 1, and full = 100 x sum(share_c x skill_c)."""
    lsum = math.fsum(spec.legs.values())
    wsum = {leg: math.fsum(c.weight for c in spec.catalogs if c.leg == leg) for leg in spec.legs}
    return {c.id: spec.legs[c.leg] / lsum * c.weight / wsum[c.leg] for c in spec.catalogs}


def score_predictions(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec) -> Score:
    """Score predictions against the suite rows (vectorised over rows)."""
    frame = scored_frame(rows, predictions, spec)
    totals = frame.group_by("catalog").agg(n=pl.len(), correct=pl.col("correct").sum(),
                                           no_choice=pl.col("choice").is_null().sum(),
                                           no_probs=pl.col("probs").is_null().sum(),
                                           no_norm=pl.col("acc_norm_choice").is_null().sum(),
                                           correct_norm=pl.col("correct_norm").sum(),
                                           no_mass=pl.col("true_mass").is_null().sum(),
                                           no_verdict=pl.col("exact_match").is_null().sum(),
                                           no_pass=pl.col("pass_at_k").is_null().sum(),
                                           abstained=pl.col("abstained").sum())
    per = {r["catalog"]: r for r in totals.iter_rows(named=True)}
    missing = [c.id for c in spec.catalogs if c.id not in per]
    if missing:
        raise ValueError(f"catalog(s) {missing} have no scored rows")
    chance = catalog_chances(frame, spec)
    acc = {c.id: per[c.id]["correct"] / per[c.id]["n"] for c in spec.catalogs}
    value = {c.id: acc[c.id] if c.scoring in ("accuracy", *VERDICT_KINDS) else
             catalog_value(c.scoring, frame.filter(pl.col("catalog") == c.id)) for c in spec.catalogs}
    full, full_raw, legs = aggregate(spec, value, chance, acc)
    catalogs = {}
    for c in spec.catalogs:
        p = per[c.id]
        unsupported = {"accuracy": p["no_choice"], "acc_norm": p["no_norm"], "true_mass": p["no_mass"],
                       "exact_match": p["no_verdict"], "maj_at_k": p["no_verdict"],
                       "pass_at_k": p["no_pass"]}.get(c.scoring, p["no_probs"])
        catalogs[c.id] = CatalogScore(
            n=p["n"], correct=p["correct"], unsupported=unsupported,
            acc=acc[c.id], chance=chance[c.id], skill=skill_of(value[c.id], chance[c.id], BEST[c.scoring]),
            weight=c.weight, leg=c.leg, kind=c.scoring, value=value[c.id], abstained=p["abstained"],
            acc_norm=p["correct_norm"] / p["n"] if c.reports_acc_norm else None)
    return Score(full=full, full_raw=full_raw, legs=legs, catalogs=catalogs)
