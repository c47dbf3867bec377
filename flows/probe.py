"""The early-exit checkpoint probe as a flow: its report becomes a Prefect artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from jex.engine_spec import EngineSpec
from jex.flows.fleet import MachinesSpec


@flow(name="early-exit-probe", log_prints=True)
def early_exit_probe(suite: str, rows: int = 200, every: int = 8, max_tokens: int = 128,
                     engine: EngineSpec = EngineSpec(), out: str = "runs/probe",  # noqa: B008
                     taus: list[float] | None = None, ks: list[int] | None = None,
                     machines: MachinesSpec | None = None) -> dict[str, Any]:
    """Probe `rows` gated rows of a suite folder or bundle; writes probe.json, probe.md, probe.png.
    `taus` x `ks`: the stable-margin grid (default: DEFAULT_TAUS x DEFAULT_KS). `machines`: where it
    runs (None: the settings' provider; `jex.flows.runners.run_lab`)."""
    from jex.flows.runners import run_lab
    from jex.tasks.lab.jobs import LabJob, ProbeJob

    job = LabJob(spec=ProbeJob(suite=suite, rows=rows, every=every, max_tokens=max_tokens, engine=engine, taus=taus,
                               ks=ks), out=out)
    summary = run_lab(job, machines)
    text = (Path(out) / "probe.md").read_text()
    create_markdown_artifact(markdown=text, key="early-exit-probe")
    print(text.splitlines()[4] if len(text.splitlines()) > 4 else text)
    return summary
