"""The early-exit checkpoint probe: could a rationale be cut short without changing the answer?

For each probed row the rationale is generated once (greedy). At every `every`-th generated token m
the probe reads two things:

- the **free gate**: the rank and log-prob of the end-of-thought token as the next token after the
  first m rationale tokens (rank 1 = the model would end its thought here, so a decoder could stop
  for free); the token is the model's end of sequence unless `end_of_thought` names another (a
  reasoning model's `</think>`, one token in its vocabulary);
- the **checkpoint answer**: the options re-read after the first m tokens (the same re-read slot
  the reason stage uses after a whole rationale), i.e. the answer if the rationale were cut at m.

A policy "cut every rationale at m" then has an accuracy, flips against the full rationale's
answer, correct rows lost, and a token cost (mean of min(m, length)); the report lists them per
checkpoint and the first m whose accuracy is no worse than the full rationale's.

Beside "cut at m", the **stable-margin rule** (tau, k): a row exits at the first checkpoint where the
checkpoint answer has stayed the same, with its margin (top-1 minus top-2 log-odds) above tau, for k
consecutive checkpoints inside its rationale, answering there; a row that never qualifies keeps its
whole rationale. The report lists each (tau, k) of a small grid with its accuracy and tokens saved.

The probed rows are the ones the coverage gate would send to reasoning first, among a pool drawn from
each catalog in turn, each catalog's rows in a seeded random order (`pick_gated`): a stratified sample,
not the head of each catalog.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from jex.engine.render import DEFAULT_RENDER
from jex.engine.types import NextTokenRequest, ReadoutMode, ReadoutRequest
from jex.engine_spec import RenderSpec
from jex.numerics import argmax, margin, named_rng
from jex.record import Record, read_record
from jex.settings import BOOTSTRAP_SEED
from jex.tasks.capture.engine_calls import CaptureRow, as_row, reason, reason_prompts

DEFAULT_TAUS = (1.0, 2.0, 3.0)
"""Margin thresholds (log-odds) of the stable-margin grid."""
DEFAULT_KS = (2, 3)
"""Consecutive checkpoints of the stable-margin grid."""


class CheckpointStats(Record):
    """A policy that cuts every rationale at `tokens` (rows that ended earlier keep their whole one)."""

    tokens: int
    mean_tokens_spent: float
    accuracy: float
    agreement_with_full: float = Field(description="Share of rows whose answer equals the full rationale's")
    flips: int = Field(description="Rows whose answer differs from the full rationale's")
    correct_lost: int = Field(description="Rows right after the full rationale, wrong when cut here")
    still_thinking: int = Field(description="Rows whose rationale is longer than `tokens`")
    gate_fired: int = Field(description="Of those, rows where end-of-sequence is the top next token")


class StableMarginStats(Record):
    """The stable-margin rule (tau, k) over the probed rows (see the module docstring)."""

    tau: float = Field(description="Margin threshold (log-odds)")
    k: int = Field(description="Consecutive checkpoints the margin must stay above tau")
    exited: int = Field(description="Rows that exited before the end of their rationale")
    mean_tokens_spent: float
    tokens_saved: int = Field(description="Rationale tokens not generated, over all rows")
    accuracy: float
    flips: int = Field(description="Rows whose answer differs from the full rationale's")
    correct_lost: int = Field(description="Rows right after the full rationale, wrong after the exit")


class ProbeResult(Record):
    """`probe.json`, written by `write_record` and read back through `read_probe`."""

    version: Literal[1] = Field(1, description="The record's version (absent before it: 1)")
    rows: int
    every: int
    max_tokens: int
    end_of_thought: str | None = Field(None, description="The token the free gate watched; None: end of sequence")
    engine: dict[str, Any]
    full_accuracy: float
    mean_rationale_tokens: float
    gate_checkpoints: int = Field(description="(row, m) pairs with m inside the rationale")
    gate_fired: int
    gate_fire_rate: float
    gate_tokens_saved: int = Field(description="Tokens saved by stopping each row at its first fired checkpoint")
    gate_correct_lost: int
    checkpoints: list[CheckpointStats]
    first_matching_checkpoint: int | None = Field(description="First m whose accuracy >= the full rationale's")
    tokens_saved_at_first_match: int | None
    stable_margin: list[StableMarginStats] = Field(default_factory=list, description="The (tau, k) grid")


def read_probe(path: str | Path) -> ProbeResult:
    return read_record(ProbeResult, path)


def end_of_thought_id(tokenizer: Any, end_of_thought: str | None) -> int:
    """The token id the free gate watches: the tokenizer's end of sequence, or `end_of_thought` when it is
    one token of the vocabulary (refused otherwise: a gate on part of a string would fire on prefixes)."""
    if end_of_thought is None:
        return int(tokenizer.eos_token_id)
    ids = tokenizer.encode(end_of_thought, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"end-of-thought {end_of_thought!r} is {len(ids)} tokens ({ids}) in this tokenizer; "
                         "the free gate watches one token")
    return int(ids[0])


def probe_rows(engine: Any, rows: Sequence[CaptureRow], *, every: int, max_tokens: int,
               render: RenderSpec = DEFAULT_RENDER, taus: Sequence[float] = DEFAULT_TAUS,
               ks: Sequence[int] = DEFAULT_KS, end_of_thought: str | None = None) -> ProbeResult:
    """Generate each row's rationale, then read the free gate (`end_of_thought`, default the end of
    sequence) and the answer at every checkpoint; the stable-margin rule is judged for every (tau, k) of
    `taus` x `ks`."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if any(k < 1 for k in ks):
        raise ValueError(f"every k must be >= 1, got {list(ks)}")
    watched = end_of_thought_id(engine.tokenizer, end_of_thought)
    prompts = reason_prompts(engine, rows, render)
    gens = reason(engine, rows, max_tokens=max_tokens, render=render)
    renderer = engine.renderer(render)
    marks = list(range(every, max_tokens + 1, every))
    # checkpoint answers: the re-read after min(m, length) tokens, each distinct cut read once
    cuts: dict[tuple[int, int], str] = {}
    for i, g in enumerate(gens):
        length = len(g.token_ids)
        for m in [*marks, length]:
            k = min(m, length)
            if (i, k) not in cuts:
                text = g.text if k == length else engine.tokenizer.decode(list(g.token_ids[:k]),
                                                                          skip_special_tokens=True)
                cuts[(i, k)] = renderer.after_thought(prompts[i], text)
    keys = list(cuts)
    readouts = engine.readout([ReadoutRequest(f"{rows[i].run_id}@{k}", cuts[(i, k)], tuple(rows[i].labels),
                                              tuple(rows[i].options)) for i, k in keys], ReadoutMode.LABEL_SLOT)
    answer = {key: argmax(r.logprobs) for key, r in zip(keys, readouts, strict=True)}
    margins = {key: margin(r.logprobs) for key, r in zip(keys, readouts, strict=True)}
    inside = [(i, m) for i, g in enumerate(gens) for m in marks if m < len(g.token_ids)]
    stats = engine.next_token([NextTokenRequest(f"{rows[i].run_id}@{m}", prompts[i], tuple(gens[i].token_ids[:m]),
                                                (watched,)) for i, m in inside])
    fired = {(i, m) for (i, m), st in zip(inside, stats, strict=True) if st.ranks and st.ranks[0] == 1}
    result = _summarise(engine, rows, gens, answer, marks, inside, fired, every=every, max_tokens=max_tokens,
                        end_of_thought=end_of_thought)
    lengths = [len(g.token_ids) for g in gens]
    grid = [stable_margin_stats(rows, lengths, answer, margins, marks, tau=t, k=k) for t in taus for k in ks]
    return result.model_copy(update={"stable_margin": grid})


