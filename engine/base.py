"""What every engine shares: the chat template, tokenisation, label tokens and request checks.

Both engines tokenise prompts themselves (`add_special_tokens=False`: the chat template already
holds the special tokens) and hand token ids to the model, so HF and vLLM read the same ids. A request
may carry its ids already (`prompt_ids`, from the engine's `preparer()` on another thread).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from jex.engine.render import ChatFn, Message, Renderer
from jex.engine.types import (
    GenerateRequest,
    Generation,
    NextTokenRequest,
    NextTokenStats,
    Readout,
    ReadoutMode,
    ReadoutRequest,
)
from jex.engine_spec import RenderSpec
from jex.provenance import ProvenanceBlock


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


class ChatTokenizer:
    """A tokenizer and its chat template: renders and tokenises prompts, runs no model."""

    tokenizer: Any  # set by the engine that loads it, or by its `preparer()`

    def chat_prompt(self, user_text: str) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}], tokenize=False,
                                                  add_generation_prompt=True)

    def chat_function(self, spec: RenderSpec) -> ChatFn | None:
        """The chat template `spec` asks for: the model's (`auto`; None when it has none), none, or the
        spec's own Jinja text."""
        if spec.chat_template == "none" or (spec.chat_template == "auto" and not self.has_chat_template()):
            return None
        template = None if spec.chat_template == "auto" else spec.chat_template

        def chat(messages: Sequence[Message]) -> str:
            return self.tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                                      add_generation_prompt=True)

        return chat

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def renderer(self, spec: RenderSpec) -> Renderer:
        return Renderer(spec, self.chat_function(spec))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text: one batch call of the fast tokenizer (which encodes in parallel
        outside the GIL), the same ids as `encode` text by text (no padding, no special tokens)."""
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


class TokenizedEngine(ChatTokenizer, ABC):
    """The base of every engine jex runs (`engine/factory.py: make_engine`): the `Engine` protocol's
    methods plus tokenisation, label tokens and request planning shared by all of them."""

    name: str
    max_context: int
    continuation_reserve = 0  # tokens the engine must be able to add after a scored sequence

    @abstractmethod
    def readout(self, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT
                ) -> list[Readout]: ...

    @abstractmethod
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]: ...

    @abstractmethod
    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]: ...

    @abstractmethod
    def provenance(self) -> ProvenanceBlock: ...

    def tokenizer_copy(self) -> Any:
        """A tokenizer equal to this engine's but not shared with it (vLLM's does not survive a deep
        copy: its engine loads one from the model folder instead)."""
        return copy.deepcopy(self.tokenizer)

    def preparer(self) -> ChatTokenizer:
        """This engine's chat template and tokenizer for a thread beside the engine (prompts rendered and
        tokenised there while the engine runs): a copy, checked to give the same ids and template, since
        the engine keeps using its own (vLLM detokenises outputs with it). When no such copy can be
        made the thread shares the engine's; encoding and decoding only read a fast tokenizer as long
        as nothing turns its truncation or padding on (jex never does)."""
        copied = ChatTokenizer()
        probe = ["<|im_start|>user\nWhich option? A. 12 B. café<|im_end|>"]
        try:
            copied.tokenizer = self.tokenizer_copy()
            works = (list(copied.tokenizer(probe, add_special_tokens=False)["input_ids"])
                     == list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
                     and getattr(copied.tokenizer, "chat_template", None) == getattr(self.tokenizer, "chat_template",
                                                                                   None))
        except Exception:  # noqa: BLE001 - a tokenizer that does not survive a copy
            works = False
        if not works:
            print(f"tokenizer {type(self.tokenizer).__name__} does not copy; the preparing thread shares it",
                  flush=True)
            return self
        return copied

    def encode_prompts(self, requests: Sequence[ReadoutRequest] | Sequence[GenerateRequest]) -> list[list[int]]:
        """Each request's prompt ids: the `prompt_ids` it carries, else from one batch call over the rest."""
        fresh = iter(self.encode_many([r.prompt for r in requests if r.prompt_ids is None]))
        return [list(r.prompt_ids) if r.prompt_ids is not None else next(fresh) for r in requests]

    def label_token(self, label: str) -> int | None:
        """The id of ' LABEL' if it is a single token, else None (a label slot cannot read it).
        Computed once per label per engine: a suite has a handful of label sets, read on every row."""
        cache: dict[str, int | None] = self.__dict__.setdefault("_label_ids", {})
        if label not in cache:
            ids = self.encode(" " + label)
            cache[label] = ids[0] if len(ids) == 1 else None
        return cache[label]

    def plan_label_slot(self, requests: Sequence[ReadoutRequest]
                        ) -> tuple[dict[int, Readout], list[tuple[int, list[int], list[int]]]]:
        """Counted refusals by request index, and (index, prompt ids, label ids) for the rest."""
        refused: dict[int, Readout] = {}
        todo = []
        for i, (r, ids) in enumerate(zip(requests, self.encode_prompts(requests), strict=True)):
            labels = [self.label_token(lab) for lab in r.labels]
            reason = None
            if any(t is None for t in labels):
                bad = [lab for lab, t in zip(r.labels, labels, strict=True) if t is None]
                reason = f"label token: ' {bad[0]}' is not a single token"
            elif len(ids) + 1 > self.max_context:
                reason = f"context: {len(ids)} prompt tokens + 1 > {self.max_context}"
            if reason:
                refused[i] = Readout(r.run_id, None, None, None, ReadoutMode.LABEL_SLOT, reason)
            else:
                todo.append((i, ids, labels))
        return refused, todo  # type: ignore[return-value]

    def plan_continuation(self, requests: Sequence[ReadoutRequest]
                          ) -> tuple[dict[int, Readout], list[tuple[int, list[int], list[list[int]]]]]:
        """Counted refusals, and (index, context ids, ids of each ' option') for the rest."""
        refused: dict[int, Readout] = {}
        todo = []
        contexts = self.encode_prompts(requests)
        options = iter(self.encode_many([" " + o for r in requests for o in r.options]))
        for i, (r, ctx) in enumerate(zip(requests, contexts, strict=True)):
            opts = [next(options) for _ in r.options]
            if len(ctx) + max(map(len, opts)) + self.continuation_reserve > self.max_context:
                refused[i] = Readout(r.run_id, None, None, None, ReadoutMode.OPTION_CONTINUATION,
                                     f"context: {len(ctx)} prompt tokens + option > {self.max_context}")
            else:
                todo.append((i, ctx, opts))
        return refused, todo
