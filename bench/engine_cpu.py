"""CPU throughput of the HF engine on the embedded model, every arm side by side on the same rows.

    .venv/bin/python bench/engine_cpu.py [--rows 64] [--gen-rows 16] [--gen-tokens 48] [--rounds 2]
        [--out bench/out/engine_cpu.json]
Readout (the fast pass's label slot): jex batch-invariant (rows packed behind their shared prefix,
`engine/hf_packed.py`), the same packed without sharing the prefix, one forward per row (before
packing; the log-probs of all three are compared), jex batched at 8, and a plain `transformers` forward
at batch 8 of the same prompts (left-padded, last position only).
Generation (the reason stage's greedy rationales): one `model.generate` per request (batch 1: the
numbers of hf engine version 1), lock-step with one-row products (`engine/hf_decode.py` at
GEMM_ROWS = 1: engine version 1's decoder, the batch-1 tokens), lock-step with 8-row products in calls
of 8 requests (what a reason shard of 8 rows did), the same with every request in one call (one
lock-step group: now), and plain batched `generate` at 8 and with every request in one batch (not
batch-invariant: the CPU audit tax is the ratio to them). The arms are interleaved round by round (a
loaded machine slows them alike) and each keeps its fastest round; the token ids of the invariant
generation arms are compared.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from jex.engine.hf import HFEngine
from jex.engine_spec import RenderSpec
from jex.sample_suite import write_sample_suite
from jex.suite import iter_rows
from jex.tasks.capture.engine_calls import fast_pass, question_prompts, reason_requests


def plain_forward(engine: HFEngine, prompts: list[str], batch: int = 8) -> None:
    """What a plain transformers user would run: tokenise with padding, one forward per batch."""
    tok = engine.tokenizer
    tok.padding_side = "left"
    for start in range(0, len(prompts), batch):
        enc = tok(prompts[start:start + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            engine.model(**enc, logits_to_keep=1)


def one_row_products(engine: HFEngine, reqs: list) -> list:
    """Lock-step decoding with one-row (M = 1) products: engine version 1's decoder."""
    from jex.engine import hf_decode

    rows, hf_decode.GEMM_ROWS = hf_decode.GEMM_ROWS, 1
    try:
        return engine.generate(reqs)
    finally:
        hf_decode.GEMM_ROWS = rows


def unshared(engine: HFEngine, rows: list) -> list:
    """The packed readout without a shared prefix (every pack's prefix 0)."""
    from jex.engine import hf_packed

    plan = hf_packed.plan_packs
    hf_packed.plan_packs = lambda seqs, tokens=None: [  # type: ignore[assignment]
        hf_packed.Pack(p.rows, 0) for p in plan(seqs, tokens)]
    try:
        return fast_pass(engine, rows)
    finally:
        hf_packed.plan_packs = plan


