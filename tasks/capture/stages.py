"""The capture's stages: the bundle, and the engine stages, fast pass, reason and generate, sharded.

Each is a `CachedStage` over its inputs record (`BundleInputs`, `FastPassInputs`, `ReasonInputs`,
`GenerateInputs`),
content-addressed in the store, and returns a small summary (paths, sha256s, counters): tasks hand each
other these, never the frames. A completed stage folder is reused as is: the engine is not even loaded.
An engine stage computed outside the flow's process (a machine, an engine host, a worker process) enters
through `engine_job.run_engine_job`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast

import polars as pl
from pydantic import JsonValue

from jex.engine.base import ChatTokenizer
from jex.engine.types import (
    EngineDeadError,
    FinishReason,
    GenerateRequest,
    Generation,
    Readout,
    ReadoutMode,
    ReadoutRequest,
    RefusalKind,
)
from jex.engine_spec import EngineSpec, RenderSpec
from jex.fileio import canonical_json, sha256_file
from jex.numerics import length_normalised_choice
from jex.run_records import EngineStageName
from jex.store_layout import SUCCESS, shards_dir, stage_dir
from jex.tasks.bundle.bundle_file import PolarsType, build_bundle, is_bundle_file, open_bundle, take_bundle
from jex.tasks.bundle.reading import bundle_rows
from jex.tasks.cached_stage import CachedStage
from jex.tasks.capture.batch_errors import ROW_RETRIES, BatchLog, compute_resilient
from jex.tasks.capture.engine_calls import (
    CaptureRow,
    CatalogRead,
    CatalogReads,
    FewShotPool,
    GenerationSpec,
    ReadPlan,
    ReasonCall,
    SampleCall,
    as_rows,
    prepared_questions,
    prepared_reasons,
    prepared_samples,
    read_questions,
    reread,
    thought_tokens,
)
from jex.tasks.execution.engine_pool import CALLS, get_engine, release_engine
from jex.tasks.inputs import BundleInputs, EngineStageInputs, FastPassInputs, GenerateInputs, ReasonInputs
from jex.tasks.records import (
    BundleSummary,
    FailedRow,
    FastPassErrors,
    FastPassSummary,
    GenerateErrors,
    GenerateSummary,
    PartialSummary,
    RationaleTokens,
    ReasonErrors,
    ReasonSummary,
    ShardWork,
    StagePlan,
    ThoughtCounts,
)
from jex.tasks.store import (
    LocalStore,
    ShardRows,
    ShardStats,
    StageDir,
    merge_shards,
    partial_summary,
    refused,
    run_sharded,
    stage_failed_rows,
)

Progress = Callable[[str, int, int], None]
Prepared = TypeVar("Prepared")

PREPARE_AHEAD_ENV = "JEX_PREPARE_AHEAD"
"""`1`: every engine stage renders and tokenises its next shard on a thread beside the engine
(`run_sharded`'s `prepare_ahead`); `0`: each shard on the engine's thread, just before reading it;
unset: the fast pass ahead, the reason stage inline. Measured on the H200 (one engine, 20,000 rows,
bench/results/h200-fastpass-prepare-ahead.json): ahead, the fast pass gains 6.5%; the reason stage
loses 15%, as its preparation is a sliver of its work and the thread takes the GIL from vLLM's
in-process scheduler loop, which runs once per generated token."""
AHEAD_BY_DEFAULT = {"fast_pass": True, "reason": False, "generate": False}

READOUT_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "logprobs": pl.List(pl.Float64), "label_mass": pl.Float64,
                  "refusal": pl.String}
LOGLIKELIHOOD_SCHEMA: dict[str, PolarsType] = {"choice_loglikelihoods": pl.List(pl.Float64),
                                               "choice_is_greedy": pl.List(pl.Boolean), "acc_norm_choice": pl.Int32}
"""The capture's lm-eval columns, only in a bundle with a loglikelihood catalog (null on its other rows):
each option's summed continuation log-likelihood, whether it is the greedy continuation, and lm-eval's
`acc_norm` prediction, argmax of log-likelihood / len(option) in characters."""
GENERATED_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "generation": pl.String,
                                           "token_ids": pl.List(pl.Int64), "finish_reason": pl.String,
                                           "refusal": pl.String}
"""The generate stage's rows: the text (cut before the first stop sequence), every generated token id, why
it ended (`stop`, `length`, `refused`, `error`) and why a row was not generated."""
SAMPLE_COLUMN: dict[str, PolarsType] = {"sample": pl.Int32}
"""Appended when a catalog samples (`samples` above 1 or a temperature): one row per generation, a row's samples
in order; a greedy bundle's frame keeps its bytes."""
THOUGHT_COLUMN: dict[str, PolarsType] = {"thought_tokens": pl.Int32}
"""Appended when a catalog names thinking delimiters: the tokens of each generation's thought
(`engine_calls.thought_tokens`; null on other catalogs' rows and on rows not generated)."""
REASON_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "rationale": pl.String, "token_ids": pl.List(pl.Int64),
                 "finish_reason": pl.String, "post_logprobs": pl.List(pl.Float64), "refusal": pl.String}


