"""`jex run` and `jex calibrate`: a campaign specified once, run or resumed, or its time and cost projected.

Every CampaignSpec field comes from settings (`jex config show`), then a `--spec campaign.toml`
file, then the flags given (`jex.flows.campaign.campaign_spec`, the path the UI form's defaults
take too). A flag left out is None and changes nothing, so the defaults live in one place.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, cast, get_args, get_origin

import typer
from pydantic.fields import FieldInfo

from jex.cli import preflight
from jex.cli.common import (
    TEMPORARY_API_NOTICE,
    check_field_flags,
    connect_prefect,
    fail,
    field_flags,
    input_error,
    print_path,
    spec_fields,
)
from jex.cli.results import ResultsStyle, print_results
from jex.cli.store import resume_from_s3
from jex.engine_spec import SERVED_PREFIX, ServedSettings, VLLMSettings
from jex.errors import InputError, JexError
from jex.run_records import CAMPAIGN_FILE, STAGE_NAMES, StageName
from jex.settings import JexSettings, load_settings
from jex.tasks.campaign_spec import BudgetSpec, CampaignSpec, settings_variable, spec_field

if TYPE_CHECKING:
    from jex.engine_spec import RenderSpec
    from jex.flows.local_api import TemporaryAPI
    from jex.lab.panel import Panel

CAMPAIGN_FIELD_OF_FLAG = {
    "suite": "suite", "name": "name", "coverage": "coverage", "out": "out", "store": "store",
    "overlays": "overlays", "shard_rows": "fast_shard_rows", "reason_shard_rows": "reason_shard_rows",
    "reason_max_tokens": "reason_max_tokens", "spec_proof_rows": "spec_proof_rows", "reference": "reference",
    "reference_min_agreement": "reference_min_agreement", "require_zero_errors": "require_zero_errors",
    "unverified_overlays": "unverified_overlays",
    "engine": "engine.kind", "model": "engine.model", "device": "engine.device", "batch_size": "engine.batch_size",
    "dtype": "engine.dtype", "engine_profile": "engine.profile",
    **{knob: f"engine.{knob}" for knob in VLLMSettings.knobs()},  # every vLLM knob, as it is named
    **{name: f"engine.{name}" for name in ServedSettings.model_fields},  # and every served-model setting
    "host_stall_s": "machines.host_stall_s",
    "provider": "machines.provider", "host": "machines.hosts", "workers": "machines.workers",
    "budget_usd": "machines.budget_usd", "engine_hosts": "machines.engine_hosts",
    "gpus_per_machine": "machines.gpus_per_machine", "engines_per_gpu": "machines.engines_per_gpu",
    "audit": "machines.audit", "audit_prompts": "machines.audit_prompts", "audit_tokens": "machines.audit_tokens",
    "mlflow_tracking_uri": "mlflow.tracking_uri", "mlflow_experiment": "mlflow.experiment",
}
"""`jex run` flag -> the CampaignSpec field it sets (a dotted path into the `engine` and `machines` tables)."""
GENERATED_FLAGS = {flag: path for flag, path in CAMPAIGN_FIELD_OF_FLAG.items()
                   if path.startswith(("engine.", "machines.", "mlflow.")) and flag not in ("model", "host")}
"""The engine, machine and MLflow flags of `jex run`, generated from their fields (`field_flags`): type, help,
checks."""
HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]+|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?)$")
"""A host name, an IPv4 address or an IPv6 address (bracketed or not)."""



def spec_help(path: str, more: str = "") -> str:
    """The help of the flag that sets the CampaignSpec field at `path`: the field's description (what the
    Prefect form shows), `more` (what only the flag needs), its choices and where its default comes from."""
    field = spec_field(path)
    arms = [a for a in get_args(field.annotation) if a is not type(None)] \
        if get_origin(field.annotation) in (Union, UnionType) else [field.annotation]
    choices = get_args(arms[0]) if len(arms) == 1 and get_origin(arms[0]) is Literal else ()  # `Literal | None` too
    default = field.get_default(call_default_factory=True)
    shown = ({True: "on", False: "off"}[default] if isinstance(default, bool)
             else None if default is None or default == [] else default)
    source = ", else ".join(str(x) for x in (settings_variable(path), shown) if x is not None)
    return (f"{field.description}{more}" + (f" ({' | '.join(choices)})" if choices else "")
            + (f" (default: {source})" if source else ""))


def spec_option(path: str, more: str = "") -> Any:
    """The typer option of the flag that sets the CampaignSpec field at `path` (help from `spec_help`)."""
    return typer.Option(help=spec_help(path, more))


SpecFile = Annotated[Path | None, typer.Option("--spec", help="Campaign TOML: any CampaignSpec field, with [engine], "
                                                               "[engine.render] and [machines] tables; flags override")]
Suite = Annotated[Path | None, spec_option("suite")]
OneModel = Annotated[str | None, spec_option("engine.model")]
Model = Annotated[list[str] | None, spec_option(
    "engine.model", "; given twice or more (or `models = [...]` in the --spec file), one campaign per model on "
                    "the same suite, then their comparison (compare.md: paired intervals, `jex compare`)")]
Coverage = Annotated[float | None, spec_option("coverage")]
Out = Annotated[Path | None, spec_option("out")]
Store = Annotated[Path | None, spec_option("store")]
EngineKind = Annotated[str | None, spec_option("engine.kind")]
Device = Annotated[str | None, spec_option("engine.device")]
Overlays = Annotated[Path | None, spec_option("overlays")]
Name = Annotated[str | None, spec_option("name")]
ShardRows = Annotated[int | None, spec_option("fast_shard_rows")]
ReasonMaxTokens = Annotated[int | None, spec_option("reason_max_tokens")]
Provider = Annotated[str | None, spec_option("machines.provider")]
Hosts = Annotated[list[str] | None, spec_option("machines.hosts", more="; repeat the flag for each host")]
Resume = Annotated[Path | None, typer.Option(help="Continue the campaign of this run folder, from any folder "
                                                  "(its store: the recorded one, OUT/store, or --store)")]
RetryFrom = Annotated[str | None, typer.Option("--retry", help="With --resume: compute STAGE and every later one "
                                                              "again (an engine stage: only its failed rows), as "
                                                              "the retry-stage deployment")]
Recompute = Annotated[bool, typer.Option("--recompute", help="Compute again the stages the run folder records but "
                                                             "no store here holds (refused otherwise)")]
ChatTemplate = Annotated[str | None, spec_option("engine.render.chat_template", more=" (here: a FILE holding it)")]
SystemPrompt = Annotated[str | None, spec_option("engine.render.system_prompt")]
PanelCatalogs = Annotated[str | None, typer.Option(help="ID,ID,...: run on these catalogs of the suite only (a "
                                                        "panel; its share of the full weight is printed, and at "
                                                        "the end its delta projected onto the full index, "
                                                        "RUN/panel.json)")]
PanelShare = Annotated[float | None, typer.Option(help="With --panel-catalogs: the panel's declared share of the "
                                                       "full weight, refused when the computed one differs by "
                                                       "more than 5e-4 (as experiments do)")]
NumFewshot = Annotated[int | None, spec_option("engine.render.num_fewshot")]
Render = Annotated[Path | None, typer.Option(help="TOML with any RenderSpec field (question_template, "
                                                  "reason_template, option_format, answer_slot, ...)")]
SpecProofRows = Annotated[int | None, spec_option("spec_proof_rows")]
Reference = Annotated[Path | None, spec_option("reference")]
ReferenceMin = Annotated[float | None, spec_option("reference_min_agreement")]
ZeroErrors = Annotated[bool | None, spec_option("require_zero_errors")]
Quiet = Annotated[bool, typer.Option("--quiet", help="Print only the run folder (for scripts)")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the results as one JSON object")]
UnverifiedOverlays = Annotated[bool | None, spec_option("unverified_overlays")]
ReasonShardRows = Annotated[int | None, spec_option("reason_shard_rows")]


@field_flags({flag: (spec_field(path), spec_help(path)) for flag, path in GENERATED_FLAGS.items()})
def run(suite: Suite = None, model: Model = None, coverage: Coverage = None, out: Out = None, store: Store = None,
        overlays: Overlays = None, name: Name = None, shard_rows: ShardRows = None,
        reason_max_tokens: ReasonMaxTokens = None, host: Hosts = None,
        resume: Resume = None, chat_template: ChatTemplate = None, system_prompt: SystemPrompt = None,
        num_fewshot: NumFewshot = None, render: Render = None,
        spec_proof_rows: SpecProofRows = None, reference: Reference = None,
        reference_min_agreement: ReferenceMin = None, require_zero_errors: ZeroErrors = None,
        reason_shard_rows: ReasonShardRows = None, spec: SpecFile = None,
        unverified_overlays: UnverifiedOverlays = None, panel_catalogs: PanelCatalogs = None,
        panel_share: PanelShare = None, quiet: Quiet = False,
        as_json: AsJson = False, recompute: Recompute = False, retry: RetryFrom = None, **generated: Any) -> None:
    """Run a whole campaign (embedded defaults: sample suite, SmolLM2, local Prefect, local store).

    Settings first, then --spec FILE, then the flags given. At the end, the results table (the full
    index, legs and catalogs with their intervals); its last line is the run folder (`--quiet`: only
    that line; `--json`: the results as JSON).
    """
    # every option by name, the generated engine and machine flags too (`GENERATED_FLAGS`); one not given is None
    flags = {**dict.fromkeys(GENERATED_FLAGS), **locals(), **generated}
    settings = load_settings()
    try:  # pre-flight: every input checked before Prefect starts or anything is written
        models = given_models(model, spec, served=names_served_engine(flags, settings))
        flags["model"] = models[0] if len(models) == 1 else None
        check_flags(flags, settings)  # the flags' own paths first: no import of the flows room (prefect) needed
        redo = retried_stages(retry, resume)
        campaign = spec_from(settings, spec_file=spec, flags=flags)
        if len(models) > 1:
            check_models(campaign, models, resume=resume, panel_catalogs=panel_catalogs)
        else:
            campaign = checked_campaign(campaign, resume=resume, store=store, redo=redo, recompute=recompute,
                                        keep_machines=flags["provider"] is not None)
    except JexError as e:
        fail(e)
    style: ResultsStyle = "json" if as_json else "quiet" if quiet else "table"
    if len(models) > 1:
        return run_models(campaign, models, settings, style=style, recompute=recompute)
    temporary = connect_prefect(settings, notice=False, ahead=True)  # before Prefect is imported: it reads its
    from jex.flows.local_api import start_temporary_api  # settings once

    api = start_temporary_api() if temporary else None  # it starts while the flows are imported
    panel = None
    try:
        if panel_catalogs and resume is None:  # a resumed run already reads its panel
            campaign, panel = on_panel(campaign, catalog_list(panel_catalogs), declared_share=panel_share)
        run_dir = stored_or_run(campaign, settings, api, recompute=recompute, redo=redo)
        if panel is not None:
            project_panel(Path(run_dir), panel, campaign)
    except JexError as e:  # the engine's errors too
        fail(e)
    print_results(Path(run_dir), style)


def stored_or_run(campaign: CampaignSpec, settings: JexSettings, api: TemporaryAPI | None, *, recompute: bool,
                  redo: list[StageName]) -> Path:
    """The campaign's run folder: with no server to record the run (`api`, the temporary one started ahead), a
    campaign stored in full is found without a flow and the server stopped unanswered; else the flow runs."""
    from jex.flows.campaign import run_campaign, stored_run

    run_dir = stored_run(campaign, settings) if api is not None and not redo else None
    if api is not None:
        if run_dir is not None:
            api.stop()
            return run_dir
        typer.echo(TEMPORARY_API_NOTICE, err=True)
        api.ready()
    return run_campaign(campaign, recompute=recompute, redo=redo)


def given_models(model: list[str] | None, spec: Path | None, *, served: bool = False) -> list[str]:
    """The models of `jex run`: the --model flags (each checked, unless they name a `served` engine's model:
    the server's name for it), else the --spec file's `models` list."""
    for m in [] if served else model or []:
        preflight.model(m)
    return list(dict.fromkeys(model or (spec_file_models(spec) if spec is not None else [])))


def checked_campaign(campaign: CampaignSpec, *, resume: Path | None, store: Path | None, keep_machines: bool,
                     redo: list[StageName], recompute: bool) -> CampaignSpec:
    """The campaign to run, checked: with `resume`, the run folder's own (read where it is, its store found by
    its stages; with S3 configured it may exist only there until now), its machines the flags' when
    `keep_machines`, and its stages held in the store before a server starts."""
    if resume is not None:
        resume_from_s3(resume, store)
        resumed = resumed_spec(resume, store)
        campaign = resumed.model_copy(update={"machines": campaign.machines}) if keep_machines else resumed
        from jex.flows.campaign import check_stages_held

        check_stages_held(campaign, resume.absolute(), redo=redo, recompute=recompute)
    check_campaign(campaign)
    if not campaign.engine.is_served():
        check_hub_model(campaign.engine.model)
    return campaign


def check_models(campaign: CampaignSpec, models: list[str], *, resume: Path | None, panel_catalogs: str | None
                 ) -> None:
    """Pre-flight of a campaign of several models: each one's campaign as `check_campaign` checks one."""
    if resume is not None or panel_catalogs:
        raise InputError("--resume and --panel-catalogs take one model: resume or sample each model's run alone",
                         field="--model")
    for m in models:
        one = campaign.with_model(m)
        check_campaign(one)
        if not one.engine.is_served():
            check_hub_model(one.engine.model)


