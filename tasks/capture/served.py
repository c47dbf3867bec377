"""A served model's checks and accounts in a campaign: its golden check (the bundle's first rows read and
generated twice, at concurrency 1 and at the engine's, every difference recorded: the server batches them as
it likes, so nothing proves it batch invariant), and the token usage and cost of its engine stages, from
their answer journals (`engine/openai_engine.py: AnswerJournal`). `served.json` in the run folder holds both.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
from pydantic import Field

from jex.engine.openai_engine import OpenAIEngine, ServedUsage, journal_usage
from jex.engine_spec import EngineSpec
from jex.fileio import sha256_json
from jex.record import Record, read_record, write_record
from jex.store_layout import golden_dir
from jex.tasks.capture.golden import compare_golden, golden_generation, golden_readout
from jex.tasks.capture.stages import stage_plan
from jex.tasks.execution.engine_pool import get_engine
from jex.tasks.inputs import EngineJob
from jex.tasks.store import LocalStore

SERVED_FILE = "served.json"
NOT_PROVEN = "served: batch invariance not proven"
"""How the report and `jex runs` mark a run of a served model."""


class ServedCheck(Record):
    """A served model's golden check: the same rows sent twice, at two concurrencies."""

    concurrency: tuple[int, int] = Field(description="The concurrencies of the two sends")
    rows_read: int = Field(description="Multiple-choice rows read each time (0: none in the bundle)")
    rows_generated: int = Field(description="Rows generated each time (rationale prompts, or generative prompts)")
    tokens: int = Field(description="New tokens per generated row")
    max_abs_dp: float = Field(description="Max |dp| between the two readouts, over every row and option")
    differing: list[str] = Field(default_factory=list, description="Rows whose readout or generated text differ")

    @property
    def identical(self) -> bool:
        return not self.differing and self.max_abs_dp == 0.0

    def line(self) -> str:
        what = " and ".join(x for x in (f"{self.rows_read} rows read" if self.rows_read else "",
                                        f"{self.rows_generated} rows generated ({self.tokens} tokens)") if x)
        outcome = "identical" if self.identical else (
            f"max |dp| {self.max_abs_dp:.3g}, {len(self.differing)} row(s) differ: {', '.join(self.differing[:5])}")
        return f"{what}, twice, at concurrency {self.concurrency[0]} and {self.concurrency[1]}: {outcome}"


class ServedDoc(Record):
    """`served.json`: a served model's run, as the report and `jex runs` show it (never the key)."""

    note: str = NOT_PROVEN
    endpoint: str | None
    model: str | None = Field(description="The model id as the server's /v1/models reports it")
    revision: str | None = None
    check: ServedCheck | None = Field(None, description="The golden check; None: not run (no engine stage sent "
                                                        "rows, or golden_generation_rows is 0)")
    usage: ServedUsage = Field(description="Every request answered for the run's engine stages, as the server "
                                           "counted its tokens")
    cost_usd: float | None = Field(None, description="The usage at the engine's prices; None: no price set")


def check_path(job: EngineJob, rows: int, tokens: int) -> Path:
    """Where the store keeps the golden check of a bundle and served engine (a resumed or repeated campaign
    reuses it: the check's requests are sent once)."""
    inputs = job.inputs
    key = sha256_json({"engine": inputs.fingerprint().key_doc(), "rows": rows, "tokens": tokens,
                       "concurrency": inputs.engine.max_concurrency})[:32]
    return golden_dir(LocalStore(job.store).root, inputs.bundle.key) / "served" / key / "check.json"


def stored_check(job: EngineJob, rows: int, tokens: int) -> ServedCheck | None:
    """The golden check the store holds for the job's bundle and served engine (None: none)."""
    path = check_path(job, rows, tokens)
    return read_record(ServedCheck, path) if path.exists() else None


