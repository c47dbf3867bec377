"""The cost ledger: every machine's life in seconds, its price, and each campaign's running total.

A served model's campaign (`engine.kind = "openai"`) records its token usage and cost here too, one entry per
answer journal (an engine stage's folder in the store), charged to the campaign that first records it and grown
to its cumulative usage by a resume, so no answer is counted twice; the running total counts it (an experiment's
budget sees it; a served campaign itself rents no machine for the guard to refuse).

Not the store's decision ledger (`jex.tasks.decisions`, `<store>/ledger.toml`, `jex ledger`): this one is
the orchestrator's `<state_dir>/ledger.json` (`jex infra ledger`).

One JSON file, rewritten atomically under a file lock (supervisors in threads, a scheduled
reconcile and the CLI may share it). The budget guard refuses new machines at the limit, and every
machine of a campaign whose budget projection (`jex calibrate`) costs more than its budget at the
machine's price; the supervisor tears running ones down when the running total reaches it.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from jex.errors import InfraError
from jex.fileio import write_json
from jex.infra.records import (
    CostLedgerDoc,
    CostLedgerEntry,
    CostLedgerReport,
    CostLedgerRow,
    ProjectedSpend,
    ServedLedgerEntry,
)
from jex.record import read_record, write_record

_Entry = TypeVar("_Entry", CostLedgerEntry, ServedLedgerEntry)

__all__ = ["BudgetExceeded", "CostLedger", "CostLedgerEntry", "ProjectedSpend", "ServedLedgerEntry",
           "over_projected_budget"]


class BudgetExceeded(InfraError):
    """The campaign's cost (or wall-clock) budget is spent."""


PROJECTIONS = "projections"
"""Beside the ledger: one `ProjectedSpend` per campaign the budget projection measured."""


def over_projected_budget(projected: ProjectedSpend | None, *, price_per_hour: float, budget_usd: float) -> None:
    """Refuse (BudgetExceeded, one line) a campaign whose projected machine-hours at this machine price
    cost more than its budget: before any of its machines starts, not once the money is spent."""
    if projected is None:
        return
    cost = projected.machine_hours * price_per_hour
    if cost > budget_usd:
        raise BudgetExceeded(
            f"campaign {projected.campaign}: the budget projection ({projected.source}) needs "
            f"{projected.machine_hours:.1f} machine-hours at coverage {projected.coverage:g}, ${cost:.2f} at "
            f"${price_per_hour:g}/hour, over its ${budget_usd:g} budget; no machine started: raise budget_usd, "
            "lower --coverage or pick a cheaper machine")


def _of(campaign: str | None, entries: Iterable[_Entry]) -> list[_Entry]:
    """The entries of `campaign` (None: all)."""
    return [e for e in entries if campaign is None or e.campaign == campaign]


