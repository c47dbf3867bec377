"""The campaign flow: bundle -> fast pass -> gate -> reason -> fold -> calibrate -> overlay -> score -> report.

Every stage is a cached Prefect task keyed by its inputs' content, so running the flow again, a
flow-run retry, or `jex run --resume RUN` recomputes only what is missing: completed stages come back
Cached and an interrupted engine stage resumes at its first missing shard.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow
from pydantic import BaseModel, ConfigDict, Field

from jex.errors import FlowError
from jex.fileio import write_json
from jex.flows.fleet import GpuFleet, MachinesSpec, s3_store
from jex.infra.s3 import checkpoint
from jex.tasks.capture.engine_pool import CALLS, EngineSpec, audited_fingerprint
from jex.tasks.capture.spec_proof import ExactnessProof, prove, write_proof
from jex.tasks.prefect_tasks import (
    bundle_task,
    calibrate_task,
    fast_pass_task,
    fold_task,
    gate_task,
    overlay_task,
    proof_gate_task,
    reason_task,
    report_task,
    score_task,
)

AUDIT_SETTINGS = {"require_zero_errors", "reference_min_agreement"}
"""Settings that decide whether a run passes, not what it computes (so not in the run's identity)."""


class CampaignSpec(BaseModel):
    """Everything that defines a campaign; the Prefect UI shows it as the run form."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("sample", description="Campaign name (prefix of the run folder)")
    suite: str | None = Field(None, description="Suite folder; empty = the embedded sample suite")
    sample_rows: int = Field(360, ge=18, description="Rows of the embedded sample suite")
    engine: EngineSpec = EngineSpec()
    coverage: float = Field(0.10, ge=0, le=1, description="Share of rows gated for a rationale")
    per_catalog_cap: float | None = Field(None, gt=0, le=1, description="Max gated share of one catalog")
    reason_max_tokens: int = Field(48, ge=1)
    spec_proof_rows: int = Field(64, ge=1, description="Gated rows the audited base re-generates to prove a "
                                                       "speculative profile exact")
    fold_rule: Literal["replace", "mix"] = "mix"
    fold_weight: float = Field(0.5, ge=0, le=1, description="Weight of the post-thought readout (mix)")
    calibration_folds: int = Field(5, ge=2)
    overlays: str | None = Field(None, description="Overlay rule file (TOML)")
    bootstrap_draws: int = Field(2000, ge=1)
    bootstrap_seed: int = 20260929
    fast_shard_rows: int = Field(32, ge=1)
    reason_shard_rows: int = Field(8, ge=1)
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

    def identity(self) -> str:
        """Hash of what defines the results (not where they are written, nor on which machines)."""
        where = ("store", "out", "fast_shard_rows", "reason_shard_rows", "machines", "samples_prompts", *AUDIT_SETTINGS)
        # a scheduler limit: under the audit profile the results do not depend on it
        doc = self.model_dump(exclude={**dict.fromkeys(where, True), "engine": {"max_num_batched_tokens": True}})
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:10]

    def run_dir(self) -> Path:
        return Path(self.out) / f"{self.name}-{self.identity()}"


def sample_suite_dir(spec: CampaignSpec) -> str:
    from jex.sample_suite import write_sample_suite

    folder = Path(spec.store) / "suites" / f"sample-{spec.sample_rows}"
    if not (folder / "suite.toml").exists():
        write_sample_suite(folder, rows=spec.sample_rows, seed=0)
    return str(folder)


STAGES = ("bundle", "fast_pass", "gate", "reason", "fold", "calibrate", "overlay", "score")


@flow(name="campaign", log_prints=True, persist_result=True)
def campaign(spec: CampaignSpec = CampaignSpec(), redo: list[str] | None = None) -> str:  # noqa: B008 - UI form
    """Run (or resume) a campaign; returns the run folder.

    `redo` names stages to compute again although cached (retry-stage): their stage folders from the
    last run of this campaign are set aside (renamed, never deleted) and their Prefect cache refreshed.
    """
    run_dir = spec.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "campaign.json").write_text(spec.model_dump_json(indent=2))
    store = spec.store
    timings: dict[str, float] = {}
    redo = list(redo or [])
    unknown = set(redo) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {list(STAGES)}")
    retired = retire_stages(run_dir, redo)
    if retired:
        print(f"retry: set aside {len(retired)} stage folder(s) for {redo}: {retired}")
    s: dict[str, Any] = {}
    s3 = s3_store()

    def timed(name: str, fn: Any, remote: dict[str, Any] | None = None, machine_stage: str | None = None,
              audited_base: bool = False, **kw: Any) -> dict[str, Any]:
        """Run one stage (its missing shards first on the machines, when `remote` args are given).

        `machine_stage` is the engine stage the machines run (default: `name`); `audited_base` says the
        stage's engine is the campaign engine under the plain audit profile."""
        t0 = time.perf_counter()
        if fleet and remote is not None:
            fp = audited_fingerprint(fleet.engine_fp) if audited_base and fleet.engine_fp else None
            fleet.run_stage(machine_stage or name, remote, engine_fp=fp)
            # measured on the machines (None: every shard was already here)
            kw["engine_fp"] = fp or fleet.engine_fp
        out = fn.with_options(refresh_cache=True)(**kw) if name in redo else fn(**kw)
        if not (Path(out.get("folder", "")) / "_SUCCESS.json").exists():  # Prefect cached a result the store lost
            out = fn.with_options(refresh_cache=True)(**kw)
        timings[name] = time.perf_counter() - t0
        s[name] = out
        write_json(run_dir / "stages.json", {k: {"key": v.get("key"), "folder": v.get("folder"),
                                                 "seconds": round(timings[k], 3)} for k, v in s.items()})
        if s3 is not None:  # a new orchestrator can resume from here (`jex store pull`, `jex run --resume`)
            checkpoint(s3, run_dir, out.get("folder"))
        return out

    suite = spec.suite or sample_suite_dir(spec)
    if spec.reference_min_agreement is not None and not spec.reference:
        raise FlowError("reference_min_agreement is set but no reference rows are given (set `reference`)")
    fleet = None if spec.machines.provider == "inprocess" else GpuFleet(spec.machines, campaign=run_dir.name,
                                                                         store=store)
    engine = spec.engine.model_dump(mode="json")
    calls_before = dict(CALLS)
    proof = None
    try:
        with fleet or contextlib.nullcontext():
            timed("bundle", bundle_task, suite=suite, store=store, reference=spec.reference)
            timed("fast_pass", fast_pass_task, remote={"bundle": s["bundle"], "engine": engine, "store": store,
                                                       "shard_rows": spec.fast_shard_rows},
                  bundle=s["bundle"], engine=spec.engine, store=store, shard_rows=spec.fast_shard_rows)
            timed("gate", gate_task, bundle=s["bundle"], fast=s["fast_pass"], store=store, coverage=spec.coverage,
                  per_catalog_cap=spec.per_catalog_cap)
            timed("reason", reason_task, remote={"bundle": s["bundle"], "gate": s["gate"], "engine": engine,
                                                 "store": store, "shard_rows": spec.reason_shard_rows,
                                                 "max_tokens": spec.reason_max_tokens},
                  bundle=s["bundle"], gate=s["gate"], engine=spec.engine, store=store,
                  max_tokens=spec.reason_max_tokens, shard_rows=spec.reason_shard_rows)
            if spec.engine.profile != "audit":
                proof = prove_speculation(spec, s, timed)
    finally:
        if fleet:  # also when a machine failed, went quiet, ran out of budget or failed its golden replay
            publish_machines(run_dir, fleet.report())
    machines = fleet.report() if fleet else None
    timed("fold", fold_task, bundle=s["bundle"], fast=s["fast_pass"], gate=s["gate"], reason=s["reason"], store=store,
          rule=spec.fold_rule, weight=spec.fold_weight, draws=spec.bootstrap_draws, seed=spec.bootstrap_seed)
    timed("calibrate", calibrate_task, bundle=s["bundle"], fold=s["fold"], store=store, folds=spec.calibration_folds)
    timed("overlay", overlay_task, calibrated=s["calibrate"], store=store, rules_file=spec.overlays)
    timed("score", score_task, bundle=s["bundle"], overlay=s["overlay"], fold=s["fold"], store=store,
          draws=spec.bootstrap_draws, seed=spec.bootstrap_seed)
    engine_calls = {k: CALLS[k] - calls_before.get(k, 0) for k in ("fast_pass", "reason")}
    if fleet:  # the engines ran on the machines: count the shard jobs they computed
        engine_calls = {k: sum(len(j["artifacts"]) for m in machines["machines"] for j in m["jobs"] if j["job"] == k)
                        for k in ("fast_pass", "reason")}
    write_json(run_dir / "engine_calls.json", {"redo": redo, "retired": retired, "calls": engine_calls})
    if proof is not None:
        write_proof(run_dir, proof, fell_back=not proof.exact)
    report_task(run_dir=str(run_dir), summaries=s, spec=spec.model_dump(mode="json"), timings=timings,
                machines=machines)
    upload_to_s3(run_dir, s, store)
    errors = s["fold"]["errors"]
    if any(errors.values()):
        print(f"WARNING: error counters are not all zero: {errors}")
    enforce_audit(spec, s)
    print(f"run folder: {run_dir.resolve()} (retry a stage: the retry-stage deployment with this run_dir)")
    return str(run_dir)


def prove_speculation(spec: CampaignSpec, s: dict[str, Any], timed: Any) -> ExactnessProof:
    """The audited base engine reasons on a sample of the gated rows; unless every token matches the
    speculative stage's, the whole reason stage is recomputed by the base engine (s["reason"] replaced)."""
    base = spec.engine.audited_base()
    reason_args = {"bundle": s["bundle"], "engine": base.model_dump(mode="json"), "store": spec.store,
                   "shard_rows": spec.reason_shard_rows, "max_tokens": spec.reason_max_tokens}
    timed("spec_proof_gate", proof_gate_task, bundle=s["bundle"], gate=s["gate"], store=spec.store,
          rows=spec.spec_proof_rows)
    timed("spec_proof", reason_task, remote={**reason_args, "gate": s["spec_proof_gate"]}, machine_stage="reason",
          audited_base=True, bundle=s["bundle"], gate=s["spec_proof_gate"], engine=base, store=spec.store,
          max_tokens=spec.reason_max_tokens, shard_rows=spec.reason_shard_rows)
    proof = prove(s["reason"], s["spec_proof"], profile=spec.engine.profile)
    print(f"speculative decoding ({spec.engine.profile}): {proof.rows_checked} rows, {proof.tokens_compared} tokens "
          f"compared, {proof.rows_differing} differing" + ("" if proof.exact else
                                                          " -> falling back to the audited base profile"))
    if not proof.exact:
        timed("reason", reason_task, remote={**reason_args, "gate": s["gate"]}, audited_base=True,
              bundle=s["bundle"], gate=s["gate"], engine=base, store=spec.store,
              max_tokens=spec.reason_max_tokens, shard_rows=spec.reason_shard_rows)
    return proof


def enforce_audit(spec: CampaignSpec, summaries: dict[str, Any]) -> None:
    """After the report is written: fail the run if the spec requires zero errors or a reference
    agreement that this run does not have."""
    from jex.tasks.probabilities.fold import require_zero

    if spec.require_zero_errors:
        require_zero(summaries["fold"]["errors"])
    audit = summaries["score"].get("reference_agreement")
    if spec.reference_min_agreement is not None and (audit is None or audit < spec.reference_min_agreement):
        shown = "none (no row compared)" if audit is None else f"{audit:.4f}"
        raise FlowError(f"reference agreement {shown} is below reference_min_agreement "
                        f"{spec.reference_min_agreement} (see the reference audit in report.md)")


def publish_machines(run_dir: Path, machines: dict[str, Any]) -> None:
    """`machines.json` in the run folder and the machines section as a Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact

    from jex.tasks.outputs.report import machines_section

    write_json(run_dir / "machines.json", machines)
    try:
        create_markdown_artifact(markdown="\n".join(machines_section(machines)), key="campaign-machines",
                                 description=f"machines of {run_dir.name}")
    except Exception as e:  # noqa: BLE001 - the JSON is written; a display failure must not hide the run's own error
        print(f"could not publish the machines artifact: {e}")


def retire_stages(run_dir: Path, stages: list[str]) -> list[str]:
    """Rename the stage folders the last run of this campaign used for `stages` (nothing is deleted)."""
    record = run_dir / "stages.json"
    if not stages or not record.exists():
        return []
    done = json.loads(record.read_text())
    retired = []
    for name in stages:
        folder = Path((done.get(name) or {}).get("folder") or "")
        if folder.name and folder.exists():
            stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**6:06d}"
            target = folder.with_name(f"{folder.name}.retired-{stamp}")
            folder.rename(target)
            retired.append(str(target))
    return retired


def upload_to_s3(run_dir: Path, summaries: dict[str, Any], store: str) -> None:
    """With JEX_STORE__S3_BUCKET set, copy the stage folders and the run folder to S3 (verified)."""
    from jex.settings import load_settings

    settings = load_settings()
    if not settings.store.s3_bucket:
        return
    from jex.infra.s3 import S3Store, sync_campaign

    manifest = sync_campaign(S3Store.from_settings(settings.store, settings.infra), run_dir, summaries, Path(store))
    print(f"uploaded {sum(o['uploaded'] for o in manifest['objects'])} of {len(manifest['objects'])} objects to "
          f"s3://{manifest['bucket']}/{manifest['prefix']}")


def run_campaign(spec: CampaignSpec) -> Path:
    """Run the flow in this process (Prefect's local API unless PREFECT_API_URL is set)."""
    return Path(campaign(spec))


def load_spec(run_dir: str | Path) -> CampaignSpec:
    return CampaignSpec.model_validate_json((Path(run_dir) / "campaign.json").read_text())
