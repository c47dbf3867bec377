"""Issues 41 and 45: jex beside `lm_eval --model vllm` on the same tasks and GPU, each tool in its own process.

On the device, after the vLLM staging (../shared/device/README.md), the wheel folders of
`bench/device_wheels.sh` (/tmp/site2, /tmp/site3) and lm_eval's (`build_lmeval_wheels.sh`, /tmp/site4):

    source /tmp/stage/env.sh && source bench/device_jex.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site4
    python3 bench/gpu_peer.py --model /tmp/smollm2 --cell text:3000 --cell letters:10000 --out $OUT/peer.json

Issue 45, items 4 and 5 (GSM8K-shaped generation, an 8B random-weight model of ../shared/device/
make_random_model.py; both tools at half the GPU's memory; the jex variants and lm_eval's second setting
for determinism):

    python3 bench/gpu_peer.py --model /tmp/big8b --cell gsm8k:1319 --max-gen-toks 256 \\
        --jex-args="--gpu-memory-utilization 0.5" --lm-eval-seqs 0 --lm-eval-seqs 32 \\
        --jex-variant="--max-num-seqs 32" --jex-variant="--reason-shard-rows 100" \\
        --jex-variant="--engines-per-gpu 2 --gpu-memory-utilization 0.45" --out $OUT/peer-gsm8k.json

A cell is a task shape and its rows. `text`: ARC style (0-shot "Question: ...\\nAnswer:", each choice a
phrase of several tokens, acc and acc_norm); `letters`: MMLU style (the options inside the prompt, the
letters as choices, a description and 5 solved examples first). The rows come from the sample suite's
generators (jex.sample_suite), written as lm-eval YAML over local JSONL. `gsm8k`: GSM8K style
(generate_until): multi-step arithmetic word problems with worked answers ending in "#### N" (seeded),
8 solved examples first, greedy up to `--max-gen-toks` new tokens cut at "Question:", lm-eval's GSM8K
filters (strict-match, flexible-extract) and exact_match settings. Per cell:

1. `lm_eval --model vllm` (vLLM's defaults, `batch_size auto`, TRITON_ATTN: the staged vLLM has no
   FlashAttention; not batch invariant, prefix caching on: what a user gets), timed from its process start;
   for `gsm8k` once per `--lm-eval-seqs` value (vLLM's max_num_seqs, 0 = vLLM's default), the first timed
   against jex, the others for lm_eval against itself;
2. `jex suite import lm-eval` then `jex run --engine vllm --device cuda --coverage 0` with no tuning
   flag but `--jex-args` (the default `local` provider: a machine process with its engine host and the
   golden replay), each timed from its process start; jex's stage seconds and engine starts from its run
   folder; for `gsm8k` then once per `--jex-variant` (extra `jex run` flags), each in a store of its own on
   the first run's compile cache;
3. fidelity, row for row: the prompt jex's engine read is lm_eval's context, each choice's
   log-likelihood (max |d|), the argmax, acc and acc_norm; for `gsm8k` the generated text, each filter's
   answer and exact_match and their means; the rows whose generation differs between jex's first run and
   each variant (jex's claim: none) and between lm_eval's first setting and each other.

`--repeat N` runs the pair N times, each tool on the compile cache of its previous run (a team's normal
case from the second run on; the first is cold when the machine is fresh). `--reuse` reads back each run
whose folder under `--work` holds its result.json (an earlier invocation's), so that work longer than one
device call can be split over several with the same command line (the variants added in a later one).
`--cpu`: a smoke run of this harness (lm_eval's HF backend, `--lm-eval-seqs` its batch size; jex's HF engine).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

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


GSM8K_YAML = """output_type: generate_until
fewshot_split: dev
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore:
      - ","
      - "\\\\$"
      - "(?s).*#### "
      - "\\\\.$"
generation_kwargs:
  until:
    - "Question:"
    - "</s>"
    - "<|im_end|>"
  do_sample: false
  temperature: 0.0
  max_gen_toks: MAX_GEN_TOKS
repeats: 1
num_fewshot: 8
fewshot_config:
  sampler: first_n
