"""The `jex` command line (typer). Each command is a thin shell over a function in a room."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from jex.cli import interop as cli_interop
from jex.cli.experiment import experiment_app
from jex.cli.probe import probe_app
from jex.cli.store import resume_from_s3, store_app
from jex.cli.suite import import_app, suite_ls, suite_validate
from jex.engine.types import EngineDeadError, EngineError
from jex.errors import InputError, JexError
from jex.settings import load_settings

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="jex: reproducible LLM benchmark campaigns.")
suite_app = typer.Typer(no_args_is_help=True, help="Suites: import, validate, list, and the sample generator.")
bundle_app = typer.Typer(no_args_is_help=True, help="Bundles: deterministic archives of a suite.")
config_app = typer.Typer(no_args_is_help=True, help="Settings (JEX_* variables and .env).")
app.add_typer(suite_app, name="suite")
app.add_typer(bundle_app, name="bundle")
app.add_typer(config_app, name="config")
server_app = typer.Typer(no_args_is_help=True, help="The orchestrator's Prefect server, worker and deployments.")
app.add_typer(server_app, name="server")
infra_app = typer.Typer(no_args_is_help=True, help="Machines: reconcile, ledger, providers.")
app.add_typer(infra_app, name="infra")
stage_app = typer.Typer(no_args_is_help=True, help="Run one engine stage without Prefect (what a GPU worker runs).")
app.add_typer(stage_app, name="stage")
overlays_app = typer.Typer(no_args_is_help=True, help="Overlays on a finished run: mine, gate, ladder.")
app.add_typer(overlays_app, name="overlays")
app.add_typer(experiment_app, name="experiment")
app.add_typer(store_app, name="store")
suite_app.add_typer(import_app, name="import")
app.add_typer(probe_app, name="probe")
suite_app.command("validate")(suite_validate)
suite_app.command("ls")(suite_ls)
cli_interop.register(app)  # jex show, jex export inspect|lm-eval


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(2)


def _check_hub_model(model: str | None) -> None:
    """Offline, a Hub id must be in the local cache: say so before any flow or engine starts. (Online,
    the machine that runs the engine downloads it: the orchestrator never fetches weights it won't use.)"""
    from huggingface_hub import constants

    from jex.engine.models import HUB_ID, resolve_hub

    if model and constants.HF_HUB_OFFLINE and not Path(model).exists() and HUB_ID.match(model):
        try:
            resolve_hub(model)
        except EngineDeadError as e:
            raise JexError(str(e)) from None


def render_spec_from(path: Path | None, *, chat_template: str, system_prompt: str | None, num_fewshot: int):
    """A RenderSpec from a TOML file (any field), then the command-line flags that were given."""
    import tomllib

    from pydantic import ValidationError

    from jex.engine.render import RenderSpec

    fields: dict = {}
    if path is not None:
        try:
            fields = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read the render file: {e}", file=str(path)) from None
    if chat_template not in ("auto", "none"):
        template = Path(chat_template)
        if not template.is_file():
            raise InputError("--chat-template: neither auto, none nor a readable Jinja file", file=chat_template)
        fields["chat_template"] = template.read_text(encoding="utf-8")
    elif chat_template != "auto" or "chat_template" not in fields:
        fields["chat_template"] = chat_template
    if system_prompt is not None:
        fields["system_prompt"] = system_prompt
    if num_fewshot:
        fields["num_fewshot"] = num_fewshot
    try:
        return RenderSpec.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise InputError(err["msg"].removeprefix("Value error, "), file=str(path) if path else None,
                         field=".".join(str(p) for p in err["loc"]) or None) from None


@suite_app.command("sample")
def suite_sample(out: Annotated[Path, typer.Option("-o", "--out", help="Suite folder to write")],
                 rows: Annotated[int, typer.Option(help="Total rows over all catalogs")] = 360,
                 seed: Annotated[int, typer.Option(help="Generator seed")] = 0) -> None:
    """Write the embedded sample suite (deterministic for a given --rows and --seed)."""
    from jex.sample_suite import write_sample_suite

    try:
        typer.echo(write_sample_suite(out, rows=rows, seed=seed))
    except (JexError, ValueError) as e:
        _fail(e)


@bundle_app.command("build")
def bundle_build(suite: Annotated[Path, typer.Argument(help="Suite folder (holds suite.toml)")],
                 out: Annotated[Path, typer.Option("-o", "--out", help="Bundle file (.tar.gz)")],
                 reference: Annotated[Path | None, typer.Option(help="Banked capture, 1:1 on run_id")] = None,
                 shard_rows: Annotated[int, typer.Option(help="Rows per Parquet shard")] = 16384) -> None:
    """Stream a suite into a byte-reproducible bundle; prints its sha256."""
    from jex.tasks.capture.bundle import build_bundle

    try:
        result = build_bundle(suite, out, reference=reference, shard_rows=shard_rows)
    except JexError as e:
        _fail(e)
    typer.echo(f"{result.sha256}  {result.path}  ({result.rows} rows)")


@app.command("score")
def score(out: Annotated[Path, typer.Option("-o", "--out", help="Folder for score.json and score.md")],
          suite: Annotated[Path | None, typer.Option(help="Suite folder or bundle file (optional with --from)")] = None,
          predictions: Annotated[Path | None, typer.Option(help="JSONL or Parquet: run_id, choice[, probs]")] = None,
          bootstrap: Annotated[int, typer.Option(help="Bootstrap draws")] = 2000,
          seed: Annotated[int, typer.Option(help="Bootstrap seed")] = 20260929,
          source: Annotated[Path | None, typer.Argument(help="--from: lm-eval samples file or output folder, or an "
                                                             "Inspect log")] = None,
          from_: Annotated[str | None, typer.Option("--from", help="lm-eval | inspect: score that tool's output "
                                                                   "(docs/bring-your-own.md)")] = None,
          map_by: Annotated[str, typer.Option(help="--from: auto | doc_id | id | content")] = "auto",
          id_field: Annotated[str | None, typer.Option(help="--from: the documents' id field")] = None) -> None:
    """Score predictions twice (vectorised and plain), with clustered bootstrap intervals."""
    from jex.tasks.scoring.score import score_files

    if from_ is not None:  # another tool's per-document output (jex/cli/interop.py)
        return cli_interop.score_from(from_, source, out=out, suite=suite, draws=bootstrap, seed=seed, map_by=map_by,
                                      id_field=id_field)
    try:
        if suite is None or predictions is None:
            raise JexError("--suite and --predictions are both needed (or --from lm-eval|inspect SOURCE)")
        doc = score_files(suite, predictions, out, draws=bootstrap, seed=seed,
                          settings=load_settings().public_dict())
    except JexError as e:
        _fail(e)
    lo, hi = doc["ci"]
    typer.echo(f"full {doc['full']:.4f}  95% CI [{lo:.4f}, {hi:.4f}]  -> {out / 'score.json'}")


@app.command("run")
def run(suite: Annotated[Path | None, typer.Option(help="Suite folder (default: the embedded sample)")] = None,
        model: Annotated[str | None, typer.Option(help="Model folder, GGUF, or Hub id org/name[@revision] (default: "
                                                       "embedded SmolLM2)")] = None,
        coverage: Annotated[float, typer.Option(help="Share of rows gated for a rationale")] = 0.10,
        out: Annotated[Path, typer.Option(help="Folder for run folders")] = Path("runs"),
        store: Annotated[Path | None, typer.Option(help="Artifact store (default: OUT/store)")] = None,
        engine: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf",
        device: Annotated[str, typer.Option(help="cpu, cuda, cuda:1 ...")] = "cpu",
        batch_size: Annotated[int, typer.Option(help="Requests per engine call (hf-batched, vllm)")] = 8,
        overlays: Annotated[Path | None, typer.Option(help="Overlay rule file (TOML)")] = None,
        name: Annotated[str, typer.Option(help="Campaign name")] = "sample",
        shard_rows: Annotated[int, typer.Option(help="Rows per fast-pass shard")] = 32,
        reason_max_tokens: Annotated[int, typer.Option(help="Rationale length limit")] = 48,
        provider: Annotated[str | None, typer.Option(help="Where engine stages run: inprocess | local | ssh | ec2 | "
                                                          "command (default: settings, 'local')")] = None,
        host: Annotated[list[str] | None, typer.Option(help="ssh provider: host (repeatable)")] = None,
        workers: Annotated[int, typer.Option(help="Machines sharing each engine stage")] = 1,
        budget_usd: Annotated[float | None, typer.Option(help="Campaign machine budget (default: settings)")] = None,
        resume: Annotated[Path | None, typer.Option(help="Continue the campaign of this run folder")] = None,
        chat_template: Annotated[str, typer.Option(help="auto (the model's; plain text if it has none) | none | "
                                                        "a Jinja template FILE")] = "auto",
        system_prompt: Annotated[str | None, typer.Option(help="System turn before every question")] = None,
        num_fewshot: Annotated[int, typer.Option(help="Solved examples before each question (the catalogs' "
                                                      "few-shot rows)")] = 0,
        render: Annotated[Path | None, typer.Option(help="TOML with any RenderSpec field (question_template, "
                                                         "reason_template, option_format, answer_slot, ...)")] = None,
        dtype: Annotated[str | None, typer.Option(help="Weights dtype (default: JEX_ENGINE__DTYPE, else the "
                                                       "engine's)")] = None,
        gpu_memory_utilization: Annotated[float | None, typer.Option(
            help="vLLM: share of GPU memory (default: JEX_ENGINE__GPU_MEMORY_UTILIZATION, 0.30)")] = None,
        max_model_len: Annotated[int | None, typer.Option(help="vLLM: context limit (default: "
                                                               "JEX_ENGINE__MAX_MODEL_LEN, the model's)")] = None,
        engine_profile: Annotated[str, typer.Option(help="audit | audit-ngram (n-gram speculative decoding, kept "
                                                         "only when this run proves it token-exact)")] = "audit",
        spec_proof_rows: Annotated[int, typer.Option(help="Gated rows re-generated by the audited base to prove a "
                                                          "speculative profile")] = 64,
        reference: Annotated[Path | None, typer.Option(help="Reference rows (run_id, choice, probs) of an earlier "
                                                            "run: audit this run against them")] = None,
        reference_min_agreement: Annotated[float | None, typer.Option(help="Fail below this final agreement "
                                                                          "with the reference")] = None,
        require_zero_errors: Annotated[bool, typer.Option(help="Fail unless every error counter is zero")] = False,
        reason_shard_rows: Annotated[int, typer.Option(help="Rows per reason shard")] = 8,
        max_num_seqs: Annotated[int, typer.Option(help="vLLM: sequences per scheduler step")] = 32,
        max_num_batched_tokens: Annotated[int | None, typer.Option(help="vLLM: tokens per scheduler step "
                                                                        "(default: vLLM's)")] = None,
        engine_hosts: Annotated[bool, typer.Option(help="One engine process per machine slot serves every job "
                                                        "of the machine (off: each job loads its own)")] = True,
        gpus_per_machine: Annotated[int, typer.Option(help="GPUs of each machine")] = 1,
        engines_per_gpu: Annotated[int, typer.Option(help="Engine processes per GPU, each a data-parallel "
                                                          "worker (small models)")] = 1,
        ) -> None:
    """Run a whole campaign (embedded defaults: sample suite, SmolLM2, local Prefect, local store).

    The last line printed is the run folder.
    """
    from jex.flows.local_api import ensure_local_api

    ensure_local_api()
    from jex.flows.campaign import CampaignSpec, load_spec, run_campaign
    from jex.flows.fleet import GoldenMismatch, JobFailed, MachinesSpec
    from jex.infra.ledger import BudgetExceeded
    from jex.tasks.capture.engine_pool import EngineSpec

    settings = load_settings()
    machines = MachinesSpec(provider=provider or settings.infra.provider, hosts=host or [], workers=workers,
                            budget_usd=budget_usd, engine_hosts=engine_hosts, gpus_per_machine=gpus_per_machine,
                            engines_per_gpu=engines_per_gpu)
    if resume is not None:
        resume_from_s3(resume)
        spec = load_spec(resume).model_copy(update={"machines": machines} if provider else {})
    else:
        try:
            _check_hub_model(model or settings.engine.model)
            render_spec = render_spec_from(render, chat_template=chat_template, system_prompt=system_prompt,
                                           num_fewshot=num_fewshot)
            es = settings.engine
            engine_spec = EngineSpec(kind=engine, model=model or es.model, device=device, batch_size=batch_size,
                                     dtype=dtype or es.dtype, render=render_spec,
                                     gpu_memory_utilization=gpu_memory_utilization or es.gpu_memory_utilization,
                                     max_model_len=max_model_len or es.max_model_len, profile=engine_profile,
                                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        except (JexError, ValueError) as e:
            _fail(e)
        spec = CampaignSpec(name=name, suite=str(suite) if suite else None, coverage=coverage,
                            engine=engine_spec,
                            overlays=str(overlays) if overlays else None, out=str(out),
                            fast_shard_rows=shard_rows, reason_shard_rows=reason_shard_rows,
                            reason_max_tokens=reason_max_tokens,
                            spec_proof_rows=spec_proof_rows, store=str(store or out / "store"), machines=machines,
                            reference=str(reference) if reference else None,
                            reference_min_agreement=reference_min_agreement, require_zero_errors=require_zero_errors)
    try:
        run_dir = run_campaign(spec)
    except (JexError, EngineError, EngineDeadError, GoldenMismatch, JobFailed, BudgetExceeded) as e:
        _fail(e)
    typer.echo(run_dir)


@app.command("calibrate")
def calibrate_cmd(coverage: Annotated[float, typer.Option(help="Coverage gated within the sample")] = 0.30,
                  sample_every: Annotated[int, typer.Option(help="Sample ~1/k of every catalog's questions")] = 4,
                  target_rows: Annotated[int | None, typer.Option(help="Rows to project for")] = None,
                  price: Annotated[float | None, typer.Option(help="$ per GPU-hour (default: settings)")] = None,
                  budget_hours: Annotated[float | None, typer.Option(help="default: settings")] = None,
                  budget_usd: Annotated[float | None, typer.Option(help="default: settings")] = None,
                  suite: Annotated[Path | None, typer.Option(help="Suite folder (default: embedded)")] = None,
                  out: Annotated[Path, typer.Option(help="Folder for run folders")] = Path("runs")) -> None:
    """Measure reasoning cost and fix rate on a stratified sample; project time and cost per coverage."""
    from jex.flows.local_api import ensure_local_api

    ensure_local_api()
    from jex.flows.calibration import CalibrationSpec, calibration
    from jex.flows.campaign import CampaignSpec

    infra = load_settings().infra
    spec = CalibrationSpec(campaign=CampaignSpec(suite=str(suite) if suite else None, out=str(out),
                                                 store=str(out / "store")),
                           coverage=coverage, sample_every=sample_every, target_rows=target_rows,
                           price_per_gpu_hour=infra.price_per_hour if price is None else price,
                           budget_hours=infra.budget_hours if budget_hours is None else budget_hours,
                           budget_usd=infra.budget_usd if budget_usd is None else budget_usd)
    doc = calibration(spec)
    typer.echo(f"recommended coverage: {doc['projection']['recommended_coverage']}")


@app.command("bakeoff")
def bakeoff(out: Annotated[Path, typer.Option("-o", "--out", help="Folder for bakeoff.json/.md/.png")],
            arms: Annotated[str, typer.Option(help="Comma-separated arms (hf-bi, hf-bi-ngram, hf-control, vllm-bi, "
                                                   "vllm-bi-ngram, "
                                                   "vllm-bi-fdo, vllm-control)")] = "hf-control,hf-bi",
            model: Annotated[str | None, typer.Option(help="Model folder (default: embedded)")] = None,
            prompts: int = 32, tokens: int = 256, ladder: str = "1,8,16,32", repeats: int = 2,
            max_num_seqs: int = 32, device: str = "cpu") -> None:
    """Batch-invariance bake-off: the ladder for an invariant arm and a control arm, each in its own process."""
    from jex.tasks.lab.bakeoff import run_bakeoff

    res = run_bakeoff(arms.split(","), model=model, prompts=prompts, tokens=tokens,
                      ladder=[int(x) for x in ladder.split(",")], repeats=repeats, max_num_seqs=max_num_seqs,
                      device=device, out_dir=out)
    typer.echo(res["verdict"])
    if res["errors"]:
        _fail(JexError(f"arms failed: {res['errors']}"))


@app.command("parity")
def parity(suite: Annotated[Path, typer.Option(help="Suite folder")],
           out: Annotated[Path, typer.Option("-o", "--out", help="Folder for parity.json and parity.md")],
           engine_a: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf",
           engine_b: Annotated[str, typer.Option(help="hf | hf-batched | vllm | vllm-control")] = "hf-batched",
           model: Annotated[str | None, typer.Option(help="Model folder (default: embedded)")] = None,
           rows: Annotated[int, typer.Option(help="Rows to read (0 = all)")] = 0,
           reason_rows: Annotated[int, typer.Option(help="Rows for generation parity")] = 0,
           max_tokens: int = 96, device: str = "cpu", batch_size: int = 8,
           reference: Annotated[Path | None, typer.Option(help="Stored capture (capture.parquet or reference "
                                                          "rows): engine A against it, no engine B")] = None) -> None:
    """Parity of two engines on the same rows: readout agreement, |dp|, flips; choices after a rationale."""
    if reference is not None:
        from jex.tasks.lab.parity import capture_parity_files

        try:
            r = capture_parity_files(suite, reference, out, kind=engine_a, model=model, device=device,
                                     batch_size=batch_size, rows=rows)["readout"]
        except (JexError, ValueError, EngineError, EngineDeadError) as e:
            _fail(e)
        typer.echo(f"argmax agreement {r['agree']}/{r['common']}, max |dp| {r['max_abs_dp']:.3g} -> {out}")
        return
    from jex.flows.local_api import ensure_local_api

    ensure_local_api()
    from jex.flows.experiments import parity as parity_flow

    try:
        r = parity_flow(suite=str(suite), engine_a=engine_a, engine_b=engine_b, model=model, rows=rows,
                        reason_rows=reason_rows, max_tokens=max_tokens, device=device, batch_size=batch_size,
                        out=str(out))
    except (JexError, ValueError, EngineError, EngineDeadError) as e:
        _fail(e)
    typer.echo(f"argmax agreement {r['agree']}/{r['common']}, max |dp| {r['max_abs_dp']:.3g} -> {out}")


def _use_running_server() -> None:
    """Talk to the server `jex server start` recorded, unless PREFECT_API_URL says otherwise."""
    import os

    from jex.deployments.server import client_env, healthy, state_file

    for k, v in client_env(load_settings()).items():  # basic auth of the server, when it has one
        os.environ.setdefault(k, v)
    sf = state_file(load_settings())
    if not os.environ.get("PREFECT_API_URL") and sf.exists():
        url = json.loads(sf.read_text())["api_url"]
        if healthy(url):
            os.environ["PREFECT_API_URL"] = url


@server_app.command("start")
def server_start(port: Annotated[int | None, typer.Option(help="default: settings (4200)")] = None,
                 host: Annotated[str | None, typer.Option(help="Bind address (default: settings, 127.0.0.1); not "
                                                               "loopback needs JEX_PREFECT__AUTH_STRING")] = None,
                 database_url: Annotated[str | None, typer.Option(help="PostgreSQL URL, e.g. postgresql+asyncpg://"
                                                                       "postgres@127.0.0.1:5432/test (default: "
                                                                       "SQLite)")] = None,
                 defaults: Annotated[Path | None, typer.Option(help="JSON: default campaign form values")] = None,
                 worker: Annotated[bool, typer.Option(help="Start the process worker too")] = True) -> None:
    """Start the Prefect server on 127.0.0.1, register the deployments and automation, start the worker."""
    from jex.deployments.server import ServerError, start

    over: dict = {}
    if port:
        over["port"] = port
    if host:
        over["host"] = host
    if database_url:
        over["database_url"] = database_url
    settings = load_settings()
    if over:
        settings = settings.model_copy(update={"prefect": settings.prefect.model_copy(update=over)})
    try:
        state = start(settings, campaign_defaults=json.loads(defaults.read_text()) if defaults else None,
                      worker=worker)
    except ServerError as e:
        _fail(e)
    typer.echo(f"Prefect UI: {state['ui_url']}  (API {state['api_url']}, {state['database']})")
    typer.echo(f"deployments: {', '.join(k for k in state['deployments'] if k != 'automation')}; "
               f"work pool {state['pool']}; PIDs {state['pids']}")
    typer.echo(f"export PREFECT_API_URL={state['api_url']}")


@server_app.command("stop")
def server_stop() -> None:
    """Stop exactly the processes `jex server start` started (by their process groups)."""
    from jex.deployments.server import stop

    pids = stop(load_settings())
    typer.echo(f"stopped {pids}" if pids else "no jex server recorded")


@app.command("runs")
def runs_cmd(limit: Annotated[int, typer.Option(help="Newest N campaign runs")] = 20,
             as_json: Annotated[bool, typer.Option("--json", help="JSON lines")] = False) -> None:
    """Campaign runs known to the Prefect API: state, index, coverage, machine cost."""
    from jex.flows.history import campaign_runs, format_runs

    _use_running_server()
    rows = campaign_runs(limit)
    typer.echo("\n".join(json.dumps(r) for r in rows) if as_json else format_runs(rows))


@infra_app.command("reconcile")
def infra_reconcile(provider: Annotated[str | None, typer.Option(help="default: settings")] = None,
                    campaign: Annotated[str | None, typer.Option(help="Only this campaign's machines")] = None) -> None:
    """Supervise, collect and delete every machine the provider tags as jex's (after a restart, or scheduled)."""
    from jex.flows.local_api import ensure_local_api
    from jex.flows.reconcile import reconcile_flow

    ensure_local_api()
    report = reconcile_flow(provider=provider, campaign=campaign)
    for m in report["machines"]:
        typer.echo(f"{m['machine']} ({m['campaign'] or 'no campaign'}): {m.get('action')}, jobs "
                   f"{[(j['job'], j['status']) for j in m['jobs']]}, deleted after "
                   f"{(m.get('teardown') or {}).get('attempts')} attempt(s)")
    typer.echo(f"{len(report['machines'])} machine(s) reconciled, {len(report['errors'])} error(s)")
    if report["errors"]:
        raise typer.Exit(1)


@infra_app.command("ledger")
def infra_ledger(campaign: Annotated[str | None, typer.Option(help="Only this campaign")] = None) -> None:
    """Every machine's life in seconds, its price and cost, and the running total."""
    from jex.infra.ledger import Ledger

    report = Ledger(Path(load_settings().infra.state_dir) / "ledger.json").report(campaign)
    for m in report["machines"]:
        typer.echo(f"{m['machine_id']:<28} {m['campaign'] or '-':<28} {m['seconds']:>9.1f} s "
                   f"${m['cost_usd']:>9.4f}  {m['end_reason'] or 'running'}")
    typer.echo(f"total ${report['total_usd']:.4f} over {report['machine_seconds']:.0f} machine-seconds")


EngineHostOption = Annotated[Path | None, typer.Option(
    "--engine-host", help="Serve the engine work from this machine's long-lived engine hosts (one per slot) "
                          "instead of loading an engine in this process")]
HostRequestsOption = Annotated[int, typer.Option(
    "--host-requests", help="With --engine-host: requests a host it starts serves before it exits (0 = any; "
                            "1 = each job loads its own engine)")]


@stage_app.command("golden")
def stage_golden(args_file: Annotated[Path, typer.Option("--args", help="JSON: bundle, engine, store")],
                 rows: Annotated[int, typer.Option(help="Rows from the head of the bundle")] = 64,
                 out: Annotated[Path, typer.Option(help="Readout Parquet")] = Path("golden.parquet"),
                 fingerprint_out: Annotated[Path, typer.Option("--fingerprint")] = Path("fingerprint.json"),
                 engine_host: EngineHostOption = None, host_requests: HostRequestsOption = 0,
                 compile_cache_in: Annotated[Path | None, typer.Option(
                     help="With --engine-host: an earlier machine's compile cache, unpacked before the first "
                          "engine start")] = None,
                 compile_cache_out: Annotated[Path | None, typer.Option(
                     help="With --engine-host: write this machine's packed compile cache here")] = None,
                 devices: Annotated[str | None, typer.Option(help="With --engine-host: CUDA_VISIBLE_DEVICES of "
                                                                 "the engine host")] = None) -> None:
    """Pre-flight golden replay on a machine: read out the bundle's first rows; record the engine fingerprint."""
    from jex.tasks.capture.engine_host import (
        HostRequest,
        absolute_args,
        bring_compile_cache,
        run_request,
        take_compile_cache,
    )

    request = HostRequest(job="golden", args=absolute_args(json.loads(args_file.read_text()), Path.cwd()),
                          golden_rows=rows, golden_out=str(out.resolve()),
                          fingerprint_out=str(fingerprint_out.resolve()))
    if engine_host and compile_cache_in:
        bring_compile_cache(engine_host.resolve(), compile_cache_in)
    run_request(request, engine_host, max_requests=host_requests, devices=devices.split(",") if devices else None)
    if engine_host and compile_cache_out and take_compile_cache(engine_host.resolve(), compile_cache_out):
        typer.echo(f"compile cache -> {compile_cache_out}")
    typer.echo(f"golden replay: {rows} rows -> {out}")


@stage_app.command("run")
def stage_run(stage: Annotated[str, typer.Argument(help="fast_pass | reason")],
              args_file: Annotated[Path, typer.Option("--args", help="JSON: bundle, engine, store, shard_rows[, gate, "
                                                                      "max_tokens]")],
              worker: Annotated[int, typer.Option(help="This worker's index")] = 0,
              workers: Annotated[int, typer.Option(help="Number of workers sharing the stage")] = 1,
              engine_host: EngineHostOption = None, host_requests: HostRequestsOption = 0,
              slots: Annotated[int, typer.Option(help="With --engine-host: engine hosts sharing this worker's "
                                                      "shards, each claiming the next free one")] = 1,
              devices: Annotated[str | None, typer.Option(help="With --engine-host: CUDA_VISIBLE_DEVICES of each "
                                                              "slot, comma-separated")] = None) -> None:
    """Compute this worker's shards of an engine stage into the store (shards w, w+N, ...)."""
    from jex.tasks.capture.engine_host import HostRequest, absolute_args, run_request

    if stage not in ("fast_pass", "reason"):
        raise typer.BadParameter(f"unknown engine stage {stage!r}; expected fast_pass or reason")
    request = HostRequest(job=stage, args=absolute_args(json.loads(args_file.read_text()), Path.cwd()),
                          worker=worker, workers=workers)
    for summary in run_request(request, engine_host, slots=slots, devices=devices.split(",") if devices else None,
                               max_requests=host_requests):
        typer.echo(json.dumps({k: summary.get(k) for k in ("stage", "key", "rows", "computed_shards", "partial",
                                                           "compute_seconds", "computed_rows")}))


@overlays_app.command("mine")
def overlays_mine(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="Folder for mining.json, candidates.toml")],
                  top: int = 5) -> None:
    """Propose candidate rules where errors are systematic, with their out-of-fold gain."""
    from jex.fileio import write_json, write_text
    from jex.tasks.lab.overlay_lab import candidate_rules_toml, load_capture, mine

    doc = mine(load_capture(run))
    write_json(out / "mining.json", doc)
    write_text(out / "candidates.toml", candidate_rules_toml(doc["candidates"], top=top))
    for c in doc["candidates"][:top]:
        typer.echo(f"{c['catalog']:>14} {c['kind']:<22} oof gain {c['oof_gain_full']:+.3f}")
    typer.echo(out / "candidates.toml")


