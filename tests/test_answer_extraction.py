"""Answer extraction and exact match (jex/answer_extraction.py) against lm-evaluation-harness's own filter
classes and `exact_match` metric, on the same strings: the shipped GSM8K task's two filters and its
metric settings, and every other filter jex reproduces."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from jex.answer_extraction import (
    NO_FILTER,
    MatchSettings,
    UnsupportedFilter,
    cut_at_stop,
    exact_match,
    extract,
    filter_from_config,
)

RESPONSES = [
    "She has 3 + 4 = 7 apples.\n#### 7", "The answer is $1,250.50.", "#### -12.5\nQuestion: next", "no digits here",
    "  ####  42 ", "It costs $18. #### 18", "First 12, then 15, finally 20.", "#### 3,000", "", "   padded   ",
    "Answer: B", "x = 5 and y = 10 so #### 15.", "ÉCOLE 3", "A", "tab\there", "7\x00",
]
REFERENCES = ["#### 7", "Natalia sold 48/2 = 24 clips.\n#### 72", "1,250.50", "$18", "15.", "18", "-12.5",
              "3000", "b", "ÉCOLE 3", "", "7"]


def gsm8k() -> dict:
    import lm_eval.tasks

    return yaml.safe_load((Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml").read_text())


def lm_eval_filtered(steps: list[dict], response: str) -> object:
    """The answer lm-eval's own filter classes extract from one response (repeats 1)."""
    from lm_eval.api.registry import get_filter

    resps: object = [[response]]
    for step in steps:
        kwargs = {k: v for k, v in step.items() if k != "function"}
        resps = list(get_filter(step["function"])(**kwargs).apply(resps, [{}]))
    (out,) = resps  # type: ignore[misc]
    return out


@pytest.mark.parametrize("entry", gsm8k()["filter_list"], ids=lambda e: e["name"])
def test_the_gsm8k_filters_extract_what_lm_evals_extract(entry):
    ours = filter_from_config(entry["name"], entry["filter"])
    for response in RESPONSES:
        assert extract(ours, response) == lm_eval_filtered(entry["filter"], response), response


@pytest.mark.parametrize("steps", [
    [{"function": "regex", "regex_pattern": r"(\d+)|([A-D])", "group_select": 0}, {"function": "take_first"}],
    [{"function": "regex", "regex_pattern": r"([A-D])\b", "fallback": " none "}, {"function": "take_first"}],
    [{"function": "regex", "regex_pattern": r"(x)|(y)", "group_select": -1, "fallback": " z "},
     {"function": "take_first"}],
    [{"function": "remove_whitespace"}, {"function": "lowercase"}, {"function": "take_first"}],
    [{"function": "uppercase"}, {"function": "map", "mapping_dict": {"A": "yes", "B": "no"}, "default_value": "?"},
     {"function": "take_first"}],
    [{"function": "take_first"}],
], ids=["groups", "fallback", "empty-groups", "whitespace-lower", "upper-map", "none"])
def test_each_reproduced_filter_extracts_what_lm_evals_class_extracts(steps):
    ours = filter_from_config("f", steps)
    for response in RESPONSES:
        assert extract(ours, response) == lm_eval_filtered(steps, response), response


@pytest.mark.parametrize("settings", [
    {k: v for k, v in gsm8k()["metric_list"][0].items() if k not in ("metric", "aggregation", "higher_is_better")},
    {}, {"ignore_case": True, "ignore_punctuation": True}, {"ignore_numbers": True, "regexes_to_ignore": [r"\s+"]},
], ids=["gsm8k", "plain", "case-punctuation", "numbers-space"])
def test_exact_match_is_lm_evals_on_every_pair(settings):
    from lm_eval.api.metrics import exact_match_hf_evaluate

    match = MatchSettings.model_validate(settings)
    for prediction in [*RESPONSES, *REFERENCES]:
        for reference in REFERENCES:
            want = exact_match_hf_evaluate(predictions=[prediction], references=[reference], **settings)["exact_match"]
            assert exact_match(prediction, reference, match) == bool(want), (prediction, reference)


def test_the_text_is_cut_at_the_first_stop_sequence_of_any():
    until = gsm8k()["generation_kwargs"]["until"]
    assert cut_at_stop(" 5 apples.\n#### 5\n\nQuestion: How many", until) == " 5 apples.\n#### 5\n\n"
    assert cut_at_stop("a<|im_end|>b Question: c", until) == "a"
    assert cut_at_stop("nothing stops this", [*until, ""]) == "nothing stops this"


def test_a_task_without_filters_takes_the_response_as_it_is():
    assert extract(NO_FILTER, " 42\n") == " 42\n"


@pytest.mark.parametrize(("function", "why"), [("regex_pos", "part-of-speech"),
                                               ("multi_choice_regex", "choices"), ("mystery", "unknown")])
def test_a_filter_jex_does_not_reproduce_is_refused_by_name(function, why):
    with pytest.raises(UnsupportedFilter, match=why):
        filter_from_config("maj", [{"function": function}, {"function": "take_first"}])


@pytest.mark.parametrize("steps", [[{"function": "regex"}], [{"function": "take_first"}, {"function": "lowercase"}],
                                   [{"function": "take_first"}, {"function": "take_first"}]])
def test_a_pipeline_that_does_not_end_in_one_take_first_is_refused(steps):
    with pytest.raises(UnsupportedFilter, match="end in one take_first"):
        filter_from_config("f", steps)


def test_a_map_to_numbers_is_refused_in_one_line():
    with pytest.raises(UnsupportedFilter, match="filter 'm'"):
        filter_from_config("m", [{"function": "map", "mapping_dict": {"A": 1}}, {"function": "take_first"}])
