"""Run history: every campaign flow run the Prefect API knows, with its index, coverage, cost and state."""

from __future__ import annotations

import json
from typing import Any


def campaign_runs(limit: int = 50) -> list[dict[str, Any]]:
    """Newest first. Index and cost come from the run folder when the run got that far."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from jex.flows.campaign import CampaignSpec

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["campaign"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=limit)
    rows = []
    for r in runs:
        row: dict[str, Any] = {"flow_run": r.name, "id": str(r.id), "state": r.state_name,
                               "start": r.start_time.isoformat(timespec="seconds") if r.start_time else None,
                               "campaign": None, "index": None, "coverage": None, "cost_usd": None}
        try:
            spec = CampaignSpec.model_validate(r.parameters.get("spec") or {})
        except ValueError:
            rows.append(row)
            continue
        run_dir = spec.run_dir()
        row.update(campaign=run_dir.name, coverage=spec.coverage, run_dir=str(run_dir))
        score, machines = run_dir / "score.json", run_dir / "machines.json"
        if score.exists():
            row["index"] = round(json.loads(score.read_text())["full"], 3)
        if machines.exists():
            row["cost_usd"] = json.loads(machines.read_text())["ledger"]["total_usd"]
        rows.append(row)
    return rows


def format_runs(rows: list[dict[str, Any]]) -> str:
    head = f"{'flow run':<24} {'state':<10} {'started':<20} {'campaign':<26} {'index':>7} {'cov':>5} {'cost $':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['flow_run']:<24} {r['state'] or '-':<10} {(r['start'] or '-')[:19]:<20} "
                     f"{r['campaign'] or '-':<26} {_n(r['index'], 2):>7} {_n(r['coverage'], 2):>5} "
                     f"{_n(r['cost_usd'], 4):>8}")
    return "\n".join(lines)


def _n(x: Any, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


__all__ = ["campaign_runs", "format_runs"]
