"""CPU cost of the loglikelihood readout: jex's continuation readout vs its label-slot readout on the same
rows, and vs lm-eval's own HF backend (`HFLM.loglikelihood`) on the same (context, continuation) requests.

    OMP_NUM_THREADS=1 .venv/bin/python bench/loglikelihood.py [--rows 50] [--repeats 1] [--out FILE.md]

The rows are the embedded sample suite's, written as lm-eval's MMLU-style verbatim prompts (question,
lettered options, "Answer:"). Arms, in one process, in turn, each timed `--repeats` times (the fastest kept):
- `label_slot`: the label tokens " A", " B", ... read after the prompt (one forward per row);
- `continuation_letters`: the continuation readout with the letters as the options (one token each: one
  forward per row, the label slot's computation);
- `continuation_texts`: the continuation readout of each option's text (one forward per option);
- `lm_eval_hflm_texts` / `lm_eval_hflm_letters`: lm-eval 0.4.13's HFLM on the same requests, batch size 1
  (as jex's batch-invariant engine) and 8.
Every arm's log-likelihoods are compared with lm-eval's (max |difference|).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from jex.engine.hf import HFEngine
from jex.engine.types import ReadoutMode, ReadoutRequest
from jex.sample_suite import write_sample_suite
from jex.suite import iter_rows


def requests(n: int) -> list[ReadoutRequest]:
    with tempfile.TemporaryDirectory() as tmp:
        rows = list(iter_rows(write_sample_suite(Path(tmp) / "s", rows=max(n, 18))))[:n]
    out = []
    for r in rows:
        shown = "\n".join(f"{lab}. {opt}" for lab, opt in zip(r.labels, r.options, strict=True))
        out.append(ReadoutRequest(r.run_id, f"{r.prompt}\n{shown}\nAnswer:", tuple(r.labels), tuple(r.options)))
    return out


REPEATS = 1


def timed(fn: Any) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds of this process, result) of the fastest of `REPEATS` runs: on a shared
    machine the CPU seconds are the steadier figure."""
    best, cpu, out = float("inf"), float("inf"), None
    for _ in range(REPEATS):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall = time.perf_counter() - start
        if wall < best:
            best, cpu = wall, time.process_time() - start_cpu
    return best, cpu, out


def lm_eval_arm(lm: Any, reqs: list[ReadoutRequest], letters: bool) -> list[float]:
    from lm_eval.api.instance import Instance

    pairs = [(r.prompt, " " + o) for r in reqs for o in (r.labels if letters else r.options)]
    return [ll for ll, _ in lm.loglikelihood([Instance("multiple_choice", {}, p, 0) for p in pairs],
                                             disable_tqdm=True)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=50)
    p.add_argument("--out", default="bench/results/loglikelihood-cpu.md")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    global REPEATS
    REPEATS = args.repeats
    from lm_eval.models.huggingface import HFLM

    reqs = requests(args.rows)
    letters = [ReadoutRequest(r.run_id, r.prompt, r.labels, r.labels) for r in reqs]
    engine = HFEngine()
    engine.readout(reqs[:2])  # warm-up
    choices = sum(len(r.options) for r in reqs)
    arms: dict[str, tuple[float, float, list[float]]] = {}
    for name, fn in (("label_slot", lambda: engine.readout(letters)),
                     ("continuation_letters", lambda: engine.readout(letters, ReadoutMode.OPTION_CONTINUATION)),
                     ("continuation_texts", lambda: engine.readout(reqs, ReadoutMode.OPTION_CONTINUATION))):
        seconds, cpu, got = timed(fn)
        arms[name] = (seconds, cpu, [x for g in got for x in g.raw_logprobs])
        print(f"{name}: {seconds:.2f} s, {cpu:.2f} CPU s", flush=True)
    lm = HFLM(pretrained=str(engine.path), device="cpu", batch_size=1, dtype="float32")
    for batch in (1, 8):
        lm.batch_size_per_gpu = batch
        for kind in ("letters", "texts"):
            arms[f"lm_eval_hflm_{kind}_batch{batch}"] = timed(
                lambda k=kind: lm_eval_arm(lm, reqs, k == "letters"))
            print(f"lm_eval {kind} batch {batch}: {arms[f'lm_eval_hflm_{kind}_batch{batch}'][:2]}", flush=True)
    write_report(Path(args.out), arms, rows=len(reqs), choices=choices, argv=sys.argv)


def write_report(path: Path, arms: dict[str, tuple[float, float, list[float]]], *, rows: int, choices: int,
                 argv: list[str]) -> None:
    ref = {"letters": arms["lm_eval_hflm_letters_batch1"][2], "texts": arms["lm_eval_hflm_texts_batch1"][2]}
    lines = ["# Loglikelihood readout on CPU: jex vs its label slot vs lm-eval's HFLM", "",
             f"Command: `OMP_NUM_THREADS={torch.get_num_threads()} .venv/bin/python {' '.join(argv)}`", "",
             f"Machine: {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
             f"model: the embedded SmolLM2-135M (float32); {rows} rows of the sample suite as MMLU-style verbatim "
             f"prompts, {choices} choices. Each arm timed {REPEATS} time(s), the fastest kept; "
             f"load average {os.getloadavg()[0]:.1f} at the end (a shared machine: compare arms, not runs).", "",
             "| arm | wall s | CPU s | rows/s (wall) | choices/s (wall) | rows/CPU s | choices/CPU s | "
             "max abs diff vs lm-eval (batch 1) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (seconds, cpu, lls) in arms.items():
        kind = "texts" if "texts" in name else "letters"
        diff = max(abs(a - b) for a, b in zip(lls, ref[kind], strict=True))
        lines.append(f"| {name} | {seconds:.2f} | {cpu:.2f} | {rows / seconds:.2f} | {choices / seconds:.2f} | "
                     f"{rows / cpu:.2f} | {choices / cpu:.2f} | {diff:.2e} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
