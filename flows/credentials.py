"""Credentials kept in Prefect blocks, resolved into the settings' secret fields before infra sees them.

A Prefect user keeps keys in the UI: a prefect-aws `AwsCredentials` block for AWS (EC2 and the S3 bucket
alike), `Secret` blocks for single values. Settings name the blocks (`JEX_INFRA__AWS_CREDENTIALS_BLOCK`,
`JEX_INFRA__AWS_ACCESS_KEY_ID_BLOCK` with `_AWS_SECRET_ACCESS_KEY_BLOCK`, `JEX_INFRA__SSH_PRIVATE_KEY_BLOCK`),
and a campaign's form may name its own AwsCredentials block (`machines.aws_credentials_block`). Only the
names travel (flow-run parameters, campaign.json, provenance); the values are read here, in the flow's
process, into `SecretStr` fields of an in-memory copy of the settings, which `infra/` turns into clients
and SSH keys as it always did. A named block wins over the plain `JEX_INFRA__AWS_*` / SSH key settings;
with no block named nothing changes and no Prefect API is called.
"""

from __future__ import annotations

from typing import Any

from pydantic import SecretStr

from jex.errors import SettingsError
from jex.settings import JexSettings


def with_block_credentials(settings: JexSettings, *, aws_credentials_block: str | None = None) -> JexSettings:
    """`settings` with the keys of every named block in `settings.infra`'s secret fields and the block names
    cleared (so resolving twice calls the API once). `aws_credentials_block` (a campaign's) wins over the
    setting of that name. Raises `SettingsError` naming the setting of a block that is missing or empty."""
    infra = settings.infra
    aws_block = aws_credentials_block or infra.aws_credentials_block
    keys: dict[str, Any] = {}
    if aws_block:
        keys |= _aws_credentials(aws_block)
    elif infra.aws_access_key_id_block or infra.aws_secret_access_key_block:
        if not (infra.aws_access_key_id_block and infra.aws_secret_access_key_block):
            raise SettingsError("set both JEX_INFRA__AWS_ACCESS_KEY_ID_BLOCK and _AWS_SECRET_ACCESS_KEY_BLOCK "
                                "(or one AwsCredentials block in JEX_INFRA__AWS_CREDENTIALS_BLOCK)",
                                field="JEX_INFRA__AWS_ACCESS_KEY_ID_BLOCK")
        keys |= {"aws_access_key_id": _secret(infra.aws_access_key_id_block, "JEX_INFRA__AWS_ACCESS_KEY_ID_BLOCK"),
                 "aws_secret_access_key": _secret(infra.aws_secret_access_key_block,
                                                  "JEX_INFRA__AWS_SECRET_ACCESS_KEY_BLOCK"),
                 "aws_session_token": None}
    if infra.ssh_private_key_block:
        keys["ssh_private_key"] = _secret(infra.ssh_private_key_block, "JEX_INFRA__SSH_PRIVATE_KEY_BLOCK")
    if not keys:
        return settings
    cleared = dict.fromkeys(("aws_credentials_block", "aws_access_key_id_block", "aws_secret_access_key_block",
                             "ssh_private_key_block"))
    return settings.model_copy(update={"infra": infra.model_copy(update=keys | cleared)})


def _aws_credentials(name: str) -> dict[str, SecretStr | None]:
    """The keys of AwsCredentials block `name`, resolved the way prefect-aws does (explicit keys, else its
    profile or assumed role), frozen: the machines and the bucket use one set."""
    from prefect_aws import AwsCredentials

    where = "JEX_INFRA__AWS_CREDENTIALS_BLOCK (or machines.aws_credentials_block)"
    block = _load(AwsCredentials, name, where)
    found = block.get_boto3_session().get_credentials()
    if found is None:
        raise SettingsError(f"the AwsCredentials block {name!r} yields no AWS keys (set its access key id and secret)",
                            field=where)
    frozen = found.get_frozen_credentials()
    return {"aws_access_key_id": SecretStr(frozen.access_key), "aws_secret_access_key": SecretStr(frozen.secret_key),
            "aws_session_token": SecretStr(frozen.token) if frozen.token else None}


def _secret(name: str, setting: str) -> SecretStr:
    """The value of Secret block `name` (a string)."""
    from prefect.blocks.system import Secret

    value = _load(Secret, name, setting).get()
    if not isinstance(value, str) or not value:
        raise SettingsError(f"the Secret block {name!r} must hold a non-empty string", field=setting)
    return SecretStr(value)


def _load(block_type: Any, name: str, setting: str) -> Any:
    try:
        return block_type.load(name)
    except ValueError as e:  # Prefect's "Unable to find block document named ..."
        slug = block_type.get_block_type_slug()
        raise SettingsError(f"no {block_type.__name__} block named {name!r} on the Prefect server "
                            f"(create it in the UI's Blocks page or with `prefect block create {slug}`)",
                            field=setting) from e
