"""boto3 clients: one place where credentials (secrets) meet the client, never logged.

Every client, the orchestrator's and a machine watchdog's alike, is built by `aws_client` and uses
botocore's `standard` retry mode (exponential backoff with jitter, retries on throttling and
transient errors, a retry quota), not the legacy mode boto3 defaults to.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jex.settings import InfraSettings, StoreSettings

log = logging.getLogger(__name__)

RETRY_MODE = "standard"
MAX_ATTEMPTS = 5
"""botocore's attempts per call (the first included) for the orchestrator's clients."""
CREDENTIAL_KEYS = ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")


def settings_credentials(infra: InfraSettings | None) -> dict[str, str]:
    """Explicit keys from `JEX_INFRA__AWS_*` (or the blocks `jex.flows.credentials` resolved into them) when
    both are set, with the session token if any; empty: boto3's own chain."""
    if infra is None or not (infra.aws_access_key_id and infra.aws_secret_access_key):
        return {}
    keys = {"aws_access_key_id": infra.aws_access_key_id.get_secret_value(),
            "aws_secret_access_key": infra.aws_secret_access_key.get_secret_value()}
    if infra.aws_session_token:
        keys["aws_session_token"] = infra.aws_session_token.get_secret_value()
    return keys


def aws_client(service: str, *, region: str, endpoint_url: str | None, infra: InfraSettings | None = None,
               credentials: Mapping[str, str] | None = None, max_attempts: int = MAX_ATTEMPTS,
               timeout_s: float | None = None) -> Any:
    """A boto3 client for `service` in standard retry mode. Keys: `credentials` (e.g. a watchdog's scoped
    ones), else those in the `infra` settings, else boto3's chain; `timeout_s` bounds connect and read.
    Returns the boto3 client (boto3 ships no types)."""
    import boto3
    from botocore.config import Config

    timeouts = {"connect_timeout": timeout_s, "read_timeout": timeout_s} if timeout_s is not None else {}
    config = Config(retries={"mode": RETRY_MODE, "total_max_attempts": max_attempts}, **timeouts)
    keys = {k: v for k, v in (credentials or {}).items() if k in CREDENTIAL_KEYS and v}
    kw: dict[str, Any] = {"region_name": region, "config": config, **(keys or settings_credentials(infra))}
    if endpoint_url:
        kw["endpoint_url"] = endpoint_url
    return boto3.client(service, **kw)


def prefix_policy(bucket: str, prefix: str) -> str:
    """An IAM session policy allowing object reads and writes under `prefix` of `bucket` only."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{bucket}/{prefix.strip('/')}/*"},
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{prefix.strip('/')}/*"]}}}]})


def scoped_credentials(store: StoreSettings, infra: InfraSettings | None, *, key_prefix: str,
                       ttl_s: float) -> dict[str, str]:
    """Temporary credentials that can touch only `key_prefix` of the store's bucket (STS federation
    token with a session policy), valid for the machine's time to live (15 min .. 36 h). Empty when
    STS refuses: the machine then uses its own role (e.g. an EC2 instance profile), never our keys; empty too
    without a bucket (the watchdog then has nothing to upload to)."""
    if not store.s3_bucket:
        return {}
    try:
        sts = aws_client("sts", region=store.s3_region, endpoint_url=store.s3_endpoint_url, infra=infra)
        token = sts.get_federation_token(Name="jex-watchdog", Policy=prefix_policy(store.s3_bucket, key_prefix),
                                         DurationSeconds=int(min(max(ttl_s, 900), 129600)))["Credentials"]
    except Exception as e:  # noqa: BLE001 - any refusal means: no credentials from us
        log.warning("no scoped credentials for the machine's watchdog (%s); it will use its own role",
                    type(e).__name__)
        return {}
    return {"aws_access_key_id": token["AccessKeyId"], "aws_secret_access_key": token["SecretAccessKey"],
            "aws_session_token": token["SessionToken"]}
