"""Issue 30 on one H200: jex against raw vLLM on real-size models with random weights, side by side.

    source /tmp/stage/env.sh && source bench/device_jex.sh && \
        python3 bench/gpu_real_size.py --shapes 8b,14b --rows 20000 --gated 2000 --out $OUT

Per shape (Llama-3-8B's, and a ~14B one: 48 layers, hidden 5120, MLP 13824, 40/8 heads) the model is
made on the GPU with random N(0, 0.02) weights, saved as bf16 safetensors with the staged SmolLM2
tokenizer and chat template (`/tmp/smollm2`), then one child process (its own GPU memory, its own
vLLM compile cache) runs, in this order:
- the engine fingerprint twice (the first hashes the weights; the second should hit the hash cache);
- the engine start (cold compile cache);
- jex's fast-pass, gate and reason stages on the sample suite (`fast_pass_stage`, `reason_stage`:
  batch invariant, one `generate` per shard, the reason stage's post-thought re-read included);
- raw vLLM on the same engine and the same rows, the prompts rendered and tokenised before the clock
  starts: one `generate` per label set for the fast pass; for the reason stage one greedy `generate`
  over the same reasoning prompts with the same settings plus one re-read `generate` over the
  rationales (what jex's stage does, without jex);
- the 64-row golden replay.
A second child with the same compile cache measures the warm engine start (`--warm-start`).

Reported per shape: rows/s, tokens/s and TFLOPS (2 x non-embedding parameters per token read or
generated, attention left out) of each stage for jex and raw vLLM and their ratio, the engine starts,
the fingerprint times, the golden replay, GPU memory in use, and the sha256 of jex's capture and
rationales.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {"8b": {"layers": 32, "hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8},
          "14b": {"layers": 48, "hidden": 5120, "inter": 13824, "heads": 40, "kv_heads": 8}}


def make_model(shape: str, tokenizer_src: Path, out: Path) -> dict:
    """A random-weight Llama-architecture model of `shape`, bf16 safetensors, with the staged tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s, src = SHAPES[shape], json.loads((tokenizer_src / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=src["vocab_size"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                      num_key_value_heads=s["kv_heads"], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, bos_token_id=src.get("bos_token_id"),
                      eos_token_id=src.get("eos_token_id"), torch_dtype="bfloat16")
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    emb = model.model.embed_tokens.weight.numel()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    for f in tokenizer_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")):
            shutil.copy(f, out / f.name)
    size = sum(f.stat().st_size for f in out.iterdir())
    return {"params": n, "params_non_embedding": n - emb, "bytes": size, "make_s": round(time.perf_counter() - t0, 1)}


def gpu_memory_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True).stdout
        return int(out.split()[0])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def raw_fast_pass(engine, requests) -> dict:
    """One `generate` per label set over pre-tokenised prompts."""
    ids = engine.encode_many([r.prompt for r in requests])
    groups: dict[tuple, list[list[int]]] = {}
    for r, p in zip(requests, ids, strict=True):
        groups.setdefault(tuple(engine.label_token(lab) for lab in r.labels), []).append(p)
    t0 = time.perf_counter()
    for labels, prompts in groups.items():
        params = engine.SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=list(labels))
        engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"rows": len(requests), "seconds": seconds, "rows_per_s": len(requests) / seconds,
            "prompt_tokens": sum(map(len, ids))}


def raw_reason(engine, prompts: list[str], labels: list[tuple[str, ...]], max_tokens: int, after: str) -> dict:
    """Greedy rationales over pre-tokenised prompts, then the re-read of each rationale (one `generate`
    per label set), as the reason stage does."""
    ids = engine.encode_many(prompts)
    t0 = time.perf_counter()
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in ids],
                               engine.SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    reread = engine.encode_many([p + o.outputs[0].text.rstrip() + after for p, o in zip(prompts, outs, strict=True)])
    groups: dict[tuple, list[list[int]]] = {}
    for lab, p in zip(labels, reread, strict=True):
        groups.setdefault(tuple(engine.label_token(x) for x in lab), []).append(p)
    t1 = time.perf_counter()
    for label_ids, items in groups.items():
        params = engine.SamplingParams(temperature=0, max_tokens=1, logprob_token_ids=list(label_ids))
        engine.llm.generate([{"prompt_token_ids": p} for p in items], params, use_tqdm=False)
    reread_s = time.perf_counter() - t1
    seconds = gen_s + reread_s
    return {"rows": len(prompts), "seconds": seconds, "generate_s": gen_s, "reread_s": reread_s,
            "tokens": tokens, "tok_per_s": tokens / seconds, "prompt_tokens": sum(map(len, ids))}


def _timed(fn, *args, **kw):
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return out, time.perf_counter() - t0


