"""Rows packed into one forward pass, each row's numbers those of its own forward (the HF engine's
batch-invariant last-position readout on CPU).

The forward of one short row is a poor use of a CPU: its matrix products have a few dozen rows. Here
the rows of a pack go through the model as one sequence:

- every linear layer, norm, rotary embedding and MLP runs over the packed tokens: an output row of
  a product this large does not depend on the other rows;
- attention runs per row, through the SDPA call the row's own forward makes (its queries, keys and
  values, causal, no mask);
- a prefix every row of a pack shares (the chat template's system turn, a few-shot preamble) is packed
  once. Each row's attention call still gets the whole row, the prefix's queries, keys and values and
  then its own, and the prefix's outputs are kept once: they are the same in every row's call (causal:
  the prefix does not see what follows it). That is checked on every call; a pack where they differ is
  computed again without sharing;
- the vocabulary head runs per row at the last position, one row at a time, as `logits_to_keep=1` does.

So each row's log-probs are bit-identical to its own forward, whatever the pack
(tests/test_hf_engine.py; bench/engine_cpu.py).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

PACKED_ATTENTION = "jex_packed_rows"
PACK_TOKENS = 1024
"""Tokens per packed forward: past ~1k the products are compute-bound on CPU already."""
_SWITCH = threading.Lock()  # a packed forward switches the model's attention while it runs


@dataclass(frozen=True)
class Pack:
    """Rows of one packed forward (indices into the call's sequences) and the leading tokens they all
    share, packed once (0: none)."""

    rows: list[int]
    prefix: int


class PrefixNotShared(Exception):
    """A shared prefix's attention outputs differed between two rows of a pack."""


def plan_packs(seqs: Sequence[Sequence[int]], tokens: int | None = None) -> list[Pack]:
    """Consecutive runs of rows, each of at most `tokens` (default PACK_TOKENS) packed tokens (a longer
    row alone), their common prefix counted once; every row keeps at least its last token outside it."""
    tokens = PACK_TOKENS if tokens is None else tokens
    packs: list[Pack] = []
    rows: list[int] = []
    prefix = total = 0
    for i, s in enumerate(seqs):
        if rows:
            shared = min(prefix, _common_prefix(seqs[rows[0]], s), len(s) - 1)
            if total + len(s) - len(rows) * shared <= tokens:
                rows.append(i)
                prefix, total = shared, total + len(s)
                continue
            packs.append(Pack(rows, prefix if len(rows) > 1 else 0))
        rows, prefix, total = [i], len(s) - 1, len(s)
    if rows:
        packs.append(Pack(rows, prefix if len(rows) > 1 else 0))
    return packs


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def last_logprobs(model: PreTrainedModel, seqs: Sequence[Sequence[int]],
                  tokens: int | None = None) -> list[torch.Tensor]:
    """The last position's log-softmax (float64) of each sequence, each bit-identical to its own forward."""
    with torch.inference_mode():
        return [torch.log_softmax(head_logits(model, row.last_hidden).double(), dim=-1).cpu()
                for row in forward_rows(model, seqs, tokens)]


def head_logits(model: PreTrainedModel, last_hidden: torch.Tensor) -> torch.Tensor:
    """The vocabulary head at one position of one row (M = 1: a head over several rows would change the bits)."""
    return model.lm_head(last_hidden.unsqueeze(0))[0, -1]


@dataclass(frozen=True)
class RowStates:
    """What a row's own forward leaves: its last hidden state (1 x hidden) and, when kept, each layer's
    keys and values (1 x kv heads x tokens x head dim, after the rotary embedding), as its cache holds them."""

    last_hidden: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def forward_rows(model: PreTrainedModel, seqs: Sequence[Sequence[int]], tokens: int | None = None, *,
                 keep_cache: bool = False) -> list[RowStates]:
    """Each sequence's states, the sequences packed (`plan_packs`), each bit-identical to its own forward."""
    _register()
    out: list[RowStates] = []
    for pack in plan_packs(seqs, tokens):
        rows = [seqs[i] for i in pack.rows]
        try:
            out += _forward(model, rows, pack.prefix, keep_cache)
        except PrefixNotShared:
            out += _forward(model, rows, 0, keep_cache)
    return out


def _forward(model: PreTrainedModel, rows: Sequence[Sequence[int]], prefix: int, keep_cache: bool) -> list[RowStates]:
    """One packed forward of `rows` behind their shared `prefix`."""
    device = model.device
    ids = torch.tensor([*rows[0][:prefix], *(t for s in rows for t in s[prefix:])], device=device).unsqueeze(0)
    pos = torch.tensor([*range(prefix), *(i for s in rows for i in range(prefix, len(s)))], device=device)
    ends = [prefix + e for e in accumulate(len(s) - prefix for s in rows)]
    bounds = list(zip([prefix, *ends[:-1]], ends, strict=True))
    cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = {} if keep_cache else None
    with _SWITCH, torch.inference_mode():
        config = model.config
        before, config._attn_implementation = config._attn_implementation, PACKED_ATTENTION
        try:
            hidden = model.model(input_ids=ids, position_ids=pos.unsqueeze(0), use_cache=False, jex_prefix=prefix,
                                 jex_row_bounds=bounds, jex_cache=cache).last_hidden_state[0]
        finally:
            config._attn_implementation = before
    layers = [cache[i] for i in sorted(cache)] if cache is not None else []
    return [RowStates(hidden[end - 1:end], [layer[r][0] for layer in layers], [layer[r][1] for layer in layers])
            for r, end in enumerate(ends)]


def _per_row_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, *, jex_row_bounds: list[tuple[int, int]],
                       jex_prefix: int = 0, jex_cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
                       scaling: float | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """Each row's queries, keys and values (the shared prefix's, then its own) through transformers' own
    SDPA call, causal, without a mask, as the row's own forward calls it; the prefix's outputs once.
    With `jex_cache`, each row's keys and values are kept under the layer's index."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    p = jex_prefix
    outs: list[torch.Tensor] = []
    for a, b in jex_row_bounds:
        q, k, v = (torch.cat([t[:, :, :p], t[:, :, a:b]], dim=2) if p else t[:, :, a:b] for t in (query, key, value))
        row = sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scaling, is_causal=True)[0]
        if jex_cache is not None:
            jex_cache.setdefault(cast(int, module.layer_idx), []).append((k, v))
        if p:
            if not outs:
                outs.append(row[:, :p])
            elif not _same_outputs(row[:, :p], outs[0]):
                raise PrefixNotShared
            row = row[:, p:]
        outs.append(row)
    return torch.cat(outs, dim=1), None


def _same_outputs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)


def _register() -> None:
    """Register PACKED_ATTENTION with transformers (once). No mask function is registered, so
    transformers builds none for a packed forward."""
    from transformers import AttentionInterface

    if PACKED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(PACKED_ATTENTION, _per_row_attention)
