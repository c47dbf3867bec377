"""The overlay stage's mechanics: decision rules laid on a frozen capture.

An overlay changes emitted choices (or the secondary `abstain` flag) only; probabilities and the
capture are never rewritten. The rule
kinds live in `overlays/`; this module applies an ordered list of them, records which stage decided
each row, and checks the two promises every overlay run must keep: non-target catalogs are
bit-identical to the base (no-degrade), and all flags off gives the base back exactly (reversible).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import polars as pl

from jex.errors import JexError
from jex.overlays.rules import OverlayRuleBase


class NoDegradeViolation(JexError):
    """An overlay changed predictions outside its target catalog."""


def apply_overlays(frame: pl.DataFrame, rules: Sequence[OverlayRuleBase]) -> tuple[pl.DataFrame, list[dict[str, Any]]]:
    """`frame`: run_id, catalog, choice, stage, probs (+ question_id, gold for fitted rules).

    Rules apply in order; each may change only its target's rows, which `no_degrade_check` verifies
    after each one. A rule that sets `abstain` adds that column (False where no rule set it); the
    stage column names the stage that decided each row's choice. Returns the new frame and one
    record per rule.
    """
    applied = []
    for rule in rules:
        before = frame
        if rule.sets not in frame.columns:
            frame = frame.with_columns(pl.lit(False).alias(rule.sets))
        new = rule.apply(frame)
        changed = (new != frame[rule.sets]).fill_null(True)
        frame = frame.with_columns(new.alias(rule.sets))
        if rule.sets == "choice":
            frame = frame.with_columns(pl.when(changed).then(pl.lit(f"overlay:{rule.id}")).otherwise(pl.col("stage"))
                                       .alias("stage"))
        no_degrade_check(before, frame, targets={rule.target}, what=f"overlay {rule.id!r}")
        applied.append({**rule.record(), "changed": int(changed.sum())})
    return frame, applied


def no_degrade_check(base: pl.DataFrame, overlaid: pl.DataFrame, *, targets: set[str], what: str = "overlays") -> None:
    """Every row outside `targets` must keep its exact choice and abstain flag; raise naming the
    catalog and rows."""
    def flags(frame: pl.DataFrame) -> pl.Expr:
        return pl.col("abstain").fill_null(False) if "abstain" in frame.columns else pl.lit(False)

    joined = base.select("run_id", "catalog", "choice", abstain=flags(base)).join(
        overlaid.select("run_id", new="choice", new_abstain=flags(overlaid)), on="run_id", how="left",
        maintain_order="left")
    moved = joined.filter(~pl.col("catalog").is_in(list(targets)) & (
        pl.col("choice").ne_missing(pl.col("new")) | pl.col("abstain").ne_missing(pl.col("new_abstain"))))
    if moved.height:
        by_cat = moved.group_by("catalog", maintain_order=True).agg(pl.col("run_id").head(3), n=pl.len())
        detail = "; ".join(f"catalog '{c}': {n} rows (first: {ids})" for c, ids, n in by_cat.iter_rows())
        raise NoDegradeViolation(f"{what} changed predictions outside its target(s) {sorted(targets)}: {detail}")


def reversibility_check(base: pl.DataFrame, all_off: pl.DataFrame) -> None:
    """With every flag off the choices must be the base's, row for row."""
    if base["run_id"].to_list() != all_off["run_id"].to_list() or \
            not base["choice"].equals(all_off["choice"], check_names=False):
        raise JexError("overlays are not reversible: all flags off does not give the base predictions back")