class CostLedger:
    """`ledger.json` (`CostLedgerDoc`): `{"machines": {machine_id: CostLedgerEntry}, "served": {served_id:
    ServedLedgerEntry}}`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _read(self) -> CostLedgerDoc:
        """The entries; a ledger that cannot be read is one InfraError naming the file (never guessed empty)."""
        if not self.path.exists():
            return CostLedgerDoc(machines={})
        try:
            return CostLedgerDoc.model_validate(json.loads(self.path.read_bytes().decode("utf-8")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # ValidationError is a ValueError
            raise InfraError(f"file {self.path}: the cost ledger is unreadable ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); repair or move it aside") from None

    @contextmanager
    def _locked(self) -> Iterator[tuple[dict[str, CostLedgerEntry], dict[str, ServedLedgerEntry]]]:
        """The machines and served entries under an exclusive lock; what the block leaves in them is written back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = self._read()
            machines, served = dict(doc.machines), dict(doc.served or {})
            yield machines, served
            write_json(self.path, CostLedgerDoc(machines=machines, served=served or None).model_dump())

    def entries(self, campaign: str | None = None) -> list[CostLedgerEntry]:
        """The machines of `campaign` (None: all)."""
        return _of(campaign, self._read().machines.values())

    def served(self, campaign: str | None = None) -> list[ServedLedgerEntry]:
        """The served models' usage in `campaign` (None: all)."""
        return _of(campaign, (self._read().served or {}).values())

    def record_served(self, entry: ServedLedgerEntry) -> None:
        """Record an answer journal's cumulative usage: a new journal is charged to `entry.campaign`; a known one
        grows to a usage of more requests (a resumed campaign's) and keeps its campaign; the same or a smaller
        usage leaves the ledger as it was (another campaign reading the stored stage sent nothing)."""
        with self._locked() as (_, served):
            old = served.get(entry.served_id)
            if old is None:
                served[entry.served_id] = entry
            elif entry.requests > old.requests:
                served[entry.served_id] = entry.model_copy(update={"campaign": old.campaign})

    def get(self, machine_id: str) -> CostLedgerEntry | None:
        return next((e for e in self.entries() if e.machine_id == machine_id), None)

    def open(self, machine_id: str, campaign: str | None, provider: str, price_per_hour: float,
             created_at: float | None = None, host: str | None = None) -> None:
        """Record a machine's start (once: a second call for the same machine changes nothing)."""
        with self._locked() as (machines, _):
            machines.setdefault(machine_id, CostLedgerEntry(
                machine_id=machine_id, campaign=campaign, provider=provider, price_per_hour=price_per_hour,
                created_at=created_at or time.time(), host=host))

    def close(self, machine_id: str, reason: str, at: float | None = None) -> None:
        """Record a machine's end (the first one counts)."""
        with self._locked() as (machines, _):
            e = machines.get(machine_id)
            if e is not None and e.deleted_at is None:
                machines[machine_id] = e.model_copy(update={"deleted_at": at or time.time(), "end_reason": reason})

    def total(self, campaign: str | None, now: float | None = None) -> float:
        """What `campaign` (None: all) cost so far: its machines and its served models' tokens."""
        doc = self._read()
        return (sum(e.cost(now) for e in _of(campaign, doc.machines.values()))
                + sum(e.cost() for e in _of(campaign, (doc.served or {}).values())))

    def guard(self, campaign: str | None, budget_usd: float, price_per_hour: float = 0.0) -> None:
        """Refuse a new machine when the campaign already spent its budget, or when the budget projection
        says it will need more than it (`over_projected_budget`)."""
        spent = self.total(campaign)
        if spent >= budget_usd:
            raise BudgetExceeded(f"campaign {campaign}: ${spent:.4f} spent of a ${budget_usd:.4f} budget; "
                                 "no new machine")
        if campaign is not None:
            over_projected_budget(self.projection(campaign), price_per_hour=price_per_hour, budget_usd=budget_usd)

    def projection_path(self, campaign: str) -> Path:
        return self.path.parent / PROJECTIONS / f"{campaign}.json"

    def record_projection(self, projected: ProjectedSpend) -> Path:
        """Keep what the budget projection measured for a campaign (the last one counts)."""
        path = self.projection_path(projected.campaign)
        write_record(path, projected)
        return path

    def projection(self, campaign: str) -> ProjectedSpend | None:
        """The campaign's budget projection, if one was made (`record_projection`)."""
        path = self.projection_path(campaign)
        return read_record(ProjectedSpend, path) if path.exists() else None

    def usage(self, campaign: str | None, now: float | None = None) -> CostLedgerReport:
        """Every machine of `campaign` (None: all) with its seconds and cost so far, its served models' usage,
        and the totals."""
        doc = self._read()
        rows = [CostLedgerRow(**e.model_dump(), seconds=round(e.life_s(now), 3), cost_usd=round(e.cost(now), 6))
                for e in _of(campaign, doc.machines.values())]
        served = _of(campaign, (doc.served or {}).values())
        total = sum(r.cost_usd for r in rows) + sum(e.cost() for e in served)
        return CostLedgerReport(campaign=campaign, machines=rows, total_usd=round(total, 6),
                                machine_seconds=round(sum(r.seconds for r in rows), 3), served=served)
