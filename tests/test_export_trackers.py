"""A run's results where teams look: `jex export mlflow|wandb|hub`, read back with each library's own reader.

MLflow: a real tracking store (a `sqlite:` URI) read back with `MlflowClient`. W&B: offline, read back from the
`.wandb` run file with wandb's own record reader (`wandb.sdk.internal.datastore`, wandb 0.29.0). The Hub layout:
loaded with `datasets.load_dataset` from the folder. One main-job run is shared by the session (conftest).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app

MODEL_DIR = "jex-embedded-SmolLM2-135M-Instruct"  # the embedded model's folder in lm-eval's layout


def cli(*args: str) -> object:
    return CliRunner().invoke(app, list(args))


def score_numbers(run_dir: Path) -> dict[str, float]:
    """Every number of score.json, by the names the trackers log them under (each interval as its bounds)."""
    doc = json.loads((run_dir / "score.json").read_text())
    out = {"full": doc["full"], "full/ci_low": doc["ci"][0], "full/ci_high": doc["ci"][1], "full_raw": doc["full_raw"]}
    for name, leg in doc["legs"].items():
        out |= {f"leg/{name}/index": leg["index"], f"leg/{name}/raw": leg["raw"], f"leg/{name}/ci_low": leg["ci"][0],
                f"leg/{name}/ci_high": leg["ci"][1]}
    for name, c in doc["catalogs"].items():
        out |= {f"catalog/{name}/{k}": v for k, v in c.items() if type(v) in (int, float)}
        out |= {f"catalog/{name}/ci_low": c["ci"][0], f"catalog/{name}/ci_high": c["ci"][1]}
    return {k: float(v) for k, v in out.items()}


# --- MLflow ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory) -> Path:
    """A folder for one sqlite tracking store (made once: its schema takes seconds); each test its own experiment."""
    return tmp_path_factory.mktemp("mlflow")


def experiment(store: Path, name: str) -> tuple[object, str, str]:
    """(client, experiment id, tracking URI): an experiment whose artifacts stay in the store's folder."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    return client, client.create_experiment(name, artifact_location=str(store / name)), uri


def logged_runs(client, experiment_id: str) -> list:
    return client.search_runs([experiment_id])


def test_mlflow_run_holds_every_number_of_score_json_and_the_run_files(main_job_run, mlflow_store):
    client, exp, uri = experiment(mlflow_store, "numbers")
    result = cli("export", "mlflow", str(main_job_run), "--tracking-uri", uri, "--experiment", "numbers")
    assert result.exit_code == 0, result.output
    [run] = logged_runs(client, exp)
    assert result.output.strip().endswith(f"{main_job_run.name}: MLflow run {run.info.run_id}")
    assert run.data.metrics == score_numbers(main_job_run)
    campaign = json.loads((main_job_run / "campaign.json").read_text())
    stages = json.loads((main_job_run / "stages.json").read_text())
    provenance = json.loads((main_job_run / "provenance.json").read_text())
    assert {k: run.data.params[k] for k in ("model", "bundle", "coverage", "jex.commit", "engine.kind",
                                            "model.weights_sha256")} == {
        "model": "embedded", "bundle": stages["bundle"]["key"], "coverage": str(campaign["coverage"]),
        "jex.commit": provenance["jex"]["commit"], "engine.kind": campaign["engine"]["kind"],
        "model.weights_sha256": provenance["engine"]["weights_sha256"]}
    assert {k: v for k, v in run.data.tags.items() if k.startswith("jex.")} == {
        "jex.run": main_job_run.name, "jex.batch_invariance": "not audited", "jex.provider": "inprocess",
        "jex.where": "local", "jex.engine": "hf", "jex.model_source": "embedded", "jex.served": "false"}
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {
        "report.md", "skill.png", "reliability.png", "samples.parquet", "score.json", "provenance.json"}


def test_exporting_to_mlflow_again_keeps_one_run_and_one_value_per_metric(main_job_run, mlflow_store):
    from jex.tasks.campaign_spec import MlflowTarget
    from jex.tasks.outputs.interop.mlflow_run import export_mlflow

    client, exp, uri = experiment(mlflow_store, "twice")
    target = MlflowTarget(tracking_uri=uri, experiment="twice")
    first, again = export_mlflow([main_job_run], target), export_mlflow([main_job_run], target)
    assert first == again and [r.info.run_id for r in logged_runs(client, exp)] == first
    assert {len(client.get_metric_history(first[0], k)) for k in score_numbers(main_job_run)} == {1}


