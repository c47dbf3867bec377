"""Engine stages: bundle, fast pass and reason, content-addressed in the store and sharded.

Each function returns a small summary (paths, sha256s, counters): tasks hand each other these, never
the frames. A completed stage folder is reused as is: the engine is not even loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from jex.engine.types import FinishReason, Generation, Readout, ReadoutMode
from jex.fileio import sha256_file
from jex.tasks.capture.batch_errors import BATCH_ERROR, compute_resilient
from jex.tasks.capture.bundle import build_bundle, open_bundle, suite_files
from jex.tasks.capture.engine_calls import FewShotPool, SimpleRow, fast_pass, reason, reread
from jex.tasks.capture.engine_pool import CALLS, EngineSpec, audited_fingerprint, fingerprint, get_engine
from jex.tasks.keys import stage_key
from jex.tasks.store import LocalStore, merge_shards, partial_summary, run_sharded

Progress = Callable[[str, int, int], None]

READOUT_SCHEMA = {"run_id": pl.String, "logprobs": pl.List(pl.Float64), "label_mass": pl.Float64,
                  "refusal": pl.String}
REASON_SCHEMA = {"run_id": pl.String, "rationale": pl.String, "token_ids": pl.List(pl.Int64),
                 "finish_reason": pl.String, "post_logprobs": pl.List(pl.Float64), "refusal": pl.String}


def terminal_progress(stage: str, done: int, total: int) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r{stage:>10} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} shards")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def bundle_stage(suite_dir: str | Path, store: LocalStore, reference: str | None = None) -> dict[str, Any]:
    """Build (or reuse) the bundle of a suite folder; keyed by the suite files' sha256 (and the
    reference rows file's, when the bundle carries one: `tasks/scoring/reference_audit.py`)."""
    from jex.suite import load_manifest

    suite_dir = Path(suite_dir)
    manifest = load_manifest(suite_dir)
    files = [suite_dir / "suite.toml", *suite_files(suite_dir, manifest)]
    inputs = {p.relative_to(suite_dir).as_posix(): sha256_file(p) for p in files}
    if reference:
        inputs["reference"] = sha256_file(reference)
    key = stage_key("bundle", params={}, inputs=inputs)
    sd = store.stage("bundle", key)
    if sd.complete:
        return sd.summary()
    result = build_bundle(suite_dir, sd.path / "bundle.tar.gz", reference=reference)
    return sd.finish({"stage": "bundle", "key": key, "bundle": str(result.path), "sha256": result.sha256,
                      "rows": result.rows})


def _bundle_rows(bundle: dict[str, Any], store: LocalStore) -> pl.DataFrame:
    opened = open_bundle(bundle["bundle"], store.root / "bundle" / bundle["key"] / "extracted")
    if opened.sha256 != bundle["sha256"]:
        raise RuntimeError(f"{bundle['bundle']} changed since it was built")
    return opened.rows(["run_id", "catalog", "question_id", "prompt", "options", "labels", "gold"])


def _as_rows(frame: pl.DataFrame) -> list[SimpleRow]:
    return [SimpleRow(r["run_id"], r["prompt"], tuple(r["labels"]), tuple(r["options"]), r["gold"], r["catalog"],
                      r["question_id"]) for r in frame.iter_rows(named=True)]


def fewshot_pool(bundle: dict[str, Any], store: LocalStore, engine: EngineSpec) -> FewShotPool | None:
    """The bundle's few-shot rows by catalog, when the render asks for examples (else None)."""
    if engine.render.num_fewshot == 0:
        return None
    opened = open_bundle(bundle["bundle"], store.root / "bundle" / bundle["key"] / "extracted")
    frame = opened.fewshot()
    pool: dict[str, list[SimpleRow]] = {}
    for r in _as_rows(frame) if frame is not None else []:
        pool.setdefault(r.catalog or "", []).append(r)
    return pool


def readouts_frame(readouts: list[Readout]) -> pl.DataFrame:
    return pl.DataFrame({"run_id": [r.run_id for r in readouts],
                         "logprobs": [list(r.logprobs) if r.logprobs is not None else None for r in readouts],
                         "label_mass": [r.label_mass for r in readouts],
                         "refusal": [r.refusal for r in readouts]}, schema=READOUT_SCHEMA)


