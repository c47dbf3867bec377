"""A served model as an engine: any OpenAI-compatible server (vLLM, SGLang, TGI, `transformers serve`, an API).

Generative rows go through `/v1/completions` as their prompt stands, or through `/v1/chat/completions` when
the render asks for the model's chat template (`chat_template = "model"`: the server applies its own);
greedy unless a request carries its own sampling. Multiple-choice rows are read through `/v1/completions`
with the prompt's log-probabilities (`echo` + `logprobs`, as vLLM's server gives them): each option's
continuation log-likelihood is the sum over the echoed tokens that spell it (found by their text offsets),
scored as the local engines score theirs. A server that answers without them is found by one probe request
(`readout_refusal`) before any row is sent: `transformers serve` ignores `echo` and `logprobs` silently, so
the probe checks the answer, not the status.

Retries (429, 5xx, timeouts, lost connections) are the `openai` client's own; at most `max_concurrency`
requests are in flight. Every answer is appended to the stage's answer journal as it arrives
(`keep_answers`), so a stage stopped mid-way and computed again sends only the requests not yet answered.
A served model's batch invariance cannot be proven from outside: its identity is the server's
`scheme://host:port`, the model id (and any revision) `/v1/models` reports, and what jex sends.
The API key comes from the settings (`JEX_ENGINE__API_KEY`, or the variable `api_key_env` names) and goes
into no record, log or error message.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import uuid
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import JsonValue, TypeAdapter

from jex.engine.base import ChatTokenizer, TokenizedEngine, continuation_readout, package_version
from jex.engine.render import ChatFn, Message
from jex.engine.types import (
    EngineDeadError,
    FinishReason,
    GenerateRequest,
    Generation,
    NextTokenRequest,
    NextTokenStats,
    Readout,
    ReadoutMode,
    ReadoutRequest,
    RefusalKind,
    cut_at_stop,
    renormalise,
)
from jex.engine_identity import EngineFingerprint, RenderDigest
from jex.engine_spec import EngineSpec, RenderSpec
from jex.provenance import ProvenanceBlock
from jex.record import Record

CHAT_PROMPT = "chat messages for /v1/chat/completions: "
"""How a chat-rendered prompt travels as text (a request's `prompt`, `samples.parquet`): this head, then the
messages as JSON. The server applies its own chat template to them."""
JOURNAL_GLOB = ".served-answers-*.jsonl"
"""Beside a stage's shards: every answer of a served model, one JSON line each (`AnswerJournal`)."""
PROBE_PROMPT = "The capital of France is Paris"
NO_KEY = "no-key"
"""Sent when no key is set (a local server needs none); never the environment's OPENAI_API_KEY by surprise."""
STOPS_SENT = 4
"""Stop sequences sent per request (OpenAI's limit); every stop sequence is applied to the answer here too."""

Route = Literal["completions", "chat", "echo"]
_MESSAGES = TypeAdapter(list[dict[str, str]])


class ServedModel(Record):
    """A served model as its server reports it: the engine's identity and provenance (never the key)."""

    endpoint: str
    model: str
    revision: str | None = None
    entry: dict[str, JsonValue] = {}
    server_version: str | None = None
    max_model_len: int | None = None


_IDENTITIES: dict[tuple[str, str | None], ServedModel] = {}
_IDENTITIES_LOCK = threading.Lock()


def served_api_key(spec: EngineSpec) -> str | None:
    """The API key: the variable `api_key_env` names, else the setting JEX_ENGINE__API_KEY; None: none set."""
    if spec.api_key_env:
        value = os.environ.get(spec.api_key_env)
        if not value:
            raise EngineDeadError(f"engine.api_key_env names {spec.api_key_env}, which is not set: export the key "
                                  "in it, or leave api_key_env empty to use JEX_ENGINE__API_KEY")
        return value
    from jex.settings import load_settings

    key = load_settings().engine.api_key
    return key.get_secret_value() if key is not None else None


def openai_client(spec: EngineSpec, *, timeout_s: float | None = None, max_retries: int | None = None) -> Any:
    """The `openai` client of `spec`'s server, its retries and timeout as the spec says."""
    from openai import OpenAI

    return OpenAI(base_url=spec.base_url, api_key=served_api_key(spec) or NO_KEY,
                  max_retries=spec.max_retries if max_retries is None else max_retries,
                  timeout=spec.request_timeout_s if timeout_s is None else timeout_s)


def served_model(spec: EngineSpec) -> ServedModel:
    """The model `spec` names as its server's `/v1/models` reports it (looked up once per process): the id,
    any revision, and the server's version where it tells one (vLLM's `/version`). Without a model name, the
    server's only model. EngineDeadError when the server does not answer or does not serve it."""
    endpoint = spec.endpoint()
    assert endpoint is not None and spec.base_url  # the spec's validator: openai needs base_url
    key = (spec.base_url, spec.model)
    with _IDENTITIES_LOCK:
        if key in _IDENTITIES:
            return _IDENTITIES[key]
    retries = min(spec.max_retries, 2)
    client = openai_client(spec, timeout_s=min(30.0, spec.request_timeout_s), max_retries=retries)
    with served_errors(spec, client.api_key, "GET /v1/models", retries=retries):
        import openai

        try:
            listed = [m.model_dump(mode="json") for m in client.models.list()]
        except openai.NotFoundError:  # a server without /v1/models: the name given is all there is
            listed = []
    found = _pick_model(spec, [e for e in listed if isinstance(e.get("id"), str)])
    root = found.get("root")
    revision = found.get("revision") or (root if isinstance(root, str) and root != found["id"] else None)
    length = found.get("max_model_len")
    info = ServedModel(endpoint=endpoint, model=str(found["id"]), revision=str(revision) if revision else None,
                       entry=found, server_version=_server_version(endpoint),
                       max_model_len=length if isinstance(length, int) else None)
    with _IDENTITIES_LOCK:
        _IDENTITIES[key] = info
    return info


def _pick_model(spec: EngineSpec, listed: list[dict[str, JsonValue]]) -> dict[str, JsonValue]:
    ids = [str(e["id"]) for e in listed]
    if spec.model is None:
        if len(listed) != 1:
            raise EngineDeadError(f"the server at {spec.endpoint()} serves {len(listed)} models "
                                  f"({', '.join(ids[:5]) or 'none listed'}): name one with --model openai:NAME")
        return listed[0]
    if not listed:
        return {"id": spec.model}
    for entry in listed:
        if entry["id"] == spec.model:
            return entry
    raise EngineDeadError(f"the server at {spec.endpoint()} does not serve model {spec.model!r} (its /v1/models "
                          f"lists {', '.join(ids[:5])}{' ...' if len(ids) > 5 else ''})")


def _server_version(endpoint: str) -> str | None:
    """The version a server reports at `/version` (vLLM's; others have none)."""
    import httpx

    try:
        answer = httpx.get(f"{endpoint}/version", timeout=5.0)
        version = answer.json().get("version") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(version) if version is not None else None


def served_fingerprint(spec: EngineSpec) -> EngineFingerprint:
    """The identity of a served model: the kind and its version, the server's `scheme://host:port`, the model
    id and revision as the server reports them, and what jex sends it (the render digest)."""
    from jex.engine.fingerprint import ENGINE_VERSIONS

    info = served_model(spec)
    return EngineFingerprint(kind="openai", engine_version=ENGINE_VERSIONS["openai"], device_type="server",
                             renderer=RenderDigest(**spec.render.digest()), endpoint=info.endpoint,
                             served_model=info.model, served_revision=info.revision)


class served_errors:  # noqa: N801 - used as a `with` block, like contextlib's
    """An `openai` error of a served request (after the client's retries) as one EngineDeadError line that
    names the server and what to do, the key scrubbed from it."""

    def __init__(self, spec: EngineSpec, key: str | None, what: str, *, retries: int | None = None):
        self.spec, self.key, self.what = spec, key, what
        self.retries = spec.max_retries if retries is None else retries

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        import openai

        if exc is None or not isinstance(exc, openai.OpenAIError):
            return
        raise EngineDeadError(scrubbed(served_failure(self.spec, exc, self.what, self.retries), self.key)) from None


def served_failure(spec: EngineSpec, exc: BaseException, what: str, retries: int) -> str:
    """What went wrong with a served request, and what to do, in one line."""
    import openai

    where = f"the server at {spec.endpoint()}"
    detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return (f"{where} refused the API key ({what}: {detail}); set it in JEX_ENGINE__API_KEY or the variable "
                "engine.api_key_env names")
    if isinstance(exc, openai.NotFoundError):
        return f"{where} has no {what} ({detail}); check --base-url (it ends in /v1) and the model's name"
    if what == "GET /v1/models":
        return f"{where} does not answer ({what}: {type(exc).__name__}: {detail}, {retries} retries): start it, or " \
               "check --base-url"
    return (f"{where} stopped answering ({what}: {type(exc).__name__}: {detail}) after {retries} retries; the "
            "requests answered so far are kept: start it again and resume (`jex run --resume RUN`)")


def scrubbed(text: str, key: str | None) -> str:
    return text.replace(key, "***") if key and key != NO_KEY else text


def chat_prompt_text(messages: Sequence[Message]) -> str:
    """A chat-rendered prompt as text: `CHAT_PROMPT` and the messages as JSON (the server renders them)."""
    return CHAT_PROMPT + json.dumps(list(messages), ensure_ascii=False)


def chat_messages(prompt: str) -> list[Message] | None:
    """The messages of a chat-rendered prompt (`chat_prompt_text`); None for a plain-text prompt."""
    if not prompt.startswith(CHAT_PROMPT):
        return None
    return _MESSAGES.validate_json(prompt.removeprefix(CHAT_PROMPT))


class ServedTokenizer(ChatTokenizer):
    """What a served model renders with, without its tokenizer (the server tokenises): no chat template of
    its own; `chat_template = "model"` sends the messages for the server's (`chat_prompt_text`); prompts
    carry no token ids."""

    tokenizer: Any = None

    def has_chat_template(self) -> bool:
        return False

    def chat_function(self, spec: RenderSpec, *, verbatim: bool = False) -> ChatFn | None:
        return chat_prompt_text if spec.chat_template == "model" else None

    def encode(self, text: str) -> list[int]:
        return []

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [[] for _ in texts]


class EchoedTokens(Record):
    """The log-probabilities of an echoed prompt, token by token: where each token starts in the text, its
    log-prob (None for the first token, which has no context), and the most likely token's log-prob there."""

    text: str
    offsets: list[int]
    logprobs: list[float | None]
    top: list[float | None]

    @classmethod
    def of(cls, choice: Any) -> EchoedTokens | None:
        """From one completion choice (the `openai` client's `CompletionChoice`); None when it carries no prompt
        log-probabilities (the server ignored `echo` or `logprobs`)."""
        lp = choice.logprobs
        offsets, logprobs = (lp.text_offset or [], lp.token_logprobs or []) if lp is not None else ([], [])
        if len(offsets) < 2 or len(offsets) != len(logprobs):
            return None
        tops = (lp.top_logprobs if lp is not None else None) or [None] * len(offsets)
        top = [max(t.values()) if isinstance(t, dict) and t else None for t in tops]
        return cls(text=choice.text or "", offsets=list(offsets), logprobs=list(logprobs), top=top)

    def span(self, start: int, end: int) -> tuple[float, bool, int] | str:
        """The tokens that spell text[start:end] (a continuation after its context): their summed log-prob,
        whether each was the most likely token (lm-eval's `is_greedy`), and how many; or why they cannot be
        read (a token crosses `start`, a log-prob is missing)."""
        if start not in self.offsets:
            return "the server's tokens cross the end of the context"
        picked = [i for i, o in enumerate(self.offsets) if start <= o < end]
        values = [v for v in (self.logprobs[i] for i in picked) if v is not None]
        if not picked or len(values) != len(picked):
            return "the server returned no log-probability for the continuation"
        greedy = all((lp := self.logprobs[i]) is not None and (top := self.top[i]) is not None and lp >= top
                     for i in picked)
        return math.fsum(values), greedy, len(picked)


class ServedAnswer(Record):
    """One answer of a served model, as the answer journal keeps it: the generated text and why it ended, or
    each echoed prompt's log-probabilities, or why the server refused the request; and the tokens it counted."""

    text: str | None = None
    finish_reason: str | None = None
    echo: list[EchoedTokens | None] | None = None
    refused: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class JournalEntry(Record):
    """One line of an answer journal: the request's key (`ServedCall.key`) and its answer."""

    key: str
    answer: ServedAnswer


@dataclass(frozen=True)
class ServedCall:
    """One request to the server: which endpoint (`echo`: completions with the prompt's log-probabilities)
    and its body."""

    route: Route
    body: dict[str, JsonValue]

    def key(self) -> str:
        """What identifies the request (and so its answer) in the journal: its route and body."""
        return hashlib.sha256(json.dumps([self.route, self.body], sort_keys=True, ensure_ascii=False).encode()
                              ).hexdigest()


def read_journal(folder: Path) -> dict[str, ServedAnswer]:
    """Every answer kept beside a stage's shards (`JOURNAL_GLOB`), by request key; a line cut short when its
    process was killed is skipped."""
    out: dict[str, ServedAnswer] = {}
    for path in sorted(folder.glob(JOURNAL_GLOB)):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                entry = JournalEntry.model_validate_json(line)
            except ValueError:
                continue
            out[entry.key] = entry.answer
    return out


class AnswerJournal:
    """A stage's answers from a served model, kept as they arrive: one `JournalEntry` line per answer in this
    process's file (`JOURNAL_GLOB`, beside the stage's shards); every process's file read when opened."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.answers = read_journal(folder)
        self.path = folder / f".served-answers-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self.lock = threading.Lock()

    def add(self, key: str, answer: ServedAnswer) -> None:
        line = JournalEntry(key=key, answer=answer).model_dump_json() + "\n"
        with self.lock:
            self.answers[key] = answer
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)


class ServedUsage(Record):
    """What a served model was asked and answered: requests, prompt and completion tokens as its server counted
    them."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: ServedUsage) -> ServedUsage:
        return ServedUsage(requests=self.requests + other.requests,
                           prompt_tokens=self.prompt_tokens + other.prompt_tokens,
                           completion_tokens=self.completion_tokens + other.completion_tokens)


def journal_usage(folder: Path) -> ServedUsage:
    """The usage of every answer kept beside a stage's shards (each request once)."""
    answers = read_journal(folder).values()
    return ServedUsage(requests=len(answers), prompt_tokens=sum(a.prompt_tokens for a in answers),
                       completion_tokens=sum(a.completion_tokens for a in answers))


class OpenAIEngine(ServedTokenizer, TokenizedEngine):
    """A served model (module docstring). `max_concurrency` requests in flight; the client retries."""

    name = "openai"

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.info = served_model(spec)
        self.key = served_api_key(spec)
        self.client = openai_client(spec)
        self.concurrency = spec.max_concurrency
        self.max_context = self.info.max_model_len or 1 << 30
        self.journal: AnswerJournal | None = None
        self._readable: str | None | bool = False  # False: not probed yet

    def preparer(self) -> ChatTokenizer:
        return self

    def tokenizer_copy(self) -> Any:
        return None

    def keep_answers(self, folder: Path | None) -> None:
        """Journal every answer in `folder` as it arrives, and answer from it what it already holds (None: keep
        none, and send every request)."""
        if folder is None or self.journal is None or self.journal.folder != folder:
            self.journal = None if folder is None else AnswerJournal(folder)

    # --- requests ---------------------------------------------------------------------------------------
    def _send(self, call: ServedCall) -> ServedAnswer:
        """One request and its answer. A refused request (400, 413, 422: e.g. a prompt longer than the model's
        context) is an answer too (`refused`): computing it again would be refused again."""
        import openai

        extra = {k: v for k, v in call.body.items() if k == "top_k"}  # vLLM's, outside OpenAI's schema
        sent: Any = {k: v for k, v in call.body.items() if k not in extra}
        try:
            if call.route == "chat":
                answer: Any = self.client.chat.completions.create(**sent, extra_body=extra or None)
                choice = answer.choices[0]
                out = ServedAnswer(text=choice.message.content or "", finish_reason=choice.finish_reason)
            else:
                answer = self.client.completions.create(**sent, extra_body=extra or None)
                choices = sorted(answer.choices, key=lambda c: c.index)
                out = ServedAnswer(echo=[EchoedTokens.of(c) for c in choices]) if call.route == "echo" else \
                    ServedAnswer(text=choices[0].text, finish_reason=choices[0].finish_reason)
        except (openai.BadRequestError, openai.UnprocessableEntityError) as e:
            return ServedAnswer(refused=scrubbed(str(e).splitlines()[0][:300], self.key))
        except openai.APIStatusError as e:
            if e.status_code != 413:
                raise
            return ServedAnswer(refused=scrubbed(str(e).splitlines()[0][:300], self.key))
        usage = answer.usage
        return out.model_copy(update={"prompt_tokens": usage.prompt_tokens if usage else 0,
                                      "completion_tokens": usage.completion_tokens if usage else 0})

    def _answers(self, calls: Sequence[ServedCall]) -> list[ServedAnswer]:
        """Each call's answer: from the journal when it holds it, else sent (at most `concurrency` at once) and
        journalled as it arrives. The first fatal error stops sending; the answers already in are kept."""
        keys = [c.key() for c in calls]
        journal = self.journal
        out = {k: journal.answers[k] for k in keys if journal is not None and k in journal.answers}
        todo = {k: c for k, c in zip(keys, calls, strict=True) if k not in out}

        def one(key: str, call: ServedCall) -> None:
            answer = self._send(call)
            if journal is not None:
                journal.add(key, answer)
            out[key] = answer

        if todo:
            with ThreadPoolExecutor(min(self.concurrency, len(todo)), thread_name_prefix="served") as pool:
                futures: list[Future[None]] = [pool.submit(one, k, c) for k, c in todo.items()]
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = next((e for f in done if (e := f.exception()) is not None), None)
                if failed is not None:
                    for f in futures:
                        f.cancel()
                    with served_errors(self.spec, self.key, "a request"):
                        raise failed
        return [out[k] for k in keys]

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        calls = []
        for r in requests:
            body: dict[str, JsonValue] = {"model": self.info.model, "max_tokens": r.max_tokens, **_sampling(r),
                                          **({"stop": list(r.stop[:STOPS_SENT])} if r.stop else {})}
            messages = chat_messages(r.prompt)
            calls.append(ServedCall("completions", {**body, "prompt": r.prompt}) if messages is None else
                         ServedCall("chat", {**body, "messages": [dict(m) for m in messages]}))
        return [_generation(r, a) for r, a in zip(requests, self._answers(calls), strict=True)]

    # --- readouts ---------------------------------------------------------------------------------------
    def readout_refusal(self) -> str | None:
        """Why this server cannot read multiple-choice rows (no prompt log-probabilities), found by one probe
        request the first time it is asked; None: it can."""
        if self._readable is False:
            with served_errors(self.spec, self.key, "the probe request"):
                echoed = (self._send(echo_call(self.info.model, [PROBE_PROMPT])).echo or [None])[0]
            ok = echoed is not None and echoed.text.startswith(PROBE_PROMPT) and \
                any(v is not None for v in echoed.logprobs)
            self._readable = None if ok else (
                f"the server at {self.info.endpoint} returns no prompt log-probabilities (`echo` + `logprobs` on "
                "/v1/completions, as vLLM's server gives them), which multiple-choice rows are scored by; run "
                "the suite's generative catalogs alone, or serve the model with vLLM")
        return self._readable if isinstance(self._readable, str) else None

    def readout(self, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT) -> list[Readout]:
        if (problem := self.readout_refusal()) is not None:
            raise EngineDeadError(problem)
        plans = [option_texts(r, mode) for r in requests]
        calls = [echo_call(self.info.model, [c + t for c, t in p]) for p in plans if not isinstance(p, str)]
        answers = iter(self._answers(calls))
        return [Readout(r.run_id, None, None, None, mode, plan) if isinstance(plan, str) else
                read_options(r.run_id, plan, next(answers), mode) for r, plan in zip(requests, plans, strict=True)]

    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]:
        why = "a served model has no next-token probe (it takes token ids the server does not)"
        return [NextTokenStats(r.run_id, tuple(None for _ in r.watch), tuple(None for _ in r.watch), why)
                for r in requests]

    def provenance(self) -> ProvenanceBlock:
        """The server, the model as it reports it and what jex sends; never the key."""
        return {"engine": "openai", "endpoint": self.info.endpoint, "served_model": self.info.model,
                "served_revision": self.info.revision, "server_version": self.info.server_version,
                "served_entry": self.info.entry, "openai": package_version("openai"),
                "max_concurrency": self.concurrency, "max_retries": self.spec.max_retries,
                "device_type": "server", "batch_invariant": False,
                "batch_invariance": "not proven (a served model: the server batches as it likes)",
                "jex": package_version("jex")}


