"""Lab jobs: the early-exit probe, engine parity and the bake-off as typed job messages.

One function (`run_lab_job`) runs a job wherever it is: in the orchestrator's process (`--provider
inprocess`) or on a machine, where the fleet starts `python -m jex.lab.jobs args.json` in the
job's folder (its suite under `inputs/suite`, its outputs under `out/`, collected back into the job's
`out`). The flows read their summaries from the output files (`lab_summary`), so both places give
the same answer; `flows/machines/runners.py` decides which place.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from jex.engine_spec import BAKEOFF_MAX_NUM_SEQS, EngineSpec, knob_field
from jex.fileio import write_text
from jex.record import Record, write_record
from jex.settings import BOOTSTRAP_SEED


class ProbeJob(Record):
    """`jex probe early-exit` (lab/early_exit.py) on `rows` gated rows of a suite folder or bundle. The one
    declaration of the probe's parameters: the flow's form, the command's flags and a machine's job read it.
    The stable-margin grid is `taus` x `ks`; unset: the probe's default (`DEFAULT_TAUS` x `DEFAULT_KS`)."""

    kind: Literal["probe"] = "probe"
    suite: str = Field(description="Suite folder or bundle file")
    rows: int = Field(200, ge=1, description="Gated rows to probe")
    every: int = Field(8, ge=1, description="A checkpoint every M generated tokens")
    max_tokens: int = Field(128, ge=1, description="Rationale length limit")
    engine: EngineSpec = Field(EngineSpec(), description="The engine that writes and re-reads the rationales")
    taus: list[float] | None = Field(None, description="Stable-margin exit: margin thresholds (log-odds)")
    ks: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="Stable-margin exit: consecutive "
                                                                           "checkpoints above tau, same answer")
    end_of_thought: str | None = Field(None, description="The one token the free gate watches (e.g. </think>); "
                                                         "empty: the model's end of sequence")
    seed: int = Field(BOOTSTRAP_SEED, description="Seed of the stratified draw of the rows the gate picks from")


class ParityJob(Record):
    """`jex parity` of two engine kinds (lab/parity.py) on a stratified sample of a suite folder. The one
    declaration of parity's parameters: the flow's form, the command's flags and a machine's job read it."""

    kind: Literal["parity"] = "parity"
    suite: str = Field(description="Suite folder")
    engine_a: str = Field("hf", description="hf | hf-batched | vllm | vllm-control")
    engine_b: str = Field("hf-batched", description="hf | hf-batched | vllm | vllm-control")
    model: str | None = Field(None, description="Model folder (default: embedded)")
    rows: int = Field(0, ge=0, description="Rows to read, a stratified sample (0 = all)")
    reason_rows: int = Field(0, ge=0, description="Rows for generation parity")
    max_tokens: int = Field(96, ge=1, description="Rationale length limit (generation parity)")
    device: str = Field("cpu", description="cpu, cuda, ...")
    batch_size: int = Field(8, ge=1, description="Requests per engine call")


REFERENCE_RULE = "evenly spaced ranks of prompt length, the longest first"
"""How batch 1's prompts are picked (`lab/bakeoff.py` `reference_sample`; in the audit's key: a new rule is a
new bake-off)."""


