"""Generation A/B on CPU (issue 32): the HF engine's batch-invariant generation before (one
`model.generate` per request) and now (row-exact lock-step, `engine/hf_decode.py`), and plain batched
`generate` (not invariant: the audit tax), interleaved over 2 rounds on the same reason prompts.

    .venv/bin/python bench/generate_cpu.py [ROWS]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from jex.engine.hf import HFEngine
from jex.engine_spec import RenderSpec
from jex.sample_suite import write_sample_suite
from jex.suite import iter_rows
from jex.tasks.capture.engine_calls import _reason_requests


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(iter_rows(write_sample_suite(Path(tmp) / "s", rows=max(n, 18))))[:n]
    inv, before, batched = HFEngine(), HFEngine(), HFEngine(batch_invariant=False)
    before._row_exact_model = False  # the path before row-exact decoding
    reqs = _reason_requests(inv, rows, 48, RenderSpec(), ())
    arms = {"before": before, "row_exact8": inv, "batched8_not_invariant": batched}
    best: dict[str, float] = {}
    toks: dict[str, list[tuple[int, ...]]] = {}
    for rnd in range(2):
        for k, e in arms.items():
            t = time.perf_counter()
            g = e.generate(reqs)
            s = time.perf_counter() - t
            best[k] = min(best.get(k, s), s)
            toks[k] = [x.token_ids for x in g]
            print(rnd, k, f"{s:.1f}s", flush=True)
    n_tok = sum(map(len, toks["before"]))
    print(json.dumps({"rows": n, "tokens": n_tok, "threads": torch.get_num_threads(),
                      "tok_per_s": {k: n_tok / v for k, v in best.items()},
                      "row_exact_vs_before": best["before"] / best["row_exact8"],
                      "tax_row_exact_over_batched": best["row_exact8"] / best["batched8_not_invariant"],
                      "identical": toks["row_exact8"] == toks["before"]}, indent=1))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 16)
