"""Whether jex scores an lm-evaluation-harness task as lm-eval does, field by field.

A `multiple_choice` task's numbers come from a few fields of its config besides the prompt: its own
`process_results`, the metrics of `metric_list` and their aggregations, `filter_list`, `repeats`, or a
Python class of its own. jex reproduces lm-eval's built-in multiple-choice metrics (`METRIC_AGGREGATIONS`:
acc, acc_norm, acc_bytes, exact_match, f1, mcc, brier_score, each from the same per-choice
log-likelihoods, with lm-eval's aggregation) and the task functions of `REPRODUCED_PROCESS_RESULTS`
(TruthfulQA mc2's mass of the true answers, a `true_mass` catalog); a task that asks for anything else is
refused with one line naming the task and the field, never imported and scored as plain accuracy.
Metric keyword arguments (`ignore_case`, `hf_evaluate`, `weight_by_size`...) do not reach lm-eval's
multiple-choice scoring (0.4.13 `ConfigurableTask.process_results` computes every metric itself), so
they change nothing. The prompt fields (`process_docs`, `doc_to_text`, few-shot settings) are reproduced
by building each prompt through the harness itself (`jex.suite_import`).
"""

from __future__ import annotations

import ast
import hashlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jex.answer_extraction import AnswerFilter, MatchSettings, TakeFirstKStep, UnsupportedFilter, filter_from_config
from jex.suite import ScoringKind

METRIC_AGGREGATIONS: dict[str, str] = {
    "acc": "mean", "acc_norm": "mean", "acc_bytes": "mean", "exact_match": "mean",
    "f1": "f1", "mcc": "matthews_corrcoef", "brier_score": "brier_score"}
"""lm-eval's multiple-choice metrics jex computes from the same per-choice log-likelihoods
(`tasks/outputs/interop/lm_eval_files.py` writes them), each with the aggregation lm-eval registers for it
(0.4.13 `api/metrics.py`); a task naming another aggregation is refused."""
REPRODUCED_METRICS = tuple(METRIC_AGGREGATIONS)
DEFAULT_METRICS = ("acc", "acc_norm")
"""What lm-eval reports for a multiple_choice task without a metric_list."""
BINARY_METRICS = ("f1",)
"""Metrics lm-eval computes with scikit-learn's binary default (`f1_score(golds, preds)`): a task with rows
of more than two choices is refused (lm-eval itself fails on multiclass labels)."""
SCORING_FIELDS = ("output_type", "process_results", "metric_list", "filter_list", "repeats")
"""The task-config fields besides the prompt that change a multiple-choice task's numbers."""


@dataclass(frozen=True)
class TaskScoring:
    """How jex scores a task it reproduces: the catalog's scoring kind and, for a multi-gold task, how a
    document lists its true options (the rows' `true_options`)."""

    scoring: ScoringKind = "accuracy"
    true_options: Callable[[Mapping[str, Any]], list[int]] | None = None
    metrics: tuple[str, ...] = DEFAULT_METRICS
    """The metrics lm-eval reports for the task (its metric_list, in order), all of which jex computes."""


def _mc2_true_options(doc: Mapping[str, Any]) -> list[int]:
    """The options `process_results_mc2` counts as true: label 1 in the document's `mc2_targets`."""
    return [i for i, label in enumerate(doc["mc2_targets"]["labels"]) if label == 1]


REPRODUCED_PROCESS_RESULTS: dict[str, TaskScoring] = {
    # lm_eval 0.4.13 tasks/truthfulqa/utils.py (and its verbatim copy in okapi/truthfulqa_multilingual):
    # np.exp of the log-likelihoods, normalised by np.sum, np.sum over labels == 1 -> {"acc": mass}
    "8db42f02270d1bb3282a66cc2a1a1a63ca7ddbf450e4fe71a07847fe7fed3b26":
        TaskScoring("true_mass", _mc2_true_options, metrics=("acc",)),
}
"""lm-eval task functions jex reproduces, by the sha256 of their source text (so an edited copy, or one
that sums in another order, is refused): what the task's catalog is scored by instead."""


def function_source(function: Any) -> str | None:
    """The source text of a task's `process_results` (a resolved function, or lm-eval's unresolved
    `/dir/module.name`), read from its module file without importing it; None when it cannot be read."""
    if callable(function):
        try:
            path, name = inspect.getsourcefile(function), function.__name__
        except TypeError:
            return None
    else:
        module, _, name = str(function).rpartition(".")
        path = f"{module}.py"
    if not path or not Path(path).is_file():
        return None
    text = Path(path).read_text(encoding="utf-8")
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    return None


