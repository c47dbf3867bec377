"""Parity: do two engines compute the same function on the same rows?

Readout parity compares the fast-pass readouts: argmax agreement, flips, mean / p95 / max |Δp|,
and the flips' pre-margins (a flip on a near-tie is expected numerics; a flip on a wide margin is
a defect). `parity_with_capture` compares one live engine with a stored capture (`jex parity
--reference CAPTURE`) with the same readout metrics. Generation parity compares the choice after a
rationale: each engine writes its own rationale and re-reads the options after it; every mismatch
is recorded with both choices, the gold answer and the margins (`parity-mismatches.parquet` beside
the report: run_id, catalog, pre-margin, both post-margins, both answers).

`parity_with_run` (`jex parity --reference RUN`) does both against a finished run folder, with no second
engine: the live engine's readouts against the run's fast-pass capture, and its own rationales and
post-rationale answers against the run's (`reasoned.parquet`), rendered as the run rendered them and
as long as its rationales were allowed to be.

A parity run on fewer rows than the suite takes a stratified sample (`stratified_rows`: every catalog
in proportion, rows drawn by a seeded generator per catalog), not the first N rows: a prefix is
whatever catalogs the suite lists first, and a sample drawn by position is a prefix-selection artifact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict, cast

import numpy as np
import polars as pl
from pydantic import Field

from jex.engine.base import TokenizedEngine
from jex.engine.render import DEFAULT_RENDER
from jex.engine.types import FinishReason, Generation, Readout, ReadoutMode
from jex.engine_spec import RenderSpec
from jex.errors import InputError
from jex.fileio import sha256_file, write_json
from jex.lab.jobs import ReadoutMetrics
from jex.numerics import margin, named_rng
from jex.record import Record, read_record
from jex.suite import read_row_file
from jex.tasks.capture.engine_calls import RowLike, fast_pass, reason, reread
from jex.tasks.store import write_parquet


class FlipRow(TypedDict):
    """A row whose argmax differs between the two sides, with both margins (log-odds)."""

    run_id: str
    choice_a: int | None
    choice_b: int | None
    gold: int | None
    margin_a: float | None
    margin_b: float | None


class _ReadoutCounts(TypedDict):
    common: int  # rows both sides read
    refused: int


class ReadoutParity(_ReadoutCounts, total=False):
    """Readout parity; with no common row only the counts."""

    argmax_agreement: float
    agree: int
    flips: int
    mean_abs_dp: float
    p95_abs_dp: float
    max_abs_dp: float
    flip_pre_margin_median: float | None
    flip_pre_margin_max: float | None
    flip_rows: list[FlipRow]  # the first 200


PARITY_SAMPLE_SEED = 20261203
"""Seed of the stratified parity sample (`stratified_rows`)."""


class ReasonedMismatch(TypedDict):
    run_id: str
    catalog: str | None
    choice_a: int | None
    choice_b: int | None
    gold: int | None
    pre_choice: int | None
    pre_margin: float | None
    post_margin_a: float | None
    post_margin_b: float | None


class ReasonedParity(TypedDict):
    """Choice parity after each engine's own rationale."""

    rows: int
    choice_agreement: float | None
    mismatches: list[ReasonedMismatch]
    identical_rationales: int


class _ParityCore(TypedDict):
    readout: ReadoutParity
    timings: dict[str, float]
    accuracy_a: float | None
    accuracy_b: float | None


class ParityResult(_ParityCore, total=False):
    """`parity.json`: readout parity, timings, both accuracies, [choice parity], [provenance of A and B]."""

    reasoned: ReasonedParity
    provenance: dict[str, Any]


class FlipRowDoc(Record):
    run_id: str
    choice_a: int | None
    choice_b: int | None
    gold: int | None
    margin_a: float | None
    margin_b: float | None


