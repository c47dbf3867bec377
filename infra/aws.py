"""boto3 clients from settings: one place where credentials (secrets) meet the client, never logged."""

from __future__ import annotations

from typing import Any


def aws_client(service: str, *, region: str, endpoint_url: str | None, infra: Any) -> Any:
    """A boto3 client for `service`; explicit keys from `JEX_INFRA__AWS_*` when set, else boto3's chain."""
    import boto3

    kw: dict[str, Any] = {"region_name": region}
    if endpoint_url:
        kw["endpoint_url"] = endpoint_url
    if infra.aws_access_key_id and infra.aws_secret_access_key:
        kw["aws_access_key_id"] = infra.aws_access_key_id.get_secret_value()
        kw["aws_secret_access_key"] = infra.aws_secret_access_key.get_secret_value()
    return boto3.client(service, **kw)
