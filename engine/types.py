"""The engine boundary: frozen requests in, frozen results out, two error kinds."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from jex.errors import JexError
from jex.numerics import argmax
from jex.provenance import ProvenanceBlock

if TYPE_CHECKING:
    from jex.engine.render import Renderer
    from jex.engine_spec import RenderSpec


class ReadoutMode(str, enum.Enum):
    LABEL_SLOT = "label_slot"
    """One forward pass; log-probs of the label tokens (" A", " B", ...) at the answer slot."""
    OPTION_CONTINUATION = "option_continuation"
    """Each option's continuation log-likelihood after the prompt, as lm-evaluation-harness's `loglikelihood`
    computes it (`TokenizedEngine.plan_continuation`)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"          # end-of-sequence token or a stop string
    LENGTH = "length"      # max_tokens reached
    REFUSED = "refused"    # not run: the prompt does not fit the context


class EngineError(JexError):
    """Recoverable: the request or batch failed, the engine is fine; a retry may succeed."""


class EngineDeadError(JexError):
    """Fatal: the engine cannot serve any more requests (bad model, refused profile, CUDA error); it is
    released, never retried."""


class RefusalKind(str, enum.Enum):
    """Why a row was not read: the head of its refusal text (`<kind>: <detail>`, as captures store it)."""

    CONTEXT = "context"
    """The prompt, with what must follow it, does not fit the model's context (or is only whitespace)."""
    LABEL_TOKEN = "label token"
    """A label is not one token, or its log-prob was not returned."""
    CONTINUATION = "continuation"
    """An option encodes to no tokens."""
    BATCH_ERROR = "batch error"
    """The row's batch kept failing, and so did the row on its own (`tasks/capture/batch_errors.py`)."""

    def refusal(self, detail: str) -> str:
        """The refusal text of this kind."""
        return f"{self.value}: {detail}"

    def of(self, refusal: str | None) -> bool:
        """Whether a refusal text is of this kind."""
        return refusal is not None and refusal.startswith(self.value)


class ContextRefusal(EngineError):
    """The prompt (plus what must follow it) does not fit the model's context."""


@dataclass(frozen=True)
class ReadoutRequest:
    run_id: str
    prompt: str
    """The rendered prompt, ending where the answer slot begins (e.g. '...Answer:')."""
    labels: tuple[str, ...]
    """Label texts, e.g. ('A', 'B', 'C', 'D'); read as the tokens ' A', ' B', ..."""
    options: tuple[str, ...] = ()
    """Option texts, used by OPTION_CONTINUATION."""
    delimiter: str = " "
    """OPTION_CONTINUATION: option i's continuation is `delimiter + options[i]` (lm-eval's target_delimiter)."""
    partial: bool = False
    """OPTION_CONTINUATION, lm-eval's partial evaluation (Winogrande): option i is a context and `delimiter +
    prompt` the one continuation read after each."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's token ids under this engine's tokenizer, when already tokenised; None: the engine
    tokenises `prompt`."""


@dataclass(frozen=True)
class Readout:
    run_id: str
    logprobs: tuple[float, ...] | None
    """Per-option log-probabilities renormalised over the options (None when refused)."""
    raw_logprobs: tuple[float, ...] | None
    """Label-token log-probs over the whole vocabulary, or continuation log-likelihood sums."""
    label_mass: float | None
    """LABEL_SLOT: total probability the label tokens hold at the slot; None for continuation."""
    mode: ReadoutMode
    refusal: str | None = None
    """Why the request was not read (counted, never a silent answer)."""
    greedy: tuple[bool, ...] | None = None
    """OPTION_CONTINUATION: whether each option's continuation is the greedy one (lm-eval's `is_greedy`)."""

    @property
    def probs(self) -> tuple[float, ...] | None:
        return None if self.logprobs is None else tuple(math.exp(x) for x in self.logprobs)

    @property
    def choice(self) -> int | None:
        return argmax(self.logprobs)


@dataclass(frozen=True)
class Sampling:
    """How one request samples instead of decoding greedily: each token drawn from the softmax of its float32
    logits / `temperature`, kept to the `top_k` most likely (0: all), then to the smallest set of `top_p`
    probability (vLLM's and transformers' order), by a generator of the request's own seeded with `seed`; so a
    request's tokens depend on its logits and its seed alone, never on the batch around it."""

    temperature: float
    seed: int
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class GenerateRequest:
    run_id: str
    prompt: str
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    """Generate exactly max_tokens (bake-offs compare fixed-length sequences)."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's token ids under this engine's tokenizer, when already tokenised; None: the engine
    tokenises `prompt`."""
    sampling: Sampling | None = None
    """None: greedy; else sampled with this request's own seed."""


@dataclass(frozen=True)
class NextTokenRequest:
    """Where would the model go next? Read after the prompt plus `continuation` (token ids)."""

    run_id: str
    prompt: str
    continuation: tuple[int, ...]
    """Token ids appended to the encoded prompt (e.g. the first m tokens of a rationale)."""
    watch: tuple[int, ...]
    """Token ids whose log-prob and rank are read at the next position (e.g. end-of-sequence)."""


@dataclass(frozen=True)
class NextTokenStats:
    run_id: str
    logprobs: tuple[float | None, ...]
    """Log-prob of each watched token over the whole vocabulary (None: the engine could not read it)."""
    ranks: tuple[int | None, ...]
    """1 = the most likely next token; None when the engine can only see its top-k and it is not there."""
    refusal: str | None = None


@dataclass(frozen=True)
class Generation:
    run_id: str
    text: str
    """Generated text, cut before the first stop string."""
    token_ids: tuple[int, ...]
    """Every generated token id, as the engine produced them (greedy, or sampled as the request asked)."""
    finish_reason: FinishReason
    prompt_tokens: int = 0


class Engine(Protocol):
    """What the stages need from an inference engine. Deterministic: greedy, or sampled by each request's own
    seed."""

    name: str

    def chat_prompt(self, user_text: str) -> str:
        """The model's chat template around one user turn, ready for the assistant's reply."""
        ...

    def renderer(self, spec: RenderSpec) -> Renderer:
        """`spec` applied with this model's tokenizer and chat template."""
        ...

    def readout(self, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT,
                ) -> list[Readout]:
        ...

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        ...

    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]:
        """Log-prob and rank of watched tokens after prompt + continuation (the early-exit probe)."""
        ...

    def provenance(self) -> ProvenanceBlock:
        """Versions, settings, model path and weights sha256: everything that fixes the function."""
        ...


def renormalise(raw: Sequence[float]) -> tuple[float, ...]:
    """log-softmax over a few values, in float64."""
    top = max(raw)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in raw))
    return tuple(x - lse for x in raw)


def cut_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for s in stop if (i := text.find(s)) >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
