"""boto3 clients from settings: one place where credentials (secrets) meet the client, never logged.

Every client uses botocore's `standard` retry mode (exponential backoff with jitter, retries on
throttling and transient errors, a retry quota), not the legacy mode boto3 defaults to.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)

RETRIES = {"mode": "standard", "total_max_attempts": 5}


def aws_client(service: str, *, region: str, endpoint_url: str | None, infra: Any) -> Any:
    """A boto3 client for `service`; explicit keys from `JEX_INFRA__AWS_*` when set, else boto3's chain."""
    import boto3
    from botocore.config import Config

    kw: dict[str, Any] = {"region_name": region, "config": Config(retries=dict(RETRIES))}
    if endpoint_url:
        kw["endpoint_url"] = endpoint_url
    if infra.aws_access_key_id and infra.aws_secret_access_key:
        kw["aws_access_key_id"] = infra.aws_access_key_id.get_secret_value()
        kw["aws_secret_access_key"] = infra.aws_secret_access_key.get_secret_value()
    return boto3.client(service, **kw)


def prefix_policy(bucket: str, prefix: str) -> str:
    """An IAM session policy allowing object reads and writes under `prefix` of `bucket` only."""
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload"],
         "Resource": f"arn:aws:s3:::{bucket}/{prefix.strip('/')}/*"},
        {"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": [f"{prefix.strip('/')}/*"]}}}]})


def scoped_credentials(store: Any, infra: Any, *, key_prefix: str, ttl_s: float) -> dict[str, str]:
    """Temporary credentials that can touch only `key_prefix` of the store's bucket (STS federation
    token with a session policy), valid for the machine's time to live (15 min .. 36 h). Empty when
    STS refuses: the machine then uses its own role (e.g. an EC2 instance profile), never our keys."""
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
