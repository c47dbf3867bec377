"""What scoring reads: the suite table (the suite's scored rows and its `ScoreSpec`: catalogs, legs,
weights, scoring kinds) and a predictions file checked against it, both validated.

Both scorers start from these frames; nothing else is shared between them.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypedDict

import polars as pl

from jex.errors import InputError
from jex.fileio import sha256_file
from jex.suite import (
    GENERATIVE_KINDS,
    LOGLIKELIHOOD_READOUTS,
    ScoringKind,
    SuiteRow,
    iter_all_rows,
    load_manifest,
    read_row_file,
)
from jex.tasks.bundle.bundle_file import PolarsType, open_bundle

SCORING_COLUMNS = ["run_id", "catalog", "question_id", "gold", "n_options", "true_options"]
"""The suite table's rows; `true_options` is null on a row that does not list them (`SuiteRow`); a generative
catalog's row has no gold, options or true options (its verdict, `exact_match`, is a prediction)."""
SCORING_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                         "gold": pl.Int32, "n_options": pl.Int32, "true_options": pl.List(pl.Int32)}
CHOICE_KINDS = ("accuracy", "acc_norm")
PROBABILITY_KINDS = ("brier", "log_loss", "calibrated_accuracy")
PROB_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class CatalogSpec:
    id: str
    leg: str
    weight: float
    chance: float | None
    exclusions: frozenset[str] = field(default_factory=frozenset)
    scoring: ScoringKind = "accuracy"
    secondary: tuple[str, ...] = ()
    readout: str = "label_slot"
    prompt_format: str = "template"
    area: str = "general"
    """The manifest's `area`: the report's per-area table groups catalogs by it (not a weight)."""

    @property
    def reports_acc_norm(self) -> bool:
        """lm-eval's `acc_norm` is reported beside `acc` (a loglikelihood catalog, or one scored by it)."""
        return self.readout == "loglikelihood" or self.scoring == "acc_norm"  # not partial: lm-eval normalises
        # a partial-evaluation task's acc_norm by its choices' texts, not by the contexts jex reads

    @property
    def generative(self) -> bool:
        """A generative catalog: its rows are generated and scored by the verdicts of their extracted answers."""
        return self.scoring in GENERATIVE_KINDS

    @property
    def final_at_fast_pass(self) -> bool:
        """The coverage gate never sends its rows to the reason stage: a loglikelihood catalog's answer is
        its options' log-likelihoods, and a verbatim prompt has no question for jex's reasoning template."""
        return self.readout in LOGLIKELIHOOD_READOUTS or self.prompt_format == "verbatim"


@dataclass(frozen=True)
class ScoreSpec:
    """The scoring-relevant part of a suite manifest, in manifest order."""

    legs: dict[str, float]
    catalogs: tuple[CatalogSpec, ...]

    @classmethod
    def from_manifest(cls, manifest: Any) -> ScoreSpec:
        return cls(legs=dict(manifest.legs), catalogs=tuple(
            CatalogSpec(c.id, c.leg, c.weight, c.chance, frozenset(c.exclusions), c.scoring, tuple(c.secondary),
                        c.readout, c.prompt_format, c.area)
            for c in manifest.catalogs))

    def as_accuracy(self) -> ScoreSpec:
        """The same suite with every catalog scored by accuracy (what decision-only counters use)."""
        return replace(self, catalogs=tuple(replace(c, scoring="accuracy", secondary=()) for c in self.catalogs))

    @property
    def needs_probs(self) -> bool:
        return any(c.scoring in PROBABILITY_KINDS for c in self.catalogs)

    def multiple_choice(self) -> ScoreSpec:
        """The suite less its generative catalogs (and the legs left without a catalog): what the decision
        stages, which read the fast pass and the rationales, score."""
        catalogs = tuple(c for c in self.catalogs if not c.generative)
        return ScoreSpec(legs={leg: w for leg, w in self.legs.items() if any(c.leg == leg for c in catalogs)},
                         catalogs=catalogs)


@dataclass(frozen=True)
class SuiteTable:
    spec: ScoreSpec
    rows: pl.DataFrame  # SCORING_COLUMNS, suite order: the multiple-choice rows, then the generative ones
    sha256: dict[str, str]

    def multiple_choice(self) -> SuiteTable:
        """The table less its generative catalogs and their rows (`ScoreSpec.multiple_choice`)."""
        spec = self.spec.multiple_choice()
        if spec == self.spec:
            return self
        kept = [c.id for c in spec.catalogs]
        return replace(self, spec=spec, rows=self.rows.filter(pl.col("catalog").is_in(kept)))