def run_models(campaign: CampaignSpec, models: list[str], settings: JexSettings, *, style: ResultsStyle,
               recompute: bool = False) -> None:
    """One campaign per model (the models flow), then the comparison printed: `table` (the leaderboard,
    the pairs and the comparison folder last), `quiet` (the folder) or `json` (compare.json)."""
    temporary = connect_prefect(settings, notice=False)
    if temporary:
        typer.echo(TEMPORARY_API_NOTICE, err=True)
    from jex.flows.lab import run_models as models_flow
    from jex.lab.model_comparison import COMPARE_JSON, COMPARE_MD

    try:
        folder = models_flow(campaign, models, recompute=recompute)
    except JexError as e:
        fail(e)
    if style == "json":
        typer.echo((folder / COMPARE_JSON).read_text())
        return
    if style == "table":
        typer.echo((folder / COMPARE_MD).read_text().rstrip())
    typer.echo(str(folder.resolve()))


def retried_stages(stage: str | None, resume: Path | None) -> list[StageName]:
    """`--retry STAGE`: that stage and every later one, computed again (needs `--resume`)."""
    if stage is None:
        return []
    preflight.choice(stage, "--retry", STAGE_NAMES)
    if resume is None:
        raise InputError("--retry needs --resume RUN: the run whose stage is computed again")
    return list(STAGE_NAMES[STAGE_NAMES.index(cast(StageName, stage)):])


