"""Issue 14 on the H200: n-gram speculation against the audited base, and the early-exit probe.

    source /tmp/stage/env.sh && export PYTHONPATH=$PWD:$PYTHONPATH
    python3 bench/gpu_speculative.py workload --model /tmp/smollm2 --rows 10000 --gated 1000 --out $OUT
    python3 bench/gpu_speculative.py probe --model /tmp/smollm2 --rows 200 --every 8 --out $OUT

`workload` runs the campaign's own stage functions (bundle, fast pass, gate, reason, the proof
sample, `tasks/capture/spec_proof.py: prove`) in a shared store: one process for the audited base engine (fast
pass, the reason stage on every gated row, the proof sample), one for the `audit-ngram` engine (its
fast pass is the base's: speculation does not key a readout). It reports identical rationales over
all gated rows, the per-run proof on the 64-row sample, and tok/s of each reason stage.
`probe` runs `lab/early_exit.py` on gated rows with the audited vLLM engine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from jex.engine_spec import EngineSpec  # noqa: E402


def engine(args: argparse.Namespace, profile: str) -> EngineSpec:
    return EngineSpec(kind=args.engine, model=args.model or None, device=args.device, batch_size=args.batch,
                      max_num_seqs=args.batch, profile=profile)


def stage_process(args: argparse.Namespace) -> None:
    """One engine's share of the workload, in this process (vLLM's settings are process-wide)."""
    from jex.sample_suite import write_sample_suite
    from jex.tasks.capture.spec_proof import proof_sample_stage
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.store import LocalStore

    work = Path(args.work)
    suite = work / "suite"
    if not (suite / "suite.toml").exists():
        write_sample_suite(suite, rows=args.rows, seed=0)
    store = LocalStore(work / "store")
    eng = engine(args, args.profile)
    t0 = time.perf_counter()
    bundle = bundle_stage(store, suite=suite)
    fast = fast_pass_stage(store, bundle=bundle, engine=eng, shard_rows=args.shard_rows)
    t_fast = time.perf_counter() - t0
    gate = gate_stage(store, bundle=bundle, fast=fast, coverage=args.gated / args.rows)
    t1 = time.perf_counter()
    reason = reason_stage(store, bundle=bundle, gate=gate, engine=eng, max_tokens=args.max_tokens,
                          shard_rows=args.shard_rows)
    t_reason = time.perf_counter() - t1
    out = {"profile": args.profile, "fast_pass": fast.model_dump(mode="json"), "gate": gate.model_dump(mode="json"),
           "reason": reason.model_dump(mode="json"), "fast_pass_wall_s": t_fast, "reason_wall_s": t_reason}
    if args.profile == "audit":
        sample = proof_sample_stage(store, bundle=bundle, gate=gate, rows=args.proof_rows)
        out["proof_sample"] = sample.model_dump(mode="json")
        out["proof_base"] = reason_stage(store, bundle=bundle, gate=sample, engine=eng, max_tokens=args.max_tokens,
                                         shard_rows=args.shard_rows).model_dump(mode="json")
    (work / f"{args.profile}.json").write_text(json.dumps(out, default=str))


def workload(args: argparse.Namespace) -> dict:
    import polars as pl

    from jex.tasks.capture.spec_proof import prove
    from jex.tasks.records import ReasonSummary

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["--model", args.model, "--rows", str(args.rows), "--gated", str(args.gated), "--max-tokens",
              str(args.max_tokens), "--batch", str(args.batch), "--work", str(work), "--engine", args.engine,
              "--device", args.device, "--proof-rows", str(args.proof_rows), "--shard-rows", str(args.shard_rows)]
    walls = {}
    for profile in ("audit", "audit-ngram"):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "_stage", "--profile", profile, *common], check=True)
        walls[profile] = time.perf_counter() - t0
    base, spec = (json.loads((work / f"{p}.json").read_text()) for p in ("audit", "audit-ngram"))
    spec_reason, base_reason, base_proof = (ReasonSummary.model_validate(d) for d in
                                            (spec["reason"], base["reason"], base["proof_base"]))
    all_rows = prove(spec_reason, base_reason, profile="audit-ngram")
    sample = prove(spec_reason, base_proof, profile="audit-ngram")

    def tokens(summary: dict) -> int:
        return sum(len(t) for t in pl.read_parquet(summary["reasoned"])["token_ids"].to_list())

    n_tok = tokens(base["reason"])
    res = {
        "rows": args.rows, "gated": base["gate"]["rows"], "max_tokens": args.max_tokens, "batch": args.batch,
        "fast_pass_reused_by_speculative_engine": spec["fast_pass"]["key"] == base["fast_pass"]["key"],
        "rationales_identical": all_rows.rows_checked - all_rows.rows_differing, "rationales": all_rows.rows_checked,
        "tokens_compared": all_rows.tokens_compared, "first_difference": all_rows.first_difference and
        all_rows.first_difference.model_dump(),
        "reason_wall_s": {"audit": base["reason_wall_s"], "audit-ngram": spec["reason_wall_s"]},
        "reason_tok_s": {"audit": n_tok / base["reason"]["compute_seconds"],
                         "audit-ngram": tokens(spec["reason"]) / spec["reason"]["compute_seconds"]},
        "process_wall_s": walls,
        "proof_on_sample": {**sample.model_dump(mode="json"), "exact": sample.exact},
        "engine": spec["reason"]["engine"],
    }
    res["speedup"] = res["reason_tok_s"]["audit-ngram"] / res["reason_tok_s"]["audit"]
    return res


def probe(args: argparse.Namespace) -> dict:
    from jex.lab.early_exit import markdown, pick_gated, plot, probe_rows, suite_rows
    from jex.sample_suite import write_sample_suite
    from jex.tasks.execution.engine_pool import get_engine

    work = Path(args.work)
    suite = work / "probe-suite"
    if not (suite / "suite.toml").exists():
        write_sample_suite(suite, rows=max(4 * args.rows, 360), seed=0)
    eng = get_engine(engine(args, "audit"))
    t0 = time.perf_counter()
    picked = pick_gated(eng, suite_rows(suite, work), args.rows)
    result = probe_rows(eng, picked, every=args.every, max_tokens=args.max_tokens)
    out = Path(args.out)
    (out / "probe.md").write_text(markdown(result))
    plot(result, out / "probe.png")
    return {**result.model_dump(mode="json"), "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["workload", "probe", "_stage"])
    p.add_argument("--model", default="/tmp/smollm2")
    p.add_argument("--engine", default="vllm")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=10000)
    p.add_argument("--gated", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--shard-rows", type=int, default=1000)
    p.add_argument("--proof-rows", type=int, default=64)
    p.add_argument("--profile", default="audit")
    p.add_argument("--work", default="/tmp/jex-spec")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    if args.cmd == "_stage":
        stage_process(args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    res = workload(args) if args.cmd == "workload" else probe(args)
    target = Path(args.out) / f"gpu-{args.cmd}.json"
    target.write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps({k: v for k, v in res.items() if k not in ("engine", "checkpoints")}, indent=1, default=str))


if __name__ == "__main__":
    main()
