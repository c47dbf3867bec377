"""S3 uploads against a real S3 API (moto's server on 127.0.0.1), through boto3's HTTP calls."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jex.fileio import sha256_file
from jex.infra.records import ObjectHead, S3Manifest
from jex.infra.s3 import S3Store, UploadError, push_campaign


@pytest.fixture
def store(s3_server, monkeypatch):
    import uuid

    import boto3

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    return S3Store(bucket, "jex", client)


def test_upload_records_and_verifies_sha256(store, tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 1000)
    got = store.put_file(f, store.key("runs", "a.bin"))
    assert got.uploaded and got.sha256 == sha256_file(f)
    head = store.client.head_object(Bucket=store.bucket, Key="jex/runs/a.bin")
    assert head["Metadata"]["sha256"] == sha256_file(f)
    assert store.put_file(f, store.key("runs", "a.bin")).uploaded is False  # idempotent
    assert store.head("jex/runs/a.bin") == ObjectHead(sha256=sha256_file(f), bytes=1000)
    assert store.head("jex/runs/nothing") is None
    back = store.get_file("jex/runs/a.bin", tmp_path / "b.bin")
    assert back.read_bytes() == f.read_bytes()


def test_object_that_does_not_match_its_metadata_is_refused(store, tmp_path):
    store.client.put_object(Bucket=store.bucket, Key="jex/x", Body=b"abc", Metadata={"sha256": "0" * 64})
    with pytest.raises(UploadError, match="does not match"):
        store.get_file("jex/x", tmp_path / "x")
    assert not (tmp_path / "x").exists()


def _stage_and_run(tmp_path, stage: str, key: str, name: str) -> tuple[Path, Path]:
    """A stage folder with one file, and an empty run folder."""
    folder = tmp_path / "store" / stage / key
    folder.mkdir(parents=True)
    (folder / name).write_bytes(b"bytes")
    run = tmp_path / "run"
    run.mkdir()
    return folder, run


def test_push_campaign_uploads_stage_folders_and_run_folder(store, tmp_path):
    stage, run = _stage_and_run(tmp_path, "fast_pass", "k1", "capture.parquet")
    (run / "score.json").write_text("{}")
    manifest = push_campaign(store, run, {"fast_pass": SimpleNamespace(folder=str(stage))}, tmp_path / "store")
    assert sorted(o.key for o in manifest.objects) == ["jex/runs/run/score.json",
                                                      "jex/store/fast_pass/k1/capture.parquet"]
    assert S3Manifest.model_validate_json((run / "s3.json").read_text()) == manifest


def test_a_typed_stage_summary_names_its_folder_too(store, tmp_path):
    stage, run = _stage_and_run(tmp_path, "gate", "k2", "gated.parquet")
    manifest = push_campaign(store, run, {"gate": SimpleNamespace(folder=str(stage))}, tmp_path / "store")
    assert [o.key for o in manifest.objects] == ["jex/store/gate/k2/gated.parquet"]


def test_clients_built_from_settings_use_botocores_standard_retry_mode():
    from jex.infra.aws import aws_client
    from jex.settings import load_settings

    client = aws_client("s3", region="us-east-1", endpoint_url="http://127.0.0.1:9", infra=load_settings().infra)
    assert client.meta.config.retries["mode"] == "standard"
    assert client.meta.config.retries["total_max_attempts"] == 5


def test_the_watchdogs_client_uses_standard_retries_and_short_timeouts(tmp_path):
    from jex.infra.watchdog import Watchdog, WatchdogConfig

    cfg = WatchdogConfig(machine="m", campaign="c", created_at=0.0, bucket="b", endpoint_url="http://127.0.0.1:9",
                         upload_attempt_s=3.0)
    client = Watchdog(tmp_path, cfg, {"aws_access_key_id": "a", "aws_secret_access_key": "s"})._store().client
    assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 2}
    assert client.meta.config.connect_timeout == client.meta.config.read_timeout == 3.0