class ReadoutParityDoc(ReadoutMetrics):
    flip_rows: list[FlipRowDoc] | None = Field(None, description="The first 200 (absent with no common row)")


class ReasonedMismatchDoc(Record):
    run_id: str
    catalog: str | None
    choice_a: int | None
    choice_b: int | None
    gold: int | None
    pre_choice: int | None
    pre_margin: float | None
    post_margin_a: float | None
    post_margin_b: float | None


class ReasonedParityDoc(Record):
    rows: int
    choice_agreement: float | None
    mismatches: list[ReasonedMismatchDoc]
    identical_rationales: int


PARITY_FILE = "parity.json"


class ParityDoc(Record):
    """`parity.json`, the record of a `ParityResult`: written through it (`write_parity`, the keys the
    result holds) and read back through it (`read_parity`)."""

    version: Literal[1] = Field(1, description="The record's version (absent before it: 1)")
    readout: ReadoutParityDoc
    timings: dict[str, float]
    accuracy_a: float | None
    accuracy_b: float | None
    reasoned: ReasonedParityDoc | None = None
    provenance: dict[str, Any] | None = None
    settings: dict[str, Any] | None = Field(None, description="bench/gpu_engines.py's arguments, in its files")


def write_parity(out: str | Path, result: ParityResult) -> str:
    """`OUT/parity.json`: the result validated as `ParityDoc`, with the keys it holds; the sha256 written."""
    doc = ParityDoc.model_validate(result)
    return write_json(Path(out) / PARITY_FILE, doc.model_dump(mode="json", exclude_unset=True, fallback=str))


def read_parity(path: str | Path) -> ParityDoc:
    """`parity.json` (a folder: the file in it), validated as `ParityDoc`."""
    path = Path(path)
    return read_record(ParityDoc, path / PARITY_FILE if path.is_dir() else path)


def compare_readouts(a: Sequence[Readout], b: Sequence[Readout],
                     gold: dict[str, int] | None = None) -> ReadoutParity:
    """Argmax agreement, |dp| statistics and flips over the rows both sides read."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if x.logprobs is not None and y.logprobs is not None]
    refused = len(a) - len(pairs)
    if not pairs:
        return {"common": 0, "refused": refused}
    dp = np.array([abs(math.exp(p) - math.exp(q)) for x, y in pairs  # both read: logprobs not None
                   for p, q in zip(cast(Sequence[float], x.logprobs), cast(Sequence[float], y.logprobs), strict=True)])
    flips: list[FlipRow] = [{"run_id": x.run_id, "choice_a": x.choice, "choice_b": y.choice,
              "gold": (gold or {}).get(x.run_id), "margin_a": margin(x.logprobs), "margin_b": margin(y.logprobs)}
             for x, y in pairs if x.choice != y.choice]
    agree = len(pairs) - len(flips)
    margins = cast(list[float], [f["margin_a"] for f in flips])  # a flip has two options read: margins set
    return {"common": len(pairs), "refused": refused, "argmax_agreement": agree / len(pairs), "agree": agree,
            "flips": len(flips), "mean_abs_dp": float(dp.mean()), "p95_abs_dp": float(np.percentile(dp, 95)),
            "max_abs_dp": float(dp.max()), "flip_pre_margin_median": float(np.median(margins)) if margins else None,
            "flip_pre_margin_max": float(max(margins)) if margins else None, "flip_rows": flips[:200]}


def compare_reasoned(rows: Sequence[RowLike], gen_a: Sequence[Generation], gen_b: Sequence[Generation],
                     post_a: Sequence[Readout], post_b: Sequence[Readout], pre_a: Sequence[Readout],
                     gold: dict[str, int] | None = None) -> ReasonedParity:
    """Choice agreement after each side's rationale; every mismatch with both choices and margins."""
    mismatches: list[ReasonedMismatch] = []
    same_tokens = 0
    for r, ga, gb, pa, pb, pre in zip(rows, gen_a, gen_b, post_a, post_b, pre_a, strict=True):
        same_tokens += ga.token_ids == gb.token_ids
        if pa.choice != pb.choice:
            mismatches.append({"run_id": r.run_id, "catalog": getattr(r, "catalog", None), "choice_a": pa.choice,
                               "choice_b": pb.choice, "gold": (gold or {}).get(r.run_id), "pre_choice": pre.choice,
                               "pre_margin": margin(pre.logprobs), "post_margin_a": margin(pa.logprobs),
                               "post_margin_b": margin(pb.logprobs)})
    n = len(rows)
    return {"rows": n, "choice_agreement": (n - len(mismatches)) / n if n else None, "mismatches": mismatches,
            "identical_rationales": same_tokens}


