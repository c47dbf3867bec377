"""Audited settings: a campaign's engine runs only with settings a stored passing bake-off covers.

Batch invariance is a property of an engine's kernels under its settings, on a kind of GPU, with one
software stack. Before the golden replay, the fleet looks in the store for a bake-off of the campaign's
engine arm (`audit_arms`: the audited profile and its CUDA-graph mode, with the control arm beside it)
keyed by the machine's GPU models, the sha256 of the stack lock it installed, the model's weights and
the bake-off's size (`audit_key`). One that passed and whose batch ladder reaches the campaign's
scheduler width covers the campaign; none does, and the fleet runs the bake-off once on its first
machine (a lab job: its machine time is in the campaign's cost ledger) and stores it. A bake-off whose
invariant arm differs from its reference at any rung (batch 1, on the prompts it read: `AUDIT_REFERENCE_PROMPTS`),
or run to run, refuses the campaign in one line.
`machines.audit`: "auto" audits vLLM engines, "always" any engine (the HF engine's arms: the CPU twin of
the same path), "off" none (the campaign's machines.json says so).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import Field

from jex.engine_spec import EngineSpec
from jex.errors import FlowError
from jex.fileio import sha256_bytes, sha256_json
from jex.record import Record, read_record, write_record
from jex.store_layout import bakeoff_dir
from jex.tasks.campaign_spec import AuditMode

AUDIT_FILE = "audit.json"
"""Beside a stored bake-off's outputs: its `SettingsAudit`, written last (the folder's completion)."""
AUDIT_REFERENCE_PROMPTS = 8
"""Prompts the bake-off's batch-1 rung reads (one request at a time: most of its cost when it read all 64),
8 at evenly spaced ranks of length, the longest among them (`reference_sample`). The weaker part: batch 1
against the next rung is checked on these 8 only. Where batch variance shows, it shows in most long prompts
within few tokens (control arm at batch 32 on the H200: 3,523 of 8,192 tokens differ, first at step 1,
median step 19), and every rung above batch 1 still reads all prompts against the smallest of them."""


class SettingsAudit(Record):
    """A bake-off of one engine arm on one kind of machine and stack, as the store keeps it."""

    key: str
    arm: str = Field(description="The audited arm (lab/bakeoff.py ARMS) the campaign's engine settings map to")
    control: str = Field(description="The arm beside it that shows the test could see divergence")
    gpus: list[str] = Field(description="GPU models of the machine it ran on ([] on a CPU machine)")
    stack_sha256: str = Field(description="sha256 of the stack lock the machine installed")
    ladder: list[int] = Field(description="Batch sizes of the bake-off, batch 1 (the reference) among them")
    passed: bool = Field(description="The audited arm: 0 tokens differing from its reference (batch 1, where it "
                                     "read the prompt) at every rung, run to run")
    powered: bool = Field(description="The control arm diverged somewhere (else the test could not have seen it)")
    verdict: str = Field(description="The bake-off's own one-line verdict")
    folder: str = Field(description="Where bakeoff.json, bakeoff.md and each arm's tokens are")
    reused: bool = Field(False, description="Found in the store: no bake-off ran for this campaign")

    def covers(self, rung: int) -> bool:
        return self.passed and max(self.ladder) >= rung


class SettingsNotAudited(FlowError):
    """The campaign's engine settings failed their bake-off on this kind of machine: no shard is computed."""

    def __init__(self, audit: SettingsAudit):
        super().__init__(f"engine settings {audit.arm!r} are not batch invariant on {audit.gpus or ['CPU']} with "
                         f"stack {audit.stack_sha256[:12]}: {audit.verdict} (bake-off in {audit.folder})")
        self.audit = audit


def audited(mode: AuditMode, engine: EngineSpec) -> bool:
    return mode == "always" or (mode == "auto" and engine.kind.startswith("vllm"))


