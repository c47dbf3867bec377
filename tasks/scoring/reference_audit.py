"""Reference audit: a run's choices and probabilities against the banked rows its bundle carries.

A bundle may carry reference rows 1:1 with its rows (`jex bundle build --reference FILE`): the
choices and probabilities of an earlier, trusted run. Every campaign on such a bundle compares its
fast-pass and its final predictions with them, question by question, with the metrics of engine
parity (`lab/parity.py`):

    compared           rows where both sides have a choice (a missing one is counted, not compared)
    argmax_agreement   agree / compared; flips = compared - agree, each listed with its catalog, both
                       choices, gold, the run's pre-margin (fast-pass top-1 minus top-2 log-odds) and
                       the reference's margin
    mean/p95/max |dp|  over every option of the rows where both sides have probabilities
    catalogs           agreement per catalog
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import Any

import numpy as np
import polars as pl

from jex.numerics import margin
from jex.tasks.bundle.bundle_file import open_bundle
from jex.tasks.documents import CatalogAgreement, ReferenceAudit, ReferenceComparison, ReferenceFlip

FLIP_ROWS = 200  # flips listed in full in the JSON (all are counted)


@functools.lru_cache(maxsize=4)
def bundle_reference(path: str, sha256: str) -> pl.DataFrame | None:
    """The reference rows of a bundle (run_id, choice, probs, suite order), or None; read once per process."""
    with tempfile.TemporaryDirectory(prefix="jex-ref-") as tmp:
        bundle = open_bundle(path, tmp)
        if bundle.sha256 != sha256:
            raise RuntimeError(f"{path} changed since it was built")
        return bundle.reference()


def probs_margin(probs: list[float] | None) -> float | None:
    """Top-1 minus top-2 log-odds of a probability vector (as `numerics.margin` of its logs)."""
    if probs is None or len(probs) < 2:
        return None
    return margin([math.log(p) if p > 0 else -math.inf for p in probs])


def compare_to_reference(reference: pl.DataFrame, run: pl.DataFrame, rows: pl.DataFrame) -> ReferenceComparison:
    """`reference`, `run`: run_id, choice, probs; `rows`: run_id, catalog, gold; `run` may carry
    `pre_margin`. Every reference row must have a run row (the bundle guarantees 1:1)."""
    joined = (rows.select("run_id", "catalog", "gold")
              .join(reference.select("run_id", ref_choice="choice", ref_probs="probs"), on="run_id", how="inner",
                    maintain_order="left")
              .join(run.select("run_id", "choice", "probs", *(["pre_margin"] if "pre_margin" in run.columns else [])),
                    on="run_id", how="left", maintain_order="left"))
    both = joined.filter(pl.col("choice").is_not_null() & pl.col("ref_choice").is_not_null())
    flips = both.filter(pl.col("choice") != pl.col("ref_choice"))
    dp = _abs_dp(joined)
    flip_rows = [ReferenceFlip(run_id=r["run_id"], catalog=r["catalog"], reference_choice=r["ref_choice"],
                               run_choice=r["choice"], gold=r["gold"], pre_margin=r.get("pre_margin"),
                               reference_margin=probs_margin(r["ref_probs"]))
                 for r in flips.head(FLIP_ROWS).iter_rows(named=True)]
    margins = [m for m in flips["pre_margin"].to_list() if m is not None] if "pre_margin" in flips.columns else []
    per = both.group_by("catalog", maintain_order=True).agg(
        compared=pl.len(), agree=(pl.col("choice") == pl.col("ref_choice")).sum())
    catalogs = {c: CatalogAgreement(compared=n, agree=a, argmax_agreement=a / n) for c, n, a in per.iter_rows()}
    return ReferenceComparison(
        rows=joined.height, compared=both.height, run_missing=joined.filter(pl.col("choice").is_null()).height,
        reference_missing=joined.filter(pl.col("ref_choice").is_null()).height,
        agree=both.height - flips.height, flips=flips.height,
        argmax_agreement=(both.height - flips.height) / both.height if both.height else None,
        mean_abs_dp=float(dp.mean()) if dp.size else None,
        p95_abs_dp=float(np.percentile(dp, 95)) if dp.size else None,
        max_abs_dp=float(dp.max()) if dp.size else None,
        flip_pre_margin_median=float(np.median(margins)) if margins else None,
        flip_pre_margin_max=float(max(margins)) if margins else None,
        catalogs=catalogs, flip_rows=flip_rows)


def _abs_dp(joined: pl.DataFrame) -> np.ndarray:
    has = joined.filter(pl.col("probs").is_not_null() & pl.col("ref_probs").is_not_null()
                        & (pl.col("probs").list.len() == pl.col("ref_probs").list.len()))
    if not has.height:
        return np.array([])
    a = has["probs"].explode().to_numpy()
    b = has["ref_probs"].explode().to_numpy()
    return np.abs(a - b)


def reference_audit(reference: pl.DataFrame, rows: pl.DataFrame, *, fast: pl.DataFrame,
                    final: pl.DataFrame) -> ReferenceAudit:
    """The audit of one run: its fast pass and its final predictions, each against the reference.

    `fast`, `final`: run_id, choice, probs (+ pre_margin); `rows`: the suite's scored columns.
    """
    return ReferenceAudit(fast_pass=compare_to_reference(reference, fast, rows),
                          final=compare_to_reference(reference, final, rows))


def audit_markdown(audit: ReferenceAudit, flips_shown: int = 50) -> list[str]:
    """The report's section: both comparisons, agreement per catalog and the final flips."""
    def f(x: Any, spec: str = ".4g") -> str:
        return "-" if x is None else format(x, spec)

    lines = ["", "## Reference audit", "",
             "Against the reference rows the bundle carries (an earlier, trusted run), question by question.", "",
             "| predictions | compared | agreement | flips | mean abs dp | p95 abs dp | max abs dp | "
             "flips' median pre-margin | missing (run / reference) |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, a in (("fast_pass", audit.fast_pass), ("final", audit.final)):
        lines.append(f"| {name} | {a.compared} | {f(a.argmax_agreement, '.4f')} | {a.flips} | "
                     f"{f(a.mean_abs_dp)} | {f(a.p95_abs_dp)} | {f(a.max_abs_dp)} | "
                     f"{f(a.flip_pre_margin_median)} | {a.run_missing} / {a.reference_missing} |")
    lines += ["", "| catalog | agreement (fast pass) | agreement (final) |", "|---|---:|---:|"]
    for c, v in audit.final.catalogs.items():
        fp = audit.fast_pass.catalogs.get(c)
        lines.append(f"| {c} | {f(fp.argmax_agreement if fp else None, '.4f')} | {v.argmax_agreement:.4f} |")
    flips = audit.final.flip_rows[:flips_shown]
    if flips:
        lines += ["", "| flip (final) | catalog | reference | run | gold | pre-margin | reference margin |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r.run_id} | {r.catalog} | {r.reference_choice} | {r.run_choice} | {r.gold} | "
                  f"{f(r.pre_margin)} | {f(r.reference_margin)} |" for r in flips]
    return lines
