"""Prompt rendering: a suite row into the chat-templated text the engines read.

The render is part of every cache key and provenance block (`RENDERER_VERSION` plus the template
text): change a word here and every downstream stage is recomputed, as it must be.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RENDERER_VERSION = "jex-render/1"

QUESTION_TEMPLATE = "{prompt}\n\n{options}\n\nAnswer with the letter of the correct option."
REASON_TEMPLATE = ("{prompt}\n\n{options}\n\nThink step by step in a few short sentences, then give the "
                   "letter of the correct option.")
ANSWER_SLOT = "Answer:"
AFTER_THOUGHT = "\nSo the correct option is"  # re-read slot after a rationale


@dataclass(frozen=True)
class RenderedRow:
    run_id: str
    prompt: str
    labels: tuple[str, ...]
    options: tuple[str, ...]


def option_block(labels: Sequence[str], options: Sequence[str]) -> str:
    return "\n".join(f"{lab}. {opt}" for lab, opt in zip(labels, options, strict=True))


def render_question(chat: Callable[[str], str], *, run_id: str, prompt: str, labels: Sequence[str],
                    options: Sequence[str]) -> RenderedRow:
    """The fast-pass prompt: question, lettered options, chat template, then the answer slot."""
    user = QUESTION_TEMPLATE.format(prompt=prompt, options=option_block(labels, options))
    return RenderedRow(run_id, chat(user) + ANSWER_SLOT, tuple(labels), tuple(options))


def render_reason(chat: Callable[[str], str], *, prompt: str, labels: Sequence[str], options: Sequence[str],
                  template: str = REASON_TEMPLATE) -> str:
    """The prompt a rationale is generated from."""
    return chat(template.format(prompt=prompt, options=option_block(labels, options)))


def render_after_thought(reason_prompt: str, rationale: str) -> str:
    """The re-read prompt: the reasoning prompt, the rationale, then the answer slot again."""
    return reason_prompt + rationale.rstrip() + AFTER_THOUGHT


def renderer_fingerprint(reason_template: str = REASON_TEMPLATE) -> dict[str, str]:
    text = "\x1f".join([RENDERER_VERSION, QUESTION_TEMPLATE, ANSWER_SLOT, reason_template, AFTER_THOUGHT])
    return {"version": RENDERER_VERSION, "sha256": hashlib.sha256(text.encode()).hexdigest()}
