"""One settings model for the whole project: `JEX_*` environment variables and a `.env` file.

Nested sections use a double underscore: `JEX_ENGINE__BATCH_SIZE=8`, `JEX_STORE__S3_BUCKET=...`.
Secrets are `SecretStr`: they print as '**********' and `public_dict()` leaves them out entirely,
so they reach no log, artifact or provenance block.

Every setting is read by something: `engine`, `store.root`, `bootstrap_*` and `infra.provider` are the
defaults of a campaign (`jex.flows.campaign.campaign_spec`, used by `jex run` and the UI form), the
rest configure the store, the machines and the Prefect server and client.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from pydantic_settings import SettingsError as PydanticSettingsError

from jex.engine_spec import EngineSpec
from jex.errors import SettingsError

BOOTSTRAP_SEED = 20260929
"""The one default seed of every bootstrap and permutation draw (scores, pre-registered tests, experiments)."""
BOOTSTRAP_DRAWS = 2000
"""The default number of bootstrap draws."""
GOLDEN_ROWS = 64
"""Rows of the bundle's head a machine's golden replay reads before its shards (`machines.golden_rows`)."""
PROOF_ROWS = 64
"""Gated rows the audited base re-generates to prove a speculative profile exact (`spec_proof_rows`)."""


class StoreSettings(BaseModel):
    root: Path = Field(Path("runs"), description="Folder of the run folders; the artifact store is ROOT/store")
    s3_bucket: str | None = None
    s3_prefix: str = "jex"
    s3_endpoint_url: str | None = None
    s3_region: str = "us-east-1"
    bundle_member_max_bytes: int = Field(4 << 30, ge=1, description="Largest member a bundle may unpack (4 GiB)")
    bundle_total_max_bytes: int = Field(64 << 30, ge=1, description="Most a bundle may unpack in all (64 GiB)")


ProviderName = Literal["inprocess", "local", "ssh", "ec2", "command"]
"""Where engine stages run: in this process, or on machines a provider rents (`infra/reaper.py: make_provider`)."""
PROVIDER_NAMES: tuple[ProviderName, ...] = get_args(ProviderName)


class InfraSettings(BaseModel):
    provider: ProviderName = "local"
    state_dir: Path = Field(Path("runs/infra"), description="Ledger, code bundles, job records of the orchestrator")
    price_per_hour: float | None = Field(None, ge=0, description="Price of one machine, $/hour; None: the provider's "
                                         "(ec2: the instance catalogue's on-demand price of ec2_instance_type in "
                                         "ec2_region, infra/instance_catalogue.toml; local, ssh, command: 0)")
    budget_usd: float = Field(100.0, ge=0)
    budget_hours: float = Field(72.0, ge=0)
    heartbeat_s: float = Field(5.0, gt=0)
    heartbeat_timeout_s: float = Field(60.0, gt=0)
    poll_s: float = Field(2.0, gt=0)
    watchdog: bool = Field(True, description="Every machine gets a dead-man's switch (infra/watchdog.py)")
    lease_s: float = Field(900.0, gt=0, description="A machine stops itself after this long without the "
                                                    "orchestrator (its lease is renewed on every poll)")
    ttl_hours: float | None = Field(None, gt=0, description="Hard time to live of a machine; None: budget_hours, "
                                                            "capped by budget_usd / price_per_hour")
    finish_grace_s: float = Field(0.0, ge=0, description="After a lease expiry, time a running job may still "
                                                         "finish before the machine stops it")
    poweroff_command: str = Field("", description="How a cloud machine's watchdog powers it off, run on the machine "
                                                  "({id}: the machine); empty: `shutdown -h now`")
    worker_python: str | None = Field(None, description="Interpreter on the machine; None = this one (local) "
                                                        "or python3")
    pip_args: str = Field("", description="Extra pip options for the bootstrap's stack install (uv and pip "
                                          "alike, e.g. an index URL)")
    hosts: list[str] = Field(default_factory=lambda: ["127.0.0.1"], description="ssh provider: existing hosts")
    remote_root: str = Field("/tmp/jex-machines", description="Machine folders on a host (local/ssh providers)")
    ssh_user: str = "root"
    ssh_port: int = 22
    ssh_key_path: Path | None = None
    ssh_private_key: SecretStr | None = None
    ssh_private_key_block: str | None = Field(None, description="Prefect Secret block holding the SSH private key "
                                                                "(wins over ssh_private_key and ssh_key_path)")
    ssh_known_hosts: Path | None = None
    accept_new_host_keys: bool = Field(False, description="Trust a host key on first sight (explicit opt-in)")
    ec2_region: str = "us-east-1"
    ec2_endpoint_url: str | None = None
    ec2_image_id: str | None = Field(None, description="AMI of the machines; None: the newest image named like "
                                                       "ec2_image_name owned by ec2_image_owner")
    ec2_image_name: str = Field("Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *",
                                description="Name pattern (* and ?) of the AMI looked up when no ec2_image_id is set")
    ec2_image_owner: str = Field("amazon", description="Owner of that AMI: an account id, 'amazon' or 'self'")
    ec2_instance_type: str = Field("p5.48xlarge", description="EC2 instance type; its GPUs and price come from the "
                                                              "instance catalogue (infra/instance_catalogue.toml)")
    ec2_key_name: str | None = None
    gpu_kind: str | None = Field(None, description="GPU of the rented machines: the pre-flight's memory estimate "
                                                   "(engine/memory.py) refuses a model that cannot fit it; None: the "
                                                   "instance catalogue's GPU of ec2_instance_type (ec2), else H200")
    gpu_kinds: dict[str, float] = Field(default_factory=dict, description="More GPU kinds, name -> memory in GiB "
                                                                          "(as torch.cuda.mem_get_info reports it)")
    command_create: str = ""
    command_describe: str = ""
    command_list: str = ""
    command_delete: str = ""
    command_keeps_disk: bool = Field(False, description="command provider: a VM's disk outlives its power-off "
                                                        "(most clouds drop it); if not, campaigns need a bucket")
    aws_access_key_id: SecretStr | None = None
    aws_secret_access_key: SecretStr | None = None
    aws_session_token: SecretStr | None = None
    aws_credentials_block: str | None = Field(None, description="prefect-aws AwsCredentials block with the AWS keys "
                                                                "(wins over the Secret blocks and the aws_* keys)")
    aws_access_key_id_block: str | None = Field(None, description="Prefect Secret block holding the AWS access key id")
    aws_secret_access_key_block: str | None = Field(None, description="Prefect Secret block holding the AWS secret key")


def infra_default(name: str) -> Any:
    """The default of the infra setting `name` (`JEX_INFRA__*`): the machine policy's and the budget
    projection's (`infra/machine.py: Policy`, `flows/budget.py: BudgetSpec`), declared once here."""
    return InfraSettings.model_fields[name].default


