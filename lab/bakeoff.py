"""Batch-invariance bake-off: does greedy output depend on the batch size?

Each arm (an engine under one profile) generates G tokens for N divergence-prone prompts at every
rung of a batch ladder, an invariant arm with repeats. Tokens are compared with the arm's own
reference: the count of positions that differ, the first divergence (prompt, step), and run-to-run
identity per rung. The reference is the batch-1 run. Batch 1 is the dearest rung (one request at a
time), so it may read a sample of the prompts (`reference_prompts`); a prompt it did not read is
compared with its run at the smallest rung above batch 1, so batch 1 against that rung is checked on
the sample only. A control arm runs each rung once: the verdict reads only whether it diverged.
Arms run in separate processes (`python -m jex.lab.bakeoff ARM OUT JOB`, JOB the `BakeoffJob` as JSON):
batch invariance is process-wide in vLLM, so a control arm and an invariant arm must not share one. If
the control arm shows no divergence, the verdict says the test was underpowered instead of claiming
invariance.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypedDict, cast

from jex.engine.types import GenerateRequest
from jex.engine.vllm_engine import NGRAM
from jex.fileio import read_json
from jex.lab.jobs import BakeoffJob

TOPICS = ["a lighthouse keeper", "a failed rocket launch", "the history of a small bakery", "a chess endgame",
          "a river delta in flood", "a bug in a compiler", "a winter expedition", "the economics of a ferry"]
FACTS = ["The reading at {n} was {m} units.", "Step {n} took {m} seconds longer than planned.",
         "Entry {n}: the count rose to {m}.", "At {n} o'clock the level was {m} and still falling.",
         "Observer {n} reported {m} anomalies."]


class LadderRung(TypedDict):
    """One batch size of an arm's ladder, as generated: token ids per repeat and per prompt."""

    prompts: list[int]  # the prompts it read, by index
    runs: list[list[list[int]]]  # (repeat, prompt read, step)
    seconds: list[float]  # per repeat
    tok_s: float  # tokens / seconds of the first run
    tokens: int


class FirstDivergence(TypedDict):
    prompt: int
    step: int


class RungComparison(TypedDict):
    """One rung against the arm's reference (`compare`): `arm-*.json` and, less token_ids, bakeoff.json."""

    prompts: list[int]
    mismatches: int
    divergent_prompts: int
    first_divergence: FirstDivergence | None
    run_to_run_identical: bool
    tok_s: float
    tokens: int
    seconds: list[float]
    token_ids: list[list[int]]


class ArmResult(TypedDict, total=False):
    """One arm's `arm-*.json` (or, when its process failed, only `error` and empty rungs)."""

    arm: str
    rungs: dict[str, RungComparison]  # by batch size (as text)
    provenance: dict[str, Any]
    prompt_tokens: list[int]
    wall_seconds: float
    error: str


class SpeculationRung(TypedDict):
    tokens_identical: int
    tokens: int
    prompts_identical: int
    prompts: int
    tok_s: float
    base_tok_s: float
    speedup: float


class Speculation(TypedDict):
    """A speculative arm against its audited base arm, rung by rung."""

    base: str
    rungs: dict[str, SpeculationRung]
    exact: bool


class BakeoffResult(TypedDict):
    """What `run_bakeoff` returns (`bakeoff.json` holds it with the token ids left out)."""

    engine: str
    prompts: int
    tokens: int
    ladder: list[int]
    repeats: int
    reference_prompts: int  # how many prompts batch 1 read
    arms: dict[str, ArmResult]
    tax: dict[str, float]  # by batch: control tok/s / invariant tok/s
    speculation: dict[str, Speculation]
    errors: dict[str, str]
    verdict: str


def divergence_prompts(n: int = 32, seed: int = 0) -> list[str]:
    """Prompts of very different lengths (tens to ~2,000 tokens) that invite long free continuations."""
    rng = random.Random(f"jex-bakeoff:{seed}")
    out = []
    for i in range(n):
        sentences = int(2 * (1.13 ** i)) % 160 + 1
        body = " ".join(rng.choice(FACTS).format(n=rng.randint(1, 999), m=rng.randint(1, 9999))
                        for _ in range(sentences))
        out.append(f"Here are field notes about {TOPICS[i % len(TOPICS)]}. {body}\n\nContinue these notes with a "
                   "long, detailed, numbered list of further observations and your reasoning about each one.")
    return out


