"""The engine calls every capture makes: fast pass, rationale, re-read after the thought.

Rows are anything with `run_id, prompt, labels, options` (suite `SuiteRow`s, or dicts through
`as_row`). These functions hold no state and know nothing of Prefect: the stages, the bake-off
and parity all call them, so they compute the same thing. The stages prepare a shard's requests
(`prepared_questions`, `prepared_reasons`: rendered and tokenised) on a thread beside the engine, with
the engine's `preparer()`, and hand them to the engine calls (`read_questions`, `ReasonCall`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

import polars as pl

from jex.engine.base import ChatTokenizer
from jex.engine.render import DEFAULT_RENDER, Example, Renderer, option_order
from jex.engine.types import Engine, GenerateRequest, Generation, Readout, ReadoutMode, ReadoutRequest, Sampling
from jex.engine_spec import RenderSpec
from jex.suite import LOGLIKELIHOOD_READOUTS, GenerationSettings, ReadoutKind, sample_seed


class RowLike(Protocol):
    # read-only members, so frozen rows (`CaptureRow`, `SuiteRow`) and their tuple/list fields match
    @property
    def run_id(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def labels(self) -> Sequence[str]: ...
    @property
    def options(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class CaptureRow:
    """A bundle row as the capture stages and the lab probes hold it: what a prompt needs, plus the
    gold, catalog and question id that few-shot pools and reports use."""

    run_id: str
    prompt: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    gold: int | None = None
    catalog: str | None = None
    question_id: str | None = None


def as_row(d: dict[str, Any]) -> CaptureRow:
    return CaptureRow(d["run_id"], d["prompt"], tuple(d["labels"]), tuple(d["options"]), d.get("gold"),
                      d.get("catalog"), d.get("question_id"))


def as_rows(frame: pl.DataFrame) -> list[CaptureRow]:
    """A frame of bundle rows (`tasks/bundle/reading.py: bundle_rows`) as the capture's rows."""
    return [as_row(r) for r in frame.iter_rows(named=True)]


class Renders(Protocol):
    """What renders prompts: an engine, or its `preparer()`."""

    def renderer(self, spec: RenderSpec) -> Renderer: ...


Request = TypeVar("Request", ReadoutRequest, GenerateRequest)


FewShotPool = Mapping[str, Sequence[CaptureRow]]
"""Solved example rows by catalog id, in the order they are used."""


@dataclass(frozen=True)
class CatalogRead:
    """How the fast pass reads one catalog's rows: the suite catalog's `readout`, `prompt_format` and
    `target_delimiter` (`jex.suite.Catalog`)."""

    readout: ReadoutKind = "label_slot"
    prompt_format: Literal["template", "verbatim"] = "template"
    target_delimiter: str = " "


LABEL_SLOT_TEMPLATE = CatalogRead()
CatalogReads = Mapping[str, CatalogRead]
"""The catalogs read otherwise than the label slot of a templated question, by catalog id."""


@dataclass(frozen=True)
class ReadPlan:
    """Which rows of a fast pass are read by continuation (loglikelihood catalogs) and which keep their
    own option order whatever `option_order_seed` says (verbatim prompts already show them), by run_id."""

    continuation: frozenset[str] = frozenset()
    verbatim: frozenset[str] = frozenset()

    @classmethod
    def of(cls, rows: Sequence[RowLike], reads: CatalogReads | None) -> ReadPlan:
        got = [(r.run_id, _read(r, reads)) for r in rows] if reads else []
        return cls(frozenset(rid for rid, c in got if c.readout in LOGLIKELIHOOD_READOUTS),
                   frozenset(rid for rid, c in got if c.prompt_format == "verbatim"))


def _read(row: RowLike, reads: CatalogReads | None) -> CatalogRead:
    return (reads or {}).get(getattr(row, "catalog", None) or "", LABEL_SLOT_TEMPLATE)


