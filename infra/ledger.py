"""Cost ledger: every machine's life in seconds, its price, and each campaign's running total.

One JSON file, rewritten atomically under a file lock (supervisors in threads, a scheduled
reconcile and the CLI may share it). The budget guard refuses new machines at the limit; the
supervisor tears running ones down when the running total reaches it.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from jex.errors import InfraError
from jex.fileio import write_json


class BudgetExceeded(InfraError):
    """The campaign's cost (or wall-clock) budget is spent."""


@dataclass
class LedgerEntry:
    machine_id: str
    campaign: str | None
    provider: str
    price_per_hour: float
    created_at: float
    deleted_at: float | None = None
    end_reason: str | None = None
    host: str | None = None  # where a host provider (local, ssh) leased it

    def seconds(self, now: float | None = None) -> float:
        return max(0.0, (self.deleted_at or now or time.time()) - self.created_at)

    def cost(self, now: float | None = None) -> float:
        return self.seconds(now) / 3600.0 * self.price_per_hour


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            doc = json.loads(self.path.read_text()) if self.path.exists() else {"machines": {}}
            yield doc
            write_json(self.path, doc)

    def entries(self, campaign: str | None = None) -> list[LedgerEntry]:
        doc = json.loads(self.path.read_text()) if self.path.exists() else {"machines": {}}
        return [LedgerEntry(**e) for e in doc["machines"].values() if campaign is None or e["campaign"] == campaign]

    def get(self, machine_id: str) -> LedgerEntry | None:
        return next((e for e in self.entries() if e.machine_id == machine_id), None)

    def open(self, machine_id: str, campaign: str | None, provider: str, price_per_hour: float,
             created_at: float | None = None, host: str | None = None) -> None:
        with self._locked() as doc:
            doc["machines"].setdefault(machine_id, asdict(LedgerEntry(
                machine_id, campaign, provider, price_per_hour, created_at or time.time(), host=host)))

    def close(self, machine_id: str, reason: str, at: float | None = None) -> None:
        with self._locked() as doc:
            e = doc["machines"].get(machine_id)
            if e is not None and e["deleted_at"] is None:
                e["deleted_at"], e["end_reason"] = at or time.time(), reason

    def total(self, campaign: str | None, now: float | None = None) -> float:
        return sum(e.cost(now) for e in self.entries(campaign))

    def guard(self, campaign: str | None, budget_usd: float) -> None:
        """Refuse a new machine when the campaign already spent its budget."""
        spent = self.total(campaign)
        if spent >= budget_usd:
            raise BudgetExceeded(f"campaign {campaign}: ${spent:.4f} spent of a ${budget_usd:.4f} budget; "
                                 "no new machine")

    def report(self, campaign: str | None, now: float | None = None) -> dict[str, Any]:
        rows = [{**asdict(e), "seconds": round(e.seconds(now), 3), "cost_usd": round(e.cost(now), 6)}
                for e in self.entries(campaign)]
        return {"campaign": campaign, "machines": rows, "total_usd": round(sum(r["cost_usd"] for r in rows), 6),
                "machine_seconds": round(sum(r["seconds"] for r in rows), 3)}
