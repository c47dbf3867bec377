"""The per-sample record of a run: `samples.parquet`, one row per suite row, from the stages' own artifacts.

Nothing here recomputes a number: every column is read from the artifact the stage wrote (bundle rows,
fast-pass capture, gate, reason, fold, calibrate, overlay predictions), joined on `run_id` in suite
order. The one thing the stages do not keep is the rendered prompt; it is rendered again exactly as
the stages rendered it (`tasks.capture.question_prompts` / `reason_prompts` with the campaign's
`RenderSpec`, few-shot pool and the model's tokenizer). When the tokenizer cannot be loaded here the
prompt columns are null and `prompt_missing` says why: never a guess.

Columns (`SAMPLES_SCHEMA`):
    run_id, catalog, question_id, metadata   the suite row (metadata as JSON text, e.g. an imported
                                       task's {"doc_id", "task"})
    prompt, prompt_sha256, prompt_ref  the fast-pass text the engine read; with `prompts="sha256"` the
                                       text is null and `prompt_ref` points at the row in the store's
                                       prompts file (`<store>/prompts/<key>/prompts.parquet#run_id=...`)
    reason_prompt, reason_prompt_sha256  the rationale prompt (gated rows only)
    prompt_missing                     why the prompts are null (else null)
    options, labels                    as in the suite
    label_logprobs, label_mass, fast_refusal, fast_choice   the fast-pass readout
    gated, gate_margin                 the coverage gate's decision and the row's top-1/top-2 margin
    rationale, rationale_token_ids, rationale_tokens, finish_reason, reason_refusal, post_logprobs
                                       the reason stage (null on rows that were not gated)
    folded, folded_logprobs            the fold stage
    final_probs, decided_by            the calibrated probabilities and the stage that made the choice
                                       (fast_pass | fold | overlay:<rule id>)
    choice, gold, correct, scored      final choice, gold index, choice == gold, and False on rows the
                                       suite excludes from scoring
Only in a run whose suite has a loglikelihood catalog (`LOGLIKELIHOOD_COLUMNS`; null on its other rows):
    choice_loglikelihoods              each option's summed continuation log-likelihood (lm-eval's `resps`)
    choice_is_greedy                   whether each option's continuation is the greedy one (lm-eval's is_greedy)
    acc_norm_choice, acc_norm_correct  lm-eval's length-normalised choice and whether it is the gold
                                       (`acc` is `fast_choice == gold`; `correct` the final choice's)
Only in a run whose suite has a true_mass catalog (`MULTI_GOLD_COLUMNS`; null on its other rows):
    true_options, true_mass            the row's true options, and the softmax of its options'
                                       log-likelihoods summed over them (lm-eval's TruthfulQA mc2 `acc`)
Only in a run whose suite has a generative catalog (`GENERATIVE_COLUMNS`), whose rows follow the multiple-choice
ones (their option, readout and fold columns null; `prompt` the text the model continued, `finish_reason` why
its generation ended, `decided_by` `generate`, `correct` the primary filter's verdict):
    generation, generation_tokens      the generated text (cut before the first stop sequence), its tokens
    reference                          the row's reference answer
    filters, answers, verdicts         each filter of its catalog (the primary first), the answer it extracted
                                       and that answer's exact_match (lm-eval's filtered_resps and exact_match)
    exact_match                        the row's verdict (what the index scores: the primary filter's; maj@k's)
Only in a run whose generative catalogs sample or think (`SAMPLED_COLUMNS`; `generation` and its finish reason
the first sample's, the filters' answers those of all samples, as lm-eval's `repeats`):
    samples, sample_generations, sample_finish_reasons      every generation of the row, in order
    sample_responses                   what the filters read of each (after the thought, cut at the stop sequences)
    sample_answers, sample_verdicts    the primary filter's answer of each sample alone, and its exact_match
    thought_tokens, thought_closed     each sample's thought in tokens and whether it closed (else null)
    pass_at_k                          a pass_at_k catalog's row: the unbiased pass@k of its samples
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import polars as pl

from jex.errors import InputError
from jex.fileio import sha256_bytes, sha256_json
from jex.tasks.records import BundleSummary, FinishedCampaign, GenerateSummary
from jex.tasks.store import LocalStore

if TYPE_CHECKING:
    from jex.tasks.campaign_spec import CampaignSpec

SAMPLES_VERSION = "jex-samples/1"
SAMPLES_FILE = "samples.parquet"
PromptMode = Literal["full", "sha256"]

SAMPLES_SCHEMA: dict[str, Any] = {
    "run_id": pl.String, "catalog": pl.String, "question_id": pl.String, "metadata": pl.String,
    "prompt": pl.String, "prompt_sha256": pl.String, "prompt_ref": pl.String,
    "reason_prompt": pl.String, "reason_prompt_sha256": pl.String, "prompt_missing": pl.String,
    "options": pl.List(pl.String), "labels": pl.List(pl.String),
    "label_logprobs": pl.List(pl.Float64), "label_mass": pl.Float64, "fast_refusal": pl.String,
    "fast_choice": pl.Int32, "gated": pl.Boolean, "gate_margin": pl.Float64,
    "rationale": pl.String, "rationale_token_ids": pl.List(pl.Int64), "rationale_tokens": pl.Int32,
    "finish_reason": pl.String, "reason_refusal": pl.String, "post_logprobs": pl.List(pl.Float64),
    "folded": pl.Boolean, "folded_logprobs": pl.List(pl.Float64), "final_probs": pl.List(pl.Float64),
    "decided_by": pl.String, "choice": pl.Int32, "gold": pl.Int32, "correct": pl.Boolean, "scored": pl.Boolean,
}


LOGLIKELIHOOD_COLUMNS: dict[str, Any] = {"choice_loglikelihoods": pl.List(pl.Float64),
                                         "choice_is_greedy": pl.List(pl.Boolean), "acc_norm_choice": pl.Int32,
                                         "acc_norm_correct": pl.Boolean}
"""Appended to `SAMPLES_SCHEMA` only when the capture has them, so other runs keep their bytes."""
MULTI_GOLD_COLUMNS: dict[str, Any] = {"true_options": pl.List(pl.Int32), "true_mass": pl.Float64}
"""Appended only when the fold carries `true_mass` (a suite with a true_mass catalog)."""
GENERATIVE_COLUMNS: dict[str, Any] = {"generation": pl.String, "generation_tokens": pl.Int32, "reference": pl.String,
                                      "filters": pl.List(pl.String), "answers": pl.List(pl.String),
                                      "verdicts": pl.List(pl.Boolean), "exact_match": pl.Boolean}
"""Appended only when the run generated (a suite with a generative catalog), so other runs keep their bytes."""
SAMPLED_COLUMNS: dict[str, Any] = {"samples": pl.Int32, "sample_generations": pl.List(pl.String),
                                   "sample_finish_reasons": pl.List(pl.String), "sample_responses": pl.List(pl.String),
                                   "sample_answers": pl.List(pl.String), "sample_verdicts": pl.List(pl.Boolean),
                                   "thought_tokens": pl.List(pl.Int32), "thought_closed": pl.List(pl.Boolean),
                                   "pass_at_k": pl.Float64}
"""Appended only when the generate stage sampled or counted thoughts (its frame has `sample` or `thought_tokens`)."""


@dataclass(frozen=True)
class RenderedPrompts:
    """The texts the engine read, by run_id; `missing` says why there are none (then both maps are empty)."""

    question: dict[str, str]
    reason: dict[str, str]
    missing: str | None = None


@dataclass(frozen=True)
class StageArtifacts:
    """Paths of the stage outputs a samples record is read from (all from the stage summaries)."""

    bundle: BundleSummary
    capture: Path
    gated: Path
    reasoned: Path
    folded: Path
    predictions: Path
    generated: Path | None = None

    @classmethod
    def from_summaries(cls, s: FinishedCampaign) -> StageArtifacts:
        return cls(bundle=s.bundle, capture=Path(s.fast_pass.capture), gated=Path(s.gate.gated),
                   reasoned=Path(s.reason.reasoned), folded=Path(s.fold.folded),
                   predictions=Path(s.overlay.predictions),
                   generated=Path(s.generate.generated) if s.generate is not None else None)


def sha256_text(text: str | None) -> str | None:
    return None if text is None else sha256_bytes(text.encode("utf-8"))


def build_samples(rows: pl.DataFrame, *, capture: pl.DataFrame, gated: pl.DataFrame, reasoned: pl.DataFrame,
                  folded: pl.DataFrame, predictions: pl.DataFrame, prompts: RenderedPrompts,
                  excluded: set[str], prompt_ref: str | None = None,
                  abstaining: frozenset[str] = frozenset()) -> pl.DataFrame:
    """Join the stage frames on run_id, in the order of `rows` (the suite's).

    `rows`: run_id, catalog, question_id, options, labels, gold[, metadata][, true_options]. `capture`: run_id,
    logprobs, label_mass, refusal. `gated`: run_id, margin. `reasoned`: run_id, rationale, token_ids,
    finish_reason, post_logprobs, refusal. `folded`: run_id, folded_logprobs, gated, folded, fast_choice[,
    true_mass].
    `predictions`: run_id, choice, probs, stage[, abstain]; a row flagged `abstain` in a catalog of
    `abstaining` (those that declare the flag) is not `correct`, as the scorer counts it. With
    `prompt_ref` (compact output) the prompt texts
    are left out and each row points at `prompt_ref#run_id=...`.
    """
    ids = rows["run_id"].to_list()
    lm_eval = [c for c in LOGLIKELIHOOD_COLUMNS if c in capture.columns]
    multi_gold = "true_mass" in folded.columns
    true_options, mass = (["true_options"], ["true_mass"]) if multi_gold else ([], [])
    if "metadata" not in rows.columns:
        rows = rows.with_columns(metadata=pl.lit(None, dtype=pl.String))
    frame = (rows.select("run_id", "catalog", "question_id", "metadata", "options", "labels", "gold",
                         *true_options)
             .join(capture.select("run_id", *lm_eval, label_logprobs="logprobs", label_mass="label_mass",
                                  fast_refusal="refusal"), on="run_id", how="left", maintain_order="left")
             .join(gated.select("run_id", gate_margin="margin"), on="run_id", how="left", maintain_order="left")
             .join(reasoned.select("run_id", "rationale", "finish_reason", "post_logprobs",
                                   rationale_token_ids="token_ids", reason_refusal="refusal"),
                   on="run_id", how="left", maintain_order="left")
             .join(folded.select("run_id", "gated", "folded", "folded_logprobs", "fast_choice", *mass),
                   on="run_id", how="left", maintain_order="left")
             .join(predictions.select("run_id", "choice", final_probs="probs", decided_by="stage",
                                      abstained=(pl.col("abstain").fill_null(False) if "abstain" in predictions.columns
                                                 else pl.lit(False))),
                   on="run_id", how="left", maintain_order="left"))
    question = [prompts.question.get(r) for r in ids]
    reason = [prompts.reason.get(r) for r in ids]
    frame = frame.with_columns(
        pl.Series("prompt", [None if prompt_ref else q for q in question], dtype=pl.String),
        pl.Series("prompt_sha256", [sha256_text(q) for q in question], dtype=pl.String),
        pl.Series("prompt_ref", [f"{prompt_ref}#run_id={r}" if prompt_ref and q is not None else None
                                 for r, q in zip(ids, question, strict=True)], dtype=pl.String),
        pl.Series("reason_prompt", [None if prompt_ref else t for t in reason], dtype=pl.String),
        pl.Series("reason_prompt_sha256", [sha256_text(t) for t in reason], dtype=pl.String),
        pl.lit(prompts.missing, dtype=pl.String).alias("prompt_missing"),
        pl.col("rationale_token_ids").list.len().cast(pl.Int32).alias("rationale_tokens"),
        ((pl.col("choice") == pl.col("gold")).fill_null(False)
         & ~(pl.col("abstained").fill_null(False) & pl.col("catalog").is_in(list(abstaining)))).alias("correct"),
        (~pl.col("run_id").is_in(list(excluded))).alias("scored"),
        pl.col("gated").fill_null(False), pl.col("folded").fill_null(False))
    schema = dict(SAMPLES_SCHEMA)
    if lm_eval:
        frame = frame.with_columns(acc_norm_correct=pl.when(pl.col("acc_norm_choice").is_null()).then(None)
                                   .otherwise(pl.col("acc_norm_choice") == pl.col("gold")))
        schema.update(LOGLIKELIHOOD_COLUMNS)
    if multi_gold:
        schema.update(MULTI_GOLD_COLUMNS)
    return frame.select([pl.col(c).cast(t) for c, t in schema.items()])


def render_prompts(engine: Any, rows: Sequence[Any], *, render: Any, fewshot: Any, gated: set[str],
                   reads: Any = None) -> RenderedPrompts:
    """The exact fast-pass and rationale texts, as `tasks.capture` builds them for the engine (`reads`:
    the catalogs read otherwise, `tasks.capture.stages.catalog_reads`)."""
    from jex.tasks.capture.engine_calls import question_prompts, reason_prompts

    question = {r.run_id: r.prompt for r in question_prompts(engine, rows, render, fewshot, reads)}
    thinking = [r for r in rows if r.run_id in gated]
    reason = dict(zip([r.run_id for r in thinking], reason_prompts(engine, thinking, render), strict=True))
    return RenderedPrompts(question, reason)


_TOKENIZERS: dict[tuple[str, str], Future[Any]] = {}
_TOKENIZERS_LOCK = threading.Lock()


def tokenizer_engine(engine_spec: Any) -> Any:
    """A tokenizer-only engine (chat template + renderer) for the campaign's model, without the weights;
    loaded once per process and tokenizer content (`warm_tokenizer` starts the load early)."""
    from jex.engine.fingerprint import tokenizer_sha256
    from jex.engine.models import resolve_model

    if engine_spec.is_served():  # the server tokenises: what jex renders for it needs no tokenizer here
        from jex.engine.openai_engine import ServedTokenizer

        return ServedTokenizer()
    path = resolve_model(engine_spec.model, Path(engine_spec.cache_dir)).path
    key = (str(path), tokenizer_sha256(path))
    with _TOKENIZERS_LOCK:
        loading = _TOKENIZERS.get(key)
        first = loading is None
        if loading is None:
            loading = _TOKENIZERS[key] = Future()
    if first:  # this caller loads it; any other waits for the same load
        _load_tokenizer(path, loading)
    try:
        return loading.result()
    except Exception:
        with _TOKENIZERS_LOCK:  # a failed load is tried again next time (the model may appear)
            _TOKENIZERS.pop(key, None)
        raise


def warm_tokenizer(engine_spec: Any) -> None:
    """Start loading the campaign's tokenizer in the background (the report renders prompts with it)
    while machines compute; errors wait for the report, which says why its prompts are missing."""
    def load() -> None:  # a second call finds the first's load in `_TOKENIZERS` and only waits for it
        with contextlib.suppress(Exception):
            tokenizer_engine(engine_spec)

    threading.Thread(target=load, daemon=True, name="jex-tokenizer-warm").start()


def _load_tokenizer(path: Path, into: Future[Any]) -> None:
    try:
        from transformers import AutoTokenizer

        from jex.engine.base import ChatTokenizer

        eng = ChatTokenizer()
        eng.tokenizer = AutoTokenizer.from_pretrained(path)
        into.set_result(eng)
    except Exception as e:  # noqa: BLE001 - handed to whoever waits for this tokenizer
        into.set_exception(e)


def campaign_prompts(art: StageArtifacts, engine_spec: Any, store: Any, rows: Sequence[Any],
                     gated: set[str]) -> RenderedPrompts:
    """Render the run's prompts with its own RenderSpec and few-shot pool; null + reason when the
    model's tokenizer is not available on this machine."""
    from jex.tasks.capture.stages import catalog_reads, fewshot_pool

    try:
        eng = tokenizer_engine(engine_spec)
    except Exception as e:  # noqa: BLE001 - any failure to load the tokenizer means the same: no prompt here
        why = f"the tokenizer of model {engine_spec.model or 'embedded SmolLM2'} is not available here: " \
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return RenderedPrompts({}, {}, why)
    return render_prompts(eng, rows, render=engine_spec.render, fewshot=fewshot_pool(art.bundle, store, engine_spec),
                          gated=gated, reads=catalog_reads(art.bundle, store))


def write_samples(run_dir: Path, summaries: FinishedCampaign, spec: CampaignSpec, *,
                  prompts: PromptMode = "full") -> Path:
    """`samples.parquet` of a finished campaign (`summaries`: the flow's stage summaries; `spec`: its
    campaign). With `prompts="sha256"` the texts go to the store and the run keeps hashes."""
    from jex.tasks.bundle.reading import bundle_rows, scored_suite
    from jex.tasks.capture.engine_calls import as_rows
    from jex.tasks.store import write_parquet

    art = StageArtifacts.from_summaries(summaries)
    store = LocalStore(spec.store)
    engine_spec = spec.engine
    rows = bundle_rows(art.bundle, store)
    rows = rows.join(bundle_metadata(art.bundle, store), on="run_id", how="left", maintain_order="left")
    table = scored_suite(art.bundle)
    rows = rows.join(table.rows.select("run_id", "true_options"), on="run_id", how="left", maintain_order="left")
    gated = pl.read_parquet(art.gated)
    rendered = campaign_prompts(art, engine_spec, store, as_rows(rows), set(gated["run_id"].to_list()))
    continued = generative_prompts(art, engine_spec, store) if summaries.generate is not None else None
    ref = None
    if prompts == "sha256" and rendered.missing is None:
        kept = rendered if continued is None or continued.missing else RenderedPrompts(
            {**rendered.question, **continued.question}, rendered.reason)
        ref = str(store_prompts(store.root, art.bundle.sha256, engine_spec, kept))
    catalogs = table.spec.catalogs
    excluded = {rid for c in catalogs for rid in c.exclusions}
    frame = build_samples(rows, capture=pl.read_parquet(art.capture), gated=gated,
                          reasoned=pl.read_parquet(art.reasoned), folded=pl.read_parquet(art.folded),
                          predictions=pl.read_parquet(art.predictions), prompts=rendered, excluded=excluded,
                          prompt_ref=ref, abstaining=frozenset(c.id for c in catalogs if "abstain" in c.secondary))
    if summaries.generate is not None and continued is not None:
        frame = pl.concat([frame, generative_samples(art, summaries.generate, store, continued, excluded=excluded,
                                                     prompt_ref=ref)], how="diagonal_relaxed")
        sampled = SAMPLED_COLUMNS if SAMPLED_COLUMNS.keys() & set(frame.columns) else {}
        frame = frame.select([pl.col(c).cast(t) for c, t in {**dict(frame.schema), **GENERATIVE_COLUMNS,
                                                                **sampled}.items()])
    out = Path(run_dir) / SAMPLES_FILE
    write_parquet(frame, out)
    return out


def generative_prompts(art: StageArtifacts, engine_spec: Any, store: LocalStore) -> RenderedPrompts:
    """The texts the generate stage continued, by run_id, rendered again as it rendered them (`Renderer.continued`);
    none, and why, when the model's tokenizer is not available here."""
    from jex.tasks.bundle.bundle_file import open_bundle

    rows = open_bundle(art.bundle.bundle, store.extracted_bundle(art.bundle.key)).generation_rows()
    try:
        renderer = tokenizer_engine(engine_spec).renderer(engine_spec.render)
    except Exception as e:  # noqa: BLE001 - as `campaign_prompts`: no tokenizer here, no prompt, and why
        return RenderedPrompts({}, {}, f"the tokenizer of model {engine_spec.model or 'embedded SmolLM2'} is not "
                                       f"available here: {type(e).__name__}")
    return RenderedPrompts(dict(zip(rows["run_id"].to_list(), map(renderer.continued, rows["prompt"].to_list()),
                                    strict=True)), {})


def generative_samples(art: StageArtifacts, generated: GenerateSummary, store: LocalStore, prompts: RenderedPrompts,
                       *, excluded: set[str], prompt_ref: str | None) -> pl.DataFrame:
    """The samples of the generative rows: the text continued (`generative_prompts`; with `prompt_ref`, compact
    samples, in the store's prompts file), the generation and, per filter, the answer and verdict the score
    stage scored (`bundle_verdicts`)."""
    from jex.tasks.bundle.bundle_file import open_bundle
    from jex.tasks.decision_stages import bundle_verdicts

    rows = open_bundle(art.bundle.bundle, store.extracted_bundle(art.bundle.key)).generation_rows()
    verdicts = bundle_verdicts(art.bundle, generated, store)
    written = pl.read_parquet(generated.generated)
    sampled = [c for c in SAMPLED_COLUMNS if {"sample", "thought_tokens"} & set(written.columns)]
    tokens = written.filter(pl.col("sample") == 0) if "sample" in written.columns else written
    ids = rows["run_id"].to_list()
    texts = [prompts.question.get(r) for r in ids]
    frame = (rows.select("run_id", "catalog", "question_id", "metadata", reference="answer")
             .join(verdicts.select("run_id", "generation", "finish_reason", "filters", "answers", "verdicts",
                                   "exact_match", *sampled, fast_refusal="refusal"), on="run_id", how="left",
                   maintain_order="left")
             .join(tokens.select("run_id", "token_ids"), on="run_id", how="left", maintain_order="left"))
    return frame.with_columns(
        pl.Series("prompt", [None if prompt_ref else t for t in texts], dtype=pl.String),
        pl.Series("prompt_sha256", [sha256_text(t) for t in texts], dtype=pl.String),
        pl.Series("prompt_ref", [f"{prompt_ref}#run_id={r}" if prompt_ref and t is not None else None
                                 for r, t in zip(ids, texts, strict=True)], dtype=pl.String),
        pl.lit(prompts.missing, dtype=pl.String).alias("prompt_missing"),
        pl.col("token_ids").list.len().cast(pl.Int32).alias("generation_tokens"),
        pl.lit("generate").alias("decided_by"), pl.col("exact_match").fill_null(False).alias("correct"),
        (~pl.col("run_id").is_in(list(excluded))).alias("scored"), pl.lit(False).alias("gated"),
        pl.lit(False).alias("folded")).drop("token_ids")


def bundle_metadata(bundle: BundleSummary, store: LocalStore) -> pl.DataFrame:
    """run_id and the row's metadata (JSON text) from the bundle."""
    from jex.tasks.bundle.bundle_file import open_bundle

    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    return opened.rows(["run_id", "metadata"])


def store_prompts(root: Path, bundle_sha256: str, engine_spec: Any, rendered: RenderedPrompts) -> Path:
    """The prompt texts, once per (bundle, render, model), at `<store>/prompts/<key>/prompts.parquet`."""
    from jex.engine.models import resolve_model, weights_sha256
    from jex.tasks.inputs import engine_content
    from jex.tasks.store import write_parquet

    weights = sha256_json(engine_content(engine_spec)) if engine_spec.is_served() else \
        weights_sha256(resolve_model(engine_spec.model, Path(engine_spec.cache_dir)).path)
    key = sha256_json({"bundle": bundle_sha256, "render": engine_spec.render.digest(), "weights": weights})[:32]
    path = root / "prompts" / key / "prompts.parquet"
    if not path.exists():
        ids = list(rendered.question)
        write_parquet(pl.DataFrame({"run_id": ids, "prompt": [rendered.question[r] for r in ids],
                                    "reason_prompt": [rendered.reason.get(r) for r in ids]},
                                   schema={"run_id": pl.String, "prompt": pl.String, "reason_prompt": pl.String}),
                      path)
    return path


def resolve_prompt_ref(ref: str) -> tuple[str | None, str | None]:
    """(prompt, reason_prompt) behind a `prompt_ref` (`PATH#run_id=ID`); an InputError when it is gone."""
    path, _, rid = ref.partition("#run_id=")
    if not Path(path).exists():
        raise InputError("the prompts file this samples record points at is gone", file=path)
    hit = pl.read_parquet(path).filter(pl.col("run_id") == rid)
    if hit.height != 1:
        raise InputError(f"no prompt for run_id '{rid}'", file=path, field="run_id")
    return hit["prompt"][0], hit["reason_prompt"][0]


def read_samples(run_dir: str | Path) -> pl.DataFrame:
    """`samples.parquet` of a run folder; an InputError naming the folder when it has none (a suite
    folder given for a run folder is told what makes one)."""
    from jex.suite import MANIFEST_NAME

    path = Path(run_dir) / SAMPLES_FILE
    if not Path(run_dir).is_dir():
        raise InputError("not a run folder", file=str(run_dir))
    if not path.exists() and (Path(run_dir) / MANIFEST_NAME).is_file():
        raise InputError(f"a suite folder (holds {MANIFEST_NAME}), not a run folder: jex run --suite {run_dir}, "
                         "then give the run folder it prints", file=str(run_dir))
    if not path.exists():
        raise InputError(f"no {SAMPLES_FILE} in this run folder (written by the report step of `jex run`; "
                         "run `jex run --resume RUN` to add it)", file=str(path))
    try:
        frame = pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as e:
        raise InputError(f"unreadable Parquet ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                         file=str(path)) from None
    missing = [c for c in SAMPLES_SCHEMA if c not in frame.columns]
    if missing:
        raise InputError(f"not a jex samples record: columns {missing} are missing", file=str(path))
    return frame


def select_samples(frame: pl.DataFrame, *, catalog: str | None = None, wrong: bool = False,
                   run_ids: Sequence[str] = (), limit: int | None = None) -> pl.DataFrame:
    """Rows of a samples record: one catalog, only the wrong ones, given run_ids, the first `limit`."""
    if catalog is not None:
        known = sorted(set(frame["catalog"].to_list()))
        if catalog not in known:
            raise InputError(f"no catalog '{catalog}' in this run (catalogs: {known})", field="catalog")
        frame = frame.filter(pl.col("catalog") == catalog)
    if run_ids:
        unknown = sorted(set(run_ids) - set(frame["run_id"].to_list()))
        if unknown:
            raise InputError(f"run_id(s) {unknown[:5]} are not in this run", field="run_id")
        frame = frame.filter(pl.col("run_id").is_in(list(run_ids)))
    if wrong:
        frame = frame.filter(pl.col("scored") & ~pl.col("correct"))
    return frame.head(limit) if limit is not None else frame


def _dist(labels: Sequence[str], values: Sequence[float] | None, *, log: bool) -> str:
    if values is None:
        return "-"
    import math

    return "  ".join(f"{lab} {math.exp(v) if log else v:.3f}" for lab, v in zip(labels, values, strict=True))


def _why_missing(refusal: str | None) -> str:
    """Why a readout is missing: a failed row (engine errors after every retry, `batch error: ...`) is named as
    failed, not as a refusal."""
    from jex.engine.types import RefusalKind

    if not refusal:
        return ""
    if RefusalKind.BATCH_ERROR.of(refusal):
        return f"   FAILED after every retry ({refusal}); the retry-stage flow computes it again"
    return f"   refused: {refusal}"


def _sampled_lines(r: dict[str, Any]) -> list[str]:
    """Every sample of a row (its generation, thought, response and the primary filter's answer of it alone), then
    each filter's answer over all of them."""
    lines = []
    thoughts = r["thought_tokens"] or [None] * r["samples"]
    closed = r["thought_closed"] or [None] * r["samples"]
    for k, (text, why, answer, ok) in enumerate(zip(r["sample_generations"], r["sample_finish_reasons"],
                                                     r["sample_answers"], r["sample_verdicts"], strict=True)):
        thought = "" if thoughts[k] is None else (f", thought {thoughts[k]} tokens" if closed[k] else
                                                   f", thought NEVER CLOSED ({thoughts[k]} tokens)")
        lines.append(f"  sample {k}, {why}{thought}: answer {answer!r}  {'match' if ok else 'no match'}")
        lines += [f"    | {line}" for line in text.splitlines() or [""]]
    for name, answer, ok in zip(r["filters"], r["answers"], r["verdicts"], strict=True):
        lines.append(f"  filter {name:<16} answer {answer!r}  {'match' if ok else 'no match'}  (all samples)")
    lines.append(f"  the index reads: pass@k {r['pass_at_k']:.4f}" if r.get("pass_at_k") is not None else
                 f"  the index reads: {'match' if r['exact_match'] else 'no match'} (the row's verdict)")
    return lines


def format_generative_sample(r: dict[str, Any], *, prompt: bool = False) -> str:
    """One generative sample, readably: verdict, the generation, each filter's answer and verdict, [prompt]."""
    verdict = "excluded" if not r["scored"] else ("right" if r["correct"] else "WRONG")
    lines = [f"{r['run_id']}  [{r['catalog']}, question {r['question_id']}]  generated  {verdict}  "
             f"(reference {r['reference']!r})"]
    if r["answers"] is None:  # refused for context, or failed: no generation to extract from
        lines.append(f"  not generated ({r['finish_reason']})" + _why_missing(r["fast_refusal"]))
    elif r.get("samples") is not None:
        lines += _sampled_lines(r)
    else:
        lines.append(f"  generation, {r['generation_tokens']} tokens, {r['finish_reason']}:")
        lines += [f"    | {line}" for line in r["generation"].splitlines() or [""]]
        for name, answer, ok in zip(r["filters"], r["answers"], r["verdicts"], strict=True):
            lines.append(f"  filter {name:<16} answer {answer!r}  {'match' if ok else 'no match'}")
    if prompt:
        text = r["prompt"]
        if text is None and r["prompt_ref"]:
            text = resolve_prompt_ref(r["prompt_ref"])[0]
        lines.append("  prompt (what the engine continued):" if text is not None else
                     f"  prompt: not recorded ({r['prompt_missing']})")
        lines += [f"    > {line}" for line in (text or "").splitlines()]
    return "\n".join(lines)


def format_sample(r: dict[str, Any], *, prompt: bool = False) -> str:
    """One sample, readably: verdict, the readouts as probabilities, the rationale, decisions, [prompt]."""
    if r.get("decided_by") == "generate":
        return format_generative_sample(r, prompt=prompt)
    labels = r["labels"]

    def lab(i: int | None) -> str:
        return "-" if i is None else labels[i]

    verdict = "excluded" if not r["scored"] else ("right" if r["correct"] else "WRONG")
    head = (f"{r['run_id']}  [{r['catalog']}, question {r['question_id']}]  choice {lab(r['choice'])}  "
            f"gold {lab(r['gold'])}  {verdict}  (decided by {r['decided_by']})")
    lines = [head]
    lines += [f"  {label}. {option}" for label, option in zip(labels, r["options"], strict=True)]
    lines.append(f"  fast pass   {_dist(labels, r['label_logprobs'], log=True)}   -> {lab(r['fast_choice'])}"
                 + _why_missing(r["fast_refusal"]))
    if r.get("choice_loglikelihoods") is not None:
        lls = "  ".join(f"{label} {ll:.4f}" for label, ll in zip(labels, r["choice_loglikelihoods"], strict=True))
        lines.append(f"  loglikelihood {lls}   acc -> {lab(r['fast_choice'])}, acc_norm -> "
                     f"{lab(r['acc_norm_choice'])}")
    if r["gated"]:
        lines.append(f"  gated (margin {r['gate_margin']:.3f}); rationale, {r['rationale_tokens']} tokens, "
                     f"{r['finish_reason']}:")
        lines += [f"    | {line}" for line in (r["rationale"] or "").strip().splitlines() or [""]]
        lines.append(f"  after it    {_dist(labels, r['post_logprobs'], log=True)}"
                     + _why_missing(r["reason_refusal"]))
        lines.append(f"  folded      {_dist(labels, r['folded_logprobs'], log=True)}" if r["folded"]
                     else "  not folded (no post-thought readout)")
    lines.append(f"  final       {_dist(labels, r['final_probs'], log=False)}")
    if prompt:
        text, why = r["prompt"], r["prompt_missing"]
        if text is None and r["prompt_ref"]:
            text = resolve_prompt_ref(r["prompt_ref"])[0]
        lines.append("  prompt (what the engine read):" if text is not None else f"  prompt: not recorded ({why})")
        lines += [f"    > {line}" for line in (text or "").splitlines()]
        thought = r["reason_prompt"] if r["prompt"] is not None or not r["prompt_ref"] else \
            resolve_prompt_ref(r["prompt_ref"])[1]
        if r["gated"] and thought is not None:
            lines.append("  rationale prompt:")
            lines += [f"    > {line}" for line in thought.splitlines()]
    return "\n".join(lines)