def examples_for(row: RowLike, pool: FewShotPool | None, k: int) -> tuple[Example, ...]:
    """The first `k` examples of the row's catalog, skipping any that share its question or run id.

    Fewer than `k` are available: an `InputError`-worthy setting, reported by the caller.
    """
    if k == 0 or pool is None:
        return ()
    catalog = getattr(row, "catalog", None)
    qid = getattr(row, "question_id", None)
    out = []
    for ex in pool.get(catalog or "", ()):
        if ex.run_id == row.run_id or (qid is not None and ex.question_id == qid) or ex.gold is None:
            continue
        out.append(Example(ex.prompt, tuple(ex.labels), tuple(ex.options), ex.gold))
        if len(out) == k:
            return tuple(out)
    raise ValueError(f"catalog '{catalog}' has {len(out)} few-shot example(s) for row '{row.run_id}', "
                     f"num_fewshot is {k}")


def question_prompts(engine: Renders, rows: Sequence[RowLike], render: RenderSpec = DEFAULT_RENDER,
                     fewshot: FewShotPool | None = None, reads: CatalogReads | None = None) -> list[ReadoutRequest]:
    """The fast-pass requests: each row rendered as `render` says, with its few-shot examples; a row of a
    verbatim catalog (`reads`) as its prompt stands (`Renderer.verbatim`), its options in its own order."""
    renderer = engine.renderer(render)
    requests = []
    for r in rows:
        read = _read(r, reads)
        if read.readout == "partial_loglikelihood":  # the options are the contexts, read as they are
            if renderer.verbatim_chat is not None:
                raise ValueError(f"row {r.run_id!r}: a partial-evaluation catalog is read without a chat template "
                                 "(its options are whole contexts)")
            requests.append(ReadoutRequest(r.run_id, r.prompt, tuple(r.labels), tuple(r.options),
                                           read.target_delimiter, partial=True))
            continue
        if read.prompt_format == "verbatim":
            requests.append(renderer.verbatim(run_id=r.run_id, prompt=r.prompt, labels=r.labels, options=r.options,
                                              delimiter=read.target_delimiter))
            continue
        req = renderer.question(run_id=r.run_id, prompt=r.prompt, labels=r.labels, options=_shown(render, r),
                                examples=examples_for(r, fewshot, render.num_fewshot))
        requests.append(req if read.target_delimiter == " " else dataclasses.replace(req,
                                                                                   delimiter=read.target_delimiter))
    return requests


def prepared_questions(tokenizer: ChatTokenizer, rows: Sequence[RowLike], render: RenderSpec = DEFAULT_RENDER,
                       fewshot: FewShotPool | None = None, reads: CatalogReads | None = None) -> list[ReadoutRequest]:
    """`question_prompts` with their token ids (`prompt_ids`) under `tokenizer` (the engine or its
    `preparer()`): what the engine reads without rendering or tokenising anything."""
    return with_prompt_ids(tokenizer, question_prompts(tokenizer, rows, render, fewshot, reads))


def with_prompt_ids(tokenizer: ChatTokenizer, requests: Sequence[Request]) -> list[Request]:
    """The requests carrying their prompts' token ids, from one batch call of `tokenizer`."""
    ids = tokenizer.encode_many([r.prompt for r in requests])
    return [dataclasses.replace(r, prompt_ids=tuple(i)) for r, i in zip(requests, ids, strict=True)]


def fast_pass(engine: Engine, rows: Sequence[RowLike], mode: ReadoutMode = ReadoutMode.LABEL_SLOT, *,
              render: RenderSpec = DEFAULT_RENDER, fewshot: FewShotPool | None = None,
              reads: CatalogReads | None = None) -> list[Readout]:
    """One forward per row: the label-slot (or continuation) readout of the rendered question; rows of a
    loglikelihood catalog (`reads`) by continuation."""
    return read_questions(engine, question_prompts(engine, rows, render, fewshot, reads), mode, render=render,
                          plan=ReadPlan.of(rows, reads))


