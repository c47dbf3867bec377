"""A generative row's answers and verdicts: its generations (one, or its catalog's `samples`) through each filter
pipeline of its catalog (`jex.answer_extraction`, lm-eval's filters, every sample as one of lm-eval's `repeats`)
and each answer's `exact_match` against the reference; the row's verdict is what the index scores
(`exact_match` in the predictions): the primary filter's, or for `maj_at_k` that of the majority answer of the
first k samples; a `pass_at_k` catalog's rows also carry the unbiased pass@k of their samples. A reasoning
catalog's generations are read after their thought (`response_after_thinking`).

Pure and cheap: the score stage writes the verdicts into the run's predictions, and the samples read them
from the same function, so an answer shown is the answer scored.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import polars as pl

from jex.answer_extraction import exact_match, extract, response_after_thinking
from jex.suite import Catalog
from jex.tasks.bundle.bundle_file import PolarsType

VERDICT_SCHEMA: dict[str, PolarsType] = {
    "run_id": pl.String, "catalog": pl.String, "generation": pl.String, "finish_reason": pl.String,
    "refusal": pl.String, "filters": pl.List(pl.String), "answers": pl.List(pl.String),
    "verdicts": pl.List(pl.Boolean), "exact_match": pl.Boolean}
"""Per generative row: its (first) generation and why it ended, then per filter of its catalog (primary first) the
extracted answer and its verdict; `exact_match` is the row's verdict (the primary filter's; maj@k's for a
`maj_at_k` catalog). A row that was not generated (refused for context, failed; any of its samples) has no answers
and no verdict (scored as unsupported)."""
SAMPLED_VERDICT_SCHEMA: dict[str, PolarsType] = {
    "samples": pl.Int32, "sample_generations": pl.List(pl.String), "sample_finish_reasons": pl.List(pl.String),
    "sample_responses": pl.List(pl.String), "sample_answers": pl.List(pl.String),
    "sample_verdicts": pl.List(pl.Boolean), "thought_tokens": pl.List(pl.Int32), "thought_closed": pl.List(pl.Boolean),
    "pass_at_k": pl.Float64}
"""Per generative row, every sample in order: its generation, why it ended, the response the filters read (after
the thought, cut at the stop sequences), the primary filter's answer of that sample alone and its verdict, the
thought's tokens and whether it closed (null without thinking delimiters); `pass_at_k`, a `pass_at_k` catalog's."""
GENERATED = ("stop", "length")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct, 1 - C(n-c, k) / C(n, k) (Chen et
    al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1), as an exact rational rounded once."""
    if n - c < k:
        return 1.0
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def majority(answers: Sequence[str | None]) -> str | None:
    """lm-eval's `majority_vote`: the most frequent answer, of a tie the one seen first."""
    return Counter(answers).most_common(1)[0][0]


def generation_verdicts(rows: pl.DataFrame, generated: pl.DataFrame, catalogs: Sequence[Catalog]) -> pl.DataFrame:
    """`rows` (run_id, catalog, answer: the bundle's generative rows) with `generated` (the generate stage's
    run_id, generation, finish_reason, refusal[, sample][, thought_tokens]) joined, scored by each catalog's
    filters and match settings; rows in `rows`' order (`VERDICT_SCHEMA`, then `SAMPLED_VERDICT_SCHEMA`)."""
    by_id = {c.id: c for c in catalogs}
    samples: dict[str, list[dict[str, Any]]] = {}
    for g in generated.iter_rows(named=True):
        samples.setdefault(g["run_id"], []).append(g)
    records = [_row_verdicts(r, sorted(samples.get(r["run_id"], []), key=lambda g: g.get("sample") or 0),
                             by_id[r["catalog"]])
               for r in rows.select("run_id", "catalog", "answer").iter_rows(named=True)]
    schema = {**VERDICT_SCHEMA, **SAMPLED_VERDICT_SCHEMA}
    return pl.DataFrame(records, schema=schema, orient="row") if records else pl.DataFrame(schema=schema)


def _row_verdicts(r: dict[str, Any], gens: list[dict[str, Any]], catalog: Catalog) -> dict[str, Any]:
    """One row's record of both schemas from its generations (none: it was never generated)."""
    filters = catalog.answer_filters()
    settings = catalog.generation
    think_end = settings.thinking.end if settings is not None and settings.thinking is not None else None
    until = settings.until if settings is not None else ()
    first = gens[0] if gens else {"generation": None, "finish_reason": None, "refusal": None}
    texts = [g["generation"] for g in gens]
    answered = bool(gens) and all(g["finish_reason"] in GENERATED for g in gens)
    responses = [response_after_thinking(t, think_end, until) for t in texts] if answered else None
    answers = verdicts = sample_answers = sample_verdicts = None
    verdict = passed = None
    if responses is not None:
        answers = [extract(f, responses) for f in filters]
        verdicts = [exact_match(a, r["answer"], catalog.match) for a in answers]
        sample_answers = [extract(filters[0], [resp]) for resp in responses]
        sample_verdicts = [exact_match(a, r["answer"], catalog.match) for a in sample_answers]
        verdict = verdicts[0]
        if catalog.scoring == "maj_at_k":
            verdict = exact_match(majority(sample_answers[:catalog.estimator_k]), r["answer"], catalog.match)
        if catalog.scoring == "pass_at_k":
            passed = pass_at_k(len(sample_verdicts), sum(sample_verdicts), catalog.estimator_k)
    return {"run_id": r["run_id"], "catalog": r["catalog"], "generation": first["generation"],
            "finish_reason": first["finish_reason"], "refusal": first["refusal"], "filters": [f.name for f in filters],
            "answers": answers, "verdicts": verdicts, "exact_match": verdict, "samples": len(gens),
            "sample_generations": texts, "sample_finish_reasons": [g["finish_reason"] for g in gens],
            "sample_responses": responses, "sample_answers": sample_answers, "sample_verdicts": sample_verdicts,
            "thought_tokens": [g.get("thought_tokens") for g in gens] if think_end else None,
            "thought_closed": [t is not None and think_end in t for t in texts] if think_end else None,
            "pass_at_k": passed}