filter_list:
  - name: "strict-match"
    filter:
      - function: "regex"
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: "take_first"
  - name: "flexible-extract"
    filter:
      - function: "regex"
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{2,})|(-?[0-9]+)"
      - function: "take_first"
metadata:
  version: 3.0
"""
"""lm-eval's shipped gsm8k.yaml (0.4.x) less its Hub dataset, on a dev split of 8 solved examples taken in order."""
NAMES = ("Tom", "Mia", "Leo", "Ava", "Sam", "Ivy", "Ben", "Zoe")
THINGS = ("apples", "stamps", "marbles", "books", "cookies", "pencils", "shells", "cards")


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """A GSM8K-shaped problem: the question, a worked answer (steps with `<<a*b=c>>` notes, `#### N` last), N."""
    name, thing, shape = rng.choice(NAMES), rng.choice(THINGS), rng.randrange(5)
    if shape == 0:
        a, b = rng.randint(2, 12), rng.randint(3, 15)
        c = rng.randint(1, a * b - 1)
        n = a * b - c
        return (f"{name} has {a} boxes with {b} {thing} in each box and gives away {c} {thing}. "
                f"How many {thing} does {name} have left?",
                f"{name} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {thing}.\nAfter giving away {c}, "
                f"{name} has {a * b} - {c} = <<{a * b}-{c}={n}>>{n} {thing} left.\n#### {n}", n)
    if shape == 1:
        a, price = rng.randint(2, 9), rng.randint(2, 20)
        bill = next(b for b in (20, 50, 100, 200, 500) if b >= a * price)
        n = bill - a * price
        return (f"A shop sells {thing} at ${price} each. {name} buys {a} of them and pays with a ${bill} bill. "
                "How much change does " + name + " get?",
                f"The {thing} cost {a} * ${price} = $<<{a}*{price}={a * price}>>{a * price}.\n"
                f"The change is ${bill} - ${a * price} = $<<{bill}-{a * price}={n}>>{n}.\n#### {n}", n)
    if shape == 2:
        a, d, b, e = rng.randint(5, 40), rng.randint(2, 7), rng.randint(5, 40), rng.randint(2, 7)
        n = a * d + b * e
        return (f"{name} reads {a} pages a day for {d} days, then {b} pages a day for {e} days. "
                f"How many pages does {name} read in all?",
                f"First {name} reads {a} * {d} = <<{a}*{d}={a * d}>>{a * d} pages.\n"
                f"Then {name} reads {b} * {e} = <<{b}*{e}={b * e}>>{b * e} pages.\n"
                f"In all, {a * d} + {b * e} = <<{a * d}+{b * e}={n}>>{n} pages.\n#### {n}", n)
    if shape == 3:
        a, k = rng.randint(3, 60), rng.randint(2, 6)
        n = a + a * k
        return (f"A farm has {a} cows and {k} times as many chickens as cows. "
                "How many cows and chickens are on the farm?",
                f"There are {a} * {k} = <<{a}*{k}={a * k}>>{a * k} chickens.\n"
                f"Together there are {a} + {a * k} = <<{a}+{a * k}={n}>>{n} animals.\n#### {n}", n)
    w, h, k = rng.randint(12, 45), rng.randint(10, 40), rng.randint(2, 8)
    n = w * h * k
    return (f"{name} earns ${w} an hour and works {h} hours a week. How much does {name} earn in {k} weeks?",
            f"In a week {name} earns {h} * ${w} = $<<{h}*{w}={w * h}>>{w * h:,}.\n"
            f"In {k} weeks that is {k} * ${w * h:,} = $<<{k}*{w * h}={n}>>{n:,}.\n#### {n}", n)


def gsm8k_task(rows: int, folder: Path, max_gen_toks: int) -> Path:
    """The `gsm8k` cell's YAML: `rows` seeded word problems (test split) after 8 solved ones (dev split)."""
    rng = random.Random("gpu-peer:gsm8k")
    docs = []
    for i in range(rows + 8):
        question, answer, _ = word_problem(rng)
        docs.append({"id": i, "question": question, "answer": answer})
    folder.mkdir(parents=True, exist_ok=True)
    test, dev = folder / "gsm8k.jsonl", folder / "gsm8k-dev.jsonl"
    test.write_text("".join(json.dumps(d) + "\n" for d in docs[8:]))
    dev.write_text("".join(json.dumps(d) + "\n" for d in docs[:8]))
    path = folder / "peer_gsm8k.yaml"
    path.write_text(f"task: peer_gsm8k\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {test}\n"
                    f"    dev: {dev}\n" + GSM8K_YAML.replace("MAX_GEN_TOKS", str(max_gen_toks)))
    return path


