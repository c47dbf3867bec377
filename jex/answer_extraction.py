"""A generated answer's extraction and verdict, as lm-evaluation-harness computes them for its generative
(`generate_until`) tasks: the text cut at the first stop sequence, each named filter pipeline of its
`filter_list` (regex with group select and fallback, take_first, remove_whitespace, lowercase, uppercase,
map, and over a row's several responses (`repeats`) take_first_k and majority_vote), and `exact_match` with
its normalisations (regexes to ignore, ignore case, ignore punctuation, ignore numbers). Each step reproduces
lm-eval 0.4.13's own class or function, to the byte (`tests/test_answer_extraction.py` and
`tests/test_sampled_generation.py` run both on the same strings). A reasoning model's thought is stripped
before any filter reads the response, as lm-eval's `think_end_token` does (`response_after_thinking`). The
filters that need the document (multi_choice_regex, custom functions) are refused by name where a task is
read (`UnsupportedFilter`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import Field

from jex.record import Record

INVALID = "[invalid]"
"""lm-eval's regex filter's default fallback: the extracted answer when the pattern matches nothing."""


class RegexStep(Record):
    """lm-eval's `regex` filter: `re.findall(pattern)`, the `group_select`-th match (a negative index counts
    from the end); of a match of several groups, its first non-empty group; stripped; `fallback` when the
    pattern matches nothing (or the selected match has no non-empty group)."""

    function: Literal["regex"] = "regex"
    regex_pattern: str = r"#### (\-?[0-9\.\,]+)"
    group_select: int = 0
    fallback: str = INVALID


class TakeFirstStep(Record):
    """lm-eval's `take_first`: the first of a document's responses."""

    function: Literal["take_first"] = "take_first"


class TakeFirstKStep(Record):
    """lm-eval's `take_first_k`: the first `k` of a document's responses (its `repeats`)."""

    function: Literal["take_first_k"] = "take_first_k"
    k: int = Field(ge=1)


class MajorityVoteStep(Record):
    """lm-eval's `majority_vote`: the response that occurs most often (`Counter.most_common(1)`: of a tie, the
    one seen first)."""

    function: Literal["majority_vote"] = "majority_vote"


class RemoveWhitespaceStep(Record):
    """lm-eval's `remove_whitespace`: leading and trailing whitespace stripped."""

    function: Literal["remove_whitespace"] = "remove_whitespace"


class LowercaseStep(Record):
    function: Literal["lowercase"] = "lowercase"


class UppercaseStep(Record):
    function: Literal["uppercase"] = "uppercase"


class MapStep(Record):
    """lm-eval's `map`: the response looked up in `mapping_dict`, `default_value` when absent."""

    function: Literal["map"] = "map"
    mapping_dict: dict[str, str] = Field(default_factory=dict)
    default_value: str | None = None


FilterStep = Annotated[RegexStep | TakeFirstStep | TakeFirstKStep | MajorityVoteStep | RemoveWhitespaceStep
                       | LowercaseStep | UppercaseStep | MapStep, Field(discriminator="function")]
SUPPORTED_FILTERS = ("regex", "take_first", "take_first_k", "majority_vote", "remove_whitespace", "lowercase",
                     "uppercase", "map")
REFUSED_FILTERS = {"multi_choice_regex": "reads the document's choices",
                   "regex_pos": "extracts part-of-speech tag lists, not one answer",
                   "custom": "runs a task's own Python function", "decontaminate": "is not an answer extraction",
                   "format_span": "reads the document's span format"}
"""lm-eval 0.4.13's other registered filters, and why jex does not run them."""


class UnsupportedFilter(ValueError):
    """A filter function jex does not reproduce (`REFUSED_FILTERS`, or one it does not know)."""


class AnswerFilter(Record):
    """One named filter pipeline (an entry of lm-eval's `filter_list`)."""

    name: str = Field(min_length=1)
    steps: tuple[FilterStep, ...] = Field(min_length=1)


NO_FILTER = AnswerFilter(name="none", steps=(TakeFirstStep(),))
"""lm-eval's pipeline for a generative task that declares no `filter_list`."""