def _bundle(out: StageDir, store: LocalStore, inputs: BundleInputs) -> BundleSummary:
    if is_bundle_file(inputs.suite):
        result = take_bundle(inputs.suite, out.path / "bundle.tar.gz")
    else:
        result = build_bundle(Path(inputs.suite), out.path / "bundle.tar.gz", reference=inputs.reference)
    return BundleSummary(key=out.key, bundle=str(result.path), sha256=result.sha256, rows=result.rows,
                         generate_rows=result.manifest.generate_rows)


bundle_stage = CachedStage(BundleInputs, BundleSummary, body=_bundle)
"""Build (or reuse) the bundle of a suite folder, or take a bundle file as built:
`bundle_stage(store, suite=..., reference=None)`."""


def fewshot_pool(bundle: BundleSummary, store: LocalStore, engine: EngineSpec) -> FewShotPool | None:
    """The bundle's few-shot rows by catalog, when the render asks for examples (else None)."""
    if engine.render.num_fewshot == 0:
        return None
    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    frame = opened.fewshot()
    pool: dict[str, list[CaptureRow]] = {}
    for r in as_rows(frame) if frame is not None else []:
        pool.setdefault(r.catalog or "", []).append(r)
    return pool


def readouts_frame(readouts: list[Readout], continued: dict[str, Sequence[str]] | None = None) -> pl.DataFrame:
    """The capture's rows; with `continued` (the options, by run_id, of the rows read by continuation;
    None when the bundle has no loglikelihood catalog) the lm-eval columns too (`LOGLIKELIHOOD_SCHEMA`)."""
    frame = pl.DataFrame({"run_id": [r.run_id for r in readouts],
                          "logprobs": [list(r.logprobs) if r.logprobs is not None else None for r in readouts],
                          "label_mass": [r.label_mass for r in readouts],
                          "refusal": [r.refusal for r in readouts]}, schema=READOUT_SCHEMA)
    if continued is None:
        return frame
    lls = [list(r.raw_logprobs) if r.run_id in continued and r.raw_logprobs is not None else None for r in readouts]
    greedy = [list(r.greedy) if r.run_id in continued and r.greedy is not None else None for r in readouts]
    norm = [length_normalised_choice(ll, continued[r.run_id]) if ll is not None else None
            for r, ll in zip(readouts, lls, strict=True)]
    return frame.with_columns(pl.Series("choice_loglikelihoods", lls, dtype=pl.List(pl.Float64)),
                              pl.Series("choice_is_greedy", greedy, dtype=pl.List(pl.Boolean)),
                              pl.Series("acc_norm_choice", norm, dtype=pl.Int32))


def catalog_reads(bundle: BundleSummary, store: LocalStore) -> CatalogReads:
    """The bundle's catalogs read otherwise than the label slot of a templated question (often none)."""
    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    return {c.id: CatalogRead(c.readout, c.prompt_format, c.target_delimiter)
            for c in opened.suite_manifest().catalogs
            if (c.readout, c.prompt_format, c.target_delimiter) != ("label_slot", "template", " ")}


