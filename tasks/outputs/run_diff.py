"""`jex diff RUN_A RUN_B`: the rows whose final decision differs between two runs of the same bundle.

Read from each run folder's own records (`stages.json` for the bundle each read, `samples.parquet` for
every row's prompt, readouts, rationale and final choice); nothing is recomputed. Two runs of different
bundles are refused: their rows are not the same rows. Each differing row says which way it went:
`fixed` (wrong in A, right in B), `broken` (right in A, wrong in B) or `changed` (wrong in both, or a
row not scored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import polars as pl
from pydantic import Field

from jex.errors import InputError
from jex.record import Record
from jex.run_records import RunStages
from jex.tasks.outputs.samples import SAMPLES_FILE

Way = Literal["fixed", "broken", "changed"]


class DifferingRow(Record):
    """One row whose final choice differs: both sides' choice, probabilities, rationale and decider."""

    run_id: str
    catalog: str
    question_id: str
    gold: int
    way: Way
    choice_a: int | None
    choice_b: int | None
    label_a: str | None
    label_b: str | None
    probs_a: list[float] | None
    probs_b: list[float] | None
    decided_by_a: str | None
    decided_by_b: str | None
    rationale_a: str | None
    rationale_b: str | None
    prompt: str | None = Field(description="The fast-pass prompt (A's; the same bundle and render give B's)")


class CatalogDiff(Record):
    rows: int
    differing: int
    fixed: int
    broken: int
    changed: int


class RunDiff(Record):
    """The whole comparison (`jex diff --json`)."""

    run_a: str
    run_b: str
    bundle: str = Field(description="The bundle key both runs read")
    rows: int
    differing: int
    catalogs: dict[str, CatalogDiff]
    rows_differing: list[DifferingRow]


COLUMNS = ("run_id", "catalog", "question_id", "gold", "labels", "choice", "correct", "scored", "final_probs",
           "decided_by", "rationale", "prompt")


def _samples(run_dir: Path) -> pl.DataFrame:
    path = run_dir / SAMPLES_FILE
    if not path.exists():
        raise InputError("no samples.parquet: not a finished run folder", file=str(run_dir))
    return pl.read_parquet(path, columns=list(COLUMNS))


def _bundle_key(run_dir: Path) -> str:
    try:
        return RunStages.read(run_dir).root["bundle"].key
    except (OSError, KeyError, ValueError) as e:
        raise InputError(f"no bundle in stages.json ({type(e).__name__})", file=str(run_dir)) from None


def diff_runs(run_a: str | Path, run_b: str | Path) -> RunDiff:
    """The rows of two runs of one bundle whose final choice differs, in suite order, and the counts per
    catalog; refused (`InputError`) when the runs read different bundles."""
    a_dir, b_dir = Path(run_a), Path(run_b)
    key_a, key_b = _bundle_key(a_dir), _bundle_key(b_dir)
    if key_a != key_b:
        raise InputError(f"the runs read different bundles ({key_a[:12]} and {key_b[:12]}): a row-level diff "
                         "compares the same rows of one bundle", file=str(b_dir), field="bundle")
    a, b = _samples(a_dir), _samples(b_dir)
    if a["run_id"].to_list() != b["run_id"].to_list():
        raise InputError("the runs' samples hold different rows", file=str(b_dir / SAMPLES_FILE), field="run_id")
    both = a.join(b.select("run_id", *(pl.col(c).alias(f"{c}_b") for c in COLUMNS if c != "run_id")),
                  on="run_id", how="left", maintain_order="left")
    differ = both.filter(pl.col("choice").ne_missing(pl.col("choice_b")))
    rows = [_row(r) for r in differ.iter_rows(named=True)]
    catalogs = {}
    for catalog in dict.fromkeys(a["catalog"].to_list()):
        mine = [r for r in rows if r.catalog == catalog]
        catalogs[catalog] = CatalogDiff(rows=a.filter(pl.col("catalog") == catalog).height, differing=len(mine),
                                        fixed=sum(r.way == "fixed" for r in mine),
                                        broken=sum(r.way == "broken" for r in mine),
                                        changed=sum(r.way == "changed" for r in mine))
    return RunDiff(run_a=str(a_dir), run_b=str(b_dir), bundle=key_a, rows=a.height, differing=len(rows),
                   catalogs=catalogs, rows_differing=rows)


def _row(r: dict) -> DifferingRow:
    scored = bool(r["scored"])
    way: Way = "changed"
    if scored and r["correct_b"] and not r["correct"]:
        way = "fixed"
    elif scored and r["correct"] and not r["correct_b"]:
        way = "broken"

    def label(choice: int | None) -> str | None:
        return r["labels"][choice] if choice is not None and 0 <= choice < len(r["labels"]) else None

    return DifferingRow(run_id=r["run_id"], catalog=r["catalog"], question_id=r["question_id"], gold=r["gold"],
                        way=way, choice_a=r["choice"], choice_b=r["choice_b"], label_a=label(r["choice"]),
                        label_b=label(r["choice_b"]), probs_a=r["final_probs"], probs_b=r["final_probs_b"],
                        decided_by_a=r["decided_by"], decided_by_b=r["decided_by_b"], rationale_a=r["rationale"],
                        rationale_b=r["rationale_b"], prompt=r["prompt"])


def diff_frame(diff: RunDiff) -> pl.DataFrame:
    """The differing rows as a table (`jex diff -o FILE.parquet`)."""
    return pl.DataFrame([r.model_dump() for r in diff.rows_differing], schema=DIFF_SCHEMA)


DIFF_SCHEMA: dict[str, Any] = {
    "run_id": pl.String, "catalog": pl.String, "question_id": pl.String, "gold": pl.Int32, "way": pl.String,
    "choice_a": pl.Int32, "choice_b": pl.Int32, "label_a": pl.String, "label_b": pl.String,
    "probs_a": pl.List(pl.Float64), "probs_b": pl.List(pl.Float64), "decided_by_a": pl.String,
    "decided_by_b": pl.String, "rationale_a": pl.String, "rationale_b": pl.String, "prompt": pl.String}
"""`DifferingRow`'s fields, in order, as Parquet columns."""
