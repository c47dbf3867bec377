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

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal, cast

from pydantic import Field, model_validator

from jex.engine.vllm_engine import NGRAM
from jex.fileio import write_text
from jex.lab.jobs import BakeoffJob
from jex.record import Record, read_record, write_record
from jex.tasks.capture.invariance import (
    ArmResult,
    compare,
    divergence_prompts,
    reference_sample,
    run_ladder,
)


class SpeculationRung(Record):
    tokens_identical: int
    tokens: int
    prompts_identical: int
    prompts: int
    tok_s: float
    base_tok_s: float
    speedup: float


class Speculation(Record):
    """A speculative arm against its audited base arm, rung by rung."""

    base: str
    rungs: dict[str, SpeculationRung]
    exact: bool



class BakeoffResult(Record):
    """What `run_bakeoff` returns; `bakeoff.json` holds it with the token ids left out (`slim`). Read back
    through this record (`read_bakeoff`): a missing or renamed key is refused naming the file."""

    version: Literal[1] = Field(1, description="The record's version (absent before it: 1)")
    engine: str
    prompts: int
    tokens: int
    ladder: list[int]
    repeats: int
    reference_prompts: int = Field(description="How many prompts batch 1 read (absent before: all of them)")
    arms: dict[str, ArmResult]
    tax: dict[str, float] = Field(default_factory=dict, description="By batch: control tok/s / invariant tok/s")
    speculation: dict[str, Speculation] = Field(default_factory=dict)
    errors: dict[str, str] = Field(default_factory=dict)
    verdict: str

    @model_validator(mode="before")
    @classmethod
    def _before_reference_sample(cls, data: Any) -> Any:
        """A bake-off written before batch 1 read a sample read every prompt at batch 1."""
        if isinstance(data, dict) and "reference_prompts" not in data and "prompts" in data:
            return {**data, "reference_prompts": data["prompts"]}
        return data

    def ran(self) -> BakeoffResult:
        """The arms that ran (those without an error)."""
        return self.model_copy(update={"arms": {a: r for a, r in self.arms.items() if r.error is None}})

    def slim(self) -> BakeoffResult:
        return self.model_copy(update={"arms": {a: r.slim() for a, r in self.arms.items()}})


BAKEOFF_FILE = "bakeoff.json"


def read_bakeoff(path: str | Path) -> BakeoffResult:
    """`bakeoff.json` (a folder: the file in it), validated as `BakeoffResult`."""
    path = Path(path)
    return read_record(BakeoffResult, path / BAKEOFF_FILE if path.is_dir() else path)


def verdict(arms: dict[str, ArmResult], invariant_arms: list[str], control_arms: list[str]) -> str:
    """The bake-off's one-line conclusion: an invariant arm that differs is NOT INVARIANT whatever the control
    did; otherwise a quiet control makes it UNDERPOWERED, never INVARIANT."""
    broken = [a for a in invariant_arms if a in arms and (arms[a].mismatches() or not all(
        r.run_to_run_identical for r in arms[a].rungs.values()))]
    if broken:
        return f"NOT INVARIANT: {', '.join(broken)} differ from their reference run or run to run"
    if control_arms and all(arms[a].mismatches() == 0 for a in control_arms if a in arms):
        return ("UNDERPOWERED: the control arm showed no divergence, so this run cannot show that the invariant "
                "arm is invariant (use longer generations or more, longer prompts)")
    if not any(a in arms for a in control_arms):
        return ("INVARIANT at every rung and run to run (no control arm ran, so this run does not show the test "
                "could detect divergence)")
    return "INVARIANT: 0 mismatches at every rung and run to run, while the control arm diverged"


def markdown(result: BakeoffResult) -> str:
    lines = [f"# Bake-off ({result.engine})", "", f"**{result.verdict}**", "",
             f"{result.prompts} prompts x {result.tokens} tokens, ladder {result.ladder}, "
             f"{result.repeats} runs of each rung of an invariant arm, 1 of a control arm."
             + ("" if result.reference_prompts == result.prompts else
                f" Batch 1 read {result.reference_prompts} of the prompts; each other prompt is compared with "
                "its run at the smallest rung above batch 1."), "",
             "| arm | batch | mismatches | divergent prompts | first divergence (prompt, step) | run-to-run | tok/s |",
             "|---|---:|---:|---:|---|---|---:|"]
    for arm, data in result.arms.items():
        for batch, r in data.rungs.items():
            fd = r.first_divergence
            lines.append(f"| {arm} | {batch} | {r.mismatches} | {r.divergent_prompts} | "
                         f"{'-' if fd is None else (fd.prompt, fd.step)} | {r.run_to_run()} | {r.tok_s:.1f} |")
    if result.tax:
        lines += ["", "| batch | BI tax (control tok/s / invariant tok/s) |", "|---:|---:|"]
        lines += [f"| {b} | {t:.2f}x |" for b, t in result.tax.items()]
    for arm, sp in result.speculation.items():
        lines += ["", f"**{arm}** against {sp.base}: {'token-exact at every rung' if sp.exact else 'NOT EXACT'}",
                  "", "| batch | tokens identical | prompts identical | tok/s | base tok/s | speed-up |",
                  "|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {b} | {r.tokens_identical}/{r.tokens} | {r.prompts_identical}/{r.prompts} | "
                  f"{r.tok_s:.1f} | {r.base_tok_s:.1f} | {r.speedup:.2f}x"
                  f"{' (slower)' if r.speedup < 1 else ''} |" for b, r in sp.rungs.items()]
    return "\n".join(lines) + "\n"


