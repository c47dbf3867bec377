"""Audited settings: a campaign's engine runs only with settings a stored, powered, passing audit covers.

Batch invariance is a property of kernels at given shapes: of the GPU models, the software stack, the
engine settings that change batching or kernels, and the model's architecture shape, not of its weights'
values. So an audit is keyed by exactly those (`audit_key`): a fine-tune shares its base's audit, and a
team comparing five checkpoints of one base pays it once.

The audit runs on the campaign's first machine inside its golden job, on the campaign's own engine (its
engine host's, started once for audit and campaign): the probe (`tasks/capture/invariance.py`) generates
divergence-prone prompts at every rung of a batch ladder up to the scheduler's width, with the control arm
(the same model without batch invariance) in a process beside it, stopped at its first divergence. The
control runs once per GPU kind x stack x shape: a stored audit whose control diverged lends its power to a
wider ladder later. An audit is:
- **proven** when the invariant arm matched its reference at every rung and run to run while the control
  diverged: stored, it covers every later campaign up to its ladder's width;
- **failed** when the invariant arm differed: the campaign is refused in one line;
- **unproven** when the control never diverged, even lengthened (prompts and new tokens x2, then x4):
  stored but covering nothing; the campaign runs with "unproven" in machines.json, the report and
  provenance, and is refused where `machines.audit = "always"` or the engine spans several GPUs
  (`tensor_parallel_size` above 1: run only where proven; the settings are part of the key, so an audit at
  one tensor-parallel size never covers another).
`machines.audit`: "auto" audits vLLM engines, "always" any engine (the HF engine through the same path:
the CPU twin; its control arm runs padded batches in bfloat16), "off" none (machines.json says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, JsonValue

from jex.engine_identity import ArchitectureShape, EffectiveSettings
from jex.engine_spec import EngineSpec
from jex.errors import FlowError
from jex.fileio import sha256_bytes, sha256_json
from jex.record import Record, read_record, write_record
from jex.store_layout import bakeoff_dir
from jex.tasks.campaign_spec import AuditMode
from jex.tasks.capture.invariance import (
    PROBE_FILE,
    SCALES,
    ArmResult,
    InvarianceProbe,
    ProbeOutcome,
    invariant,
)

AUDIT_FILE = "audit.json"
"""Beside a stored bake-off's outputs: its `SettingsAudit`, written last (the folder's completion)."""
AUDIT_REFERENCE_PROMPTS = 8
"""Prompts the bake-off's batch-1 rung reads (one request at a time: most of its cost when it read all 64),
8 at evenly spaced ranks of length, the longest among them (`reference_sample`). The weaker part: batch 1
against the next rung is checked on these 8 only. Where batch variance shows, it shows in most long prompts
within few tokens (control arm at batch 32 on the H200: 3,523 of 8,192 tokens differ, first at step 1,
median step 19), and every rung above batch 1 still reads all prompts against the smallest of them."""


AuditStatus = Literal["proven", "failed", "unproven"]


class SettingsAudit(Record):
    """An audit of one engine's settings on one kind of machine, stack and architecture shape, as the store
    keeps it (`audit.json` beside its `bakeoff.json`)."""

    key: str
    arm: str = Field(description="The audited arm (lab/bakeoff.py ARMS) the campaign's engine settings map to")
    control: str = Field(description="The arm beside it that shows the test could see divergence")
    gpus: list[str] = Field(description="GPU models of the machine it ran on ([] on a CPU machine)")
    stack_sha256: str = Field(description="sha256 of the stack lock the machine installed")
    ladder: list[int] = Field(description="Batch sizes of the bake-off, batch 1 (the reference) among them")
    passed: bool = Field(description="The audited arm: 0 tokens differing from its reference (batch 1, where it "
                                     "read the prompt) at every rung, run to run")
    powered: bool = Field(description="The control arm diverged (here, or in the stored audit whose power this "
                                      "one reused): else the test could not have seen divergence")
    verdict: str = Field(description="The bake-off's own one-line verdict")
    folder: str = Field(description="Where bakeoff.json, bakeoff.md and each arm's tokens are")
    reused: bool = Field(False, description="Found in the store: no probe ran for this campaign")
    shape: ArchitectureShape | None = Field(None, description="The architecture shape it covers")
    kernel: dict[str, JsonValue] = Field(default_factory=dict, description="The engine settings it covers "
                                                                            "(batching and kernels), as asked")
    effective: EffectiveSettings | None = Field(None, description="What the audited engine ran with, read back "
                                                                 "from it: every machine's engine must match it")
    scale: int = Field(1, description="Its prompts and new tokens, times the configured size (lengthened "
                                      "while the control stayed quiet)")
    model: str | None = Field(None, description="The model it ran on (any model of the same shape is covered)")
    control_reused: bool = Field(False, description="The control did not run: a stored audit of this shape, "
                                                    "machine kind and stack had shown the test's power")
    control_error: str | None = Field(None, description="Why the control arm gave no result (then unproven)")

    @property
    def status(self) -> AuditStatus:
        return "failed" if not self.passed else "proven" if self.powered else "unproven"

    def tensor_parallel(self) -> int:
        """GPUs the audited engine spans (its kernel settings' `tensor_parallel_size`; 1 when not vLLM)."""
        tp = self.kernel.get("tensor_parallel_size")
        return tp if isinstance(tp, int) else 1

    def covers(self, rung: int) -> bool:
        return self.status == "proven" and max(self.ladder) >= rung

    def line(self) -> str:
        """One line for the campaign's log and report."""
        where = self.gpus or ["CPU"]
        size = f", lengthened x{self.scale}" if self.scale > 1 else ""
        tp = f" at tensor_parallel_size {self.tensor_parallel()}" if self.tensor_parallel() > 1 else ""
        return (f"engine settings {self.arm!r}{tp} on {where}: {self.status.upper()} up to batch {max(self.ladder)}"
                f" ({'stored audit' if self.reused else 'probed now'}{size}; {self.folder})")


class SettingsNotAudited(FlowError):
    """The campaign's engine settings failed their bake-off on this kind of machine: no shard is computed."""

    def __init__(self, audit: SettingsAudit):
        super().__init__(f"engine settings {audit.arm!r} are not batch invariant on {audit.gpus or ['CPU']} with "
                         f"stack {audit.stack_sha256[:12]}: {audit.verdict} (bake-off in {audit.folder})")
        self.audit = audit


class SettingsUnproven(FlowError):
    """`machines.audit = "always"`, or an engine over several GPUs, and the audit could not show its power: the
    control arm never diverged."""

    def __init__(self, audit: SettingsAudit):
        why = (f"the control arm {audit.control!r} failed: {audit.control_error}" if audit.control_error else
               f"the control arm {audit.control!r} never diverged, even at {audit.scale}x the prompts and tokens")
        needs = (f"tensor_parallel_size {audit.tensor_parallel()} runs only where proven" if audit.tensor_parallel() > 1
                 else "machines.audit is 'always'")
        super().__init__(f"engine settings {audit.arm!r} on {audit.gpus or ['CPU']}: the audit is unproven ({why}), "
                         f"and {needs} (bake-off in {audit.folder})")
        self.audit = audit


def audited(mode: AuditMode, engine: EngineSpec) -> bool:
    return mode == "always" or (mode == "auto" and engine.kind.startswith("vllm"))


def audit_arms(engine: EngineSpec) -> tuple[str, str]:
    """(audited arm, control arm) of the bake-off that stands for the engine's settings."""
    if engine.profile == "audit-ngram":  # a speculative engine is its own arm (and its own key)
        return ("vllm-bi-ngram", "vllm-control") if engine.kind.startswith("vllm") else ("hf-bi-ngram", "hf-control")
    if engine.kind.startswith("vllm"):
        return ("vllm-bi-fdo" if engine.cudagraph_mode == "FULL_DECODE_ONLY" else "vllm-bi"), "vllm-control"
    return "hf-bi", "hf-control"


def audit_ladder(width: int) -> list[int]:
    """Batch 1, then powers of two from 8, up to and including the scheduler width."""
    rungs = [1, *(b for b in (8, 16, 32, 64, 128, 256, 512, 1024) if b < width), width]
    return sorted(set(rungs))


def audit_width(engine: EngineSpec) -> int:
    """The most sequences the campaign's engine batches at once: vLLM's max_num_seqs, else its batch size."""
    return engine.scheduler_seqs() if engine.kind.startswith("vllm") else max(1, engine.requests_per_call())


def audit_key(*, arm: str, gpus: list[str], stack_lock: str, shape: ArchitectureShape,
              kernel: dict[str, JsonValue], prompts: int, tokens: int) -> str:
    """What an audit's verdict depends on: GPU models, stack, the architecture shape and the engine settings
    that change batching or kernels, and the probe's size and rule. Not the weights' values; not the ladder
    (a wider one covers a narrower)."""
    from jex.lab.jobs import REFERENCE_RULE

    return sha256_json({"arm": arm, "gpus": gpus, "stack_sha256": sha256_bytes(stack_lock.encode()),
                        "shape": shape.model_dump(mode="json"), "kernel": kernel, "prompts": prompts,
                        "tokens": tokens, "reference_prompts": AUDIT_REFERENCE_PROMPTS,
                        "reference_rule": REFERENCE_RULE})[:32]


def audit_folder(store_root: Path, key: str) -> Path:
    return bakeoff_dir(store_root, key)


def stored_audit(store_root: Path, key: str) -> SettingsAudit | None:
    path = audit_folder(store_root, key) / AUDIT_FILE
    return read_record(SettingsAudit, path) if path.exists() else None


CONTROL_KV_CACHE_GIB = 4.0
"""The vLLM control's KV cache, fixed: it starts beside the campaign's engine on one GPU, where a profiled
share of the GPU's memory would not fit (the campaign's engine holds its own share), and it holds the probe's
widest rung (32 prompts x 2k tokens of an 8B shape's ~128 KiB per token) with room to spare."""
CONTROL_GPU_MEMORY_SHARE = 0.1
"""With its KV cache fixed, vLLM only checks that this share of the GPU is free when the control starts
(`request_memory` in vLLM's GPU worker), whatever share the campaign's engine already holds."""


def control_engine(engine: EngineSpec) -> EngineSpec:
    """The control arm's engine: the campaign's model and settings without batch invariance, its KV cache fixed
    (vLLM), or padded batches in bfloat16 (HF on a CPU, where fp32 padding rarely flips a greedy token)."""
    if engine.kind.startswith("vllm"):
        return engine.model_copy(update={
            "kind": "vllm-control", "profile": "audit",
            "kv_cache_memory_gib": engine.kv_cache_memory_gib or CONTROL_KV_CACHE_GIB,
            "gpu_memory_utilization": min(engine.gpu_memory_utilization, CONTROL_GPU_MEMORY_SHARE)})
    return engine.model_copy(update={"kind": "hf-batched", "profile": "audit", "dtype": "bfloat16",
                                     "batch_size": None})


class AuditPlan(Record):
    """Before the machines' golden jobs: the stored audit that covers the campaign, or the probe its first
    machine runs (and what the audit of that probe will be keyed and judged by)."""

    key: str
    folder: str
    arm: str
    control: str
    gpus: list[str]
    stack_sha256: str
    shape: ArchitectureShape
    kernel: dict[str, JsonValue]
    model: str | None
    stored: SettingsAudit | None = None
    probe: InvarianceProbe | None = None


def plan_audit(engine: EngineSpec, *, store_root: Path, gpus: list[str], stack_lock: str, shape: ArchitectureShape,
               kernel: dict[str, JsonValue], prompts: int, tokens: int) -> AuditPlan:
    """The stored audit that covers `engine` on this machine kind, stack and shape, else the probe to run;
    a stored failed audit refuses the campaign here (`SettingsNotAudited`), before any golden job."""
    arm, control = audit_arms(engine)
    width = audit_width(engine)
    key = audit_key(arm=arm, gpus=gpus, stack_lock=stack_lock, shape=shape, kernel=kernel, prompts=prompts,
                    tokens=tokens)
    plan = AuditPlan(key=key, folder=str(audit_folder(store_root, key)), arm=arm, control=control, gpus=gpus,
                     stack_sha256=sha256_bytes(stack_lock.encode()), shape=shape, kernel=kernel, model=engine.model)
    found = stored_audit(store_root, key)
    if found is not None and not found.passed:
        raise SettingsNotAudited(found.model_copy(update={"reused": True}))
    if found is not None and found.covers(width):
        return plan.model_copy(update={"stored": found.model_copy(update={"reused": True})})
    power_known = found is not None and found.powered  # a narrower proven audit: its control's power stands
    probe = InvarianceProbe(arm=arm, control_arm=control, control=None if power_known else control_engine(engine),
                            prompts=prompts, tokens=tokens, ladder=audit_ladder(width), repeats=2,
                            reference_prompts=AUDIT_REFERENCE_PROMPTS,
                            scales=[found.scale] if found is not None and power_known else list(SCALES))
    return plan.model_copy(update={"probe": probe, "stored": found})


def judge_probe(plan: AuditPlan, probe_dir: Path, mode: AuditMode) -> SettingsAudit:
    """The audit of a probe a machine ran (its arms' files in `probe_dir`): the bake-off written and stored
    under the plan's key (`audit.json` last), whatever its status; raises `SettingsNotAudited` when the
    invariant arm failed, `SettingsUnproven` when the control never diverged and `mode` is "always" or the
    engine spans several GPUs (tensor parallel: run only where proven)."""
    from jex.lab.bakeoff import bakeoff_result, write_bakeoff

    probe = plan.probe
    assert probe is not None
    outcome = read_record(ProbeOutcome, probe_dir / PROBE_FILE)
    arms = {probe.control_arm: read_record(ArmResult, probe_dir / f"arm-{probe.control_arm}.json")} \
        if (probe_dir / f"arm-{probe.control_arm}.json").exists() else {}
    if outcome.control_error:
        arms[probe.control_arm] = ArmResult(arm=probe.control_arm, error=outcome.control_error)
    arms[probe.arm] = read_record(ArmResult, probe_dir / f"arm-{probe.arm}.json")
    folder = Path(plan.folder)
    if plan.stored is not None and plan.stored.status == "proven":  # a wider ladder: the narrower audit stays
        folder = folder / f"ladder-{max(probe.ladder)}"
    for name, arm in arms.items():
        write_record(folder / f"arm-{name}.json", arm)
    scale = outcome.scale
    result = bakeoff_result(arms, engine=probe.arm.split("-")[0], prompts=probe.prompts * scale,
                            tokens=probe.tokens * scale, ladder=probe.ladder, repeats=probe.repeats,
                            reference_prompts=min(probe.reference_prompts or probe.prompts * scale,
                                                  probe.prompts * scale))
    write_bakeoff(result, folder)
    audit = judge(folder / "bakeoff.json", key=plan.key, arm=plan.arm, control=plan.control, gpus=plan.gpus,
                  stack_sha256=plan.stack_sha256, ladder=probe.ladder)
    reused_power = probe.control is None and plan.stored is not None and plan.stored.powered
    audit = audit.model_copy(update={
        "powered": audit.powered or reused_power, "control_reused": reused_power, "shape": plan.shape,
        "kernel": plan.kernel, "scale": scale, "model": plan.model, "effective": arms[probe.arm].effective,
        "control_error": outcome.control_error})
    write_record(folder / AUDIT_FILE, audit)
    if folder != Path(plan.folder) and audit.status == "proven":  # the wider audit now covers every width
        write_record(Path(plan.folder) / AUDIT_FILE, audit)
    if audit.status == "failed":
        raise SettingsNotAudited(audit)
    if audit.status == "unproven" and (mode == "always" or audit.tensor_parallel() > 1):
        raise SettingsUnproven(audit)
    return audit


def judge(bakeoff_json: Path, *, key: str, arm: str, control: str, gpus: list[str], stack_sha256: str,
          ladder: list[int]) -> SettingsAudit:
    """The audit of a finished bake-off (`bakeoff.json`): passed when the audited arm ran and showed no
    token differing from its reference (batch 1 where it read the prompt) at any rung and was identical run to
    run; powered when the control arm diverged. The file is read through its record (`read_bakeoff`): a
    missing or renamed key is an `InputError` naming the file, never a verdict."""
    from jex.lab.bakeoff import read_bakeoff  # here: the lab's engine modules load only to judge

    doc = read_bakeoff(bakeoff_json)
    audited_arm = doc.arms.get(arm, ArmResult())
    powered = doc.arms.get(control, ArmResult()).mismatches() > 0
    return SettingsAudit(key=key, arm=arm, control=control, gpus=gpus, stack_sha256=stack_sha256, ladder=ladder,
                         passed=invariant(audited_arm), powered=powered, verdict=doc.verdict,
                         folder=str(bakeoff_json.parent))


def effective_mismatch(audit: SettingsAudit, effective: EffectiveSettings | None) -> list[str]:
    """The settings a machine's engine ran with that differ from what its audit measured (one line each);
    a setting either side did not read is not compared."""
    if audit.effective is None or effective is None:
        return []
    want, got = audit.effective.kernel_doc(), effective.kernel_doc()
    return [f"{k}: {got[k]!r}, audited {want[k]!r}" for k in sorted(want.keys() & got.keys()) if want[k] != got[k]]