class BakeoffJob(Record):
    """`jex bakeoff` (lab/bakeoff.py): each arm in its own process. The one declaration of the bake-off's
    parameters: the flow's form, the command's flags and each arm's process read it."""

    kind: Literal["bakeoff"] = "bakeoff"
    arms: list[str] = Field(["hf-control", "hf-bi"], min_length=1, description="Arms, each in its own process "
                                                                               "(`ARMS` of lab/bakeoff.py)")
    model: str | None = Field(None, description="Model folder (default: embedded)")
    prompts: int = Field(32, ge=1, description="Divergence-prone prompts")
    tokens: int = Field(256, ge=1, description="Tokens generated per prompt")
    ladder: list[Annotated[int, Field(ge=1)]] = Field([1, 8, 16, 32], min_length=1, description="Batch sizes, "
                                                      "1 (the reference) among them")
    repeats: int = Field(2, ge=1, description="Runs per batch size of an invariant arm (run-to-run identity); a "
                                              "control arm runs each once: only its divergence is read")
    reference_prompts: int | None = Field(None, ge=1, description="Prompts batch 1 (the reference, one request at "
                                                                  "a time) generates: a sample spread over the "
                                                                  "prompts' lengths, the longest among them "
                                                                  "(default: all); other rungs read every prompt")
    max_num_seqs: int = knob_field("max_num_seqs", BAKEOFF_MAX_NUM_SEQS)  # the one knob, the bake-off's default
    device: str = Field("cpu", description="cpu, cuda, ...")

    @field_validator("ladder")
    @classmethod
    def _reference_rung(cls, ladder: list[int]) -> list[int]:
        if 1 not in ladder:
            raise ValueError("batch 1, the reference, must be among the batch sizes")
        return ladder


LabSpec = Annotated[ProbeJob | ParityJob | BakeoffJob, Field(discriminator="kind")]

OUTPUTS: dict[str, tuple[str, ...]] = {
    "probe": ("probe.json", "probe.md", "probe.png"),
    "parity": ("parity.json", "parity.md", "parity-mismatches.parquet"),
    "bakeoff": ("bakeoff.json", "bakeoff.md", "bakeoff.png", "arm-*.json"),
}
"""What each kind writes into its `out` folder (the patterns a machine's job collects)."""
MACHINE_SUITE, MACHINE_OUT = "inputs/suite", "out"
"""Where a lab job's suite and outputs are in its folder on a machine."""


class LabJob(Record):
    """A lab job to run somewhere: what to measure, and the folder its outputs go to."""

    spec: LabSpec
    out: str

    @property
    def kind(self) -> str:
        return self.spec.kind

    def suite(self) -> Path | None:
        """The suite folder or bundle file the job reads (None: the bake-off reads none)."""
        return None if isinstance(self.spec, BakeoffJob) else Path(self.spec.suite)

    def engine_kinds(self) -> list[str]:
        """The engine kinds the job loads (what a machine must have installed)."""
        spec = self.spec
        if isinstance(spec, ProbeJob):
            return [spec.engine.kind]
        if isinstance(spec, ParityJob):
            return [spec.engine_a, spec.engine_b]
        from jex.lab.bakeoff import ARMS

        return [ARMS[arm][0] for arm in spec.arms if arm in ARMS]

    def on_machine(self) -> LabJob:
        """The same job as its folder on a machine sees it: the suite under `inputs/suite` (a bundle
        keeps its file name), the outputs under `out/`."""
        suite = self.suite()
        spec = self.spec
        if suite is not None:
            where = MACHINE_SUITE if suite.is_dir() else f"{MACHINE_SUITE}/{suite.name}"
            spec = spec.model_copy(update={"suite": where})
        return LabJob(spec=spec, out=MACHINE_OUT)

    def machine_files(self) -> dict[str, Path]:
        """The job's input files for its folder on a machine (name in the folder -> local path)."""
        suite = self.suite()
        if suite is None:
            return {}
        if not suite.is_dir():
            return {f"{MACHINE_SUITE}/{suite.name}": suite}
        return {f"{MACHINE_SUITE}/{p.relative_to(suite).as_posix()}": p for p in sorted(suite.rglob("*"))
                if p.is_file()}


def run_lab_job(job: LabJob) -> None:
    """Run the job in this process; its outputs (`OUTPUTS`) land in `job.out`."""
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = job.spec
    if isinstance(spec, ProbeJob):
        _probe(spec, out)
    elif isinstance(spec, ParityJob):
        _parity(spec, out)
    else:
        from jex.lab.bakeoff import run_bakeoff

        run_bakeoff(spec, out)


