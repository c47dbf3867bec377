"""The reference engine: transformers on CPU or GPU, greedy or sampled by each request's seed, deterministic.

Batched calls left-pad and pass `position_ids = cumsum(attention_mask) - 1`, which keeps results
within ~1e-6 of batch 1 but not bit-identical (padding changes the reduction shapes). With
`batch_invariant=True` every request runs in its own forward pass (method "per-request"), so the
result cannot depend on batch size, request order or shard count. On CPU, last-position readouts
(the label slot) pack several rows into one forward instead, a prefix they share packed once, each
row's log-probs bit-identical to its own forward (`engine/hf_packed.py`).
Generation on CPU decodes the requests in lock-step with every linear layer at one fixed matrix shape
(`engine/hf_decode.py`): each row's tokens are the same at every batch size and order. A sampled request
draws each token from its own row's float32 logits with its own seeded generator (`engine/sampling.py`), on
either path.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from jex.engine.base import TokenizedEngine, continuation_readout, package_version
from jex.engine.models import resolve_model, weights_sha256
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
    Sampling,
    cut_at_stop,
    renormalise,
)
from jex.engine.vllm_engine import SpeculativeConfig
from jex.engine_identity import EffectiveSettings
from jex.provenance import ProvenanceBlock

DEFAULT_CACHE = Path.home() / ".cache" / "jex"


class HFEngine(TokenizedEngine):
    name = "hf"

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 8, batch_invariant: bool = True, cache_dir: Path = DEFAULT_CACHE,
                 max_context: int | None = None, speculative: SpeculativeConfig | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.source = resolve_model(model, Path(cache_dir))
        self.path = self.source.path
        self.device, self.dtype = device, dtype
        self.batch_invariant = batch_invariant
        self.batch_size = batch_size
        self.speculative = _prompt_lookup(speculative)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path)
            # transformers wraps nn.Module.to with functools.wraps; typeshed's _Wrapped does not bind `self`
            self.model = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=getattr(torch, dtype)).to(device)  # type: ignore[arg-type]
        except (OSError, ValueError) as e:
            raise EngineDeadError(f"cannot load model from {self.path}: {e}") from e
        self.model.eval()
        self.max_context = max_context or int(getattr(self.model.config, "max_position_embeddings", 2048))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else \
            self.tokenizer.eos_token_id
        self.eos_ids = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        self.weights_sha256 = weights_sha256(self.path)
        self.calls = {"readout": 0, "generate": 0}
        self.packs_rows = batch_invariant and device == "cpu"

    @property
    def batch_size(self) -> int:
        """Rows per forward pass: always 1 in batch-invariant mode, whatever was requested."""
        return 1 if self.batch_invariant else self.requested_batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.requested_batch_size = int(value)

    # --- forward ---------------------------------------------------------------------------------
    def _forward_logprobs(self, seqs: list[list[int]], last_only: bool, keep: Sequence[int] | None = None) -> list[Any]:
        """log-softmax (float64) for each sequence: of the last position, of its last `keep[i]` positions
        (the logits of the others are not computed), or of every position."""
        if last_only and self.packs_rows:
            from jex.engine.hf_packed import last_logprobs

            return last_logprobs(self.model, seqs)
        torch = self.torch
        out: list[Any] = []
        for start in range(0, len(seqs), self.batch_size):
            batch = seqs[start:start + self.batch_size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, s in enumerate(batch):  # left padding: every sequence ends at the last column
                ids[i, width - len(s):] = torch.tensor(s)
                mask[i, width - len(s):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            kept = keep[start:start + self.batch_size] if keep is not None else None
            with torch.inference_mode():
                kw = {"logits_to_keep": 1} if last_only else {"logits_to_keep": max(kept)} if kept else {}
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), **kw).logits.double()
            lp = torch.log_softmax(logits, dim=-1).cpu()
            for i, s in enumerate(batch):
                out.append(lp[i, -1] if last_only else lp[i, lp.shape[1] - kept[i]:] if kept else
                           lp[i, width - len(s):])
        return out

    def readout(self, requests: Sequence[ReadoutRequest], mode: ReadoutMode = ReadoutMode.LABEL_SLOT) -> list[Readout]:
        self.calls["readout"] += 1
        if mode is ReadoutMode.LABEL_SLOT:
            return self._label_slot(requests)
        return self._continuation(requests)

    def _label_slot(self, requests: Sequence[ReadoutRequest]) -> list[Readout]:
        results, todo = self.plan_label_slot(requests)
        lps = self._forward_logprobs([ids for _, ids, _ in todo], last_only=True)
        for (i, _, labels), lp in zip(todo, lps, strict=True):
            raw = tuple(float(lp[t]) for t in labels)
            mass = float(self.torch.exp(lp[labels]).sum())
            results[i] = Readout(requests[i].run_id, renormalise(raw), raw, mass, ReadoutMode.LABEL_SLOT)
        return [results[i] for i in range(len(requests))]

    def _continuation(self, requests: Sequence[ReadoutRequest]) -> list[Readout]:
        """lm-eval's `loglikelihood` of each option (`plan_continuation`): options of one token each are
        read from one forward of the shared context, as the label slot reads; longer ones each from a
        forward of context + continuation minus its last token, the logits of the continuation only."""
        results, todo = self.plan_continuation(requests)
        shared = [p for p in todo if p.single_token]
        lasts = self._forward_logprobs([p.sequence(0)[:-1] for p in shared], last_only=True)
        for p, lp in zip(shared, lasts, strict=True):
            toks = [c[0] for c in p.continuations]
            best = int(lp.argmax())
            results[p.index] = continuation_readout(requests[p.index].run_id, [float(lp[t]) for t in toks],
                                                    [t == best for t in toks])
        multi = [(p, k) for p in todo if not p.single_token for k in range(len(p.continuations))]
        lps = self._forward_logprobs([p.sequence(k)[:-1] for p, k in multi], last_only=False,
                                     keep=[len(p.continuations[k]) for p, k in multi])
        scores: dict[int, list[tuple[float, bool]]] = {}
        for (p, k), lp in zip(multi, lps, strict=True):
            cont = p.continuations[k]
            scores.setdefault(p.index, []).append(
                (sum(float(lp[j, t]) for j, t in enumerate(cont)),
                 all(int(lp[j].argmax()) == t for j, t in enumerate(cont))))
        for i, got in scores.items():
            results[i] = continuation_readout(requests[i].run_id, [x for x, _ in got], [g for _, g in got])
        return [results[i] for i in range(len(requests))]

    # --- generation ------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        """Greedy or sampled generations (`GenerateRequest.sampling`). Batch-invariant on CPU: requests decode
        together in lock-step, each row's numbers independent of the others (`engine/hf_decode.py`); elsewhere
        one `model.generate` per batch (of one request when batch-invariant)."""
        self.calls["generate"] += 1
        out: dict[int, Generation] = {}
        todo: list[tuple[int, list[int]]] = []
        for i, (r, ids) in enumerate(zip(requests, self.encode_prompts(requests), strict=True)):
            if len(ids) + r.max_tokens > self.max_context:
                out[i] = Generation(r.run_id, "", (), FinishReason.REFUSED, len(ids))
            else:
                todo.append((i, ids))
        if self.decodes_in_lockstep:
            from jex.engine.hf_decode import DecodeRow, decode_rows

            news = decode_rows(self.model, [DecodeRow(ids, requests[i].max_tokens, requests[i].ignore_eos,
                                                      requests[i].sampling) for i, ids in todo],
                               self.generation_eos,
                               partial(self._row_stopped, [requests[i].stop for i, _ in todo]))
            out.update({i: self._generation(requests[i], ids, new) for (i, ids), new in zip(todo, news, strict=True)})
        else:
            for start in range(0, len(todo), self.batch_size):
                out.update(self._generate_batch(requests, todo[start:start + self.batch_size]))
        return [out[i] for i in range(len(requests))]

    @property
    def decodes_in_lockstep(self) -> bool:
        """Generation goes through `engine/hf_decode.py` (batch-invariant on CPU, a model it supports);
        else through `model.generate`."""
        if "_lockstep_model" not in self.__dict__:
            from jex.engine.hf_decode import row_exact_supported

            self._lockstep_model = row_exact_supported(self.model)
        return self.batch_invariant and self.device == "cpu" and not self.speculative and self._lockstep_model

    @property
    def generation_eos(self) -> set[int]:
        """The tokens that end `model.generate` (its generation config's end-of-sequence ids)."""
        eos = self.model.generation_config.eos_token_id
        return set() if eos is None else {eos} if isinstance(eos, int) else set(eos)

    def _generate_kw(self, stops: Sequence[str]) -> dict[str, Any]:
        return {"do_sample": False, "pad_token_id": self.pad_id, "stop_strings": list(stops) or None,
                "tokenizer": self.tokenizer if stops else None, "temperature": None, "top_p": None, "top_k": None}

    def _generate_batch(self, requests: Sequence[GenerateRequest], batch: list[tuple[int, list[int]]]
                        ) -> dict[int, Generation]:
        """One `model.generate` over a left-padded batch (one request when batch-invariant)."""
        torch = self.torch
        width = max(len(ids) for _, ids in batch)
        ids_t = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for k, (_, ids) in enumerate(batch):
            ids_t[k, width - len(ids):] = torch.tensor(ids)
            mask[k, width - len(ids):] = 1
        max_new = max(requests[i].max_tokens for i, _ in batch)
        stops = sorted({s for i, _ in batch for s in requests[i].stop})
        sampled = _sampled_rows([requests[i].sampling for i, _ in batch])
        with torch.inference_mode():
            gen = self.model.generate(
                input_ids=ids_t.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new,
                min_new_tokens=max_new if all(requests[i].ignore_eos for i, _ in batch) else None,
                **self._generate_kw(stops), **(self.speculative if len(batch) == 1 and not sampled else {}),
                **({"logits_processor": sampled} if sampled else {}))
        return {i: self._generation(requests[i], ids, gen[k, width:].tolist())
                for k, (i, ids) in enumerate(batch)}

    def _generation(self, r: GenerateRequest, ids: list[int], new: list[int]) -> Generation:
        """A request's generation from its new tokens: cut at the first end-of-sequence token (padding of
        a batch follows it) and at a stop string (the tokens up to the one that completed it)."""
        new = new[: r.max_tokens]
        for cut, t in enumerate(new):
            if t in self.eos_ids:
                new = new[: cut + 1]
                break
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        text, stopped = cut_at_stop(text, r.stop)
        finished = stopped or (bool(new) and new[-1] in self.eos_ids)
        if stopped:
            new = self._trim_to_stop(new, r.stop)
        return Generation(r.run_id, text, tuple(new), FinishReason.STOP if finished else FinishReason.LENGTH,
                          len(ids))

    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]:
        """Exact log-prob and rank (1 = argmax) of each watched token, one forward per request."""
        seqs = [self.encode(r.prompt) + list(r.continuation) for r in requests]
        out = []
        for r, seq in zip(requests, seqs, strict=True):
            if len(seq) + 1 > self.max_context:
                out.append(NextTokenStats(r.run_id, (None,) * len(r.watch), (None,) * len(r.watch),
                                          RefusalKind.CONTEXT.refusal(f"{len(seq)} tokens + 1 > {self.max_context}")))
                continue
            lp = self._forward_logprobs([seq], last_only=True)[0]
            out.append(NextTokenStats(r.run_id, tuple(float(lp[t]) for t in r.watch),
                                      tuple(int((lp > lp[t]).sum()) + 1 for t in r.watch)))
        return out

    def _trim_to_stop(self, tokens: list[int], stop: Sequence[str]) -> list[int]:
        for n in range(1, len(tokens) + 1):
            if self._stop_reached(tokens[:n], stop):
                return tokens[:n]
        return tokens

    def _row_stopped(self, stops: Sequence[Sequence[str]], row: int, tokens: list[int]) -> bool:
        """Row `row` of a lock-step group has reached one of its stop strings."""
        return self._stop_reached(tokens, stops[row])

    def _stop_reached(self, tokens: list[int], stop: Sequence[str]) -> bool:
        """The text of these tokens contains one of the stop strings."""
        return bool(stop) and cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), stop)[1]

    # --- provenance ------------------------------------------------------------------------------
    def effective_settings(self) -> EffectiveSettings:
        from jex.engine.effective import hf_effective

        return hf_effective(self.model, batch_invariant=self.batch_invariant)

    def provenance(self) -> ProvenanceBlock:
        """What fixes the function this engine computes, and what describes the run (paths, hardware)."""
        from jex.engine.hf_decode import GEMM_ROWS

        torch = self.torch
        gpu = torch.cuda.get_device_name(0) if self.device.startswith("cuda") else None
        return {"engine": "hf", "weights_sha256": self.weights_sha256, "dtype": self.dtype,
                **({"speculative": self.speculative} if self.speculative else {}),
                "device_type": self.device.split(":")[0], "batch_invariant": self.batch_invariant,
                "batch_size": self.batch_size, "torch": package_version("torch"),
                "transformers": package_version("transformers"), "model_path": str(self.path),
                "batch_invariant_method": "per-request forward (batch 1)"
                                          + ("; label slot: rows packed behind their shared prefix, "
                                             "attention and lm_head per row" if self.packs_rows else "")
                                          + ("; generation: lock-step decoding, linear layers in fixed "
                                             f"{GEMM_ROWS}-row products, attention per row"
                                             if self.decodes_in_lockstep else "") if self.batch_invariant else None,
                "requested_batch_size": self.requested_batch_size, "max_context": self.max_context,
                "threads": torch.get_num_threads(), "cuda": torch.version.cuda, "gpu": gpu,
                "machine": platform.machine(), "jex": package_version("jex")}


