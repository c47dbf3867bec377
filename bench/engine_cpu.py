"""CPU readout throughput of the HF engine on the embedded model: batch 1 and 8, invariant on and off.

    .venv/bin/python bench/engine_cpu.py [--rows 64] [--out bench/out/engine_cpu.json]
All four arms run in one process on the same rows, side by side, so the ratios are meaningful on a
noisy machine; each arm is timed twice and the faster run kept.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from jex.engine.hf import HFEngine  # noqa: E402
from jex.sample_suite import write_sample_suite  # noqa: E402
from jex.suite import iter_rows  # noqa: E402
from jex.tasks.capture.engine_calls import fast_pass  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--out", default="bench/out/engine_cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(iter_rows(write_sample_suite(Path(tmp) / "s", rows=max(args.rows, 18))))[: args.rows]
    engines = {"invariant": HFEngine(batch_invariant=True), "batched": HFEngine(batch_invariant=False)}
    results = {}
    for mode, engine in engines.items():
        fast_pass(engine, rows[:4])  # warm-up
        for batch in (1, 8):
            engine.batch_size = batch
            best = min(_timed(engine, rows) for _ in range(2))
            results[f"{mode}_batch{batch}"] = {"rows_per_s": len(rows) / best, "seconds": best,
                                               "effective_batch": engine.batch_size}
    base = results["batched_batch1"]["rows_per_s"]
    for v in results.values():
        v["relative_to_batched_batch1"] = v["rows_per_s"] / base
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": len(rows), "results": results,
                                          "threads": __import__("torch").get_num_threads()}, indent=1))
    for k, v in results.items():
        print(f"{k:20s} {v['rows_per_s']:7.2f} rows/s  ({v['relative_to_batched_batch1']:.2f}x)")


def _timed(engine: HFEngine, rows: list) -> float:
    t0 = time.perf_counter()
    fast_pass(engine, rows)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
