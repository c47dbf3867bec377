"""Issue 41, item 2: is vLLM's prefix cache bit-exact under batch invariance? Text-choice rows (a shared
context, several continuations of several tokens) scored by `prompt_logprobs`, as the continuation readout
scores them, with the prefix cache off (the audited profile: the reference) and on.

    source /tmp/stage/env.sh && source bench/device_jex.sh && \
        python3 bench/gpu_prefix_cache.py --model /tmp/smollm2 --rows 1000 --out $OUT/prefix.json \
            --engine-timeout 400

Each engine's result is kept beside `--out` (`prefix-<engine>-<rows>.json`) and the summary rewritten
after each one, so a call that runs out of time keeps what it measured and the next call (the same
files carried back) resumes with the engines not yet done.

Engines (each in its own process: batch invariance is process-wide; VLLM_BATCH_INVARIANT=1, TRITON_ATTN,
bf16, max_num_seqs 512), and the submissions each makes:
- `off`: prefix caching off. `all` (every sequence in one `generate`: the reference), `shuffled` (the same
  in another order: is the reference itself order-free?).
- `on`: prefix caching on. `all` on a cold cache (sequences of one row share only what an earlier
  scheduler step computed), `warm` (each context alone first, then every sequence in reverse order: every
  context a cache hit), `again` (the same sequences a second time: whole prompts cached but the last
  block).
- `on-chunked`: prefix caching on and max_num_batched_tokens 512 (long contexts prefilled in chunks
  whose boundaries move with what is cached): `all`, `warm`.
- `off-sizes`, `off-nographs` (item 3, the start): prefix caching off with CUDA graphs captured only at
  powers of two up to max_num_seqs, or with no CUDA graphs (still compiled): `all`.
Every submission is compared with `off/all` token by token: sequences whose continuation log-probs are
not bit-identical, max |d|, and argmax changes per row; seconds per submission beside it.

Every engine also records its start (seconds to import vLLM and to build the `LLM`: compile, graphs and
weights; the first engine of a fresh machine compiles cold, later ones may find vLLM's compile cache) and
a generation check: 32 of the contexts (their last 256 tokens) decoded greedily for 64 tokens all in one
`generate` and each alone, token-identical or not, and against `off`'s tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

POWERS_OF_TWO = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
ENGINES = {"off": {"enable_prefix_caching": False}, "on": {"enable_prefix_caching": True},
           "on-chunked": {"enable_prefix_caching": True, "max_num_batched_tokens": 512},
           "off-sizes": {"enable_prefix_caching": False,
                         "compilation_config": {"cudagraph_capture_sizes": POWERS_OF_TWO}},
           "off-nographs": {"enable_prefix_caching": False, "compilation_config": {"cudagraph_mode": "NONE"}}}
GEN_PROMPTS, GEN_TOKENS = 32, 64
PHRASES = ("it is {} in this case", "the answer would be {}", "{}, as far as anyone can tell", "clearly {}")


def rows(n: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """(context, continuations): a few-shot context of 0-24 solved examples (20 to ~1,500 tokens) and
    four continuations of several tokens each."""
    from jex.sample_suite import GENERATORS

    rng = random.Random(seed)
    kinds = ("arith", "capitals", "sorted_max", "weekdays", "letters")
    out = []
    for i in range(n):
        shots = []
        for _ in range(rng.randrange(25)):
            q, opts, gold = GENERATORS[rng.choice(kinds)](rng)
            shots.append(f"Question: {q}\nAnswer: {PHRASES[rng.randrange(4)].format(opts[gold])}\n\n")
        q, opts, _ = GENERATORS[kinds[i % len(kinds)]](rng)
        out.append(("".join(shots) + f"Question: {q}\nAnswer:",
                    [" " + PHRASES[(i + k) % 4].format(o) for k, o in enumerate(opts)]))
    return out


def child(engine: str, model: str, n: int, out: Path) -> None:
    os.environ.update(VLLM_BATCH_INVARIANT="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", attention_backend="TRITON_ATTN", max_num_seqs=512, seed=0,
              gpu_memory_utilization=0.4, **ENGINES[engine])
    start = {"import_s": import_s, "llm_s": time.perf_counter() - t0}
    tok = llm.get_tokenizer()
    seqs, spans, contexts = [], [], []
    for context, conts in rows(n):
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        contexts.append(ctx)
        for c in conts:
            ids = tok(c, add_special_tokens=False)["input_ids"]
            seqs.append(ctx + ids)
            spans.append(len(ids))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def score(order: list[int]) -> tuple[list[list[float]], float]:
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": seqs[i]} for i in order], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        got: dict[int, list[float]] = {}
        for i, r in zip(order, res, strict=True):
            seq, plp = seqs[i], r.prompt_logprobs
            got[i] = [float(plp[p][seq[p]].logprob) for p in range(len(seq) - spans[i], len(seq))]
        return [got[i] for i in range(len(seqs))], seconds

    prompts = [{"prompt_token_ids": c[-256:]} for c in contexts[:GEN_PROMPTS]]
    greedy = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()
    together = [list(r.outputs[0].token_ids) for r in llm.generate(prompts, greedy, use_tqdm=False)]
    gen = {"together_s": time.perf_counter() - t0}
    alone = [list(llm.generate([q], greedy, use_tqdm=False)[0].outputs[0].token_ids) for q in prompts]
    gen.update(tokens=together, alone_differs=sum(a != b for a, b in zip(together, alone, strict=True)))
    if ENGINES[engine]["enable_prefix_caching"]:
        llm.reset_prefix_cache()  # `all` starts on a cold cache

    everyone = list(range(len(seqs)))
    runs: dict[str, dict] = {}
    lps, s = score(everyone)
    runs["all"] = {"lps": lps, "seconds": s}
    if engine == "off":
        shuffled = everyone[:]
        random.Random(1).shuffle(shuffled)
        lps, s = score(shuffled)
        runs["shuffled"] = {"lps": lps, "seconds": s}
    else:
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": c} for c in contexts], SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
        warm_s = time.perf_counter() - t0
        lps, s = score(everyone[::-1])
        runs["warm"] = {"lps": lps, "seconds": s, "contexts_seconds": warm_s}
        if engine == "on":
            lps, s = score(everyone)
            runs["again"] = {"lps": lps, "seconds": s}
    out.write_text(json.dumps({"engine": engine, "sequences": len(seqs), "tokens": sum(map(len, seqs)),
                               "context_tokens": sum(map(len, contexts)), "runs": runs, "start": start,
                               "generation": gen}))


def compare(ref: list[list[float]], got: list[list[float]], choices: int = 4) -> dict:
    differ = sum(a != b for a, b in zip(ref, got, strict=True))
    worst = max((abs(x - y) for a, b in zip(ref, got, strict=True) for x, y in zip(a, b, strict=True)), default=0.0)
    def argmaxes(lps: list[list[float]]) -> list[int]:
        sums = [sum(x) for x in lps]
        return [max(range(choices), key=sums[i:i + choices].__getitem__) for i in range(0, len(sums), choices)]

    flips = sum(a != b for a, b in zip(argmaxes(ref), argmaxes(got), strict=True))
    return {"sequences_not_bit_identical": differ, "max_abs_d_token_logprob": worst, "argmax_changes": flips}


def summarize(docs: dict[str, dict], rows: int) -> dict:
    """Every engine's submissions compared with `off/all` (once `off` has run), and the timings."""
    ref = docs["off"]["runs"]["all"]["lps"] if "off" in docs else None
    table = {f"{engine}/{run}": {"seconds": got["seconds"], **({"contexts_seconds": got["contexts_seconds"]}
                                                               if "contexts_seconds" in got else {}),
                                 **(compare(ref, got["lps"]) if ref is not None else {})}
             for engine, doc in docs.items() for run, got in doc["runs"].items()}
    first = next(iter(docs.values()), {})
    ref_tokens = docs["off"]["generation"]["tokens"] if "off" in docs else None
    generation = {e: {"together_s": d["generation"]["together_s"],
                      "prompts_alone_differing": d["generation"]["alone_differs"],
                      **({"prompts_differing_from_off": sum(a != b for a, b in zip(
                          ref_tokens, d["generation"]["tokens"], strict=True))} if ref_tokens else {})}
                  for e, d in docs.items()}
    return {"command": " ".join(sys.argv), "rows": rows, "sequences": first.get("sequences"),
            "start": {e: d["start"] for e, d in docs.items()}, "generation": generation,
            "tokens": first.get("tokens"), "context_tokens": first.get("context_tokens"),
            "process_seconds": {e: d["process_seconds"] for e, d in docs.items()}, "runs": table}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--engines", default=",".join(ENGINES), help="which engines, in order (default: all)")
    p.add_argument("--engine-timeout", type=float, default=None, help="seconds one engine's process may take")
    p.add_argument("--child", choices=list(ENGINES))
    p.add_argument("--child-out", type=Path)
    a = p.parse_args()
    if a.child:
        child(a.child, a.model, a.rows, a.child_out)
        return
    work = a.out.parent
    work.mkdir(parents=True, exist_ok=True)
    docs = {}
    for engine in a.engines.split(","):
        path = work / f"prefix-{engine}-{a.rows}.json"  # kept: a later call resumes after the engines done
        if not path.exists():
            t0 = time.perf_counter()
            try:
                subprocess.run([sys.executable, __file__, "--model", a.model, "--rows", str(a.rows), "--out",
                                str(a.out), "--child", engine, "--child-out", str(path)], check=True,
                               timeout=a.engine_timeout)
            except subprocess.TimeoutExpired:
                print(f"{engine}: no result within {a.engine_timeout} s", file=sys.stderr)
                continue
            doc = json.loads(path.read_text())
            path.write_text(json.dumps({**doc, "process_seconds": time.perf_counter() - t0}))
        docs[engine] = json.loads(path.read_text())
        a.out.write_text(json.dumps(summarize(docs, a.rows), indent=2))  # after every engine
    print(a.out.read_text())


if __name__ == "__main__":
    main()
