"""The production engine: offline vLLM under the audit profile (batch-invariant).

The audit profile is the recipe under which vLLM's answers were measured not to depend on batch
size, request order or shard count: `VLLM_BATCH_INVARIANT=1`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
the TRITON_ATTN backend, prefix caching off, no speculative decoding, bf16
weights and KV cache, compiled with CUDA graphs (never eager: with `enforce_eager=True` the flag
left 1,889 of 3,072 greedy tokens differing between batch 1 and 32 on an H200 with vLLM 0.22.1).
A profile that breaks any of these is refused unless it is asked for by a non-audit name. Tensor parallel
above 1 (`VLLMSettings.tensor_parallel_size`) is not the profile's to refuse: a campaign runs it only where a
settings audit proved it batch invariant (`flows/machines/audit.py`, `tasks/campaign_spec.py`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from jex.engine.base import ContinuationPlan, TokenizedEngine, continuation_readout, package_version
from jex.engine.effective import asked_problems, vllm_asked, vllm_effective
from jex.engine.factory import vllm_args
from jex.engine.models import model_config, weights_sha256
from jex.engine.shape_link import served_by_shape
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
from jex.engine_identity import EffectiveSettings
from jex.engine_spec import AUDITED_CUDAGRAPH_MODES, VLLMSettings
from jex.provenance import ProvenanceBlock

AUDIT = "audit"
VLLM_PIN = "0.22.1"
"""The vLLM release the audit profile was verified on (the `gpu` extra pins it; workers install it)."""
NON_AUDITED_NAMES = ("control", "non-audited")
SpeculativeConfig = dict[str, str | int]
"""vLLM's `speculative_config`: the method and its integer settings."""
NGRAM: SpeculativeConfig = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                            "prompt_lookup_min": 2}
SPECULATIVE_PROFILES: dict[str, SpeculativeConfig] = {"audit-ngram": NGRAM}
"""Audit profiles plus one speculative method each: allowed only with an exactness proof on the same
run (every sampled rationale token-identical to the audited base engine's; tasks/capture/spec_proof.py)."""


