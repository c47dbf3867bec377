"""The batch-invariance probe an audit runs: divergence-prone prompts generated at every rung of a batch
ladder, each rung compared with the arm's reference (batch 1, or for a prompt batch 1 did not read, its
run at the smallest rung above). The lab's bake-off (`jex.lab.bakeoff`) runs arms of it in processes of
their own; a machine's engine host runs the campaign's own engine through it for the settings audit
(`probe_engine`), with the control arm beside it in another process (`python -m jex.tasks.capture.invariance
control PROBE OUT`), which stops at its first divergence: it only has to show the test's power. The control
starts with the campaign's engine where the GPU's memory allows (`start_probe`), so its start hides behind
the engine's instead of following it.
"""

from __future__ import annotations

import functools
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypedDict

from pydantic import Field

from jex.engine.types import GenerateRequest
from jex.engine_identity import EffectiveSettings
from jex.engine_spec import EngineSpec
from jex.record import Record, read_record, write_record

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


class FirstDivergence(Record):
    prompt: int
    step: int


class RungComparison(Record):
    """One rung against the arm's reference (`compare`): `arm-*.json` and, less token_ids, bakeoff.json."""

    prompts: list[int] = Field(default_factory=list, description="The prompts it read, by index (absent in "
                                                                  "files before batch 1 read a sample)")
    mismatches: int = Field(description="Tokens differing from the reference")
    divergent_prompts: int
    first_divergence: FirstDivergence | None
    run_to_run_identical: bool
    tok_s: float = Field(description="tokens / seconds of the first run")
    tokens: int
    seconds: list[float] = Field(description="Per repeat")
    token_ids: list[list[int]] | None = Field(None, description="The first run's tokens per prompt read "
                                                                "(`arm-*.json` only; absent in bakeoff.json)")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"token_ids"})

    def run_to_run(self) -> str:
        if len(self.seconds) == 1:
            return "1 run"
        return "identical" if self.run_to_run_identical else "DIFFERS"


class ArmResult(Record):
    """One arm's `arm-*.json` (or, when its process failed, only `error` and empty rungs)."""

    arm: str | None = None
    rungs: dict[str, RungComparison] = Field(default_factory=dict, description="By batch size (as text)")
    provenance: dict[str, Any] | None = None
    prompt_tokens: list[int] | None = None
    wall_seconds: float | None = None
    error: str | None = None
    scale: int | None = Field(None, description="An audit's lengthening: prompts and tokens times this")
    effective: EffectiveSettings | None = Field(None, description="What the arm's engine ran with, read back")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"arm", "provenance", "prompt_tokens", "wall_seconds",
                                                        "error", "scale", "effective"})

    def mismatches(self) -> int:
        return sum(r.mismatches for r in self.rungs.values())

    def slim(self) -> ArmResult:
        """The arm as bakeoff.json holds it: the token ids stay in `arm-*.json`."""
        return self.model_copy(update={"rungs": {b: r.model_copy(update={"token_ids": None})
                                                 for b, r in self.rungs.items()}})


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
               reference: list[int] | None = None, stop_at_divergence: bool = False,
               on_rung: Callable[[int], None] | None = None) -> dict[str, LadderRung]:
    """Generate at every rung (batch 1 on the `reference` prompts only, if given); returns token ids per
    repeat and throughput per rung. With `stop_at_divergence` (a control arm, which only has to show the
    test's power) the ladder ends at the first rung that differs from the reference. The engine's own
    batch size is restored after (an engine host's engine serves the campaign next). `on_rung(batch)` after
    each rung: an engine host's progress, so its client does not take a long probe for a stalled host."""
    requests = [GenerateRequest(f"p{i:03d}", engine.chat_prompt(p), tokens, ignore_eos=True)
                for i, p in enumerate(prompts)]
    engine.generate(requests[:1])  # warm-up outside the timings
    rungs: dict[str, LadderRung] = {}
    size = "requested_batch_size" if hasattr(engine, "requested_batch_size") else "batch_size"  # HF: its request
    own_batch = getattr(engine, size)
    try:
        for batch in ladder:
            rungs[str(batch)] = _rung(engine, requests, batch, repeats,
                                      reference if batch == 1 and reference is not None else None)
            if on_rung is not None:
                on_rung(batch)
            if stop_at_divergence and any(r.mismatches for r in compare(rungs).values()):
                break
    finally:
        setattr(engine, size, own_batch)
    return rungs


