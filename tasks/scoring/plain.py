"""The second scorer: a plain loop over rows in pure Python, written from the definitions alone.

It shares nothing with the vectorised scorer (`tasks/scoring/index.py`) but the rows and predictions
it reads. Every score runs both (`tasks/scoring/score.py: score_twice`, for the campaign's score stage,
`jex score` and the interop imports alike) and fails on any difference, float bits included, so an
implementation slip in either one cannot reach a report.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NotRequired, TypedDict

FLOOR = 1e-15
GENERATIVE = ("exact_match", "maj_at_k", "pass_at_k")


class PlainCatalog(TypedDict):
    """A catalog as the plain scorer reads it (the manifest's fields, nothing derived)."""

    id: str
    leg: str
    weight: float
    chance: float | None
    exclusions: Collection[str]
    scoring: str
    secondary: Sequence[str]
    readout: NotRequired[str]


class PlainCatalogScore(TypedDict):
    n: int
    correct: int
    unsupported: int
    acc: float
    chance: float
    skill: float
    weight: float
    leg: str
    kind: str
    value: float
    abstained: int
    acc_norm: NotRequired[float]


class PlainLegScore(TypedDict):
    index: float
    raw: float


class PlainScore(TypedDict):
    """The same JSON shape as `Score.to_json()`, so the two can be compared key by key."""

    full: float
    full_raw: float
    legs: dict[str, PlainLegScore]
    catalogs: dict[str, PlainCatalogScore]


@dataclass
class _Tally:
    """What one catalog's rows add up to while the loop runs."""

    n: int = 0
    correct: int = 0
    correct_norm: int = 0
    unsupported: int = 0
    abstained: int = 0
    options: dict[int, int] = field(default_factory=dict)  # rows per number of options, for chance
    true_share: Fraction = Fraction(0)  # sum of t/k over rows listing t true options of k (true_mass chance)
    terms: list[float] = field(default_factory=list)  # per-row (brier: per-option) terms of the value


def _chance(kind: str, given: float | None, t: _Tally) -> float:
    options, n = t.options, t.n
    if kind in GENERATIVE:  # no answer matches by chance
        return given if given is not None else 0.0
    if kind == "true_mass":
        return given if given is not None else float(t.true_share / n)
    inv = sum((Fraction(m, k) for k, m in options.items()), Fraction(0))
    logk = sum((m * Fraction(math.log(k)) for k, m in options.items()), Fraction(0))
    if kind == "log_loss":
        return -math.log(given) if given is not None else float(logk / n)
    if kind == "brier":
        return 1.0 - given if given is not None else float(1 - inv / n)
    return given if given is not None else float(inv / n)


def _value_terms(kind: str, p: list[float] | None, gold: int, k: int) -> list[float]:
    """The row's terms of a probability kind's value; no prediction is the uniform forecast 1/k."""
    if p is None:
        p = [1.0 / k] * k
    if kind == "calibrated_accuracy":
        return [p[gold]]
    if kind == "log_loss":
        return [-math.log(max(p[gold], FLOOR))]
    diffs = [q - (1.0 if i == gold else 0.0) for i, q in enumerate(p)]  # brier
    return [d * d for d in diffs]


def _tally_rows(rows: Iterable[Mapping[str, Any]], catalogs: Sequence[PlainCatalog],
                choices: Mapping[str, int | None], probs: Mapping[str, list[float] | None],
                abstain: Mapping[str, bool | None], norm: Mapping[str, int | None],
                mass: Mapping[str, float | None], verdicts: Mapping[str, bool | None],
                passes: Mapping[str, float | None]) -> dict[str, _Tally]:
    """One pass over the rows: counts, correct choices, unsupported and abstained rows, value terms."""
    tally = {c["id"]: _Tally() for c in catalogs}
    kinds = {c["id"]: c["scoring"] for c in catalogs}
    may_abstain = {c["id"] for c in catalogs if "abstain" in c["secondary"]}
    excluded = {rid for c in catalogs for rid in c["exclusions"]}
    for row in rows:
        rid = row["run_id"]
        if rid in excluded:
            continue
        cat, k, gold = row["catalog"], row["n_options"], row["gold"]
        t = tally[cat]
        t.n += 1
        kind = kinds[cat]
        if kind in GENERATIVE:  # a generative row: its verdict (and pass@k), nothing else
            verdict, passed = verdicts.get(rid), passes.get(rid)
            if abstain.get(rid) and cat in may_abstain:
                t.abstained += 1
                verdict = passed = None
            t.correct += verdict is True
            if kind == "pass_at_k":  # no estimate: 0
                t.unsupported += passed is None
                t.terms.append(passed if passed is not None else 0.0)
            else:
                t.unsupported += verdict is None
            continue
        t.options[k] = t.options.get(k, 0) + 1
        true_options = row.get("true_options")
        n_true = None if true_options is None else len(true_options)
        if n_true is not None:
            t.true_share += Fraction(n_true, k)
        choice, p, choice_norm, row_mass = choices.get(rid), probs.get(rid), norm.get(rid), mass.get(rid)
        if abstain.get(rid) and cat in may_abstain:
            t.abstained += 1
            choice = p = choice_norm = row_mass = None
        if choice is not None and choice == gold:
            t.correct += 1
        if choice_norm is not None and choice_norm == gold:
            t.correct_norm += 1
        if {"accuracy": choice, "acc_norm": choice_norm, "true_mass": row_mass}.get(kind, p) is None:
            t.unsupported += 1
        if kind == "true_mass":  # no mass read: the uniform forecast's, t/k
            t.terms.append(row_mass if row_mass is not None else n_true / k)
        elif kind not in ("accuracy", "acc_norm"):
            t.terms.extend(_value_terms(kind, p, gold, k))
    return tally


def _catalog_score(c: PlainCatalog, t: _Tally) -> PlainCatalogScore:
    """value, chance and skill of one catalog from its tally."""
    kind = c["scoring"]
    acc = t.correct / t.n
    acc_norm = t.correct_norm / t.n
    value = acc if kind in ("accuracy", "exact_match", "maj_at_k") else acc_norm if kind == "acc_norm" else \
        math.fsum(t.terms) / t.n
    chance = _chance(kind, c["chance"], t)
    best = 0.0 if kind in ("brier", "log_loss") else 1.0
    out: PlainCatalogScore = {"n": t.n, "correct": t.correct, "unsupported": t.unsupported, "acc": acc,
                              "chance": chance, "skill": (value - chance) / (best - chance), "weight": c["weight"],
                              "leg": c["leg"], "kind": kind, "value": value, "abstained": t.abstained}
    if kind == "acc_norm" or c.get("readout") == "loglikelihood":  # lm-eval reports both for these
        out["acc_norm"] = acc_norm
    return out


def _leg_score(members: Sequence[PlainCatalog], scores: Mapping[str, PlainCatalogScore]) -> PlainLegScore:
    """100 x the weighted mean of the members' skill (index) and accuracy (raw)."""
    weights = math.fsum(c["weight"] for c in members)
    index_terms = [c["weight"] * scores[c["id"]]["skill"] for c in members]
    raw_terms = [c["weight"] * scores[c["id"]]["acc"] for c in members]
    return {"index": 100.0 * math.fsum(index_terms) / weights, "raw": 100.0 * math.fsum(raw_terms) / weights}


def plain_score(rows: Iterable[Mapping[str, Any]], choices: Mapping[str, int | None], legs: Mapping[str, float],
                catalogs: Sequence[PlainCatalog], probs: Mapping[str, list[float] | None] | None = None,
                abstain: Mapping[str, bool | None] | None = None,
                acc_norm: Mapping[str, int | None] | None = None,
                true_mass: Mapping[str, float | None] | None = None,
                exact_match: Mapping[str, bool | None] | None = None,
                pass_at_k: Mapping[str, float | None] | None = None) -> PlainScore:
    """rows: dicts with run_id, catalog, gold, n_options[, true_options]; choices, probs, abstain, acc_norm
    (lm-eval's length-normalised choices), true_mass (the mass of a row's true options), exact_match (a
    generative row's verdict), pass_at_k (its samples' pass@k): by run_id (a run_id absent is no prediction);
    catalogs: id, leg, weight, chance, exclusions, scoring, secondary[, readout]."""
    tally = _tally_rows(rows, catalogs, choices, probs or {}, abstain or {}, acc_norm or {}, true_mass or {},
                        exact_match or {}, pass_at_k or {})
    out_cats = {c["id"]: _catalog_score(c, tally[c["id"]]) for c in catalogs}
    out_legs = {leg: _leg_score([c for c in catalogs if c["leg"] == leg], out_cats) for leg in legs}
    total = math.fsum(legs.values())
    full = math.fsum(legs[leg] * out_legs[leg]["index"] for leg in legs) / total
    full_raw = math.fsum(legs[leg] * out_legs[leg]["raw"] for leg in legs) / total
    return {"full": full, "full_raw": full_raw, "legs": out_legs, "catalogs": out_cats}
