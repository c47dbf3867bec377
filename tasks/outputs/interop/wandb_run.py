"""`jex export wandb`: a jex run as a Weights & Biases run: its metrics as the summary, its parameters and tags as
the config, the samples as a table, the plots as images, and the report, score and samples as an artifact.

The W&B run's id is the jex run's (its folder's name), so exporting again, or syncing an offline export, updates
the same run. Offline (`WANDB_MODE=offline`) it is written under `WANDB_DIR` and sent later by `wandb sync DIR`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from jex.errors import InputError
from jex.extras import needs_extra
from jex.tasks.outputs.interop.tracked_run import PLOTS, RUN_TAG, TrackedRun, tracked_run

SAMPLES_TABLE_ROWS = 10_000  # W&B shows at most this many rows of a logged table (`wandb.Table.MAX_ROWS`)


class WandbTarget(BaseModel):
    """Where a finished run is logged in W&B. The API key comes from W&B's own `WANDB_API_KEY` (or `wandb login`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    project: str = Field("jex", min_length=1, description="W&B project the run is logged in")
    entity: str | None = Field(None, description="W&B entity (team or user); empty = the API key's default")


class WandbRun(BaseModel):
    """One exported run: its W&B id, and where it is (its page, or offline the folder `wandb sync` sends)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str
    offline: bool
    where: str


def export_wandb(run_dirs: Sequence[str | Path], target: WandbTarget) -> list[WandbRun]:
    """Log each run folder as one W&B run in `target`'s project. Every folder is read before anything is logged."""
    runs = [tracked_run(r) for r in run_dirs]
    wandb = needs_extra("wandb", "wandb")
    return [_log_run(wandb, run, target) for run in runs]


def wandb_id(run: str) -> str:
    """The W&B run id of a jex run: its folder's name, as W&B's ids are spelt (letters, digits, `_` and `-`)."""
    return re.sub(r"[^\w-]", "-", run)[:64]


def _log_run(wandb: Any, run: TrackedRun, target: WandbTarget) -> WandbRun:
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False)
    offline = wandb.setup().settings.mode in ("offline", "dryrun")  # an offline run resumes nothing (until synced)
    try:
        with wandb.init(project=target.project, entity=target.entity, id=wandb_id(run.run), name=run.run,
                        config={**run.params, **run.tags}, resume=None if offline else "allow",
                        reinit="create_new", settings=settings,
                        tags=[f"{k.removeprefix('jex.')}:{v}"[:64] for k, v in run.tags.items() if k != RUN_TAG]
                        ) as logged:
            logged.summary.update(run.metrics)
            plots = {f"plots/{Path(name).stem}": wandb.Image(str(run.file(name))) for name in PLOTS
                     if name in run.artifacts}
            logged.log({"samples": _samples_table(wandb, run.file("samples.parquet")), **plots})
            artifact = wandb.Artifact(f"{wandb_id(run.run)}-run", type="jex-run",
                                      description=f"report, score and samples of jex run {run.run}")
            for name in run.artifacts:
                artifact.add_file(str(run.file(name)))
            logged.log_artifact(artifact)
            return WandbRun(id=logged.id, offline=logged.offline,
                            where=logged.settings.sync_dir if logged.offline else logged.url)
    except wandb.Error as e:
        raise InputError(f"W&B refused the run: {str(e).splitlines()[0]} (offline: WANDB_MODE=offline, then "
                         "`wandb sync`)", file=run.run_dir) from None


def _samples_table(wandb: Any, path: Path) -> Any:
    """The scalar columns of samples.parquet (lists stay in the file, which the artifact holds), at most
    `SAMPLES_TABLE_ROWS` rows."""
    frame = pl.read_parquet(path, n_rows=SAMPLES_TABLE_ROWS)
    frame = frame.select([c for c, t in frame.schema.items() if not isinstance(t, pl.List | pl.Array | pl.Struct)])
    return wandb.Table(columns=frame.columns, data=[list(r) for r in frame.iter_rows()])