def load_suite_table(source: str | Path) -> SuiteTable:
    """Read the scored columns from a suite folder (validated row by row) or a bundle (verified)."""
    source = Path(source)
    if source.is_file():
        with tempfile.TemporaryDirectory(prefix="jex-score-") as tmp:
            bundle = open_bundle(source, tmp)
            spec = ScoreSpec.from_manifest(bundle.suite_manifest())
            scan = pl.scan_parquet(bundle.row_shards()) if bundle.row_shards() else bundle.rows().lazy()
            true = pl.col("true_options") if "true_options" in scan.collect_schema() else pl.lit(None)
            rows = scan.select("run_id", "catalog", "question_id", "gold",
                               pl.col("options").list.len().cast(pl.Int32).alias("n_options"),
                               true.cast(pl.List(pl.Int32)).alias("true_options")).collect()
            generative = bundle.generation_rows().select("run_id", "catalog", "question_id")
        if generative.height:
            rows = pl.concat([rows, generative], how="diagonal_relaxed").select(
                [pl.col(c).cast(t) for c, t in SCORING_SCHEMA.items()])
        return SuiteTable(spec, rows, {"bundle": bundle.sha256})
    manifest = load_manifest(source)
    data: dict[str, list[Any]] = {c: [] for c in SCORING_COLUMNS}
    later: list[tuple[str, str, str]] = []  # generative rows: after the multiple-choice ones, as in a bundle
    for r in iter_all_rows(source, manifest):
        if not isinstance(r, SuiteRow):
            later.append((r.run_id, r.catalog, r.question_id))
            continue
        for col, val in (("run_id", r.run_id), ("catalog", r.catalog), ("question_id", r.question_id),
                         ("gold", r.gold), ("n_options", len(r.options)),
                         ("true_options", r.true_options)):
            data[col].append(val)
    for run_id, catalog, question_id in later:
        for col, val in (("run_id", run_id), ("catalog", catalog), ("question_id", question_id), ("gold", None),
                         ("n_options", None), ("true_options", None)):
            data[col].append(val)
    rows = pl.DataFrame(data, schema=SCORING_SCHEMA)
    files = [source / "suite.toml", *(source / f for c in manifest.catalogs for f in c.files)]
    return SuiteTable(ScoreSpec.from_manifest(manifest), rows,
                      {f"suite/{p.relative_to(source).as_posix()}": sha256_file(p) for p in files})


FAST_PASS_SCORING_COLUMNS = ("acc_norm_choice", "true_mass")
"""lm-eval's per-row scoring read from the fast pass's continuation log-likelihoods: the length-normalised
choice and the mass of the true options. They are in a run only where a catalog reads log-likelihoods
(its other rows null), and travel as they are from the fold to the predictions: folding, calibrating and
overlays never change them."""
PREDICTION_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "choice": pl.Int32, "probs": pl.List(pl.Float64),
                                           "abstain": pl.Boolean, "acc_norm_choice": pl.Int32,
                                           "true_mass": pl.Float64, "exact_match": pl.Boolean,
                                           "pass_at_k": pl.Float64}
"""A predictions file's columns; a generative row's prediction is its `exact_match` verdict (its choice null) and, in
a catalog scored by pass_at_k, its `pass_at_k`."""


class _Where(TypedDict):
    """Where a prediction is, as `InputError` takes it."""

    file: str
    row: int


def _check_probs(probs: Any, k: int, where: _Where) -> list[float] | None:
    """`probs`: null or one probability per option, each in [0, 1], summing to 1 within 1e-6."""
    if probs is None:
        return None
    if not isinstance(probs, list) or len(probs) != k or any(
            isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1 for p in probs):
        raise InputError(f"probs must be null or {k} numbers in [0, 1], one per option, got {probs!r}",
                         field="probs", **where)
    if abs(math.fsum(probs) - 1) > PROB_SUM_TOLERANCE:
        raise InputError(f"probs must sum to 1 (within {PROB_SUM_TOLERANCE:g}), got {math.fsum(probs)!r}",
                         field="probs", **where)
    return [float(p) for p in probs]