def _reproduced(function: Any) -> TaskScoring | None:
    source = function_source(function)
    return None if source is None else REPRODUCED_PROCESS_RESULTS.get(hashlib.sha256(source.encode()).hexdigest())


@dataclass(frozen=True)
class ScoringRefusal:
    """A task jex would score differently from lm-eval: the task, the config field, and why."""

    task: str
    field: str
    reason: str

    def line(self) -> str:
        return f"task '{self.task}': {self.field} {self.reason}"


def _name(value: Any) -> str:
    """A metric, aggregation or function as the task names it (a resolved function by its qualified name)."""
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"
    return str(value)


def task_scoring(task: str, config: Mapping[str, Any], *, multiple_input: bool = False
                 ) -> TaskScoring | ScoringRefusal:
    """How jex scores the task when every scoring field of its config (`SCORING_FIELDS`, as a plain
    mapping: a parsed YAML or `task_config` of a loaded task) is one it reproduces, else the first field
    it does not. A multiple-input task (Winogrande: `doc_to_text` gives the gold index) is scored by `acc`
    only: lm-eval normalises its acc_norm by the choices' texts, not by the contexts jex reads."""
    output_type = config.get("output_type") or "generate_until"
    if output_type != "multiple_choice":
        return ScoringRefusal(task, "output_type", f"is {output_type!r}, not multiple_choice")
    scoring, allowed = TaskScoring(), REPRODUCED_METRICS
    if config.get("process_results") is not None:
        reproduced = _reproduced(config["process_results"])
        if reproduced is None:
            function = _name(config["process_results"])
            return ScoringRefusal(task, "process_results", f"is the task's own function ({function}), which jex "
                                                           "does not run")
        scoring = reproduced
        allowed = reproduced.metrics
    if multiple_input:
        allowed = ("acc",)
        if not config.get("metric_list"):
            return ScoringRefusal(task, "metric_list", "is lm-eval's default (acc and acc_norm); of a multiple-input "
                                                       "task jex reproduces acc only")
    reported = []
    for i, entry in enumerate(config.get("metric_list") or ()):
        metric = _name(entry.get("metric"))
        if metric not in allowed:
            return ScoringRefusal(task, f"metric_list[{i}].metric", f"is {metric!r}; jex reproduces "
                                                                   f"{', '.join(allowed)} only")
        aggregation = entry.get("aggregation")
        if aggregation is not None and _name(aggregation) != METRIC_AGGREGATIONS[metric]:
            return ScoringRefusal(task, f"metric_list[{i}].aggregation",
                                  f"of {metric} is {_name(aggregation)!r}; jex aggregates it by lm-eval's "
                                  f"{METRIC_AGGREGATIONS[metric]}")
        reported.append(metric)
    if config.get("filter_list"):
        return ScoringRefusal(task, "filter_list", "is set; jex applies no filters to multiple-choice answers")
    if (config.get("repeats") or 1) != 1:
        return ScoringRefusal(task, "repeats", f"is {config['repeats']}; jex reads each document once")
    plain = scoring.scoring == "accuracy" and not multiple_input
    return TaskScoring(scoring.scoring, scoring.true_options,
                       tuple(reported) or (DEFAULT_METRICS if plain else tuple(allowed)))


def task_config(task: Any) -> dict[str, Any]:
    """The scoring fields of a loaded lm-eval task (`SCORING_FIELDS`), plus `process_results` when the task
    is a Python class that scores documents its own way."""
    from lm_eval.api.task import ConfigurableTask

    config = {field: getattr(task.config, field, None) for field in SCORING_FIELDS}
    if config["process_results"] is None and type(task).process_results is not ConfigurableTask.process_results:
        config["process_results"] = type(task).process_results
    return config


GENERATION_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")
"""The `generation_kwargs` jex reads: greedy decoding (do_sample false, or unset at temperature 0) or sampling
(do_sample true, or unset at a positive temperature; with top_p and top_k) up to max_gen_toks, cut at the `until`
sequences. Any other key would reach the model's generate call and is refused."""
MATCH_KWARGS = ("regexes_to_ignore", "ignore_case", "ignore_punctuation", "ignore_numbers")
"""`exact_match`'s keyword arguments (lm-eval's `exact_match_hf_evaluate`)."""
MAX_GEN_TOKS = 256
"""lm-eval's default `max_gen_toks` (HF and vLLM backends)."""