def in_calls_of(engine: HFEngine, reqs: list, n: int) -> list:
    """`generate` on `n` requests at a time (one lock-step group each)."""
    return [g for start in range(0, len(reqs), n) for g in engine.generate(reqs[start:start + n])]


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--gen-rows", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="bench/out/engine_cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(iter_rows(write_sample_suite(Path(tmp) / "s", rows=max(args.rows, args.gen_rows, 18))))
    read_rows, gen_rows = rows[: args.rows], rows[: args.gen_rows]
    inv, batched, before = HFEngine(batch_invariant=True), HFEngine(batch_invariant=False), HFEngine()
    before._lockstep_model = False  # generation by one `model.generate` per request
    before.packs_rows = False  # the readout before packing: one forward per row
    batched.batch_size = 8
    batched_all = HFEngine(batch_invariant=False, batch_size=len(gen_rows))  # every rationale in one batch
    prompts = [r.prompt for r in question_prompts(inv, read_rows, RenderSpec(), None, None)]
    reqs = reason_requests(inv, gen_rows, args.gen_tokens, RenderSpec(), ())
    arms = {
        "readout_jex_invariant": lambda: fast_pass(inv, read_rows),
        "readout_jex_invariant_unshared_prefix": lambda: unshared(inv, read_rows),
        "readout_jex_invariant_one_forward_per_row": lambda: fast_pass(before, read_rows),
        "readout_jex_batched8": lambda: fast_pass(batched, read_rows),
        "readout_plain_transformers_batch8": lambda: plain_forward(inv, prompts),
        "generate_invariant_one_request": lambda: before.generate(reqs),
        "generate_invariant_lockstep_1row_v1": lambda: one_row_products(inv, reqs),
        "generate_invariant_lockstep_8row_calls_of_8": lambda: in_calls_of(inv, reqs, 8),
        "generate_invariant_lockstep_8row_v2": lambda: inv.generate(reqs),
        "generate_batched8_not_invariant": lambda: batched.generate(reqs),
        "generate_batched_all_not_invariant": lambda: batched_all.generate(reqs),
    }
    fast_pass(inv, read_rows[:2])  # warm-up
    best: dict[str, float] = {}
    outs: dict[str, object] = {}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            seconds, outs[name] = timed(fn)
            best[name] = min(best.get(name, seconds), seconds)
    gens = {k: [g.token_ids for g in outs[k]] for k in arms if k.startswith("generate")}  # type: ignore[attr-defined]
    tokens = sum(map(len, gens["generate_invariant_one_request"]))
    res = {name: ({"rows_per_s": len(read_rows) / s} if name.startswith("readout") else
                  {"tokens_per_s": sum(map(len, gens[name])) / s, "tokens": sum(map(len, gens[name]))}) | {"seconds": s}
           for name, s in best.items()}
    g_v1, g_new = best["generate_invariant_lockstep_1row_v1"], best["generate_invariant_lockstep_8row_v2"]
    packed, per_row = outs["readout_jex_invariant"], outs["readout_jex_invariant_one_forward_per_row"]
    summary = {"rows": len(read_rows), "gen_rows": len(gen_rows), "gen_max_tokens": args.gen_tokens,
               "tokens_one_request": tokens, "threads": torch.get_num_threads(), "rounds": args.rounds,
               "lockstep_1row_identical_to_one_request": gens["generate_invariant_lockstep_1row_v1"]
               == gens["generate_invariant_one_request"],
               "lockstep_8row_identical_to_v1": gens["generate_invariant_lockstep_8row_v2"]
               == gens["generate_invariant_one_request"],
               "speedup_8row_vs_1row": g_v1 / g_new,
               "speedup_one_group_vs_calls_of_8": best["generate_invariant_lockstep_8row_calls_of_8"] / g_new,
               "lockstep_calls_of_8_identical": gens["generate_invariant_lockstep_8row_calls_of_8"]
               == gens["generate_invariant_lockstep_8row_v2"],
               "speedup_8row_vs_one_request": best["generate_invariant_one_request"] / g_new,
               "packed_readout_identical_to_one_per_row": [r.raw_logprobs for r in packed]  # type: ignore[attr-defined]
               == [r.raw_logprobs for r in per_row]  # type: ignore[attr-defined]
               == [r.raw_logprobs for r in outs["readout_jex_invariant_unshared_prefix"]],  # type: ignore[attr-defined]
               "speedup_shared_prefix_vs_unshared": best["readout_jex_invariant_unshared_prefix"]
               / best["readout_jex_invariant"],
               "speedup_packed_vs_one_forward_per_row": best["readout_jex_invariant_one_forward_per_row"]
               / best["readout_jex_invariant"],
               "audit_tax_generation": g_new / best["generate_batched8_not_invariant"],
               "audit_tax_generation_same_batch": g_new / best["generate_batched_all_not_invariant"],
               "readout_plain_vs_jex_invariant_seconds": best["readout_jex_invariant"]
               / best["readout_plain_transformers_batch8"],
               "results": res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
