"""Scoring: chance-normalised skill per catalog, weighted leg indices and the composite.

Definitions (the contract):
    per catalog  acc = correct / n over scored rows (exclusions dropped; a missing or null
                 prediction is wrong and counted `unsupported`); chance = the manifest's value or
                 the mean of 1/len(options) over scored rows; skill = (acc - chance) / (1 - chance)
    per leg      index = 100 * sum(weight * skill) / sum(weight); raw likewise with acc
    composite    full = sum(leg_weight * leg_index) / sum(leg_weight)

Sums over catalogs and legs are correctly rounded (`math.fsum`) and the chance level is an exact
rational rounded once, so the result does not depend on summation order: the plain scorer in
`scoring_plain.py` reproduces it bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import polars as pl

from tasks.scoring_inputs import ScoreSpec


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


@dataclass(frozen=True)
class Score:
    full: float
    full_raw: float
    legs: dict[str, dict[str, float]]  # leg -> {"index", "raw"}
    catalogs: dict[str, CatalogScore]

    def to_json(self) -> dict[str, Any]:
        return {"full": self.full, "full_raw": self.full_raw,
                "legs": {k: dict(v) for k, v in self.legs.items()},
                "catalogs": {k: vars(v).copy() for k, v in self.catalogs.items()}}


def skill_of(acc: float, chance: float) -> float:
    return (acc - chance) / (1.0 - chance)


def aggregate(spec: ScoreSpec, acc: dict[str, float], chance: dict[str, float]) -> tuple[float, float, dict]:
    """Leg indices and the composite from per-catalog accuracy and chance (shared by the bootstrap)."""
    legs: dict[str, dict[str, float]] = {}
    for leg in spec.legs:
        cats = [c for c in spec.catalogs if c.leg == leg]
        wsum = math.fsum(c.weight for c in cats)
        legs[leg] = {
            "index": 100.0 * math.fsum(c.weight * skill_of(acc[c.id], chance[c.id]) for c in cats) / wsum,
            "raw": 100.0 * math.fsum(c.weight * acc[c.id] for c in cats) / wsum,
        }
    lsum = math.fsum(spec.legs.values())
    full = math.fsum(w * legs[leg]["index"] for leg, w in spec.legs.items()) / lsum
    full_raw = math.fsum(w * legs[leg]["raw"] for leg, w in spec.legs.items()) / lsum
    return full, full_raw, legs


def scored_frame(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec) -> pl.DataFrame:
    """Suite rows minus exclusions, with `choice` joined and a boolean `correct` column."""
    excluded = [rid for c in spec.catalogs for rid in c.exclusions]
    return (rows.filter(~pl.col("run_id").is_in(excluded))
            .join(predictions.select("run_id", "choice"), on="run_id", how="left", maintain_order="left")
            .with_columns(correct=(pl.col("choice") == pl.col("gold")).fill_null(False)))


def catalog_chances(frame: pl.DataFrame, spec: ScoreSpec) -> dict[str, float]:
    counts = frame.group_by("catalog", "n_options").len()
    hist: dict[str, Fraction] = {}
    totals: dict[str, int] = {}
    for cat, k, n in counts.iter_rows():
        hist[cat] = hist.get(cat, Fraction(0)) + Fraction(n, k)
        totals[cat] = totals.get(cat, 0) + n
    return {c.id: c.chance if c.chance is not None else float(hist[c.id] / totals[c.id]) for c in spec.catalogs}


def score_predictions(rows: pl.DataFrame, predictions: pl.DataFrame, spec: ScoreSpec) -> Score:
    """Score predictions against the suite rows (vectorised over rows)."""
    frame = scored_frame(rows, predictions, spec)
    totals = frame.group_by("catalog").agg(n=pl.len(), correct=pl.col("correct").sum(),
                                           unsupported=pl.col("choice").is_null().sum())
    per = {r["catalog"]: r for r in totals.iter_rows(named=True)}
    missing = [c.id for c in spec.catalogs if c.id not in per]
    if missing:
        raise ValueError(f"catalog(s) {missing} have no scored rows")
    chance = catalog_chances(frame, spec)
    acc = {c.id: per[c.id]["correct"] / per[c.id]["n"] for c in spec.catalogs}
    full, full_raw, legs = aggregate(spec, acc, chance)
    catalogs = {c.id: CatalogScore(n=per[c.id]["n"], correct=per[c.id]["correct"],
                                   unsupported=per[c.id]["unsupported"], acc=acc[c.id], chance=chance[c.id],
                                   skill=skill_of(acc[c.id], chance[c.id]), weight=c.weight, leg=c.leg)
                for c in spec.catalogs}
    return Score(full=full, full_raw=full_raw, legs=legs, catalogs=catalogs)
