"""Issue 13 on one GPU: the fast pass and the reason stage, the path before against the new one, with
the raw-vLLM ceiling beside them.

    source /tmp/stage/env.sh && PYTHONPATH=$PWD:/tmp/site2:$PYTHONPATH \
        python3 bench/gpu_fastpass.py --rows 20000 --out $OUT

Each configuration runs the real stages (`fast_pass_stage`, `gate_stage`, `reason_stage`) on the same
sample suite in its own process (batch invariance is process-wide, and an engine's GPU memory goes
with its process):
- `before`: the settings and code path of the issue's measurement, re-enacted: 256 requests per
  `generate`, max_num_seqs 128, every prompt and every label tokenised one at a time;
- `new`: one `generate` per shard (batch_size 0), one batch tokeniser call per shard with label ids
  computed once, max_num_seqs 512, max_num_batched_tokens 32768;
- `new-inline`: `new` with each shard rendered and tokenised on the engine's thread just before its
  engine call (`JEX_PREPARE_AHEAD=0`), where `new` prepares the next shard on a thread beside it;
- `ceiling` (in the `new` process, same engine): one `generate` per label set over every row's
  pre-tokenised ids; no rendering, no tokenising, no jex.
Rows/s counts the stage's compute after the engine is up (engine start reported separately); the
captures and rationales of `before` and `new` are compared by sha256.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NEW = {"batch_size": 0, "max_num_seqs": 512, "max_num_batched_tokens": 32768, "per_prompt_tokens": False}
CONFIGS = {
    "before": {"batch_size": 256, "max_num_seqs": 128, "max_num_batched_tokens": None, "per_prompt_tokens": True},
    "new": NEW,
    "new-inline": {**NEW, "env": {"JEX_PREPARE_AHEAD": "0"}},
}


def per_prompt_tokenising() -> None:
    """The tokenisation of the path before this change: one tokenizer call per prompt and per label."""
    from jex.engine.base import TokenizedEngine

    TokenizedEngine.encode_many = lambda self, texts: [self.encode(t) for t in texts]  # type: ignore[method-assign]

    def label_token(self: TokenizedEngine, label: str) -> int | None:
        ids = self.encode(" " + label)
        return ids[0] if len(ids) == 1 else None

    TokenizedEngine.label_token = label_token  # type: ignore[method-assign]


def ceiling(engine, requests) -> dict:
    """One `generate` per label set over pre-tokenised prompts (the rendering and tokenising are done
    before the clock starts): what vLLM alone takes for these rows."""
    groups: dict[tuple, list[list[int]]] = {}
    for r, ids in zip(requests, engine.encode_many([r.prompt for r in requests]), strict=True):
        groups.setdefault(tuple(engine.label_token(lab) for lab in r.labels), []).append(ids)
    t0 = time.perf_counter()
    for labels, prompts in groups.items():
        params = engine.SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=list(labels))
        engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "rows_per_s": len(requests) / seconds, "label_sets": len(groups)}


def child(args: argparse.Namespace) -> None:
    import polars as pl

    from jex.engine_spec import EngineSpec
    from jex.fileio import sha256_file
    from jex.tasks.capture.engine_calls import question_prompts
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.execution.engine_pool import get_engine
    from jex.tasks.store import LocalStore

    cfg = CONFIGS[args.config]
    if cfg["per_prompt_tokens"]:
        per_prompt_tokenising()
    store = LocalStore(Path(args.store))
    bundle = bundle_stage(store, suite=Path(args.suite))
    if args.kind == "hf":  # a CPU smoke run of this script's plumbing (no vLLM, no ceiling)
        spec = EngineSpec(kind="hf")
    else:
        spec = EngineSpec(kind="vllm", model=args.model, batch_size=cfg["batch_size"],
                          max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
                          gpu_memory_utilization=0.5)
    t0 = time.perf_counter()
    engine = get_engine(spec)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = fast_pass_stage(store, bundle=bundle, engine=spec, shard_rows=args.fast_shard)
    fast_s = time.perf_counter() - t0
    gate = gate_stage(store, bundle=bundle, fast=fast, coverage=args.gated / fast.rows)
    t0 = time.perf_counter()
    reasoned = reason_stage(store, bundle=bundle, gate=gate, engine=spec, max_tokens=args.max_tokens,
                            shard_rows=args.reason_shard)
    reason_s = time.perf_counter() - t0
    tokens = sum(len(t) for t in pl.read_parquet(reasoned.reasoned)["token_ids"].to_list())
    out = {"config": args.config, "settings": cfg, "engine_start_s": start_s,
           "fast_pass": {"rows": fast.rows, "seconds": fast_s, "rows_per_s": fast.rows / fast_s,
                         "capture_sha256": sha256_file(fast.capture)},
           "reason": {"rows": reasoned.rows, "seconds": reason_s, "tokens": tokens, "tok_per_s": tokens / reason_s,
                      "rows_per_s": reasoned.rows / reason_s, "reasoned_sha256": sha256_file(reasoned.reasoned)},
           "provenance": engine.provenance()}
    if args.config == "new" and args.kind == "vllm":
        from jex.tasks.bundle.reading import bundle_rows
        from jex.tasks.capture.engine_calls import as_rows

        rows = as_rows(bundle_rows(bundle, store))
        out["ceiling"] = ceiling(engine, question_prompts(engine, rows, spec.render))
    print("RESULT " + json.dumps(out, default=str), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--gated", type=int, default=1000, help="rows the reason stage reasons on")
    p.add_argument("--model", default="/tmp/smollm2")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fast-shard", type=int, default=5000)
    p.add_argument("--reason-shard", type=int, default=500)
    p.add_argument("--configs", default="before,new")
    p.add_argument("--kind", default="vllm", choices=["vllm", "hf"], help="hf: a CPU smoke run of the plumbing")
    p.add_argument("--out", required=True)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--suite", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.config:
        return child(args)
    from jex.sample_suite import write_sample_suite

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        suite = write_sample_suite(Path(tmp) / "suite", rows=args.rows, seed=0)
        for name in args.configs.split(","):
            cmd = [sys.executable, __file__, "--config", name, "--suite", str(suite), "--store", f"{tmp}/store-{name}",
                   "--model", args.model, "--kind", args.kind, "--gated", str(args.gated),
                   "--max-tokens", str(args.max_tokens), "--fast-shard", str(args.fast_shard),
                   "--reason-shard", str(args.reason_shard), "--out", args.out]
            env = {**os.environ, **CONFIGS[name].get("env", {})}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                runs[name] = {"error": proc.stderr[-4000:], "returncode": proc.returncode}
                continue
            runs[name] = json.loads(lines[-1][len("RESULT "):])
    result = {"settings": {k: v for k, v in vars(args).items() if k not in ("config", "suite", "store")}, "runs": runs}
    if all("fast_pass" in runs.get(n, {}) for n in ("before", "new")):
        b, n = runs["before"], runs["new"]
        result["capture_identical"] = b["fast_pass"]["capture_sha256"] == n["fast_pass"]["capture_sha256"]
        result["reasoned_identical"] = b["reason"]["reasoned_sha256"] == n["reason"]["reasoned_sha256"]
        result["fast_pass_speedup"] = n["fast_pass"]["rows_per_s"] / b["fast_pass"]["rows_per_s"]
        result["reason_speedup"] = n["reason"]["tok_per_s"] / b["reason"]["tok_per_s"]
    if all("fast_pass" in runs.get(n, {}) for n in ("new", "new-inline")):
        n, i = runs["new"], runs["new-inline"]
        result["prepare_ahead"] = {
            "capture_identical": n["fast_pass"]["capture_sha256"] == i["fast_pass"]["capture_sha256"],
            "reasoned_identical": n["reason"]["reasoned_sha256"] == i["reason"]["reasoned_sha256"],
            "fast_pass_speedup": n["fast_pass"]["rows_per_s"] / i["fast_pass"]["rows_per_s"],
            "reason_speedup": n["reason"]["tok_per_s"] / i["reason"]["tok_per_s"]}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu-fastpass.json").write_text(json.dumps(result, indent=1, default=str))
    summary = {k: v for k, v in result.items() if k != "runs"}
    for name, r in runs.items():
        summary[name] = {"engine_start_s": r.get("engine_start_s"), "error": r.get("error", "")[-600:] or None,
                         **{s: {k: v for k, v in r[s].items() if not k.endswith("sha256")}
                            for s in ("fast_pass", "reason", "ceiling") if s in r}}
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    main()
