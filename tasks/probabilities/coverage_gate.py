"""Coverage gate: the least sure rows of the fast pass, the ones worth a rationale."""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from jex.numerics import logit


def margins(logprobs: pl.Series) -> pl.Series:
    """Top-1 minus top-2 log-odds per row (null where the readout was refused)."""
    out: list[float | None] = []
    for lp in logprobs.to_list():
        if lp is None or len(lp) < 2:
            out.append(None)
            continue
        p = np.sort(np.exp(np.asarray(lp, dtype=np.float64)))[::-1]
        z = logit(p[:2])
        out.append(float(z[0] - z[1]))
    return pl.Series("margin", out, dtype=pl.Float64)


def coverage_gate(panel: pl.DataFrame, *, coverage: float, per_catalog_cap: float | None = None) -> pl.DataFrame:
    """Gate the fraction `coverage` of panel rows with the smallest margin.

    `panel` has `run_id`, `catalog` and `logprobs`. Ties are broken by run_id; rows whose readout was
    refused are not gated (they are counted by the fast pass). `per_catalog_cap` limits the gated
    share of any one catalog. Returns the gated rows (`run_id, catalog, margin`) in gate order.
    """
    if not 0 <= coverage <= 1:
        raise ValueError(f"coverage must be in [0, 1], got {coverage}")
    scored = panel.select("run_id", "catalog").with_columns(margins(panel["logprobs"])).drop_nulls("margin")
    target = math.floor(coverage * panel.height + 0.5)
    ordered = scored.sort(["margin", "run_id"])
    if per_catalog_cap is None:
        return ordered.head(target)
    caps = {c: math.floor(per_catalog_cap * n + 0.5) for c, n in panel.group_by("catalog").len().iter_rows()}
    taken: dict[str, int] = {}
    keep: list[int] = []
    for i, cat in enumerate(ordered["catalog"].to_list()):
        if len(keep) == target:
            break
        if taken.get(cat, 0) < caps[cat]:
            taken[cat] = taken.get(cat, 0) + 1
            keep.append(i)
    return ordered[keep]
