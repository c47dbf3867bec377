"""The JSON documents the campaign's stages write, typed: `score.json` (and `baseline_score.json`),
`fold.json`, `calibration.json`, and the golden replay's verdict (which the fleet's `machines.json`
carries, `flows/machines/machines_doc.py`).

Each document is built once, by the stage that writes it (`write_doc`), and read back through its
model everywhere else (`read_doc`): no reader indexes a dictionary by key. The files keep the keys and
values they always had (`canonical_json` sorts the keys); a field named in `omit_if_none` is left
out of the file while it is None, as it was absent before these records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, model_serializer

from jex.fileio import write_json
from jex.tasks.records import FailedRow, RationaleTokens, Record

Interval = tuple[float, float]
"""A 95% interval (low, high); a two-element list in the JSON."""

FoldRule = Literal["replace", "mix"]


class Document(Record):
    """A record written as one JSON file (or a part of one)."""


D = TypeVar("D", bound=Document)


def read_doc(kind: type[D], path: str | Path) -> D:
    """A document file, validated as `kind` (an unknown or missing field is refused by name)."""
    return kind.model_validate_json(Path(path).read_bytes())


def write_doc(path: str | Path, doc: Document) -> str:
    """Write a document atomically as canonical JSON; returns the sha256 of the bytes written."""
    return write_json(path, doc.model_dump(mode="json"))


# -- score.json ---------------------------------------------------------------------------------------

class LegScore(Document):
    index: float = Field(description="100 x the weighted mean skill of the leg's catalogs")
    raw: float = Field(description="100 x the weighted mean accuracy of the leg's catalogs")
    ci: Interval = Field(description="95% clustered bootstrap interval of `index`")


class CatalogResult(Document):
    """One catalog's score (`tasks/scoring/index.py` defines every field)."""

    n: int = Field(description="Scored rows (exclusions dropped)")
    correct: int
    unsupported: int = Field(description="Rows without the prediction the kind reads (scored as none)")
    acc: float = Field(description="Accuracy of the choices, whatever the scoring kind")
    chance: float = Field(description="The kind's value of the uniform guess")
    skill: float = Field(description="(value - chance) / (best - chance)")
    weight: float = Field(description="The catalog's weight within its leg")
    leg: str
    kind: str = Field(description="Scoring kind: accuracy | calibrated_accuracy | brier | log_loss")
    value: float = Field(description="The kind's value: accuracy, mean p[gold], Brier score or log loss")
    abstained: int = Field(description="Rows flagged `abstain` in a catalog that declares it")
    ci: Interval = Field(description="95% clustered bootstrap interval of `skill`")
    acc_norm: float | None = Field(None, description="lm-eval's length-normalised accuracy, for loglikelihood "
                                                     "catalogs and those scored by it (absent elsewhere)")

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: Any) -> Any:
        """`acc_norm` is left out where it is None, so catalogs without it keep their bytes."""
        doc = handler(self)
        if doc.get("acc_norm", 0) is None:
            del doc["acc_norm"]
        return doc


class BootstrapParams(Document):
    """How the intervals were drawn (`tasks/scoring/bootstrap_ci.py`)."""

    draws: int
    seed: int
    cluster: Literal["question_id"] = "question_id"
    strata: Literal["catalog"] = "catalog"
    interval: Literal["95% percentile"] = "95% percentile"


class CatalogAgreement(Document):
    compared: int
    agree: int
    argmax_agreement: float


class ReferenceFlip(Document):
    """A compared row whose choice differs from the reference's."""

    run_id: str
    catalog: str
    reference_choice: int
    run_choice: int
    gold: int
    pre_margin: float | None = Field(description="The run's fast-pass top-1 minus top-2 log-odds")
    reference_margin: float | None = Field(description="The same of the reference's probabilities")