def catalog_list(text: str) -> list[str]:
    """`--panel-catalogs ID,ID,...` as a list of catalog ids."""
    return [c.strip() for c in text.split(",") if c.strip()]


def on_panel(campaign: CampaignSpec, catalogs: list[str], *,
             declared_share: float | None = None) -> tuple[CampaignSpec, Panel]:
    """The campaign on the panel of `catalogs` of its suite (`jex.lab.panel.prepare_panel`, the one the
    experiments use, its share checked against `declared_share`), written beside its run folder as
    RUN-panel-suite; and the panel."""
    from jex.lab.panel import prepare_panel
    from jex.tasks.campaign_spec import sample_suite_dir

    run_dir = campaign.run_dir()
    dest = run_dir.with_name(run_dir.name + "-panel-suite")
    panel = prepare_panel(campaign.suite or sample_suite_dir(campaign), dest, catalogs, declared_share=declared_share)
    typer.echo(f"panel {catalogs}: share of the full weight {panel.share:.5f}", err=True)
    return campaign.model_copy(update={"suite": str(panel.suite)}), panel


def project_panel(run_dir: Path, panel: Panel, campaign: CampaignSpec) -> None:
    """RUN/panel.json: the panel run's delta (final minus fast pass) projected onto the full index, as
    experiments project an arm (`jex.lab.panel.panel_projection`); printed on stderr."""
    from jex.fileio import write_json
    from jex.lab.panel import panel_projection

    doc = panel_projection(run_dir, panel, draws=campaign.bootstrap_draws, seed=campaign.bootstrap_seed)
    write_json(run_dir / "panel.json", doc)
    d = doc["projected_full_delta"]
    typer.echo(f"panel share {panel.share:.5f}: the campaign's delta over its fast pass, projected onto the full "
               f"index: {d['delta']:+.3f} (95% CI {d['ci'][0]:+.3f} to {d['ci'][1]:+.3f}) -> {run_dir / 'panel.json'}",
               err=True)