def stable_exit(margins: Sequence[float | None], answers: Sequence[int | None], *, tau: float, k: int) -> int | None:
    """Index of the first checkpoint that closes a run of `k` consecutive checkpoints with the same answer,
    each with its margin above `tau`; None: no exit. An unread margin (None) breaks the run; a changed
    answer starts a new one."""
    run = 0
    for j, m in enumerate(margins):
        if m is None or not m > tau:
            run = 0
        else:
            run = run + 1 if run and answers[j] == answers[j - 1] else 1
        if run >= k:
            return j
    return None


def stable_margin_stats(rows: Sequence[CaptureRow], lengths: Sequence[int],
                        answer: dict[tuple[int, int], int | None], margins: dict[tuple[int, int], float | None],
                        marks: Sequence[int], *, tau: float, k: int) -> StableMarginStats:
    """The stable-margin rule over probed rows: `answer` and `margins` keyed by (row, tokens read), with
    each row's whole rationale at (row, its length)."""
    n = len(rows)
    spent, exited, ok, flips, lost = [], 0, 0, 0, 0
    for i, row in enumerate(rows):
        length = lengths[i]
        inside = [m for m in marks if m < length]
        j = stable_exit([margins[(i, m)] for m in inside], [answer[(i, m)] for m in inside], tau=tau, k=k)
        stop = inside[j] if j is not None else length
        exited += j is not None
        spent.append(stop)
        full, got = answer[(i, length)], answer[(i, stop)]
        ok += got == row.gold
        flips += got != full
        lost += full == row.gold and got != row.gold
    return StableMarginStats(tau=tau, k=k, exited=exited, mean_tokens_spent=sum(spent) / n if n else 0.0,
                             tokens_saved=sum(lengths) - sum(spent), accuracy=ok / n if n else math.nan, flips=flips,
                             correct_lost=lost)


