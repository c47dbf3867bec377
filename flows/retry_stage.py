"""Retry a campaign from a named stage: that stage and every later one run again, earlier ones come from cache."""

from __future__ import annotations

from prefect import flow

from jex.flows.campaign import STAGES, campaign, resume_spec
from jex.run_records import StageName


@flow(name="retry-stage", log_prints=True)
def retry_stage(run_dir: str, stage: StageName = "fold", store: str | None = None) -> str:
    """Continue the campaign of `run_dir` from `stage`; the capture upstream of it is reused, not recomputed.

    Works from any working folder: the run folder is read where it is and its store found by the stages
    it recorded (`store`: the store to use when it moved elsewhere)."""
    redo = list(STAGES[STAGES.index(stage):])
    print(f"retrying {run_dir} from {stage}: {redo}")
    return campaign(resume_spec(run_dir, store=store), redo=redo)
