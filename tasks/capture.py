"""The engine calls every capture makes: fast pass, rationale, re-read after the thought.

Rows are anything with `run_id, prompt, labels, options` (suite `Row`s, or dicts through
`as_row`). These functions hold no state and know nothing of Prefect: the stages, the bake-off
and parity all call them, so they compute the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from engine.render import REASON_TEMPLATE, render_after_thought, render_question, render_reason
from engine.types import Engine, GenerateRequest, Generation, Readout, ReadoutMode, ReadoutRequest


class RowLike(Protocol):
    run_id: str
    prompt: str
    labels: Sequence[str]
    options: Sequence[str]


@dataclass(frozen=True)
class SimpleRow:
    run_id: str
    prompt: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    gold: int | None = None
    catalog: str | None = None


def as_row(d: dict[str, Any]) -> SimpleRow:
    return SimpleRow(d["run_id"], d["prompt"], tuple(d["labels"]), tuple(d["options"]), d.get("gold"),
                     d.get("catalog"))


def fast_pass(engine: Engine, rows: Sequence[RowLike], mode: ReadoutMode = ReadoutMode.LABEL_SLOT) -> list[Readout]:
    """One forward per row: the label-slot (or continuation) readout of the rendered question."""
    requests = []
    for r in rows:
        rendered = render_question(engine.chat_prompt, run_id=r.run_id, prompt=r.prompt, labels=r.labels,
                                   options=r.options)
        requests.append(ReadoutRequest(r.run_id, rendered.prompt, rendered.labels, rendered.options))
    return engine.readout(requests, mode)


def reason_prompts(engine: Engine, rows: Sequence[RowLike], template: str = REASON_TEMPLATE) -> list[str]:
    return [render_reason(engine.chat_prompt, prompt=r.prompt, labels=r.labels, options=r.options,
                          template=template) for r in rows]


def reason(engine: Engine, rows: Sequence[RowLike], *, max_tokens: int, template: str = REASON_TEMPLATE,
           stop: tuple[str, ...] = ()) -> list[Generation]:
    """A greedy rationale per row."""
    prompts = reason_prompts(engine, rows, template)
    return engine.generate([GenerateRequest(r.run_id, p, max_tokens, stop) for r, p in zip(rows, prompts,
                                                                                           strict=True)])


def reread(engine: Engine, rows: Sequence[RowLike], rationales: Sequence[Generation], *,
           template: str = REASON_TEMPLATE) -> list[Readout]:
    """Label-slot readout with the rationale in context: the post-thought probabilities."""
    prompts = reason_prompts(engine, rows, template)
    requests = [ReadoutRequest(r.run_id, render_after_thought(p, g.text), tuple(r.labels), tuple(r.options))
                for r, p, g in zip(rows, prompts, rationales, strict=True)]
    return engine.readout(requests, ReadoutMode.LABEL_SLOT)


def margin(logprobs: Sequence[float] | None) -> float | None:
    """Top-1 minus top-2 log-odds of a readout (natural log)."""
    if logprobs is None or len(logprobs) < 2:
        return None
    top = sorted(logprobs, reverse=True)
    p1, p2 = math.exp(top[0]), math.exp(top[1])
    return _logit(p1) - _logit(p2)


def _logit(p: float) -> float:
    p = min(max(p, 1e-300), 1 - 1e-16)
    return math.log(p) - math.log1p(-p)
