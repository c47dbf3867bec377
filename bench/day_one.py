"""Issue 54: a team's first and later campaigns of a model beside `lm_eval --model vllm`, same GPU, same lease.

On the device, after the vLLM staging (../shared/device/README.md), the wheel folders of
`bench/device_wheels.sh` and lm_eval's (`build_lmeval_wheels.sh`):

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/day_one.py --model /tmp/smollm2 --cell gsm8k:1319 --work /tmp/d1 --out $OUT/day-one.json

Per cell (a task shape of `bench/gpu_peer.py` and its rows), each tool in its own process, timed from its start
(in the order 2, 1, 3: a jex run that fails costs no lm_eval run):
1. `lm_eval --model vllm` (vLLM's defaults, TRITON_ATTN, `batch_size auto`); with `--cold` first, vLLM's own
   compile cache on the machine (~/.cache/vllm) is emptied, so its first cell of a model starts cold;
2. jex "first": `jex run` (default `local` provider, settings audit on by default for vLLM) on a fresh store:
   the model's first campaign, audit included, no compile cache (with `--first-store`, a fine-tune's first
   campaign: the base's store's stored audit and compile cache carried over);
3. jex "later": the same model's next campaign, on a store that holds no result of this task: only the
   compile cache and the stored audit of the first run's store (or `--later-store`'s) are carried over, as a
   team's store carries them from one task's campaign to the next.
Phases of each jex run from its run folder: the audit's probe, the engine start (libraries imported and the
engine started), the golden job (less the two), the engine work (the stage jobs) and everything else (the
temporary Prefect server, bootstrap, bundle, collection, decision stages, report). Differences against
lm_eval's samples, row for row: generations for `gsm8k`, argmax for the multiple-choice shapes.

`--reuse` reads back a run whose folder under `--work` holds its result (an earlier call's), so the cells of one
model can be spread over several device calls with the same `--work`; `--cpu`: a smoke run on this machine
(lm_eval's HF backend, jex's HF engine).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_peer import (  # noqa: E402 - the harness beside this one: tasks, timed runs, fidelity
    fidelity,
    generation_fidelity,
    make_tasks,
    run_jex,
    run_lm_eval,
)


def phases(result: dict) -> dict[str, float]:
    """Seconds of a jex run by phase, from its machines.json and the golden job's probe outcome."""
    machines = result.get("machines") or {}
    audit_s = start_s = golden_s = work_s = 0.0
    for m in machines.get("machines", []):
        starts = m.get("engine_start_records") or []
        start_s += sum(s.get("seconds", 0.0) + s.get("import_s", 0.0) for s in starts)
        for job in m.get("jobs", []):
            if job["job"].startswith("golden"):
                golden_s += job.get("seconds") or 0.0
            elif not job["job"].startswith("lab"):
                work_s += job.get("seconds") or 0.0
    store = Path(result["run_dir"]).parent.parent / "store"
    for probe in store.glob(".machines/*/golden/audit/probe.json"):
        audit_s += json.loads(probe.read_text()).get("seconds", 0.0)
    golden_s = max(0.0, golden_s - audit_s - start_s)  # the golden job holds the engine start and the probe
    wall = result["wall_s"]
    return {"audit": round(audit_s, 1), "engine_start": round(start_s, 1), "golden": round(golden_s, 1),
            "work": round(work_s, 1), "everything_else": round(wall - audit_s - start_s - golden_s - work_s, 1)}


def probes_of(result: dict) -> list[dict]:
    """The settings audit's probe outcomes (`probe.json`) of a jex run: how long it held the campaign and whether
    its control started beside the campaign's engine."""
    store = Path(result["run_dir"]).parent.parent / "store"
    return [json.loads(p.read_text()) for p in sorted(store.glob(".machines/*/golden/audit/probe.json"))]


def audit_of(result: dict) -> dict | None:
    audit = (result.get("machines") or {}).get("audit")
    if not audit:
        return None
    return {k: audit.get(k) for k in ("key", "arm", "passed", "powered", "scale", "reused", "control_reused",
                                      "ladder", "verdict", "model")}


def differences(kind: str, task: str, lm_out: Path, run_dir: Path) -> int:
    """Rows whose generation (gsm8k) or argmax (multiple choice) differs from lm_eval's."""
    if kind == "gsm8k":
        return int(generation_fidelity(task, lm_out, run_dir)["generation_differences"])
    return int(fidelity(task, lm_out, run_dir)["argmax_differences"])


