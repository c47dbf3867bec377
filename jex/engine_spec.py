"""The one engine spec: which engine a stage uses and what it reads, in the core so that settings
(`JEX_ENGINE__*`), command-line flags, the campaign form, `--spec` files and the engine factory all
map to the same record (`engine/factory.py: make_engine(spec)`).

`RenderSpec` holds every setting that changes what the engine reads besides the row itself; its
digest is part of the engine fingerprint (`EngineFingerprint`, `engine_identity.py`), so of every
engine stage key. Both records refuse unknown keys, so a misspelt key in a `--spec` file is an error, not ignored.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jex.fileio import sha256_json

EngineKind = Literal["hf", "hf-batched", "vllm", "vllm-control", "openai"]
"""`hf`: the batch-invariant reference; `hf-batched`: padded batches; `vllm`: batch-invariant vLLM (the
audit profile); `vllm-control`: vLLM without batch invariance (a bake-off's control arm); `openai`: a model
served behind an OpenAI-compatible API (`engine/openai_engine.py`), whose batch invariance cannot be proven."""
ENGINE_KINDS: tuple[EngineKind, ...] = ("hf", "hf-batched", "vllm", "vllm-control", "openai")
SERVED_PREFIX = "openai:"
"""`--model openai:NAME[@BASE_URL]`: the model NAME served at BASE_URL (else the engine's `base_url`)."""
EngineProfile = Literal["audit", "audit-ngram"]
CudagraphMode = Literal["FULL_DECODE_ONLY", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "NONE"]
"""vLLM's CUDA-graph modes (`compilation_config.cudagraph_mode`)."""
AUDITED_CUDAGRAPH_MODES: tuple[CudagraphMode | None, ...] = (None, "FULL_DECODE_ONLY")
"""The modes measured batch invariant (vLLM 0.22.1 on an H200): vLLM's default (None) and the seeds'
FULL_DECODE_ONLY. The audit profile refuses the others (`engine/vllm_engine.py`)."""

RENDERER_VERSION = "jex-render/2"

QUESTION_TEMPLATE = "{prompt}\n\n{options}\n\nAnswer with the letter of the correct option."
REASON_TEMPLATE = ("{prompt}\n\n{options}\n\nThink step by step in a few short sentences, then give the "
                   "letter of the correct option.")
OPTION_FORMAT = "{label}. {option}"
ANSWER_SLOT = "Answer:"
AFTER_THOUGHT = "\nSo the correct option is"  # re-read slot after a rationale

_PLACEHOLDERS = {"question_template": {"prompt", "options"}, "reason_template": {"prompt", "options"},
                 "option_format": {"label", "option"}}
_OPTIONAL = {"question_template": {"options"}}
"""A question template may leave the option block out: for rows whose prompt already lists the choices."""


def _fields(template: str) -> set[str]:
    return {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}


EMBEDDED_MODEL = "embedded"
"""The embedded SmolLM2's name where a model is named (`--model embedded`, `jex runs`); the spec holds None."""


class RenderSpec(BaseModel):
    """What the engine reads, besides the row itself. Part of every engine stage's cache key."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    question_template: str = Field(QUESTION_TEMPLATE, description="Fast-pass user turn; {prompt} and {options} "
                                                                  "({options} may be left out for rows whose "
                                                                  "prompt already lists the choices)")
    reason_template: str = Field(REASON_TEMPLATE, description="Reasoning user turn; {prompt} and {options}")
    option_format: str = Field(OPTION_FORMAT, description="One option line; {label} and {option}")
    answer_slot: str = Field(ANSWER_SLOT, description="Text after the assistant turn opens; the label is read next")
    after_thought: str = Field(AFTER_THOUGHT, description="Appended to a rationale before the options are re-read")
    system_prompt: str | None = Field(None, description="System turn (plain text before the question without a "
                                                        "chat template)")
    chat_template: str = Field("auto", description="auto (the model's, plain text if it has none; none for "
                                                   "verbatim catalogs, as lm-eval) | model (the model's "
                                                   "always, verbatim catalogs too) | none | the Jinja text")
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
        if got != want and not (want - _OPTIONAL.get(info.field_name, set()) <= got <= want):
            raise ValueError(f"needs exactly the placeholders {sorted(want)}, found {sorted(got)}")
        return value

    def digest(self) -> dict[str, str]:
        """Version plus the sha256 of every setting; equal specs give equal digests (part of the engine
        fingerprint, so of every engine stage key)."""
        doc = self.model_dump(mode="json")
        if doc["option_order_seed"] is None:  # added later: absent at its default, so older keys stay valid
            del doc["option_order_seed"]
        return {"version": RENDERER_VERSION, "sha256": sha256_json(doc)}


HF_BATCH = 8
"""Requests per call of the HF engines (the batch-invariant `hf` reads one at a time whatever it is given)."""
VLLM_MAX_NUM_SEQS = 512
"""vLLM's sequences per scheduler step unless the spec says otherwise: enough to keep an H200 busy on
one-token readouts (measured beside lm_eval at 512, 0 argmax differences over 13,000 rows)."""
VLLM_BATCHED_TOKENS = 8192
"""vLLM's own tokens per scheduler step when `max_num_batched_tokens` is empty: what the memory estimate
(`engine/memory.py`) sizes one step's activations by."""
BAKEOFF_MAX_NUM_SEQS = 32
"""The bake-off's `max_num_seqs` unless its job says otherwise: the top rung of its default ladder."""


@dataclass(frozen=True)
class Knob:
    """A `VLLMSettings` field's mark: `keyed` when it changes the numbers vLLM computes, so belongs in the
    engine fingerprint (`engine/fingerprint.py`, every engine stage key); the others change only speed or memory."""

    keyed: bool


KEYED, UNKEYED = Knob(keyed=True), Knob(keyed=False)


class VLLMSettings(BaseModel):
    """Every vLLM knob, declared once: its one default, its description (the `jex run` flag's help and the
    campaign form's text) and its mark (`Knob`: keyed or not). `EngineSpec` carries them flat (its keys,
    `JEX_ENGINE__*` variables and form unchanged; `EngineSpec.vllm` is this record), the vLLM profile checks
    them, `engine/factory.py` (`vllm_args`) hands them to vLLM: a new knob is one field here and one line there."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_num_seqs: Annotated[int | None, KEYED] = Field(
        None, ge=1, description=f"vLLM: sequences per scheduler step; empty = {VLLM_MAX_NUM_SEQS}")
    max_num_batched_tokens: Annotated[int | None, UNKEYED] = Field(
        None, ge=16, description="vLLM: tokens per scheduler step; empty = vLLM's default")
    gpu_memory_utilization: Annotated[float, UNKEYED] = Field(0.30, gt=0, le=0.95,
                                                              description="vLLM: share of GPU memory")
    kv_cache_memory_gib: Annotated[float | None, UNKEYED] = Field(
        None, gt=0, description="vLLM: KV cache size, fixed instead of profiled; engines with it start together "
                                "on one GPU")
    max_model_len: Annotated[int | None, KEYED] = Field(None, ge=16,
                                                        description="vLLM: context limit; empty = the model's")
    cudagraph_mode: Annotated[CudagraphMode | None, KEYED] = Field(
        None, description="vLLM: CUDA-graph mode; empty = vLLM's default. The audit profile allows the default "
                          "and FULL_DECODE_ONLY (the seeds' setting), both measured batch invariant")
    tensor_parallel_size: Annotated[int, KEYED] = Field(
        1, ge=1, description="vLLM: GPUs one engine spans (tensor parallel); above 1 the audit profile runs only "
                             "where a settings audit proves it batch invariant, and gpus_per_machine must be a "
                             "multiple of it")

    @classmethod
    def knobs(cls) -> tuple[str, ...]:
        """The vLLM knobs' names, in declaration order."""
        return tuple(VLLMSettings.model_fields)

    @classmethod
    def keyed_knobs(cls) -> tuple[str, ...]:
        """The knobs that change the numbers (marked `KEYED`): the engine fingerprint's vLLM fields."""
        return tuple(name for name, f in VLLMSettings.model_fields.items()
                     if any(isinstance(m, Knob) and m.keyed for m in f.metadata))

    def scheduler_seqs(self) -> int:
        """vLLM's `max_num_seqs`: the field, else VLLM_MAX_NUM_SEQS."""
        return self.max_num_seqs or VLLM_MAX_NUM_SEQS

    def scheduler_tokens(self) -> int:
        """vLLM's `max_num_batched_tokens`: the field, else vLLM's own (VLLM_BATCHED_TOKENS)."""
        return self.max_num_batched_tokens or VLLM_BATCHED_TOKENS

    def keyed(self) -> dict[str, Any]:
        """The keyed knobs as the engine runs them (an empty `max_num_seqs`: VLLM_MAX_NUM_SEQS; one GPU's
        `tensor_parallel_size` as None, so it stays out of the keys written before it was a knob)."""
        return {**{name: getattr(self, name) for name in self.keyed_knobs()}, "max_num_seqs": self.scheduler_seqs(),
                "tensor_parallel_size": None if self.tensor_parallel_size == 1 else self.tensor_parallel_size}

    @property
    def vllm(self) -> VLLMSettings:
        """The vLLM settings alone (on an `EngineSpec`: its vLLM knobs as their own record)."""
        return VLLMSettings(**{name: getattr(self, name) for name in VLLMSettings.model_fields})


class ServedSettings(BaseModel):
    """How jex talks to a served model (`kind = "openai"`), declared once as the vLLM knobs are: each field's
    default, description (flag help, form text) and mark (`KEYED`: part of the engine's identity, as its
    `scheme://host:port`). The API key is never here: it is a secret of the settings (`JEX_ENGINE__API_KEY`,
    or the variable `api_key_env` names), never logged or written."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    base_url: Annotated[str | None, KEYED] = Field(
        None, description="openai: the server's OpenAI-compatible base URL (http://HOST:PORT/v1); its "
                          "scheme://host:port is part of the engine's identity")
    api_key_env: Annotated[str | None, UNKEYED] = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="openai: the environment variable holding the API key; empty = JEX_ENGINE__API_KEY")
    max_concurrency: Annotated[int, UNKEYED] = Field(8, ge=1, le=1024,
                                                     description="openai: requests in flight at once")
    max_retries: Annotated[int, UNKEYED] = Field(
        4, ge=0, le=20, description="openai: retries of a request on 429, 5xx, a timeout or a lost connection "
                                    "(the openai client's own, with exponential backoff)")
    request_timeout_s: Annotated[float, UNKEYED] = Field(600.0, gt=0, description="openai: seconds one request "
                                                                                    "may take")
    price_input_per_mtok: Annotated[float | None, UNKEYED] = Field(
        None, ge=0, description="openai: $ per million prompt tokens; with it the report shows the cost")
    price_output_per_mtok: Annotated[float | None, UNKEYED] = Field(
        None, ge=0, description="openai: $ per million completion tokens")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        from urllib.parse import urlsplit

        if not url:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL, e.g. http://127.0.0.1:8000/v1")
        if parts.username or parts.password:
            raise ValueError("the URL holds credentials: give the key in JEX_ENGINE__API_KEY (or the variable "
                             "api_key_env names), never in the URL")
        return url.rstrip("/")

    @property
    def served(self) -> ServedSettings:
        """The served-model settings alone (on an `EngineSpec`: its own as their record)."""
        return ServedSettings(**{name: getattr(self, name) for name in ServedSettings.model_fields})

    def endpoint(self) -> str | None:
        """`scheme://host:port` of the base URL (the port spelt out): the server's part of the engine identity."""
        from urllib.parse import urlsplit

        if not self.base_url:
            return None
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def knob_field(name: str, default: Any) -> Any:
    """The field of the vLLM knob `name` with a context's own default (a named constant: e.g. the
    bake-off's BAKEOFF_MAX_NUM_SEQS): its constraints and description, less its 'empty = ...' clause."""
    f = VLLMSettings.model_fields[name]
    return Field(default, description=(f.description or "").split("; empty")[0],
                 **{k: getattr(m, k) for m in f.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)})


class _EngineHead(BaseModel):
    """The fields of `EngineSpec` before its vLLM knobs (the campaign form shows them in this order)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: EngineKind = Field("hf", description="Engine and profile")
    profile: EngineProfile = Field("audit", description="audit-ngram: n-gram speculative decoding, kept only if "
                                                        "proven exact on this run")
    model: str | None = Field(None, description="Model folder, GGUF file or Hub id org/name[@revision]; empty or "
                                                f"'{EMBEDDED_MODEL}' = the embedded SmolLM2")
    device: str = Field("cpu", description="cpu, cuda, cuda:1 ...")
    batch_size: int | None = Field(None, ge=0, description="Requests per engine call; empty = the engine's: vLLM 0 "
                                                        "(all the stage hands over, a shard, in one call, scheduled "
                                                        f"by vLLM), HF {HF_BATCH}; 0 is for vLLM only")
    dtype: str | None = Field(None, description="Weights dtype; empty = the engine's (hf float32, vllm bfloat16 "
                                                "under the audit profile)")


class EngineSpec(ServedSettings, VLLMSettings, _EngineHead):
    """Which engine a stage uses and how it runs. This is what the campaign form shows under 'engine'.
    Its vLLM knobs are `VLLMSettings`'s fields, flat (`spec.max_num_seqs`; `spec.vllm` is that record), and so
    are a served model's settings (`ServedSettings`, `spec.served`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cache_dir: str = Field(str(Path.home() / ".cache" / "jex"), description="Converted-model and Hub cache")
    render: RenderSpec = Field(RenderSpec(), description="Templates, system prompt, chat template, few-shot count")

    @model_validator(mode="before")
    @classmethod
    def _served_model_name(cls, data: Any) -> Any:
        """`model = "openai:NAME[@BASE_URL]"` names a served model: kind openai, its name, its base URL."""
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, str) and model.startswith(SERVED_PREFIX):
            name, at, url = model.removeprefix(SERVED_PREFIX).partition("@")
            data = {**data, "kind": "openai", "model": name, **({"base_url": url} if at else {})}
        return data

    @field_validator("model")
    @classmethod
    def _embedded_is_none(cls, value: str | None) -> str | None:
        """'embedded' and '' name the embedded model, which the spec (and its identity) holds as None."""
        return None if value in ("", EMBEDDED_MODEL) else value

    @model_validator(mode="after")
    def _profile_fits_kind(self) -> EngineSpec:
        if self.batch_size == 0 and self.kind != "vllm":  # None: the engine's own (`requests_per_call`)
            raise ValueError(f"batch_size 0 (one call per shard) is for the audited vLLM engine, whose results do "
                             f"not depend on the batch; {self.kind!r} needs >= 1")
        if self.profile != "audit" and self.kind not in ("hf", "vllm"):
            raise ValueError(f"profile {self.profile!r} needs an audited engine kind (hf or vllm), not {self.kind!r}")
        if self.cudagraph_mode is not None and not self.kind.startswith("vllm"):
            raise ValueError(f"cudagraph_mode is a vLLM setting; engine {self.kind!r} has no CUDA graphs")
        if self.tensor_parallel_size > 1 and not self.kind.startswith("vllm"):
            raise ValueError(f"tensor_parallel_size is a vLLM setting; engine {self.kind!r} runs on one device")
        if self.kind == "openai" and not self.base_url:
            raise ValueError("the openai engine needs base_url (--base-url http://HOST:PORT/v1, or "
                             "--model openai:NAME@URL)")
        if self.kind == "openai" and self.render.chat_template not in ("auto", "none", "model"):
            raise ValueError("a served model's chat template is the server's: chat_template model (its "
                             "/v1/chat/completions), auto or none (plain text through /v1/completions)")
        return self

    def is_served(self) -> bool:
        """A model behind an OpenAI-compatible server: no weights here, no batch invariance to prove."""
        return self.kind == "openai"

    def model_name(self) -> str:
        """The model as `jex runs`, the ledger and comparisons name it (`openai:NAME` for a served one)."""
        return f"{SERVED_PREFIX}{self.model or 'served'}" if self.is_served() else self.model or EMBEDDED_MODEL

    def requests_per_call(self) -> int:
        """Requests the engine hands its backend per call: `batch_size`, else the engine's own (the audited
        vLLM engine: 0, a whole shard to vLLM's scheduler; the others: HF_BATCH)."""
        if self.batch_size is not None:
            return self.batch_size
        return 0 if self.kind == "vllm" else HF_BATCH

    def on_gpu(self) -> bool:
        return self.device.startswith("cuda") and not self.is_served()

    def starts_alone(self) -> bool:
        """Whether this engine's start must not overlap another's on the machine: vLLM sizes its KV
        cache by profiling the GPU's free memory, which an engine starting beside it distorts (measured:
        two starting together fail), unless the size is fixed (`kv_cache_memory_gib`)."""
        return self.kind.startswith("vllm") and self.kv_cache_memory_gib is None

    def audited_base(self) -> EngineSpec:
        """The same engine under the plain audit profile (what a speculative profile is proven against)."""
        return self.model_copy(update={"profile": "audit"})

    def loaded_key(self) -> str:
        """Engines are shared by every spec that differs only in what it renders."""
        return self.model_copy(update={"render": RenderSpec()}).model_dump_json()


def closest_name(name: str, valid: list[str] | tuple[str, ...]) -> str | None:
    """The valid name closest to a misspelt one (None when nothing is close)."""
    import difflib

    found = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return found[0] if found else None
