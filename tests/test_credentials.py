"""Credentials from Prefect blocks (`jex.flows.credentials`): an AwsCredentials block or Secret blocks sign
the S3 requests, a Secret block's SSH key opens the machines' shells, a missing block is one line naming
its setting, and no key reaches a run's files, logs or flow-run parameters; without blocks the settings
are used as before.

Real components: the session's Prefect test API (`prefect_harness`), moto's S3 server on 127.0.0.1,
the private OpenSSH server (`sshd`)."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from jex.errors import SettingsError
from jex.flows.credentials import with_block_credentials
from jex.flows.machines.fleet import s3_store
from jex.settings import JexSettings

BLOCK_KEY_ID = "AKIABLOCKKEY00000001"
BLOCK_SECRET = "block-secret-6f1d2c9a8b7e"
ENV_KEY_ID = "AKIAENVKEY0000000001"


@pytest.fixture(autouse=True)
def no_user_settings(monkeypatch):
    for name in [n for n in os.environ if n.startswith("JEX_")]:
        monkeypatch.delenv(name)


def settings(s3_server: str | None = None, bucket: str | None = None, **infra: object) -> JexSettings:
    store = {"s3_bucket": bucket, "s3_endpoint_url": s3_server} if bucket else {}
    return JexSettings(_env_file=None, store=store, infra=infra)  # type: ignore[arg-type]


def new_bucket(s3_server: str) -> str:
    import boto3

    name = f"jex-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                 aws_secret_access_key="test").create_bucket(Bucket=name)
    return name


def signing_keys(store) -> list[str]:
    """The access key ids in the Authorization headers of every request the store's client sends."""
    seen: list[str] = []
    store.client.meta.events.register(
        "before-send.s3.*", lambda request, **_: seen.append(
            request.headers["Authorization"].decode().split("Credential=")[1].split("/")[0]))
    return seen


def save_aws_block(name: str) -> None:
    from prefect_aws import AwsCredentials

    AwsCredentials(aws_access_key_id=BLOCK_KEY_ID, aws_secret_access_key=SecretStr(BLOCK_SECRET)).save(
        name, overwrite=True)


def save_secret(name: str, value: str) -> None:
    from prefect.blocks.system import Secret

    Secret(value=SecretStr(value)).save(name, overwrite=True)


def test_an_aws_credentials_block_signs_the_s3_requests(prefect_harness, s3_server, tmp_path):
    save_aws_block("jex-test-aws")
    store = s3_store(settings(s3_server, new_bucket(s3_server), aws_credentials_block="jex-test-aws",
                              aws_access_key_id=ENV_KEY_ID, aws_secret_access_key="env-secret"))
    seen = signing_keys(store)
    (tmp_path / "f.txt").write_text("x")
    store.put_file(tmp_path / "f.txt", store.key("f.txt"))
    assert seen and set(seen) == {BLOCK_KEY_ID}


def test_secret_blocks_sign_the_s3_requests(prefect_harness, s3_server, tmp_path):
    save_secret("jex-test-key-id", BLOCK_KEY_ID)
    save_secret("jex-test-secret-key", BLOCK_SECRET)
    store = s3_store(settings(s3_server, new_bucket(s3_server), aws_access_key_id_block="jex-test-key-id",
                              aws_secret_access_key_block="jex-test-secret-key"))
    seen = signing_keys(store)
    (tmp_path / "f.txt").write_text("x")
    store.put_file(tmp_path / "f.txt", store.key("f.txt"))
    assert seen and set(seen) == {BLOCK_KEY_ID}


def test_a_campaign_block_name_beats_the_setting(prefect_harness):
    save_aws_block("jex-test-aws")
    resolved = with_block_credentials(settings(aws_credentials_block="no-such-block"),
                                      aws_credentials_block="jex-test-aws")
    assert resolved.infra.aws_access_key_id == SecretStr(BLOCK_KEY_ID)


def test_without_blocks_the_settings_keys_are_used_unchanged():
    plain = settings(aws_access_key_id=ENV_KEY_ID, aws_secret_access_key="env-secret")
    assert with_block_credentials(plain) is plain


def test_a_missing_block_is_one_line_naming_its_setting(prefect_harness):
    with pytest.raises(SettingsError, match="JEX_INFRA__SSH_PRIVATE_KEY_BLOCK.*no Secret block named "
                                            "'jex-no-such-key'"):
        with_block_credentials(settings(ssh_private_key_block="jex-no-such-key"))


def test_a_secret_block_holds_the_ssh_key_the_machines_are_opened_with(prefect_harness, sshd, tmp_path):
    from jex.infra.reaper import make_provider

    save_secret("jex-test-ssh-key", Path(sshd["key_path"]).read_text())
    resolved = with_block_credentials(settings(ssh_private_key_block="jex-test-ssh-key", ssh_port=sshd["port"],
                                               ssh_known_hosts=sshd["known_hosts"],
                                               remote_root=str(tmp_path / "remote")))
    provider = make_provider(resolved.infra, name="ssh", hosts=["127.0.0.1"])
    machine = provider.create("creds")
    try:
        assert provider.shell(machine).run("echo opened").stdout.strip() == "opened"
    finally:
        provider.delete(machine.id)


def test_no_block_value_reaches_the_run_files_logs_or_parameters(prefect_harness, main_job_run, s3_server,
                                                                  monkeypatch):
    """The main job again (every stage cached) with its AWS keys from a block and its run uploaded to S3:
    the keys are used, and only the block's name is written anywhere."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.logging.handlers import APILogHandler

    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import MachinesSpec, load_spec

    save_aws_block("jex-test-aws")
    bucket = new_bucket(s3_server)
    monkeypatch.setenv("JEX_STORE__S3_BUCKET", bucket)
    monkeypatch.setenv("JEX_STORE__S3_ENDPOINT_URL", s3_server)
    spec = load_spec(main_job_run)
    spec = spec.model_copy(update={"machines": MachinesSpec(provider="inprocess",
                                                            aws_credentials_block="jex-test-aws")})
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # the flow's prints and infos reach the API (the suite's default is WARNING)
        logger.setLevel(logging.INFO)
    try:
        run_dir = Path(campaign(spec))
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        run = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["campaign"])),
                                    sort=FlowRunSort.START_TIME_DESC, limit=1)[0]
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
    assert run.parameters["spec"]["machines"]["aws_credentials_block"] == "jex-test-aws"
    assert [log for log in logs if f"objects to s3://{bucket}/" in log.message]  # uploaded with the block's keys
    written = [p.read_bytes() for p in run_dir.rglob("*") if p.is_file()]
    for secret in (BLOCK_KEY_ID, BLOCK_SECRET):
        assert secret not in str(run.parameters)
        assert not [log.message for log in logs if secret in log.message]
        assert not [b for b in written if secret.encode() in b]
