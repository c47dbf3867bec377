"""`machines.json`: the fleet's report of a campaign's machines, typed, and its section of the report.

`GpuFleet.report()` builds it (`flows/machines/fleet.py`); the campaign flow writes it into the run folder
(`publish_machines`) and hands the report its Markdown (`report_section`: the tasks room renders
the report but may not read this room's records); `jex runs` reads the cost from it (`read_machines`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from jex.engine_identity import EngineFingerprint
from jex.flows.machines.audit import SettingsAudit
from jex.infra.records import CostLedgerReport, MachineReport, Record
from jex.tasks.documents import GenerationVerdict, GoldenVerdict
from jex.tasks.execution import EngineStart
from jex.tasks.outputs.report import MachinesSection


class GoldenReplay(GoldenVerdict):
    """A machine's golden replay, as `machines.json` lists it."""

    machine: str
    reference: str = Field(description="The reference it was compared with, or the file it established")
    established: bool = Field(description="No reference existed: this replay became it (nothing compared)")
    generation: GenerationVerdict | None = Field(None, description="The golden generation, token for token")


class FingerprintMismatch(Record):
    """A machine measured another engine fingerprint than the fleet's first machine: its replay is not
    compared with anything (there is no verdict) and it runs no shard."""

    machine: str
    fingerprint: EngineFingerprint = Field(description="The engine fingerprint the machine measured")
    expected: EngineFingerprint = Field(description="The fleet's engine fingerprint (its first machine's)")


class FleetMachine(MachineReport):
    """One machine of the fleet: its life, jobs and cost, and the engine starts of its engine hosts."""

    engine_starts: int
    engine_start_records: list[EngineStart] = Field(description="`starts.jsonl` of the machine's engine hosts")


class MachinesDoc(Record):
    """`machines.json`: the machines of one campaign, their golden replays, and its cost so far."""

    provider: str
    workers: int = Field(description="Machines sharing each engine stage")
    slots: int = Field(description="Engine processes per machine")
    engine_hosts: bool
    golden: list[GoldenReplay | FingerprintMismatch] = Field(description="Every machine's golden replay, in order")
    audit: SettingsAudit | None = Field(None, description="The bake-off that covers the engine's settings on these "
                                                          "machines (flows/machines/audit.py); None: not audited")
    machines: list[FleetMachine]
    engine_starts: int = Field(description="Engine starts over every machine")
    ledger: CostLedgerReport = Field(description="The cost ledger of the campaign's machines")

    def shards(self) -> dict[str, int]:
        """Parquet artifacts the machines' jobs handed over, by stage (for the engine stages: their shards;
        a stage's jobs under other keys, `STAGE-KEY8`, count with it)."""
        out: dict[str, int] = {}
        for m in self.machines:
            for j in m.jobs:
                stage = j.job.partition("-")[0]
                out[stage] = out.get(stage, 0) + sum(a.path.endswith(".parquet") for a in j.artifacts)
        return out


def read_machines(path: str | Path) -> MachinesDoc:
    return MachinesDoc.model_validate_json(Path(path).read_bytes())


def _f(x: float | None, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def machines_section(doc: MachinesDoc) -> list[str]:
    """Each machine's life, cost and end, the golden replays, and the campaign's running total."""
    lines = ["", "## Machines", "", f"Provider `{doc.provider}`, {doc.workers} worker(s), "
             f"{doc.slots} engine process(es) each, {doc.engine_starts} engine start(s) in all.", "",
             "| machine | life (s) | cost ($) | ended because | teardown attempts | engine starts | jobs |",
             "|---|---:|---:|---|---:|---:|---|"]
    for m in doc.machines:
        t = m.teardown
        jobs = ", ".join(f"{j.job}: {j.status} ({len(j.artifacts)} artifacts)" for j in m.jobs)
        lines.append(f"| {(m.machine or {}).get('id')} | {_f(m.life_s, 1)} | {_f(m.cost_usd, 4)} | "
                     f"{t.reason if t else 'running'} | {t.attempts if t else '-'} | {m.engine_starts} | {jobs} |")
    if not doc.machines:
        lines.append("| (none: every engine stage was cached) | | | | | | |")
    for g in doc.golden:
        if isinstance(g, FingerprintMismatch):
            lines.append(f"\nGolden replay on {g.machine}: not compared, its engine fingerprint differs from the "
                         "fleet's (see machines.json).")
            continue
        how = "reference established" if g.established else f"against {g.reference}"
        lines.append(f"\nGolden replay on {g.machine}: {g.rows} rows, max |dp| {g.max_abs_dp:.3g} "
                     f"(tolerance {g.tolerance:.0e}), {how}.")
    if doc.audit is not None:
        a = doc.audit
        lines.append(f"\nSettings audit: {a.line()}. {a.verdict}."
                     + (" Its control arm's power is the stored audit's." if a.control_reused else "")
                     + (" Unproven: the control arm never diverged, so batch invariance is NOT shown for this run."
                        if a.status == "unproven" else ""))
    lines.append(f"\nCampaign machine cost so far: ${doc.ledger.total_usd:.4f} over "
                 f"{doc.ledger.machine_seconds:.0f} machine-seconds.")
    return lines


def report_section(doc: MachinesDoc | None) -> MachinesSection | None:
    """What the campaign's report shows of its machines (None: the engine stages ran in-process)."""
    if doc is None:
        return None
    audit = None if doc.audit is None else {
        "status": doc.audit.status, "key": doc.audit.key, "arm": doc.audit.arm, "powered": doc.audit.powered,
        "control_reused": doc.audit.control_reused, "scale": doc.audit.scale, "ladder": list(doc.audit.ladder),
        "gpus": list(doc.audit.gpus), "stack_sha256": doc.audit.stack_sha256,
        "shape": doc.audit.shape.model_dump(mode="json") if doc.audit.shape else None, "kernel": doc.audit.kernel,
        "reused": doc.audit.reused, "folder": doc.audit.folder}
    return MachinesSection(markdown=machines_section(doc), shards=doc.shards(), audit=audit)


__all__ = ["FingerprintMismatch", "FleetMachine", "GoldenReplay", "MachinesDoc", "machines_section", "read_machines",
           "report_section"]
