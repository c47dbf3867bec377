"""Run history: every campaign flow run the Prefect API knows, with its index, coverage, cost and state."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from jex.errors import JexError


class RunRow(BaseModel):
    """One campaign flow run, as `jex runs` lists it."""

    model_config = ConfigDict(extra="forbid")
    flow_run: str
    id: str
    state: str | None
    start: str | None = Field(description="ISO time, seconds")
    campaign: str | None = None
    index: float | None = Field(None, description="The full index (score.json), rounded to 3 places")
    coverage: float | None = None
    cost_usd: float | None = Field(None, description="The campaign's machine cost (machines.json)")
    prices_per_hour: list[float] | None = Field(None, description="The prices its machines were billed at, USD/hour, "
                                                                 "each once (machines.json)")
    model: str | None = Field(None, description="The model as the campaign named it (the embedded one: 'embedded')")
    revision: str | None = Field(None, description="The Hub commit the model resolved to (provenance.json)")
    weights_sha256: str | None = Field(None, description="The weights the run read (provenance.json)")
    bundle: str | None = Field(None, description="The bundle key (stages.json): runs of one bundle compare row by row")
    note: str | None = Field(None, description="What the run cannot prove (a served model: 'served: batch "
                                               "invariance not proven')")
    run_dir: str | None = Field(None, description="Absent when the run's spec does not validate")

    def to_json(self) -> dict[str, object]:
        return self.model_dump(mode="json", exclude={"run_dir"} if self.run_dir is None else set())


def campaign_runs(limit: int = 50, *, model: str | None = None) -> list[RunRow]:
    """Newest first; with `model`, only the runs of that model (its name as the campaign gave it, or a
    prefix of its weights' sha256). Index, cost, weights and bundle come from the run folder when the
    run got that far."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    from jex.flows.machines.machines_doc import read_machines
    from jex.tasks.campaign_spec import CampaignSpec
    from jex.tasks.capture.served import NOT_PROVEN, read_served
    from jex.tasks.documents import ScoreDoc, read_doc

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["campaign"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=limit)
    rows = []
    for r in runs:
        row = RunRow(flow_run=r.name, id=str(r.id), state=r.state_name,
                     start=r.start_time.isoformat(timespec="seconds") if r.start_time else None)
        try:
            spec = CampaignSpec.model_validate(r.parameters.get("spec") or {})
        except ValueError:
            rows.append(row)
            continue
        try:
            run_dir = spec.located().run_dir()
        except (JexError, OSError):  # its suite or model is not on this machine: the row without its results
            rows.append(row)
            continue
        score, machines = run_dir / "score.json", run_dir / "machines.json"
        ledger = read_machines(machines).ledger if machines.exists() else None
        served = read_served(run_dir)
        rows.append(row.model_copy(update={
            "campaign": run_dir.name, "coverage": spec.coverage, "run_dir": str(run_dir),
            "index": round(read_doc(ScoreDoc, score).full, 3) if score.exists() else None,
            "cost_usd": ledger.total_usd if ledger else served.cost_usd if served else None,
            "note": NOT_PROVEN if spec.engine.is_served() else None,
            "prices_per_hour": sorted({m.price_per_hour for m in ledger.machines}) if ledger else None,
            "model": spec.engine.model_name(), **_identity(run_dir)}))
    if model is not None:
        rows = [r for r in rows if r.model == model or (r.weights_sha256 or "").startswith(model)]
    return rows


def _identity(run_dir: Path) -> dict[str, str | None]:
    """The weights, Hub revision and bundle a run folder records (nothing for a run that did not get there)."""
    from jex.provenance import read_provenance
    from jex.run_records import RunStages

    out: dict[str, str | None] = {}
    provenance = run_dir / "provenance.json"
    if provenance.exists():
        engine = read_provenance(provenance).engine
        out["weights_sha256"] = engine.weights_sha256 if engine else None
        out["revision"] = (engine.hub.commit if engine and engine.hub else None) or None
    try:
        out["bundle"] = RunStages.read(run_dir).root["bundle"].key
    except (OSError, KeyError, ValueError):
        pass
    return out


def format_runs(rows: list[RunRow]) -> str:
    head = (f"{'flow run':<24} {'state':<10} {'started':<20} {'campaign':<26} {'index':>7} {'cov':>5} {'cost $':>8} "
            f"{'$/hour':>8} {'model':<24} {'weights':<8} {'bundle':<8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        prices = "/".join(f"{p:g}" for p in r.prices_per_hour or []) or "-"
        lines.append(f"{r.flow_run:<24} {r.state or '-':<10} {(r.start or '-')[:19]:<20} "
                     f"{r.campaign or '-':<26} {_n(r.index, 2):>7} {_n(r.coverage, 2):>5} "
                     f"{_n(r.cost_usd, 4):>8} {prices:>8} {(r.model or '-')[-24:]:<24} "
                     f"{(r.weights_sha256 or '-')[:8]:<8} {(r.bundle or '-')[:8]:<8}"
                     + (f"  {r.note}" if r.note else ""))
    return "\n".join(lines)


def _n(x: float | None, nd: int) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


__all__ = ["RunRow", "campaign_runs", "format_runs"]