def read_questions(engine: Engine, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT,
                   *, render: RenderSpec = DEFAULT_RENDER, plan: ReadPlan | None = None) -> list[Readout]:
    """The readout of questions rendered with `render` (`question_prompts`, `prepared_questions`), each
    back in its row's own option order; the rows `plan` reads by continuation in one call of their own."""
    plan = plan or ReadPlan()
    if not plan.continuation:
        return _restored(render, engine.readout(requests, mode), plan)
    out: list[Readout | None] = [None] * len(requests)
    label = [i for i, r in enumerate(requests) if r.run_id not in plan.continuation]
    continued = [i for i, r in enumerate(requests) if r.run_id in plan.continuation]
    for picked, want in ((label, mode), (continued, ReadoutMode.OPTION_CONTINUATION)):
        if picked:
            for i, got in zip(picked, engine.readout([requests[i] for i in picked], want), strict=True):
                out[i] = got
    return _restored(render, [r for r in out if r is not None], plan)


def _shown(render: RenderSpec, row: RowLike) -> Sequence[str]:
    """The row's options in the order the render shows them (`RenderSpec.option_order_seed`)."""
    order = option_order(render, row.run_id, len(row.options))
    return row.options if order is None else [row.options[j] for j in order]


def _restored(render: RenderSpec, readouts: list[Readout], plan: ReadPlan | None = None) -> list[Readout]:
    """Readouts back in the row's own option order (position i showed option order[i]); verbatim rows
    were shown in their own order."""
    if render.option_order_seed is None:
        return readouts
    out = []
    for r in readouts:
        order = option_order(render, r.run_id, len(r.logprobs or r.raw_logprobs or ()))
        if order is None or r.logprobs is None or (plan is not None and r.run_id in plan.verbatim):
            out.append(r)
            continue
        out.append(dataclasses.replace(r, logprobs=_unshuffled(order, r.logprobs),
                                       raw_logprobs=_unshuffled(order, r.raw_logprobs),
                                       greedy=_unshuffled(order, r.greedy)))
    return out


Item = TypeVar("Item", float, bool)


def _unshuffled(order: Sequence[int], shown: Sequence[Item] | None) -> tuple[Item, ...] | None:
    """Values by shown position back to the row's own order (position i showed option order[i])."""
    if shown is None:
        return None
    out = list(shown)
    for pos, j in enumerate(order):
        out[j] = shown[pos]
    return tuple(out)


def reason_prompts(engine: Renders, rows: Sequence[RowLike], render: RenderSpec = DEFAULT_RENDER) -> list[str]:
    renderer = engine.renderer(render)
    return [renderer.reason(prompt=r.prompt, labels=r.labels, options=_shown(render, r)) for r in rows]


def reason(engine: Engine, rows: Sequence[RowLike], *, max_tokens: int, render: RenderSpec = DEFAULT_RENDER,
           stop: tuple[str, ...] = ()) -> list[Generation]:
    """A greedy rationale per row."""
    return engine.generate(reason_requests(engine, rows, max_tokens, render, stop))


def reason_requests(renders: Renders, rows: Sequence[RowLike], max_tokens: int, render: RenderSpec,
                     stop: tuple[str, ...]) -> list[GenerateRequest]:
    return [GenerateRequest(r.run_id, p, max_tokens, stop)
            for r, p in zip(rows, reason_prompts(renders, rows, render), strict=True)]


@dataclass(frozen=True)
class ReasonCall:
    """A row and its rationale request, rendered and tokenised ahead of the engine (`prepared_reasons`)."""

    row: RowLike
    request: GenerateRequest

    @property
    def run_id(self) -> str:
        return self.row.run_id


def prepared_reasons(tokenizer: ChatTokenizer, rows: Sequence[RowLike], *, max_tokens: int,
                     render: RenderSpec = DEFAULT_RENDER, stop: tuple[str, ...] = ()) -> list[ReasonCall]:
    """The requests of `reason`, with their token ids (`prompt_ids`) under `tokenizer` (the engine or its
    `preparer()`)."""
    requests = with_prompt_ids(tokenizer, reason_requests(tokenizer, rows, max_tokens, render, stop))
    return [ReasonCall(r, q) for r, q in zip(rows, requests, strict=True)]