def resumed_spec(run_dir: Path, store: Path | None = None) -> CampaignSpec:
    """The campaign recorded in a run folder's `campaign.json` (named with its field when it is bad), to
    go on with from here: `resume_spec` finds its store (`store`, when given)."""
    from pydantic import ValidationError

    from jex.flows.campaign import resume_spec

    path = run_dir / CAMPAIGN_FILE
    try:
        CampaignSpec.model_validate_json(preflight.text_file(path, "--resume"))
    except ValidationError as e:
        raise input_error(e, file=path, model=CampaignSpec) from None
    return resume_spec(run_dir, store=store)


def check_flags(flags: dict[str, Any], settings: JexSettings) -> None:
    """Pre-flight of the flags given that name paths, models, providers, hosts and numbers (in a
    fraction of a second: the whole campaign is checked again by `check_campaign`)."""
    if not names_served_engine(flags, settings):  # a served model's name is the server's (its /v1/models checks it)
        preflight.model(flags["model"])
    for flag in ("spec", "render"):
        if flags[flag] is not None:
            preflight.existing_file(flags[flag], f"--{flag}")
    if flags["reference"] is not None:
        preflight.rows_file(flags["reference"], "--reference", needs=("run_id", "choice"))
    preflight.rules(flags["overlays"])
    if flags["suite"] is not None:
        preflight.suite(flags["suite"])
    if flags["resume"] is not None:  # with S3, `jex run --resume` first pulls a run folder that is not here
        s3 = settings.store.s3_bucket
        if Path(flags["resume"]).exists() or not s3:
            preflight.existing_dir(flags["resume"], "--resume", holds=None if s3 else CAMPAIGN_FILE)
    for flag in ("out", "store"):
        if flags[flag] is not None:
            preflight.writable_dir(flags[flag], f"--{flag}")
    check_field_flags(flags, {flag: spec_field(path) for flag, path in GENERATED_FLAGS.items()})  # ranges, choices
    check_hosts(flags["host"] or [])
    preflight.share(flags["coverage"], "--coverage")
    for flag in ("shard_rows", "reason_shard_rows", "reason_max_tokens", "spec_proof_rows"):
        preflight.at_least(flags[flag], "--" + flag.replace("_", "-"), 1)


