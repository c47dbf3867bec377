"""Machines on a GPU (issues 6 and 7): golden replay and data-parallel fast pass with vLLM, 1 vs 2 workers.

    python bench/gpu_fleet.py --model /tmp/smollm2 --out $OUT/gpu-fleet.json

Runs the orchestrator's machine lifecycle with the local provider on a GPU host: each machine is
bootstrapped, replays the golden rows, computes its shards of the fast pass with vLLM (audit profile,
batch invariant) and is torn down. Run A (1 worker) establishes the golden reference; run B (2
workers, two engines sharing the GPU) replays against it and must merge to the same capture bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="vLLM: the converted bf16 folder (default: embedded, HF only)")
    ap.add_argument("--kind", default="vllm", help="vllm, or hf for a CPU dry run of the same path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=360)
    ap.add_argument("--shard-rows", type=int, default=32)
    ap.add_argument("--golden-rows", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one-gpu", action="store_true", help="workers share one GPU: run their jobs one after another "
                    "(two vLLM engines starting on one GPU each count the other's memory against their budget)")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jex-gpu-fleet-"))
    os.environ.update({"JEX_INFRA__STATE_DIR": str(work / "infra"), "JEX_INFRA__POLL_S": "1",
                       "JEX_INFRA__HEARTBEAT_S": "2", "JEX_INFRA__HEARTBEAT_TIMEOUT_S": "300",
                       "JEX_INFRA__WORKER_PYTHON": sys.executable})
    from jex.engine_spec import EngineSpec
    from jex.fileio import sha256_file
    from jex.flows.machines.fleet import GpuFleet, JobFailed
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs
    from jex.tasks.store import LocalStore

    suite = write_sample_suite(work / "suite", rows=a.rows, seed=0)
    engine = EngineSpec(kind=a.kind, model=a.model, device=a.device, max_num_seqs=64, batch_size=64)
    result: dict = {"rows": a.rows, "shard_rows": a.shard_rows, "golden_rows": a.golden_rows, "runs": {}}
    first_store: Path | None = None
    for n in a.workers:
        store = LocalStore(work / f"store-{n}")
        if first_store is not None:  # the reference the first run established travels with the campaign store
            shutil.copytree(first_store / "golden", store.root / "golden")
        bundle = bundle_stage(store, suite=suite)
        job = EngineJob(inputs=FastPassInputs(bundle=bundle, engine=engine, shard_rows=a.shard_rows),
                        store=str(store.root))
        t0 = time.time()
        lines: list[str] = []
        spec = MachinesSpec(provider="local", workers=n, golden_rows=a.golden_rows, concurrent=not a.one_gpu)
        fleet = GpuFleet(spec, campaign=f"gpu-{n}",
                         store=str(store.root), settings=load_settings(), echo=lines.append)
        try:
            with fleet:
                fast = fast_pass_stage(store, fleet.run_stage(job).inputs)
        except JobFailed as e:
            result["runs"][str(n)] = {"error": str(e), "log_tail": e.outcome.log_tail[-4000:],
                                      "report": fleet.report().model_dump(mode="json")}
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
            print(str(e), e.outcome.log_tail[-3000:])
            raise
        rep = fleet.report().model_dump(mode="json")
        result["runs"][str(n)] = {
            "wall_s": round(time.time() - t0, 1), "capture_sha256": fast.sha256,
            "capture_file_sha256": sha256_file(fast.capture), "rows": fast.rows,
            "readout_errors": fast.readout_errors, "engine": fleet.engine_fp,
            "golden": [{k: g[k] for k in ("machine", "ok", "max_abs_dp", "established", "rows")}
                       for g in rep["golden"]],
            "machines": [{"id": m["machine"]["id"], "life_s": m["life_s"], "teardown": m["teardown"],
                          "jobs": [(j["job"], j["status"], len(j["artifacts"]), j["seconds"]) for j in m["jobs"]],
                          "stack": (m["provenance"] or {}).get("stack"), "gpus": (m["provenance"] or {}).get("gpus")}
                         for m in rep["machines"]],
            "left_running": [m.id for m in fleet.provider.list_machines()], "log_tail": lines[-8:]}
        print(json.dumps(result["runs"][str(n)], default=str)[:2000], flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
        first_store = first_store or store.root
    shas = {r["capture_sha256"] for r in result["runs"].values()}
    result["byte_identical_across_worker_counts"] = len(shas) == 1
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print("byte identical:", result["byte_identical_across_worker_counts"])


if __name__ == "__main__":
    main()
