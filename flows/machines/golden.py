"""The machines' golden jobs, as the fleet runs them: each machine's replay of the bundle's first rows against
the store's reference (or establishing it), its golden generation, and on the first machine the settings
audit's probe before them, on the same engine; and the compile cache the first golden job brings or takes.
`GoldenReplays` is the fleet's part that does this (`GpuFleet` inherits it and supplies how a job runs)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import polars as pl
from pydantic import JsonValue

from jex.engine_identity import EngineFingerprint
from jex.engine_spec import EngineSpec
from jex.errors import FlowError
from jex.fileio import write_json
from jex.flows.machines.audit import AuditPlan
from jex.flows.machines.machine_life import MachineLife, machine_gpus, machine_of, machine_provenance
from jex.flows.machines.machines_doc import FingerprintMismatch, GoldenReplay
from jex.infra.machine import MachineSession, RemoteJob
from jex.infra.providers import Machine
from jex.infra.records import MachineProvenance
from jex.record import write_record
from jex.store_layout import compile_cache_dir, machine_inbox
from jex.tasks.campaign_spec import MachinesSpec
from jex.tasks.capture.golden import (
    compare_generation,
    compare_golden,
    find_reference,
    generation_reference_path,
    has_reference,
    store_reference,
)
from jex.tasks.capture.invariance import PROBE_FILE, InvarianceProbe
from jex.tasks.capture.stages import stage_plan
from jex.tasks.documents import GenerationVerdict, GoldenVerdict
from jex.tasks.execution import COMPILE_CACHE, compile_cache_key
from jex.tasks.inputs import EngineJob, ReasonInputs
from jex.tasks.records import BundleSummary, StagePlan
from jex.tasks.store import LocalStore, write_parquet

PROBE_OUT = "audit"
"""The golden job's folder for the audit probe's arms and outcome."""


class GoldenMismatch(FlowError):
    """A machine's golden replay is outside the tolerance, or the machine measured another engine
    fingerprint than the fleet's (then nothing was compared): it runs no shard."""

    def __init__(self, machine: str, verdict: GoldenVerdict | FingerprintMismatch | GenerationVerdict):
        if isinstance(verdict, FingerprintMismatch):
            what = f"engine fingerprint {verdict.fingerprint} differs from the fleet's {verdict.expected}"
        elif isinstance(verdict, GenerationVerdict):
            what = (f"greedy generation of {verdict.rows} rows x {verdict.tokens} tokens differs from "
                    f"{verdict.reference} ({'; '.join(verdict.differing)}): batch variance, or another GPU stack "
                    "than the reference's (if the stack changed on purpose, delete that reference to record a new "
                    "one)")
        else:
            worst = ", ".join(f"{w.run_id} ({w.max_abs_dp:.3g})" for w in verdict.worst[:3])
            what = (f"max |dp| {verdict.max_abs_dp:.3g} > tolerance {verdict.tolerance:.3g}; worst rows: {worst}; "
                    f"{verdict.problems[:3]}")
        super().__init__(f"golden replay on {machine}: {what}")
        self.verdict = verdict


