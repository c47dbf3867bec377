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
    LOGLIKELIHOOD_READOUTS,
    ScoringKind,
    check_campaign_catalogs,
    iter_rows,
    load_manifest,
    read_row_file,
)
from jex.tasks.capture.bundle import PolarsType, open_bundle

SCORING_COLUMNS = ["run_id", "catalog", "question_id", "gold", "n_options", "true_options"]
"""The suite table's rows; `true_options` is null on a row that does not list them (`SuiteRow`)."""
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


@dataclass(frozen=True)
class SuiteTable:
    spec: ScoreSpec
    rows: pl.DataFrame  # SCORING_COLUMNS, suite order
    sha256: dict[str, str]


def load_suite_table(source: str | Path) -> SuiteTable:
    """Read the scored columns from a suite folder (validated row by row) or a bundle (verified)."""
    source = Path(source)
    if source.is_file():
        with tempfile.TemporaryDirectory(prefix="jex-score-") as tmp:
            bundle = open_bundle(source, tmp)
            spec = ScoreSpec.from_manifest(bundle.suite_manifest())
            scan = pl.scan_parquet(bundle.row_shards())
            true = pl.col("true_options") if "true_options" in scan.collect_schema() else pl.lit(None)
            rows = scan.select("run_id", "catalog", "question_id", "gold",
                               pl.col("options").list.len().cast(pl.Int32).alias("n_options"),
                               true.cast(pl.List(pl.Int32)).alias("true_options")).collect()
        return SuiteTable(spec, rows, {"bundle": bundle.sha256})
    manifest = load_manifest(source)
    check_campaign_catalogs(manifest, str(source / "suite.toml"))  # the scorers have no exact_match kind yet
    data: dict[str, list[Any]] = {c: [] for c in SCORING_COLUMNS}
    for r in iter_rows(source, manifest):
        for col, val in (("run_id", r.run_id), ("catalog", r.catalog), ("question_id", r.question_id),
                         ("gold", r.gold), ("n_options", len(r.options)),
                         ("true_options", r.true_options)):
            data[col].append(val)
    rows = pl.DataFrame(data, schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                      "gold": pl.Int32, "n_options": pl.Int32, "true_options": pl.List(pl.Int32)})
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
                                           "true_mass": pl.Float64}


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
    """Read `run_id, choice[, probs][, abstain][, acc_norm_choice][, true_mass]` and check them against the
    suite rows.

    Errors name the file, row and field: a duplicate or unknown run_id, a choice that is not an
    integer or lies outside the row's options, probs that are not a distribution over the row's
    options, an abstain flag that is not a boolean, a true_mass outside [0, 1]. A missing prediction
    is not an error: scoring counts it as unsupported.
    """
    path = Path(path)
    n_options = dict(zip(suite["run_id"].to_list(), suite["n_options"].to_list(), strict=True))
    run_ids: list[str] = []
    choices: list[int | None] = []
    probs: list[list[float] | None] = []
    abstain: list[bool | None] = []
    norm: list[int | None] = []
    mass: list[float | None] = []
    seen: set[str] = set()
    for line, rec in read_row_file(path):
        where: _Where = {"file": str(path), "row": line}
        if not isinstance(rec, dict):
            raise InputError("a prediction must be an object with run_id and choice", **where)
        if "run_id" not in rec:
            raise InputError("missing run_id", field="run_id", **where)
        if "choice" not in rec:
            raise InputError("missing choice (use null for no answer)", field="choice", **where)
        rid, choice = str(rec["run_id"]), rec["choice"]
        if rid in seen:
            raise InputError(f"duplicate prediction for run_id '{rid}'", field="run_id", **where)
        if rid not in n_options:
            raise InputError(f"run_id '{rid}' is not in the suite", field="run_id", **where)
        for name in ("choice", "acc_norm_choice"):
            _check_choice(rec.get(name), name, n_options[rid], where)
        flag = rec.get("abstain")
        if flag is not None and not isinstance(flag, bool):
            raise InputError(f"abstain must be true, false or null, got {flag!r}", field="abstain", **where)
        probs.append(_check_probs(rec.get("probs"), n_options[rid], where))
        mass.append(_check_mass(rec.get("true_mass"), where))
        abstain.append(flag)
        norm.append(rec.get("acc_norm_choice"))
        seen.add(rid)
        run_ids.append(rid)
        choices.append(choice)
    return pl.DataFrame({"run_id": run_ids, "choice": choices, "probs": probs, "abstain": abstain,
                         "acc_norm_choice": norm, "true_mass": mass}, schema=PREDICTION_SCHEMA)


def _check_mass(mass: Any, where: _Where) -> float | None:
    """`true_mass`: null or a probability (the mass of the row's true options)."""
    if mass is None:
        return None
    if isinstance(mass, bool) or not isinstance(mass, int | float) or not 0 <= mass <= 1:
        raise InputError(f"true_mass must be a probability or null, got {mass!r}", field="true_mass", **where)
    return float(mass)


def _check_choice(choice: Any, name: str, k: int, where: _Where) -> None:
    """`choice` (or `acc_norm_choice`, lm-eval's length-normalised one): null or an option index."""
    if choice is None:
        return
    if isinstance(choice, bool) or not isinstance(choice, int):
        raise InputError(f"{name} must be an option index or null, got {choice!r}", field=name, **where)
    if not 0 <= choice < k:
        raise InputError(f"{name} {choice} out of range for {k} options", field=name, **where)