def make_tasks(kind: str, rows: int, folder: Path, max_gen_toks: int = 256) -> Path:
    """The lm-eval task YAML of a cell and its JSONL rows (test split, and a dev split for the shots)."""
    from jex.sample_suite import GENERATORS

    if kind == "gsm8k":
        return gsm8k_task(rows, folder, max_gen_toks)

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
    """Seconds from the process's start to its exit (it must succeed); its output in `log` (stdout, then
    stderr) and, each line stamped with the seconds since the start, in `log`'s `-timeline.log` beside it
    (where a run's fixed cost went)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            encoding="utf-8", errors="replace")
    streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
    timeline: list[str] = []

    def read(name: str, tag: str, stream: IO[str]) -> None:
        for line in stream:
            streams[name].append(line)
            timeline.append(f"{time.perf_counter() - t0:8.2f} {tag} {line}")

    readers = [threading.Thread(target=read, args=(name, name[3], stream))  # tags: o(ut), e(rr)
               for name, stream in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    try:
        code = proc.wait()
    except BaseException:  # interrupted: the child (a GPU run) must not outlive the bench
        proc.kill()
        proc.wait()
        raise
    for r in readers:
        r.join()
    seconds = time.perf_counter() - t0
    stdout, stderr = "".join(streams["stdout"]), "".join(streams["stderr"])
    log.write_text(stdout + "\n--- stderr ---\n" + stderr)
    log.with_name(f"{log.stem}-timeline.log").write_text("".join(timeline) + f"{seconds:8.2f} exit {code}\n")
    if code:
        raise SystemExit(f"{cmd[:4]} failed ({code}); see {log}:\n{stderr[-3000:]}")
    return seconds


def run_key(task: Path, *settings: object) -> str:
    """What a run's result depends on: the task YAML, its rows and the settings given."""
    docs = [Path(f).read_text() for f in sorted(glob.glob(str(task.parent / "*.jsonl")))]
    return hashlib.sha256(json.dumps([task.read_text(), docs, *settings], default=str).encode()).hexdigest()


def reused(folder: Path, reuse: bool, key: str) -> dict | None:
    """With `reuse`, the record an earlier invocation of the same `key` left in `folder` (marked reused); else
    None, and the folder emptied for a fresh run (nothing of an earlier run may be read as this one's)."""
    done = folder / "result.json"
    if reuse and done.exists() and (earlier := json.loads(done.read_text())).get("key") == key:
        return {**earlier, "reused": True}
    shutil.rmtree(folder, ignore_errors=True)
    return None