def _rung(engine: Any, requests: list[GenerateRequest], batch: int, repeats: int,
          reference: list[int] | None) -> LadderRung:
    engine.batch_size = batch
    read = reference if reference is not None else list(range(len(requests)))
    runs: list[list[list[int]]] = []
    seconds: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gens = engine.generate([requests[i] for i in read])
        seconds.append(time.perf_counter() - t0)
        runs.append([list(g.token_ids) for g in gens])
    n_tok = sum(len(t) for t in runs[0])
    # the first run's rate: a control arm runs once, so the best of an invariant arm's runs would flatter it
    return {"prompts": read, "runs": runs, "seconds": seconds, "tok_s": n_tok / seconds[0], "tokens": n_tok}


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
                if first is None or diff[0] < first.step:
                    first = FirstDivergence(prompt=p, step=diff[0])
        out[batch] = RungComparison(prompts=rung["prompts"], mismatches=mismatches, divergent_prompts=divergent,
                                    first_divergence=first,
                                    run_to_run_identical=all(r == rung["runs"][0] for r in rung["runs"]),
                                    tok_s=rung["tok_s"], tokens=rung["tokens"], seconds=rung["seconds"],
                                    token_ids=rung["runs"][0])
    return out


SCALES = (1, 2, 4)
"""An audit whose control arm stays quiet is lengthened: prompts and new tokens times 2, then 4."""
PROBE_FILE = "probe.json"


class InvarianceProbe(Record):
    """What the settings audit asks a machine to measure: the campaign's engine through the ladder at each
    scale until the control arm diverges (or the invariant arm fails), the control beside it."""

    arm: str = Field(description="The audited arm's name (the campaign engine's settings)")
    control_arm: str
    control: EngineSpec | None = Field(description="The control arm's engine; None: its power is already known "
                                                   "(a stored audit of this shape), only the invariant arm runs")
    prompts: int = Field(ge=1)
    tokens: int = Field(ge=1)
    ladder: list[int]
    repeats: int = Field(2, ge=1)
    reference_prompts: int | None = None
    scales: list[int] = Field(default_factory=lambda: list(SCALES))
    engine_home: str | None = Field(None, description="The machine's engine folder: the control takes its start "
                                                      "lock, as a second engine host would")


class ProbeOutcome(Record):
    """`probe.json`: how far the probe went; the arms are `arm-<name>.json` beside it."""

    scale: int
    passed: bool = Field(description="The invariant arm: no token differing from its reference, run to run")
    powered: bool | None = Field(description="The control arm diverged (None: no control ran)")
    control_error: str | None = None
    seconds: float
    control_beside_start: bool | None = Field(None, description="The control's process started with the campaign's "
                                                                "engine (True) or once it was up (False); None: "
                                                                "no control ran")


@dataclass
class StartedProbe:
    """A probe whose folder is laid out, its control arm's process running (None: no control)."""

    control: subprocess.Popen[bytes] | None
    beside_start: bool


def control_beside_start(campaign: EngineSpec, control: EngineSpec) -> bool:
    """Whether the control may start while the campaign's engine starts. Always where the campaign's engine
    does not size its KV cache from the GPU's free memory (HF, or a fixed `kv_cache_memory_gib`); for vLLM
    otherwise, when the control's footprint leaves the campaign's engine most of its cache
    (`engine.memory.neighbour_fits_start`). A GPU or model this cannot size: after (the safe order)."""
    if not campaign.kind.startswith("vllm") or not campaign.starts_alone():
        return True
    try:
        import torch

        from jex.engine.hf import DEFAULT_CACHE
        from jex.engine.memory import GpuKind, ModelShape, neighbour_fits_start
        from jex.engine.models import model_config, resolve_model, safetensors_index_size

        folder = resolve_model(campaign.model, DEFAULT_CACHE).path
        config = model_config(folder)
        total = torch.cuda.mem_get_info()[1]
        return neighbour_fits_start(ModelShape.from_config(config.get("text_config") or config),
                                    dtype=campaign.dtype, weights_bytes_on_disk=safetensors_index_size(folder),
                                    gpu=GpuKind(name="this machine's", memory_gib=total / 2**30),
                                    engine=campaign.vllm, neighbour=control.vllm)
    except Exception as e:  # noqa: BLE001 - no answer means the order that cannot starve the campaign's engine
        print(f"settings audit: the control starts after the engine ({type(e).__name__}: {e})", flush=True)
        return False