class PrefectSettings(BaseModel):
    api_url: str | None = Field(None, description="Prefect API the CLI's flows report to (PREFECT_API_URL "
                                                  "wins); None = a jex server's or Prefect's local API")
    database_url: SecretStr | None = None
    budget_cron: str = Field("0 3 * * *", validation_alias=AliasChoices("budget_cron", "calibration_cron"),
                             description="Cron of the scheduled budget projection (`jex calibrate`); "
                                         "JEX_PREFECT__CALIBRATION_CRON, its older name, is accepted")
    reconcile_every_s: float = Field(900.0, gt=0, description="Interval of the scheduled reconcile")
    host: str = Field("127.0.0.1", description="Address the server binds; anything but loopback needs auth_string")
    port: int = 4200
    auth_string: SecretStr | None = Field(None, description="'user:password' of the server's basic authentication "
                                                            "(Prefect's server.api.auth_string); sent by every client")
    notify_block: str | None = Field(None, description="Prefect notification block ('type-slug/name', e.g. "
                                                       "'custom-webhook/jex-alerts') told of every failed campaign")


class EngineSettings(EngineSpec):
    """The campaign's engine defaults (`JEX_ENGINE__*`), and the one secret an engine reads: a served model's
    API key (`JEX_ENGINE__API_KEY`), which no campaign spec, record or log holds (`engine_spec()` leaves it out)."""

    api_key: SecretStr | None = Field(None, description="openai: the served model's API key (or name the variable "
                                                        "that holds it in JEX_ENGINE__API_KEY_ENV)")

    def engine_spec(self) -> dict[str, Any]:
        """The engine spec's fields, without the key."""
        return self.model_dump(exclude={"api_key"})


class JexSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="JEX_", env_nested_delimiter="__", env_file=".env",
                                      env_file_encoding="utf-8", extra="ignore")

    engine: EngineSettings = Field(EngineSettings(), description="The campaign's engine defaults (`JEX_ENGINE__*`); "
                               "the --spec file, flags and the form override them field by field")
    store: StoreSettings = StoreSettings()
    infra: InfraSettings = InfraSettings()
    prefect: PrefectSettings = PrefectSettings()
    bootstrap_draws: int = Field(BOOTSTRAP_DRAWS, ge=1)
    bootstrap_seed: int = Field(BOOTSTRAP_SEED, ge=0)

    def public_dict(self) -> dict[str, Any]:
        """Settings with every secret field removed: safe for logs, artifacts and provenance."""
        return _drop_secrets(self)


def _drop_secrets(model: BaseModel) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, SecretStr):
            continue
        out[name] = _drop_secrets(value) if isinstance(value, BaseModel) else (
            str(value) if isinstance(value, Path) else value)
    return out


def load_settings(**overrides: Any) -> JexSettings:
    """The settings; a malformed `JEX_*` variable or `.env` file is a `SettingsError` naming it."""
    settings, problems = settings_and_problems(**overrides)
    if problems:
        raise problems[0]
    return settings


def settings_and_problems(**overrides: Any) -> tuple[JexSettings, list[SettingsError]]:
    """The settings with every malformed variable left out (a `.env` that cannot be read: the whole
    file), and one `SettingsError` per variable left out: what `jex config show` prints."""
    problems: list[SettingsError] = []
    env_file: str | None = ".env"
    skipped: dict[str, str] = {}
    try:
        for _ in range(len(os.environ) + 2):
            try:
                return JexSettings(_env_file=env_file, **overrides), problems
            except (UnicodeDecodeError, OSError) as e:
                problems.append(SettingsError(f"cannot read the settings file: {_reason(e)}", file=".env"))
                env_file = None
            except (ValidationError, PydanticSettingsError) as e:
                name, problem = _culprit(e)
                problems.append(problem)
                if name in os.environ:
                    skipped[name] = os.environ.pop(name)
                elif env_file is not None:
                    env_file = None  # the variable is in .env: leave the file out
                else:
                    break
        return JexSettings(_env_file=None), problems
    finally:
        os.environ.update(skipped)


def _reason(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 ({e.reason} at byte {e.start})"
    return getattr(e, "strerror", None) or str(e)


def _culprit(e: ValidationError | PydanticSettingsError) -> tuple[str, SettingsError]:
    """The variable a settings error comes from, and the error naming it."""
    if isinstance(e, ValidationError):
        first = e.errors()[0]
        name = "JEX_" + "__".join(str(p) for p in first["loc"]).upper()
        if first["type"] == "extra_forbidden":
            return name, SettingsError(f"unknown setting{_closest(name)}", field=name)
        return name, SettingsError(f"{first['msg']} (got {str(first.get('input'))[:80]!r})", field=name)
    section = e.args[0].split('"')[1] if '"' in e.args[0] else ""
    prefix = f"JEX_{section.upper()}"
    names = sorted(n for n in os.environ if n.upper() == prefix or n.upper().startswith(prefix + "__"))
    for name in names:
        try:
            json.loads(os.environ[name])
        except ValueError:
            if not _plain_text_field(name):
                return name, SettingsError(f"not valid JSON (got {os.environ[name][:80]!r}); a list or table "
                                           "setting is JSON, e.g. '[\"h1\", \"h2\"]'", field=name)
    name = names[0] if names else prefix + "__*"
    return name, SettingsError(f"cannot parse the value: {e}", field=name)


def _closest(name: str) -> str:
    """'; did you mean JEX_...?' for a misspelt variable whose section is known, else ''."""
    from jex.engine_spec import closest_name

    *section, leaf = name.lower().removeprefix("jex_").split("__")
    model: Any = JexSettings
    for part in section:
        model = getattr(model, "model_fields", {}).get(part)
        model = model.annotation if model is not None else None
    fields = sorted(getattr(model, "model_fields", {}))
    best = closest_name(leaf, fields) if fields else None
    return f"; did you mean {name.rsplit('__', 1)[0]}__{best.upper()}?" if best else ""


def _plain_text_field(name: str) -> bool:
    """Whether variable `name` sets a scalar field (its value needs no JSON)."""
    model: Any = JexSettings
    for part in name.lower().removeprefix("jex_").split("__"):
        fields = getattr(model, "model_fields", {})
        if part not in fields:
            return True
        model = fields[part].annotation
    return not (isinstance(model, type) and issubclass(model, BaseModel)) and "list" not in str(model) and \
        "dict" not in str(model)
