"""The reference engine: transformers on CPU or GPU, greedy, deterministic.

Batched calls left-pad and pass `position_ids = cumsum(attention_mask) - 1`, which keeps results
within ~1e-6 of batch 1 but not bit-identical (padding changes the reduction shapes). With
`batch_invariant=True` every request runs in its own forward pass (method "per-request"), so the
result cannot depend on batch size, request order or shard count.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jex.engine.base import TokenizedEngine, package_version
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
    cut_at_stop,
    renormalise,
)
from jex.engine.vllm_engine import SpeculativeConfig
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

    @property
    def batch_size(self) -> int:
        """Rows per forward pass: always 1 in batch-invariant mode, whatever was requested."""
        return 1 if self.batch_invariant else self.requested_batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self.requested_batch_size = int(value)

    # --- forward ---------------------------------------------------------------------------------
    def _forward_logprobs(self, seqs: list[list[int]], last_only: bool) -> list[Any]:
        """log-softmax (float64) for each sequence: of the last position, or of every position."""
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
            with torch.inference_mode():
                kw = {"logits_to_keep": 1} if last_only else {}
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    position_ids=pos.to(self.device), **kw).logits.double()
            lp = torch.log_softmax(logits, dim=-1).cpu()
            for i, s in enumerate(batch):
                out.append(lp[i, -1] if last_only else lp[i, width - len(s):])
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
        results, todo = self.plan_continuation(requests)
        seqs: list[list[int]] = []
        spans: list[tuple[int, list[tuple[int, int]]]] = []
        for i, ctx, opts in todo:
            spans.append((i, [(len(seqs) + k, len(o)) for k, o in enumerate(opts)]))
            seqs += [ctx + o for o in opts]
        lps = self._forward_logprobs(seqs, last_only=False)
        for i, parts in spans:
            raw = []
            for seq_index, n_opt in parts:
                seq, lp = seqs[seq_index], lps[seq_index]
                # token t at position p is predicted by the distribution at p-1
                raw.append(sum(float(lp[p - 1, seq[p]]) for p in range(len(seq) - n_opt, len(seq))))
            raw_t = tuple(raw)
            results[i] = Readout(requests[i].run_id, renormalise(raw_t), raw_t, None,
                                 ReadoutMode.OPTION_CONTINUATION)
        return [results[i] for i in range(len(requests))]

    # --- generation ------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Generation]:
        torch = self.torch
        self.calls["generate"] += 1
        out: dict[int, Generation] = {}
        todo = []
        for i, (r, ids) in enumerate(zip(requests, self.encode_prompts(requests), strict=True)):
            if len(ids) + r.max_tokens > self.max_context:
                out[i] = Generation(r.run_id, "", (), FinishReason.REFUSED, len(ids))
            else:
                todo.append((i, ids))
        for start in range(0, len(todo), self.batch_size):
            batch = todo[start:start + self.batch_size]
            width = max(len(ids) for _, ids in batch)
            ids_t = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for k, (_, ids) in enumerate(batch):
                ids_t[k, width - len(ids):] = torch.tensor(ids)
                mask[k, width - len(ids):] = 1
            max_new = max(requests[i].max_tokens for i, _ in batch)
            stops = sorted({s for i, _ in batch for s in requests[i].stop})
            with torch.inference_mode():
                gen = self.model.generate(
                    input_ids=ids_t.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
                    max_new_tokens=max_new, pad_token_id=self.pad_id,
                    min_new_tokens=max_new if all(requests[i].ignore_eos for i, _ in batch) else None,
                    stop_strings=stops or None,
                    tokenizer=self.tokenizer if stops else None, temperature=None, top_p=None, top_k=None,
                    **(self.speculative if len(batch) == 1 else {}))
            for k, (i, ids) in enumerate(batch):
                r = requests[i]
                new = gen[k, width:].tolist()[: r.max_tokens]
                # drop padding after this row finished (other rows kept the batch going)
                for cut, t in enumerate(new):
                    if t in self.eos_ids:
                        new = new[: cut + 1]
                        break
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                text, stopped = cut_at_stop(text, r.stop)
                finished = stopped or (bool(new) and new[-1] in self.eos_ids)
                if stopped:  # keep the tokens up to the one that completed the stop string
                    new = self._trim_to_stop(new, r.stop)
                out[i] = Generation(r.run_id, text, tuple(new), FinishReason.STOP if finished else
                                    FinishReason.LENGTH, len(ids))
        return [out[i] for i in range(len(requests))]

    def next_token(self, requests: Sequence[NextTokenRequest]) -> list[NextTokenStats]:
        """Exact log-prob and rank (1 = argmax) of each watched token, one forward per request."""
        seqs = [self.encode(r.prompt) + list(r.continuation) for r in requests]
        out = []
        for r, seq in zip(requests, seqs, strict=True):
            if len(seq) + 1 > self.max_context:
                out.append(NextTokenStats(r.run_id, (None,) * len(r.watch), (None,) * len(r.watch),
                                          f"context: {len(seq)} tokens + 1 > {self.max_context}"))
                continue
            lp = self._forward_logprobs([seq], last_only=True)[0]
            out.append(NextTokenStats(r.run_id, tuple(float(lp[t]) for t in r.watch),
                                      tuple(int((lp > lp[t]).sum()) + 1 for t in r.watch)))
        return out

    def _trim_to_stop(self, tokens: list[int], stop: Sequence[str]) -> list[int]:
        for n in range(1, len(tokens) + 1):
            if cut_at_stop(self.tokenizer.decode(tokens[:n], skip_special_tokens=True), stop)[1]:
                return tokens[:n]
        return tokens

    # --- provenance ------------------------------------------------------------------------------
    def provenance(self) -> ProvenanceBlock:
        """What fixes the function this engine computes, and what describes the run (paths, hardware)."""
        torch = self.torch
        gpu = torch.cuda.get_device_name(0) if self.device.startswith("cuda") else None
        return {"engine": "hf", "weights_sha256": self.weights_sha256, "dtype": self.dtype,
                **({"speculative": self.speculative} if self.speculative else {}),
                "device_type": self.device.split(":")[0], "batch_invariant": self.batch_invariant,
                "batch_size": self.batch_size, "torch": package_version("torch"),
                "transformers": package_version("transformers"), "model_path": str(self.path),
                "batch_invariant_method": "per-request forward (batch 1)" if self.batch_invariant else None,
                "requested_batch_size": self.requested_batch_size, "max_context": self.max_context,
                "threads": torch.get_num_threads(), "cuda": torch.version.cuda, "gpu": gpu,
                "machine": platform.machine(), "jex": package_version("jex")}


def _prompt_lookup(speculative: SpeculativeConfig | None) -> dict[str, int]:
    """vLLM's n-gram speculative config as transformers' prompt-lookup decoding arguments."""
    if not speculative:
        return {}
    if speculative.get("method") != "ngram":
        raise EngineDeadError(f"the HF engine speculates only by n-gram prompt lookup, not {speculative!r}")
    return {"prompt_lookup_num_tokens": int(speculative.get("num_speculative_tokens", 4)),
            "max_matching_ngram_size": int(speculative.get("prompt_lookup_max", 4))}