class MatchSettings(Record):
    """The keyword arguments of lm-eval's `exact_match` metric."""

    regexes_to_ignore: tuple[str, ...] = ()
    ignore_case: bool = False
    ignore_punctuation: bool = False
    ignore_numbers: bool = False


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """The text before the first occurrence of any stop sequence (lm-eval's `s.split(term)[0]` for each
    non-empty term of `until`)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


def _regex(step: RegexStep, response: str) -> str:
    found: list[Any] = re.findall(step.regex_pattern, response)
    if not found:
        return step.fallback
    try:
        match = found[step.group_select]
    except IndexError:  # lm-eval raises here; jex reads it as no answer
        return step.fallback
    if isinstance(match, tuple):
        groups = [m for m in match if m]
        match = groups[0] if groups else step.fallback
    return str(match).strip()


def apply_step(step: FilterStep, response: str | None) -> str | None:
    """One step on one response (None: a `map` default of None)."""
    if isinstance(step, RegexStep):
        return _regex(step, response if isinstance(response, str) else "")
    if isinstance(step, MapStep):
        return step.mapping_dict.get(response, step.default_value) if response is not None else step.default_value
    if response is None or isinstance(step, TakeFirstStep | TakeFirstKStep | MajorityVoteStep):
        return response
    if isinstance(step, RemoveWhitespaceStep):
        return response.strip()
    return response.lower() if isinstance(step, LowercaseStep) else response.upper()


def extract(answer_filter: AnswerFilter, response: str | Sequence[str]) -> str | None:
    """The answer `answer_filter` extracts from one generated response, or from a row's responses (lm-eval's
    `resps` of a task with `repeats`, in order): each step maps every response, take_first and take_first_k
    keep the first (k), majority_vote the most frequent; the answer is the first left."""
    values: list[str | None] = [response] if isinstance(response, str) else list(response)
    for step in answer_filter.steps:
        if isinstance(step, TakeFirstStep | TakeFirstKStep):
            values = values[:step.k if isinstance(step, TakeFirstKStep) else 1]
        elif isinstance(step, MajorityVoteStep):
            values = [Counter(values).most_common(1)[0][0]] if values else values
        else:
            values = [apply_step(step, v) for v in values]
    return values[0] if values else None


def response_after_thinking(generation: str, think_end: str | None, until: Sequence[str]) -> str:
    """The response a reasoning model's generation gives (lm-eval's `postprocess_generated_text`): the text after
    the last `think_end`, its leading whitespace stripped, cut at the first stop sequence; with no `think_end`,
    the generation as it is (already cut at its stop sequences)."""
    if not think_end:
        return generation
    return cut_at_stop(generation.split(think_end)[-1].lstrip(), until)


def normalised(text: str, match: MatchSettings) -> str:
    """`text` as lm-eval's exact_match compares it: each regex to ignore removed (in order), then lower case,
    punctuation and digits removed as asked; trailing NUL characters dropped (numpy's fixed-width strings,
    which lm-eval compares, cannot hold them)."""
    for pattern in match.regexes_to_ignore:
        text = re.sub(pattern, "", text)
    if match.ignore_case:
        text = text.lower()
    if match.ignore_punctuation:
        text = text.translate(str.maketrans("", "", string.punctuation))
    if match.ignore_numbers:
        text = text.translate(str.maketrans("", "", string.digits))
    return text.rstrip("\x00")


def exact_match(prediction: str | None, reference: str, match: MatchSettings) -> bool:
    """lm-eval's `exact_match` of one extracted answer against the reference (None never matches)."""
    return prediction is not None and normalised(prediction, match) == normalised(reference, match)


def filter_from_config(name: str, steps: Sequence[Mapping[str, Any]]) -> AnswerFilter:
    """An lm-eval `filter_list` entry (`{"name": ..., "filter": [{"function": ..., **kwargs}, ...]}`'s name and
    steps) as an `AnswerFilter`; `UnsupportedFilter` names a step jex does not reproduce and why."""
    parsed = []
    for step in steps:
        function = str(step.get("function"))
        if function in REFUSED_FILTERS:
            raise UnsupportedFilter(f"filter '{name}': lm-eval's {function} {REFUSED_FILTERS[function]}")
        if function not in SUPPORTED_FILTERS:
            raise UnsupportedFilter(f"filter '{name}': unknown filter function {function!r} "
                                    f"(jex reproduces {', '.join(SUPPORTED_FILTERS)})")
        parsed.append(step)
    if [s.get("function") for s in steps].count("take_first") != 1 or steps[-1].get("function") != "take_first":
        raise UnsupportedFilter(f"filter '{name}': jex reproduces pipelines that end in one take_first (lm-eval "
                                "then scores one answer per document; steps after it would read its characters)")
    try:
        return AnswerFilter.model_validate({"name": name, "steps": parsed})
    except ValueError as e:  # pydantic's ValidationError: an argument jex does not read (a map to numbers...)
        first = e.errors()[0] if hasattr(e, "errors") else {"msg": str(e), "loc": ()}
        raise UnsupportedFilter(f"filter '{name}': {first['msg']} at {'.'.join(map(str, first['loc']))}") from None