def names_served_engine(flags: dict[str, Any], settings: JexSettings) -> bool:
    """Whether `jex run`'s engine is a served model: by --engine, else the --spec file's [engine] kind, else the
    settings' (JEX_ENGINE__KIND)."""
    if flags["engine"] is not None:
        return bool(flags["engine"] == "openai")
    if flags["spec"] is not None and Path(flags["spec"]).is_file():
        try:
            engine = read_spec_file(flags["spec"]).get("engine")
        except InputError:  # named by its own check
            engine = None
        if isinstance(engine, dict) and "kind" in engine:
            return bool(engine["kind"] == "openai")
    return settings.engine.kind == "openai"


def check_campaign(campaign: CampaignSpec) -> None:
    """Pre-flight of a campaign: its suite, model (and whether it fits the GPU), rule file, reference rows,
    output folders and machines."""
    if campaign.suite:
        preflight.suite(campaign.suite)
    if campaign.engine.is_served():  # the server answers and serves the model: one line before any flow
        from jex.engine.fingerprint import engine_fingerprint

        engine_fingerprint(campaign.engine)
    else:
        preflight.model(campaign.engine.model)
        preflight.local_engine(campaign.engine, campaign.machines.provider)
    preflight.rules(campaign.overlays)
    if campaign.reference:
        preflight.rows_file(campaign.reference, "--reference", needs=("run_id", "choice"))
    preflight.writable_dir(campaign.out, "--out")
    preflight.writable_dir(campaign.store, "--store")
    if campaign.mlflow.tracking_uri:  # logged at the end of the flow: the extra is checked before it starts
        from jex.extras import check_extra

        check_extra("mlflow", "mlflow")
    from jex.infra.instance_catalogue import machine_price, memory_preflight_gpu

    infra = load_settings().infra
    machine_price(infra, campaign.machines.provider, campaign.machines.price_per_hour)  # an unknown type: one line
    gpu_kind, gpu_kinds = memory_preflight_gpu(infra, campaign.machines.provider)
    if warning := preflight.model_fits(campaign.engine, gpu_kind=gpu_kind, gpu_kinds=gpu_kinds,
                                       reason_max_tokens=campaign.reason_max_tokens, suite=campaign.suite):
        typer.echo(f"WARNING: {warning}", err=True)
    for warning in campaign.gpu_warnings():
        typer.echo(f"WARNING: {warning}", err=True)
    preflight.results_survive_poweroff(campaign.machines.provider, load_settings())
    if campaign.machines.provider == "ssh":
        from jex.infra.shell import load_private_key, load_private_key_file

        infra = load_settings().infra
        check_hosts(campaign.machines.hosts or infra.hosts)
        if infra.ssh_private_key_block:
            pass  # a Secret block's key is read by the flow (jex.flows.credentials), once Prefect is connected
        elif infra.ssh_private_key:  # the machines' key, loaded now: a broken one is one line before any flow
            load_private_key(infra.ssh_private_key.get_secret_value(), where="JEX_INFRA__SSH_PRIVATE_KEY")
        elif infra.ssh_key_path:
            load_private_key_file(infra.ssh_key_path)
        for host in campaign.machines.hosts or infra.hosts:
            preflight.reachable(host, infra.ssh_port, "--host")