@overlays_app.command("gate")
def overlays_gate(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                  rules: Annotated[Path, typer.Option(help="Rule file (TOML)")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="Folder for gate-settings.json, gate.json")],
                  alpha: float = 0.05, draws: int = 2000, permutations: int = 200, seed: int = 20260929) -> None:
    """Pre-registered gate: settings hashed first; CI above zero, permutation p < alpha, no-degrade."""
    from jex.overlays import load_rule_file
    from jex.tasks.lab.overlay_lab import GateSettings, gate, load_capture

    try:
        doc = gate(load_capture(run), [r for r in load_rule_file(rules) if r.enabled],
                   GateSettings(alpha=alpha, draws=draws, seed=seed, permutations=permutations), out)
    except JexError as e:
        _fail(e)
    for r in doc["results"]:
        failed = [k for k, v in r["checks"].items() if not v]
        typer.echo(f"{r['rule']['id']}: {'PASS' if r['passed'] else 'FAIL ' + ', '.join(failed)} "
                   f"(gain {r['gain_full']:+.3f}, CI {r['ci_full'][0]:+.3f}..{r['ci_full'][1]:+.3f}, "
                   f"p {r['permutation_p']:.4f})" + (f": {r['no_degrade_error']}" if r["no_degrade_error"] else ""))