def test_a_run_scored_again_replaces_its_mlflow_run(main_job_run, mlflow_store, tmp_path):
    """MLflow keeps every value of a metric: a changed run gets a new MLflow run, the stale one deleted."""
    from jex.tasks.campaign_spec import MlflowTarget
    from jex.tasks.documents import ScoreDoc, read_doc, write_doc
    from jex.tasks.outputs.interop.mlflow_run import export_mlflow

    run = shutil.copytree(main_job_run, tmp_path / main_job_run.name)
    client, exp, uri = experiment(mlflow_store, "rescored")
    target = MlflowTarget(tracking_uri=uri, experiment="rescored")
    [stale] = export_mlflow([run], target)
    score = read_doc(ScoreDoc, run / "score.json")
    write_doc(run / "score.json", score.model_copy(update={"full": score.full + 1}))
    [fresh] = export_mlflow([run], target)
    assert fresh != stale and [r.info.run_id for r in logged_runs(client, exp)] == [fresh]
    assert client.get_run(stale).info.lifecycle_stage == "deleted"
    assert [m.value for m in client.get_metric_history(fresh, "full")] == [score.full + 1]


def test_runs_nest_under_one_parent_run(main_job_run, mlflow_store):
    client, exp, uri = experiment(mlflow_store, "nested")
    for _ in range(2):
        result = cli("export", "mlflow", str(main_job_run), "--tracking-uri", uri, "--experiment", "nested",
                     "--parent", "smollm-vs-others")
        assert result.exit_code == 0, result.output
    runs = {r.data.tags["mlflow.runName"]: r for r in logged_runs(client, exp)}
    assert sorted(runs) == sorted([main_job_run.name, "smollm-vs-others"])
    assert runs[main_job_run.name].data.tags["mlflow.parentRunId"] == runs["smollm-vs-others"].info.run_id