MISMATCH_SCHEMA = {"run_id": pl.String, "catalog": pl.String, "pre_margin": pl.Float64, "post_margin_a": pl.Float64,
                   "post_margin_b": pl.Float64, "choice_a": pl.Int64, "choice_b": pl.Int64, "pre_choice": pl.Int64,
                   "gold": pl.Int64}


def mismatch_frame(reasoned: ReasonedParity) -> pl.DataFrame:
    """The reason-parity mismatch record: one row per mismatch (MISMATCH_SCHEMA), empty when none."""
    return pl.DataFrame([{k: m.get(k) for k in MISMATCH_SCHEMA} for m in reasoned["mismatches"]],
                        schema=MISMATCH_SCHEMA)


def write_mismatches(result: ParityResult, out: str | Path) -> Path | None:
    """`OUT/parity-mismatches.parquet` when the result holds choice parity; None otherwise."""
    if "reasoned" not in result:
        return None
    path = Path(out) / "parity-mismatches.parquet"
    write_parquet(mismatch_frame(result["reasoned"]), path)
    return path


def stratified_rows(rows: Sequence[RowLike], n: int, *, seed: int = PARITY_SAMPLE_SEED) -> list[RowLike]:
    """`n` rows (all when n <= 0 or n >= len(rows)) in suite order, every catalog in proportion to its size
    (largest remainders; ties by catalog name), each catalog's rows drawn by `named_rng(seed, catalog)`."""
    if n <= 0 or n >= len(rows):
        return list(rows)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(str(getattr(r, "catalog", None) or ""), []).append(i)
    exact = {c: n * len(ix) / len(rows) for c, ix in groups.items()}
    quota = {c: math.floor(q) for c, q in exact.items()}
    for c in sorted(groups, key=lambda c: (-(exact[c] - quota[c]), c))[:n - sum(quota.values())]:
        quota[c] += 1
    picked = [ix[j] for c, ix in groups.items() for j in named_rng(seed, c).permutation(len(ix))[:quota[c]]]
    return [rows[i] for i in sorted(picked)]


def run_parity(engine_a: Any, engine_b: Any, rows: Sequence[RowLike], *, reason_rows: int = 0,
               max_tokens: int = 96, seed: int = PARITY_SAMPLE_SEED) -> ParityResult:
    """Fast-pass parity on `rows`; generation parity on a stratified sample of `reason_rows` of them."""
    reasoned_sub = stratified_rows(rows, reason_rows, seed=seed) if reason_rows else []
    gold = {r.run_id: r.gold for r in rows if getattr(r, "gold", None) is not None}  # type: ignore[attr-defined]
    timings: dict[str, float] = {}
    captures: dict[str, Any] = {}
    for name, eng in (("a", engine_a), ("b", engine_b)):
        t0 = time.perf_counter()
        captures[f"pre_{name}"] = fast_pass(eng, rows)
        timings[f"readout_rows_per_s_{name}"] = len(rows) / (time.perf_counter() - t0)
        sub = reasoned_sub
        if sub:
            t0 = time.perf_counter()
            captures[f"gen_{name}"] = reason(eng, sub, max_tokens=max_tokens)
            captures[f"post_{name}"] = reread(eng, sub, captures[f"gen_{name}"])
            timings[f"reason_seconds_{name}"] = time.perf_counter() - t0
    out: ParityResult = {"readout": compare_readouts(captures["pre_a"], captures["pre_b"], gold),
                         "timings": timings,
                         "accuracy_a": _acc(captures["pre_a"], gold), "accuracy_b": _acc(captures["pre_b"], gold)}
    if reasoned_sub:
        position = {r.run_id: i for i, r in enumerate(rows)}
        pre_a = [captures["pre_a"][position[r.run_id]] for r in reasoned_sub]
        out["reasoned"] = compare_reasoned(reasoned_sub, captures["gen_a"], captures["gen_b"], captures["post_a"],
                                           captures["post_b"], pre_a, gold)
    return out


