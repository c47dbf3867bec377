"""Paired statistics of arms against the base: clustered bootstrap deltas, sign-flip permutation p,
arm-vs-placebo, sweep out-of-fold choice and the panel projection.

Every arm is scored on the same rows as the base. The bootstrap is the clustered one of
`tasks.bootstrap` (question clusters resampled within each catalog, seed per catalog), run once over
the base and all arms together, so every prediction set sees the same draws: the delta of any two
sets (arm - base, arm - placebo) is paired draw by draw. Intervals are 95% percentile intervals.

The index is linear in each catalog's mean row value (chances stay at their point values):

    metric = sum_c K_c * mean_c(value) + const,   K_c = 100 * w_leg(c) * w_c / (best_c - chance_c)

with w_leg(c) the leg's share of the composite (1 for a leg metric) and w_c the catalog's share of
its leg. So a delta is a sum over question clusters of K_c / n_c * (arm sum - base sum), which is
what the permutation test flips: under the null (arm and base exchangeable within a question) each
cluster's difference keeps or changes sign with probability 1/2 (Good, *Permutation Tests*, 2005,
paired design); p = (1 + #{|perm| >= |obs|}) / (1 + permutations), two-sided.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np
import polars as pl

from jex.numerics import named_rng, question_folds
from jex.settings import BOOTSTRAP_DRAWS, BOOTSTRAP_SEED
from jex.tasks.bundle.suite_table import ScoreSpec
from jex.tasks.scoring.bootstrap_ci import (
    ClusterLayout,
    DrawStatistics,
    interval,
    resampled_accuracy,
    statistics_per_draw,
)
from jex.tasks.scoring.index import BEST, Score, catalog_chances, catalog_shares, score_predictions, scored_frame


class DeltaJson(TypedDict):
    """A delta as `experiment.json` writes it."""

    delta: float
    ci: list[float]


class OofChoice(TypedDict):
    """A sweep's out-of-fold choice (see `oof_choice`)."""

    choice: Any  # the grid value chosen most often
    fold_choices: list[Any]
    oof_delta: float
    in_sample_best: Any
    folds: int


@dataclass(frozen=True)
class Delta:
    """A point delta with its paired 95% interval."""

    delta: float
    ci: tuple[float, float]

    def to_json(self) -> DeltaJson:
        return {"delta": self.delta, "ci": list(self.ci)}


@dataclass(frozen=True)
class ArmStats:
    """One arm against the base: the metric, every leg and every catalog (skill x 100, index points)."""

    metric: Delta
    full: Delta
    p: float
    legs: dict[str, Delta]
    catalogs: dict[str, Delta]
    index: float
    draws: dict[str, np.ndarray] = field(repr=False, compare=False)
    """Per-draw deltas: 'metric', 'full', and 'cat:ID' for each catalog (pairing with other arms)."""
    retention: float | None = None
    """Share of the base's correct rows the arm keeps correct (`retention`); None when the base has none."""


def _ci(samples: np.ndarray) -> tuple[float, float]:
    """`interval` as the (low, high) pair a `Delta` holds."""
    lo, hi = interval(samples)
    return lo, hi


def metric_weights(spec: ScoreSpec, chance: Mapping[str, float], metric: str = "full") -> dict[str, float]:
    """K_c of the module docstring: index points per unit of catalog c's mean value."""
    if metric != "full" and metric not in spec.legs:
        raise ValueError(f"metric '{metric}' is neither 'full' nor a leg ({sorted(spec.legs)})")
    lsum = sum(spec.legs.values())
    out = {}
    for c in spec.catalogs:
        if metric != "full" and c.leg != metric:
            out[c.id] = 0.0
            continue
        wsum = sum(x.weight for x in spec.catalogs if x.leg == c.leg)
        leg_share = 1.0 if metric != "full" else spec.legs[c.leg] / lsum
        out[c.id] = 100.0 * leg_share * (c.weight / wsum) / (BEST[c.scoring] - chance[c.id])
    return out


def _metric_of(stats: DrawStatistics, metric: str) -> np.ndarray:
    return stats["full"] if metric == "full" else stats["legs"][metric]


def cluster_differences(layout: ClusterLayout, base: list[np.ndarray], arm: list[np.ndarray],
                        weights: Mapping[str, float]) -> np.ndarray:
    """Each question cluster's contribution to the metric delta, all catalogs concatenated."""
    parts = []
    for k, cid in enumerate(layout.catalogs):
        n = float(layout.sizes[k].sum())
        parts.append(weights[cid] / n * (np.asarray(arm[k], dtype=np.float64) - np.asarray(base[k], dtype=np.float64)))
    return np.concatenate(parts)