def _sampled_rows(samplings: Sequence[Sampling | None]) -> Any:
    """`model.generate`'s logits processors for a batch with sampled rows (None when every row is greedy): each
    sampled row's token drawn by its own `RowSampler` and made the only one left, so the greedy step takes it."""
    if all(s is None for s in samplings):
        return None
    from transformers import LogitsProcessor, LogitsProcessorList

    from jex.engine.sampling import RowSampler

    samplers = [RowSampler(s) if s is not None else None for s in samplings]

    class DrawnPerRow(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            for b, sampler in enumerate(samplers):
                if sampler is not None:
                    token = sampler.pick(scores[b])
                    scores[b] = float("-inf")
                    scores[b, token] = 0.0
            return scores

    return LogitsProcessorList([DrawnPerRow()])


def _prompt_lookup(speculative: SpeculativeConfig | None) -> dict[str, int]:
    """vLLM's n-gram speculative config as transformers' prompt-lookup decoding arguments."""
    if not speculative:
        return {}
    if speculative.get("method") != "ngram":
        raise EngineDeadError(f"the HF engine speculates only by n-gram prompt lookup, not {speculative!r}")
    return {"prompt_lookup_num_tokens": int(speculative.get("num_speculative_tokens", 4)),
            "max_matching_ngram_size": int(speculative.get("prompt_lookup_max", 4))}