@dataclass(frozen=True)
class VLLMProfile:
    """Engine settings. `name="audit"` is validated; other names must be one of NON_AUDITED_NAMES. The vLLM
    knobs a spec sets are `settings` (`jex.engine_spec.VLLMSettings`, their one declaration and defaults),
    checked here; the rest is the profile's own: what the audit fixes."""

    name: str = AUDIT
    batch_invariant: bool = True
    attention_backend: str = "TRITON_ATTN"
    enable_prefix_caching: bool = False
    speculative_config: dict[str, Any] | None = None
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"  # = the model dtype (bf16)
    enforce_eager: bool = False
    settings: VLLMSettings = field(default_factory=VLLMSettings)
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, **given: Any) -> VLLMProfile:
        """The profile of `given` keywords, the vLLM knobs among them (`max_num_seqs=...`) into `settings`."""
        knobs = {k: given.pop(k) for k in VLLMSettings.knobs() if k in given}
        return cls(settings=VLLMSettings(**knobs), **given)

    def violations(self, model: Path) -> list[str]:
        out = []
        if not self.batch_invariant:
            out.append("VLLM_BATCH_INVARIANT must be 1")
        if self.attention_backend != "TRITON_ATTN":
            out.append(f"attention_backend={self.attention_backend}: the audited backend is TRITON_ATTN")
        if self.enable_prefix_caching:
            out.append("prefix caching on: cached prefixes make log-probs depend on request order")
        if self.speculative_config:
            out.append("speculative decoding is not part of the audited path")
        if self.dtype != "bfloat16" or self.kv_cache_dtype not in ("auto", "bfloat16"):
            out.append(f"dtype={self.dtype}, kv_cache_dtype={self.kv_cache_dtype}: the audit uses bf16 for both")
        if self.enforce_eager:
            out.append("enforce_eager=True: eager mode is NOT batch invariant (measured: 1,889 of 3,072 greedy "
                       "tokens differed between batch 1 and 32 on the H200, vLLM 0.22.1)")
        if self.settings.cudagraph_mode not in AUDITED_CUDAGRAPH_MODES:
            out.append(f"cudagraph_mode={self.settings.cudagraph_mode}: only the default and FULL_DECODE_ONLY were "
                       "measured invariant")
        if model.suffix == ".gguf" or (model.is_dir() and any(model.glob("*.gguf"))):
            out.append("a GGUF-quantised model: vLLM's GGUF kernels switch kernels by row count and are not "
                       "batch invariant; serve a dequantised bf16 folder (engine.models.convert_gguf)")
        return out

    def check(self, model: Path) -> None:
        problems = self.violations(model)
        if self.name in SPECULATIVE_PROFILES:
            want = SPECULATIVE_PROFILES[self.name]
            if (self.speculative_config or {}).get("method") != want["method"]:
                raise EngineDeadError(f"profile {self.name!r} speculates by {want['method']!r}; got "
                                      f"speculative_config={self.speculative_config!r}")
            problems = [p for p in problems if not p.startswith("speculative decoding")]
            if problems:
                raise EngineDeadError(f"profile {self.name!r} keeps every other audit setting; it refuses: "
                                      + "; ".join(problems))
            return
        if self.name == AUDIT and problems:
            raise EngineDeadError("the audit profile refuses these settings: " + "; ".join(problems) +
                                  f". Ask for a non-audited profile by name ({', '.join(NON_AUDITED_NAMES)}) "
                                  "to run them anyway.")
        if self.name != AUDIT and self.name not in NON_AUDITED_NAMES:
            raise EngineDeadError(f"unknown profile name {self.name!r}: use '{AUDIT}', one of "
                                  f"{tuple(SPECULATIVE_PROFILES)} or one of {NON_AUDITED_NAMES}")

    def record(self) -> dict[str, Any]:
        """The profile as provenance records it: one flat table, the vLLM knobs beside the profile's own."""
        own = {k: v for k, v in asdict(self).items() if k != "settings"}
        return {**own, **self.settings.model_dump(mode="json")}

    def environment(self) -> dict[str, str]:
        return {"VLLM_BATCH_INVARIANT": "1" if self.batch_invariant else "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def import_vllm(profile: VLLMProfile) -> Any:
    """vLLM's module, imported under the profile's process-wide environment (refused when this process
    already imported it under another). Importing takes tens of seconds: a machine's engine host does
    it before waiting for its turn to start an engine."""
    env = profile.environment()
    if "vllm" in sys.modules and any(os.environ.get(k) != v for k, v in env.items()):
        raise EngineDeadError(f"vLLM was already imported in this process with other settings than {env}; "
                              "batch invariance is process-wide: start a new process for this profile")
    os.environ.update(env)
    try:
        import vllm
    except ImportError as e:
        raise EngineDeadError(f"vLLM is not installed (pip install 'jex[gpu]'): {e}") from e
    return vllm


def inspect_here(vllm: Any, model: Path) -> None:
    """Let vLLM inspect the model's architecture in this process. vLLM inspects an architecture it holds no
    record of (`VLLM_CACHE_ROOT/modelinfos`) in a fresh Python process that imports torch and vLLM again, where
    this process has both imported already. Registering the in-tree class itself (`ModelRegistry.register_model`,
    vLLM's API for a model class) makes vLLM inspect it here: a start took 47.5 s instead of 81.9 s on the H100
    (`bench/gpu_start.py`). Only saves time: anything unexpected leaves vLLM's own path."""
    if not (model / "config.json").is_file():
        return
    try:
        config = model_config(model)
        registry = vllm.ModelRegistry
        for arch in config.get("architectures") or []:
            entry = registry.models.get(arch)
            module, name = getattr(entry, "module_name", None), getattr(entry, "class_name", None)
            if module and name and str(module).startswith("vllm.model_executor.models."):
                registry.register_model(arch, getattr(importlib.import_module(module), name))
    except Exception as e:  # noqa: BLE001 - vLLM's inspection in its own process still works
        print(f"vLLM inspects {model.name}'s architecture in a process of its own ({type(e).__name__}: {e})",
              flush=True)


class VLLMEngine(TokenizedEngine):
    name = "vllm"
    continuation_reserve = 1  # vLLM must sample one token after the scored prompt
    feeds_last_token = True  # a continuation's log-probs are the prompt log-probs of context + continuation

    def __init__(self, model: str | Path, profile: VLLMProfile | None = None, *, batch_size: int = 32,
                 shape_links: Path | None = None):
        """`shape_links`: the folder of the links vLLM is given the model through, one per architecture
        shape (`engine/shape_link.py`: a fine-tune then starts from its base's compile cache); None: the
        model's own path."""
        self.profile = profile or VLLMProfile()
        self.path = Path(model)
        self.profile.check(self.path)
        vllm = import_vllm(self.profile)
        LLM, SamplingParams = vllm.LLM, vllm.SamplingParams
        self.vllm, self.SamplingParams = vllm, SamplingParams
        kwargs: dict[str, Any] = dict(
            dtype=self.profile.dtype,
            enable_prefix_caching=self.profile.enable_prefix_caching, attention_backend=self.profile.attention_backend,
            seed=self.profile.seed, enforce_eager=self.profile.enforce_eager,
            kv_cache_dtype=self.profile.kv_cache_dtype, **vllm_args(self.profile.settings), **self.profile.extra)
        if self.profile.speculative_config:
            kwargs["speculative_config"] = self.profile.speculative_config
        if self.profile.settings.tensor_parallel_size == 1:  # over several GPUs vLLM starts worker processes
            inspect_here(vllm, self.path)
        # the weights' sha256 (seconds per GB on a first start) is read beside the engine start, not after it:
        # hashlib and file reads release the GIL, and the reads leave the files in the page cache vLLM loads from
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="jex-weights-sha256") as hashing:
            weights = hashing.submit(weights_sha256, self.path)
            with served_by_shape(self.path, shape_links) if shape_links else nullcontext(self.path) as served:
                try:
                    self.llm = LLM(model=str(served), **kwargs)
                except Exception as e:  # noqa: BLE001 - anything at start-up is fatal for this engine
                    raise EngineDeadError(f"vLLM could not start {served} with {kwargs}: {e}") from e
            self.weights_sha256 = weights.result()
        self.effective = vllm_effective(self.llm)
        if self.profile.name == AUDIT and (problems := asked_problems(vllm_asked(self.profile), self.effective)):
            raise EngineDeadError("vLLM did not apply the audit profile: " + "; ".join(problems))
        self.tokenizer = self.llm.get_tokenizer()
        config = getattr(self.llm.llm_engine, "vllm_config", None)
        model_config = getattr(config, "model_config", None) or getattr(self.llm.llm_engine, "model_config", None)
        self.max_context = int(model_config.max_model_len) if model_config is not None else 8192
        self.batch_size = batch_size
        self.has_token_ids_api = "logprob_token_ids" in getattr(SamplingParams, "__struct_fields__", ()) or \
            "logprob_token_ids" in getattr(SamplingParams, "__annotations__", {})
        self.calls = {"readout": 0, "generate": 0}

    def tokenizer_copy(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def _run(self, prompts: list[list[int]], params: Any) -> list[Any]:
        """Submit in chunks of `batch_size` (the batch shape the caller asked for), or all in one
        `generate` when it is 0: vLLM then batches under max_num_seqs / max_num_batched_tokens, and
        the audit profile makes every result independent of that batching. `params`: one `SamplingParams`
        for every prompt, or a list of one per prompt."""
        out: list[Any] = []
        step = self.batch_size or max(1, len(prompts))
        for start in range(0, len(prompts), step):
            chunk = [{"prompt_token_ids": ids} for ids in prompts[start:start + step]]
            out += self.llm.generate(chunk, params[start:start + step] if isinstance(params, list) else params,
                                     use_tqdm=False)
        return out

    def readout(self, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT) -> list[Readout]:
        self.calls["readout"] += 1
        if mode is ReadoutMode.OPTION_CONTINUATION:
            return self._continuation(requests)
        results, todo = self.plan_label_slot(requests)
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, ids, labels in todo:
            groups.setdefault(tuple(labels), []).append((i, ids))
        for label_ids, items in groups.items():
            if self.has_token_ids_api:
                params = self.SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=list(label_ids))
            else:
                params = self.SamplingParams(temperature=0, max_tokens=1, logprobs=20)
            for (i, _), res in zip(items, self._run([ids for _, ids in items], params), strict=True):
                lp = res.outputs[0].logprobs[0]
                missing = [t for t in label_ids if t not in lp]
                if missing:
                    results[i] = Readout(requests[i].run_id, None, None, None, ReadoutMode.LABEL_SLOT,
                                         RefusalKind.LABEL_TOKEN.refusal(f"ids {missing} not among the returned "
                                                                         "top-k log-probs"))
                    continue
                raw = tuple(float(lp[t].logprob) for t in label_ids)
                mass = sum(2.718281828459045 ** x for x in raw)
                results[i] = Readout(requests[i].run_id, renormalise(raw), raw, mass, ReadoutMode.LABEL_SLOT)
        return [results[i] for i in range(len(requests))]

    def _continuation(self, requests: Sequence[ReadoutRequest]) -> list[Readout]:
        """lm-eval's `loglikelihood` of each option (`plan_continuation`): options of one token each are
        read at the shared context's next position, as the label slot reads them (greedy: the sampled
        token); longer ones from the prompt log-probs of context + continuation (greedy: rank 1 at each
        of the continuation's positions)."""
        results, todo = self.plan_continuation(requests)
        shared = [p for p in todo if p.single_token]
        by_tokens: dict[tuple[int, ...], list[ContinuationPlan]] = {}
        for p in shared:
            by_tokens.setdefault(tuple(c[0] for c in p.continuations), []).append(p)
        for toks, plans in by_tokens.items():
            params = self.SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=list(toks)) \
                if self.has_token_ids_api else self.SamplingParams(temperature=0, max_tokens=1, logprobs=20)
            for p, res in zip(plans, self._run([p.sequence(0)[:-1] for p in plans], params), strict=True):
                lp, sampled = res.outputs[0].logprobs[0], int(res.outputs[0].token_ids[0])
                if any(t not in lp for t in toks):
                    results[p.index] = Readout(requests[p.index].run_id, None, None, None,
                                               ReadoutMode.OPTION_CONTINUATION,
                                               "continuation: a token not among the returned top-k log-probs")
                    continue
                results[p.index] = continuation_readout(requests[p.index].run_id,
                                                        [float(lp[t].logprob) for t in toks],
                                                        [t == sampled for t in toks])
        multi = [(p, k) for p in todo if not p.single_token for k in range(len(p.continuations))]
        params = self.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        outs = self._run([p.sequence(k) for p, k in multi], params) if multi else []
        scores: dict[int, list[tuple[float, bool]]] = {}
        for (p, k), res in zip(multi, outs, strict=True):
            seq, plp, n = p.sequence(k), res.prompt_logprobs, len(p.continuations[k])
            picked = [plp[pos][seq[pos]] for pos in range(len(seq) - n, len(seq))]
            scores.setdefault(p.index, []).append((sum(float(e.logprob) for e in picked),
                                                   all(getattr(e, "rank", None) == 1 for e in picked)))
        for i, got in scores.items():
            results[i] = continuation_readout(requests[i].run_id, [x for x, _ in got], [g for _, g in got])
        return [results[i] for i in range(len(requests))]

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        self.calls["generate"] += 1
        out: dict[int, Generation] = {}
        by_params: dict[tuple, list[tuple[int, list[int]]]] = {}
        sampled: list[tuple[int, list[int]]] = []
        for i, (r, ids) in enumerate(zip(requests, self.encode_prompts(requests), strict=True)):
            if len(ids) + r.max_tokens > self.max_context:
                out[i] = Generation(r.run_id, "", (), FinishReason.REFUSED, len(ids))
            elif r.sampling is not None:
                sampled.append((i, ids))
            else:
                by_params.setdefault((r.max_tokens, r.stop, r.ignore_eos), []).append((i, ids))
        for (max_tokens, stop, ignore_eos), items in by_params.items():
            params = self.SamplingParams(temperature=0, max_tokens=max_tokens, stop=list(stop) or None,
                                         ignore_eos=ignore_eos)
            for (i, ids), res in zip(items, self._run([ids for _, ids in items], params), strict=True):
                out[i] = self._generation(requests[i], ids, res)
        if sampled:  # one call, each request with its own seed (vLLM's per-request generator: RANDOM_SEED)
            per_request = [self._sampling_params(requests[i]) for i, _ in sampled]
            for (i, ids), res in zip(sampled, self._run([ids for _, ids in sampled], per_request), strict=True):
                out[i] = self._generation(requests[i], ids, res)
        return [out[i] for i in range(len(requests))]

    def _sampling_params(self, r: GenerateRequest) -> Any:
        """vLLM's `SamplingParams` of a sampled request: its temperature, top_p, top_k (0: all) and seed."""
        s = r.sampling
        assert s is not None
        return self.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                   max_tokens=r.max_tokens, stop=list(r.stop) or None, ignore_eos=r.ignore_eos)

    @staticmethod
    def _generation(r: GenerateRequest, ids: list[int], res: Any) -> Generation:
        o = res.outputs[0]
        text, _ = cut_at_stop(o.text, r.stop)
        reason = FinishReason.LENGTH if o.finish_reason == "length" else FinishReason.STOP
        return Generation(r.run_id, text, tuple(int(t) for t in o.token_ids), reason, len(ids))

    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]:
        """Log-prob and vocabulary rank of each watched token when it is among the top 20 next tokens;
        None beyond (enough for the early-exit gate, which asks for rank 1)."""
        out = []
        for r in requests:
            seq = self.encode(r.prompt) + list(r.continuation)
            if len(seq) + 1 > self.max_context:
                out.append(NextTokenStats(r.run_id, (None,) * len(r.watch), (None,) * len(r.watch),
                                          RefusalKind.CONTEXT.refusal(f"{len(seq)} tokens + 1 > {self.max_context}")))
                continue
            # the top 20 with their vocabulary ranks (measured on the H200: with `logprob_token_ids` vLLM ranks
            # the listed ids among themselves, so every watched token came back rank 1)
            params = self.SamplingParams(temperature=0, max_tokens=1, logprobs=20)
            lp = self._run([seq], params)[0].outputs[0].logprobs[0]
            out.append(NextTokenStats(r.run_id, tuple(float(lp[t].logprob) if t in lp else None for t in r.watch),
                                      tuple(getattr(lp[t], "rank", None) if t in lp else None for t in r.watch)))
        return out

    def effective_settings(self) -> EffectiveSettings:
        return self.effective

    def provenance(self) -> ProvenanceBlock:
        """What fixes the function this engine computes, and what describes the run (paths, hardware)."""
        import torch

        env_names = sorted(k for k in os.environ if k.startswith(("VLLM_", "CUBLAS", "CUDA_VISIBLE")))
        return {"engine": "vllm", "weights_sha256": self.weights_sha256, "profile": self.profile.record(),
                "vllm": package_version("vllm"), "torch": package_version("torch"), "model_path": str(self.path),
                "audited": self.profile.name == AUDIT,
                "environment": {k: os.environ[k] for k in env_names}, "transformers": package_version("transformers"),
                "triton": package_version("triton"), "cuda": torch.version.cuda,
                "driver": _driver_version(),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "batch_size": self.batch_size, "jex": package_version("jex"),
                "readout_api": "logprob_token_ids" if self.has_token_ids_api else "top-k logprobs (checked)",
                "effective": self.effective.model_dump(mode="json"),
                "vllm_config": str(getattr(self.llm.llm_engine, "vllm_config", ""))[:4000]}


def _driver_version() -> str | None:
    try:
        import subprocess

        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, ValueError):
        return None
