"""Issue 54: what vLLM's architecture inspection costs an engine's first start, and what `inspect_here` saves.

vLLM inspects a model class it holds no record of (`VLLM_CACHE_ROOT/modelinfos`) in a fresh Python process;
`jex.engine.vllm_engine.inspect_here` registers the in-tree class so that vLLM inspects it in the engine's own
process. Each start runs in a process of its own (importing vLLM is part of a start), under one cache root
whose compile caches a first (warm-up) start fills and whose `modelinfos` is removed before every start:
the arms differ only in where the inspection runs. On the GPU device, after the staging:
    source /tmp/stage/env.sh && source bench/device_jex.sh
    python3 bench/gpu_start.py --model /tmp/smollm2 --work /tmp/gs --repeats 2 --out $OUT/start.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ARMS = ("vllm-subprocess", "inspect-here")


def child(arm: str, model: Path) -> None:
    began = time.perf_counter()
    import jex.engine.vllm_engine as vllm_engine

    if arm == "vllm-subprocess":
        vllm_engine.inspect_here = lambda vllm, model: None
    engine = vllm_engine.VLLMEngine(model, vllm_engine.VLLMProfile.of(gpu_memory_utilization=0.3))
    ready = time.perf_counter()
    print(json.dumps({"arm": arm, "start_s": round(ready - began, 2), "max_context": engine.max_context}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--child", choices=ARMS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model)
    cache = args.work / "vllm-cache"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(cache), "TRITON_CACHE_DIR": str(args.work / "triton")}
    plan = [("warm-up", "inspect-here")] + [(f"r{i}", arm) for i in range(args.repeats) for arm in ARMS]
    runs = []
    for label, arm in plan:
        shutil.rmtree(cache / "modelinfos", ignore_errors=True)
        began = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--model", str(args.model), "--work", str(args.work),
                               "--out", str(args.out), "--child", arm], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - began
        log = args.work / f"{label}-{arm}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)
        last = [line for line in done.stdout.splitlines() if line.startswith("{")]
        run = {"label": label, "arm": arm, "rc": done.returncode, "wall_s": round(wall, 2),
               **(json.loads(last[-1]) if last else {}),
               "modelinfos_written": sorted(p.name for p in (cache / "modelinfos").glob("*"))}
        runs.append(run)
        print(json.dumps(run), flush=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
