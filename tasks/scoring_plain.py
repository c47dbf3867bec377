"""The second scorer: a plain loop over rows in pure Python, written from the definitions alone.

It shares nothing with `scoring.py` but the files it reads. `jex score` runs both and fails on any
difference, so an implementation slip in either one cannot reach a report.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any


def plain_score(rows: list[dict[str, Any]], choices: dict[str, int | None], legs: dict[str, float],
                catalogs: list[dict[str, Any]]) -> dict[str, Any]:
    """rows: dicts with run_id, catalog, gold, n_options; catalogs: id, leg, weight, chance, exclusions."""
    tally = {c["id"]: {"n": 0, "correct": 0, "unsupported": 0, "inv": Fraction(0)} for c in catalogs}
    excluded = {rid for c in catalogs for rid in c["exclusions"]}
    for row in rows:
        if row["run_id"] in excluded:
            continue
        t = tally[row["catalog"]]
        t["n"] += 1
        t["inv"] += Fraction(1, row["n_options"])
        choice = choices.get(row["run_id"])
        if choice is None:
            t["unsupported"] += 1
        elif choice == row["gold"]:
            t["correct"] += 1
    out_cats: dict[str, dict[str, Any]] = {}
    for c in catalogs:
        t = tally[c["id"]]
        acc = t["correct"] / t["n"]
        chance = c["chance"] if c["chance"] is not None else float(t["inv"] / t["n"])
        out_cats[c["id"]] = {"n": t["n"], "correct": t["correct"], "unsupported": t["unsupported"], "acc": acc,
                             "chance": chance, "skill": (acc - chance) / (1.0 - chance),
                             "weight": c["weight"], "leg": c["leg"]}
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
