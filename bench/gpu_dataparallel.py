"""Issue 8 on a multi-GPU machine: fast pass + reason on 1 GPU and on N GPUs, same bytes, scaling.

    source /tmp/stage/env.sh && PYTHONPATH=$PWD:/tmp/site python3 bench/gpu_dataparallel.py \
        --rows 20000 --gpus 2 --out $OUT
One vLLM engine (audit profile, tensor parallel 1) per GPU, each in its own process with its own
CUDA_VISIBLE_DEVICES; shards are dealt round-robin and merged. Rows/s counts the stage work after
the engines are up (their start is reported separately).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from jex.engine_spec import EngineSpec  # noqa: E402
from jex.sample_suite import write_sample_suite  # noqa: E402
from jex.tasks.capture.stages import bundle_stage  # noqa: E402
from jex.tasks.decision_stages import gate_stage  # noqa: E402
from jex.tasks.execution.workers import run_workers  # noqa: E402
from jex.tasks.inputs import EngineJob, FastPassInputs, ReasonInputs  # noqa: E402
from jex.tasks.store import LocalStore  # noqa: E402


def sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def one_config(suite: Path, store_dir: Path, gpus: int, args: argparse.Namespace) -> dict:
    """`gpus` workers; worker i runs on device args.devices[i] (default: GPU i)."""
    store = LocalStore(store_dir)
    bundle = bundle_stage(store, suite=suite)
    engine = EngineSpec(kind="vllm", model=args.model, batch_size=args.batch, max_num_seqs=args.max_num_seqs)
    devices = (args.devices.split(",") if args.devices else [str(i) for i in range(args.gpus)])[:gpus]
    t0 = time.perf_counter()
    fast_job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=engine, shard_rows=args.fast_shard),
                         store=str(store_dir))
    fast, fast_workers = run_workers(fast_job, workers=gpus, devices=devices)
    fast_wall = time.perf_counter() - t0
    gate = gate_stage(store, bundle=bundle, fast=fast, coverage=args.coverage)
    t0 = time.perf_counter()
    reason_job = EngineJob(inputs=ReasonInputs(bundle=bundle, engine=engine, gate=gate, shard_rows=args.reason_shard,
                                               max_tokens=args.max_tokens), store=str(store_dir))
    reason, reason_workers = run_workers(reason_job, workers=gpus, devices=devices)
    reason_wall = time.perf_counter() - t0
    fast_compute = max(w.compute_s for w in fast_workers)
    reason_compute = max(w.compute_s for w in reason_workers)
    return {"gpus": gpus, "rows": fast.rows, "gated": gate.rows,
            "fast_pass": {"wall_s": fast_wall, "compute_s": fast_compute, "rows_per_s": fast.rows / fast_compute,
                          "workers": [w.model_dump() for w in fast_workers], "capture_sha256": sha(fast.capture)},
            "reason": {"wall_s": reason_wall, "compute_s": reason_compute,
                       "rows_per_s": reason.rows / reason_compute,
                       "workers": [w.model_dump() for w in reason_workers], "reasoned_sha256": sha(reason.reasoned)},
            "combined_rows_per_s": fast.rows / (fast_compute + reason_compute)}

def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--model", default="/tmp/smollm2")
    p.add_argument("--coverage", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--fast-shard", type=int, default=1000)
    p.add_argument("--reason-shard", type=int, default=100)
    p.add_argument("--devices", default=None, help="CUDA_VISIBLE_DEVICES per worker, e.g. 0,1 (or 0,0 on one GPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        suite = write_sample_suite(tmp / "suite", rows=args.rows, seed=0)
        runs = [one_config(suite, tmp / f"store-{g}", g, args) for g in (1, args.gpus)]
    one, many = runs
    result = {"settings": vars(args), "runs": runs,
              "capture_identical": one["fast_pass"]["capture_sha256"] == many["fast_pass"]["capture_sha256"],
              "reasoned_identical": one["reason"]["reasoned_sha256"] == many["reason"]["reasoned_sha256"],
              "scaling_fast_pass": many["fast_pass"]["rows_per_s"] / one["fast_pass"]["rows_per_s"],
              "scaling_reason": many["reason"]["rows_per_s"] / one["reason"]["rows_per_s"],
              "scaling_combined": many["combined_rows_per_s"] / one["combined_rows_per_s"]}
    Path(args.out, "dataparallel.json").write_text(json.dumps(result, indent=1, default=str))
    result["devices"] = args.devices or ",".join(str(i) for i in range(args.gpus))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1, default=str))
    for r in runs:
        print(r["gpus"], "GPU:", {k: r[k] for k in ("rows", "gated")}, "fast", round(r["fast_pass"]["rows_per_s"], 1),
              "rows/s, reason", round(r["reason"]["rows_per_s"], 1), "rows/s")


if __name__ == "__main__":
    main()