def _engine(kind: str, *, model: str | None, device: str, batch_size: int) -> TokenizedEngine:
    """An engine of `kind` (validated against the engine spec: an unknown kind is refused by name)."""
    from jex.engine.factory import make_engine
    from jex.engine_spec import EngineSpec

    return make_engine(EngineSpec.model_validate({"kind": kind, "model": model, "device": device,
                                                  "batch_size": batch_size}))


def parity_of_kinds(kind_a: str, kind_b: str, rows: Sequence[RowLike], *, model: str | None, device: str,
                    batch_size: int, reason_rows: int = 0, max_tokens: int = 96,
                    seed: int = PARITY_SAMPLE_SEED) -> ParityResult:
    """`run_parity` on two engines built from their kinds, with both engines' provenance."""
    a = _engine(kind_a, model=model, device=device, batch_size=batch_size)
    b = _engine(kind_b, model=model, device=device, batch_size=batch_size)
    res = run_parity(a, b, rows, reason_rows=reason_rows, max_tokens=max_tokens, seed=seed)
    res["provenance"] = {"a": a.provenance(), "b": b.provenance()}
    return res


def capture_readouts(path: str | Path, run_ids: Sequence[str]) -> list[Readout]:
    """The stored readouts of `run_ids` (in that order) from a capture: a fast-pass `capture.parquet`
    (run_id, logprobs[, label_mass, refusal]) or reference rows (run_id, choice, probs; JSONL or
    Parquet). Errors name the file and the first run_id it lacks."""
    path = Path(path)
    try:
        frame = pl.read_parquet(path) if path.suffix == ".parquet" else pl.DataFrame(
            [rec for _, rec in read_row_file(path)], infer_schema_length=None)
    except (OSError, pl.exceptions.PolarsError) as e:
        raise InputError(f"cannot read the capture: {e}", file=str(path)) from None
    if "run_id" not in frame.columns or not {"logprobs", "probs"} & set(frame.columns):
        raise InputError("a capture needs run_id and logprobs (fast-pass capture) or probs (reference rows)",
                         file=str(path), field="run_id" if "run_id" not in frame.columns else "probs")
    if "logprobs" not in frame.columns:
        frame = frame.with_columns(logprobs=pl.col("probs").cast(pl.List(pl.Float64)).list.eval(
            pl.when(pl.element() > 0).then(pl.element().log()).otherwise(float("-inf"))))
    stored = {r["run_id"]: r for r in frame.select("run_id", "logprobs", *(
        c for c in ("label_mass", "refusal") if c in frame.columns)).iter_rows(named=True)}
    missing = [rid for rid in run_ids if rid not in stored]
    if missing:
        raise InputError(f"the capture lacks {len(missing)} of the rows (first: {missing[:3]})", file=str(path),
                         field="run_id")
    out = []
    for rid in run_ids:
        r = stored[rid]
        lp = tuple(r["logprobs"]) if r["logprobs"] is not None else None
        out.append(Readout(rid, lp, lp, r.get("label_mass"), ReadoutMode.LABEL_SLOT,
                           r.get("refusal") if lp is None else None))
    return out