def reference_sample(prompts: list[str], k: int | None) -> list[int]:
    """The prompts batch 1 reads, by index: all, or `k` of them at evenly spaced ranks of their length
    (text, so every arm picks the same), the longest among them: long prompts diverge first."""
    n = len(prompts)
    if k is None or k >= n:
        return list(range(n))
    by_length = sorted(range(n), key=lambda i: (len(prompts[i]), i))
    return sorted(by_length[n - 1 - (j * n) // k] for j in range(k))


def run_ladder(engine: Any, prompts: list[str], *, ladder: list[int], repeats: int, tokens: int,
               reference: list[int] | None = None) -> dict[str, LadderRung]:
    """Generate at every rung (batch 1 on the `reference` prompts only, if given); returns token ids per
    repeat and throughput per rung."""
    requests = [GenerateRequest(f"p{i:03d}", engine.chat_prompt(p), tokens, ignore_eos=True)
                for i, p in enumerate(prompts)]
    engine.generate(requests[:1])  # warm-up outside the timings
    rungs: dict[str, LadderRung] = {}
    for batch in ladder:
        engine.batch_size = batch
        read = reference if batch == 1 and reference is not None else list(range(len(requests)))
        runs: list[list[list[int]]] = []
        seconds: list[float] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            gens = engine.generate([requests[i] for i in read])
            seconds.append(time.perf_counter() - t0)
            runs.append([list(g.token_ids) for g in gens])
        n_tok = sum(len(t) for t in runs[0])
        # the first run's rate: a control arm runs once, so the best of an invariant arm's runs would flatter it
        rungs[str(batch)] = {"prompts": read, "runs": runs, "seconds": seconds, "tok_s": n_tok / seconds[0],
                             "tokens": n_tok}
    return rungs


def compare(rungs: dict[str, LadderRung]) -> dict[str, RungComparison]:
    """Mismatches of every rung against its reference, and run-to-run identity of its repeats. A prompt's
    reference is its batch-1 run (repeat 0), else its run at the smallest rung above batch 1 that read it."""
    ref: dict[int, list[int]] = {}
    for batch in sorted(rungs, key=int):
        for p, tokens in zip(rungs[batch]["prompts"], rungs[batch]["runs"][0], strict=True):
            ref.setdefault(p, tokens)
    out: dict[str, RungComparison] = {}
    for batch, rung in rungs.items():
        mismatches, divergent = 0, 0
        first: FirstDivergence | None = None
        for p, b in zip(rung["prompts"], rung["runs"][0], strict=True):
            a = ref[p]
            diff = [s for s in range(max(len(a), len(b))) if s >= len(a) or s >= len(b) or a[s] != b[s]]
            mismatches += len(diff)
            if diff:
                divergent += 1
                if first is None or diff[0] < first["step"]:
                    first = {"prompt": p, "step": diff[0]}
        out[batch] = {"prompts": rung["prompts"], "mismatches": mismatches, "divergent_prompts": divergent,
                      "first_divergence": first,
                      "run_to_run_identical": all(r == rung["runs"][0] for r in rung["runs"]),
                      "tok_s": rung["tok_s"], "tokens": rung["tokens"], "seconds": rung["seconds"],
                      "token_ids": rung["runs"][0]}
    return out


def verdict(arms: dict[str, ArmResult], invariant_arms: list[str], control_arms: list[str]) -> str:
    """The bake-off's one-line conclusion; a quiet control arm makes it UNDERPOWERED, never INVARIANT."""
    def total(arm: str) -> int:
        return sum(r["mismatches"] for r in arms[arm]["rungs"].values())

    if control_arms and all(total(a) == 0 for a in control_arms if a in arms):
        return ("UNDERPOWERED: the control arm showed no divergence, so this run cannot show that the invariant "
                "arm is invariant (use longer generations or more, longer prompts)")
    broken = [a for a in invariant_arms if a in arms and (total(a) or not all(
        r["run_to_run_identical"] for r in arms[a]["rungs"].values()))]
    if broken:
        return f"NOT INVARIANT: {', '.join(broken)} differ from their reference run or run to run"
    if not any(a in arms for a in control_arms):
        return ("INVARIANT at every rung and run to run (no control arm ran, so this run does not show the test "
                "could detect divergence)")
    return "INVARIANT: 0 mismatches at every rung and run to run, while the control arm diverged"


def markdown(result: BakeoffResult) -> str:
    lines = [f"# Bake-off ({result['engine']})", "", f"**{result['verdict']}**", "",
             f"{result['prompts']} prompts x {result['tokens']} tokens, ladder {result['ladder']}, "
             f"{result['repeats']} runs of each rung of an invariant arm, 1 of a control arm."
             + ("" if result["reference_prompts"] == result["prompts"] else
                f" Batch 1 read {result['reference_prompts']} of the prompts; each other prompt is compared with "
                "its run at the smallest rung above batch 1."), "",
             "| arm | batch | mismatches | divergent prompts | first divergence (prompt, step) | run-to-run | tok/s |",
             "|---|---:|---:|---:|---|---|---:|"]
    for arm, data in result["arms"].items():
        for batch, r in data["rungs"].items():
            fd = r["first_divergence"]
            lines.append(f"| {arm} | {batch} | {r['mismatches']} | {r['divergent_prompts']} | "
                         f"{'-' if fd is None else (fd['prompt'], fd['step'])} | "
                         f"{_run_to_run(r)} | {r['tok_s']:.1f} |")
    if result.get("tax"):
        lines += ["", "| batch | BI tax (control tok/s / invariant tok/s) |", "|---:|---:|"]
        lines += [f"| {b} | {t:.2f}x |" for b, t in result["tax"].items()]
    for arm, sp in (result.get("speculation") or {}).items():
        lines += ["", f"**{arm}** against {sp['base']}: {'token-exact at every rung' if sp['exact'] else 'NOT EXACT'}",
                  "", "| batch | tokens identical | prompts identical | tok/s | base tok/s | speed-up |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {b} | {r['tokens_identical']}/{r['tokens']} | {r['prompts_identical']}/{r['prompts']} | "
                  f"{r['tok_s']:.1f} | {r['base_tok_s']:.1f} | {r['speedup']:.2f}x"
                  f"{' (slower)' if r['speedup'] < 1 else ''} |" for b, r in sp["rungs"].items()]
    return "\n".join(lines) + "\n"


def _run_to_run(rung: RungComparison) -> str:
    if len(rung["seconds"]) == 1:
        return "1 run"
    return "identical" if rung["run_to_run_identical"] else "DIFFERS"


def plot(result: BakeoffResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, data in result["arms"].items():
        batches = [int(b) for b in data["rungs"]]
        ax1.plot(batches, [r["tok_s"] for r in data["rungs"].values()], marker="o", label=arm)
        ax2.plot(batches, [r["mismatches"] for r in data["rungs"].values()], marker="o", label=arm)
    ax1.set(xlabel="batch size", ylabel="tokens / s", title="throughput", xscale="log", yscale="log")
    ax2.set(xlabel="batch size", ylabel="tokens differing from the reference", title="mismatches", xscale="log")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- one arm, in its own process -----------------------------------------------------------------

ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (engine kind, settings)
    "hf-bi": ("hf", {"batch_invariant": True}),
    "hf-bi-ngram": ("hf", {"batch_invariant": True, "speculative": NGRAM}),
    "hf-control": ("hf", {"batch_invariant": False}),
    "vllm-bi": ("vllm", {"name": "audit"}),
    "vllm-bi-ngram": ("vllm", {"name": "audit-ngram", "speculative_config": NGRAM}),
    "vllm-bi-fdo": ("vllm", {"name": "audit", "cudagraph_mode": "FULL_DECODE_ONLY"}),
    "vllm-control": ("vllm", {"name": "control", "batch_invariant": False}),
}
INVARIANT_ARMS = {"hf-bi", "hf-bi-ngram", "vllm-bi", "vllm-bi-ngram", "vllm-bi-fdo"}
SPECULATIVE_BASE = {"hf-bi-ngram": "hf-bi", "vllm-bi-ngram": "vllm-bi"}
"""Each speculative arm and the audited arm its tokens must equal, rung by rung."""


def speculation(arms: dict[str, ArmResult]) -> dict[str, Speculation]:
    """Per speculative arm and rung: tokens identical to its audited base arm (count), speed-up."""
    out: dict[str, Speculation] = {}
    for arm, base in SPECULATIVE_BASE.items():
        if arm not in arms or base not in arms:
            continue
        rungs: dict[str, SpeculationRung] = {}
        for batch, r in arms[arm]["rungs"].items():
            b = arms[base]["rungs"].get(batch)
            if b is None:
                continue
            pairs = list(zip(r["token_ids"], b["token_ids"], strict=True))
            same = sum(x == y for a, c in pairs for x, y in zip(a, c, strict=False))
            total = sum(max(len(a), len(c)) for a, c in pairs)
            rungs[batch] = {"tokens_identical": same, "tokens": total,
                            "prompts_identical": sum(a == c for a, c in pairs), "prompts": len(pairs),
                            "tok_s": r["tok_s"], "base_tok_s": b["tok_s"], "speedup": r["tok_s"] / b["tok_s"]}
        out[arm] = {"base": base, "rungs": rungs,
                    "exact": all(v["tokens_identical"] == v["tokens"] for v in rungs.values())}
    return out


def arm_engine(arm: str, job: BakeoffJob) -> Any:
    """The engine of one bake-off arm (its kind and profile from `ARMS`); campaigns build theirs with
    `jex.engine.factory.make_engine`."""
    kind, settings = ARMS[arm]
    model = job.model or None  # empty: the embedded model
    if kind == "hf":
        from jex.engine.hf import HFEngine

        return HFEngine(model, device=job.device, **settings)
    from jex.engine.vllm_engine import VLLMEngine, VLLMProfile

    # vLLM needs a model path: a missing model fails in VLLMEngine (Path(None)) as it always has
    return VLLMEngine(cast(str, model), VLLMProfile(max_num_seqs=job.max_num_seqs, **settings))


def _arm_main(arm: str, target: str, job_json: str) -> None:
    """One arm's process: its ladder under the bake-off `job_json` (a `BakeoffJob`), written to `target`."""
    job = BakeoffJob.model_validate_json(job_json)
    engine = arm_engine(arm, job)
    prompts = divergence_prompts(job.prompts)
    rungs = run_ladder(engine, prompts, ladder=job.ladder, repeats=job.repeats if arm in INVARIANT_ARMS else 1,
                       tokens=job.tokens, reference=reference_sample(prompts, job.reference_prompts))
    out: ArmResult = {"arm": arm, "rungs": compare(rungs), "provenance": engine.provenance(),
                      "prompt_tokens": [len(engine.encode(engine.chat_prompt(p))) for p in prompts]}
    Path(target).write_text(json.dumps(out, default=str))


def run_bakeoff(job: BakeoffJob, out_dir: Path) -> BakeoffResult:
    """Run each arm in a fresh process, then compare; writes bakeoff.json, bakeoff.md, bakeoff.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    arms = job.arms
    results = {arm: _run_arm(arm, job, out_dir / f"arm-{arm}.json") for arm in arms}
    ok = {a: r for a, r in results.items() if "error" not in r}
    inv = [a for a in arms if a in INVARIANT_ARMS]
    ctl = [a for a in arms if a not in INVARIANT_ARMS]
    tax: dict[str, float] = {}
    if inv and ctl and inv[0] in ok and ctl[0] in ok:
        tax = {b: ok[ctl[0]]["rungs"][b]["tok_s"] / ok[inv[0]]["rungs"][b]["tok_s"] for b in ok[inv[0]]["rungs"]}
    result: BakeoffResult = {
        "engine": ARMS[arms[0]][0], "prompts": job.prompts, "tokens": job.tokens, "ladder": job.ladder,
        "repeats": job.repeats,
        "reference_prompts": len(reference_sample(divergence_prompts(job.prompts), job.reference_prompts)),
        "arms": results, "tax": tax, "speculation": speculation(ok),
        "errors": {a: r["error"] for a, r in results.items() if "error" in r},
        "verdict": verdict(ok, inv, ctl) if ok else "NO RESULT: every arm failed"}
    slim = {**result, "arms": {a: {**r, "rungs": {b: {k: v for k, v in x.items() if k != "token_ids"}
                                                  for b, x in r.get("rungs", {}).items()}}
                               for a, r in results.items()}}  # the token ids stay in arm-*.json
    (out_dir / "bakeoff.json").write_text(json.dumps(slim, indent=1, default=str))
    (out_dir / "bakeoff.md").write_text(markdown({**result, "arms": ok}))
    if ok:
        plot({**result, "arms": ok}, out_dir / "bakeoff.png")
    return result


def _run_arm(arm: str, job: BakeoffJob, target: Path) -> ArmResult:
    """One arm in a fresh process (`python -m jex.lab.bakeoff ARM OUT JOB`) writing `target`."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
    cmd = [sys.executable, "-m", "jex.lab.bakeoff", arm, str(target), job.model_dump_json()]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=os.environ.copy())
    if proc.returncode != 0:
        return {"error": f"arm process exited {proc.returncode}", "rungs": {}}
    result: ArmResult = read_json(target)
    result["wall_seconds"] = time.perf_counter() - t0
    return result


if __name__ == "__main__":
    _arm_main(*sys.argv[1:])
