"""Issue 57, item 4: a sampled evaluation that is the same bytes whatever the batch, beside lm_eval's.

The GSM8K-shaped task of `bench/gpu_peer.py` made a self-consistency task (lm-eval's
`gsm8k_cot_self_consistency` shape): `repeats` samples per question at `--temperature`, filters `score-first`
(the first sample's answer) and `maj@K` (the majority answer of the K samples). Then:

1. jex imports it (`jex suite import lm-eval`: repeats become `[catalogs.generation] samples`, each sample
   seeded by a hash of the catalog's seed, the row and the sample's index) and runs it once per `--jex-seqs`
   value (vLLM's max_num_seqs, each run in a store of its own on the first run's compile cache);
2. `lm_eval --model vllm` runs it once per `--lm-eval-seqs` value (vLLM's max_num_seqs, 0 = its default; lm_eval
   seeds the engine, `seed=1234`, not each request);
3. per tool: the rows whose samples (all K texts, in order) differ between its first run and each other run,
   a sha256 over every row's samples, each run's wall, and each filter's mean exact_match (jex's from
   `jex export lm-eval`), which jex's claim says is one number per tool whatever the batch.

On the device, after the staging of `bench/gpu_peer.py`:

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/gpu_sampled.py --model /tmp/smollm2 --rows 1319 --jex-seqs 256 --jex-seqs 16 \\
        --lm-eval-seqs 256 --lm-eval-seqs 16 --jex-args "--audit off" --out $OUT/sampled.json

`--jex-args` go to every jex run (`--audit off`: the runs themselves are the comparison; the engine is batch
invariant either way). `--reuse` reads back each run an earlier call left under `--work`. `--cpu`: a smoke
run (lm_eval's HF backend, `--lm-eval-seqs` its batch size; jex's HF engine).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import gpu_peer  # noqa: E402  (the GSM8K-shaped task, the runners and the samples readers)

TASK = "sampled_gsm8k"


def sampled_task(rows: int, folder: Path, max_gen_toks: int, temperature: float, samples: int) -> Path:
    """The `gsm8k` cell's task, sampled: `samples` repeats at `temperature`, score-first and maj@K filters."""
    greedy = gpu_peer.gsm8k_task(rows, folder, max_gen_toks)
    text = greedy.read_text().replace("task: peer_gsm8k", f"task: {TASK}")
    head, _, _ = text.partition("filter_list:")
    for before, after in (("do_sample: false", "do_sample: true"), ("temperature: 0.0", f"temperature: {temperature}"),
                          ("repeats: 1", f"repeats: {samples}")):
        if before not in head:
            raise SystemExit(f"gpu_peer's GSM8K task changed: no {before!r} in it")
        head = head.replace(before, after)
    answer = '      - function: "regex"\n        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"\n'
    filters = (f'filter_list:\n  - name: "score-first"\n    filter:\n{answer}      - function: "take_first"\n'
               f'  - name: "maj@{samples}"\n    filter:\n{answer}      - function: "majority_vote"\n'
               '      - function: "take_first"\nmetadata:\n  version: 3.0\n')
    path = folder / f"{TASK}.yaml"
    path.write_text(head + filters)
    greedy.unlink()
    return path


def jex_samples(run_dir: Path) -> dict[int, tuple[str, ...]]:
    """Each row's samples (the K generated texts, in sample order) by doc_id."""
    return {d: tuple(r["sample_generations"] or ()) for d, r in gpu_peer.jex_rows(run_dir, TASK).items()}  # refused: ()


def lm_eval_samples(lm_out: Path) -> dict[int, tuple[str, ...]]:
    """lm_eval's K responses of each doc_id (`resps[0]`: a repeated request's responses, in order)."""
    return {d: tuple(next(iter(s.values()))["resps"][0]) for d, s in gpu_peer.lm_samples(lm_out, TASK).items()}


def digest(samples: dict[int, tuple[str, ...]]) -> str:
    return hashlib.sha256(json.dumps(sorted(samples.items())).encode()).hexdigest()