def parity_with_capture(engine: Any, capture: str | Path, rows: Sequence[RowLike], *,
                        render: RenderSpec = DEFAULT_RENDER) -> ParityResult:
    """Readout parity of a live engine (A) against a stored capture (B) on `rows`: the metrics of
    `run_parity`, with no second engine."""
    gold = {r.run_id: r.gold for r in rows if getattr(r, "gold", None) is not None}  # type: ignore[attr-defined]
    stored = capture_readouts(capture, [r.run_id for r in rows])
    t0 = time.perf_counter()
    live = fast_pass(engine, rows, render=render)
    timings = {"readout_rows_per_s_a": len(rows) / (time.perf_counter() - t0)}
    return {"readout": compare_readouts(live, stored, gold), "timings": timings,
            "accuracy_a": _acc(live, gold), "accuracy_b": _acc(stored, gold),
            "provenance": {"a": engine.provenance(), "b": {"capture": str(capture),
                                                           "sha256": sha256_file(capture)}}}


def capture_parity_files(suite: str | Path, capture: str | Path, out: str | Path, *, kind: str, model: str | None,
                         device: str, batch_size: int, rows: int = 0,
                         seed: int = PARITY_SAMPLE_SEED) -> ParityResult:
    """`jex parity --reference CAPTURE`: engine `kind` live against the capture; parity.json + parity.md."""
    from jex.fileio import write_text
    from jex.suite import iter_rows

    picked = stratified_rows(list(iter_rows(suite)), rows, seed=seed)
    capture_readouts(capture, [r.run_id for r in picked])  # a bad capture fails before the engine loads
    res = parity_with_capture(_engine(kind, model=model, device=device, batch_size=batch_size), capture, picked)
    write_parity(out, res)
    write_text(Path(out) / "parity.md", markdown(res, (kind, f"capture {Path(capture).name}")))
    return res


def reasoned_reference(path: str | Path, run_ids: Sequence[str]) -> tuple[list[Generation], list[Readout]]:
    """The stored rationales (token ids, text, finish reason) and post-rationale readouts of `run_ids`, in
    that order, from a reason stage's `reasoned.parquet`."""
    frame = pl.read_parquet(path)
    stored = {r["run_id"]: r for r in frame.iter_rows(named=True)}
    missing = [rid for rid in run_ids if rid not in stored]
    if missing:
        raise InputError(f"the run reasoned on none of {missing[:3]}", file=str(path), field="run_id")
    gens, posts = [], []
    for rid in run_ids:
        r = stored[rid]
        reason = FinishReason.LENGTH if r["finish_reason"] == "length" else FinishReason.STOP
        gens.append(Generation(rid, r["rationale"] or "", tuple(r["token_ids"] or ()), reason))
        lp = tuple(r["post_logprobs"]) if r["post_logprobs"] is not None else None
        posts.append(Readout(rid, lp, lp, None, ReadoutMode.LABEL_SLOT, r["refusal"] if lp is None else None))
    return gens, posts


