"""Resume from S3: a new orchestrator with an empty local store gets back every verified stage folder.

The stage folders go up after every stage (`_SUCCESS.json` last) with the run record; `jex store
pull` and `jex run --resume` bring them back, each object checked against its sha256 and each
folder against its `_SUCCESS.json`. Real S3 API: moto's server on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jex.infra.s3 import UploadError, checkpoint, pull_campaign
from jex.tasks.records import StageSummary
from jex.tasks.store import LocalStore

JEX = str(Path(sys.executable).with_name("jex"))


def _stage(store: Path, stage: str, key: str, files: dict[str, bytes]) -> Path:
    sd = LocalStore(store).stage(stage, key)
    for name, data in files.items():
        (sd.path / name).parent.mkdir(parents=True, exist_ok=True)
        (sd.path / name).write_bytes(data)
    sd.finish(StageSummary(stage=stage, key=key, sha256=""))
    return sd.path


def _run(tmp_path: Path, store: Path, stages: dict[str, Path]) -> Path:
    run_dir = tmp_path / "runs" / "camp-0123456789"
    run_dir.mkdir(parents=True)
    (run_dir / "campaign.json").write_text(json.dumps({"name": "camp", "store": str(store)}))
    (run_dir / "stages.json").write_text(json.dumps({k: {"folder": str(v), "key": v.name} for k, v in stages.items()}))
    return run_dir


def test_checkpointed_stages_come_back_verified_into_an_empty_store(tmp_path, s3_bucket):
    store = tmp_path / "store"
    a = _stage(store, "fast_pass", "k1", {"capture.parquet": b"capture", "shards-4/shard-00000.parquet": b"s0"})
    b = _stage(store, "gate", "k2", {"gated.parquet": b"gated"})
    run_dir = _run(tmp_path, store, {"fast_pass": a, "gate": b})
    for folder in (a, b):
        checkpoint(s3_bucket, run_dir, folder)
    keys = [o.key for o in s3_bucket.list_objects("jex/store/fast_pass/k1/")]
    assert keys[-1].endswith("_SUCCESS.json") or len(keys) == 3
    shutil.rmtree(store)
    shutil.rmtree(run_dir)
    report = pull_campaign(s3_bucket, "camp", out=tmp_path / "runs", store=store)
    assert sorted(report.pulled) == ["fast_pass/k1", "gate/k2"] and report.incomplete == []
    assert (store / "fast_pass/k1/shards-4/shard-00000.parquet").read_bytes() == b"s0"
    assert LocalStore(store).stage("gate", "k2").complete
    assert json.loads((run_dir / "campaign.json").read_text())["name"] == "camp"
    again = pull_campaign(s3_bucket, "camp", out=tmp_path / "runs", store=store)  # idempotent: nothing downloaded twice
    assert again.pulled == [] and sorted(again.present) == ["fast_pass/k1", "gate/k2"]


def test_an_object_that_does_not_match_its_sha256_is_refused_and_nothing_lands(tmp_path, s3_bucket):
    store = tmp_path / "store"
    a = _stage(store, "fast_pass", "k1", {"capture.parquet": b"capture"})
    run_dir = _run(tmp_path, store, {"fast_pass": a})
    checkpoint(s3_bucket, run_dir, a)
    key = "jex/store/fast_pass/k1/capture.parquet"
    meta = s3_bucket.client.head_object(Bucket=s3_bucket.bucket, Key=key)["Metadata"]
    s3_bucket.client.put_object(Bucket=s3_bucket.bucket, Key=key, Body=b"tampered", Metadata=meta)
    shutil.rmtree(store)
    with pytest.raises(UploadError, match="does not match its sha256"):
        pull_campaign(s3_bucket, "camp", out=tmp_path / "runs", store=store)
    assert not (store / "fast_pass" / "k1").exists()


def test_a_stage_folder_without_its_success_record_in_s3_is_left_to_compute(tmp_path, s3_bucket):
    store = tmp_path / "store"
    a = _stage(store, "fast_pass", "k1", {"capture.parquet": b"capture"})
    run_dir = _run(tmp_path, store, {"fast_pass": a})
    checkpoint(s3_bucket, run_dir, a)
    s3_bucket.client.delete_object(Bucket=s3_bucket.bucket, Key="jex/store/fast_pass/k1/_SUCCESS.json")
    shutil.rmtree(store)
    report = pull_campaign(s3_bucket, "camp", out=tmp_path / "runs", store=store)
    assert report.incomplete == ["fast_pass/k1"] and not (store / "fast_pass/k1/_SUCCESS.json").exists()


def test_shards_machines_uploaded_are_placed_in_the_store(tmp_path, s3_bucket):
    store = tmp_path / "store"
    run_dir = _run(tmp_path, store, {})
    checkpoint(s3_bucket, run_dir, None)
    shard = tmp_path / "shard.parquet"
    shard.write_bytes(b"shard bytes")
    s3_bucket.put_file(shard, s3_bucket.key("campaigns", run_dir.name, "machines", "m1", "fast_pass",
                                            "store/fast_pass/k9/shards-4/shard-00002.parquet"))
    report = pull_campaign(s3_bucket, run_dir.name, out=tmp_path / "fresh", store=tmp_path / "fresh-store")
    assert report.shards == 1
    assert (tmp_path / "fresh-store/fast_pass/k9/shards-4/shard-00002.parquet").read_bytes() == b"shard bytes"


def test_an_unknown_or_ambiguous_campaign_is_a_clear_error(tmp_path, s3_bucket):
    with pytest.raises(UploadError, match="no campaign 'nope'"):
        pull_campaign(s3_bucket, "nope", out=tmp_path, store=tmp_path / "store")


@pytest.mark.slow
def test_orchestrator_killed_and_local_store_deleted_resumes_from_s3_with_zero_engine_calls(
        tmp_path, s3_bucket, s3_server, prefect_api_url):
    """A campaign runs with S3; its orchestrator is gone with everything local (store, run folder,
    Prefect home with the result storage Prefect's cache lives in) after the reason stage's checkpoint; a new
    one resumes from S3. Both report to the session's Prefect test API, as to a team's server."""
    from jex.sample_suite import write_sample_suite

    suite = write_sample_suite(tmp_path / "suite", rows=18, seed=5)

    def jex(*args: str, home: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PREFECT_HOME": str(tmp_path / home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "JEX_STORE__S3_BUCKET": s3_bucket.bucket, "JEX_STORE__S3_PREFIX": "jex",
               "JEX_STORE__S3_ENDPOINT_URL": s3_server, "JEX_INFRA__AWS_ACCESS_KEY_ID": "test",
               "JEX_INFRA__AWS_SECRET_ACCESS_KEY": "test", "PREFECT_API_URL": prefect_api_url}
        p = subprocess.run([JEX, *args], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400)
        assert p.returncode == 0, p.stderr[-3000:]
        return p

    first = jex("run", "--suite", str(suite), "--provider", "inprocess", "--coverage", "0.2", "--reason-max-tokens",
                "8", "--shard-rows", "9", "--name", "t", "--out", "runs", home="prefect-1")
    run_dir = tmp_path / first.stdout.strip().splitlines()[-1]
    predictions = (run_dir / "predictions.parquet").read_bytes()
    stages = json.loads((run_dir / "stages.json").read_text())
    # the orchestrator dies after the reason stage's checkpoint: S3 holds nothing of later stages
    for stage in ("fold", "calibrate", "overlay", "score"):
        rel = "/".join(Path(stages[stage]["folder"]).parts[-2:])
        for o in s3_bucket.list_objects(f"jex/store/{rel}/") + s3_bucket.list_objects(f"jex/runs/{run_dir.name}/"):
            s3_bucket.client.delete_object(Bucket=s3_bucket.bucket, Key=o.key)
    kept = {k: v for k, v in stages.items() if k in ("bundle", "fast_pass", "gate", "reason")}
    (run_dir / "stages.json").write_text(json.dumps(kept))
    checkpoint(s3_bucket, run_dir, None)  # the run record as it stood after the reason stage
    shutil.rmtree(tmp_path / "runs")  # the local store and the run folder are gone with the orchestrator

    second = jex("run", "--resume", f"runs/{run_dir.name}", home="prefect-2")
    assert Path(second.stdout.strip().splitlines()[-1]) == (tmp_path / "runs" / run_dir.name)
    assert "pulled 4 stage folder(s)" in second.stderr
    calls = json.loads((run_dir / "engine_calls.json").read_text())["calls"]
    assert calls == {"fast_pass": 0, "reason": 0}
    assert (run_dir / "predictions.parquet").read_bytes() == predictions