def audit_arms(engine: EngineSpec) -> tuple[str, str]:
    """(audited arm, control arm) of the bake-off that stands for the engine's settings."""
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


def audit_key(*, arm: str, gpus: list[str], stack_lock: str, weights_sha256: str, prompts: int, tokens: int) -> str:
    """What a bake-off's verdict depends on; the ladder is not in it (a wider one covers a narrower)."""
    from jex.lab.jobs import REFERENCE_RULE

    return sha256_json({"arm": arm, "gpus": gpus, "stack_sha256": sha256_bytes(stack_lock.encode()),
                        "weights_sha256": weights_sha256, "prompts": prompts, "tokens": tokens,
                        "reference_prompts": AUDIT_REFERENCE_PROMPTS, "reference_rule": REFERENCE_RULE})[:32]


def audit_folder(store_root: Path, key: str) -> Path:
    return bakeoff_dir(store_root, key)


def stored_audit(store_root: Path, key: str) -> SettingsAudit | None:
    path = audit_folder(store_root, key) / AUDIT_FILE
    return read_record(SettingsAudit, path) if path.exists() else None


def judge(bakeoff_json: Path, *, key: str, arm: str, control: str, gpus: list[str], stack_lock: str,
          ladder: list[int]) -> SettingsAudit:
    """The audit of a finished bake-off (`bakeoff.json`): passed when the audited arm ran and showed no
    token differing from its reference (batch 1 where it read the prompt) at any rung and was identical run to
    run. The file is read through its record (`read_bakeoff`): a missing or renamed key is an `InputError`
    naming the file, never a verdict."""
    from jex.lab.bakeoff import ArmResult, read_bakeoff  # here: the lab's engine modules load only to judge

    doc = read_bakeoff(bakeoff_json)
    audited_arm = doc.arms.get(arm, ArmResult())
    rungs = audited_arm.rungs
    passed = bool(rungs) and audited_arm.error is None and all(
        r.mismatches == 0 and r.run_to_run_identical for r in rungs.values())
    powered = doc.arms.get(control, ArmResult()).mismatches() > 0
    return SettingsAudit(key=key, arm=arm, control=control, gpus=gpus, stack_sha256=sha256_bytes(stack_lock.encode()),
                         ladder=ladder, passed=passed, powered=powered, verdict=doc.verdict,
                         folder=str(bakeoff_json.parent))


def audit_settings(engine: EngineSpec, *, store_root: Path, gpus: list[str], stack_lock: str, weights_sha256: str,
                   prompts: int, tokens: int, run_bakeoff: Callable[[Any, Path], None]) -> SettingsAudit:
    """The stored audit that covers `engine` on this machine kind and stack, else a bake-off run now
    (`run_bakeoff(job, folder)`, on the campaign's first machine) and stored; raises `SettingsNotAudited`
    when the audited arm failed."""
    from jex.lab.jobs import BakeoffJob

    arm, control = audit_arms(engine)
    width = audit_width(engine)
    key = audit_key(arm=arm, gpus=gpus, stack_lock=stack_lock, weights_sha256=weights_sha256, prompts=prompts,
                    tokens=tokens)
    found = stored_audit(store_root, key)
    if found is not None and (found.covers(width) or not found.passed):
        audit = found.model_copy(update={"reused": True})
    else:
        ladder = audit_ladder(width)
        folder = audit_folder(store_root, key)
        job = BakeoffJob(arms=[control, arm], model=engine.model, prompts=prompts, tokens=tokens, ladder=ladder,
                         repeats=2, reference_prompts=AUDIT_REFERENCE_PROMPTS, max_num_seqs=max(ladder),
                         device=engine.device)
        run_bakeoff(job, folder)
        audit = judge(folder / "bakeoff.json", key=key, arm=arm, control=control, gpus=gpus, stack_lock=stack_lock,
                      ladder=ladder)
        write_record(folder / AUDIT_FILE, audit)
    if not audit.passed:
        raise SettingsNotAudited(audit)
    return audit