def recorded(folder: Path, key: str, result: dict) -> dict:
    """`result`, also kept as `folder`/result.json for a later `--reuse`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps({**result, "key": key}, indent=2, default=str))
    return result


def run_lm_eval(task: Path, model: str, out: Path, env: dict[str, str], cpu: bool, seqs: int = 0,
                reuse: bool = False, invariant: bool = False) -> dict:
    """`lm_eval run` with its samples in `out`, timed from its process start; `seqs`: vLLM's max_num_seqs (on
    the CPU the HF batch size), 0 = the default (vLLM's; HF 8); `invariant`: vLLM batch invariant
    (`VLLM_BATCH_INVARIANT=1`, prefix caching off), as jex runs it."""
    key = run_key(task, model, cpu, seqs, *(["invariant"] if invariant else []))
    if (earlier := reused(out, reuse, key)) is not None:
        return earlier
    invariant_args = ",enable_prefix_caching=False" if invariant and not cpu else ""
    if invariant and not cpu:
        env = {**env, "VLLM_BATCH_INVARIANT": "1"}
    backend = (["--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                "--batch_size", str(seqs or 8)] if cpu else
               ["--model", "vllm", "--model_args", f"pretrained={model},dtype=bfloat16,attention_backend=TRITON_ATTN,"
                "gpu_memory_utilization=0.5" + (f",max_num_seqs={seqs}" if seqs else "") + invariant_args,
                "--batch_size", "auto"])
    cmd = [sys.executable, "-m", "lm_eval", "run", *backend, "--tasks", task.stem, "--include_path",
           str(task.parent), "--log_samples", "--output_path", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    wall = timed(cmd, out.with_suffix(".log"), env, out.parent)
    (results,) = glob.glob(str(out / "*" / "results_*.json"))
    doc = json.loads(Path(results).read_text())
    return recorded(out, key, {"wall_s": wall, "evaluation_s": float(doc.get("total_evaluation_time_seconds", "nan")),
                               "seqs": seqs, "results": doc["results"][task.stem]})


def jex_run_key(task: Path, model: str, cpu: bool, extra: list[str] | None, cluster: str | None,
                warm_from: Path | None, engine_key: list[str] | None) -> str:
    """What a `run_jex` result depends on (a cold run is never reused as a warm one)."""
    return run_key(task, model, cpu, extra or [], cluster, warm_from, *([engine_key] if engine_key is not None else []))


def run_jex(task: Path, model: str, work: Path, env: dict[str, str], warm_from: Path | None, cpu: bool,
            extra: list[str] | None = None, cluster: str | None = "topic", reuse: bool = False,
            engine: list[str] | None = None, engine_key: list[str] | None = None) -> dict:
    """Import and run in a store of its own (nothing cached) but for the compile cache of the run before,
    when `warm_from` names its store (as a team's store carries it from one campaign to the next); `extra`:
    more `jex run` flags (after the harness's, so a flag given twice takes its last value); `engine`: the
    engine's flags (default: in-process vLLM on the GPU, jex's HF engine with `cpu`), `engine_key` what of them
    the result depends on (default: all)."""
    key = jex_run_key(task, model, cpu, extra, cluster, warm_from, engine_key if engine_key is not None else engine)
    if warm_from is not None and work in (warm_from, *warm_from.parents):
        raise SystemExit(f"the warm store {warm_from} lies inside {work}, which a fresh run empties first")
    if (earlier := reused(work, reuse, key)) is not None:
        return earlier
    suite, store = work / "suite", work / "store"
    work.mkdir(parents=True, exist_ok=True)
    for carried in ("compile_cache", "bakeoff"):  # what a team's store carries from one campaign to the next
        if warm_from is not None and (warm_from / carried).is_dir():
            shutil.copytree(warm_from / carried, store / carried)
    jex = [sys.executable, "-m", "jex"]
    clusters = ["--cluster", cluster] if cluster else []
    import_s = timed([*jex, "suite", "import", "lm-eval", "--task", str(task), *clusters, "-o", str(suite),
                      "--force"], work / "import.log", env, work)
    env = {**env, "JEX_INFRA__STATE_DIR": str(work / "infra"), "JEX_INFRA__REMOTE_ROOT": str(work / "machines"),
           "PREFECT_HOME": str(work / "prefect")}
    if engine is None:
        engine = [] if cpu else ["--engine", "vllm", "--device", "cuda"]
    run_s = timed([*jex, "run", "--suite", str(suite), "--model", model, *engine,
                   "--coverage", "0", "--name", task.stem, "--out", str(work / "runs"), "--store", str(store),
                   "--quiet", *(extra or [])], work / "run.log", env, work)
    run_dir = Path((work / "run.log").read_text().split("\n--- stderr ---")[0].strip().splitlines()[-1])
    stages = json.loads((run_dir / "stages.json").read_text())
    machines = run_dir / "machines.json"
    return recorded(work, key, {"import_s": import_s, "run_s": run_s, "wall_s": import_s + run_s, "args": extra or [],
                                "run_dir": str(run_dir), "stages": stages,
                                "machines": json.loads(machines.read_text()) if machines.exists() else None})


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


def lm_samples(lm_out: Path, task: str) -> dict[int, dict[str, dict]]:
    """lm_eval's samples of a generative task by doc_id, then by filter (its jsonl has a line per filter)."""
    (path,) = glob.glob(str(lm_out / "*" / f"samples_{task}_*.jsonl"))
    by_doc: dict[int, dict[str, dict]] = {}
    for s in map(json.loads, Path(path).read_text().splitlines()):
        by_doc.setdefault(s["doc_id"], {})[s["filter"]] = s
    return by_doc


def lm_texts(lm_out: Path, task: str) -> dict[int, str]:
    """The text lm_eval generated for each doc_id (`resps[0][0]`, the same on every filter's line)."""
    return {d: next(iter(s.values()))["resps"][0][0] for d, s in lm_samples(lm_out, task).items()}


def jex_rows(run_dir: Path, task: str) -> dict[int, dict]:
    """jex's samples rows of a catalog by doc_id, `prompt` read through `prompt_ref` where the record left it out."""
    import polars as pl

    from jex.tasks.outputs.samples import resolve_prompt_ref

    rows = {}
    for r in pl.read_parquet(run_dir / "samples.parquet").filter(pl.col("catalog") == task).iter_rows(named=True):
        if r["prompt"] is None and r["prompt_ref"]:
            r["prompt"] = resolve_prompt_ref(r["prompt_ref"])[0]
        rows[json.loads(r["metadata"])["doc_id"]] = r
    return rows


def differing(first: dict[int, str], other: dict[int, str]) -> int:
    """Rows whose generated text differs between two runs of the same rows."""
    if set(first) != set(other):
        raise SystemExit(f"the runs hold different rows ({len(first)} and {len(other)})")
    return sum(first[d] != other[d] for d in first)


def generation_fidelity(task: str, lm_out: Path, run_dir: Path) -> dict:
    """jex's generations against lm_eval's, row for row: the prompt, the generated text, each filter's answer and
    exact_match, and each filter's mean exact_match by both."""
    lm, ours = lm_samples(lm_out, task), jex_rows(run_dir, task)
    if set(lm) != set(ours):
        raise SystemExit(f"lm_eval has {len(lm)} rows of {task}, jex {len(ours)}")
    prompts = texts = 0
    filters: dict[str, dict] = {}
    for d, r in ours.items():
        first = next(iter(lm[d].values()))
        prompts += first["arguments"]["gen_args_0"]["arg_0"] != r["prompt"]
        texts += first["resps"][0][0] != r["generation"]
        for name, s in lm[d].items():
            f = filters.setdefault(name, {"answer_differences": 0, "verdict_differences": 0, "lm_eval": 0, "jex": 0})
            if name not in (r["filters"] or []):  # not generated by jex (refused or failed): no answer, no match
                f["answer_differences"] += 1
                f["verdict_differences"] += bool(s["exact_match"])
                f["lm_eval"] += bool(s["exact_match"]) / len(lm)
                continue
            i = r["filters"].index(name)
            f["answer_differences"] += s["filtered_resps"][0] != r["answers"][i]
            f["verdict_differences"] += bool(s["exact_match"]) != r["verdicts"][i]
            f["lm_eval"] += bool(s["exact_match"]) / len(lm)
            f["jex"] += r["verdicts"][i] / len(lm)
    return {"rows": len(lm), "prompt_differences": prompts, "generation_differences": texts,
            "jex_generated_tokens": sum(r["generation_tokens"] or 0 for r in ours.values()),
            "jex_stopped": sum(r["finish_reason"] == "stop" for r in ours.values()), "filters": filters}


def jex_metrics(run_dir: Path, out: Path, env: dict[str, str], task: str) -> dict:
    """acc and acc_norm (a generative task: exact_match per filter) as `jex export lm-eval` writes them."""
    shutil.rmtree(out, ignore_errors=True)
    timed([sys.executable, "-m", "jex", "export", "lm-eval", str(run_dir), "-o", str(out)], out.with_suffix(".log"),
          env, out.parent)
    (results,) = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    return json.loads(Path(results).read_text())["results"][task]


def bench_env() -> dict[str, str]:
    """The environment every tool runs in here: no Hub, no tokenizer threads, unbuffered output."""
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1"}


def recorder(out: Path, doc: dict) -> Callable[..., None]:
    """`record(**line)`: prints the line as JSON and rewrites `out` with `doc` as it stands (a call cut off keeps
    what it measured so far)."""
    def record(**line: object) -> None:
        say(**line)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=str))
    return record


