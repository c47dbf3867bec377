"""Decoding several requests at once, greedy or sampled, each row's numbers independent of the others (the HF
engine's batch-invariant generation on CPU).

A decode step reads one token per row. Done row by row (`model.generate` on one request: every linear
layer a matrix-vector product, M = 1) it is compute- and memory-bound at ~15 tokens/s for the 135M
model on 2 cores. Here the rows advance in lock-step through the model, layer by layer:

- every linear layer multiplies `GEMM_ROWS` rows at a time (the live rows, in chunks, the last chunk
  padded with zero rows): always the same matrix shape, so always the same GEMM kernel, and a GEMM
  reduces each output row on its own: a row's numbers do not depend on which rows share its chunk,
  nor on its place in it (M = 1 and M = 2 take other kernels, whose last bits differ: that is why the
  shape is fixed, and why these numbers are not those of a batch-1 `generate`: engine version 2);
  a large matrix (the vocabulary head) in slices of its output rows, each slice read once from memory
  for all chunks;
- attention runs per row on the row's own keys and values (`sdpa_attention_forward` on one row,
  without the left padding of the shared cache), with the arguments the batch-1 forward passes;
- the requests decode in groups as large as their key/value cache allows (`GROUP_CACHE_BYTES`), since
  a row's numbers do not depend on its group;
- the prompts are read packed (`engine/hf_packed.py`: each prompt's keys, values and first token
  those of its own forward), and their caches joined, left-padded.

Everything else in the forward is element-wise or reduces within a row (RMS norm, rotary embedding,
the MLP's gate), so each row's tokens are the same at every batch size and in any order;
`tests/test_hf_engine.py` checks the token ids across batch sizes and orders, and a chunk's rows
against the same rows among others. A sampled request draws each token from its own row's float32 logits
with its own seeded generator (`engine/sampling.py`), so its samples are as independent of the batch
(`tests/test_sampled_generation.py`). Models outside these assumptions (a linear layer with a bias,
attention other than SDPA) keep the batch-1 path (`row_exact_supported`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.cache_utils import DynamicLayer
from torch.nn import functional as F

from jex.engine.hf_packed import RowStates, forward_rows, head_logits
from jex.engine.sampling import RowSampler
from jex.engine.types import Sampling

ROWS_ATTENTION = "jex_rows"
GEMM_ROWS = 8
"""Rows of every decode-step product: one fixed shape, so one kernel, whatever the batch."""
SLICE_ELEMENTS = 1 << 21
"""Weight elements (8 MiB in fp32) per slice of a large linear layer: several fit in the L3 cache."""
GROUP_CACHE_BYTES = 1 << 30
"""Key/value cache of one lock-step group at its longest: requests join a group up to this. The more rows
a step reads, the fewer times it reads the weights (36 rows together: 1.7x groups of 8, measured)."""
_PADS: ContextVar[list[int]] = ContextVar("jex_row_pads")


def _rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kw: Any) -> tuple[torch.Tensor, None]:
    """SDPA row by row on each row's unpadded keys and values, with no mask (the batch-1 decode's call)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = [sdpa_attention_forward(module, query[b:b + 1], key[b:b + 1, :, pad:], value[b:b + 1, :, pad:], None,
                                   **kw)[0] for b, pad in enumerate(_PADS.get())]
    return torch.cat(outs), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


