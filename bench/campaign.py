"""Campaign benchmarks (issue 4), all in one run on this machine.

    .venv/bin/python bench/campaign.py [--out bench/out/campaign.json]
1. The main job (`jex run` on the embedded defaults) from a cold store: wall time, and per stage.
2. The same campaign again, capture cached: wall time as a fraction of the first (target < 5%).
3. Orchestration overhead, everything cached, in one process: the Prefect flow against the same
   stage functions called directly (target: overhead < 15 s or < 1.2x, whichever is larger).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def direct(spec) -> float:
    """The stage functions in order, no Prefect (all stored already)."""
    from jex.overlays.loading import load_rules
    from jex.tasks import decision_stages as c
    from jex.tasks.campaign_spec import sample_suite_dir
    from jex.tasks.capture import stages as s
    from jex.tasks.outputs.run_folder import write_run_folder
    from jex.tasks.records import CampaignSummaries
    from jex.tasks.store import LocalStore

    t0 = time.perf_counter()
    store = LocalStore(spec.store)
    out = CampaignSummaries()
    out.bundle = s.bundle_stage(store, suite=spec.suite or sample_suite_dir(spec), reference=spec.reference)
    out.fast_pass = s.fast_pass_stage(store, bundle=out.bundle, engine=spec.engine, shard_rows=spec.fast_shard_rows)
    out.gate = c.gate_stage(store, bundle=out.bundle, fast=out.fast_pass, coverage=spec.coverage,
                            per_catalog_cap=spec.per_catalog_cap)
    out.reason = s.reason_stage(store, bundle=out.bundle, gate=out.gate, engine=spec.engine,
                                max_tokens=spec.reason_max_tokens, shard_rows=spec.reason_shard_rows)
    out.fold = c.fold_stage(store, bundle=out.bundle, fast=out.fast_pass, gate=out.gate, reason=out.reason,
                            rule=spec.fold_rule, weight=spec.fold_weight, draws=spec.bootstrap_draws,
                            seed=spec.bootstrap_seed)
    out.calibrate = c.calibrate_stage(store, bundle=out.bundle, fold=out.fold, folds=spec.calibration_folds)
    rules, sha = load_rules(spec.overlays)
    out.overlay = c.overlay_stage(store, calibrated=out.calibrate, rules=rules, rules_sha256=sha)
    out.score = c.score_stage(store, bundle=out.bundle, overlay=out.overlay, fold=out.fold,
                              draws=spec.bootstrap_draws, seed=spec.bootstrap_seed)
    write_run_folder(Path(tempfile.mkdtemp()), out, spec.model_dump(mode="json"), {})
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/campaign.json")
    p.add_argument("--work", default=None, help="reuse this folder (skips nothing: the store decides)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="jex-bench-"))
    env = {**os.environ, "PREFECT_HOME": str(work / "prefect"), "JEX_INFRA__STATE_DIR": str(work / "infra")}
    cmd = [str(ROOT / ".venv/bin/jex"), "run", "--out", str(work)]
    res = {}
    for name in ("first_run", "cached_rerun"):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        res[name] = {"wall_seconds": time.perf_counter() - t0}
        run_dir = Path(proc.stdout.strip().splitlines()[-1])
        # this run's own stage times (a cached report keeps the times of the run that rendered it)
        res[name]["stages"] = {k: v["seconds"] for k, v in json.loads((run_dir / "stages.json").read_text()).items()}
        res[name]["sha256"] = {f: sha256_file(run_dir / f)[:16] for f in ("predictions.parquet", "samples.parquet")}
    res["rerun_fraction"] = res["cached_rerun"]["wall_seconds"] / res["first_run"]["wall_seconds"]
    # in-process overhead, everything cached
    os.environ["PREFECT_HOME"] = str(work / "prefect")
    from jex.flows.campaign import campaign
    from jex.flows.local_api import ensure_local_api
    from jex.tasks.campaign_spec import load_spec

    ensure_local_api()
    spec = load_spec(run_dir)
    direct_s = min(direct(spec) for _ in range(2))
    from prefect.testing.utilities import prefect_test_harness

    t0 = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=120):
        harness_start = time.perf_counter() - t0
        flow_s = []
        for _ in range(2):
            t1 = time.perf_counter()
            campaign(spec)
            flow_s.append(time.perf_counter() - t1)
    res["overhead"] = {"direct_seconds": direct_s, "flow_seconds": min(flow_s), "api_start_seconds": harness_start,
                       "overhead_seconds": min(flow_s) - direct_s, "ratio": min(flow_s) / direct_s}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