def reread(engine: Engine, rows: Sequence[RowLike], rationales: Sequence[Generation], *,
           render: RenderSpec = DEFAULT_RENDER, prompts: Sequence[str] | None = None) -> list[Readout]:
    """Label-slot readout with the rationale in context: the post-thought probabilities. `prompts`: the
    rows' reasoning prompts when already rendered (`ReasonCall.request`), else rendered here."""
    renderer = engine.renderer(render)
    prompts = reason_prompts(engine, rows, render) if prompts is None else prompts
    requests = [ReadoutRequest(r.run_id, renderer.after_thought(p, g.text), tuple(r.labels), tuple(_shown(render, r)))
                for r, p, g in zip(rows, prompts, rationales, strict=True)]
    return _restored(render, engine.readout(requests, ReadoutMode.LABEL_SLOT))


@dataclass(frozen=True)
class GenerationSpec:
    """How one generative catalog's rows are generated (its suite catalog's `generation` table): `samples`
    requests per row, greedy at temperature 0, else each sampled with its own seed (`jex.suite.sample_seed`); a
    reasoning catalog's (`think_end`) without stop sequences, its response cut after the thought
    (`jex.answer_extraction.response_after_thinking`, as lm-eval's vLLM backend does)."""

    until: tuple[str, ...]
    max_tokens: int
    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    think_end: str | None = None

    @classmethod
    def of(cls, generation: GenerationSettings) -> GenerationSpec:
        return cls(generation.until, generation.max_tokens, generation.samples, generation.temperature,
                   generation.top_p, generation.top_k, generation.seed,
                   generation.thinking.end if generation.thinking else None)

    def request(self, run_id: str, prompt: str, sample: int) -> GenerateRequest:
        """Sample `sample` of a row: its stop sequences (none while a thought may be open) and its sampling."""
        sampling = Sampling(self.temperature, sample_seed(self.seed, run_id, sample), self.top_p, self.top_k) \
            if self.temperature > 0 else None
        return GenerateRequest(run_id, prompt, self.max_tokens, () if self.think_end else self.until,
                               sampling=sampling)


@dataclass(frozen=True)
class SampleCall:
    """One generation of a row: sample `sample` of its catalog's `samples` (0 for a greedy catalog), and what
    closes its thought (a reasoning catalog's)."""

    request: GenerateRequest
    sample: int
    think_end: str | None = None

    @property
    def run_id(self) -> str:
        return self.request.run_id


class GenerativeRow(Protocol):
    @property
    def run_id(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def catalog(self) -> str: ...


def prepared_generations(tokenizer: ChatTokenizer, rows: Sequence[GenerativeRow], *,
                         settings: Mapping[str, GenerationSpec], render: RenderSpec = DEFAULT_RENDER
                         ) -> list[GenerateRequest]:
    """The generate stage's requests (`prepared_samples`, without their sample indices)."""
    return [c.request for c in prepared_samples(tokenizer, rows, settings=settings, render=render)]


def prepared_samples(tokenizer: ChatTokenizer, rows: Sequence[GenerativeRow], *,
                     settings: Mapping[str, GenerationSpec], render: RenderSpec = DEFAULT_RENDER) -> list[SampleCall]:
    """The generate stage's calls: each row's prompt as it stands (`Renderer.continued`), up to its catalog's max
    tokens, cut at its stop sequences, greedy or sampled, its catalog's `samples` times (row by row, samples in
    order), with its token ids under `tokenizer`."""
    renderer = tokenizer.renderer(render)
    prompts = [renderer.continued(r.prompt) for r in rows]
    ids = tokenizer.encode_many(prompts)
    return [SampleCall(dataclasses.replace(settings[r.catalog].request(r.run_id, p, k), prompt_ids=tuple(i)), k,
                       settings[r.catalog].think_end)
            for r, p, i in zip(rows, prompts, ids, strict=True) for k in range(settings[r.catalog].samples)]


def thought_tokens(decode: Callable[[Sequence[int]], str], token_ids: Sequence[int], think_end: str) -> int:
    """How many of a generation's tokens its thought takes: up to the one that completes the last `think_end`
    of the decoded text (what `response_after_thinking` splits at), all of them when it never closes; found by
    bisection over the decoded prefixes."""
    total = decode(token_ids).count(think_end)
    if total == 0:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the shortest prefix whose text holds every delimiter
    while lo < hi:
        mid = (lo + hi) // 2
        if decode(token_ids[:mid]).count(think_end) >= total:
            hi = mid
        else:
            lo = mid + 1
    return lo


