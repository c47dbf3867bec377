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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jex.engine.types import ReadoutRequest
from jex.engine_spec import RenderSpec

Message = dict[str, str]
ChatFn = Callable[[Sequence[Message]], str]
"""Messages (role, content) in, the text the model reads (ready for the assistant's reply) out."""

DEFAULT_RENDER = RenderSpec()


@dataclass(frozen=True)
class Example:
    """A solved few-shot example: the question, its options and labels, and the gold index."""

    prompt: str
    labels: tuple[str, ...]
    options: tuple[str, ...]
    gold: int


class Renderer:
    """A `RenderSpec` applied with one engine's chat function (None: no chat template at all), and the one
    verbatim prompts get (`ChatTokenizer.chat_function(spec, verbatim=True)`: none unless asked for)."""

    def __init__(self, spec: RenderSpec, chat: ChatFn | None, verbatim_chat: ChatFn | None = None):
        self.spec, self.chat, self.verbatim_chat = spec, chat, verbatim_chat

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

    def verbatim(self, *, run_id: str, prompt: str, labels: Sequence[str], options: Sequence[str],
                 delimiter: str = " ") -> ReadoutRequest:
        """The fast-pass request of a verbatim row: its prompt exactly as the row holds it (an imported
        harness's description, few-shot examples and question), no template, option block or answer
        slot; with a chat template only when the spec asks for one (`model` or Jinja text), the prompt as
        one user turn after the system prompt. Labels are read, or options continued, right after it."""
        return ReadoutRequest(run_id, self.continued(prompt), tuple(labels), tuple(options), delimiter)

    def continued(self, prompt: str) -> str:
        """The text a generative row's model continues: its prompt exactly as the row holds it (as lm-eval's
        `generate_until` context), in one user turn only when the spec asks for a chat template (`verbatim`)."""
        return prompt if self.verbatim_chat is None else self.verbatim_chat(self._messages(prompt))

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