class GoldenReplays:
    """The fleet's golden jobs (see the module docstring); what they need of the fleet is declared here."""

    spec: MachinesSpec
    store: LocalStore
    echo: Callable[[str], None]
    golden: list[GoldenReplay | FingerprintMismatch]
    engine_fp: EngineFingerprint | None
    _reference_due: int
    _lock: threading.Lock
    _lives: list[MachineLife]

    def _run(self, session: MachineSession, job: RemoteJob) -> None:
        raise NotImplementedError

    def _host_options_argv(self, host: Machine, engine: EngineSpec, inbox: Path, files: dict[str, Path]) -> list[str]:
        raise NotImplementedError

    def _judge_probe(self, plan: AuditPlan, inbox: Path) -> None:
        raise NotImplementedError

    def _golden(self, session: MachineSession, job: EngineJob, audit: AuditPlan | None = None) -> None:
        """Machine `session`'s golden replay, compared with the stored reference (or the head of this
        engine's fast-pass capture). With nothing a replay could meet (one machine, no reference of the
        bundle in the store) the machine only measures its fingerprint, and the fast pass it runs next
        becomes the reference (`_establish_reference`): a replay would compare nothing."""
        host = machine_of(session)
        inputs = job.inputs
        rows = min(self.spec.golden_rows, inputs.bundle.rows)
        replay_rows = rows if len(self._lives) > 1 or has_reference(self.store, inputs.bundle) else 0
        inbox = self._replay(session, job, "golden", replay_rows, first=True, probe=audit.probe if audit else None)
        if audit is not None:
            self._judge_probe(audit, inbox)
        fp = EngineFingerprint.model_validate_json((inbox / "fingerprint.json").read_text())
        generation = self._generation_verdict(session, inputs.bundle, fp, inbox)
        with self._lock:
            self.engine_fp = self.engine_fp or fp
            if fp != self.engine_fp:
                mismatch = FingerprintMismatch(machine=host.id, fingerprint=fp, expected=self.engine_fp)
                self.golden.append(mismatch)
                raise GoldenMismatch(host.id, mismatch)
            plan = stage_plan(inputs.model_copy(update={"engine_fp": fp}), job.store)
            capture = Path(plan.folder) / "capture.parquet"
            ref, source = find_reference(self.store, inputs.bundle, fp, rows, str(capture)) if rows else \
                (None, "nothing (no multiple-choice row)")
            if not rows:  # generative catalogs alone: no readout to replay; the golden generation checks the machine
                verdict = GoldenReplay(machine=host.id, reference="no multiple-choice row", established=False,
                                       ok=True, rows=0, max_abs_dp=0.0, tolerance=self.spec.golden_tolerance)
            elif not replay_rows and ref is None:
                self._reference_due = rows
                verdict = GoldenReplay(machine=host.id, reference="the fast pass's first rows", established=True,
                                       ok=True, rows=0, max_abs_dp=0.0, tolerance=self.spec.golden_tolerance)
            elif ref is None:
                source = str(store_reference(self.store, inputs.bundle, fp, pl.read_parquet(inbox / "golden.parquet")))
                verdict = GoldenReplay(machine=host.id, reference=source, established=True, ok=True, rows=rows,
                                       max_abs_dp=0.0, tolerance=self.spec.golden_tolerance)
            else:
                if not replay_rows:  # a capture of this engine but no stored reference (an in-process fast pass)
                    inbox = self._replay(session, job, "golden-replay", rows, first=False)
                replay = pl.read_parquet(inbox / "golden.parquet")
                verdict = GoldenReplay(machine=host.id, reference=source, established=False,
                                       **dict(compare_golden(ref, replay, self.spec.golden_tolerance)))
            verdict = verdict.model_copy(update={"generation": generation})
            self.golden.append(verdict)
        self.echo(f"machine {host.id}: golden replay of {verdict.rows} rows: max |dp| {verdict.max_abs_dp:.3g} "
                  f"({'reference established' if verdict.established else 'against ' + source})")
        if generation is not None:
            self.echo(f"machine {host.id}: golden generation of {generation.rows} rows x {generation.tokens} tokens: "
                      + ("reference established" if generation.established else
                         "token-identical" if generation.ok else f"{len(generation.differing)}+ rows differ"))
        if not verdict.ok:
            raise GoldenMismatch(host.id, verdict)
        if generation is not None and not generation.ok:
            raise GoldenMismatch(host.id, generation)

    def _generation_verdict(self, session: MachineSession, bundle: BundleSummary, fp: EngineFingerprint,
                            inbox: Path) -> GenerationVerdict | None:
        """The machine's golden generation against the store's reference for this bundle, engine and GPU
        models, or established as that reference when there is none; None when the spec asks for none."""
        replay = inbox / GOLDEN_GENERATION
        if not self.spec.golden_generation_rows or not replay.exists():
            return None
        gpus = machine_gpus(machine_provenance(session))
        ref = generation_reference_path(self.store, bundle, fp, gpus, self.spec.golden_generation_rows,
                                        self.spec.golden_generation_tokens)
        with self._lock:
            got = pl.read_parquet(replay)
            if not ref.exists():
                write_parquet(got, ref)
                return GenerationVerdict(ok=True, rows=got.height, tokens=self.spec.golden_generation_tokens,
                                         reference=str(ref), established=True)
            return compare_generation(pl.read_parquet(ref), got, source=str(ref),
                                      tokens=self.spec.golden_generation_tokens)

    def _replay(self, session: MachineSession, job: EngineJob, name: str, rows: int, *, first: bool,
                probe: InvarianceProbe | None = None) -> Path:
        """Run the golden job `name` (the bundle's first `rows` rows and the engine fingerprint) on the
        machine; its inbox. The `first` one brings the store's compile cache or takes the machine's."""
        host, inputs = machine_of(session), job.inputs
        inbox = machine_inbox(self.store.root, host.id, name)
        files = job_files(job, inbox)
        cached = compile_cache_path(self.store, inputs.engine, machine_provenance(session))
        brought = cached.exists()
        cache_argv = self._compile_cache_argv(cached, files) if first else []
        generate = self.spec.golden_generation_rows if first else 0
        available = inputs.bundle.rows or inputs.bundle.generate_rows or 0  # generative prompts when no row is MC
        generation_argv = ["--generation-rows", str(min(generate, available)), "--generation-tokens",
                           str(self.spec.golden_generation_tokens), "--generation-out", GOLDEN_GENERATION] \
            if generate else []
        probe_argv = []
        if probe is not None:  # the settings audit, on this job's engine before its replay
            write_record(inbox / "probe.json", probe)
            files["probe.json"] = inbox / "probe.json"
            probe_argv = ["--probe", "probe.json", "--probe-out", PROBE_OUT]
        remote = RemoteJob(name, ["-m", "jex", "stage", "golden", "--args", "args.json", "--rows", str(rows),
                                  "--out", "golden.parquet", "--fingerprint", "fingerprint.json",
                                  *self._host_options_argv(host, inputs.engine, inbox, files), *cache_argv,
                                  *generation_argv, *probe_argv],
                           ["golden.parquet", "fingerprint.json", COMPILE_CACHE, GOLDEN_GENERATION,
                            f"{PROBE_OUT}/arm-*.json", f"{PROBE_OUT}/{PROBE_FILE}"], inbox, files=files)
        self._run(session, remote)
        if first and not brought and (inbox / COMPILE_CACHE).exists():  # the first machine of this engine compiled
            with self._lock:
                if not cached.exists():
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    (inbox / COMPILE_CACHE).replace(cached)
        return inbox

    def _compile_cache_argv(self, cached: Path, files: dict[str, Path]) -> list[str]:
        """The golden job's compile-cache options: bring the store's cache for this engine when there
        is one (adding it to `files`), else ask the machine for the one its first engine start makes."""
        if not self.spec.engine_hosts:
            return []
        if cached.exists():
            files["inputs/compile-cache.tar.gz"] = cached
            return ["--compile-cache-in", "inputs/compile-cache.tar.gz"]
        return ["--compile-cache-out", COMPILE_CACHE]

    def _establish_reference(self, job: EngineJob, plan: StagePlan) -> None:
        """Store the first rows of a fast pass the machines just computed as the bundle's golden reference,
        when no replay established one (`_golden`): later machines' replays meet it."""
        if not (self._reference_due and job.inputs.stage == "fast_pass" and job.inputs.engine_fp):
            return
        frames: list[pl.DataFrame] = []
        for shard in sorted(Path(plan.shards_dir).glob("shard-*.parquet")):
            if sum(f.height for f in frames) >= self._reference_due:
                break
            frames.append(pl.read_parquet(shard))
        reference = pl.concat(frames).head(self._reference_due)
        path = store_reference(self.store, job.inputs.bundle, job.inputs.engine_fp, reference)
        self.echo(f"golden reference of {reference.height} rows established from the fast pass: {path}")
        self._reference_due = 0