def _sampling(request: GenerateRequest) -> dict[str, JsonValue]:
    """Greedy (temperature 0), or the request's own sampling (its seed sent: servers that honour it repeat)."""
    sampling = getattr(request, "sampling", None)
    if sampling is None:
        return {"temperature": 0.0}
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
            **({"top_k": sampling.top_k} if sampling.top_k else {})}


def _generation(request: GenerateRequest, answer: ServedAnswer) -> Generation:
    """The request's generation from its answer: cut at its stop sequences (a server may keep the one it
    stopped at, as `transformers serve` does), or refused."""
    if answer.refused is not None or answer.text is None:
        return Generation(request.run_id, "", (), FinishReason.REFUSED, answer.prompt_tokens)
    text, stopped = cut_at_stop(answer.text, request.stop)
    finish = FinishReason.LENGTH if answer.finish_reason == "length" and not stopped else FinishReason.STOP
    return Generation(request.run_id, text, (), finish, answer.prompt_tokens)


def echo_call(model: str, prompts: list[str]) -> ServedCall:
    """A completions request that echoes its prompts with their log-probabilities (lm-eval's: one new token)."""
    return ServedCall("echo", {"model": model, "prompt": list(prompts) if len(prompts) > 1 else prompts[0],
                               "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1})


def option_texts(r: ReadoutRequest, mode: ReadoutMode) -> list[tuple[str, str]] | str:
    """Each option's (context, continuation) texts, paired as lm-eval pairs them (the context's trailing
    whitespace moved to the continuation, as `TokenizedEngine.encode_pairs`); or why the row cannot be read."""
    if chat_messages(r.prompt) is not None:
        raise EngineDeadError("a served model reads multiple-choice rows as plain text through /v1/completions "
                              "(prompt log-probabilities): use chat_template auto or none for them (chat_template "
                              "model is for generative catalogs)")
    if not r.prompt.strip():
        return RefusalKind.CONTEXT.refusal("an empty context: a served model has no prefix token to read after")
    if mode is ReadoutMode.LABEL_SLOT:
        return [(r.prompt, " " + label) for label in r.labels]
    pairs = [(o, r.delimiter + r.prompt) for o in r.options] if r.partial else \
        [(r.prompt, r.delimiter + o) for o in r.options]
    return [moved_whitespace(ctx, cont) for ctx, cont in pairs]


def moved_whitespace(context: str, continuation: str) -> tuple[str, str]:
    """lm-eval's pair: the context's trailing whitespace moved to the start of the continuation."""
    n = len(context) - len(context.rstrip())
    return (context[:-n], context[-n:] + continuation) if n else (context, continuation)


def read_options(run_id: str, plan: Sequence[tuple[str, str]], answer: ServedAnswer, mode: ReadoutMode) -> Readout:
    """One row's readout from the echoed answer of its options' texts (context + continuation each): each
    option's continuation log-likelihood, renormalised over the options. Label slot: every label must be one
    token (else a label-token refusal, which the stage reads again by continuation), its mass their sum."""
    if answer.refused is not None:
        return Readout(run_id, None, None, None, mode, RefusalKind.CONTEXT.refusal(answer.refused))
    echoed = answer.echo or []
    scores: list[tuple[float, bool, int]] = []
    for k, (ctx, cont) in enumerate(plan):
        tokens = echoed[k] if k < len(echoed) else None
        got = tokens.span(len(ctx), len(ctx) + len(cont)) if tokens is not None else \
            "the server returned no log-probabilities"
        if isinstance(got, str):
            return Readout(run_id, None, None, None, mode, RefusalKind.CONTINUATION.refusal(f"option {k}: {got}"))
        scores.append(got)
    raw = tuple(s for s, _, _ in scores)
    if mode is ReadoutMode.LABEL_SLOT:
        if any(n != 1 for _, _, n in scores):
            bad = next(cont for (_, cont), (_, _, n) in zip(plan, scores, strict=True) if n != 1)
            return Readout(run_id, None, None, None, mode,
                           RefusalKind.LABEL_TOKEN.refusal(f"'{bad}' is not a single token"))
        return Readout(run_id, renormalise(raw), raw, math.fsum(math.exp(x) for x in raw), mode)
    return continuation_readout(run_id, raw, [g for _, g, _ in scores])