def test_the_campaign_option_logs_the_run_after_its_report_and_a_refusal_is_a_warning(main_job_run, mlflow_store,
                                                                                   capsys):
    """What the flow calls after the report (`CampaignSpec.mlflow`); a tracker that refuses the run does not fail
    a finished campaign, it says how to log it later."""
    from jex.flows.campaign import log_to_mlflow
    from jex.tasks.campaign_spec import CampaignSpec, MlflowTarget

    client, exp, uri = experiment(mlflow_store, "campaign")
    log_to_mlflow(CampaignSpec(mlflow=MlflowTarget(tracking_uri=uri, experiment="campaign")), main_job_run)
    [run] = logged_runs(client, exp)
    assert run.data.tags["jex.run"] == main_job_run.name and "logged to MLflow" in capsys.readouterr().out
    log_to_mlflow(CampaignSpec(mlflow=MlflowTarget(tracking_uri="nowhere://tracker")), main_job_run)
    said = capsys.readouterr().out
    assert "WARNING: the run is not logged to MLflow" in said and f"jex export mlflow {main_job_run}" in said


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_an_export_without_its_extra_names_the_extra(main_job_run, monkeypatch, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # as if not installed: `import tracker` fails
    result = cli("export", tracker, str(main_job_run))
    assert result.exit_code == 1 and result.output.strip() == \
        f"error: {tracker} is not installed: pip install 'jex[{tracker}]'"


# --- Weights & Biases --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wandb_offline(main_job_run, tmp_path_factory) -> Path:
    """The run exported offline under a folder of the test's (W&B's every folder there): its `.wandb` run file."""
    import wandb

    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
            (root / name.lower()).mkdir()
            env.setenv(name, str(root / name.lower()))
        env.delenv("WANDB_API_KEY", raising=False)
        result = cli("export", "wandb", str(main_job_run), "--project", "evals")
        wandb.teardown()
    assert result.exit_code == 0, result.output
    [path] = (root / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")
    assert result.output.strip().endswith(f"(send it: wandb sync {path.parent})")
    return path


def wandb_records(path: Path) -> list:
    """Every record of a `.wandb` run file, read with wandb's own reader."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    records = []
    while (data := store.scan_data()) is not None:
        record = pb.Record()
        record.ParseFromString(data)
        records.append(record)
    return records


def updates(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_offline_run_holds_every_number_config_and_tags(main_job_run, wandb_offline):
    """Its id is the run folder's name: every export (and `wandb sync` of an offline one) updates that run."""
    records = wandb_records(wandb_offline)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    summary: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary |= updates(r.summary.update)
    expected = score_numbers(main_job_run)
    assert {k: summary[k] for k in expected} == expected
    config = updates(run.config.update)
    assert (run.run_id, run.display_name, run.project) == (main_job_run.name, main_job_run.name, "evals")
    assert (config["model"], config["jex.run"], config["jex.batch_invariance"]) == \
        ("embedded", main_job_run.name, "not audited")
    assert "batch_invariance:not audited" in run.tags


def test_wandb_offline_run_holds_the_samples_table_the_plots_and_the_report(main_job_run, wandb_offline):
    records = wandb_records(wandb_offline)
    logged: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            logged |= updates(r.history.item)
    assert (logged["samples/_type"], logged["plots/skill/_type"], logged["plots/reliability/_type"]) == \
        ("table-file", "image-file", "image-file")
    table = json.loads((wandb_offline.parent / "files" / logged["samples/path"]).read_text())
    samples = pl.read_parquet(main_job_run / "samples.parquet")
    assert [row[table["columns"].index("run_id")] for row in table["data"]] == samples["run_id"].to_list()
    [artifact] = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact" and
                  r.artifact.type == "jex-run"]
    assert {c.path for c in artifact.manifest.contents} == {
        "report.md", "skill.png", "reliability.png", "samples.parquet", "score.json", "provenance.json"}


# --- the Hugging Face Hub's results layout ---------------------------------------------------------

def test_hub_folder_loads_with_datasets_as_lm_eval_lays_it_out(main_job_run, tmp_path):
    from datasets import load_dataset

    result = cli("export", "hub", str(main_job_run), "-o", str(tmp_path / "hub"))
    assert result.exit_code == 0, result.output
    folder = Path(result.output.strip().splitlines()[-1])
    cache = str(tmp_path / "cache")
    [results] = load_dataset(str(folder), name=f"{MODEL_DIR}__results", split="latest", cache_dir=cache)
    score = json.loads((main_job_run / "score.json").read_text())
    assert {c: results["results"][c]["acc,none"] for c in score["catalogs"]} == \
        {c: v["acc"] for c, v in score["catalogs"].items()}
    assert results["jex"]["full"] == score["full"]
    samples = pl.read_parquet(main_job_run / "samples.parquet").filter(pl.col("scored"))
    for catalog in score["catalogs"]:
        rows = load_dataset(str(folder), name=f"{MODEL_DIR}__{catalog}", split="latest", cache_dir=cache)
        assert sorted(d["run_id"] for d in rows["doc"]) == \
            sorted(samples.filter(pl.col("catalog") == catalog)["run_id"].to_list())
    card = (folder / "README.md").read_text()
    assert f"config_name: {MODEL_DIR}__results" in card and "split: latest" in card


def test_pushing_to_the_hub_without_a_token_is_one_line_before_anything_is_written(main_job_run, monkeypatch,
                                                                                    tmp_path):
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    result = cli("export", "hub", str(main_job_run), "-o", str(tmp_path / "hub"), "--repo-id", "org/evals")
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1
    assert "needs a Hugging Face token" in result.output and "HF_TOKEN" in result.output
    assert not (tmp_path / "hub").exists()


# --- bad input, before any tracker is reached ----------------------------------------------------------

def test_a_folder_that_is_not_a_finished_run_is_one_line(tmp_path):
    result = cli("export", "mlflow", str(tmp_path))
    assert result.exit_code == 1
    assert result.output.strip() == f"error: file {tmp_path}: not a finished run folder (no score.json): give the " \
                                    "folder `jex run` printed last"


def test_a_tracking_uri_with_a_password_is_refused_without_echoing_it(tmp_path):
    result = cli("export", "mlflow", str(tmp_path), "--tracking-uri", "https://me:s3cret@mlflow.example")
    assert result.exit_code == 1 and "MLFLOW_TRACKING_PASSWORD" in result.output and "s3cret" not in result.output