def start_probe(probe: InvarianceProbe, out: Path, campaign: EngineSpec | None = None) -> StartedProbe:
    """Lay out the probe's folder (an earlier attempt's files removed) and start its control arm: now when
    `campaign` (the engine about to start) is given and `control_beside_start` allows it, else None (then
    `probe_engine` starts it once the campaign's engine is up)."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("control-s*.json"), *out.glob("arm-*.json"), out / PROBE_FILE]:
        stale.unlink(missing_ok=True)  # an earlier attempt's (a host replaced mid-probe): never read as this one's
    write_record(out / "probe-request.json", probe)
    beside = probe.control is not None and campaign is not None and control_beside_start(campaign, probe.control)
    return StartedProbe(control=_start_control(probe, out) if beside else None, beside_start=beside)


def arm_result(engine: Any, probe: InvarianceProbe, scale: int, *, invariant: bool,
               on_rung: Callable[[int], None] | None = None) -> ArmResult:
    """One arm of the probe at `scale` on `engine` (a control stops at its first divergence)."""
    prompts = divergence_prompts(probe.prompts * scale)
    t0 = time.perf_counter()
    rungs = run_ladder(engine, prompts, ladder=probe.ladder, repeats=probe.repeats if invariant else 1,
                       tokens=probe.tokens * scale, reference=reference_sample(prompts, probe.reference_prompts),
                       stop_at_divergence=not invariant, on_rung=on_rung)
    effective = engine.effective_settings() if hasattr(engine, "effective_settings") else None
    return ArmResult(arm=probe.arm if invariant else probe.control_arm, rungs=compare(rungs),
                     provenance=engine.provenance(), prompt_tokens=[len(engine.encode(engine.chat_prompt(p)))
                                                                    for p in prompts],
                     wall_seconds=time.perf_counter() - t0, scale=scale, effective=effective)


def invariant(arm: ArmResult) -> bool:
    return bool(arm.rungs) and arm.error is None and all(r.mismatches == 0 and r.run_to_run_identical
                                                         for r in arm.rungs.values())


CONTROL_WAIT_S = 1800.0
"""How long the probe waits for the control arm's result at one scale (its engine start, a cold compile among
it, and its ladder) before it records the control as failed."""
CONTROL_ENV_DROPPED = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "VLLM_USE_AOT_COMPILE")
"""What vLLM's batch-invariant mode set in the host's environment: the control runs vLLM's defaults."""

Progress = Callable[[str, int, int], None]


def probe_engine(engine: Any, probe: InvarianceProbe, out: Path, progress: Progress | None = None,
                 started: StartedProbe | None = None) -> ProbeOutcome:
    """The audit on a machine: `engine` (the campaign's, already started: no second start) through the
    ladder, the control arm in its own process beside it (batch invariance is process-wide), scale after
    scale while the control stays quiet and the invariant arm holds. `started`: the probe as `start_probe`
    laid it out before the engine started (its control perhaps running already). Writes the arms' files and
    `probe.json`; `progress(what, done, total)` as each rung ends and while it waits for the control."""
    started = started or start_probe(probe, out)
    control = started.control or (_start_control(probe, out) if probe.control else None)
    t0, powered, error, scale = time.perf_counter(), None, None, probe.scales[0]
    def tick(what: str, done: int) -> None:
        if progress is not None:
            progress(what, done, len(probe.ladder))

    try:
        for scale in probe.scales:
            arm = arm_result(engine, probe, scale, invariant=True,
                             on_rung=functools.partial(_rung_done, tick, f"audit x{scale}", probe.ladder))
            write_record(out / f"arm-{probe.arm}.json", arm)
            if control is not None:
                quiet, error = _control_at(control, out, scale, functools.partial(tick, f"audit x{scale} control", 0))
                powered = None if quiet is None else not quiet
            if not invariant(arm) or powered is not False:
                break
    finally:
        if control is not None:
            _stop(control)
    outcome = ProbeOutcome(scale=scale, passed=invariant(arm), powered=powered, control_error=error,
                           seconds=time.perf_counter() - t0,
                           control_beside_start=started.beside_start if probe.control else None)
    write_record(out / PROBE_FILE, outcome)
    return outcome


