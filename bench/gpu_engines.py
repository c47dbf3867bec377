"""Device-side experiments for the engines issue: bake-off ladder and HF-vs-vLLM parity.

Runs on the GPU machine with only torch, transformers and the staged vLLM (no polars, no Prefect):
    source /tmp/stage/env.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 bench/gpu_engines.py bakeoff \
        --arms vllm-control,vllm-bi --prompts 64 --tokens 256 --ladder 1,8,16,32,64 --max-num-seqs 64 --out $OUT
    ... python3 bench/gpu_engines.py parity --rows 2000 --reason-rows 48 --out $OUT
Results land as JSON + Markdown (+ PNG) in --out; bench/results/ keeps the committed copies.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def bakeoff(args: argparse.Namespace) -> None:
    from jex.lab.bakeoff import run_bakeoff
    from jex.lab.jobs import BakeoffJob

    job = BakeoffJob(arms=args.arms.split(","), model=args.model, prompts=args.prompts, tokens=args.tokens,
                     ladder=[int(x) for x in args.ladder.split(",")], repeats=args.repeats,
                     reference_prompts=args.reference_prompts,
                     max_num_seqs=args.max_num_seqs, device=args.device)
    res = run_bakeoff(job, Path(args.out))
    print(res.verdict)
    print((Path(args.out) / "bakeoff.md").read_text())


def parity(args: argparse.Namespace) -> None:
    from jex.engine.hf import HFEngine
    from jex.engine.vllm_engine import VLLMEngine, VLLMProfile
    from jex.lab.parity import markdown, run_parity
    from jex.sample_suite import write_sample_suite
    from jex.suite import iter_rows

    with tempfile.TemporaryDirectory() as tmp:
        suite = write_sample_suite(Path(tmp) / "suite", rows=args.rows, seed=0)
        rows = list(iter_rows(suite))
    t0 = time.perf_counter()
    hf = HFEngine(args.model, device="cuda", dtype=args.hf_dtype, batch_invariant=True)
    vl = VLLMEngine(args.model, VLLMProfile.of(max_num_seqs=args.max_num_seqs), batch_size=args.batch)
    print(f"engines up in {time.perf_counter() - t0:.1f}s", flush=True)
    res = run_parity(hf, vl, rows, reason_rows=args.reason_rows, max_tokens=args.max_tokens)
    res["provenance"] = {"a": hf.provenance(), "b": vl.provenance()}
    res["settings"] = vars(args)
    out = Path(args.out)
    (out / "parity.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res, (f"HF {args.hf_dtype} (per-request)", "vLLM bf16 audit"))
    md += "\n" + json.dumps(res["timings"], indent=1) + "\n"
    (out / "parity.md").write_text(md)
    print(md)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bakeoff")
    b.add_argument("--arms", default="vllm-control,vllm-bi")
    b.add_argument("--model", default="/tmp/smollm2")
    b.add_argument("--prompts", type=int, default=32)
    b.add_argument("--tokens", type=int, default=256)
    b.add_argument("--ladder", default="1,8,16,32")
    b.add_argument("--repeats", type=int, default=2)
    b.add_argument("--reference-prompts", type=int, default=None, help="prompts batch 1 reads (default: all)")
    b.add_argument("--max-num-seqs", type=int, default=32)
    b.add_argument("--device", default="cuda")
    b.add_argument("--out", required=True)
    q = sub.add_parser("parity")
    q.add_argument("--model", default="/tmp/smollm2")
    q.add_argument("--rows", type=int, default=2000)
    q.add_argument("--reason-rows", type=int, default=48)
    q.add_argument("--max-tokens", type=int, default=96)
    q.add_argument("--hf-dtype", default="float32")
    q.add_argument("--batch", type=int, default=64)
    q.add_argument("--max-num-seqs", type=int, default=64)
    q.add_argument("--out", required=True)
    args = p.parse_args()
    {"bakeoff": bakeoff, "parity": parity}[args.cmd](args)


if __name__ == "__main__":
    main()
