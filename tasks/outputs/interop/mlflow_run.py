"""`jex export mlflow`: one MLflow run per jex run, with its parameters, metrics, tags and files
(`tracked_run.TrackedRun`), optionally nested under a parent run (a model comparison).

Idempotent: the MLflow run is found again by its `jex.run` tag. Exporting an unchanged run again updates its tags
and files and leaves its parameters and metrics as they are (one value per metric); a run whose parameters or
metrics changed since (scored again) replaces the MLflow run it had, which is deleted (MLflow keeps a metric's
every value and refuses a changed parameter, so the run cannot be updated in place).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jex.errors import InputError
from jex.extras import needs_extra
from jex.tasks.campaign_spec import MlflowTarget
from jex.tasks.outputs.interop.tracked_run import RUN_TAG, TrackedRun, tracked_run

PARENT_TAG = "jex.parent"
"""The tag naming a parent run (`export_mlflow(parent=...)`), found again by it."""
METRICS_PER_CALL, PARAMS_PER_CALL = 1000, 100  # MLflow's log_batch limits


def export_mlflow(run_dirs: Sequence[str | Path], target: MlflowTarget, *, parent: str | None = None) -> list[str]:
    """Log each run folder as one MLflow run in `target`'s experiment (made when missing), under a parent run named
    `parent` if given; returns the MLflow run ids. Every folder is read before anything is logged."""
    runs = [tracked_run(r) for r in run_dirs]
    needs_extra("mlflow", "mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=target.tracking_uri)
        experiment = client.get_experiment_by_name(target.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(target.experiment)
        parent_id = _parent_run(client, experiment_id, parent) if parent else None
        return [_log_run(client, experiment_id, run, parent_id) for run in runs]
    except MlflowException as e:
        where = target.tracking_uri or "MLflow's default tracking URI"  # one from the environment may hold a password
        raise InputError(f"MLflow at {where} refused the run: {str(e.message).splitlines()[0]}",
                         field="tracking_uri") from None


def _log_run(client: Any, experiment_id: str, run: TrackedRun, parent_id: str | None) -> str:
    """The MLflow run of `run`: the one its tag finds if it holds the same parameters and metrics, else a new one
    (a stale one deleted); its tags set and its files logged again."""
    current = None
    for found in _runs_tagged(client, experiment_id, RUN_TAG, run.run):
        if current is None and _holds(found, run):
            current = found.info.run_id
        else:
            client.delete_run(found.info.run_id)
    if current is None:
        current = client.create_run(experiment_id, run_name=run.run, tags=run.tags).info.run_id
        _log_values(client, current, run)
    _set_tags(client, current, {**run.tags, **({"mlflow.parentRunId": parent_id} if parent_id else {})})
    for name in run.artifacts:
        client.log_artifact(current, str(run.file(name)))
    client.set_terminated(current)
    return str(current)


def _log_values(client: Any, run_id: str, run: TrackedRun) -> None:
    from mlflow.entities import Metric, Param

    stamp = int(time.time() * 1000)
    metrics = [Metric(k, v, stamp, 0) for k, v in run.metrics.items()]
    params = [Param(k, v) for k, v in run.params.items()]
    for i in range(0, len(metrics), METRICS_PER_CALL):
        client.log_batch(run_id, metrics=metrics[i:i + METRICS_PER_CALL])
    for i in range(0, len(params), PARAMS_PER_CALL):
        client.log_batch(run_id, params=params[i:i + PARAMS_PER_CALL])


def _set_tags(client: Any, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, v) for k, v in tags.items()]
    for i in range(0, len(items), PARAMS_PER_CALL):
        client.log_batch(run_id, tags=items[i:i + PARAMS_PER_CALL])


def _holds(found: Any, run: TrackedRun) -> bool:
    """Whether an MLflow run holds exactly the run's parameters and metrics (NaN equal to NaN)."""
    metrics: dict[str, float] = found.data.metrics
    return found.data.params == run.params and metrics.keys() == run.metrics.keys() and all(
        v == metrics[k] or (math.isnan(v) and math.isnan(metrics[k])) for k, v in run.metrics.items())


def _runs_tagged(client: Any, experiment_id: str, tag: str, value: str) -> list[Any]:
    from mlflow.entities import ViewType

    quoted = value.replace("'", "\\'")
    return list(client.search_runs([experiment_id], filter_string=f"tags.`{tag}` = '{quoted}'",
                                   run_view_type=ViewType.ACTIVE_ONLY, order_by=["attributes.start_time ASC"]))


def _parent_run(client: Any, experiment_id: str, name: str) -> str:
    """The parent run named `name`: found by its tag, else made."""
    found = _runs_tagged(client, experiment_id, PARENT_TAG, name)
    if found:
        return str(found[0].info.run_id)
    run_id = client.create_run(experiment_id, run_name=name, tags={PARENT_TAG: name}).info.run_id
    client.set_terminated(run_id)
    return str(run_id)