def permutation_p(diffs: np.ndarray, *, permutations: int, rng: np.random.Generator) -> float:
    """Two-sided paired sign-flip p of sum(diffs) (see the module docstring)."""
    obs = abs(float(diffs.sum()))
    signs = rng.integers(0, 2, size=(permutations, len(diffs))) * 2 - 1  # (permutations, clusters)
    null = np.abs(signs @ diffs)
    return float((1 + np.count_nonzero(null >= obs - 1e-12 * max(1.0, obs))) / (1 + permutations))


def retention(base: pl.DataFrame, arm: pl.DataFrame) -> float | None:
    """Share of the base's correct rows that the arm keeps correct: |base ok & arm ok| / |base ok|.

    Both are `scored_frame`s on the same rows in the same order; None when the base has no correct row."""
    kept = base["correct"] & arm["correct"]
    right = int(base["correct"].sum())
    return int(kept.sum()) / right if right else None


def arm_rng(seed: int, name: str) -> np.random.Generator:
    """The permutation generator of one arm: (seed, crc32(arm name))."""
    return named_rng(seed, name)


@dataclass(frozen=True)
class SharedDraws:
    """Several prediction sets of the same rows under one set of bootstrap draws: each set's per-draw
    statistics and point score, and its per-cluster values (for the permutation test)."""

    layout: ClusterLayout
    chance: dict[str, float]
    per_cluster: dict[str, list[np.ndarray]]
    per_draw: dict[str, DrawStatistics]
    points: dict[str, Score]
    frames: dict[str, pl.DataFrame]
    seed: int


def shared_draws(rows: pl.DataFrame, spec: ScoreSpec, sets: Mapping[str, pl.DataFrame], *,
                 draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED) -> SharedDraws:
    """Every set scored on the suite's rows and resampled with the same draws (the first set's rows and
    order are the reference; a set on other rows is refused)."""
    frames = {name: scored_frame(rows, p, spec) for name, p in sets.items()}
    first = next(iter(frames))
    order = frames[first]["run_id"].to_list()
    for name, f in frames.items():
        if f["run_id"].to_list() != order:
            raise ValueError(f"'{name}' is not scored on the rows of '{first}' in their order")
    chance = catalog_chances(frames[first], spec)
    layout = ClusterLayout.from_frame(frames[first], spec)
    sums = {name: layout.per_cluster_values(f, spec) for name, f in frames.items()}
    names = list(frames)
    acc = resampled_accuracy(layout, [sums[n] for n in names], draws=draws, seed=seed)
    return SharedDraws(layout=layout, chance=chance, per_cluster=sums,
                       per_draw={n: statistics_per_draw(spec, a, chance) for n, a in zip(names, acc, strict=True)},
                       points={n: score_predictions(rows, sets[n], spec) for n in names}, frames=frames, seed=seed)


def paired_stats(shared: SharedDraws, spec: ScoreSpec, base: str, arm: str, *, metric: str = "full",
                 permutations: int = 2000) -> ArmStats:
    """Set `arm` against set `base` of the same draws: paired deltas, intervals and sign-flip p."""
    a, b = shared.per_draw[arm], shared.per_draw[base]
    ap, bp = shared.points[arm], shared.points[base]
    d_metric = _metric_of(a, metric) - _metric_of(b, metric)
    d_full = a["full"] - b["full"]
    point_metric = ap.full - bp.full if metric == "full" else ap.legs[metric]["index"] - bp.legs[metric]["index"]
    legs = {leg: Delta(ap.legs[leg]["index"] - bp.legs[leg]["index"],
                       _ci(a["legs"][leg] - b["legs"][leg])) for leg in spec.legs}
    cats, cat_draws = {}, {}
    for c in spec.catalogs:
        d = 100.0 * (a["catalogs"][c.id] - b["catalogs"][c.id])
        cat_draws[f"cat:{c.id}"] = d
        cats[c.id] = Delta(100.0 * (ap.catalogs[c.id].skill - bp.catalogs[c.id].skill), _ci(d))
    diffs = cluster_differences(shared.layout, shared.per_cluster[base], shared.per_cluster[arm],
                                metric_weights(spec, shared.chance, metric))
    p = permutation_p(diffs, permutations=permutations, rng=arm_rng(shared.seed, arm))
    return ArmStats(metric=Delta(point_metric, _ci(d_metric)), full=Delta(ap.full - bp.full, _ci(d_full)), p=p,
                    legs=legs, catalogs=cats, index=ap.full, draws={"metric": d_metric, "full": d_full, **cat_draws},
                    retention=retention(shared.frames[base], shared.frames[arm]))


