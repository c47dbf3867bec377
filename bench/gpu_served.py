"""Issue 56, item 5 (the GPU half): a model served by `vllm serve` against jex's in-process vLLM engine.

The same tasks as `bench/gpu_peer.py` (`gsm8k`: GSM8K-shaped generation, greedy; `text` / `letters`:
ARC- and MMLU-shaped multiple choice) run twice by jex, each in a store of its own:

1. in process: `jex run --engine vllm --device cuda` (the default `local` provider, batch invariant);
2. served: `vllm serve MODEL` started here with `VLLM_BATCH_INVARIANT=1` and the in-process engine's settings
   (bf16, TRITON_ATTN, prefix caching off, seed 0), then `jex run --engine openai --base-url URL --model MODEL
   --max-concurrency N` (greedy generations through `/v1/completions`; multiple choice through completions
   with the prompt's log-probabilities, `echo` + `logprobs`).

Reported per cell, row for row: generative cells, the rows whose generated text differs and each filter's
exact_match by both; multiple-choice cells, each choice's log-likelihood (max |d|) and the rows whose argmax
differs. And the wall of each run, the server's start (from its process start to its first `/v1/models`
answer) apart. On the device, after the staging of `bench/gpu_peer.py`:

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/gpu_served.py --model /tmp/smollm2 --cell gsm8k:1319 --cell letters:2000 \\
        --jex-args "--audit off" --out $OUT/served.json

`--warm-store` gives the in-process runs a store's compile cache; `--reuse` reads back runs an earlier call left
under `--work`. `--cpu`: a smoke run of the harness with `transformers serve` and jex's HF engine (`gsm8k`
cells only: `transformers serve` returns no prompt log-probabilities, and jex refuses its multiple choice).
"""

from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_peer  # noqa: E402  (the tasks, the runners and the samples readers)

