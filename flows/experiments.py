"""Engine experiments as flows: the batch-invariance bake-off and engine parity, with their reports as artifacts.

Each runs where its `machines` say (None: the settings' provider): in this process or on a machine
(`jex.flows.runners.run_lab`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from jex.flows.fleet import MachinesSpec


@flow(name="bakeoff", log_prints=True)
def bakeoff(arms: list[str] = ["hf-control", "hf-bi"], model: str | None = None,  # noqa: B006 - UI form default
            prompts: int = 32, tokens: int = 256, ladder: list[int] = [1, 8, 16, 32],  # noqa: B006
            repeats: int = 2, max_num_seqs: int = 32, device: str = "cpu", out: str = "runs/bakeoff",
            machines: MachinesSpec | None = None) -> dict[str, Any]:
    """Each arm in its own process; the verdict and the table become a Prefect artifact."""
    from jex.flows.runners import run_lab
    from jex.tasks.lab.jobs import BakeoffJob, LabJob

    job = LabJob(spec=BakeoffJob(arms=arms, model=model, prompts=prompts, tokens=tokens, ladder=ladder,
                                 repeats=repeats, max_num_seqs=max_num_seqs, device=device), out=out)
    summary = run_lab(job, machines)
    create_markdown_artifact(markdown=(Path(out) / "bakeoff.md").read_text(), key="bakeoff-report")
    print(summary["verdict"])
    return summary


@flow(name="parity", log_prints=True)
def parity(suite: str, engine_a: str = "hf", engine_b: str = "hf-batched", model: str | None = None, rows: int = 0,
           reason_rows: int = 0, max_tokens: int = 96, device: str = "cpu", batch_size: int = 8,
           out: str = "runs/parity", machines: MachinesSpec | None = None) -> dict[str, Any]:
    """Readout parity (and choice parity after a rationale) of two engines on the same rows: a stratified
    sample of `rows` (0: all); the mismatches after a rationale also go to parity-mismatches.parquet."""
    from jex.flows.runners import run_lab
    from jex.tasks.lab.jobs import LabJob, ParityJob

    job = LabJob(spec=ParityJob(suite=suite, engine_a=engine_a, engine_b=engine_b, model=model, rows=rows,
                                reason_rows=reason_rows, max_tokens=max_tokens, device=device,
                                batch_size=batch_size), out=out)
    summary = run_lab(job, machines)
    create_markdown_artifact(markdown=(Path(out) / "parity.md").read_text(), key="parity-report")
    return summary