def paired_arms(rows: pl.DataFrame, spec: ScoreSpec, base: pl.DataFrame, arms: Mapping[str, pl.DataFrame], *,
                metric: str = "full", draws: int = BOOTSTRAP_DRAWS, seed: int = BOOTSTRAP_SEED,
                permutations: int = 2000) -> tuple[float, dict[str, ArmStats]]:
    """The base's index and every arm's paired statistics against it (one shared set of draws).

    `base` and each arm: predictions with `run_id`, `choice` (and `probs`) for the suite's rows.
    """
    if metric != "full" and metric not in spec.legs:
        raise ValueError(f"metric '{metric}' is neither 'full' nor a leg ({sorted(spec.legs)})")
    try:
        shared = shared_draws(rows, spec, {"__base__": base, **arms}, draws=draws, seed=seed)
    except ValueError as e:
        raise ValueError(f"{e} (an arm must be scored on the base's rows in the base's order)") from None
    return shared.points["__base__"].full, {
        name: paired_stats(shared, spec, "__base__", name, metric=metric, permutations=permutations) for name in arms}


def versus(arm: ArmStats, placebo: ArmStats) -> Delta:
    """The arm's metric delta minus the placebo's, with its paired interval (same draws)."""
    return Delta(arm.metric.delta - placebo.metric.delta, _ci(arm.draws["metric"] - placebo.draws["metric"]))


def row_contributions(rows: pl.DataFrame, spec: ScoreSpec, predictions: pl.DataFrame, *,
                      metric: str = "full") -> pl.DataFrame:
    """run_id, question_id, catalog and each row's share of the metric (K_c / n_c * value)."""
    frame = scored_frame(rows, predictions, spec)
    chance = catalog_chances(frame, spec)
    weights = metric_weights(spec, chance, metric)
    n = dict(frame.group_by("catalog").len().iter_rows())
    scale = pl.col("catalog").replace_strict({c: weights[c] / n[c] for c in n}, return_dtype=pl.Float64)
    return frame.select("run_id", "question_id", "catalog", contribution=scale * pl.col("value"))


def oof_choice(base: pl.DataFrame, points: Mapping[Any, pl.DataFrame], *, folds: int = 5) -> OofChoice:
    """Out-of-fold choice of a sweep's grid value.

    `base` and each grid point: `row_contributions` frames. Questions are split into folds by
    crc32(question_id) % folds; on each fold the value with the best delta on the *other* folds is
    chosen and scored on the held-out fold. Returns the value chosen most often (ties: grid order),
    the per-fold choices, the out-of-fold delta (sum of held-out deltas) and the in-sample best.
    """
    grid = list(points)
    fold = question_folds(base["question_id"].to_list(), folds)
    base_c = base["contribution"].to_numpy()
    deltas = np.stack([points[g]["contribution"].to_numpy() - base_c for g in grid])  # (grid, rows)
    chosen, oof = [], 0.0
    for k in range(folds):
        test = fold == k
        if not test.any():
            continue
        best = int(np.argmax(deltas[:, ~test].sum(axis=1)))
        chosen.append(grid[best])
        oof += float(deltas[best, test].sum())
    counts = [chosen.count(g) for g in grid]
    return {"choice": grid[int(np.argmax(counts))], "fold_choices": chosen, "oof_delta": oof,
            "in_sample_best": grid[int(np.argmax(deltas.sum(axis=1)))], "folds": folds}


def panel_share(full: ScoreSpec, catalogs: Sequence[str]) -> dict[str, float]:
    """Each panel catalog's share of the full index's weight (leg share x share within its leg)."""
    shares = catalog_shares(full)
    missing = sorted(set(catalogs) - set(shares))
    if missing:
        raise ValueError(f"panel catalog(s) {missing} are not in the suite ({sorted(shares)})")
    return {c: s for c, s in shares.items() if c in catalogs}


def project(arm: ArmStats, shares: Mapping[str, float]) -> Delta:
    """The panel arm's delta projected onto the full index: sum of share_c x catalog delta (index
    points), other catalogs unchanged; its interval from the same draws."""
    point = sum(s * arm.catalogs[c].delta for c, s in shares.items())
    draws = sum(s * arm.draws[f"cat:{c}"] for c, s in shares.items())
    return Delta(float(point), _ci(np.asarray(draws)))
