"""What every engine shares: the chat template, tokenisation, label tokens and request checks.

Both engines tokenise prompts themselves (`add_special_tokens=False`: the chat template already
holds the special tokens) and hand token ids to the model, so HF and vLLM read the same ids. A request
may carry its ids already (`prompt_ids`, from the engine's `preparer()` on another thread).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
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
    RefusalKind,
    renormalise,
)
from jex.engine_identity import EffectiveSettings
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

    def chat_function(self, spec: RenderSpec, *, verbatim: bool = False) -> ChatFn | None:
        """The chat template `spec` asks for: the model's (`auto`; None when it has none), none, or the
        spec's own Jinja text. For a verbatim prompt (an imported harness's own text) `auto` means none,
        as lm-eval applies no template unless asked; `model` asks for the model's template always."""
        wanted = spec.chat_template
        if wanted == "none" or (wanted == "auto" and (verbatim or not self.has_chat_template())):
            return None
        if wanted == "model" and not self.has_chat_template():
            raise ValueError("chat_template = 'model', but the model's tokenizer has no chat template")
        template = None if wanted in ("auto", "model") else wanted

        def chat(messages: Sequence[Message]) -> str:
            return self.tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                                      add_generation_prompt=True)

        return chat

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def renderer(self, spec: RenderSpec) -> Renderer:
        return Renderer(spec, self.chat_function(spec), verbatim_chat=self.chat_function(spec, verbatim=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prefix_token_id(self) -> int:
        """What an empty context reads as (lm-eval's `prefix_token_id`): BOS, else EOS."""
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    def harness_encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids as lm-eval's `HFLM.tok_encode` gives them by default: the tokenizer's own special
        tokens (a BOS only where the tokenizer adds one), none where the text already starts with the
        prefix token's text."""
        prefix = self.tokenizer.decode(self.prefix_token_id())
        plain = [i for i, t in enumerate(texts) if not (prefix and t.startswith(prefix))]
        marked = [i for i, t in enumerate(texts) if prefix and t.startswith(prefix)]
        out: list[list[int]] = [[] for _ in texts]
        for group, special in ((plain, True), (marked, False)):
            if group:
                ids = self.tokenizer([texts[i] for i in group], add_special_tokens=special)["input_ids"]
                for i, row in zip(group, ids, strict=True):
                    out[i] = list(row)
        return out

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

    def effective_settings(self) -> EffectiveSettings | None:
        """What the started engine runs with, read back from it (`engine/effective.py`); None: not read."""
        return None

    def keep_answers(self, folder: Path | None) -> None:
        """Where an engine that pays per request keeps each answer as it arrives, answering from there what it
        already holds (a served model: a stage computed again sends only the requests not yet answered);
        the local engines keep none."""
        return None

    def readout_refusal(self) -> str | None:
        """Why this engine cannot read multiple-choice rows at all (a server without prompt log-probabilities);
        None: it can."""
        return None

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
                reason = RefusalKind.LABEL_TOKEN.refusal(f"' {bad[0]}' is not a single token")
            elif len(ids) + 1 > self.max_context:
                reason = RefusalKind.CONTEXT.refusal(f"{len(ids)} prompt tokens + 1 > {self.max_context}")
            if reason:
                refused[i] = Readout(r.run_id, None, None, None, ReadoutMode.LABEL_SLOT, reason)
            else:
                todo.append((i, ids, labels))
        return refused, todo  # type: ignore[return-value]

    feeds_last_token = False
    """Whether the engine reads a continuation's last token as input too (vLLM's prompt log-probs) or
    stops one before it (a causal forward, as lm-eval's HF backend)."""

    def continuation_window(self) -> int:
        """Most tokens of context + continuation scored at once: lm-eval's left truncation keeps the last
        `max_length + 1` (the last one is never an input); an engine that must read it and sample one
        token after it keeps fewer."""
        return self.max_context + (0 if self.feeds_last_token else 1) - self.continuation_reserve

    def plan_continuation(self, requests: Sequence[ReadoutRequest]
                          ) -> tuple[dict[int, Readout], list[ContinuationPlan]]:
        """Counted refusals, and each other request's context and continuation ids, encoded as lm-eval's
        `loglikelihood` encodes a (context, delimiter + option) pair (`encode_pairs`)."""
        refused: dict[int, Readout] = {}
        todo = []
        window = self.continuation_window()
        for i, (r, pair) in enumerate(zip(requests, self.encode_pairs(requests), strict=True)):
            reason = pair if isinstance(pair, str) else None
            if not isinstance(pair, str) and max(map(len, pair[1])) >= window:
                reason = RefusalKind.CONTEXT.refusal(f"an option of {max(map(len, pair[1]))} tokens leaves no "
                                                     f"context in {window}")
            if reason is not None:
                refused[i] = Readout(r.run_id, None, None, None, ReadoutMode.OPTION_CONTINUATION, reason)
            elif not isinstance(pair, str):
                todo.append(ContinuationPlan(i, tuple(tuple(c) for c in pair[0]), tuple(tuple(c) for c in pair[1]),
                                             window))
        return refused, todo

    def encode_pairs(self, requests: Sequence[ReadoutRequest]
                     ) -> list[tuple[list[list[int]], list[list[int]]] | str]:
        """(context ids per option, continuation ids per option) of each request, or why it cannot be read.
        The pairs are (prompt, delimiter + option) for each option, or (option, delimiter + prompt) for a
        partial-evaluation request, encoded as lm-eval 0.4.13 encodes a pair: trailing whitespace of the
        context moves to the continuation; continuation ids = encode(context + continuation)[len(encode(
        context)):]; an empty context is the prefix token."""
        pairs = [[(o, r.delimiter + r.prompt) for o in r.options] if r.partial else
                 [(r.prompt, r.delimiter + o) for o in r.options] for r in requests]
        texts: list[str] = []
        for r, request_pairs in zip(requests, pairs, strict=True):
            if r.prompt:
                for ctx, cont in request_pairs if r.partial else request_pairs[:1]:
                    texts.append(_moved(ctx, cont)[0])
                texts += ["".join(_moved(ctx, cont)) for ctx, cont in request_pairs]
        ids = iter(self.harness_encode_many(texts))
        plain = iter(self.encode_many([r.delimiter + o for r in requests if not r.prompt for o in r.options]))
        out: list[tuple[list[list[int]], list[list[int]]] | str] = []
        for r, request_pairs in zip(requests, pairs, strict=True):
            if not r.prompt:
                out.append(_empty_context([next(plain) for _ in r.options], self.prefix_token_id()))
                continue
            ctx_ids = [next(ids) for _ in request_pairs] if r.partial else [next(ids)] * len(request_pairs)
            conts = [next(ids)[len(c):] for c in ctx_ids]
            if not all(_moved(ctx, cont)[0] for ctx, cont in request_pairs):
                out.append(RefusalKind.CONTEXT.refusal("the prompt is only whitespace"))
            elif not all(conts):
                out.append(RefusalKind.CONTINUATION.refusal(f"option {[len(c) for c in conts].index(0)} encodes "
                                                            "to no tokens"))
            else:
                out.append((ctx_ids, conts))
        return out


def continuation_readout(run_id: str, raw: Sequence[float], greedy: Sequence[bool]) -> Readout:
    """A continuation readout: the options' summed log-likelihoods, renormalised over the options."""
    return Readout(run_id, renormalise(tuple(raw)), tuple(raw), None, ReadoutMode.OPTION_CONTINUATION,
                   greedy=tuple(greedy))


def _moved(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's pair: the context's trailing whitespace moved to the start of the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def _empty_context(conts: list[list[int]], prefix: int) -> tuple[list[list[int]], list[list[int]]] | str:
    """lm-eval's empty context: the prefix token, unless a continuation starts with it (then its first token).
    One context for every option is needed here; options that disagree on it are refused."""
    pairs = [([prefix], c) if c and c[0] != prefix else (c[:1], c[1:]) for c in conts]
    if any(not c for _, c in pairs) or len({tuple(p) for p, _ in pairs}) > 1:
        return "continuation: an empty context and options that start with the prefix token"
    return [p for p, _ in pairs], [c for _, c in pairs]


@dataclass(frozen=True)
class ContinuationPlan:
    """One request's continuation readout: each option's context ids (one shared context but for partial
    evaluation) and continuation ids, the window."""

    index: int
    contexts: tuple[tuple[int, ...], ...]
    continuations: tuple[tuple[int, ...], ...]
    window: int

    def sequence(self, k: int) -> list[int]:
        """Option k's context + continuation, left-truncated to the window as lm-eval does."""
        return list(self.contexts[k] + self.continuations[k])[-self.window:]

    @property
    def single_token(self) -> bool:
        """Every option is one token after one shared context: one read of the context gives them all
        (lm-eval's one-token continuation cache; the label slot's computation)."""
        return len(set(self.contexts)) == 1 and all(len(c) == 1 for c in self.continuations)