def continued_options(rows: Sequence[CaptureRow], plan: ReadPlan) -> dict[str, Sequence[str]] | None:
    """The options of the rows read by continuation, by run_id; None when no catalog is."""
    return {r.run_id: r.options for r in rows if r.run_id in plan.continuation} if plan.continuation else None


def stage_plan(inputs: EngineStageInputs, store: str | Path) -> StagePlan:
    """Where an engine stage's shards go and how many there are, without loading anything heavy."""
    key = inputs.key()
    rows = (inputs.gate.rows if isinstance(inputs, ReasonInputs) else inputs.bundle.generate_rows or 0
            if isinstance(inputs, GenerateInputs) else inputs.bundle.rows)
    folder = stage_dir(store, inputs.stage, key)
    return StagePlan(stage=inputs.stage, key=key, folder=str(folder),
                     shards_dir=str(shards_dir(folder, inputs.shard_rows)), shards=-(-rows // inputs.shard_rows),
                     complete=(folder / SUCCESS).exists(), engine=inputs.fingerprint())


@dataclass(frozen=True)
class ShardShare:
    """How one process takes part in an engine stage, never what it computes: worker `worker` of
    `workers` takes shards w, w+N, ...; with `claim` processes take shards as they claim them;
    `progress(stage, done, total)` after each shard."""

    worker: int = 0
    workers: int = 1
    claim: bool = False
    progress: Progress | None = None
    engine_start_s: float = 0.0
    """Seconds this process spent starting the engine for this call before it (an engine host's start)."""


ALONE = ShardShare()
"""One process computes every shard."""


def _sharded(stage: EngineStageName, out: StageDir, rows: Sequence[Any],
             prepare: Callable[[ChatTokenizer, Sequence[CaptureRow]], list[Prepared]],
             read: Callable[[Sequence[Prepared]], pl.DataFrame],
             failed: Callable[[Sequence[Prepared], str], pl.DataFrame],
             *, engine: EngineSpec, shard_rows: int, share: ShardShare) -> tuple[Path, ShardStats] | PartialSummary:
    """The shards of an engine stage: each rendered and tokenised (`prepare`; one shard ahead on a thread
    beside the engine, with the engine's `preparer()`, as `PREPARE_AHEAD_ENV` says), then read in one
    engine call (`read`; a batch that keeps failing is split, a row on its own is retried as `ROW_RETRIES`
    says, and a row that still fails becomes a `failed` row, recorded beside its shard); a `PartialSummary`
    when other processes still compute some shards."""
    setting = os.environ.get(PREPARE_AHEAD_ENV)
    ahead = AHEAD_BY_DEFAULT[stage] if setting is None else setting != "0"

    @functools.cache
    def tokenizer() -> ChatTokenizer:
        """The engine (started here, on the caller's thread), or its tokenizer copy for the preparing thread."""
        eng = get_engine(engine)
        return eng.preparer() if ahead else eng

    def compute(prepared: Sequence[Prepared]) -> ShardRows:
        CALLS[stage] += 1
        get_engine(engine).keep_answers(shards)  # a served model's answers, kept as they arrive (resumes send no more)
        log = BatchLog()
        return ShardRows(compute_resilient(prepared, read, failed, policy=ROW_RETRIES, log=log), log.failed_rows)

    shards = shards_dir(out.path, shard_rows)
    progress = share.progress
    try:
        stats = run_sharded(rows, shard_rows=shard_rows, folder=shards, compute=compute, worker=share.worker,
                            workers=share.workers, on_shard=(lambda d, t: progress(stage, d, t)) if progress else None,
                            prepare=tokenizer, claim=share.claim,
                            prepare_chunk=lambda chunk: prepare(tokenizer(), chunk), prepare_ahead=ahead)
    except EngineDeadError:
        release_engine(engine)  # never served again: whoever needs this engine next starts a new one
        raise
    if stats.computed:
        record_work(shards, ShardWork(computed_shards=stats.computed, compute_seconds=stats.compute_seconds,
                                      computed_rows=stats.computed_rows,
                                      engine_start_seconds=share.engine_start_s + stats.start_seconds,
                                      stacks=[engine_stack(get_engine(engine))]))
    if (share.workers > 1 or share.claim) and len(list(shards.glob("shard-*.parquet"))) < stats.shards:
        return partial_summary(stage, out.key, stats)
    return shards, stats


WORK_RECORDS = ".work-*.json"
"""Beside a stage's shards: one `ShardWork` record per process call that computed some of them (here, in
a worker process, on a machine: collected with the shards), so the merged summary counts the seconds
wherever the shards were computed. Dot-names: not in the stage folder's `files`."""


def record_work(shards: Path, work: ShardWork) -> None:
    import uuid

    from jex.fileio import write_json

    write_json(shards / f".work-{uuid.uuid4().hex}.json", work.model_dump(mode="json"))


RUN_DESCRIBING = ("model_path", "vllm_config", "batch_size")
"""Engine provenance that describes one process rather than the stack (paths, the full config dump, the
caller's batch shape): left out of `engine_stack`, so every machine of one stack records the same entry."""


def engine_stack(engine: Any) -> dict[str, JsonValue]:
    """The engine's provenance as it reports it in this process (`Engine.provenance`), less what describes
    only this process (`RUN_DESCRIBING`): for vLLM its version, torch, triton, CUDA, the driver, the GPU,
    the VLLM_* environment and the profile (CUDA-graph mode included)."""
    block = {k: v for k, v in engine.provenance().items() if k not in RUN_DESCRIBING}
    if isinstance(block.get("environment"), dict):  # which GPU of the machine: not the stack
        block["environment"] = {k: v for k, v in block["environment"].items() if k != "CUDA_VISIBLE_DEVICES"}
    return block


def _shard_fields(stats: ShardStats, shards: Path) -> ShardFields:
    """The stage's shard counters: its own shards, and the seconds and rows of every record of work
    beside them (`WORK_RECORDS`: this call's and those of the processes and machines that computed the rest)."""
    works = [ShardWork.model_validate_json(p.read_text()) for p in sorted(shards.glob(WORK_RECORDS))]
    return {"shards": stats.shards, "computed_shards": stats.computed, "reused_shards": stats.reused,
            "compute_seconds": sum(w.compute_seconds for w in works),
            "computed_rows": sum(w.computed_rows for w in works),
            "engine_start_seconds": sum(w.engine_start_seconds for w in works),
            "stacks": list({canonical_json(st): st for w in works for st in w.stacks}.values())}  # each once


def failed_rows(shards: Path, stats: ShardStats, frame: pl.DataFrame) -> list[FailedRow] | None:
    """The records of the rows the merged `frame` holds as batch errors, in shard order (None: none failed)."""
    failing = frame.filter(refused(RefusalKind.BATCH_ERROR))["run_id"]
    return stage_failed_rows(shards, stats.shards, set(failing.to_list())) or None


class ShardFields(TypedDict):
    """The shard counters both engine stages' summaries carry."""

    shards: int
    computed_shards: list[int]
    reused_shards: list[int]
    compute_seconds: float
    computed_rows: int
    engine_start_seconds: float
    stacks: list[dict[str, JsonValue]]


def _fast_pass(out: StageDir, store: LocalStore, inputs: FastPassInputs,
               share: ShardShare = ALONE) -> FastPassSummary | PartialSummary:
    bundle, engine = inputs.bundle, inputs.engine
    rows = as_rows(bundle_rows(bundle, store))
    pool = fewshot_pool(bundle, store, engine)
    reads = catalog_reads(bundle, store)
    plan = ReadPlan.of(rows, reads)
    continued = continued_options(rows, plan)
    if rows and engine.is_served() and (lacking := get_engine(engine).readout_refusal()):  # one probe, no row sent
        catalogs = ", ".join(sorted({f"'{r.catalog}'" for r in rows}))
        raise EngineDeadError(f"multiple-choice catalog(s) {catalogs}: {lacking}")

    def questions(tokenizer: ChatTokenizer, batch: Sequence[CaptureRow]) -> list[ReadoutRequest]:
        return prepared_questions(tokenizer, batch, engine.render, pool, reads)

    def readout(requests: Sequence[ReadoutRequest]) -> pl.DataFrame:
        return readouts_frame(read_with_fallback(get_engine(engine), requests, render=engine.render, plan=plan),
                              continued)

    def unread(requests: Sequence[ReadoutRequest], why: str) -> pl.DataFrame:
        return readouts_frame([Readout(r.run_id, None, None, None, ReadoutMode.LABEL_SLOT, why) for r in requests],
                              continued)

    done = _sharded("fast_pass", out, rows, questions, readout, unread, engine=engine, shard_rows=inputs.shard_rows,
                    share=share)
    if isinstance(done, PartialSummary):
        return done
    shards, stats = done
    merged = out.path / "capture.parquet"
    frame = merge_shards(shards, stats.shards, merged) if stats.shards else _written(readouts_frame([], continued),
                                                                                      merged)
    return FastPassSummary(key=out.key, capture=str(merged), sha256=sha256_file(merged), rows=frame.height,
                           shard_rows=inputs.shard_rows, **_shard_fields(stats, shards),
                           failed_rows=failed_rows(shards, stats, frame),
                           **fast_pass_error_counters(frame),
                           engine=inputs.fingerprint())


fast_pass_stage = CachedStage(FastPassInputs, FastPassSummary, body=_fast_pass)
"""Label-slot readout of every row, sharded; `capture.parquet` is the merge of the shards.

`fast_pass_stage.run(store, FastPassInputs(...), share=ShardShare(...))` (`share` defaults to `ALONE`;
`fast_pass_stage(store, inputs)` is the same, alone, and never partial). The inputs' `engine_fp`, when
set, is the fingerprint measured where the shards were computed (a machine's), else this process's
engine is fingerprinted; with `claim` or several `workers` in `share`, a process may return a
`PartialSummary` (`run_sharded`). `reason_stage` is called the same way with a `ReasonInputs`."""


def read_with_fallback(eng: Any, requests: Sequence[ReadoutRequest], *, render: RenderSpec,
                       plan: ReadPlan | None = None) -> list[Readout]:
    """Label-slot readout of the questions (`engine_calls.prepared_questions`), the continuation readout of
    the rows `plan` names (loglikelihood catalogs); a label-slot row whose labels are not single tokens is
    read again through the fallback path, the options' continuation log-likelihoods (its `label_mass`
    stays null)."""
    readouts = read_questions(eng, requests, render=render, plan=plan)
    redo = [i for i, r in enumerate(readouts) if RefusalKind.LABEL_TOKEN.of(r.refusal)]
    if redo:
        again = read_questions(eng, [requests[i] for i in redo], ReadoutMode.OPTION_CONTINUATION, render=render,
                               plan=plan)
        for i, r in zip(redo, again, strict=True):
            readouts[i] = r
    return readouts


def fast_pass_error_counters(frame: pl.DataFrame) -> FastPassErrors:
    """Disjoint counters of a capture: context refusals, batch errors, other readout errors, and
    key fallbacks (label-slot rows read, but through the continuation fallback: logprobs without label mass)."""
    context, batch = refused(RefusalKind.CONTEXT), refused(RefusalKind.BATCH_ERROR)
    return {"context_refusals": frame.filter(context).height,
            "batch_errors": frame.filter(batch).height,
            "readout_errors": frame.filter(pl.col("refusal").is_not_null() & ~context & ~batch).height,
            "key_fallbacks": frame.filter(pl.col("logprobs").is_not_null() & pl.col("label_mass").is_null()
                                          & _label_slot_row(frame)).height}


def _label_slot_row(frame: pl.DataFrame) -> pl.Expr:
    """Rows of label-slot catalogs (a loglikelihood catalog's rows have no label mass by design)."""
    return pl.col("choice_loglikelihoods").is_null() if "choice_loglikelihoods" in frame.columns else pl.lit(True)


def reason_error_counters(frame: pl.DataFrame) -> ReasonErrors:
    """Disjoint counters of the reason stage: rationale prompts refused for context, batch errors,
    and mechanism failures (a rationale was written but could not be re-read)."""
    batch = refused(RefusalKind.BATCH_ERROR)
    return {"context_refusals": frame.filter(pl.col("finish_reason") == FinishReason.REFUSED.value).height,
            "batch_errors": frame.filter(batch).height,
            "mechanism_failures": frame.filter(pl.col("finish_reason").is_in(["stop", "length"])
                                               & pl.col("post_logprobs").is_null() & ~batch).height}


def failed_reason_frame(rows: Sequence[ReasonCall], why: str) -> pl.DataFrame:
    """Rows whose batch failed on its own: no rationale, no re-read, finish reason `error`."""
    return pl.DataFrame({"run_id": [r.run_id for r in rows], "rationale": [""] * len(rows),
                         "token_ids": [[] for _ in rows], "finish_reason": ["error"] * len(rows),
                         "post_logprobs": [None] * len(rows), "refusal": [why] * len(rows)},
                        schema=REASON_SCHEMA)


def reason_frame(gens: list[Generation], posts: list[Readout]) -> pl.DataFrame:
    return pl.DataFrame({
        "run_id": [g.run_id for g in gens], "rationale": [g.text for g in gens],
        "token_ids": [list(g.token_ids) for g in gens], "finish_reason": [g.finish_reason.value for g in gens],
        "post_logprobs": [list(p.logprobs) if p.logprobs is not None and g.finish_reason is not FinishReason.REFUSED
                          else None for g, p in zip(gens, posts, strict=True)],
        "refusal": [RefusalKind.CONTEXT.refusal("rationale prompt too long") if g.finish_reason is FinishReason.REFUSED
                    else p.refusal
                    for g, p in zip(gens, posts, strict=True)]},
        schema=REASON_SCHEMA)


def _reason(out: StageDir, store: LocalStore, inputs: ReasonInputs,
            share: ShardShare = ALONE) -> ReasonSummary | PartialSummary:
    bundle, engine, max_tokens = inputs.bundle, inputs.engine, inputs.max_tokens
    gated = pl.read_parquet(inputs.gate.gated)["run_id"]
    rows = as_rows(bundle_rows(bundle, store).join(gated.to_frame(), on="run_id", how="semi", maintain_order="left"))

    def calls(tokenizer: ChatTokenizer, batch: Sequence[CaptureRow]) -> list[ReasonCall]:
        return prepared_reasons(tokenizer, batch, max_tokens=max_tokens, render=engine.render)

    def think(batch: Sequence[ReasonCall]) -> pl.DataFrame:
        eng = get_engine(engine)
        gens = eng.generate([c.request for c in batch])
        return reason_frame(gens, reread(eng, [c.row for c in batch], gens, render=engine.render,
                                         prompts=[c.request.prompt for c in batch]))

    done = _sharded("reason", out, rows, calls, think, failed_reason_frame, engine=engine,
                    shard_rows=inputs.shard_rows, share=share)
    if isinstance(done, PartialSummary):
        return done
    shards, stats = done
    merged = out.path / "reasoned.parquet"
    frame = merge_shards(shards, stats.shards, merged) if stats.shards else _written(reason_frame([], []), merged)
    lengths = [len(t) for t in frame["token_ids"].to_list()]
    tokens = RationaleTokens(mean=sum(lengths) / len(lengths) if lengths else 0.0, max=max(lengths, default=0),
                             hit_max_tokens=frame.filter(pl.col("finish_reason") == "length").height)
    return ReasonSummary(key=out.key, reasoned=str(merged), sha256=sha256_file(merged), rows=frame.height,
                         **_shard_fields(stats, shards), **reason_error_counters(frame), rationale_tokens=tokens,
                         failed_rows=failed_rows(shards, stats, frame),
                         engine=inputs.fingerprint())


reason_stage = CachedStage(ReasonInputs, ReasonSummary, body=_reason)
"""A greedy rationale for each gated row, then the options re-read after it (post-thought readout)."""


def generation_rows(bundle: BundleSummary, store: LocalStore) -> pl.DataFrame:
    """The bundle's generative rows (`bundle.GENERATE_SCHEMA`), in suite order."""
    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    if opened.sha256 != bundle.sha256:
        raise RuntimeError(f"{bundle.bundle} changed since it was built")
    return opened.generation_rows()


def as_generative(frame: pl.DataFrame) -> list[CaptureRow]:
    """Generative rows (`generation_rows`) as the engine calls take them: run_id, prompt, catalog, question_id."""
    return [CaptureRow(r["run_id"], r["prompt"], (), (), None, r["catalog"], r["question_id"])
            for r in frame.iter_rows(named=True)]


def generation_settings(bundle: BundleSummary, store: LocalStore) -> dict[str, GenerationSpec]:
    """Each generative catalog's stop sequences, token limit, sampling and thinking, from the bundle's suite
    manifest."""
    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    return {c.id: GenerationSpec.of(c.generation) for c in opened.suite_manifest().catalogs
            if c.generation is not None}


@dataclass(frozen=True)
class GeneratedColumns:
    """The generate stage's optional columns, the same in every shard of a stage: `sample` when a catalog
    samples, `thought_tokens` when one thinks (with `decode`, the engine's tokenizer's, to count them)."""

    sampled: bool = False
    thinking: bool = False
    decode: Callable[[Sequence[int]], str] | None = None

    @classmethod
    def of(cls, settings: dict[str, GenerationSpec]) -> GeneratedColumns:
        return cls(any(g.samples > 1 or g.temperature > 0 for g in settings.values()),
                   any(g.think_end for g in settings.values()))

    def added(self, frame: pl.DataFrame, calls: Sequence[SampleCall], gens: Sequence[Generation] | None
              ) -> pl.DataFrame:
        """`frame` (`GENERATED_SCHEMA`) with the columns this stage writes."""
        if self.sampled:
            frame = frame.with_columns(pl.Series("sample", [c.sample for c in calls], dtype=SAMPLE_COLUMN["sample"]))
        if self.thinking:
            counted: list[int | None] = [None] * len(calls)
            if gens is not None and self.decode is not None:
                decode = self.decode
                counted = [thought_tokens(decode, g.token_ids, c.think_end)
                           if c.think_end and g.finish_reason is not FinishReason.REFUSED else None
                           for c, g in zip(calls, gens, strict=True)]
            frame = frame.with_columns(pl.Series("thought_tokens", counted, dtype=THOUGHT_COLUMN["thought_tokens"]))
        return frame


def generated_frame(gens: Sequence[Generation], calls: Sequence[SampleCall] = (),
                    columns: GeneratedColumns = GeneratedColumns()) -> pl.DataFrame:
    """The generate stage's rows (`GENERATED_SCHEMA`, and the `columns` of `calls`); a prompt too long for the
    context is a context refusal."""
    frame = pl.DataFrame({
        "run_id": [g.run_id for g in gens], "generation": [g.text for g in gens],
        "token_ids": [list(g.token_ids) for g in gens], "finish_reason": [g.finish_reason.value for g in gens],
        "refusal": [RefusalKind.CONTEXT.refusal(f"the prompt of {g.prompt_tokens} tokens leaves no room to generate")
                    if g.finish_reason is FinishReason.REFUSED else None for g in gens]}, schema=GENERATED_SCHEMA)
    return columns.added(frame, calls, gens) if calls else frame


def failed_generation_frame(requests: Sequence[GenerateRequest], why: str, calls: Sequence[SampleCall] = (),
                            columns: GeneratedColumns = GeneratedColumns()) -> pl.DataFrame:
    """Rows whose batch failed on their own: no generation, finish reason `error`."""
    frame = pl.DataFrame({"run_id": [r.run_id for r in requests], "generation": [""] * len(requests),
                          "token_ids": [[] for _ in requests], "finish_reason": ["error"] * len(requests),
                          "refusal": [why] * len(requests)}, schema=GENERATED_SCHEMA)
    return columns.added(frame, calls, None) if calls else frame


def generate_error_counters(frame: pl.DataFrame) -> GenerateErrors:
    """Disjoint counters of the generate stage: prompts refused for context, batch errors."""
    return {"context_refusals": frame.filter(pl.col("finish_reason") == FinishReason.REFUSED.value).height,
            "batch_errors": frame.filter(refused(RefusalKind.BATCH_ERROR)).height}


def _generate(out: StageDir, store: LocalStore, inputs: GenerateInputs,
              share: ShardShare = ALONE) -> GenerateSummary | PartialSummary:
    bundle, engine = inputs.bundle, inputs.engine
    rows = as_generative(generation_rows(bundle, store))
    settings = generation_settings(bundle, store)
    shape = GeneratedColumns.of(settings)

    def calls(tokenizer: ChatTokenizer, batch: Sequence[CaptureRow]) -> list[SampleCall]:
        return prepared_samples(tokenizer, cast(Sequence[Any], batch), settings=settings, render=engine.render)

    def columns() -> GeneratedColumns:
        tokenizer = getattr(get_engine(engine), "tokenizer", None) if shape.thinking else None
        if tokenizer is None:  # no thought, or an engine without a local tokenizer (a served one): none counted
            return shape
        return replace(shape, decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True))

    def generate(batch: Sequence[SampleCall]) -> pl.DataFrame:
        return generated_frame(get_engine(engine).generate([c.request for c in batch]), batch, columns())

    def failed(batch: Sequence[SampleCall], why: str) -> pl.DataFrame:
        return failed_generation_frame([c.request for c in batch], why, batch, shape)

    done = _sharded("generate", out, rows, calls, generate, failed, engine=engine, shard_rows=inputs.shard_rows,
                    share=share)
    if isinstance(done, PartialSummary):
        return done
    shards, stats = done
    merged = out.path / "generated.parquet"
    frame = merge_shards(shards, stats.shards, merged)
    lengths = [len(t) for t in frame["token_ids"].to_list()]
    tokens = RationaleTokens(mean=sum(lengths) / len(lengths) if lengths else 0.0, max=max(lengths, default=0),
                             hit_max_tokens=frame.filter(pl.col("finish_reason") == "length").height)
    return GenerateSummary(key=out.key, generated=str(merged), sha256=sha256_file(merged),
                           rows=frame["run_id"].n_unique() if shape.sampled else frame.height,
                           samples=frame.height if shape.sampled else None,
                           thinking=thought_counts(frame, settings, bundle, store) if shape.thinking else None,
                           **_shard_fields(stats, shards), **generate_error_counters(frame),
                           generated_tokens=tokens, failed_rows=failed_rows(shards, stats, frame),
                           engine=inputs.fingerprint())