@dataclass(frozen=True)
class GenerativeScoring:
    """How jex runs and scores a `generate_until` task it reproduces: its generation settings (greedy, or
    sampled `samples` times per document: lm-eval's `repeats`), the task's filter pipelines and exact_match's
    settings."""

    until: tuple[str, ...]
    max_tokens: int
    filters: tuple[AnswerFilter, ...]
    match: MatchSettings
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    samples: int = 1


def generative_scoring(task: str, config: Mapping[str, Any], generation_kwargs: Mapping[str, Any] | None
                       ) -> GenerativeScoring | ScoringRefusal:
    """A `generate_until` task's generation and scoring when every field is one jex reproduces (exact_match
    of each filter's answer; greedy or sampled decoding, `repeats` times), else the first field it does not."""
    if config.get("process_results") is not None:
        return ScoringRefusal(task, "process_results", f"is the task's own function "
                                                       f"({_name(config['process_results'])}), which jex does not run")
    entries = list(config.get("metric_list") or ())
    if len(entries) != 1 or _name(entries[0].get("metric")) != "exact_match":
        names = [_name(e.get("metric")) for e in entries]
        return ScoringRefusal(task, "metric_list", f"is {names}; of a generative task jex reproduces exact_match "
                                                   "alone")
    entry = entries[0]
    if entry.get("aggregation") is not None and _name(entry["aggregation"]) != "mean":
        return ScoringRefusal(task, "metric_list[0].aggregation", f"is {_name(entry['aggregation'])!r}; jex "
                                                                  "aggregates exact_match by its mean")
    kwargs = {k: v for k, v in entry.items() if k not in ("metric", "aggregation", "higher_is_better")}
    if unknown := sorted(set(kwargs) - set(MATCH_KWARGS)):
        return ScoringRefusal(task, f"metric_list[0].{unknown[0]}", f"is not one of exact_match's settings jex "
                                                                    f"reproduces ({', '.join(MATCH_KWARGS)})")
    samples = config.get("repeats") or 1
    if not isinstance(samples, int) or samples < 1:
        return ScoringRefusal(task, "repeats", f"is {samples!r}; jex generates a whole number of samples per document")
    gen = dict(generation_kwargs or {})
    if unknown := sorted(set(gen) - set(GENERATION_KWARGS)):
        return ScoringRefusal(task, f"generation_kwargs.{unknown[0]}", "is set; jex generates with until, "
                                                                       "max_gen_toks, temperature, top_p and top_k "
                                                                       "alone")
    # lm-eval 0.4.13 (`normalize_gen_kwargs`) samples when do_sample is true, or unset at a positive temperature;
    # do_sample true at temperature 0 is refused by HF's generate and greedy in vLLM
    temperature = float(gen.get("temperature") or 0)
    sampling = gen.get("do_sample") is True or (gen.get("do_sample") is None and temperature > 0)
    if sampling and temperature <= 0:
        return ScoringRefusal(task, "generation_kwargs", "asks for sampling at temperature 0 (greedy in vLLM, refused "
                                                         "by HF's generate): set a temperature above 0")
    until = gen.get("until") or ()
    filters = []
    for i, f in enumerate(config.get("filter_list") or ()):
        try:
            filters.append(filter_from_config(str(f.get("name")), list(f.get("filter") or ())))
        except UnsupportedFilter as e:
            return ScoringRefusal(task, f"filter_list[{i}]", f"cannot be reproduced: {e}")
    try:
        match = MatchSettings.model_validate(kwargs)
    except ValueError as e:
        return ScoringRefusal(task, "metric_list[0]", f"has exact_match settings jex cannot read: {e}")
    steps = [step for f in filters for step in f.steps]
    wide = max((step.k for step in steps if isinstance(step, TakeFirstKStep)), default=1)
    if wide > samples:
        return ScoringRefusal(task, "filter_list", f"takes the first {wide} responses of a document; repeats is "
                                                   f"{samples}")
    return GenerativeScoring(until=(until,) if isinstance(until, str) else tuple(until),
                             max_tokens=int(gen.get("max_gen_toks") or MAX_GEN_TOKS), filters=tuple(filters),
                             match=match, temperature=temperature if sampling else 0.0,
                             top_p=float(gen.get("top_p") or 1.0) if sampling else 1.0,
                             top_k=int(gen.get("top_k") or 0) if sampling else 0, samples=samples)