def save(a: argparse.Namespace, done: list[dict]) -> None:
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), "cells": done}, indent=2, default=str))


def say(**line: object) -> None:
    print(json.dumps(line, default=str), flush=True)


def cell(kind: str, rows: int, a: argparse.Namespace, work: Path, env: dict[str, str], done: list[dict]) -> dict:
    if kind == "gsm8k":
        return gsm8k_cell(rows, a, work, env, done)
    task = make_tasks(kind, rows, work / f"tasks-{kind}")
    runs: list[dict] = []
    done.append({"cell": kind, "rows": rows, "runs": runs})
    for n in range(a.repeat):
        here = work / f"{kind}-{n}"
        here.mkdir(parents=True, exist_ok=True)
        lm = run_lm_eval(task, a.model, here / "lm", env, a.cpu, reuse=a.reuse)
        before = work / f"{kind}-{n - 1}" / "jex-run" / "store" if n else None
        ours = run_jex(task, a.model, here / "jex-run", env, before, a.cpu, a.jex_args, reuse=a.reuse)
        run_dir = Path(ours["run_dir"])
        fid = fidelity(task.stem, here / "lm", run_dir)
        metrics = jex_metrics(run_dir, here / "export", env, task.stem)
        same = {m: metrics.get(m) == lm["results"].get(m) for m in ("acc,none", "acc_norm,none")}
        runs.append({"repeat": n, "lm_eval": lm, "jex": ours, "fidelity": fid, "jex_metrics": metrics,
                     "metrics_equal": same, "jex_over_lm_eval": ours["wall_s"] / lm["wall_s"]})
        say(cell=f"{kind}:{rows}", repeat=n, lm_eval_s=round(lm["wall_s"], 1), jex_s=round(ours["wall_s"], 1),
            ratio=round(runs[-1]["jex_over_lm_eval"], 3), **fid, **same)
        save(a, done)
    return done[-1]


