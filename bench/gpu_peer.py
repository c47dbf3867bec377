"""Issue 41: jex beside `lm_eval --model vllm` on the same tasks and GPU, each tool in its own process.

On the device, after the vLLM staging (../shared/device/README.md), the wheel folders of
`bench/device_wheels.sh` (/tmp/site2, /tmp/site3) and lm_eval's (`build_lmeval_wheels.sh`, /tmp/site4):

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/gpu_peer.py --model /tmp/smollm2 --cell text:3000 --cell letters:10000 --out $OUT/peer.json

A cell is a task shape and its rows. `text`: ARC style (0-shot "Question: ...\\nAnswer:", each choice a
phrase of several tokens, acc and acc_norm); `letters`: MMLU style (the options inside the prompt, the
letters as choices, a description and 5 solved examples first). The rows come from the sample suite's
generators (jex.sample_suite), written as lm-eval YAML over local JSONL. Per cell:

1. `lm_eval --model vllm` (vLLM's defaults, `batch_size auto`, TRITON_ATTN: the staged vLLM has no
   FlashAttention; not batch invariant, prefix caching on: what a user gets), timed from its process start;
2. `jex suite import lm-eval` then `jex run --engine vllm --device cuda --coverage 0` with no tuning
   flag (the default `local` provider: a machine process with its engine host and the golden replay),
   each timed from its process start; jex's stage seconds and engine starts from its run folder;
3. fidelity, row for row: the prompt jex's engine read is lm_eval's context, each choice's
   log-likelihood (max |d|), the argmax, acc and acc_norm.

`--repeat N` runs the pair N times, each tool on the compile cache of its previous run (a team's normal
case from the second run on; the first is cold when the machine is fresh).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

COMMON = """dataset_path: json
output_type: multiple_choice
test_split: test
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
"""
PHRASES = ("it is {} in this case", "the answer would be {}", "{}, as far as anyone can tell", "clearly {}")
"""Turn each option into a phrase of several tokens, as ARC's answers are (a one-token option is read at the
context's next position by both tools, which is not the shape under test)."""


def make_tasks(kind: str, rows: int, folder: Path) -> Path:
    """The lm-eval task YAML of a cell and its JSONL rows (test split, and a dev split for the shots)."""
    from jex.sample_suite import GENERATORS

    rng = random.Random(f"gpu-peer:{kind}")
    four = [c for c in ("arith", "capitals", "sorted_max", "weekdays", "letters")]
    docs = []
    while len(docs) < rows + 5:
        catalog = four[len(docs) % len(four)]
        prompt, options, gold = GENERATORS[catalog](rng)
        if kind == "text":
            options = [PHRASES[(len(docs) + i) % len(PHRASES)].format(o) for i, o in enumerate(options)]
        docs.append({"id": len(docs), "topic": catalog, "question": prompt, "choices": options, "answer": gold})
    folder.mkdir(parents=True, exist_ok=True)
    test, dev = folder / f"{kind}.jsonl", folder / f"{kind}-dev.jsonl"
    test.write_text("".join(json.dumps(d) + "\n" for d in docs[5:]))
    dev.write_text("".join(json.dumps(d) + "\n" for d in docs[:5]))
    task = f"peer_{kind}"
    head = f"task: {task}\ndataset_kwargs:\n  data_files:\n    test: {test}\n    dev: {dev}\n{COMMON}"
    if kind == "text":
        body = 'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
    else:
        body = ('fewshot_split: dev\nnum_fewshot: 5\nfewshot_config:\n  sampler: first_n\n'
                'description: "The following are multiple choice questions (with answers).\\n\\n"\n'
                'doc_to_text: "{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\n'
                'D. {{choices[3]}}\\nAnswer:"\ndoc_to_choice: ["A", "B", "C", "D"]\ndoc_to_target: answer\n')
    path = folder / f"{task}.yaml"
    path.write_text(head + body)
    return path