VLLM_CLI = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; main()"
"""`vllm` (its console script: the staged vLLM is a folder on PYTHONPATH, without the script)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`vllm serve` (or, with `cpu`, `transformers serve`) of `model` on 127.0.0.1, its output in `log`."""

    def __init__(self, model: str, log: Path, env: dict[str, str], cpu: bool, gpu_memory_utilization: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        if cpu:
            cmd = [str(Path(sys.executable).with_name("transformers")), "serve", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--device", "cpu", "--dtype", "float32"]
        else:  # the in-process engine's settings (engine/vllm_engine.py: VLLMProfile), batch invariant
            cmd = [sys.executable, "-c", VLLM_CLI, "serve", model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", "bfloat16", "--attention-backend", "TRITON_ATTN",
                   "--no-enable-prefix-caching", "--seed", "0",
                   "--gpu-memory-utilization", str(gpu_memory_utilization)]
            env = {**env, "VLLM_BATCH_INVARIANT": "1"}
        self.cmd, self.log = cmd, log
        log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        self.process = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited ({self.process.returncode}): {log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as answer:
                    self.models = json.load(answer)
                    break
            except OSError:
                time.sleep(0.5)
        else:
            self.stop()
            raise SystemExit(f"the server did not answer in 600 s: {log.read_text()[-3000:]}")
        self.start_s = time.perf_counter() - t0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def compare(kind: str, task: str, local: Path, served: Path) -> dict:
    """The served run's rows against the in-process run's, by doc_id."""
    ours, theirs = gpu_peer.jex_rows(local, task), gpu_peer.jex_rows(served, task)
    if set(ours) != set(theirs):
        raise SystemExit(f"the in-process run has {len(ours)} rows of {task}, the served one {len(theirs)}")
    if kind == "gsm8k":
        return {"rows": len(ours), "prompt_differences": sum(ours[d]["prompt"] != theirs[d]["prompt"] for d in ours),
                "generation_differences": gpu_peer.differing({d: r["generation"] for d, r in ours.items()},
                                                             {d: r["generation"] for d, r in theirs.items()}),
                "finish_reason_differences": sum(ours[d]["finish_reason"] != theirs[d]["finish_reason"] for d in ours)}
    worst, argmax, missing = 0.0, 0, 0
    for d, r in ours.items():
        mine, other = r["choice_loglikelihoods"], theirs[d]["choice_loglikelihoods"]
        if mine is None or other is None:
            missing += 1
            continue
        worst = max(worst, *(abs(a - b) for a, b in zip(mine, other, strict=True)))
        argmax += max(range(len(mine)), key=mine.__getitem__) != max(range(len(other)), key=other.__getitem__)
    return {"rows": len(ours), "max_abs_d_loglik": worst, "argmax_differences": argmax, "rows_unread": missing}


def scores(results: dict) -> dict:
    """A run's acc, acc_norm and exact_match by filter (`jex export lm-eval`'s results, less the rest)."""
    return {k: v for k, v in results.items() if k.startswith(("acc,", "acc_norm,", "exact_match,"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="bf16 model folder (jex reads it, the server serves it)")
    p.add_argument("--cell", action="append", required=True, help="gsm8k:ROWS, text:ROWS or letters:ROWS")
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--max-concurrency", type=int, default=256, help="jex's requests in flight to the server")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the server's (jex's default is 0.3)")
    p.add_argument("--jex-args", type=shlex.split, default=[], help="more `jex run` flags for every run, one string")
    p.add_argument("--warm-store", type=Path, help="a store whose compile cache the first in-process run starts from")
    p.add_argument("--reuse", action="store_true", help="read back each run an earlier call left under --work")
    p.add_argument("--cpu", action="store_true", help="a smoke run: transformers serve and jex's HF engine")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-served"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    env = gpu_peer.bench_env()
    doc: dict = {"command": " ".join(sys.argv), "cells": []}
    save = gpu_peer.recorder(a.out, doc)

    tasks = []
    warm = a.warm_store
    for spec in a.cell:  # every in-process run first: the server then has the GPU to itself
        kind, rows = spec.split(":")
        task = gpu_peer.make_tasks(kind, int(rows), a.work / f"tasks-{kind}", a.max_gen_toks)
        cluster = None if kind == "gsm8k" else "topic"
        local = gpu_peer.run_jex(task, a.model, a.work / f"{kind}-local", env, warm, a.cpu, a.jex_args, cluster,
                                 a.reuse)
        warm = a.work / f"{kind}-local" / "store"
        tasks.append((kind, int(rows), task, cluster, local))
        save(cell=spec, run="in-process", wall_s=round(local["wall_s"], 1))
    server: Server | None = None
    try:
        for kind, rows, task, cluster, local in tasks:
            folder, engine_key = a.work / f"{kind}-served", ["openai", str(a.max_concurrency)]  # not the URL's port
            key = gpu_peer.jex_run_key(task, a.model, a.cpu, a.jex_args, cluster, None, engine_key)
            served = gpu_peer.reused(folder, a.reuse, key)  # an earlier call's run needs no server
            if served is None:
                if server is None:
                    server = Server(a.model, a.work / "server.log", env, a.cpu, a.gpu_memory_utilization)
                    doc["server"] = {"command": server.cmd, "start_s": server.start_s, "models": server.models}
                    save(run="server", start_s=round(server.start_s, 1))
                served = gpu_peer.run_jex(task, a.model, folder, env, None, a.cpu, a.jex_args, cluster, a.reuse,
                                          engine=["--engine", "openai", "--base-url", server.url,
                                                  "--max-concurrency", str(a.max_concurrency)], engine_key=engine_key)
            diff = compare(kind, task.stem, Path(local["run_dir"]), Path(served["run_dir"]))
            metrics = {name: scores(gpu_peer.jex_metrics(Path(run["run_dir"]), a.work / f"{kind}-{name}-export", env,
                                                         task.stem))
                       for name, run in (("local", local), ("served", served))}
            doc["cells"].append({"cell": kind, "rows": rows, "in_process": local, "served": served,
                                 "differences": diff, "metrics": metrics,
                                 "served_over_in_process": served["wall_s"] / local["wall_s"]})
            save(cell=f"{kind}:{rows}", in_process_s=round(local["wall_s"], 1), served_s=round(served["wall_s"], 1),
                 **diff, metrics_equal=metrics["local"] == metrics["served"])
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
