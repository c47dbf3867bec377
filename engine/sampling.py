"""One request's next token drawn from its own logits by its own generator (`engine.types.Sampling`).

The draw reads nothing but the row's float32 logits and the request's generator, seeded once with the
request's seed: where the logits are the same bits whatever the batch (the HF engine's lock-step decoding,
`engine/hf_decode.py`), so are the samples. The warpers are transformers' (`TemperatureLogitsWarper`,
`TopKLogitsWarper`, `TopPLogitsWarper`, in that order), then `torch.multinomial` of the softmax.
"""

from __future__ import annotations

import torch

from jex.engine.types import Sampling


class RowSampler:
    """The sampler of one request: `pick(logits)` for each of its tokens, in order."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.generator = torch.Generator(device="cpu").manual_seed(sampling.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from this row's logits (vocab,), any dtype or device (read as float32 on the CPU)."""
        s = self.sampling
        scores = logits.detach().to("cpu", torch.float32) / s.temperature
        if 0 < s.top_k < scores.numel():
            kth = torch.topk(scores, s.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if s.top_p < 1:
            ascending, order = torch.sort(scores, stable=True)
            drop = ascending.softmax(-1).cumsum(-1) <= 1 - s.top_p
            drop[-1] = False  # the most likely token always stays
            scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))