def check_hosts(hosts: list[str]) -> None:
    """Every `--host` is a host name or an IP address (the user and port are settings: JEX_INFRA__SSH_USER,
    JEX_INFRA__SSH_PORT)."""
    for host in hosts:
        if not HOST.match(host):
            raise InputError(f"--host: expected a host name or an IP address (user and port are the settings "
                             f"JEX_INFRA__SSH_USER and _SSH_PORT), got {host!r}")


def spec_from(settings: JexSettings, *, spec_file: Path | None, flags: dict[str, Any]) -> CampaignSpec:
    """The campaign of `jex run`: settings, then the --spec file, then the flags given."""
    from pydantic import ValidationError

    from jex.tasks.campaign_spec import CampaignSpec, campaign_spec

    layers = []
    try:
        if spec_file is not None:
            layers.append({k: v for k, v in read_spec_file(spec_file).items() if k != "models"})  # spec_file_models
            campaign_spec(settings, *layers)
    except ValidationError as e:
        raise input_error(e, file=spec_file, model=CampaignSpec) from None
    layers.append(spec_fields(flags, CAMPAIGN_FIELD_OF_FLAG))
    render = render_fields(flags["render"], chat_template=flags["chat_template"],
                           system_prompt=flags["system_prompt"], num_fewshot=flags["num_fewshot"])
    if render:
        layers[-1].setdefault("engine", {})["render"] = render
    try:
        return campaign_spec(settings, *layers)
    except ValidationError as e:
        raise input_error(e, model=CampaignSpec) from None


def spec_file_models(path: Path) -> list[str]:
    """The `models = [...]` list of a campaign file (empty when it names none): names, folders, Hub ids, and
    served models as `openai:NAME` or a table `{engine = "openai", model = "NAME", base_url = "URL"}`."""
    models = read_spec_file(path).get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str | dict) for m in models):
        raise InputError("models: expected a list of model names, folders, Hub ids or served-model tables",
                         file=str(path), field="models")
    return [m if isinstance(m, str) else served_model_name(m, path) for m in models]


def served_model_name(table: dict[str, Any], path: Path) -> str:
    """A campaign file's served-model table as the model name `openai:NAME[@BASE_URL]`."""
    if table.get("engine") != "openai" or not isinstance(table.get("model"), str) or \
            set(table) - {"engine", "model", "base_url"} or not isinstance(table.get("base_url", ""), str):
        raise InputError("models: a table names a served model: {engine = \"openai\", model = \"NAME\", base_url "
                         f"= \"URL\"}} (base_url optional), got {table}", file=str(path), field="models")
    return SERVED_PREFIX + table["model"] + (f"@{table['base_url']}" if table.get("base_url") else "")


def read_spec_file(path: Path, flag: str = "--spec") -> dict[str, Any]:
    """The fields of a campaign TOML file (any CampaignSpec field; `[engine]`, `[machines]` tables)."""
    try:
        return preflight.toml_file(path, flag)
    except InputError as e:
        raise InputError(f"cannot read the campaign spec: {str(e).partition(': ')[2]}", file=str(path)) from None