def differing(first: dict[int, tuple[str, ...]], other: dict[int, tuple[str, ...]]) -> dict:
    """Rows whose samples differ, and single samples that differ (of rows x K)."""
    if set(first) != set(other):
        raise SystemExit(f"the runs hold different rows ({len(first)} and {len(other)})")
    return {"rows": sum(first[d] != other[d] for d in first),
            "samples": sum(a != b for d in first for a, b in zip(first[d], other[d], strict=True)),
            "of_samples": sum(len(v) for v in first.values())}


def exact_match(results: dict) -> dict[str, float]:
    return {k: v for k, v in results.items() if k.startswith("exact_match,")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="bf16 model folder both tools read")
    p.add_argument("--rows", type=int, default=1319)
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--samples", type=int, default=4, help="samples per question (lm-eval's repeats)")
    p.add_argument("--jex-seqs", type=int, action="append", default=[], help="vLLM's max_num_seqs of a jex run "
                   "(repeatable; the first is compared with the others)")
    p.add_argument("--lm-eval-seqs", type=int, action="append", default=[], help="vLLM's max_num_seqs of an lm_eval "
                   "run, 0 = vLLM's default (repeatable; --cpu: the HF batch size)")
    p.add_argument("--jex-args", type=shlex.split, default=[], help="more `jex run` flags, one string")
    p.add_argument("--warm-store", type=Path, help="a store whose compile cache the first jex run starts from")
    p.add_argument("--reuse", action="store_true", help="read back each run an earlier call left under --work")
    p.add_argument("--cpu", action="store_true", help="a smoke run: lm_eval's HF backend and jex's HF engine")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-sampled"))
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    env = gpu_peer.bench_env()
    task = sampled_task(a.rows, a.work / "tasks", a.max_gen_toks, a.temperature, a.samples)
    doc: dict = {"command": " ".join(sys.argv), "rows": a.rows, "samples": a.samples, "temperature": a.temperature,
                 "max_gen_toks": a.max_gen_toks, "jex": [], "lm_eval": []}
    save = gpu_peer.recorder(a.out, doc)

    first: dict[int, tuple[str, ...]] = {}
    for i, seqs in enumerate(a.jex_seqs or [0]):
        warm = a.work / "jex-0" / "store" if i else a.warm_store
        seq_args = ["--max-num-seqs", str(seqs)] if seqs and not a.cpu else []
        res = gpu_peer.run_jex(task, a.model, a.work / f"jex-{i}", env, warm, a.cpu, [*a.jex_args, *seq_args], None,
                               a.reuse)
        run_dir = Path(res["run_dir"])
        samples = jex_samples(run_dir)
        first = first or samples
        metrics = exact_match(gpu_peer.jex_metrics(run_dir, a.work / f"jex-{i}-export", env, TASK))
        doc["jex"].append({"max_num_seqs": seqs, "wall_s": res["wall_s"], "digest": digest(samples),
                           "generate_stage_s": res["stages"].get("generate", {}).get("seconds"),
                           "differences_vs_first": differing(first, samples), "exact_match": metrics, "run": res})
        save(tool="jex", max_num_seqs=seqs, wall_s=round(res["wall_s"], 1), digest=digest(samples)[:16],
             differences_vs_first=doc["jex"][-1]["differences_vs_first"], **metrics)
    first = {}
    for i, seqs in enumerate(a.lm_eval_seqs or [0]):
        lm = gpu_peer.run_lm_eval(task, a.model, a.work / f"lm-{i}", env, a.cpu, seqs, a.reuse)
        samples = lm_eval_samples(a.work / f"lm-{i}")
        first = first or samples
        metrics = exact_match(lm["results"])
        doc["lm_eval"].append({"max_num_seqs": seqs, "wall_s": lm["wall_s"], "digest": digest(samples),
                               "differences_vs_first": differing(first, samples), "exact_match": metrics, "run": lm})
        save(tool="lm_eval", max_num_seqs=seqs, wall_s=round(lm["wall_s"], 1), digest=digest(samples)[:16],
             differences_vs_first=doc["lm_eval"][-1]["differences_vs_first"], **metrics)


if __name__ == "__main__":
    main()