@overlays_app.command("ladder")
def overlays_ladder(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                    rules: Annotated[Path, typer.Option(help="Rule file (TOML), applied in declared order")],
                    out: Annotated[Path, typer.Option("-o", "--out", help="Folder for ladder.json, disclosure.md")],
                    gate_record: Annotated[Path | None, typer.Option("--gate", help="gate.json: keep its passes")]
                    = None) -> None:
    """Ladder, leave-one-outs, no-degrade and reversibility checks, and the disclosure sheet."""
    from jex.fileio import write_json, write_text
    from jex.overlays import load_rule_file
    from jex.tasks.lab.overlay_lab import disclosure, ladder, load_capture

    chosen = [r for r in load_rule_file(rules) if r.enabled]
    if gate_record is not None:
        passed = set(json.loads(gate_record.read_text())["passed"])
        chosen = [r for r in chosen if r.id in passed]
    try:
        doc = ladder(load_capture(run), chosen)
    except JexError as e:
        _fail(e)
    write_json(out / "ladder.json", doc)
    write_text(out / "disclosure.md", disclosure(doc, chosen))
    for s in doc["steps"]:
        typer.echo(f"{s['step']:>24} {s['full']:.4f}")
    typer.echo(out / "disclosure.md")


@config_app.command("show")
def config_show() -> None:
    """Print the effective settings; secrets are masked."""
    settings = load_settings()
    typer.echo(json.dumps(json.loads(settings.model_dump_json()), indent=2))


def main() -> None:
    """The console entry (`jex`, `python -m jex`): user errors print one line, never a traceback.

    A `JexError` (bad input, machines, S3, flows, server), invalid parameters (pydantic) and a path
    that does not exist are user errors; anything else is a bug and keeps its traceback.
    `JEX_TRACEBACK=1` shows the traceback of a user error too.
    """
    import os

    from pydantic import ValidationError

    try:
        app()
    except (JexError, ValidationError, FileNotFoundError) as e:
        if os.environ.get("JEX_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
