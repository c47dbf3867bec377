"""Pre-flight golden replay: a new machine re-reads a fixed slice of the bundle before it spends the budget.

The readout of the first `rows` rows is compared with a stored reference capture of the same
engine fingerprint; above the tolerance (max |dp| over every row and option) the machine must not
run its shards. Greedy generation, where batch variance shows first, is checked too: the first
`generation_rows` rows' rationale prompts decoded for `tokens` new tokens must be token-identical to
the reference of the same bundle, engine and GPU models (the first machine's becomes it). A re-run is a
reproduction, not an improvisation, on every machine.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import polars as pl

from jex.engine.fingerprint import engine_fingerprint
from jex.engine_identity import EngineFingerprint
from jex.engine_spec import EngineSpec
from jex.numerics import argmax
from jex.store_layout import golden_dir
from jex.tasks.bundle.reading import bundle_rows
from jex.tasks.capture.engine_calls import as_rows
from jex.tasks.capture.stages import (
    as_generative,
    catalog_reads,
    continued_options,
    fewshot_pool,
    generation_rows,
    readouts_frame,
)
from jex.tasks.documents import GenerationVerdict, GoldenRow, GoldenVerdict
from jex.tasks.execution.engine_pool import get_engine
from jex.tasks.inputs import EngineJob, GoldenInputs
from jex.tasks.records import BundleSummary
from jex.tasks.store import LocalStore, write_parquet


def golden_readout(bundle: BundleSummary, engine: EngineSpec, store: LocalStore, rows: int) -> pl.DataFrame:
    """The label-slot readout of the bundle's first `rows` rows (the same code path as the fast pass)."""
    from jex.tasks.capture.engine_calls import ReadPlan, fast_pass

    chunk = as_rows(bundle_rows(bundle, store).head(rows))
    reads = catalog_reads(bundle, store)
    return readouts_frame(fast_pass(get_engine(engine), chunk, render=engine.render,
                                   fewshot=fewshot_pool(bundle, store, engine), reads=reads),
                          continued_options(chunk, ReadPlan.of(chunk, reads)))


def golden_generation(bundle: BundleSummary, engine: EngineSpec, store: LocalStore, rows: int,
                      tokens: int) -> pl.DataFrame:
    """run_id, token_ids, text: the greedy generation of the bundle's first `rows` rows' rationale prompts
    (the reason stage's code path, `tokens` new tokens, no stop sequence, EOS ending a row early); in a
    bundle without multiple-choice rows, of its first generative rows' prompts (the generate stage's path)."""
    from jex.tasks.capture.engine_calls import GenerationSpec, prepared_generations, reason

    eng = get_engine(engine)
    chunk = as_rows(bundle_rows(bundle, store).head(rows))
    if chunk:
        out = reason(eng, chunk, max_tokens=tokens, render=engine.render)
    else:
        generative = generation_rows(bundle, store).head(rows)
        settings = {c: GenerationSpec((), tokens) for c in set(generative["catalog"].to_list())}
        out = eng.generate(prepared_generations(eng, cast(Any, as_generative(generative)), settings=settings,
                                                render=engine.render))
    return pl.DataFrame({"run_id": [g.run_id for g in out], "token_ids": [list(g.token_ids) for g in out],
                         "text": [g.text for g in out]},
                        schema={"run_id": pl.String, "token_ids": pl.List(pl.Int64), "text": pl.String})


def generation_reference_path(store: LocalStore, bundle: BundleSummary, engine_fp: EngineFingerprint,
                              gpus: list[str], rows: int, tokens: int) -> Path:
    """Where the store keeps the golden generation of a bundle, engine and GPU models (kernels differ
    across GPU models, so greedy tokens may too; a stack change on the same models must not change them)."""
    from jex.fileio import sha256_json

    key = sha256_json({"bundle": bundle.key, "engine": engine_fp.key_doc(), "gpus": gpus, "rows": rows,
                       "tokens": tokens})[:32]
    return golden_dir(store.root, bundle.key) / "generation" / key / "reference.parquet"