def stage_plan(stage: str, args: dict[str, Any], engine_fp: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where an engine stage's shards go and how many there are, without loading anything heavy.

    `args` is what `jex stage run` reads (bundle, engine, store, shard_rows[, gate, max_tokens]);
    `engine_fp` is the fingerprint measured on the machine that computes the stage (default: here).
    """
    fp = engine_fp or fingerprint(EngineSpec.model_validate(args["engine"]))
    if stage == "fast_pass":
        key, rows = _fast_pass_key(args["bundle"], fp), args["bundle"]["rows"]
    elif stage == "reason":
        key, rows = _reason_key(args["bundle"], args["gate"], fp, args["max_tokens"]), args["gate"]["rows"]
    else:
        raise ValueError(f"unknown engine stage {stage!r}")
    folder = Path(args["store"]) / stage / key
    return {"stage": stage, "key": key, "folder": str(folder),
            "shards_dir": str(folder / f"shards-{args['shard_rows']}"),
            "shards": -(-rows // args["shard_rows"]), "complete": (folder / "_SUCCESS.json").exists(), "engine": fp}


def _fast_pass_key(bundle: dict[str, Any], fp: dict[str, Any]) -> str:
    return stage_key("fast_pass", params={"mode": "label_slot"}, inputs={"bundle": bundle["sha256"]},
                     engine=audited_fingerprint(fp))


def _reason_key(bundle: dict[str, Any], gate: dict[str, Any], fp: dict[str, Any], max_tokens: int) -> str:
    return stage_key("reason", params={"max_tokens": max_tokens},
                     inputs={"bundle": bundle["sha256"], "gate": gate["sha256"]}, engine=fp)


def fast_pass_stage(bundle: dict[str, Any], engine: EngineSpec, store: LocalStore, *, shard_rows: int = 32,
                    worker: int = 0, workers: int = 1, progress: Progress | None = None,
                    engine_fp: dict[str, Any] | None = None, claim: bool = False) -> dict[str, Any]:
    """Label-slot readout of every row, sharded; `capture.parquet` is the merge of the shards.

    `engine_fp` overrides the local fingerprint when the shards were computed on another machine;
    `claim`: this worker's shards are shared with other processes (`run_sharded`).
    """
    engine_fp = engine_fp or fingerprint(engine)
    key = _fast_pass_key(bundle, engine_fp)
    sd = store.stage("fast_pass", key)
    if sd.complete:
        return sd.summary()
    rows = _as_rows(_bundle_rows(bundle, store))
    pool = fewshot_pool(bundle, store, engine)

    def readout(batch: list[SimpleRow]) -> pl.DataFrame:
        return readouts_frame(read_with_fallback(get_engine(engine), batch, render=engine.render, fewshot=pool))

    def compute(chunk: list[SimpleRow]) -> pl.DataFrame:
        CALLS["fast_pass"] += 1
        return compute_resilient(chunk, readout, lambda rows, why: readouts_frame(
            [Readout(r.run_id, None, None, None, ReadoutMode.LABEL_SLOT, why) for r in rows]))

    shards = sd.path / f"shards-{shard_rows}"
    stats = run_sharded(rows, shard_rows=shard_rows, folder=shards, compute=compute, worker=worker, workers=workers,
                        on_shard=(lambda d, t: progress("fast_pass", d, t)) if progress else None,
                        prepare=lambda: get_engine(engine), claim=claim)
    if (workers > 1 or claim) and len(list(shards.glob("shard-*.parquet"))) < stats.shards:
        return partial_summary("fast_pass", key, stats)
    frame = merge_shards(shards, stats.shards, sd.path / "capture.parquet")
    return sd.finish({"stage": "fast_pass", "key": key, "capture": str(sd.path / "capture.parquet"),
                      "sha256": sha256_file(sd.path / "capture.parquet"), "rows": frame.height,
                      "shard_rows": shard_rows, "shards": stats.shards, "computed_shards": stats.computed,
                      "reused_shards": stats.reused, "compute_seconds": stats.compute_seconds,
                      "computed_rows": stats.computed_rows,
                      **fast_pass_error_counters(frame), "engine": engine_fp})


def read_with_fallback(eng: Any, rows: list[SimpleRow], **render: Any) -> list[Readout]:
    """Label-slot readout; a row whose labels are not single tokens is read again through the
    fallback path, the options' continuation log-likelihoods (its `label_mass` stays null).
    `render` goes to `capture.fast_pass` unchanged."""
    readouts = list(fast_pass(eng, rows, **render))
    redo = [i for i, r in enumerate(readouts) if r.refusal is not None and r.refusal.startswith("label token")]
    if redo:
        again = fast_pass(eng, [rows[i] for i in redo], ReadoutMode.OPTION_CONTINUATION, **render)
        for i, r in zip(redo, again, strict=True):
            readouts[i] = r
    return readouts


def fast_pass_error_counters(frame: pl.DataFrame) -> dict[str, int]:
    """Disjoint counters of a capture: context refusals, batch errors, other readout errors, and
    key fallbacks (rows read, but through the continuation fallback: logprobs without label mass)."""
    refusal = pl.col("refusal")
    return {"context_refusals": frame.filter(refusal.str.starts_with("context")).height,
            "batch_errors": frame.filter(refusal.str.starts_with(BATCH_ERROR)).height,
            "readout_errors": frame.filter(refusal.is_not_null() & ~refusal.str.starts_with("context")
                                           & ~refusal.str.starts_with(BATCH_ERROR)).height,
            "key_fallbacks": frame.filter(pl.col("logprobs").is_not_null() & pl.col("label_mass").is_null()).height}


def reason_error_counters(frame: pl.DataFrame) -> dict[str, int]:
    """Disjoint counters of the reason stage: rationale prompts refused for context, batch errors,
    and mechanism failures (a rationale was written but could not be re-read)."""
    batch = pl.col("refusal").str.starts_with(BATCH_ERROR).fill_null(False)
    return {"context_refusals": frame.filter(pl.col("finish_reason") == FinishReason.REFUSED.value).height,
            "batch_errors": frame.filter(batch).height,
            "mechanism_failures": frame.filter(pl.col("finish_reason").is_in(["stop", "length"])
                                               & pl.col("post_logprobs").is_null() & ~batch).height}


def failed_reason_frame(rows: list[SimpleRow], why: str) -> pl.DataFrame:
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
        "refusal": ["context: rationale prompt too long" if g.finish_reason is FinishReason.REFUSED else p.refusal
                    for g, p in zip(gens, posts, strict=True)]},
        schema=REASON_SCHEMA)


def reason_stage(bundle: dict[str, Any], gate: dict[str, Any], engine: EngineSpec, store: LocalStore, *,
                 max_tokens: int, shard_rows: int = 8, worker: int = 0,
                 workers: int = 1, progress: Progress | None = None,
                 engine_fp: dict[str, Any] | None = None, claim: bool = False) -> dict[str, Any]:
    """A greedy rationale for each gated row, then the options re-read after it (post-thought readout)."""
    engine_fp = engine_fp or fingerprint(engine)
    key = _reason_key(bundle, gate, engine_fp, max_tokens)
    sd = store.stage("reason", key)
    if sd.complete:
        return sd.summary()
    gated = pl.read_parquet(gate["gated"])["run_id"]
    rows = _as_rows(_bundle_rows(bundle, store).join(gated.to_frame(), on="run_id", how="semi", maintain_order="left"))

    def think(batch: list[SimpleRow]) -> pl.DataFrame:
        eng = get_engine(engine)
        gens = reason(eng, batch, max_tokens=max_tokens, render=engine.render)
        return reason_frame(gens, reread(eng, batch, gens, render=engine.render))

    def compute(chunk: list[SimpleRow]) -> pl.DataFrame:
        CALLS["reason"] += 1
        return compute_resilient(chunk, think, failed_reason_frame)

    shards = sd.path / f"shards-{shard_rows}"
    stats = run_sharded(rows, shard_rows=shard_rows, folder=shards, compute=compute, worker=worker, workers=workers,
                        on_shard=(lambda d, t: progress("reason", d, t)) if progress else None,
                        prepare=lambda: get_engine(engine), claim=claim)
    if (workers > 1 or claim) and len(list(shards.glob("shard-*.parquet"))) < stats.shards:
        return partial_summary("reason", key, stats)
    out = sd.path / "reasoned.parquet"
    frame = merge_shards(shards, stats.shards, out) if stats.shards else _empty_reason(out)
    lengths = [len(t) for t in frame["token_ids"].to_list()]
    return sd.finish({"stage": "reason", "key": key, "reasoned": str(out), "sha256": sha256_file(out),
                      "rows": frame.height, "shards": stats.shards, "computed_shards": stats.computed,
                      "reused_shards": stats.reused, "compute_seconds": stats.compute_seconds,
                      "computed_rows": stats.computed_rows,
                      **reason_error_counters(frame),
                      "rationale_tokens": {"mean": sum(lengths) / len(lengths) if lengths else 0.0,
                                           "max": max(lengths, default=0),
                                           "hit_max_tokens": frame.filter(pl.col("finish_reason") == "length").height},
                      "engine": engine_fp})


def _empty_reason(out: Path) -> pl.DataFrame:
    from jex.tasks.store import write_parquet

    frame = reason_frame([], [])
    write_parquet(frame, out)
    return frame