def render_fields(path: Path | None, *, chat_template: str | None, system_prompt: str | None,
                  num_fewshot: int | None) -> dict[str, Any]:
    """The RenderSpec fields of a render TOML file (any field), then of the flags given; checked, so a
    bad file is named with its field."""
    from pydantic import ValidationError

    from jex.engine_spec import RenderSpec

    fields: dict[str, Any] = read_spec_file(path, "--render") if path is not None else {}
    if chat_template is not None and chat_template not in ("auto", "none", "model"):
        if not Path(chat_template).is_file():
            raise InputError("--chat-template: neither auto, model, none nor a readable Jinja file",
                             file=chat_template)
        fields["chat_template"] = preflight.text_file(chat_template, "--chat-template")
    elif chat_template is not None:
        fields["chat_template"] = chat_template
    fields.update({k: v for k, v in (("system_prompt", system_prompt), ("num_fewshot", num_fewshot)) if v is not None})
    try:
        RenderSpec.model_validate(fields)
    except ValidationError as e:
        raise input_error(e, file=path) from None
    return fields


def render_spec_from(path: Path | None, *, chat_template: str = "auto", system_prompt: str | None = None,
                     num_fewshot: int = 0) -> RenderSpec:
    """A RenderSpec from a TOML file (any field), then the given flags ('auto' and 0 keep the file's)."""
    from jex.engine_spec import RenderSpec

    return RenderSpec.model_validate(render_fields(path, chat_template=None if chat_template == "auto" else
                                                   chat_template, system_prompt=system_prompt,
                                                   num_fewshot=num_fewshot or None))


def check_hub_model(model: str | None) -> None:
    """Offline, a Hub id must be in the local cache: say so before any flow or engine starts. (Online,
    the machine that runs the engine downloads it: the orchestrator never fetches weights it won't use.)"""
    from huggingface_hub import constants

    from jex.engine.models import HUB_ID, resolve_hub

    if model and constants.HF_HUB_OFFLINE and not Path(model).exists() and HUB_ID.match(model):
        resolve_hub(model)  # EngineDeadError, a JexError, when it is not in the cache


CALIBRATE_FIELD_OF_FLAG = {"coverage": "coverage", "sample_every": "sample_every", "target_rows": "target_rows",
                           "price": "price_per_gpu_hour", "budget_hours": "budget_hours", "budget_usd": "budget_usd"}
"""`jex calibrate` flag -> the BudgetSpec field it sets (its type, help and checks generated from the field)."""


def budget_field(flag: str) -> FieldInfo:
    return BudgetSpec.model_fields[CALIBRATE_FIELD_OF_FLAG[flag]]


@field_flags({flag: (budget_field(flag), str(budget_field(flag).description)) for flag in CALIBRATE_FIELD_OF_FLAG},
             defaults=True, before="suite")
def calibrate(suite: Suite = None, out: Out = None, provider: Provider = None, **generated: Any) -> None:
    """Project a campaign's time and cost per coverage, and recommend a coverage that fits the budget.

    Measured on a stratified sample (the budget projection; not the campaign's calibrate stage), its
    engine stages on the campaign's machines (`--provider`, as `jex run`).
    """
    settings = load_settings()
    try:  # pre-flight
        if suite is not None:
            preflight.suite(suite)
        if out is not None:
            preflight.writable_dir(out, "--out")
        preflight.choice(provider, "--provider", preflight.PROVIDERS)
        check_field_flags(generated, {flag: budget_field(flag) for flag in CALIBRATE_FIELD_OF_FLAG})
    except JexError as e:
        fail(e)
    connect_prefect(settings)
    from jex.flows.budget import budget_dir, budget_projection, render
    from jex.tasks.campaign_spec import campaign_spec

    campaign = campaign_spec(settings, spec_fields({"suite": suite, "out": out, "provider": provider},
                                                   CAMPAIGN_FIELD_OF_FLAG))
    spec = BudgetSpec(campaign=campaign, **{CALIBRATE_FIELD_OF_FLAG[flag]: value for flag, value in generated.items()
                                            if value is not None})
    doc = budget_projection(spec)
    typer.echo(render(doc).rstrip())  # budget.md: the measure, wall and cost per coverage, the recommendation
    print_path(budget_dir(spec))


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("calibrate")(calibrate)
