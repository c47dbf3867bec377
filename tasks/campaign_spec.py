"""The campaign spec: everything that defines a campaign, the one record settings, `--spec` files, the
command line and the Prefect run form fill (`campaign_spec`). Free of Prefect, so the command line reads its
fields' descriptions and defaults for its help without starting one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from jex.engine_spec import VLLM_MAX_NUM_SEQS, EngineSpec
from jex.fileio import sha256_json
from jex.run_records import CAMPAIGN_FILE
from jex.settings import (
    BOOTSTRAP_DRAWS,
    BOOTSTRAP_SEED,
    GOLDEN_ROWS,
    PROOF_ROWS,
    JexSettings,
    ProviderName,
    infra_default,
)
from jex.tasks.execution.engine_host import HostOptions
from jex.tasks.inputs import (
    FAST_SHARD_ROWS,
    GENERATE_SHARD_ROWS,
    GPU_SHARDS_PER_ENGINE,
    REASON_SHARD_ROWS,
    FastPassInputs,
    GenerateInputs,
    ReasonInputs,
    engine_content,
    file_content,
    gpu_shard_rows,
    suite_content,
)
from jex.tasks.records import BundleSummary, GateSummary

AuditMode = Literal["auto", "always", "off"]
"""Which engines a campaign audits (`MachinesSpec.audit`, flows/machines/audit.py)."""


class MachinesSpec(BaseModel):
    """Where the engine stages run; the campaign form's 'machines' section."""

    model_config = ConfigDict(extra="forbid")
    provider: ProviderName = Field("local", description="inprocess = in this process; others rent machines")
    hosts: list[str] = Field(default_factory=list, description="ssh: hosts to use (empty = settings)")
    workers: int = Field(1, ge=1, description="Machines sharing each engine stage (each with its engine slots)")
    budget_usd: float | None = Field(None, ge=0, description="Campaign cost budget (empty = settings)")
    price_per_hour: float | None = Field(None, ge=0, description="Price of one machine (empty = settings)")
    budget_hours: float | None = Field(None, gt=0, validation_alias=AliasChoices("budget_hours", "wall_budget_hours"),
                                       description="Max life of a machine, hours (empty = settings)")
    heartbeat_timeout_s: float | None = Field(None, gt=0)
    golden_rows: int = Field(GOLDEN_ROWS, ge=1, description="Rows replayed before a machine runs its shards (and "
                                                            "proved first by a speculative profile's proof)")
    golden_tolerance: float = Field(1e-4, ge=0, description="Max |dp| of the golden replay")
    golden_generation_rows: int = Field(8, ge=0, description="Rows whose rationale prompts (a suite of generative "
                                                             "catalogs alone: whose prompts) every machine decodes "
                                                             "greedily before its shards, token for token against "
                                                             "the reference of the same bundle, engine and GPU "
                                                             "models (0: none)")
    golden_generation_tokens: int = Field(32, ge=1, description="New tokens per golden generation row")
    audit: AuditMode = Field("auto", description="Run only with engine settings a stored, powered, passing audit "
                                                 "covers on this kind of machine, stack and model shape, probing them "
                                                 "once on the first machine when none does (flows/machines/audit.py): "
                                                 "auto = vLLM engines (an unproven audit is reported), always = any "
                                                 "engine (an unproven audit refuses the campaign), off = none")
    audit_prompts: int = Field(64, ge=1, description="The audit bake-off's divergence-prone prompts (64: the "
                                                     "size whose control arm diverged on the H200; 32 did not "
                                                     "on an H100, so proved nothing)")
    audit_tokens: int = Field(256, ge=1, description="Tokens the audit bake-off generates per prompt")
    concurrent: bool = Field(True, description="Machines compute at the same time (off: one after another, e.g. "
                                               "workers emulated on one shared GPU)")
    engine_hosts: bool = Field(True, description="One long-lived engine process per slot serves all of a machine's "
                                                 "jobs (golden, fast pass, reason); off: every job loads its own")
    gpus_per_machine: int = Field(1, ge=1, description="GPUs of each machine (one set of engine slots per GPU)")
    engines_per_gpu: int = Field(1, ge=1, description="Engine processes per GPU, each a data-parallel worker; more "
                                                      "than 1 pays off when one engine leaves the GPU idle (small "
                                                      "models); vLLM engines that profile their KV cache start "
                                                      "one after another, others (kv_cache_memory_gib set, the "
                                                      "HF engine) together")
    host_stall_s: float = Field(600.0, gt=0, description="Seconds an engine host may go without finishing a shard "
                                                         "before its job stops it and starts a new one")
    aws_credentials_block: str | None = Field(None, description="prefect-aws AwsCredentials block with the AWS "
                                                                "keys of the machines and the bucket (empty = "
                                                                "settings); only its name is stored")
    fresh_processes: bool = Field(False, description="inprocess: compute the engine stages in fresh local processes "
                                                     "(one per worker) instead of this one (a twin audit's check)")

    @model_validator(mode="after")
    def _slots_need_machines(self) -> MachinesSpec:
        if self.provider == "inprocess" and self.slots > 1:
            raise ValueError(f"engines_per_gpu x gpus_per_machine = {self.slots} engine processes need machines "
                             "(provider local, ssh, ec2 or command); inprocess runs one engine in this process")
        return self

    @property
    def slots(self) -> int:
        """Engine processes per machine of one-GPU engines."""
        return self.gpus_per_machine * self.engines_per_gpu

    def engine_slots(self, engine: EngineSpec | None) -> int:
        """Engine processes per machine of `engine`: `engines_per_gpu` on each group of `tensor_parallel_size`
        GPUs (None: one-GPU engines)."""
        group = engine.tensor_parallel_size if engine is not None else 1
        return self.gpus_per_machine // group * self.engines_per_gpu

    def slot_devices(self, engine: EngineSpec) -> list[str]:
        """Each slot's CUDA_VISIBLE_DEVICES: slot s spans GPU group s // engines_per_gpu, its
        `tensor_parallel_size` GPUs ("0,1" for one engine over two)."""
        group = engine.tensor_parallel_size
        return [",".join(str(s // self.engines_per_gpu * group + g) for g in range(group))
                for s in range(self.engine_slots(engine))]

    def host_options(self, workdir: str, engine: EngineSpec) -> HostOptions:
        """How a machine's jobs hand their engine work to its engine hosts (`jex stage --host-options`)."""
        slots = self.engine_slots(engine)
        devices = self.slot_devices(engine) if engine.device.startswith("cuda") else None
        return HostOptions(home=f"{workdir}/engines", slots=slots, devices=devices,
                           max_requests=0 if self.engine_hosts else 1, stall_s=self.host_stall_s)


class MlflowTarget(BaseModel):
    """Where a finished run is logged in MLflow (`jex export mlflow`); the campaign form's 'mlflow' section, which
    logs the run at the end of the flow. Credentials come from MLflow's own variables (MLFLOW_TRACKING_TOKEN,
    MLFLOW_TRACKING_USERNAME and _PASSWORD), never from the URI, which campaign.json records."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI (http(s)://HOST, sqlite:///FILE.db, "
                                                       "databricks): the campaign logs its run there after the "
                                                       "report; empty = not logged (jex export mlflow: MLflow's "
                                                       "default, MLFLOW_TRACKING_URI)")
    experiment: str = Field("jex", min_length=1, description="MLflow experiment the run is logged in (made if missing)")

    @field_validator("tracking_uri")
    @classmethod
    def _no_password(cls, uri: str | None) -> str | None:
        if uri and urlsplit(uri).password:
            raise ValueError("the URI holds a password: give it in MLFLOW_TRACKING_PASSWORD (or a token in "
                             "MLFLOW_TRACKING_TOKEN), never in the URI")
        return uri or None


GPU_MIN_BATCH = 64
"""Below this many requests per call, sequences per step or rows per shard, a GPU engine waits on jex."""
AUDIT_SETTINGS = {"require_zero_errors", "reference_min_agreement"}
"""Settings that decide whether a run passes, not what it computes (so not in the run's identity)."""


class CampaignSpec(BaseModel):
    """Everything that defines a campaign; the Prefect UI shows it as the run form."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("sample", description="Campaign name (prefix of the run folder)")
    suite: str | None = Field(None, description="Suite folder, or a bundle (.tar.gz) as `jex bundle build` writes "
                                                           "it; empty = the embedded sample suite")
    sample_rows: int = Field(360, ge=18, description="Rows of the embedded sample suite")
    engine: EngineSpec = EngineSpec()
    coverage: float = Field(0.10, ge=0, le=1, description="Share of rows gated for a rationale")
    per_catalog_cap: float | None = Field(None, gt=0, le=1, description="Max gated share of one catalog")
    reason_max_tokens: int = Field(48, ge=1, description="Rationale length limit, tokens")
    spec_proof_rows: int = Field(PROOF_ROWS, ge=1, description="Gated rows the audited base re-generates to prove a "
                                                       "speculative profile exact")
    fold_rule: Literal["replace", "mix"] = "mix"
    fold_weight: float = Field(0.5, ge=0, le=1, description="Weight of the post-thought readout (mix)")
    calibration_folds: int = Field(5, ge=2)
    overlays: str | None = Field(None, description="Overlay rule file (TOML)")
    bootstrap_draws: int = Field(BOOTSTRAP_DRAWS, ge=1)
    bootstrap_seed: int = BOOTSTRAP_SEED
    fast_shard_rows: int | None = Field(None, ge=1, description="Rows per fast-pass shard (a checkpoint, a machine's "
                                                                "unit of work); empty = from the work: "
                                                                f"{FAST_SHARD_ROWS} on CPU, on GPUs the rows split "
                                                                f"into {GPU_SHARDS_PER_ENGINE} shards per engine")
    reason_shard_rows: int | None = Field(None, ge=1, description="Rows per reason (and generate) shard; empty = "
                                                                  "from the work: "
                                                                  f"{REASON_SHARD_ROWS} on CPU, on GPUs as the "
                                                                  "fast pass but at least max_num_seqs rows "
                                                                  "(an engine's share at most)")
    store: str = Field("runs/store", description="Artifact store folder")
    out: str = Field("runs", description="Folder the run folder is created in")
    machines: MachinesSpec = MachinesSpec()
    reference: str | None = Field(None, description="Reference rows (run_id, choice, probs) of an earlier, trusted "
                                  "run, 1:1 with the suite: every run is audited against them")
    require_zero_errors: bool = Field(False, description="Fail the run unless every error counter is zero")
    samples_prompts: Literal["full", "sha256"] = Field(
        "full", description="samples.parquet: the rendered prompts in full, or their sha256 and a pointer to the store")
    reference_min_agreement: float | None = Field(
        None, ge=0, le=1, description="With reference rows in the bundle: fail the run when the final choices "
        "agree with them on fewer than this share of rows")
    unverified_overlays: bool = Field(False, description="Apply the overlay rules even without a passed gate record "
                                                         "for each (the report and samples mark them); off: refused")
    mlflow: MlflowTarget = Field(MlflowTarget(), description="Log the finished run to MLflow after its report")

    @model_validator(mode="after")
    def _tensor_parallel_fits(self) -> CampaignSpec:
        """An engine over `tensor_parallel_size` GPUs needs whole groups of them on each machine, and, under the
        audit profile, a settings audit to prove it batch invariant (none runs with audit off; the inprocess
        provider runs one engine on one GPU); the control engine (`vllm-control`) opts out of the guarantee."""
        tp, machines = self.engine.tensor_parallel_size, self.machines
        if machines.gpus_per_machine % tp:
            raise ValueError(f"machines.gpus_per_machine {machines.gpus_per_machine} is not a multiple of "
                             f"engine.tensor_parallel_size {tp}: one engine slot spans {tp} GPUs")
        if tp > 1 and self.engine.kind == "vllm" and machines.audit == "off":
            raise ValueError(f"engine.tensor_parallel_size {tp} runs under the audit profile only where a settings "
                             "audit proves it batch invariant, and machines.audit is 'off': set it to auto, or use "
                             "engine kind vllm-control (no batch-invariance guarantee)")
        return self

    def identity(self) -> str:
        """Hash of what defines the results, from content only: the suite's files (or the bundle's bytes),
        the engine's fingerprint (weights, tokenizer, what it reads, the settings that change numbers),
        the reference and rule files' bytes, and the campaign's own settings. Not where anything lies (no
        path, store, cache folder or device index), nor on which machines: the same campaign from another
        folder, home or machine has the same run folder name."""
        where = ("store", "out", "fast_shard_rows", "reason_shard_rows", "machines", "samples_prompts", "mlflow",
                 *AUDIT_SETTINGS,
                 *(() if self.unverified_overlays else ("unverified_overlays",)))  # set: its own run folder
        files = ("suite", "reference", "overlays")
        doc = self.model_dump(mode="json", exclude={*where, *files, "engine"})
        doc.update(engine=engine_content(self.engine), suite=suite_content(self.suite) if self.suite else None,
                   reference=file_content(self.reference), overlays=file_content(self.overlays))
        return sha256_json(doc)[:10]

    def run_dir(self) -> Path:
        return Path(self.out) / f"{self.name}-{self.identity()}"

    def with_model(self, model: str | None) -> CampaignSpec:
        """The same campaign on another model (validated: 'embedded' names the embedded one)."""
        engine = {**self.engine.model_dump(), "model": model}
        return CampaignSpec.model_validate({**self.model_dump(), "engine": engine})

    def located(self) -> CampaignSpec:
        """The same campaign with every path absolute (folders, suite, reference, rules, a model on disk),
        so its run folder's record names them from any working folder."""
        def here(path: str | None) -> str | None:
            return str(Path(path).expanduser().absolute()) if path else path

        served = self.engine.is_served()  # a served model's name is the server's, never a path here
        on_disk = not served and self.engine.model and Path(self.engine.model).exists()  # else embedded or a Hub id
        engine = self.engine.model_copy(update={"model": here(self.engine.model)}) if on_disk else self.engine
        return self.model_copy(update={"out": here(self.out), "store": here(self.store), "suite": here(self.suite),
                                       "reference": here(self.reference), "overlays": here(self.overlays),
                                       "engine": engine})

    def fast_pass_inputs(self, bundle: BundleSummary) -> FastPassInputs:
        return FastPassInputs(bundle=bundle, engine=self.engine,
                              shard_rows=self.shard_rows(self.fast_shard_rows, FAST_SHARD_ROWS, bundle.rows))

    def reason_inputs(self, bundle: BundleSummary, gate: GateSummary, engine: EngineSpec | None = None) -> ReasonInputs:
        """The reason stage on `gate`'s rows, by the campaign's engine or another (a speculative proof's base)."""
        shard_rows = self.shard_rows(self.reason_shard_rows, REASON_SHARD_ROWS, gate.rows, generating=True)
        return ReasonInputs(bundle=bundle, gate=gate, engine=engine or self.engine, max_tokens=self.reason_max_tokens,
                            shard_rows=shard_rows)

    def generate_inputs(self, bundle: BundleSummary) -> GenerateInputs:
        """The generate stage on the bundle's generative rows, by the audited engine (a speculative profile's
        exactness proof covers rationales only, so generated answers never depend on the speculation); its
        shards sized as the reason stage's (`reason_shard_rows`)."""
        engine = self.engine if self.engine.profile == "audit" else self.engine.audited_base()
        return GenerateInputs(bundle=bundle, engine=engine, shard_rows=self.shard_rows(
            self.reason_shard_rows, GENERATE_SHARD_ROWS, bundle.generate_rows or 0, generating=True))

    def shard_rows(self, given: int | None, cpu_rows: int, rows: int, *, generating: bool = False) -> int:
        """Rows per shard of an engine stage over `rows` rows: `given`, else `cpu_rows` on CPU, else sized
        for the campaign's GPU engines (`gpu_shard_rows`; a `generating` stage's shards fill vLLM's
        scheduler). Shards merge to the same bytes whatever their size, so this changes no key."""
        if given is not None:
            return given
        if not self.engine.on_gpu():
            return cpu_rows
        return gpu_shard_rows(rows, self.machines.workers * self.machines.engine_slots(self.engine), cpu_rows,
                              fill=self.engine.scheduler_seqs() if generating else 0)

    def gpu_warnings(self) -> list[str]:
        """The settings that would leave a GPU engine idle, one line each naming the setting (the pre-flight
        prints them, the flow logs them); none for CPU engines."""
        if not (self.engine.kind == "vllm" and self.engine.on_gpu()):
            return []
        out = []
        batch = self.engine.batch_size
        if batch and batch < GPU_MIN_BATCH:
            out.append(f"engine.batch_size = {batch} (--batch-size): vLLM gets {batch} requests per call and the "
                       "GPU idles between calls; leave it empty (0: a whole shard to vLLM's scheduler)")
        if self.engine.scheduler_seqs() < GPU_MIN_BATCH:
            out.append(f"engine.max_num_seqs = {self.engine.scheduler_seqs()} (--max-num-seqs): at most that many "
                       f"sequences per scheduler step; leave it empty ({VLLM_MAX_NUM_SEQS})")
        for name, given in (("fast_shard_rows", self.fast_shard_rows), ("reason_shard_rows", self.reason_shard_rows)):
            if given is not None and given < GPU_MIN_BATCH:
                out.append(f"{name} = {given}: shards of CPU size, one engine call each; leave it empty (sized "
                           "from the work)")
        return out


def settings_variable(path: str) -> str | None:
    """The settings variable that gives the CampaignSpec field at `path` (dotted) its default, as
    `settings_fields` reads it; None for a field settings leave alone."""
    if path.startswith("engine."):
        return "JEX_" + path.upper().replace(".", "__")
    return {"out": "JEX_STORE__ROOT", "store": "JEX_STORE__ROOT/store", "bootstrap_draws": "JEX_BOOTSTRAP_DRAWS",
            "bootstrap_seed": "JEX_BOOTSTRAP_SEED", "machines.provider": "JEX_INFRA__PROVIDER"}.get(path)


def spec_field(path: str) -> FieldInfo:
    """The CampaignSpec field at `path` (dotted: `engine.render.chat_template`)."""
    record: Any = CampaignSpec
    *tables, leaf = path.split(".")
    for table in tables:
        record = record.model_fields[table].annotation
    return cast(FieldInfo, record.model_fields[leaf])


def settings_fields(settings: JexSettings) -> dict[str, Any]:
    """The CampaignSpec fields settings decide: the engine (`JEX_ENGINE__*`), where runs go
    (`JEX_STORE__ROOT`: run folders in ROOT, the store in ROOT/store), the bootstrap (`JEX_BOOTSTRAP_*`)
    and where engine stages run (`JEX_INFRA__PROVIDER`)."""
    root = Path(settings.store.root)
    return {"engine": settings.engine.engine_spec(), "out": str(root), "store": str(root / "store"),
            "bootstrap_draws": settings.bootstrap_draws, "bootstrap_seed": settings.bootstrap_seed,
            "machines": {"provider": settings.infra.provider}}


def campaign_spec(settings: JexSettings, *layers: Mapping[str, Any]) -> CampaignSpec:
    """The one way a campaign is specified: settings, then each layer in turn (a `--spec` file, the
    command-line flags, the UI form's values). A later layer wins field by field; tables (`engine`,
    `machines`, `engine.render`) merge. `store` follows `out` (OUT/store) unless a layer sets it.

    Raises pydantic's ValidationError naming the field of a bad value."""
    fields = settings_fields(settings)
    for layer in layers:
        fields = merged_fields(fields, layer)
    if any("out" in layer for layer in layers) and not any("store" in layer for layer in layers):
        fields["store"] = str(Path(fields["out"]) / "store")
    return CampaignSpec.model_validate(fields)


def merged_fields(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `layer` on top; a table in both is merged, any other value replaced."""
    out = dict(base)
    for name, value in layer.items():
        below = out.get(name)
        out[name] = merged_fields(below, value) if isinstance(value, Mapping) and isinstance(below, Mapping) else value
    return out


def sample_suite_dir(spec: CampaignSpec) -> str:
    from jex.sample_suite import write_sample_suite

    folder = Path(spec.store) / "suites" / f"sample-{spec.sample_rows}"
    if not (folder / "suite.toml").exists():
        write_sample_suite(folder, rows=spec.sample_rows, seed=0)
    return str(folder)


def load_spec(run_dir: str | Path) -> CampaignSpec:
    """The campaign as its run folder recorded it (`campaign.json`)."""
    return CampaignSpec.model_validate_json((Path(run_dir) / CAMPAIGN_FILE).read_text())


class BudgetSpec(BaseModel):
    """The budget projection (`jex calibrate`, the budget deployment's form): what it measures, on which campaign,
    and the budget it projects against. Its flags are generated from these fields."""

    campaign: CampaignSpec = CampaignSpec()
    coverage: float = Field(0.30, gt=0, le=1, description="Coverage gated within the sample")
    sample_every: int = Field(4, ge=1, description="Sample ~1/k of every catalog's questions")
    coverages: list[float] = Field([0.05, 0.10, 0.15, 0.25, 0.30], description="Coverages to project")
    target_rows: int | None = Field(None, ge=1, description="Rows to project for (default: this suite's)")
    price_per_gpu_hour: float | None = Field(infra_default("price_per_hour"), ge=0,
                                             description="$ per GPU-hour (default: the settings' price per hour, "
                                                         "else the machine's: the catalogue's for EC2, 0 local)")
    gpus: int = Field(1, ge=1, description="GPU workers of the projected run (data parallel)")
    budget_hours: float = Field(infra_default("budget_hours"), gt=0,
                                description="Wall hours the campaign may take (default: the settings')")
    budget_usd: float = Field(infra_default("budget_usd"), gt=0,
                              description="Dollars the campaign may spend (default: the settings')")