def parity_with_run(engine: Any, run_dir: str | Path, rows: Sequence[RowLike], *, reason_rows: int = 0,
                    seed: int = PARITY_SAMPLE_SEED) -> ParityResult:
    """A live engine (A) against a finished run (B) on `rows` of its suite: readout parity against its
    fast-pass capture and, on up to `reason_rows` of the rows it reasoned on (a stratified sample), choice
    parity after each side's rationale against its `reasoned.parquet`; the run's render settings and
    rationale length, no second engine."""
    from jex.run_records import RecordedCampaign
    from jex.tasks.run_store import run_summaries

    recorded, summaries = RecordedCampaign.read(run_dir), run_summaries(run_dir)
    if summaries.fast_pass is None:
        raise InputError("the run has no fast-pass stage", file=str(run_dir))
    render = recorded.engine.render
    result = parity_with_capture(engine, summaries.fast_pass.capture, rows, render=render)
    if reason_rows and summaries.reason is not None:
        reasoned = set(pl.read_parquet(summaries.reason.reasoned, columns=["run_id"])["run_id"].to_list())
        picked = stratified_rows([r for r in rows if r.run_id in reasoned], reason_rows, seed=seed)
        gen_b, post_b = reasoned_reference(summaries.reason.reasoned, [r.run_id for r in picked])
        pre_a = fast_pass(engine, picked, render=render)
        gen_a = reason(engine, picked, max_tokens=recorded.reason_max_tokens, render=render)
        post_a = reread(engine, picked, gen_a, render=render)
        gold = {r.run_id: r.gold for r in picked if getattr(r, "gold", None) is not None}  # type: ignore[attr-defined]
        result["reasoned"] = compare_reasoned(picked, gen_a, gen_b, post_a, post_b, pre_a, gold)
    result["provenance"] = {"a": engine.provenance(), "b": {"run": str(run_dir),
                                                           "capture_sha256": summaries.fast_pass.sha256}}
    return result


def run_parity_files(suite: str | Path, run_dir: str | Path, out: str | Path, *, kind: str, model: str | None,
                     device: str, batch_size: int, rows: int = 0, reason_rows: int = 0,
                     seed: int = PARITY_SAMPLE_SEED) -> ParityResult:
    """`jex parity --reference RUN`: engine `kind` live against the run; parity.json, parity.md and the
    mismatch record."""
    from jex.fileio import write_text
    from jex.suite import iter_rows

    picked = stratified_rows(list(iter_rows(suite)), rows, seed=seed)
    res = parity_with_run(_engine(kind, model=model, device=device, batch_size=batch_size), run_dir, picked,
                          reason_rows=reason_rows, seed=seed)
    write_parity(out, res)
    write_text(Path(out) / "parity.md", markdown(res, (kind, f"run {Path(run_dir).name}")))
    write_mismatches(res, out)
    return res


def _acc(readouts: Sequence[Readout], gold: dict[str, int]) -> float | None:
    scored = [r for r in readouts if r.run_id in gold]
    return sum(r.choice == gold[r.run_id] for r in scored) / len(scored) if scored else None


def markdown(result: ParityResult, names: tuple[str, str]) -> str:
    r = result["readout"]
    lines = [f"# Parity: {names[0]} vs {names[1]}", "", "| metric | value |", "|---|---|",
             f"| common rows | {r['common']} (refused {r['refused']}) |",
             f"| argmax agreement | {r['agree']} / {r['common']} = {100 * r['argmax_agreement']:.2f}% |",
             f"| flips | {r['flips']} |", f"| mean abs dp | {r['mean_abs_dp']:.3g} |",
             f"| p95 abs dp | {r['p95_abs_dp']:.3g} |", f"| max abs dp | {r['max_abs_dp']:.3g} |",
             f"| flips' median pre-margin (log-odds) | {r['flip_pre_margin_median']} |",
             f"| accuracy A / B | {result['accuracy_a']} / {result['accuracy_b']} |"]
    if "reasoned" in result:
        g = result["reasoned"]
        lines += [f"| choice agreement after a rationale | {g['rows'] - len(g['mismatches'])} / {g['rows']} |",
                  f"| identical rationales (token ids) | {g['identical_rationales']} / {g['rows']} |"]
        if g["mismatches"]:
            lines += ["", "| run_id | choice A | choice B | gold | pre choice | pre margin | post margin A | "
                      "post margin B |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {m['run_id']} | {m['choice_a']} | {m['choice_b']} | {m['gold']} | {m['pre_choice']} | "
                      f"{m['pre_margin']} | {m['post_margin_a']} | {m['post_margin_b']} |" for m in g["mismatches"]]
    return "\n".join(lines) + "\n"
