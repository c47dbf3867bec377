"""Prompt rendering: a suite row into the text the engines read.

`RenderSpec` holds every setting that changes what the engine reads: the question and reasoning
templates, the option line format, the answer slot, the system prompt, the chat template (`auto`,
`none` or the Jinja text itself) and the few-shot count. Its digest is part of every engine
stage's cache key and of every provenance block, so an arm that changes a word here recomputes
exactly the engine stages, and an arm that changes nothing here reuses them.

A `Renderer` applies a spec with one engine's chat function. The defaults reproduce the prompts
jex has always used: the embedded model reads byte-identical text.
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jex.engine.types import ReadoutRequest
from jex.fileio import sha256_json

RENDERER_VERSION = "jex-render/2"

QUESTION_TEMPLATE = "{prompt}\n\n{options}\n\nAnswer with the letter of the correct option."
REASON_TEMPLATE = ("{prompt}\n\n{options}\n\nThink step by step in a few short sentences, then give the "
                   "letter of the correct option.")
OPTION_FORMAT = "{label}. {option}"
ANSWER_SLOT = "Answer:"
AFTER_THOUGHT = "\nSo the correct option is"  # re-read slot after a rationale

Message = dict[str, str]
ChatFn = Callable[[Sequence[Message]], str]
"""Messages (role, content) in, the text the model reads (ready for the assistant's reply) out."""

_PLACEHOLDERS = {"question_template": {"prompt", "options"}, "reason_template": {"prompt", "options"},
                 "option_format": {"label", "option"}}


def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}