def child(a: argparse.Namespace) -> None:
    import polars as pl

    from jex.engine.fingerprint import engine_fingerprint
    from jex.engine_spec import EngineSpec
    from jex.fileio import sha256_file
    from jex.tasks.bundle.reading import bundle_rows
    from jex.tasks.capture.engine_calls import as_rows, question_prompts, reason_prompts
    from jex.tasks.capture.golden import golden_readout
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.execution.engine_pool import get_engine
    from jex.tasks.store import LocalStore

    spec = EngineSpec(kind="vllm", model=a.model, batch_size=0, max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=32768, gpu_memory_utilization=a.gpu_memory_utilization)
    fp1, fp1_s = _timed(engine_fingerprint, spec)
    _, fp2_s = _timed(engine_fingerprint, spec)
    engine, start_s = _timed(get_engine, spec)
    out: dict = {"fingerprint_first_s": fp1_s, "fingerprint_again_s": fp2_s, "engine_start_s": start_s,
                 "gpu_memory_used_mib": gpu_memory_used_mib(), "weights_sha256": fp1.weights_sha256}
    if a.start_only:
        print("RESULT " + json.dumps(out, default=str), flush=True)
        return
    store = LocalStore(Path(a.store))
    bundle = bundle_stage(store, suite=Path(a.suite))
    fast, fast_s = _timed(fast_pass_stage, store, bundle=bundle, engine=spec, shard_rows=a.fast_shard)
    gate = gate_stage(store, bundle=bundle, fast=fast, coverage=a.gated / fast.rows)
    reasoned, reason_s = _timed(reason_stage, store, bundle=bundle, gate=gate, engine=spec,
                                max_tokens=a.max_tokens, shard_rows=a.reason_shard)
    tokens = sum(len(t) for t in pl.read_parquet(reasoned.reasoned)["token_ids"].to_list())
    rows = as_rows(bundle_rows(bundle, store))
    gated_ids = set(pl.read_parquet(reasoned.reasoned)["run_id"].to_list())
    gated = [r for r in rows if r.run_id in gated_ids]
    raw_fp = raw_fast_pass(engine, question_prompts(engine, rows, spec.render))
    raw_rs = raw_reason(engine, reason_prompts(engine, gated, spec.render), [tuple(r.labels) for r in gated],
                        a.max_tokens, spec.render.after_thought)
    _, golden_s = _timed(golden_readout, bundle, spec, store, 64)
    out.update({
        "jex_fast_pass": {"rows": fast.rows, "seconds": fast_s, "rows_per_s": fast.rows / fast_s,
                          "capture_sha256": sha256_file(fast.capture)},
        "jex_reason": {"rows": reasoned.rows, "seconds": reason_s, "tokens": tokens, "tok_per_s": tokens / reason_s,
                       "reasoned_sha256": sha256_file(reasoned.reasoned)},
        "raw_fast_pass": raw_fp, "raw_reason": raw_rs, "golden_replay_64_s": golden_s,
        "gpu_memory_used_mib_end": gpu_memory_used_mib()})
    print("RESULT " + json.dumps(out, default=str), flush=True)


def _run_child(a: argparse.Namespace, model: Path, suite: Path, store: Path, cache: Path, start_only: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--suite", str(suite), "--store", str(store),
           "--gated", str(a.gated), "--max-tokens", str(a.max_tokens), "--fast-shard", str(a.fast_shard),
           "--reason-shard", str(a.reason_shard), "--max-num-seqs", str(a.max_num_seqs),
           "--gpu-memory-utilization", str(a.gpu_memory_utilization), "--out", a.out]
    if start_only:
        cmd.append("--start-only")
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "VLLM_CACHE_ROOT": str(cache)})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-4000:], "returncode": proc.returncode}
    return json.loads(lines[-1][len("RESULT "):])


def summarise(made: dict, run: dict) -> dict:
    """Ratios and TFLOPS from one shape's child result."""
    if "jex_fast_pass" not in run:
        return run
    flops = 2 * made["params_non_embedding"]
    jf, rf, jr, rr = run["jex_fast_pass"], run["raw_fast_pass"], run["jex_reason"], run["raw_reason"]
    prompt_tokens = rf["prompt_tokens"]
    return {"fast_pass": {"jex_rows_per_s": jf["rows_per_s"], "raw_rows_per_s": rf["rows_per_s"],
                          "jex_over_raw": jf["rows_per_s"] / rf["rows_per_s"],
                          "jex_tflops": flops * prompt_tokens / jf["seconds"] / 1e12,
                          "raw_tflops": flops * prompt_tokens / rf["seconds"] / 1e12},
            "reason": {"jex_tok_per_s": jr["tok_per_s"], "raw_tok_per_s": rr["tok_per_s"],
                       "jex_over_raw": jr["tok_per_s"] / rr["tok_per_s"],
                       "raw_generate_s": rr["generate_s"], "raw_reread_s": rr["reread_s"],
                       "jex_tflops_decode": flops * jr["tokens"] / jr["seconds"] / 1e12}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8b")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--gated", type=int, default=2000, help="rows the reason stage reasons on")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--fast-shard", type=int, default=5000)
    p.add_argument("--reason-shard", type=int, default=2000)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--tokenizer", default="/tmp/smollm2")
    p.add_argument("--warm-start", action="store_true", help="a second child measures the warm engine start")
    p.add_argument("--out", required=True)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--start-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--suite", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    from jex.sample_suite import write_sample_suite

    results: dict = {"settings": {k: v for k, v in vars(a).items() if k not in ("child", "model", "suite", "store")},
                     "command": " ".join(sys.argv)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        suite = write_sample_suite(Path(tmp) / "suite", rows=a.rows, seed=0)
        for shape in a.shapes.split(","):
            model = Path(tmp) / f"model-{shape}"
            made = make_model(shape, Path(a.tokenizer), model)
            cache = Path(tmp) / f"vllm-cache-{shape}"
            run = _run_child(a, model, suite, Path(tmp) / f"store-{shape}", cache, start_only=False)
            entry = {"model": made, "run": run, "summary": summarise(made, run)}
            if a.warm_start:
                entry["warm"] = _run_child(a, model, suite, Path(tmp) / f"store-{shape}-warm", cache, start_only=True)
            results[shape] = entry
            shutil.rmtree(model, ignore_errors=True)
            shown = {shape: {"summary": entry["summary"], "warm": entry.get("warm")}}
            print(json.dumps(shown, default=str), flush=True)
            Path(a.out, "gpu-real-size.json").write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
