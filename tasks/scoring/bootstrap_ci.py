"""Clustered bootstrap of the index: 95% percentile intervals, and a paired mode for deltas.

Clusters are `question_id`s resampled with replacement within each catalog (stratified by
catalog), as in the cluster bootstrap of Cameron, Gelbach & Miller (2008). What is resampled is
each catalog's scoring kind: the count of correct rows for accuracy (exact integers), the per-row
value for the probability kinds (`scoring.scored_frame`). Chance levels stay at their point
values. Each catalog draws from its own generator, seeded by (seed, crc32(catalog id)), so adding
a catalog leaves the other catalogs' draws unchanged. Draws are made in fixed chunks of
`DRAW_CHUNK` to bound memory; `bootstrap_loop` is the readable version the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict, cast

import numpy as np
import polars as pl

from jex.numerics import named_rng
from jex.settings import BOOTSTRAP_SEED
from jex.tasks.bundle.suite_table import ScoreSpec
from jex.tasks.scoring.index import BEST, COUNTED_KINDS, aggregate, skill_of

DRAW_CHUNK = 128
DEFAULT_DRAWS = 2000
DEFAULT_SEED = BOOTSTRAP_SEED


@dataclass(frozen=True)
class ClusterLayout:
    """Per catalog (manifest order): the cluster index of each scored row and the cluster sizes."""

    catalogs: tuple[str, ...]
    row_cluster: tuple[np.ndarray, ...]
    sizes: tuple[np.ndarray, ...]

    @classmethod
    def from_frame(cls, frame: pl.DataFrame, spec: ScoreSpec) -> ClusterLayout:
        """`frame`: scored rows (exclusions dropped) with `catalog` and `question_id`, in a fixed order."""
        row_cluster, sizes = [], []
        for c in spec.catalogs:
            qids = frame.filter(pl.col("catalog") == c.id)["question_id"].to_numpy()
            _, codes = np.unique(qids, return_inverse=True)  # clusters in sorted question_id order
            row_cluster.append(codes.astype(np.int64))
            sizes.append(np.bincount(codes).astype(np.int64))
        return cls(tuple(c.id for c in spec.catalogs), tuple(row_cluster), tuple(sizes))

    def per_cluster(self, frame: pl.DataFrame, column: str, spec: ScoreSpec) -> list[np.ndarray]:
        """Sum of a 0/1 column per cluster, per catalog."""
        out = []
        for c, codes, sizes in zip(spec.catalogs, self.row_cluster, self.sizes, strict=True):
            values = frame.filter(pl.col("catalog") == c.id)[column].cast(pl.Int64).to_numpy()
            out.append(np.bincount(codes, weights=values, minlength=len(sizes)).astype(np.int64))
        return out

    def per_cluster_values(self, frame: pl.DataFrame, spec: ScoreSpec) -> list[np.ndarray]:
        """Per catalog, the sum per cluster of what its kind averages: `correct` (exact integers) for
        accuracy and exact_match (`correct_norm` for acc_norm), the row `value` (floats) for the probability kinds."""
        out = []
        for c, codes, sizes in zip(spec.catalogs, self.row_cluster, self.sizes, strict=True):
            sub = frame.filter(pl.col("catalog") == c.id)
            if c.scoring in COUNTED_KINDS:
                hits = sub["correct_norm" if c.scoring == "acc_norm" else "correct"]
                out.append(np.bincount(codes, weights=hits.cast(pl.Int64).to_numpy(),
                                       minlength=len(sizes)).astype(np.int64))
            else:
                out.append(np.bincount(codes, weights=sub["value"].to_numpy(), minlength=len(sizes)))
        return out


def resampled_accuracy(layout: ClusterLayout, correct: list[list[np.ndarray]], *, draws: int,
                       seed: int) -> list[dict[str, np.ndarray]]:
    """Mean per draw (accuracy, or the kind's value) for each prediction set in `correct` (sets x
    catalogs of per-cluster sums).

    All sets see the same draws, which is what makes the paired mode paired.
    """
    out: list[dict[str, np.ndarray]] = [{} for _ in correct]
    for k, cid in enumerate(layout.catalogs):
        sizes = layout.sizes[k]
        nc = len(sizes)
        rng = named_rng(seed, cid)
        num = np.empty((len(correct), draws))
        den = np.empty(draws)
        sums = [per_set[k] for per_set in correct]
        packed = _packed(sizes, sums)
        for start in range(0, draws, DRAW_CHUNK):
            stop = min(start + DRAW_CHUNK, draws)
            idx = rng.integers(0, nc, size=(stop - start, nc))  # (chunk, clusters)
            if packed is not None:  # integer sums: one gather per set gives rows and hits together
                for s, both in enumerate(packed):
                    total = np.take(both, idx).sum(axis=1)
                    den[start:stop] = total >> 32
                    num[s, start:stop] = total & 0xFFFFFFFF
                continue
            den[start:stop] = np.take(sizes, idx).sum(axis=1)
            for s, values in enumerate(sums):
                num[s, start:stop] = np.take(values, idx).sum(axis=1)
        for s in range(len(correct)):
            out[s][cid] = num[s] / den
    return out


def _packed(sizes: np.ndarray, sums: list[np.ndarray]) -> list[np.ndarray] | None:
    """sizes << 32 | hits per cluster when every set holds integer sums and no draw can overflow
    (a draw's rows < 2**31): summing these gives both sums exactly, with half the gathers."""
    if any(v.dtype.kind != "i" for v in sums) or len(sizes) * int(sizes.max(initial=0)) >= 2**31:
        return None
    return [(sizes.astype(np.int64) << 32) | v.astype(np.int64) for v in sums]


class DrawStatistics(TypedDict):
    """Per-draw arrays, shape (draws,): the full index, each leg's index, each catalog's skill."""

    full: np.ndarray
    legs: dict[str, np.ndarray]
    catalogs: dict[str, np.ndarray]


class Intervals(TypedDict):
    """95% percentile intervals [low, high] of the full index, each leg and each catalog's skill."""

    full: list[float]
    legs: dict[str, list[float]]
    catalogs: dict[str, list[float]]


def statistics_per_draw(spec: ScoreSpec, acc: dict[str, np.ndarray], chance: dict[str, float]) -> DrawStatistics:
    """Vectorised over draws: catalog skill, leg index and full index arrays."""
    skill = {c.id: skill_of(acc[c.id], chance[c.id], BEST[c.scoring]) for c in spec.catalogs}
    legs: dict[str, np.ndarray] = {}
    for leg in spec.legs:
        cats = [c for c in spec.catalogs if c.leg == leg]
        legs[leg] = 100.0 * sum(c.weight * skill[c.id] for c in cats) / sum(c.weight for c in cats)
    full = cast(np.ndarray, sum(w * legs[leg] for leg, w in spec.legs.items()) / sum(spec.legs.values()))
    return {"full": full, "legs": legs, "catalogs": skill}


def interval(samples: np.ndarray, level: float = 0.95) -> list[float]:
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return [float(lo), float(hi)]


def intervals(stats: DrawStatistics) -> Intervals:
    return {"full": interval(stats["full"]),
            "legs": {k: interval(v) for k, v in stats["legs"].items()},
            "catalogs": {k: interval(v) for k, v in stats["catalogs"].items()}}


def bootstrap_ci(frame: pl.DataFrame, spec: ScoreSpec, chance: dict[str, float], *, draws: int = DEFAULT_DRAWS,
                 seed: int = DEFAULT_SEED) -> Intervals:
    """95% intervals of full, each leg and each catalog skill; `frame` from `scoring.scored_frame`."""
    layout = ClusterLayout.from_frame(frame, spec)
    (acc,) = resampled_accuracy(layout, [layout.per_cluster_values(frame, spec)], draws=draws, seed=seed)
    return intervals(statistics_per_draw(spec, acc, chance))


def paired_bootstrap_ci(baseline: pl.DataFrame, policy: pl.DataFrame, spec: ScoreSpec, chance: dict[str, float],
                        *, draws: int = DEFAULT_DRAWS, seed: int = DEFAULT_SEED) -> Intervals:
    """Intervals of policy minus baseline under the same draws; both frames hold the same rows."""
    if baseline["run_id"].to_list() != policy["run_id"].to_list():
        raise ValueError("paired bootstrap needs both prediction sets over the same rows in the same order")
    layout = ClusterLayout.from_frame(baseline, spec)
    acc_a, acc_b = resampled_accuracy(layout, [layout.per_cluster_values(baseline, spec),
                                               layout.per_cluster_values(policy, spec)], draws=draws, seed=seed)
    a, b = statistics_per_draw(spec, acc_a, chance), statistics_per_draw(spec, acc_b, chance)
    diff: DrawStatistics = {"full": b["full"] - a["full"],
            "legs": {k: b["legs"][k] - a["legs"][k] for k in a["legs"]},
            "catalogs": {k: b["catalogs"][k] - a["catalogs"][k] for k in a["catalogs"]}}
    return intervals(diff)


def bootstrap_loop(frame: pl.DataFrame, spec: ScoreSpec, chance: dict[str, float], *, draws: int,
                   seed: int) -> list[float]:
    """Readable reference: full index per draw with loops over draws and clusters (tests only)."""
    layout = ClusterLayout.from_frame(frame, spec)
    correct = layout.per_cluster_values(frame, spec)
    picks: dict[str, list[list[int]]] = {}
    for k, cid in enumerate(layout.catalogs):
        rng, nc = named_rng(seed, cid), len(layout.sizes[k])
        picks[cid] = []
        for start in range(0, draws, DRAW_CHUNK):
            picks[cid].extend(rng.integers(0, nc, size=(min(DRAW_CHUNK, draws - start), nc)).tolist())
    fulls = []
    for b in range(draws):
        acc = {}
        for k, cid in enumerate(layout.catalogs):
            hits = rows = 0
            for cluster in picks[cid][b]:
                hits += correct[k][cluster]
                rows += int(layout.sizes[k][cluster])
            acc[cid] = float(hits / rows)
        fulls.append(aggregate(spec, acc, chance)[0])
    return fulls