class RenderSpec(BaseModel):
    """What the engine reads, besides the row itself. Part of every engine stage's cache key."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    question_template: str = Field(QUESTION_TEMPLATE, description="Fast-pass user turn; {prompt} and {options}")
    reason_template: str = Field(REASON_TEMPLATE, description="Reasoning user turn; {prompt} and {options}")
    option_format: str = Field(OPTION_FORMAT, description="One option line; {label} and {option}")
    answer_slot: str = Field(ANSWER_SLOT, description="Text after the assistant turn opens; the label is read next")
    after_thought: str = Field(AFTER_THOUGHT, description="Appended to a rationale before the options are re-read")
    system_prompt: str | None = Field(None, description="System turn (plain text before the question without a "
                                                        "chat template)")
    chat_template: str = Field("auto", description="auto (the model's, plain text if it has none) | none | "
                                                   "the Jinja template text")
    num_fewshot: int = Field(0, ge=0, description="Solved examples before each fast-pass question, taken in "
                                                  "order from the catalog's few-shot rows")
    option_order_seed: int | None = Field(None, description="Show each row's options in an order shuffled by "
                                                            "(seed, run_id), restored before scoring (a placebo); "
                                                            "empty = the row's order")

    @field_validator("question_template", "reason_template", "option_format")
    @classmethod
    def _placeholders(cls, value: str, info: Any) -> str:
        want = _PLACEHOLDERS[info.field_name]
        try:
            got = _fields(value)
        except ValueError as e:
            raise ValueError(f"not a format string ({e}); write literal braces as {{{{ and }}}}") from None
        if got != want:
            raise ValueError(f"needs exactly the placeholders {sorted(want)}, found {sorted(got)}")
        return value

    def digest(self) -> dict[str, str]:
        """Version plus the sha256 of every setting; equal specs give equal digests (part of the engine
        fingerprint, so of every engine stage key)."""
        doc = self.model_dump(mode="json")
        if doc["option_order_seed"] is None:  # added later: absent at its default, so older keys stay valid
            del doc["option_order_seed"]
        return {"version": RENDERER_VERSION, "sha256": sha256_json(doc)}

    def is_default(self) -> bool:
        return self == RenderSpec()


DEFAULT_RENDER = RenderSpec()


@dataclass(frozen=True)
class Example:
    """A solved few-shot example: the question, its options and labels, and the gold index."""

    prompt: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    gold: int


class Renderer:
    """A `RenderSpec` applied with one engine's chat function (None: no chat template at all)."""

    def __init__(self, spec: RenderSpec, chat: ChatFn | None):
        self.spec, self.chat = spec, chat

    def _messages(self, user: str, examples: Sequence[Example] = ()) -> list[Message]:
        out: list[Message] = [{"role": "system", "content": self.spec.system_prompt}] if self.spec.system_prompt \
            else []
        for ex in examples:
            out.append({"role": "user", "content": self._question_text(ex.prompt, ex.labels, ex.options)})
            out.append({"role": "assistant", "content": f"{self.spec.answer_slot} {ex.labels[ex.gold]}"})
        out.append({"role": "user", "content": user})
        return out

    def option_block(self, labels: Sequence[str], options: Sequence[str]) -> str:
        return "\n".join(self.spec.option_format.format(label=lab, option=opt)
                         for lab, opt in zip(labels, options, strict=True))

    def _question_text(self, prompt: str, labels: Sequence[str], options: Sequence[str]) -> str:
        return self.spec.question_template.format(prompt=prompt, options=self.option_block(labels, options))

    def question(self, *, run_id: str, prompt: str, labels: Sequence[str], options: Sequence[str],
                 examples: Sequence[Example] = ()) -> ReadoutRequest:
        """The fast-pass request: [system], few-shot turns, the question, then the answer slot."""
        user = self._question_text(prompt, labels, options)
        text = self._plain(user, examples) if self.chat is None else \
            self.chat(self._messages(user, examples)) + self.spec.answer_slot
        return ReadoutRequest(run_id, text, tuple(labels), tuple(options))

    def reason(self, *, prompt: str, labels: Sequence[str], options: Sequence[str]) -> str:
        """The prompt a rationale is generated from (zero-shot: examples carry no rationale)."""
        user = self.spec.reason_template.format(prompt=prompt, options=self.option_block(labels, options))
        return self._plain(user, (), slot="") if self.chat is None else self.chat(self._messages(user))

    def after_thought(self, reason_prompt: str, rationale: str) -> str:
        """The re-read prompt: the reasoning prompt, the rationale, then the re-read slot."""
        return reason_prompt + rationale.rstrip() + self.spec.after_thought

    def _plain(self, user: str, examples: Sequence[Example], slot: str | None = None) -> str:
        """No chat template: system text, solved examples and the question as plain paragraphs."""
        slot = self.spec.answer_slot if slot is None else slot
        parts = [self.spec.system_prompt] if self.spec.system_prompt else []
        parts += [f"{self._question_text(ex.prompt, ex.labels, ex.options)}\n{self.spec.answer_slot} "
                  f"{ex.labels[ex.gold]}" for ex in examples]
        parts.append(user)
        return "\n\n".join(parts) + "\n" + slot


def option_order(spec: RenderSpec, run_id: str, k: int) -> list[int] | None:
    """Display order of a row's options: position i shows option order[i] (None: the row's own order).

    Seeded by (option_order_seed, run_id) alone, so every engine and every process shows the same order.
    """
    if spec.option_order_seed is None:
        return None
    digest = hashlib.sha256(f"{spec.option_order_seed}:{run_id}".encode()).digest()
    order = list(range(k))
    for i in range(k - 1, 0, -1):  # Fisher-Yates driven by the digest's bytes
        j = digest[i % len(digest)] % (i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def render_question(chat: Callable[[str], str], *, run_id: str, prompt: str, labels: Sequence[str],
                    options: Sequence[str]) -> ReadoutRequest:
    """The default fast-pass prompt with a one-turn chat function (kept for engine-level tests)."""
    return Renderer(DEFAULT_RENDER, lambda msgs: chat(msgs[-1]["content"])).question(
        run_id=run_id, prompt=prompt, labels=labels, options=options)