def _rung_done(tick: Callable[[str, int], None], what: str, ladder: list[int], batch: int) -> None:
    tick(f"{what} rung", ladder.index(batch) + 1)


def _start_control(probe: InvarianceProbe, out: Path) -> subprocess.Popen[bytes]:
    """The control arm's process, in a session of its own (its compile workers stop with it), with vLLM's
    default environment and a compile cache of its own (seeded with the machine's architecture inspections,
    where its engine slots made any)."""
    import os

    from jex.engine.compile_cache import seed_modelinfos

    env = {k: v for k, v in os.environ.items() if k not in CONTROL_ENV_DROPPED}
    env["VLLM_CACHE_ROOT"] = str(out / "control-cache")
    if probe.engine_home:  # the campaign engine inspected the architecture already: the control need not again
        seed_modelinfos(out / "control-cache", Path(probe.engine_home))
    return subprocess.Popen([sys.executable, "-m", "jex.tasks.capture.invariance", "control",
                             str(out / "probe-request.json"), str(out)], env=env, start_new_session=True)


def stop_control(probe: StartedProbe) -> None:
    """Stop the probe's control arm if it still runs (its probe ended, or the engine beside it never started)."""
    if probe.control is not None:
        _stop(probe.control)


def _stop(control: subprocess.Popen[bytes]) -> None:
    import os
    import signal

    if control.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(control.pid, sig)
            control.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _control_at(control: subprocess.Popen[bytes], out: Path, scale: int, waiting: Callable[[], None],
                timeout_s: float = CONTROL_WAIT_S) -> tuple[bool | None, str | None]:
    """(quiet, error) of the control arm at `scale`: its file, else its process's end or the deadline."""
    target = out / f"control-s{scale}.json"
    deadline, last_tick = time.monotonic() + timeout_s, 0.0
    while not target.exists():
        if control.poll() is not None and not target.exists():
            return None, f"the control arm's process exited {control.returncode} before scale {scale}"
        if time.monotonic() > deadline:
            return None, f"the control arm gave no result at scale {scale} within {timeout_s:.0f} s"
        if time.monotonic() - last_tick > 5:
            waiting()
            last_tick = time.monotonic()
        time.sleep(0.2)
    arm = read_record(ArmResult, target)
    (out / f"arm-{arm.arm}.json").write_bytes(target.read_bytes())
    return arm.mismatches() == 0, None


def control_main(probe_file: str, out: str) -> None:
    """The control arm's process: its engine (started under the machine's start lock when it profiles the
    GPU's memory), then each scale until it diverges; `control-sN.json` written as each scale ends."""
    from contextlib import nullcontext

    from jex.tasks.execution.engine_host.protocol import flock
    from jex.tasks.execution.engine_pool import get_engine

    probe = read_record(InvarianceProbe, Path(probe_file))
    spec = probe.control
    assert spec is not None
    alone = spec.starts_alone() and probe.engine_home
    with flock(Path(str(probe.engine_home)) / "engine-start.lock") if alone else nullcontext():
        engine = get_engine(spec)
    for scale in probe.scales:
        arm = arm_result(engine, probe, scale, invariant=False)
        write_record(Path(out) / f"control-s{scale}.json", arm)
        if arm.mismatches():
            return


if __name__ == "__main__" and sys.argv[1:2] == ["control"]:
    control_main(*sys.argv[2:4])