def _summarise(engine: Any, rows: Sequence[CaptureRow], gens: Sequence[Any], answer: dict[tuple[int, int], int | None],
               marks: list[int], inside: list[tuple[int, int]], fired: set[tuple[int, int]], *, every: int,
               max_tokens: int, end_of_thought: str | None) -> ProbeResult:
    n = len(rows)
    lengths = [len(g.token_ids) for g in gens]
    full = [answer[(i, lengths[i])] for i in range(n)]
    right = [full[i] == rows[i].gold for i in range(n)]
    checkpoints = []
    for m in marks:
        cut = [answer[(i, min(m, lengths[i]))] for i in range(n)]
        ok = [cut[i] == rows[i].gold for i in range(n)]
        checkpoints.append(CheckpointStats(
            tokens=m, mean_tokens_spent=sum(min(m, k) for k in lengths) / n, accuracy=sum(ok) / n,
            agreement_with_full=sum(c == f for c, f in zip(cut, full, strict=True)) / n,
            flips=sum(c != f for c, f in zip(cut, full, strict=True)),
            correct_lost=sum(r and not o for r, o in zip(right, ok, strict=True)),
            still_thinking=sum(k > m for k in lengths), gate_fired=sum((i, m) in fired for i in range(n))))
    first_fire = {i: min(m for j, m in fired if j == i) for i in {j for j, _ in fired}}
    full_acc = sum(right) / n if n else math.nan
    match = next((c for c in checkpoints if c.accuracy >= full_acc), None)
    return ProbeResult(
        rows=n, every=every, max_tokens=max_tokens, end_of_thought=end_of_thought, engine=engine.provenance(),
        full_accuracy=full_acc,
        mean_rationale_tokens=sum(lengths) / n if n else 0.0, gate_checkpoints=len(inside), gate_fired=len(fired),
        gate_fire_rate=len(fired) / len(inside) if inside else 0.0,
        gate_tokens_saved=sum(lengths[i] - m for i, m in first_fire.items()),
        gate_correct_lost=sum(right[i] and answer[(i, m)] != rows[i].gold for i, m in first_fire.items()),
        checkpoints=checkpoints, first_matching_checkpoint=match.tokens if match else None,
        tokens_saved_at_first_match=sum(k - min(match.tokens, k) for k in lengths) if match else None)