class ReferenceComparison(Document):
    """One prediction set against the bundle's reference rows (`tasks/scoring/reference_audit.py`)."""

    rows: int = Field(description="Reference rows (1:1 with the bundle's rows)")
    compared: int = Field(description="Rows where both sides have a choice")
    run_missing: int
    reference_missing: int
    agree: int
    flips: int = Field(description="compared - agree (all counted; the first FLIP_ROWS listed)")
    argmax_agreement: float | None = Field(description="agree / compared; None when no row was compared")
    mean_abs_dp: float | None = Field(description="Over every option of the rows with probabilities on both sides")
    p95_abs_dp: float | None
    max_abs_dp: float | None
    flip_pre_margin_median: float | None
    flip_pre_margin_max: float | None
    catalogs: dict[str, CatalogAgreement]
    flip_rows: list[ReferenceFlip]


class ReferenceAudit(Document):
    fast_pass: ReferenceComparison
    final: ReferenceComparison


class ScoreDoc(Document):
    """`score.json` (and `baseline_score.json`: the fast pass alone), `jex score`'s output."""

    full: float = Field(description="The composite index: the legs' indices weighted")
    full_raw: float = Field(description="The same with accuracy in place of skill")
    legs: dict[str, LegScore]
    catalogs: dict[str, CatalogResult]
    ci: Interval = Field(description="95% clustered bootstrap interval of `full`")
    bootstrap: BootstrapParams
    reference_audit: ReferenceAudit | None = Field(None, description="When the bundle carries reference rows")
    provenance: dict[str, Any] | None = Field(None, description="The run's provenance block (`jex/provenance.py`); "
                                                                "the run folder's and `jex score`'s copies")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"reference_audit", "provenance"})


# -- fold.json ----------------------------------------------------------------------------------------

class FoldCounters(Document):
    """The fold's dry-run counters over a set of rows, measured by accuracy whatever the scoring kind."""

    panel_rows: int
    gated: int
    folded: int = Field(description="Gated rows whose post-thought readout was folded in")
    fold_missing: int = Field(description="Gated rows without a post-thought readout (fast pass kept)")
    fixed: int = Field(description="Gated rows wrong before the fold and right after it")
    flipped: int = Field(description="Gated rows right before the fold and wrong after it")
    gated_wrong_before: int
    fix_rate: float | None = Field(description="fixed / gated_wrong_before; None when no gated row was wrong")
    baseline_acc: float | None = Field(description="Accuracy of the fast pass's choices")
    policy_acc: float | None = Field(description="Accuracy of the folded choices")


class FoldOverall(FoldCounters):
    reasoned: int = Field(description="Rationales re-read without a refusal")


class FoldCatalog(FoldCounters):
    delta_skill: float = Field(description="Skill after the fold minus before it")
    delta_skill_ci: Interval = Field(description="Paired 95% bootstrap interval of `delta_skill`")


class ErrorCounters(Document):
    """Every error of the capture, disjoint per stage; all zero on a clean run (`fold.error_counters`).
    In the order of the file (sorted), which the report lists them in."""

    batch_errors: int = Field(description="Rows whose engine batch still failed after retry and split")
    context_refusals: int = Field(description="Prompts that do not fit (fast pass and rationale prompts)")
    key_fallbacks: int = Field(description="Fast-pass rows read through the continuation fallback")
    mechanism_failures: int = Field(description="Rationales that could not be re-read")
    readout_errors: int = Field(description="Fast-pass rows not read for another reason")
    unmatched_rows: int = Field(description="Reasoned rows that are not gated panel rows (the fold refuses them)")


class ErrorRow(Document):
    run_id: str
    why: str


class FoldRuleParams(Document):
    rule: FoldRule
    weight: float = Field(description="The post-thought readout's weight under `mix`")