def _row_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)` as products of `GEMM_ROWS` rows each (zero rows pad the last); large weights in slices
    of output rows, each read once for all chunks."""
    weight = layer.weight
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n % GEMM_ROWS:
        rows = torch.cat([rows, rows.new_zeros(GEMM_ROWS - n % GEMM_ROWS, rows.shape[1])])
    chunks = rows.split(GEMM_ROWS)
    step = max(1, SLICE_ELEMENTS // weight.shape[1])
    parts = [torch.cat([F.linear(c, weight[s:s + step]) for c in chunks]) for s in range(0, weight.shape[0], step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out[:n].reshape(*x.shape[:-1], weight.shape[0])


def row_exact_supported(model: PreTrainedModel) -> bool:
    """The model decodes row-exactly here: SDPA attention and no linear layer with a bias."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return (getattr(model.config, "_attn_implementation", None) == "sdpa" and bool(linears)
            and all(m.bias is None for m in linears) and hasattr(model, "set_attn_implementation"))


@contextlib.contextmanager
def _row_exact(model: PreTrainedModel) -> Iterator[None]:
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


def _joined(model: PreTrainedModel, rows: Sequence[RowStates], lengths: Sequence[int]) -> DynamicCache:
    """One cache of all rows' prompts (of these lengths), each left-padded with zeros to the longest."""
    from transformers import DynamicCache

    width = max(lengths)
    cache = DynamicCache(config=model.config)
    for li in range(len(rows[0].keys)):
        keys = torch.cat([F.pad(r.keys[li], (0, 0, width - n, 0)) for r, n in zip(rows, lengths, strict=True)])
        values = torch.cat([F.pad(r.values[li], (0, 0, width - n, 0)) for r, n in zip(rows, lengths, strict=True)])
        cache.update(keys, values, li)
    return cache


@dataclass(frozen=True)
class DecodeRow:
    """One request to decode: its prompt's token ids, its budget of new tokens, whether end-of-sequence
    tokens are barred (`generate`'s `min_new_tokens` over the whole budget), and how it samples (None:
    greedy)."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    sampling: Sampling | None = None


def decode_rows(model: PreTrainedModel, rows: Sequence[DecodeRow], eos: set[int],
                stopped: Callable[[int, list[int]], bool] = lambda row, new: False) -> list[list[int]]:
    """The new tokens of each row, greedy or sampled by its own generator, up to its end-of-sequence token
    (kept), `max_tokens`, or the token after which `stopped(row index, new tokens)` holds (a stop string); the
    rows decode in lock-step, in consecutive groups of at most `GROUP_CACHE_BYTES` of key/value cache."""
    out: list[list[int]] = []
    for group in _groups(model, rows):
        out += _decode_group(model, rows[group.start:group.stop], eos,
                             partial(_shifted, stopped, group.start))
    return out


def _shifted(stopped: Callable[[int, list[int]], bool], start: int, row: int, new: list[int]) -> bool:
    return stopped(start + row, new)


def cache_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of key/value cache one token takes, all layers."""
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * heads * head_dim * torch.empty((), dtype=model.dtype).element_size()


def _groups(model: PreTrainedModel, rows: Sequence[DecodeRow]) -> list[range]:
    """Consecutive runs of rows whose joined cache (every row as wide as the longest prompt plus the
    largest budget) stays within `GROUP_CACHE_BYTES`; at least one row each."""
    per_token = cache_bytes_per_token(model)
    groups: list[range] = []
    start, prompt, budget = 0, 0, 0
    for i, r in enumerate(rows):
        wider = max(prompt, len(r.prompt)), max(budget, r.max_tokens)
        if i > start and (i - start + 1) * sum(wider) * per_token > GROUP_CACHE_BYTES:
            groups.append(range(start, i))
            start, wider = i, (len(r.prompt), r.max_tokens)
        prompt, budget = wider
    return [*groups, range(start, len(rows))] if rows else []


def _decode_group(model: PreTrainedModel, rows: Sequence[DecodeRow], eos: set[int],
                  stopped: Callable[[int, list[int]], bool]) -> list[list[int]]:
    """`decode_rows` for one group, all its rows in lock-step."""
    barred = torch.tensor(sorted(eos), dtype=torch.long)
    samplers = [RowSampler(r.sampling) if r.sampling is not None else None for r in rows]
    with torch.inference_mode():
        prompts = forward_rows(model, [r.prompt for r in rows], keep_cache=True)
        new = [[_first_token(model, p, barred if r.ignore_eos else None, sampler)]
               for p, r, sampler in zip(prompts, rows, samplers, strict=True)]
        lengths = [len(r.prompt) for r in rows]
        cache = _joined(model, prompts, lengths)

        def going(b: int) -> bool:
            r = rows[b]
            return len(new[b]) < r.max_tokens and (r.ignore_eos or new[b][-1] not in eos) and not stopped(b, new[b])

        live = [b for b in range(len(rows)) if going(b)]
        if len(live) < len(rows):
            _select(cache, live)
        pads = [max(lengths) - n for n in lengths]
        with _row_exact(model):
            while live:
                token = _PADS.set([pads[b] for b in live])
                try:
                    logits = model(input_ids=torch.tensor([[new[b][-1]] for b in live]),
                                   position_ids=torch.tensor([[lengths[b] + len(new[b]) - 1] for b in live]),
                                   cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :].float()
                finally:
                    _PADS.reset(token)
                for j, b in enumerate(live):
                    if rows[b].ignore_eos and len(barred):
                        logits[j, barred] = float("-inf")
                keep = []
                for j, (b, t) in enumerate(zip(live, logits.argmax(-1).tolist(), strict=True)):
                    sampler = samplers[b]
                    new[b].append(t if sampler is None else sampler.pick(logits[j]))
                    if going(b):
                        keep.append(j)
                if len(keep) < len(live):
                    _select(cache, keep)
                    live = [live[j] for j in keep]
    return new


def _first_token(model: PreTrainedModel, prompt: RowStates, barred: torch.Tensor | None,
                 sampler: RowSampler | None = None) -> int:
    """The token after a prompt, as `generate`'s first step picks it (float32 logits; the end-of-sequence tokens
    barred when `min_new_tokens` asks for more): greedy, or drawn by the row's sampler."""
    logits = head_logits(model, prompt.last_hidden).float()
    if barred is not None and len(barred):
        logits[barred] = float("-inf")
    return int(logits.argmax()) if sampler is None else sampler.pick(logits.reshape(-1))


def _select(cache: DynamicCache, rows: Sequence[int]) -> None:
    """Keep only these rows of the cache (finished rows leave the batch)."""
    if not rows:
        return
    index = torch.tensor(list(rows), dtype=torch.long)
    for layer in cache.layers:
        cast("DynamicLayer", layer).batch_select_indices(index)