def markdown(result: ProbeResult) -> str:
    lines = ["# Early-exit checkpoint probe", "",
             f"{result.rows} gated rows, rationales up to {result.max_tokens} tokens (mean "
             f"{result.mean_rationale_tokens:.1f}), a checkpoint every {result.every} tokens; engine "
             f"`{result.engine.get('engine', '?')}`.", "",
             f"- Full rationale accuracy: **{result.full_accuracy:.3f}**.",
             f"- Free gate (end-of-sequence ranked first): fired at {result.gate_fired} of {result.gate_checkpoints} "
             f"checkpoints ({100 * result.gate_fire_rate:.2f} %); stopping there would save "
             f"{result.gate_tokens_saved} tokens and lose {result.gate_correct_lost} correct rows."]
    if result.first_matching_checkpoint is not None:
        lines.append(f"- First checkpoint as accurate as the full rationale: {result.first_matching_checkpoint} tokens "
                     f"(saves {result.tokens_saved_at_first_match} tokens over all rows).")
    else:
        lines.append("- No checkpoint reaches the full rationale's accuracy: cutting rationales short costs answers.")
    lines += ["", "| cut at | mean tokens | accuracy | agreement with full | flips | correct lost | still thinking "
                  "| gate fired |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {c.tokens} | {c.mean_tokens_spent:.1f} | {c.accuracy:.3f} | {c.agreement_with_full:.3f} | {c.flips} "
              f"| {c.correct_lost} | {c.still_thinking} | {c.gate_fired} |" for c in result.checkpoints]
    if result.stable_margin:
        lines += ["", "Stable-margin exit: stop where the margin has stayed above tau for k consecutive checkpoints.",
                  "", "| tau | k | exited | mean tokens | tokens saved | accuracy | flips | correct lost |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {e.tau:g} | {e.k} | {e.exited} | {e.mean_tokens_spent:.1f} | {e.tokens_saved} | "
                  f"{e.accuracy:.3f} | {e.flips} | {e.correct_lost} |" for e in result.stable_margin]
    return "\n".join(lines) + "\n"


def plot(result: ProbeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([c.mean_tokens_spent for c in result.checkpoints], [c.accuracy for c in result.checkpoints],
            marker="o", label="cut at checkpoint")
    ax.axhline(result.full_accuracy, color="grey", linestyle="--", label="full rationale")
    ax.set(xlabel="mean rationale tokens spent", ylabel="accuracy", title="early exit: accuracy vs tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def pick_gated(engine: Any, rows: Sequence[CaptureRow], n: int, *, render: RenderSpec = DEFAULT_RENDER,
               pool: int | None = None, seed: int = BOOTSTRAP_SEED) -> list[CaptureRow]:
    """The `n` rows the coverage gate would send to reasoning first: the smallest fast-pass margins
    among a pool (default 4n; the whole suite if smaller) drawn from each catalog in turn, each catalog's
    rows in the order of a random draw seeded by `seed` and the catalog (`stratified_pool`)."""
    import polars as pl

    from jex.tasks.capture.engine_calls import fast_pass
    from jex.tasks.probabilities.coverage_gate import coverage_gate

    candidates = stratified_pool(rows, min(len(rows), pool or 4 * n), seed=seed)
    readouts = fast_pass(engine, candidates, render=render)
    panel = pl.DataFrame({"run_id": [r.run_id for r in candidates], "catalog": [r.catalog or "" for r in candidates],
                          "logprobs": [list(r.logprobs) if r.logprobs else None for r in readouts]},
                         schema={"run_id": pl.String, "catalog": pl.String, "logprobs": pl.List(pl.Float64)})
    gated = coverage_gate(panel, coverage=min(1.0, n / len(candidates)))["run_id"].to_list()[:n]
    index = {r.run_id: r for r in candidates}
    return [index[i] for i in gated]


def stratified_pool(rows: Sequence[CaptureRow], size: int, *, seed: int) -> list[CaptureRow]:
    """`size` rows, one of each catalog in turn (catalogs in suite order), each catalog's rows in the
    order of a permutation drawn from `named_rng(seed, "early-exit:<catalog>")`: the same pool for the same
    suite and seed, whatever the other catalogs hold."""
    by_catalog: dict[str | None, list[CaptureRow]] = {}
    for r in rows:
        by_catalog.setdefault(r.catalog, []).append(r)
    queues = [[group[i] for i in named_rng(seed, f"early-exit:{catalog}").permutation(len(group))]
              for catalog, group in by_catalog.items()]
    out: list[CaptureRow] = []
    while len(out) < size:
        for queue in queues:
            if queue and len(out) < size:
                out.append(queue.pop(0))
    return out


def suite_rows(source: str | Path, workdir: Path) -> list[CaptureRow]:
    """Rows of a suite folder or a bundle file (extracted under `workdir`)."""
    source = Path(source)
    if source.is_dir():
        from jex.suite import iter_rows

        return [as_row(r.model_dump()) for r in iter_rows(source)]
    from jex.tasks.bundle.bundle_file import open_bundle

    frame = open_bundle(source, workdir / "bundle").rows(["run_id", "catalog", "question_id", "prompt", "options",
                                                          "labels", "gold"])
    return [as_row(r) for r in frame.iter_rows(named=True)]
