"""Whether jex scores an lm-evaluation-harness task as lm-eval does, field by field.

A `multiple_choice` task's numbers come from a few fields of its config besides the prompt: its own
`process_results`, the metrics of `metric_list` and their aggregations, `filter_list`, `repeats`, or a
Python class of its own. jex reproduces lm-eval's built-in per-document `acc` and `acc_norm` (the same
per-choice log-likelihoods, argmax and length-normalised argmax, averaged); a task that asks for anything
else is refused with one line naming the task and the field, never imported and scored as plain accuracy.
Metric keyword arguments (`ignore_case`, `hf_evaluate`, `weight_by_size`...) do not reach lm-eval's
multiple-choice scoring (0.4.13 `ConfigurableTask.process_results` computes acc and acc_norm itself), so
they change nothing. The prompt fields (`process_docs`, `doc_to_text`, few-shot settings) are reproduced
by building each prompt through the harness itself (`jex.suite_import`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REPRODUCED_METRICS = ("acc", "acc_norm")
"""lm-eval's per-document multiple-choice metrics that jex computes from the same log-likelihoods."""
REPRODUCED_AGGREGATION = "mean"
"""The only aggregation of those metrics jex computes (lm-eval's default for both)."""
SCORING_FIELDS = ("output_type", "process_results", "metric_list", "filter_list", "repeats")
"""The task-config fields besides the prompt that change a multiple-choice task's numbers."""


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


def scoring_refusal(task: str, config: Mapping[str, Any]) -> ScoringRefusal | None:
    """None when every scoring field of the task's config (`SCORING_FIELDS`, as a plain mapping: a parsed
    YAML or `task_config` of a loaded task) is one jex reproduces, else the first field it does not."""
    output_type = config.get("output_type") or "generate_until"
    if output_type != "multiple_choice":
        return ScoringRefusal(task, "output_type", f"is {output_type!r}, not multiple_choice")
    if config.get("process_results") is not None:
        return ScoringRefusal(task, "process_results", f"is the task's own function "
                                                       f"({_name(config['process_results'])}), which jex does not run")
    for i, entry in enumerate(config.get("metric_list") or ()):
        metric = _name(entry.get("metric"))
        if metric not in REPRODUCED_METRICS:
            return ScoringRefusal(task, f"metric_list[{i}].metric", f"is {metric!r}; jex reproduces "
                                                                   f"{' and '.join(REPRODUCED_METRICS)} only")
        aggregation = entry.get("aggregation")
        if aggregation is not None and _name(aggregation) != REPRODUCED_AGGREGATION:
            return ScoringRefusal(task, f"metric_list[{i}].aggregation", f"of {metric} is {_name(aggregation)!r}; "
                                                                         f"jex aggregates by {REPRODUCED_AGGREGATION}")
    if config.get("filter_list"):
        return ScoringRefusal(task, "filter_list", "is set; jex applies no filters to multiple-choice answers")
    if (config.get("repeats") or 1) != 1:
        return ScoringRefusal(task, "repeats", f"is {config['repeats']}; jex reads each document once")
    return None


def task_config(task: Any) -> dict[str, Any]:
    """The scoring fields of a loaded lm-eval task (`SCORING_FIELDS`), plus `process_results` when the task
    is a Python class that scores documents its own way."""
    from lm_eval.api.task import ConfigurableTask

    config = {field: getattr(task.config, field, None) for field in SCORING_FIELDS}
    if config["process_results"] is None and type(task).process_results is not ConfigurableTask.process_results:
        config["process_results"] = type(task).process_results
    return config