GOLDEN_GENERATION = "generation.parquet"
"""The golden job's greedy generation (`tasks/capture/golden.py: golden_generation`)."""


def compile_cache_path(store: LocalStore, engine: EngineSpec, machine: MachineProvenance | None) -> Path:
    """Where the store keeps the compile cache of an engine on a kind of machine: keyed by what
    compiled code depends on (the engine fingerprint less its renderer, the scheduler's token
    budget, and from the machine's `provenance.json` its GPU models, vLLM and Python), so every
    machine of that kind and every campaign of that engine starts from it. vLLM checks its own
    cache keys again on load."""
    gpus: list[JsonValue] = list(machine_gpus(machine))
    kind: dict[str, JsonValue] = {"gpus": gpus, "vllm": machine.packages.get("vllm") if machine else None,
                                  "python": machine.python if machine else None}
    key = compile_cache_key(engine, kind)
    return compile_cache_dir(store.root, key) / COMPILE_CACHE


def job_files(job: EngineJob, inbox: Path) -> dict[str, Path]:
    """The job's input files for its folder on the machine, and `args.json`: the job with the machine's
    relative paths."""
    files: dict[str, Path] = {"inputs/bundle.tar.gz": Path(job.inputs.bundle.bundle)}
    gated = None
    if isinstance(job.inputs, ReasonInputs):
        gated = "inputs/gated.parquet"
        files[gated] = Path(job.inputs.gate.gated)
    remote = job.with_paths(store="store", bundle="inputs/bundle.tar.gz", gated=gated)
    inbox.mkdir(parents=True, exist_ok=True)
    write_json(inbox / "args.json", remote.model_dump(mode="json"))
    files["args.json"] = inbox / "args.json"
    return files