def timed(cmd: list[str], log: Path, env: dict[str, str], cwd: Path) -> float:
    """Seconds from the process's start to its exit (it must succeed); its output in `log`."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    log.write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    if done.returncode:
        raise SystemExit(f"{cmd[:4]} failed ({done.returncode}); see {log}:\n{done.stderr[-3000:]}")
    return seconds


def run_lm_eval(task: Path, model: str, out: Path, env: dict[str, str], cpu: bool) -> dict:
    backend = (["--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                "--batch_size", "8"] if cpu else
               ["--model", "vllm", "--model_args", f"pretrained={model},dtype=bfloat16,attention_backend=TRITON_ATTN,"
                "gpu_memory_utilization=0.5", "--batch_size", "auto"])
    cmd = [sys.executable, "-m", "lm_eval", "run", *backend, "--tasks", task.stem, "--include_path",
           str(task.parent), "--log_samples", "--output_path", str(out)]
    wall = timed(cmd, out.with_suffix(".log"), env, out.parent)
    (results,) = glob.glob(str(out / "*" / "results_*.json"))
    doc = json.loads(Path(results).read_text())
    return {"wall_s": wall, "evaluation_s": float(doc.get("total_evaluation_time_seconds", "nan")),
            "results": doc["results"][task.stem]}


def run_jex(task: Path, model: str, work: Path, env: dict[str, str], warm_from: Path | None, cpu: bool) -> dict:
    """Import and run in a store of its own (nothing cached) but for the compile cache of the run before,
    when `warm_from` names its store (as a team's store carries it from one campaign to the next)."""
    import shutil

    suite, store = work / "suite", work / "store"
    work.mkdir(parents=True, exist_ok=True)
    if warm_from is not None and (warm_from / "compile_cache").is_dir():
        shutil.copytree(warm_from / "compile_cache", store / "compile_cache")
    jex = [sys.executable, "-m", "jex"]
    import_s = timed([*jex, "suite", "import", "lm-eval", "--task", str(task), "--cluster", "topic", "-o",
                      str(suite), "--force"], work / "import.log", env, work)
    env = {**env, "JEX_INFRA__STATE_DIR": str(work / "infra"), "JEX_INFRA__REMOTE_ROOT": str(work / "machines"),
           "PREFECT_HOME": str(work / "prefect")}
    engine = [] if cpu else ["--engine", "vllm", "--device", "cuda"]
    run_s = timed([*jex, "run", "--suite", str(suite), "--model", model, *engine,
                   "--coverage", "0", "--name", task.stem, "--out", str(work / "runs"), "--store", str(store),
                   "--quiet"], work / "run.log", env, work)
    run_dir = Path((work / "run.log").read_text().split("\n--- stderr ---")[0].strip().splitlines()[-1])
    stages = json.loads((run_dir / "stages.json").read_text())
    machines = run_dir / "machines.json"
    return {"import_s": import_s, "run_s": run_s, "wall_s": import_s + run_s, "run_dir": str(run_dir),
            "stages": stages, "machines": json.loads(machines.read_text()) if machines.exists() else None}


def fidelity(task: str, lm_out: Path, run_dir: Path) -> dict:
    """jex's samples against lm_eval's, row for row (doc_id order)."""
    import polars as pl

    (path,) = glob.glob(str(lm_out / "*" / f"samples_{task}_*.jsonl"))
    lm = sorted((json.loads(x) for x in Path(path).read_text().splitlines()), key=lambda s: s["doc_id"])
    frame = pl.read_parquet(run_dir / "samples.parquet").filter(pl.col("catalog") == task)
    ours = sorted(frame.iter_rows(named=True), key=lambda r: json.loads(r["metadata"])["doc_id"])
    prompts = argmax = 0
    worst = 0.0
    for s, r in zip(lm, ours, strict=True):
        prompts += {a["arg_0"] for a in s["arguments"].values()} != {r["prompt"]}
        theirs = [float(x[0][0]) for x in s["resps"]]
        mine = list(r["choice_loglikelihoods"])
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, theirs, strict=True)))
        argmax += max(range(len(mine)), key=mine.__getitem__) != max(range(len(theirs)), key=theirs.__getitem__)
    return {"rows": len(lm), "prompt_differences": prompts, "argmax_differences": argmax, "max_abs_d_loglik": worst}


def jex_metrics(run_dir: Path, out: Path, env: dict[str, str], task: str) -> dict:
    """acc and acc_norm as `jex export lm-eval` writes them."""
    timed([sys.executable, "-m", "jex", "export", "lm-eval", str(run_dir), "-o", str(out)], out.with_suffix(".log"),
          env, out.parent)
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(results).read_text())["results"][task]


def cell(kind: str, rows: int, a: argparse.Namespace, work: Path, env: dict[str, str], done: list[dict]) -> dict:
    task = make_tasks(kind, rows, work / f"tasks-{kind}")
    runs: list[dict] = []
    done.append({"cell": kind, "rows": rows, "runs": runs})
    for n in range(a.repeat):
        here = work / f"{kind}-{n}"
        here.mkdir(parents=True, exist_ok=True)
        lm = run_lm_eval(task, a.model, here / "lm", env, a.cpu)
        before = work / f"{kind}-{n - 1}" / "jex-run" / "store" if n else None
        ours = run_jex(task, a.model, here / "jex-run", env, before, a.cpu)
        run_dir = Path(ours["run_dir"])
        fid = fidelity(task.stem, here / "lm", run_dir)
        metrics = jex_metrics(run_dir, here / "export", env, task.stem)
        same = {m: metrics.get(m) == lm["results"].get(m) for m in ("acc,none", "acc_norm,none")}
        runs.append({"repeat": n, "lm_eval": lm, "jex": ours, "fidelity": fid, "jex_metrics": metrics,
                     "metrics_equal": same, "jex_over_lm_eval": ours["wall_s"] / lm["wall_s"]})
        print(json.dumps({"cell": f"{kind}:{rows}", "repeat": n, "lm_eval_s": round(lm["wall_s"], 1),
                          "jex_s": round(ours["wall_s"], 1), "ratio": round(runs[-1]["jex_over_lm_eval"], 3),
                          **fid, **same}), flush=True)
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "cells": done}, indent=2, default=str))
    return done[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="bf16 model folder both tools read")
    p.add_argument("--cell", action="append", required=True, help="text:ROWS or letters:ROWS (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each pair (the later ones on warm caches)")
    p.add_argument("--cpu", action="store_true", help="a smoke run of this harness: lm_eval's HF backend and "
                                                       "jex's HF engine on the CPU, fp32 (--model: an HF folder)")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-peer"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    cells: list[dict] = []
    for spec in a.cell:
        kind, rows = spec.split(":")
        cell(kind, int(rows), a, a.work, env, cells)


if __name__ == "__main__":
    main()