class FoldDoc(Document):
    """`fold.json`: the fold's dry-run counters and every error counter of the capture."""

    overall: FoldOverall
    catalogs: dict[str, FoldCatalog]
    delta_full_ci: Interval = Field(description="Paired 95% bootstrap interval of the full index's delta")
    delta_legs_ci: dict[str, Interval]
    errors: ErrorCounters
    error_rows: dict[str, list[ErrorRow]] = Field(description="The rows behind each non-zero counter (the first 50)")
    rule: FoldRuleParams
    rationale_tokens: RationaleTokens
    failed_rows: dict[str, list[FailedRow]] | None = Field(
        None, description="Every row behind `batch_errors`, by engine stage (`fast_pass`, `reason`): run_id, "
                          "attempts, last error; absent when none failed")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"failed_rows"})

    def failed_lines(self) -> list[str]:
        """One line per engine stage with failed rows (`failed_rows_line`); none on a clean run."""
        return [failed_rows_line(stage, rows) for stage, rows in (self.failed_rows or {}).items()]


def failed_rows_line(stage: str, rows: list[FailedRow], shown: int = 20) -> str:
    """`fast pass: 2 rows failed after 3 attempts: ids a, b` (the first `shown` ids, then how many more)."""
    tries = sorted({r.attempts for r in rows})
    after = str(tries[0]) if len(tries) == 1 else f"{tries[0]} to {tries[-1]}"
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return (f"{stage.replace('_', ' ')}: {len(rows)} row{'' if len(rows) == 1 else 's'} failed after {after} "
            f"attempt{'' if tries == [1] else 's'}: ids {', '.join(r.run_id for r in rows[:shown])}{more}")


# -- calibration.json ---------------------------------------------------------------------------------

class ReliabilityBin(Document):
    bin: int
    n: int
    confidence: float = Field(description="Mean top-1 probability of the bin's rows")
    accuracy: float


class Reliability(Document):
    ece: float = Field(description="Expected calibration error over the bins")
    bins: list[ReliabilityBin] = Field(description="The non-empty bins of top-1 probability")


class FoldTemperature(Document):
    fold: int
    temperature: float = Field(description="Fitted on the other folds")
    rows: int


class CalibrationDoc(Document):
    """`calibration.json`: temperature scaling, fitted out of fold by question."""

    folds: list[FoldTemperature]
    nll_before: float | None = Field(description="None: no multiple-choice row was calibrated")
    nll_after: float | None
    reliability_before: Reliability | None
    reliability_after: Reliability | None
    argmax_changed: int = Field(description="Always 0: the stage fails otherwise")
    rounding_ties: int = Field(description="Rows that scaling tied by rounding (their choice is kept)")


# -- the golden replay (a part of the fleet's machines.json) ------------------------------------------

class GoldenRow(Document):
    run_id: str
    max_abs_dp: float = Field(description="Max |p_ref - p_replay| over the row's options")
    argmax_ref: int
    argmax_replay: int


class GenerationVerdict(Document):
    """A machine's golden generation (greedy, the reason stage's prompts) against the reference of the
    same bundle, engine and GPU models (`capture/golden.py: compare_generation`): token for token."""

    ok: bool = Field(description="Every row's tokens identical to the reference's (or this became the reference)")
    rows: int
    tokens: int = Field(description="New tokens per row")
    reference: str = Field(description="The reference file compared with, or the one this generation established")
    established: bool = Field(False, description="No reference existed: this generation became it")
    differing: list[str] = Field(default_factory=list, description="Rows whose tokens differ: run_id and the first "
                                                                   "differing position")


class GoldenVerdict(Document):
    """A machine's golden replay compared with the stored reference (`capture/golden.py: compare_golden`)."""

    ok: bool = Field(description="No problem and max_abs_dp <= tolerance: the machine may run its shards")
    rows: int
    max_abs_dp: float = Field(description="Max |dp| over every row and option")
    tolerance: float
    worst: list[GoldenRow] = Field(default_factory=list, description="The rows with the largest |dp|, worst first")
    problems: list[str] = Field(default_factory=list, description="Rows missing on a side, or refused differently")