def _probe(spec: ProbeJob, out: Path) -> None:
    from jex.lab.early_exit import DEFAULT_KS, DEFAULT_TAUS, markdown, pick_gated, plot, probe_rows, suite_rows
    from jex.tasks.execution.engine_pool import get_engine

    eng = get_engine(spec.engine)
    picked = pick_gated(eng, suite_rows(spec.suite, out), spec.rows, render=spec.engine.render, seed=spec.seed)
    result = probe_rows(eng, picked, every=spec.every, max_tokens=spec.max_tokens, render=spec.engine.render,
                        taus=spec.taus or DEFAULT_TAUS, ks=spec.ks or DEFAULT_KS, end_of_thought=spec.end_of_thought)
    write_record(out / "probe.json", result)
    write_text(out / "probe.md", markdown(result))
    plot(result, out / "probe.png")


def _parity(spec: ParityJob, out: Path) -> None:
    from jex.lab.parity import markdown, parity_of_kinds, stratified_rows, write_mismatches, write_parity
    from jex.suite import iter_rows

    picked = stratified_rows(list(iter_rows(spec.suite)), spec.rows)
    res = parity_of_kinds(spec.engine_a, spec.engine_b, picked, model=spec.model, device=spec.device,
                          batch_size=spec.batch_size, reason_rows=spec.reason_rows, max_tokens=spec.max_tokens)
    write_parity(out, res)
    write_text(out / "parity.md", markdown(res, (spec.engine_a, spec.engine_b)))
    write_mismatches(res, out)


class ReadoutMetrics(Record):
    """Readout parity's numbers (`lab/parity.py: compare_readouts`); with no common row only the counts."""

    common: int = Field(description="Rows both sides read")
    refused: int
    argmax_agreement: float | None = None
    agree: int | None = None
    flips: int | None = None
    mean_abs_dp: float | None = None
    p95_abs_dp: float | None = None
    max_abs_dp: float | None = None
    flip_pre_margin_median: float | None = None
    flip_pre_margin_max: float | None = None


class ProbeSummary(Record):
    """What the early-exit probe's flow returns (from `probe.json`)."""

    kind: Literal["probe"] = "probe"
    full_accuracy: float
    gate_fire_rate: float
    first_matching_checkpoint: int | None
    out: str


class ParitySummary(ReadoutMetrics):
    """What the parity flow returns: `parity.json`'s readout parity less its flip rows."""

    kind: Literal["parity"] = "parity"
    out: str


class BakeoffSummary(Record):
    """What the bake-off's flow returns (from `bakeoff.json`)."""

    kind: Literal["bakeoff"] = "bakeoff"
    verdict: str
    tax: dict[str, float]
    errors: dict[str, str]
    out: str


LabSummary = Annotated[ProbeSummary | ParitySummary | BakeoffSummary, Field(discriminator="kind")]
"""What a lab job's flow returns: the headline of its `<kind>.json` (and where its outputs are), one record
per kind."""


def lab_summary(job: LabJob) -> ProbeSummary | ParitySummary | BakeoffSummary:
    """What the job's flow returns, read from its outputs in `job.out` (wherever it ran) through their records."""
    out = Path(job.out)
    if job.kind == "probe":
        from jex.lab.early_exit import read_probe

        probe = read_probe(out / "probe.json")
        return ProbeSummary(full_accuracy=probe.full_accuracy, gate_fire_rate=probe.gate_fire_rate,
                            first_matching_checkpoint=probe.first_matching_checkpoint, out=str(out))
    if job.kind == "parity":
        from jex.lab.parity import read_parity

        readout = read_parity(out / "parity.json").readout
        return ParitySummary(**readout.model_dump(include=set(ReadoutMetrics.model_fields)), out=str(out))
    from jex.lab.bakeoff import read_bakeoff

    bake = read_bakeoff(out / "bakeoff.json")
    return BakeoffSummary(verdict=bake.verdict, tax=bake.tax, errors=bake.errors, out=str(out))


def _main(args_file: str) -> None:
    """A machine's lab job: `args.json` (a `LabJob` with paths relative to the job folder, the cwd)."""
    run_lab_job(LabJob.model_validate_json(Path(args_file).read_text()))


if __name__ == "__main__":
    _main(sys.argv[1])
