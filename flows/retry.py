"""Retry a campaign from a named stage: that stage and every later one run again, earlier ones come from cache."""

from __future__ import annotations

from typing import Literal

from prefect import flow

from jex.flows.campaign import STAGES, campaign, load_spec

StageName = Literal["bundle", "fast_pass", "gate", "reason", "fold", "calibrate", "overlay", "score"]


@flow(name="retry-stage", log_prints=True)
def retry_stage(run_dir: str, stage: StageName = "fold") -> str:
    """Continue the campaign of `run_dir` from `stage`; the capture upstream of it is reused, not recomputed."""
    redo = list(STAGES[STAGES.index(stage):])
    print(f"retrying {run_dir} from {stage}: {redo}")
    return campaign(load_spec(run_dir), redo=redo)
