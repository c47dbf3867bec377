"""A generative row's answers and verdicts: its generation through each filter pipeline of its catalog
(`jex.answer_extraction`, lm-eval's filters) and each answer's `exact_match` against the reference; the
catalog's primary filter's verdict is what the index scores (`exact_match` in the predictions).

Pure and cheap: the score stage writes the verdicts into the run's predictions, and the samples read them
from the same function, so an answer shown is the answer scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from jex.answer_extraction import exact_match, extract
from jex.suite import Catalog
from jex.tasks.bundle.bundle_file import PolarsType

VERDICT_SCHEMA: dict[str, PolarsType] = {
    "run_id": pl.String, "catalog": pl.String, "generation": pl.String, "finish_reason": pl.String,
    "refusal": pl.String, "filters": pl.List(pl.String), "answers": pl.List(pl.String),
    "verdicts": pl.List(pl.Boolean), "exact_match": pl.Boolean}
"""Per generative row: its generation and why it ended, then per filter of its catalog (primary first) the
extracted answer and its verdict; `exact_match` is the primary filter's verdict. A row that was not generated
(refused for context, failed) has no answers and no verdict (scored as unsupported)."""
GENERATED = ("stop", "length")


def generation_verdicts(rows: pl.DataFrame, generated: pl.DataFrame, catalogs: Sequence[Catalog]) -> pl.DataFrame:
    """`rows` (run_id, catalog, answer: the bundle's generative rows) with `generated` (the generate stage's
    run_id, generation, finish_reason, refusal) joined, scored by each catalog's filters and match settings;
    rows in `rows`' order (`VERDICT_SCHEMA`)."""
    by_id = {c.id: c for c in catalogs}
    joined = rows.select("run_id", "catalog", "answer").join(
        generated.select("run_id", "generation", "finish_reason", "refusal"), on="run_id", how="left",
        maintain_order="left")
    records = []
    for r in joined.iter_rows(named=True):
        catalog = by_id[r["catalog"]]
        filters = catalog.answer_filters()
        answered = r["finish_reason"] in GENERATED
        answers = [extract(f, r["generation"]) for f in filters] if answered else None
        verdicts = [exact_match(a, r["answer"], catalog.match) for a in answers] if answers is not None else None
        records.append({"run_id": r["run_id"], "catalog": r["catalog"], "generation": r["generation"],
                        "finish_reason": r["finish_reason"], "refusal": r["refusal"],
                        "filters": [f.name for f in filters], "answers": answers, "verdicts": verdicts,
                        "exact_match": verdicts[0] if verdicts is not None else None})
    return pl.DataFrame(records, schema=VERDICT_SCHEMA, orient="row") if records else \
        pl.DataFrame(schema=VERDICT_SCHEMA)