def thought_counts(frame: pl.DataFrame, settings: dict[str, GenerationSpec], bundle: BundleSummary,
                   store: LocalStore) -> ThoughtCounts:
    """The thoughts of the reasoning catalogs' generations: their tokens, those that never closed, and those of
    them that reached the token limit (thought and answer share it)."""
    catalogs = generation_rows(bundle, store).select("run_id", "catalog")
    ends = pl.DataFrame({"catalog": list(settings), "think_end": [g.think_end for g in settings.values()]},
                        schema={"catalog": pl.String, "think_end": pl.String})
    thoughts = (frame.join(catalogs, on="run_id", how="left").join(ends, on="catalog", how="left")
                .filter(pl.col("think_end").is_not_null() & pl.col("finish_reason").is_in(["stop", "length"])))
    unclosed = thoughts.filter(~pl.col("generation").str.contains(pl.col("think_end"), literal=True))
    lengths = thoughts["thought_tokens"].drop_nulls().to_list()
    return ThoughtCounts(generations=thoughts.height, mean=sum(lengths) / len(lengths) if lengths else 0.0,
                         max=max(lengths, default=0), unclosed=unclosed.height,
                         unclosed_at_max_tokens=unclosed.filter(pl.col("finish_reason") == "length").height)


generate_stage = CachedStage(GenerateInputs, GenerateSummary, body=_generate)
"""Every generative row of the bundle continued as its catalog says (stop sequences, max tokens, greedy or sampled
`samples` times, thinking)."""


def _written(frame: pl.DataFrame, out: Path) -> pl.DataFrame:
    """An engine stage's merged frame when it has no shards (no row to read: a suite of generative catalogs
    alone has no multiple-choice row), written as its artifact."""
    from jex.tasks.store import write_parquet

    write_parquet(frame, out)
    return frame