def load_predictions(path: str | Path, suite: pl.DataFrame) -> pl.DataFrame:
    """Read `run_id, choice[, probs][, abstain][, acc_norm_choice][, true_mass][, exact_match][, pass_at_k]` and
    check them against the suite rows (a generative catalog's row: `run_id, exact_match[, pass_at_k]`).

    Errors name the file, row and field: a duplicate or unknown run_id, a choice that is not an
    integer or lies outside the row's options, probs that are not a distribution over the row's
    options, an abstain flag that is not a boolean, a true_mass or pass_at_k outside [0, 1], a generative row's
    verdict that is not a boolean (or a choice given to it). A missing prediction is not an error:
    scoring counts it as unsupported.
    """
    path = Path(path)
    n_options = dict(zip(suite["run_id"].to_list(), suite["n_options"].to_list(), strict=True))
    run_ids: list[str] = []
    choices: list[int | None] = []
    probs: list[list[float] | None] = []
    abstain: list[bool | None] = []
    norm: list[int | None] = []
    mass: list[float | None] = []
    verdicts: list[bool | None] = []
    passes: list[float | None] = []
    seen: set[str] = set()
    for line, rec in read_row_file(path):
        where: _Where = {"file": str(path), "row": line}
        if not isinstance(rec, dict):
            raise InputError("a prediction must be an object with run_id and choice", **where)
        if "run_id" not in rec:
            raise InputError("missing run_id", field="run_id", **where)
        rid, choice = str(rec["run_id"]), rec.get("choice")
        if rid in seen:
            raise InputError(f"duplicate prediction for run_id '{rid}'", field="run_id", **where)
        if rid not in n_options:
            raise InputError(f"run_id '{rid}' is not in the suite", field="run_id", **where)
        verdict = _check_verdict(rec, generative=n_options[rid] is None, where=where)
        passes.append(_check_mass(rec.get("pass_at_k"), where, "pass_at_k"))  # a multiple-choice row's: refused
        if n_options[rid] is None:  # a generative row: its verdict is all it predicts
            run_ids.append(rid)
            choices.append(None)
            probs.append(None)
            abstain.append(_check_abstain(rec.get("abstain"), where))
            norm.append(None)
            mass.append(None)
            verdicts.append(verdict)
            seen.add(rid)
            continue
        if "choice" not in rec:
            raise InputError("missing choice (use null for no answer)", field="choice", **where)
        for name in ("choice", "acc_norm_choice"):
            _check_choice(rec.get(name), name, n_options[rid], where)
        flag = _check_abstain(rec.get("abstain"), where)
        probs.append(_check_probs(rec.get("probs"), n_options[rid], where))
        mass.append(_check_mass(rec.get("true_mass"), where))
        verdicts.append(None)
        abstain.append(flag)
        norm.append(rec.get("acc_norm_choice"))
        seen.add(rid)
        run_ids.append(rid)
        choices.append(choice)
    return pl.DataFrame({"run_id": run_ids, "choice": choices, "probs": probs, "abstain": abstain,
                         "acc_norm_choice": norm, "true_mass": mass, "exact_match": verdicts, "pass_at_k": passes},
                        schema=PREDICTION_SCHEMA)


def _check_abstain(flag: Any, where: _Where) -> bool | None:
    """`abstain`: true, false or null."""
    if flag is not None and not isinstance(flag, bool):
        raise InputError(f"abstain must be true, false or null, got {flag!r}", field="abstain", **where)
    return flag


def _check_verdict(rec: dict[str, Any], *, generative: bool, where: _Where) -> bool | None:
    """A generative row's `exact_match`: true, false or null (no verdict), and nothing a choice row reads; a
    multiple-choice row has none."""
    verdict = rec.get("exact_match")
    if not generative:
        if rec.get("pass_at_k") is not None:
            raise InputError("pass_at_k is a generative catalog's row's; this row is multiple choice (give its "
                             "choice)", field="pass_at_k", **where)
        if verdict is not None:
            raise InputError("exact_match is the verdict of a generative catalog's row; this row is multiple "
                             "choice (give its choice)", field="exact_match", **where)
        return None
    if verdict is not None and not isinstance(verdict, bool):
        raise InputError(f"exact_match must be true, false or null, got {verdict!r}", field="exact_match", **where)
    given = [k for k in ("choice", "probs", "acc_norm_choice", "true_mass") if rec.get(k) is not None]
    if given:
        raise InputError(f"a generative catalog's row is scored by its exact_match verdict; it has no {given[0]}",
                         field=given[0], **where)
    return verdict


def _check_mass(mass: Any, where: _Where, name: str = "true_mass") -> float | None:
    """`true_mass` (the mass of the row's true options) or `pass_at_k`: null or a probability."""
    if mass is None:
        return None
    if isinstance(mass, bool) or not isinstance(mass, int | float) or not 0 <= mass <= 1:
        raise InputError(f"{name} must be a probability or null, got {mass!r}", field=name, **where)
    return float(mass)


def _check_choice(choice: Any, name: str, k: int, where: _Where) -> None:
    """`choice` (or `acc_norm_choice`, lm-eval's length-normalised one): null or an option index."""
    if choice is None:
        return
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise InputError(f"{name} must be an option index or null, got {choice!r}", field=name, **where)
    if not 0 <= choice < k:
        raise InputError(f"{name} {choice} out of range for {k} options", field=name, **where)