def one_cell(kind: str, rows: int, a: argparse.Namespace, env: dict[str, str]) -> dict:
    work = a.work / f"{kind}-{rows}"
    task = make_tasks(kind, rows, work / "tasks", a.max_gen_toks) if kind == "gsm8k" else \
        make_tasks(kind, rows, work / "tasks")
    cell: dict = {"task": kind, "model": a.model_name or a.model, "rows": rows}
    cluster = None if kind == "gsm8k" else "topic"
    first = None  # jex's own compile caches live in its store and machine folders, never in ~/.cache/vllm
    if not a.skip_first:
        first = run_jex(task, a.model, work / "jex-first", env, a.first_store, a.cpu, a.jex_args, cluster, a.reuse)
        cell |= {"jex_first_s": round(first["wall_s"], 1), "phases_first": phases(first), "audit_first":
                 audit_of(first), "probes_first": probes_of(first), "first_run_dir": first["run_dir"]}
        print(json.dumps({"cell": f"{kind}:{rows}", "jex_first_s": cell["jex_first_s"],
                          "phases": cell["phases_first"], "audit": cell["audit_first"]}), flush=True)
    if a.cold:  # lm_eval's first cell of the model on this machine: no vLLM compile cache of an earlier run
        shutil.rmtree(Path.home() / ".cache" / "vllm", ignore_errors=True)
    lm = run_lm_eval(task, a.model, work / "lm", env, a.cpu, reuse=a.reuse)
    cell |= {"lm_eval_s": round(lm["wall_s"], 1), "lm_eval_cold_compile_cache": a.cold}
    print(json.dumps({"cell": f"{kind}:{rows}", "lm_eval_s": cell["lm_eval_s"]}), flush=True)
    if first is not None:
        cell["generations_or_argmax_differ"] = differences(kind, task.stem, work / "lm", Path(first["run_dir"]))
    if a.lm_eval_invariant:  # lm_eval as jex runs vLLM: its samples are what jex's must equal, row for row
        lm_bi = run_lm_eval(task, a.model, work / "lm-invariant", env, a.cpu, reuse=a.reuse, invariant=True)
        cell["lm_eval_invariant_s"] = round(lm_bi["wall_s"], 1)
        print(json.dumps({"cell": f"{kind}:{rows}", "lm_eval_invariant_s": cell["lm_eval_invariant_s"]}), flush=True)
    later_store = a.later_store or (work / "jex-first" / "store" if not a.skip_first else None)
    if later_store is not None and not a.skip_later:
        later = run_jex(task, a.model, work / "jex-later", env, later_store, a.cpu, a.jex_args, cluster, a.reuse)
        cell |= {"jex_later_s": round(later["wall_s"], 1), "phases_later": phases(later),
                 "audit_later": audit_of(later), "later_run_dir": later["run_dir"], "later_store_from":
                 str(later_store)}
        cell.setdefault("generations_or_argmax_differ",
                        differences(kind, task.stem, work / "lm", Path(later["run_dir"])))
        print(json.dumps({"cell": f"{kind}:{rows}", "jex_later_s": cell["jex_later_s"],
                          "phases": cell["phases_later"], "audit": cell["audit_later"]}), flush=True)
    jex_run = first["run_dir"] if first is not None else cell.get("later_run_dir")
    if a.lm_eval_invariant and jex_run is not None:
        cell["differ_from_invariant_lm_eval"] = differences(kind, task.stem, work / "lm-invariant", Path(jex_run))
    for key in ("jex_first_s", "jex_later_s"):
        if key in cell:
            cell[key.replace("_s", "_over_lm_eval")] = round(cell[key] / cell["lm_eval_s"], 3)
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="bf16 model folder both tools read")
    p.add_argument("--model-name", help="how the results name the model (default: its path)")
    p.add_argument("--cell", action="append", required=True, help="KIND:ROWS, KIND one of gsm8k, text, letters")
    p.add_argument("--later-store", type=Path, help="the store whose compile cache and stored audit each cell's "
                                                    "'later' campaign starts from (default: the cell's first run's)")
    p.add_argument("--first-store", type=Path, help="the store of a measured base whose stored audit (and compile "
                                                    "cache) the first campaign starts from: the model is its "
                                                    "fine-tune, of the same architecture shape")
    p.add_argument("--skip-later", action="store_true", help="no later campaign")
    p.add_argument("--skip-first", action="store_true", help="only lm_eval and the later campaign")
    p.add_argument("--cold", action="store_true", help="empty vLLM's compile cache before lm_eval's run")
    p.add_argument("--lm-eval-invariant", action="store_true",
                   help="also run lm_eval batch invariant (VLLM_BATCH_INVARIANT=1, prefix caching off) and count "
                        "jex's differences from it")
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--jex-args", type=lambda s: s.split(), default=[])
    p.add_argument("--work", type=Path, default=Path("/tmp/day-one"))
    p.add_argument("--reuse", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    started = time.time()
    cells = []
    for spec in a.cell:
        kind, rows = spec.split(":")
        cells.append(one_cell(kind, int(rows), a, env))
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "started": started, "cells": cells}, indent=2,
                                    default=str))


if __name__ == "__main__":
    main()