def served_check(job: EngineJob, *, rows: int, tokens: int) -> ServedCheck | None:
    """The golden check of the job's served engine on its bundle: stored, else run now, unless the engine
    cannot read the bundle's multiple-choice rows (its fast pass refuses the campaign: nothing is sent here)."""
    if (stored := stored_check(job, rows, tokens)) is not None:
        return stored
    path = check_path(job, rows, tokens)
    spec, bundle, store = job.inputs.engine, job.inputs.bundle, LocalStore(job.store)
    engine = get_engine(spec)
    assert isinstance(engine, OpenAIEngine)  # a served model's check
    if bundle.rows and engine.readout_refusal() is not None:
        return None
    engine.keep_answers(None)  # both sends reach the server
    concurrency = (1, spec.max_concurrency)
    reads: list[pl.DataFrame] = []
    texts: list[dict[str, str]] = []
    try:
        for c in concurrency:
            engine.concurrency = c
            if bundle.rows:
                reads.append(golden_readout(bundle, spec, store, rows))
            generated = golden_generation(bundle, spec, store, rows, tokens)
            texts.append(dict(zip(generated["run_id"].to_list(), generated["text"].to_list(), strict=True)))
    finally:
        engine.concurrency = spec.max_concurrency
    verdict = compare_golden(reads[0], reads[1], tolerance=0.0, worst=len(reads[0])) if reads else None
    differing = sorted({*(w.run_id for w in verdict.worst if w.max_abs_dp > 0), *(p.split(":")[0] for p in
                                                                                  verdict.problems)}
                       if verdict else set()) + sorted(r for r in texts[0] if texts[0][r] != texts[1].get(r))
    check = ServedCheck(concurrency=concurrency, rows_read=verdict.rows if verdict else 0,
                        rows_generated=len(texts[0]), tokens=tokens,
                        max_abs_dp=verdict.max_abs_dp if verdict else 0.0, differing=differing)
    write_record(path, check)
    return check


def answer_journals(jobs: list[EngineJob]) -> dict[Path, ServedUsage]:
    """The usage of the answers kept in each of the jobs' engine stage folders in the store (its journal), by
    folder: what was sent for that stage, by whichever campaign sent it."""
    return {folder: journal_usage(folder)
            for folder in sorted({Path(stage_plan(j.inputs, j.store).shards_dir) for j in jobs})}


def served_usage(jobs: list[EngineJob]) -> ServedUsage:
    """The usage of every answer kept for the jobs' engine stages (each stage's journal once)."""
    usage = ServedUsage()
    for journal in answer_journals(jobs).values():
        usage += journal
    return usage


def usage_cost(spec: EngineSpec, usage: ServedUsage) -> float | None:
    """`usage` at the served engine's prices per million tokens; None when it sets none."""
    prices = (spec.price_input_per_mtok, spec.price_output_per_mtok)
    return None if prices == (None, None) else (
        usage.prompt_tokens * (prices[0] or 0.0) + usage.completion_tokens * (prices[1] or 0.0)) / 1e6


def served_doc(spec: EngineSpec, check: ServedCheck | None, usage: ServedUsage) -> ServedDoc:
    """What `served.json` holds of a run of the served engine `spec`."""
    from jex.engine.fingerprint import engine_fingerprint

    fp = engine_fingerprint(spec)
    return ServedDoc(endpoint=fp.endpoint, model=fp.served_model, revision=fp.served_revision, check=check,
                     usage=usage, cost_usd=usage_cost(spec, usage))


def served_section(doc: ServedDoc, spec: EngineSpec) -> list[str]:
    """The report's section of a served model: where it was served, that its batch invariance is not proven,
    its golden check, and its token usage and cost."""
    revision = f", revision `{doc.revision}`" if doc.revision else ""
    lines = ["", "## Served model", "",
             f"Engine stages ran in the orchestrator's process, each request sent to `{doc.endpoint}` (model "
             f"`{doc.model}`{revision}, at most {spec.max_concurrency} in flight); no machine was rented.", "",
             f"**{NOT_PROVEN[0].upper()}{NOT_PROVEN[1:]}.** The server batches requests as it likes and jex cannot "
             "pin its kernels: the settings audit does not run for a served model, and its numbers may change "
             "with the server's load.", ""]
    lines.append(f"Golden check: {doc.check.line()}." if doc.check else
                 "Golden check: not run (every engine stage was stored, or golden_generation_rows is 0).")
    u = doc.usage
    cost = (f"; cost ${doc.cost_usd:.4f} at ${spec.price_input_per_mtok or 0:g} / "
            f"${spec.price_output_per_mtok or 0:g} per million prompt / completion tokens" if doc.cost_usd is not None
            else "; no price set (engine.price_input_per_mtok, price_output_per_mtok)")
    lines += ["", f"Token usage: {u.requests} requests, {u.prompt_tokens} prompt tokens, {u.completion_tokens} "
                  f"completion tokens{cost}."]
    return lines


def read_served(run_dir: str | Path) -> ServedDoc | None:
    """A run folder's `served.json` (None: not a served model's run)."""
    path = Path(run_dir) / SERVED_FILE
    return read_record(ServedDoc, path) if path.exists() else None
