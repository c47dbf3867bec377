"""The second scorer: a plain loop over rows in pure Python, written from the definitions alone.

It shares nothing with `scoring.py` but the files it reads. `jex score` runs both and fails on any
difference, so an implementation slip in either one cannot reach a report.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

FLOOR = 1e-15


def _chance(kind: str, given: float | None, options: dict[int, int], n: int) -> float:
    inv = sum((Fraction(m, k) for k, m in options.items()), Fraction(0))
    logk = sum((m * Fraction(math.log(k)) for k, m in options.items()), Fraction(0))
    if kind == "log_loss":
        return -math.log(given) if given is not None else float(logk / n)
    if kind == "brier":
        return 1.0 - given if given is not None else float(1 - inv / n)
    return given if given is not None else float(inv / n)


def plain_score(rows: list[dict[str, Any]], choices: dict[str, int | None], legs: dict[str, float],
                catalogs: list[dict[str, Any]], probs: dict[str, list[float] | None] | None = None,
                abstain: dict[str, bool | None] | None = None) -> dict[str, Any]:
    """rows: dicts with run_id, catalog, gold, n_options; choices, probs, abstain: by run_id (a run_id
    absent is no prediction); catalogs: id, leg, weight, chance, exclusions, scoring, secondary."""
    probs, abstain = probs or {}, abstain or {}
    tally = {c["id"]: {"n": 0, "correct": 0, "unsupported": 0, "abstained": 0, "options": {},
                       "terms": []} for c in catalogs}
    kinds = {c["id"]: c["scoring"] for c in catalogs}
    may_abstain = {c["id"] for c in catalogs if "abstain" in c["secondary"]}
    excluded = {rid for c in catalogs for rid in c["exclusions"]}
    for row in rows:
        if row["run_id"] in excluded:
            continue
        cat, k, gold = row["catalog"], row["n_options"], row["gold"]
        t = tally[cat]
        t["n"] += 1
        t["options"][k] = t["options"].get(k, 0) + 1  # rows per number of options, for chance
        rid = row["run_id"]
        choice, p = choices.get(rid), probs.get(rid)
        if abstain.get(rid) and cat in may_abstain:
            t["abstained"] += 1
            choice = p = None
        if choice is not None and choice == gold:
            t["correct"] += 1
        kind = kinds[cat]
        if (choice if kind == "accuracy" else p) is None:
            t["unsupported"] += 1
        if kind == "accuracy":
            continue
        if p is None:
            p = [1.0 / k] * k
        if kind == "calibrated_accuracy":
            t["terms"].append(p[gold])
        elif kind == "log_loss":
            t["terms"].append(-math.log(max(p[gold], FLOOR)))
        else:  # brier
            for i, q in enumerate(p):
                d = q - (1.0 if i == gold else 0.0)
                t["terms"].append(d * d)
    out_cats: dict[str, dict[str, Any]] = {}
    for c in catalogs:
        t, kind = tally[c["id"]], c["scoring"]
        acc = t["correct"] / t["n"]
        value = acc if kind == "accuracy" else math.fsum(t["terms"]) / t["n"]
        chance = _chance(kind, c["chance"], t["options"], t["n"])
        best = 0.0 if kind in ("brier", "log_loss") else 1.0
        out_cats[c["id"]] = {"n": t["n"], "correct": t["correct"], "unsupported": t["unsupported"], "acc": acc,
                             "chance": chance, "skill": (value - chance) / (best - chance),
                             "weight": c["weight"], "leg": c["leg"], "kind": kind, "value": value,
                             "abstained": t["abstained"]}
    out_legs: dict[str, dict[str, float]] = {}
    for leg in legs:
        members = [c for c in catalogs if c["leg"] == leg]
        weights = math.fsum(c["weight"] for c in members)
        index_terms, raw_terms = [], []
        for c in members:
            index_terms.append(c["weight"] * out_cats[c["id"]]["skill"])
            raw_terms.append(c["weight"] * out_cats[c["id"]]["acc"])
        out_legs[leg] = {"index": 100.0 * math.fsum(index_terms) / weights,
                         "raw": 100.0 * math.fsum(raw_terms) / weights}
    total = math.fsum(legs.values())
    full = math.fsum(legs[leg] * out_legs[leg]["index"] for leg in legs) / total
    full_raw = math.fsum(legs[leg] * out_legs[leg]["raw"] for leg in legs) / total
    return {"full": full, "full_raw": full_raw, "legs": out_legs, "catalogs": out_cats}