def plot(result: BakeoffResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, data in result.arms.items():
        batches = [int(b) for b in data.rungs]
        ax1.plot(batches, [r.tok_s for r in data.rungs.values()], marker="o", label=arm)
        ax2.plot(batches, [r.mismatches for r in data.rungs.values()], marker="o", label=arm)
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
    "hf-control": ("hf", {"batch_invariant": False, "dtype": "bfloat16"}),  # padded fp32 batches rarely flip a token
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
        for batch, r in arms[arm].rungs.items():
            b = arms[base].rungs.get(batch)
            if b is None:
                continue
            pairs = list(zip(r.token_ids or [], b.token_ids or [], strict=True))
            same = sum(x == y for a, c in pairs for x, y in zip(a, c, strict=False))
            total = sum(max(len(a), len(c)) for a, c in pairs)
            rungs[batch] = SpeculationRung(tokens_identical=same, tokens=total,
                                           prompts_identical=sum(a == c for a, c in pairs), prompts=len(pairs),
                                           tok_s=r.tok_s, base_tok_s=b.tok_s, speedup=r.tok_s / b.tok_s)
        out[arm] = Speculation(base=base, rungs=rungs,
                               exact=all(v.tokens_identical == v.tokens for v in rungs.values()))
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
    return VLLMEngine(cast(str, model), VLLMProfile.of(max_num_seqs=job.max_num_seqs, **settings))


def _arm_main(arm: str, target: str, job_json: str) -> None:
    """One arm's process: its ladder under the bake-off `job_json` (a `BakeoffJob`), written to `target`."""
    job = BakeoffJob.model_validate_json(job_json)
    engine = arm_engine(arm, job)
    prompts = divergence_prompts(job.prompts)
    rungs = run_ladder(engine, prompts, ladder=job.ladder, repeats=job.repeats if arm in INVARIANT_ARMS else 1,
                       tokens=job.tokens, reference=reference_sample(prompts, job.reference_prompts))
    write_record(target, ArmResult(arm=arm, rungs=compare(rungs), provenance=engine.provenance(),
                                   prompt_tokens=[len(engine.encode(engine.chat_prompt(p))) for p in prompts]))


def run_bakeoff(job: BakeoffJob, out_dir: Path) -> BakeoffResult:
    """Run each arm in a fresh process, then compare; writes bakeoff.json, bakeoff.md, bakeoff.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {arm: _run_arm(arm, job, out_dir / f"arm-{arm}.json") for arm in job.arms}
    result = bakeoff_result(results, engine=ARMS[job.arms[0]][0], prompts=job.prompts, tokens=job.tokens,
                            ladder=job.ladder, repeats=job.repeats, reference_prompts=len(
                                reference_sample(divergence_prompts(job.prompts), job.reference_prompts)))
    write_bakeoff(result, out_dir)
    return result


def bakeoff_result(results: dict[str, ArmResult], *, engine: str, prompts: int, tokens: int, ladder: list[int],
                   repeats: int, reference_prompts: int) -> BakeoffResult:
    """The bake-off of finished arms (in order: `jex bakeoff`'s processes, or a machine's audit probe): the
    tax on the rungs both the first invariant and the first control arm ran, the speculation, the verdict."""
    ok = {a: r for a, r in results.items() if r.error is None}
    inv = [a for a in results if a in INVARIANT_ARMS]
    ctl = [a for a in results if a not in INVARIANT_ARMS]
    tax: dict[str, float] = {}
    if inv and ctl and inv[0] in ok and ctl[0] in ok:  # a control stopped at its divergence ran fewer rungs
        tax = {b: ok[ctl[0]].rungs[b].tok_s / ok[inv[0]].rungs[b].tok_s for b in ok[inv[0]].rungs
               if b in ok[ctl[0]].rungs}
    return BakeoffResult(
        engine=engine, prompts=prompts, tokens=tokens, ladder=ladder, repeats=repeats,
        reference_prompts=reference_prompts, arms=results, tax=tax, speculation=speculation(ok),
        errors={a: r.error for a, r in results.items() if r.error is not None},
        verdict=verdict(ok, inv, ctl) if ok else "NO RESULT: every arm failed")


def write_bakeoff(result: BakeoffResult, out_dir: Path) -> None:
    """`bakeoff.json` (the token ids stay in `arm-*.json`), `bakeoff.md` and, when an arm ran, `bakeoff.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_record(out_dir / BAKEOFF_FILE, result.slim())
    write_text(out_dir / "bakeoff.md", markdown(result.ran()))
    if result.ran().arms:
        plot(result.ran(), out_dir / "bakeoff.png")


def _run_arm(arm: str, job: BakeoffJob, target: Path) -> ArmResult:
    """One arm in a fresh process (`python -m jex.lab.bakeoff ARM OUT JOB`) writing `target`."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {sorted(ARMS)}")
    cmd = [sys.executable, "-m", "jex.lab.bakeoff", arm, str(target), job.model_dump_json()]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=os.environ.copy())
    if proc.returncode != 0:
        return ArmResult(error=f"arm process exited {proc.returncode}")
    return read_record(ArmResult, target).model_copy(update={"wall_seconds": time.perf_counter() - t0})


if __name__ == "__main__":
    _arm_main(*sys.argv[1:])