def gsm8k_cell(rows: int, a: argparse.Namespace, work: Path, env: dict[str, str], done: list[dict]) -> dict:
    """Per repeat: lm_eval at its first setting and jex, timed and compared row for row; then each jex variant
    and each other lm_eval setting, compared with its tool's first run (rows whose generation differs)."""
    task = make_tasks("gsm8k", rows, work / "tasks-gsm8k", a.max_gen_toks)
    seqs = a.lm_eval_seqs or [0]
    runs: list[dict] = []
    done.append({"cell": "gsm8k", "rows": rows, "max_gen_toks": a.max_gen_toks, "runs": runs})
    name = f"gsm8k:{rows}"
    for n in range(a.repeat):
        here = work / f"gsm8k-{n}"
        here.mkdir(parents=True, exist_ok=True)
        lm = run_lm_eval(task, a.model, here / "lm", env, a.cpu, seqs[0], a.reuse)
        say(cell=name, repeat=n, run=f"lm_eval seqs={seqs[0]}", wall_s=round(lm["wall_s"], 1),
            **{k: v for k, v in lm["results"].items() if k.startswith("exact_match,")})
        before = work / f"gsm8k-{n - 1}" / "jex-run" / "store" if n else a.warm_store
        ours = run_jex(task, a.model, here / "jex-run", env, before, a.cpu, a.jex_args, None, a.reuse)
        run_dir = Path(ours["run_dir"])
        fid = generation_fidelity(task.stem, here / "lm", run_dir)
        metrics = jex_metrics(run_dir, here / "export", env, task.stem)
        keys = [k for k in lm["results"] if k.startswith("exact_match,")]
        same = {k: metrics.get(k) == lm["results"][k] for k in keys}
        generate_s = ours["stages"].get("generate", {}).get("seconds")
        run: dict = {"repeat": n, "lm_eval": lm, "jex": ours, "fidelity": fid, "jex_metrics": metrics,
                     "metrics_equal": same, "jex_over_lm_eval": ours["wall_s"] / lm["wall_s"],
                     "jex_variants": [], "lm_eval_settings": []}
        runs.append(run)
        say(cell=name, repeat=n, run="jex", wall_s=round(ours["wall_s"], 1), generate_stage_s=generate_s,
            lm_eval_s=round(lm["wall_s"], 1), ratio=round(run["jex_over_lm_eval"], 3),
            **{k: v for k, v in fid.items() if k != "filters"},
            **{f"{f}:{k}": round(v, 4) if isinstance(v, float) else v
               for f, d in fid["filters"].items() for k, v in d.items()}, metrics_equal=same)
        save(a, done)
        first = {d: r["generation"] for d, r in jex_rows(run_dir, task.stem).items()}
        for j, variant in enumerate(a.jex_variant):
            other = run_jex(task, a.model, here / f"jex-variant-{j}", env, here / "jex-run" / "store", a.cpu,
                            [*a.jex_args, *shlex.split(variant)], None, a.reuse)
            texts = {d: r["generation"] for d, r in jex_rows(Path(other["run_dir"]), task.stem).items()}
            run["jex_variants"].append({"variant": variant, "jex": other, "generation_differences":
                                        differing(first, texts)})
            say(cell=name, repeat=n, run=f"jex {variant}", wall_s=round(other["wall_s"], 1),
                generate_stage_s=other["stages"].get("generate", {}).get("seconds"),
                generation_differences_vs_first_jex=run["jex_variants"][-1]["generation_differences"])
            save(a, done)
        first_lm = lm_texts(here / "lm", task.stem)
        for k in seqs[1:]:
            other = run_lm_eval(task, a.model, here / f"lm-seqs-{k}", env, a.cpu, k, a.reuse)
            diff = differing(first_lm, lm_texts(here / f"lm-seqs-{k}", task.stem))
            run["lm_eval_settings"].append({"seqs": k, "lm_eval": other, "generation_differences": diff})
            say(cell=name, repeat=n, run=f"lm_eval seqs={k}", wall_s=round(other["wall_s"], 1),
                generation_differences_vs_first_lm_eval=diff)
            save(a, done)
    return done[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="bf16 model folder both tools read")
    p.add_argument("--cell", action="append", required=True,
                   help="text:ROWS, letters:ROWS or gsm8k:ROWS (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each pair (the later ones on warm caches)")
    p.add_argument("--cpu", action="store_true", help="a smoke run of this harness: lm_eval's HF backend and "
                                                       "jex's HF engine on the CPU, fp32 (--model: an HF folder)")
    p.add_argument("--max-gen-toks", type=int, default=256, help="gsm8k: new tokens at most (max_gen_toks)")
    p.add_argument("--lm-eval-seqs", type=int, action="append", default=[],
                   help="gsm8k: vLLM's max_num_seqs for an lm_eval run, 0 = vLLM's default (--cpu: the HF batch "
                        "size, 0 = 8); repeatable, the first timed against jex, the others compared with it "
                        "(default: 0 alone)")
    p.add_argument("--jex-args", type=shlex.split, default=[],
                   help='more `jex run` flags for every jex run, one string (e.g. "--gpu-memory-utilization 0.5")')
    p.add_argument("--jex-variant", action="append", default=[],
                   help='gsm8k: another jex run with these `jex run` flags after --jex-args, one string '
                        '(e.g. "--reason-shard-rows 100"), its generations compared with the first run\'s '
                        "(repeatable)")
    p.add_argument("--reuse", action="store_true", help="read back each run whose folder under --work holds its "
                                                         "result.json instead of running it again")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu-peer"))
    p.add_argument("--warm-store", type=Path, help="a store whose compile cache and stored bake-off the first jex "
                                                    "run starts from (a team's store after its first campaign)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    if a.warm_store is not None and not any((a.warm_store / c).is_dir() for c in ("compile_cache", "bakeoff")):
        p.error(f"--warm-store {a.warm_store}: no compile_cache or bakeoff folder in it")
    a.work.mkdir(parents=True, exist_ok=True)
    env = bench_env()
    cells: list[dict] = []
    for spec in a.cell:
        kind, rows = spec.split(":")
        cell(kind, int(rows), a, a.work, env, cells)


if __name__ == "__main__":
    main()