def compare_generation(reference: pl.DataFrame, replay: pl.DataFrame, *, source: str, tokens: int,
                       worst: int = 5) -> GenerationVerdict:
    """Token for token: each reference row's tokens against the replay's; a row missing on a side differs."""
    ref = dict(zip(reference["run_id"], reference["token_ids"].to_list(), strict=True))
    got = dict(zip(replay["run_id"], replay["token_ids"].to_list(), strict=True))
    differing = []
    for rid in sorted(ref.keys() | got.keys()):
        a, b = ref.get(rid), got.get(rid)
        if a is None or b is None:
            differing.append(f"{rid}: missing in {'reference' if a is None else 'replay'}")
        elif a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            differing.append(f"{rid}: token {at}")
    return GenerationVerdict(ok=not differing, rows=len(ref), tokens=tokens, reference=source,
                             differing=differing[:worst])


def reference_path(store: LocalStore, bundle: BundleSummary, engine_fp: EngineFingerprint, rows: int) -> Path:
    key = GoldenInputs(bundle=bundle, engine_fp=engine_fp, rows=rows).key()
    return golden_dir(store.root, bundle.key) / key / "reference.parquet"


def has_reference(store: LocalStore, bundle: BundleSummary) -> bool:
    """Whether the store holds a golden reference of this bundle for any engine (one a replay could meet)."""
    return any(golden_dir(store.root, bundle.key).glob("*/reference.parquet"))


def find_reference(store: LocalStore, bundle: BundleSummary, engine_fp: EngineFingerprint, rows: int,
                   fast_pass_capture: str | None = None) -> tuple[pl.DataFrame | None, str]:
    """The stored reference, else the head of a complete fast-pass capture of the same engine; (None, why) if none."""
    ref = reference_path(store, bundle, engine_fp, rows)
    if ref.exists():
        return pl.read_parquet(ref), str(ref)
    if fast_pass_capture and Path(fast_pass_capture).exists():
        return pl.read_parquet(fast_pass_capture).head(rows), fast_pass_capture
    return None, "no reference yet"


def store_reference(store: LocalStore, bundle: BundleSummary, engine_fp: EngineFingerprint,
                    frame: pl.DataFrame) -> Path:
    path = reference_path(store, bundle, engine_fp, frame.height)
    write_parquet(frame, path)
    return path


def compare_golden(reference: pl.DataFrame, replay: pl.DataFrame, tolerance: float = 1e-4,
                   worst: int = 5) -> GoldenVerdict:
    """max |p_ref - p_replay| over rows and options; rows missing on either side or refused differently fail."""
    ref = {r["run_id"]: r for r in reference.iter_rows(named=True)}
    got = {r["run_id"]: r for r in replay.iter_rows(named=True)}
    problems = [f"{rid}: missing in replay" for rid in ref if rid not in got]
    problems += [f"{rid}: not in reference" for rid in got if rid not in ref]
    diffs = []
    for rid in ref.keys() & got.keys():
        a, b = ref[rid]["logprobs"], got[rid]["logprobs"]
        if (a is None) != (b is None) or (a is not None and len(a) != len(b)):
            problems.append(f"{rid}: readout shape differs ({ref[rid]['refusal']!r} vs {got[rid]['refusal']!r})")
            continue
        if a is None:
            continue
        dp = max(abs(math.exp(x) - math.exp(y)) for x, y in zip(a, b, strict=True))
        diffs.append(GoldenRow(run_id=rid, max_abs_dp=dp, argmax_ref=argmax(a), argmax_replay=argmax(b)))
    diffs.sort(key=lambda d: (-d.max_abs_dp, d.run_id))
    top = diffs[0].max_abs_dp if diffs else 0.0
    return GoldenVerdict(ok=not problems and top <= tolerance, rows=len(ref), max_abs_dp=top, tolerance=tolerance,
                         worst=diffs[:worst], problems=problems[:worst])


def golden_job(job: EngineJob, rows: int, out: Path, fingerprint_out: Path,
               generation: tuple[int, int, Path] | None = None) -> None:
    """What `jex stage golden` runs on a machine: the replay, this machine's engine fingerprint and, with
    `generation` (rows, new tokens, Parquet out), the golden generation."""
    from jex.fileio import write_json

    engine = job.inputs.engine
    write_json(fingerprint_out, engine_fingerprint(engine).model_dump(mode="json"))
    if rows:  # rows 0: the fingerprint only (there is nothing to compare a replay with)
        write_parquet(golden_readout(job.inputs.bundle, engine, LocalStore(job.store), rows), out)
    if generation and generation[0]:
        generate_rows, tokens, generation_out = generation
        write_parquet(golden_generation(job.inputs.bundle, engine, LocalStore(job.store), generate_rows, tokens),
                      generation_out)
