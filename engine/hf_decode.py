"""Greedy decoding of several requests at once whose every number is the batch-1 number (the HF engine's
batch-invariant generation).

The batch-1 path (`model.generate` on one request) decodes one token per forward: every linear layer
is a matrix-vector product (M = 1), which on CPU is memory bound (the 135M model reads its ~0.5 GB of
weights per token). A batched forward would read them once for all rows, but a matrix-matrix product
(M > 1) reduces in another order: its rows differ from the batch-1 ones in the last bits (measured:
every row differs), so its tokens could differ. Here the batch advances in lock-step through the
model, layer by layer, and inside each layer every row gets its own batch-1 kernel call:

- each linear layer runs one M = 1 product per row (`F.linear(x[b:b+1], W)`: the batch-1 kernel), one
  row after the other while the weight matrix is hot in the cache; a large matrix (the vocabulary
  head) in slices of its output rows, each slice read once from memory for all rows (a dot product
  per output: slicing the outputs does not change any of them);
- attention runs per row on the row's own keys and values (`sdpa_attention_forward` on one row,
  without the left padding of the shared cache), with the arguments the batch-1 forward passes;
- the prompt of each request is read by `model.generate` itself, exactly as the batch-1 path does
  (its first token and its key/value cache), and the caches are then joined, left-padded.

Everything else in the forward is element-wise or reduces within a row (RMS norm, rotary embedding,
the MLP's gate), so each row's logits are the batch-1 logits bit for bit; `tests/test_hf_engine.py`
checks the token ids against the batch-1 `generate` across batch sizes. Models outside these
assumptions (a linear layer with a bias, attention other than SDPA) keep the batch-1 path
(`row_exact_supported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch.nn import functional as F

ROWS_ATTENTION = "jex_rows"
SLICE_ELEMENTS = 1 << 21
"""Weight elements (8 MiB in fp32) per slice of a large linear layer: several fit in the L3 cache."""
_PADS: ContextVar[list[int]] = ContextVar("jex_row_pads")


def _rows_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kw: Any) -> tuple[Any, None]:
    """SDPA row by row on each row's unpadded keys and values, with no mask (the batch-1 decode's call)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = [sdpa_attention_forward(module, query[b:b + 1], key[b:b + 1, :, pad:], value[b:b + 1, :, pad:], None,
                                   **kw)[0] for b, pad in enumerate(_PADS.get())]
    return torch.cat(outs), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


def _row_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` with one batch-1 (M = 1) product per row; large weights in slices of output rows."""
    weight = layer.weight
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        return F.linear(x, weight)
    step = max(1, SLICE_ELEMENTS // weight.shape[1])
    parts = [torch.cat([F.linear(rows[b:b + 1], weight[n:n + step]) for b in range(rows.shape[0])])
             for n in range(0, weight.shape[0], step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def row_exact_supported(model: Any) -> bool:
    """The model decodes row-exactly here: SDPA attention and no linear layer with a bias."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return (getattr(model.config, "_attn_implementation", None) == "sdpa" and bool(linears)
            and all(m.bias is None for m in linears) and hasattr(model, "set_attn_implementation"))


@contextlib.contextmanager
def _row_exact(model: Any) -> Iterator[None]:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    impl = model.config._attn_implementation
    _register()
    for m in linears:
        m.forward = _row_linear.__get__(m)  # type: ignore[method-assign]  # this instance only, undone below
    model.set_attn_implementation(ROWS_ATTENTION)
    try:
        yield
    finally:
        for m in linears:
            del m.forward
        model.set_attn_implementation(impl)


def _prefill(model: Any, ids: list[int], generate_kw: dict[str, Any]) -> tuple[Any, int]:
    """The batch-1 path's own first step on one prompt: its key/value cache and first token."""
    t = torch.tensor([ids], dtype=torch.long)
    out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=1,
                         return_dict_in_generate=True, **generate_kw)
    return out.cache, int(out.sequences[0, -1])


def _joined(model: Any, caches: Sequence[Any], lengths: Sequence[int]) -> Any:
    """One cache of all rows, each left-padded with zeros to the longest prompt."""
    from transformers import DynamicCache

    width = max(lengths)
    cache = DynamicCache(config=model.config)
    for li in range(len(caches[0].layers)):
        keys = torch.cat([F.pad(c.layers[li].keys, (0, 0, width - n, 0)) for c, n in zip(caches, lengths, strict=True)])
        values = torch.cat([F.pad(c.layers[li].values, (0, 0, width - n, 0))
                            for c, n in zip(caches, lengths, strict=True)])
        cache.update(keys, values, li)
    return cache


def greedy_rows(model: Any, prompts: Sequence[list[int]], max_tokens: Sequence[int], eos: set[int],
                generate_kw: dict[str, Any]) -> list[list[int]]:
    """The new tokens of each prompt, greedy, up to its end-of-sequence token (kept) or `max_tokens`:
    what `model.generate` gives each prompt alone, computed for all of them in lock-step."""
    with torch.inference_mode():
        firsts = [_prefill(model, ids, generate_kw) for ids in prompts]
        lengths = [len(ids) for ids in prompts]
        cache = _joined(model, [c for c, _ in firsts], lengths)
        new = [[tok] for _, tok in firsts]
        live = [b for b in range(len(prompts)) if new[b][0] not in eos and max_tokens[b] > 1]
        if len(live) < len(prompts):
            _select(cache, live)
        pads = [max(lengths) - n for n in lengths]
        with _row_exact(model):
            while live:
                token = _PADS.set([pads[b] for b in live])
                try:
                    logits = model(input_ids=torch.tensor([[new[b][-1]] for b in live]),
                                   position_ids=torch.tensor([[lengths[b] + len(new[b]) - 1] for b in live]),
                                   cache=cache, use_cache=True, logits_to_keep=1).logits
                finally:
                    _PADS.reset(token)
                keep = []
                for j, (b, t) in enumerate(zip(live, logits[:, -1, :].float().argmax(-1).tolist(), strict=True)):
                    new[b].append(t)
                    if t not in eos and len(new[b]) < max_tokens[b]:
                        keep.append(j)
                if len(keep) < len(live):
                    _select(cache, keep)
                    live = [live[j] for j in keep]
    return new


def _select(cache: Any, rows: Sequence[int]) -> None:
    """Keep only these rows of the cache (finished rows leave the batch)."""
    if not rows:
        return
    index = torch.tensor(list(rows), dtype=torch.long)
    for layer in cache.layers:
        layer.batch_select_indices(index)
