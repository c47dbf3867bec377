"""Whole campaigns through the local provider's machine, the way a user runs them (issue 13).

    python bench/gpu_campaign.py --rows 150759 --coverage 0.15 --config hosts2 --out $OUT/campaign.json
    python bench/gpu_campaign.py --rows 20000 --coverage 0.05 --config hosts1 --config no-hosts --out ...

Each configuration is one `python -m jex run` in its own process, store and run folder (nothing is
cached between them: each machine has its own vLLM compile cache, and a store its own copy). Per
configuration: wall, seconds per stage (`stages.json`), engine starts and job seconds per machine
(`machines.json`), fast-pass rows/s, reason tokens/s, machine cost, and the sha256 of the capture,
the rationales and the predictions, so configurations can be compared byte for byte.

Configurations: `hosts1` (one engine host per machine), `hosts2` (two engine processes on the GPU,
starting one after the other), `hosts2-kv` (the same with a fixed 16 GiB KV cache each: the two
engines start together, beside the golden replay), `no-hosts` (every job loads its own engine: the
behaviour before engine hosts), `hosts1-fdo` (one host, `cudagraph_mode=FULL_DECODE_ONLY`: its capture
against the default mode's). A configuration may be given twice. With `--shared-store` every run
uses one store and its own suite (seed = its position), so nothing is cached between runs but the
engine's compile cache: the second run's machine starts from the first one's (`compile_cache:
restored` in its start records). `--first-seed` continues such a store in a later call (each whole
150k campaign needs most of a device call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {"hosts1": ["--engines-per-gpu", "1"], "hosts2": ["--engines-per-gpu", "2"],
           "hosts2-kv": ["--engines-per-gpu", "2", "--kv-cache-memory-gib", "16"],
           "no-hosts": ["--no-engine-hosts", "--engines-per-gpu", "1"],
           "hosts1-fdo": ["--engines-per-gpu", "1", "--cudagraph-mode", "FULL_DECODE_ONLY"]}


def run_config(config: str, name: str, a: argparse.Namespace, suite: Path, work: Path, store: Path) -> dict:
    from jex.fileio import sha256_file

    cmd = [sys.executable, "-m", "jex", "run", "--suite", str(suite), "--provider", "local", "--name", name,
           "--out", str(work / name / "runs"), "--store", str(store), "--coverage", str(a.coverage),
           "--reason-max-tokens", str(a.max_tokens), "--shard-rows", str(a.fast_shard),
           "--reason-shard-rows", str(a.reason_shard), *a.engine_args, *CONFIGS[config]]
    env = {**os.environ, "JEX_INFRA__STATE_DIR": str(work / name / "infra"),
           "JEX_INFRA__REMOTE_ROOT": str(work / name / "machines"), "PREFECT_HOME": str(work / name / "prefect")}
    t0 = time.perf_counter()
    # cwd: not the checkout, whose bare jex/ would shadow the jex namespace on a machine without `make setup`
    out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (work / f"{name}.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        return {"config": config, "run": name, "command": cmd, "ok": False, "wall_s": wall,
                "tail": (out.stdout + out.stderr)[-4000:]}
    run_dir = Path(out.stdout.strip().splitlines()[-1])
    stages = json.loads((run_dir / "stages.json").read_text())
    machines = json.loads((run_dir / "machines.json").read_text())

    def summary(stage: str) -> dict:
        return json.loads((Path(stages[stage]["folder"]) / "_SUCCESS.json").read_text())

    fast, reason = summary("fast_pass"), summary("reason")
    tokens = reason["rationale_tokens"]["mean"] * reason["rows"]
    return {"config": config, "run": name, "command": cmd, "ok": True, "wall_s": round(wall, 1),
            "stage_s": {k: v.get("seconds") for k, v in stages.items()},
            "fast_pass_rows": fast["rows"],
            "fast_pass_rows_per_s": round(fast["rows"] / stages["fast_pass"]["seconds"]),
            "reason_rows": reason["rows"], "rationale_tokens": round(tokens),
            "reason_tokens_per_s": round(tokens / stages["reason"]["seconds"]),
            "engine_starts": machines.get("engine_starts"),
            "engine_start_s": [round(r["seconds"], 1) for m in machines["machines"]
                               for r in m.get("engine_start_records", [])],
            "compile_cache": [r.get("compile_cache") for m in machines["machines"]
                              for r in m.get("engine_start_records", [])],
            "engine_start_records": [{k: r.get(k) for k in ("slot", "seconds", "queued_s", "alone", "compile_cache",
                                                            "time")}
                                     for m in machines["machines"] for r in m.get("engine_start_records", [])],
            "jobs_s": {j["job"]: j["seconds"] for m in machines["machines"] for j in m["jobs"]},
            "engine_compute": engine_compute(machines),
            "machine_life_s": [m["life_s"] for m in machines["machines"]],
            "machine_cost_usd": machines["ledger"]["total_usd"],
            "capture_sha256": fast["sha256"], "reasoned_sha256": reason["sha256"],
            "predictions_sha256": sha256_file(run_dir / "predictions.parquet"),
            "engine_stacks": fast.get("stacks"), "audit": machines.get("audit"), "golden": machines.get("golden"),
            "score": {k: json.loads((run_dir / "score.json").read_text())[k] for k in ("full", "ci")}}


def engine_compute(machines: dict) -> list[dict]:
    """Per engine process and stage job: rows it computed and its compute seconds (engine start
    excluded), from the summary line each slot prints into its job's log. A slot that found the
    stage already merged prints the merging slot's summary: such repeats are dropped."""
    out, seen = [], set()
    for m in machines["machines"]:
        for j in m["jobs"]:
            for line in j.get("log_tail", "").splitlines():
                if not line.startswith('{"stage"') or not (doc := json.loads(line)).get("compute_seconds"):
                    continue
                if (j["job"], tuple(doc["computed_shards"])) in seen:
                    continue
                seen.add((j["job"], tuple(doc["computed_shards"])))
                out.append({"job": j["job"], "rows": doc["computed_rows"], "seconds": round(doc["compute_seconds"], 2),
                            "rows_per_s": round(doc["computed_rows"] / doc["compute_seconds"])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=150_759)
    ap.add_argument("--coverage", type=float, default=0.15)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--fast-shard", type=int, default=2500)
    ap.add_argument("--reason-shard", type=int, default=500)
    ap.add_argument("--config", action="append", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--shared-store", action="store_true", help="one store for all runs, a suite seed per run")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="with --shared-store: the first run's suite seed (a later call continues a store)")
    ap.add_argument("--engine-args", default="--engine vllm --device cuda --model /tmp/smollm2 --batch-size 0 "
                                             "--max-num-seqs 512 --max-num-batched-tokens 32768",
                    help="jex run engine options (default: vLLM on the staged model, one generate per shard)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/jex-gpu-campaign"))
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.engine_args = a.engine_args.split()
    from jex.sample_suite import write_sample_suite

    a.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    seeds = range(a.first_seed, a.first_seed + len(a.config)) if a.shared_store else [0] * len(a.config)
    suites = {seed: write_sample_suite(a.work / f"suite-{a.rows}-{seed}", rows=a.rows, seed=seed) for seed in seeds}
    result = {"rows": a.rows, "coverage": a.coverage, "max_tokens": a.max_tokens, "fast_shard_rows": a.fast_shard,
              "reason_shard_rows": a.reason_shard, "shared_store": a.shared_store,
              "suite_write_s": round(time.perf_counter() - t0, 1), "runs": []}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for i, (config, seed) in enumerate(zip(a.config, seeds, strict=True)):  # JSON after each: a cut call keeps it
        name = f"{config}-{seed}" if a.shared_store else f"{config}-{i}"
        store = a.work / "store" if a.shared_store else a.work / name / "store"
        result["runs"].append(run_config(config, name, a, suites[seed], a.work, store))
        print(json.dumps(result["runs"][-1])[:2000], flush=True)
        ok = [r for r in result["runs"] if r["ok"] and not a.shared_store]  # shared store: different suites
        result["identical_across_configs"] = {k: len({r[k] for r in ok}) == 1 for k in
                                              ("capture_sha256", "reasoned_sha256", "predictions_sha256")}
        a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
