"""Issue 27 on one H200: the loglikelihood (continuation) readout on vLLM against the HF engine, and its
throughput against the label-slot readout, in one process.

    source /tmp/stage/env.sh && source bench/device_jex.sh && \
        python3 bench/gpu_loglikelihood.py --suites SUITE_DIR... --rows 5000 --out $OUT

1. Fidelity: each suite (made by `jex suite import lm-eval` from an lm-eval task: verbatim prompts,
   `readout = "loglikelihood"`) runs through the real fast-pass stage (`fast_pass_stage`) three times,
   each in its own store: jex-vLLM (bf16, batch invariant, the audit profile), jex-HF on the GPU in bf16
   and jex-HF on the GPU in fp32. The per-choice log-likelihoods (`choice_loglikelihoods`) are
   compared row for row: max |difference| and argmax agreement of each pair. lm-eval itself is not on
   the device; its numbers are matched on CPU by `tests/test_lm_eval_fidelity.py`.
2. Throughput on vLLM (batch invariant): the sample suite's rows as MMLU-style verbatim prompts (the
   options listed, ending in "Answer:"), read three ways on the same engine: the label slot, the
   continuation readout with the letters as options (one token each), and with each option's text.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def vllm_spec(model: str):
    """The one vLLM engine of this process (both parts use it: one engine start)."""
    from jex.engine_spec import EngineSpec

    return EngineSpec(kind="vllm", model=model, batch_size=0, gpu_memory_utilization=0.3, max_num_seqs=512,
                      max_num_batched_tokens=32768)


def fidelity_child(name: str, suites: list[Path], model: str, work: Path) -> None:
    """One engine's fast pass over each suite, in its own process (vLLM's batch-invariant mode replaces
    torch's log-softmax process-wide, which the HF engine's float64 readout cannot run under)."""
    import polars as pl

    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage
    from jex.tasks.store import LocalStore

    spec = {"vllm_bf16": vllm_spec(model),
            "hf_bf16": EngineSpec(kind="hf", model=model, device="cuda", dtype="bfloat16"),
            "hf_fp32": EngineSpec(kind="hf", model=model, device="cuda", dtype="float32")}[name]
    out: dict = {}
    for suite in suites:
        store = LocalStore(work / f"store-{suite.name}-{name}")
        bundle = bundle_stage(store, suite=suite)
        t0 = time.perf_counter()
        fast = fast_pass_stage(store, bundle=bundle, engine=spec, shard_rows=1000)
        frame = pl.read_parquet(fast.capture)
        out[suite.name] = {"seconds": time.perf_counter() - t0, "lls": dict(zip(
            frame["run_id"].to_list(), frame["choice_loglikelihoods"].to_list(), strict=True))}
    (work / f"lls-{name}.json").write_text(json.dumps(out))


def fidelity(suites: list[Path], model: str, work: Path) -> dict:
    import subprocess
    import sys

    names = ("vllm_bf16", "hf_bf16", "hf_fp32")
    runs: dict = {}
    for name in names:
        env = {**__import__("os").environ}
        if name.startswith("hf"):
            env.pop("VLLM_BATCH_INVARIANT", None)
        done = subprocess.run([sys.executable, __file__, "--fidelity-child", name, "--model", model, "--out",
                               str(work), "--suites", *map(str, suites)], env=env, capture_output=True, text=True)
        if done.returncode:
            runs[name] = {"error": done.stderr[-3000:]}
            continue
        runs[name] = json.loads((work / f"lls-{name}.json").read_text())
    out: dict = {"errors": {n: r["error"] for n, r in runs.items() if "error" in r}}
    for suite in suites:
        got = {n: r[suite.name] for n, r in runs.items() if "error" not in r}
        entry = out.setdefault(suite.name, {f"{n}_seconds": g["seconds"] for n, g in got.items()})
        for a, b in (("vllm_bf16", "hf_bf16"), ("vllm_bf16", "hf_fp32"), ("hf_bf16", "hf_fp32")):
            if a not in got or b not in got:
                continue
            diffs, agree = [], 0
            for rid, x in got[a]["lls"].items():
                y = got[b]["lls"][rid]
                diffs += [abs(p - q) for p, q in zip(x, y, strict=True)]
                agree += max(range(len(x)), key=x.__getitem__) == max(range(len(y)), key=y.__getitem__)
            entry[f"{a}_vs_{b}"] = {"rows": len(got[a]["lls"]), "choices": len(diffs), "max_abs_diff": max(diffs),
                                    "argmax_agree": agree}
    return out


def throughput(model: str, rows: int) -> dict:
    from jex.engine.types import ReadoutMode, ReadoutRequest
    from jex.sample_suite import write_sample_suite
    from jex.suite import iter_rows
    from jex.tasks.execution.engine_pool import get_engine

    with tempfile.TemporaryDirectory() as tmp:
        suite_rows = list(iter_rows(write_sample_suite(Path(tmp) / "s", rows=rows)))
    texts = []
    for r in suite_rows:
        shown = "\n".join(f"{lab}. {opt}" for lab, opt in zip(r.labels, r.options, strict=True))
        texts.append(ReadoutRequest(r.run_id, f"{r.prompt}\n{shown}\nAnswer:", tuple(r.labels), tuple(r.options)))
    letters = [ReadoutRequest(r.run_id, r.prompt, r.labels, r.labels) for r in texts]
    engine = get_engine(vllm_spec(model))
    engine.readout(letters[:8])  # warm-up
    arms: dict = {}
    for name, reqs, mode in (("label_slot", letters, ReadoutMode.LABEL_SLOT),
                             ("continuation_letters", letters, ReadoutMode.OPTION_CONTINUATION),
                             ("continuation_texts", texts, ReadoutMode.OPTION_CONTINUATION)):
        t0 = time.perf_counter()
        got = engine.readout(reqs, mode)
        seconds = time.perf_counter() - t0
        choices = sum(len(r.options) for r in reqs)
        arms[name] = {"rows": len(reqs), "choices": choices, "seconds": seconds, "rows_per_s": len(reqs) / seconds,
                      "choices_per_s": choices / seconds, "refused": sum(g.logprobs is None for g in got),
                      "raw": [g.raw_logprobs for g in got[:200]]}
    slot, cont = arms["label_slot"]["raw"], arms["continuation_letters"]["raw"]
    arms["letters_continuation_vs_label_slot_max_abs_diff"] = max(
        abs(p - q) for x, y in zip(slot, cont, strict=True) if x and y for p, q in zip(x, y, strict=True))
    for a in ("label_slot", "continuation_letters", "continuation_texts"):
        del arms[a]["raw"]
    return arms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--suites", nargs="*", default=[])
    p.add_argument("--model", default="/tmp/smollm2")
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--out", required=True)
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--fidelity-child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.fidelity_child:
        return fidelity_child(a.fidelity_child, [Path(s) for s in a.suites], a.model, Path(a.out))
    result: dict = {"settings": vars(a)}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        if not a.skip_throughput:
            result["throughput"] = throughput(a.model, a.rows)
            print(json.dumps(result["throughput"], indent=1), flush=True)
        result["fidelity"] = fidelity([Path(s) for s in a.suites], a.model, Path(tmp))
        print(json.dumps(result["fidelity"], indent=1), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "gpu-loglikelihood.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
