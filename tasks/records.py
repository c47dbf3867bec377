"""Typed stage summaries: what one stage hands the next, what `_SUCCESS.json` holds. Small records of
paths, sha256s and counters, never frames. What a stage takes is its inputs record (`tasks/inputs.py`).

Every summary names its stage, its cache key, the sha256 of its main artifact, and (once the stage
is complete) its folder and the sha256 of every file in it. A summary read back from the store is
validated, so a stage folder written by other code is refused by name, not misread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypedDict, get_args

from pydantic import ConfigDict, Field, JsonValue

from jex.engine_identity import EngineFingerprint
from jex.record import Record
from jex.run_records import EngineStageName


class StageSummary(Record):
    stage: str
    key: str
    sha256: str = Field(description="sha256 of the stage's main artifact")
    folder: str = Field("", description="The stage folder (set when the stage is complete)")
    files: dict[str, str] = Field(default_factory=dict, description="sha256 of every file in the folder")

    def moved_to(self, folder: str | Path) -> Self:
        """The same summary with its folder, and every path under it, where the folder is now (a store
        moved, copied or pulled elsewhere: a stage folder is found by its key, its paths follow it)."""
        old, new = self.folder, str(folder)
        if not old or old == new:
            return self.model_copy(update={"folder": new})
        update = {name: new + value[len(old):] for name in type(self).model_fields
                  if isinstance(value := getattr(self, name), str) and (value == old or value.startswith(old + "/"))}
        return self.model_copy(update=update)


class BundleSummary(StageSummary):
    stage: Literal["bundle"] = "bundle"
    bundle: str = Field(description="The bundle tar.gz")
    rows: int = Field(description="Multiple-choice rows (what the fast pass reads)")
    generate_rows: int | None = Field(None, description="Generative rows (what the generate stage reads); absent "
                                                       "when the suite has none")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"generate_rows"})


class ShardWork(Record):
    """What one call of a sharded stage computed itself (the rest it reused or left to others)."""

    computed_shards: list[int] = Field(default_factory=list)
    compute_seconds: float = 0.0
    computed_rows: int = 0
    engine_start_seconds: float = Field(0.0, description="Seconds spent starting the engine for this work")
    stacks: list[dict[str, JsonValue]] = Field(
        default_factory=list, description="Provenance, never keyed: the engine stack that computed the shards as "
                                          "the engine reported it where it ran (`engine_stack`: versions of vLLM, "
                                          "torch, triton, CUDA, the driver, the GPU, VLLM_* settings, the engine "
                                          "profile), one entry per distinct stack")


class PartialSummary(ShardWork):
    """One of several processes sharing an engine stage: its own shards; another one merges."""

    stage: EngineStageName
    key: str
    partial: Literal[True] = True


class FastPassErrors(TypedDict):
    """The fast pass's error counters, disjoint (`tasks/capture/stages.py: fast_pass_error_counters`)."""

    context_refusals: int
    batch_errors: int
    readout_errors: int
    key_fallbacks: int


class ReasonErrors(TypedDict):
    """The reason stage's error counters, disjoint (`reason_error_counters`)."""

    context_refusals: int
    batch_errors: int
    mechanism_failures: int


class FailedRow(Record):
    """A row whose engine calls kept failing (`EngineError`) after every try the row retry policy allows
    (`tasks/capture/batch_errors.py`); its shard holds it as a `batch error` row."""

    run_id: str
    attempts: int = Field(description="Tries of the row on its own, over every computation of its stage")
    error_type: str = Field(description="The last error's type")
    error: str = Field(description="The last error's message (first line, 200 characters)")


class FailedRows(Record):
    """`shard-NNNNN.failed.json`, beside a shard that holds failed rows (`tasks/store.py`)."""

    rows: list[FailedRow]


class EngineStageSummary(StageSummary, ShardWork):
    """What both engine stages' summaries carry: rows, shards, the counters both count, the engine."""

    rows: int
    shards: int
    reused_shards: list[int] = Field(default_factory=list)
    context_refusals: int = 0
    batch_errors: int = 0
    engine: EngineFingerprint = Field(description="The engine fingerprint measured where the shards were computed")
    failed_rows: list[FailedRow] | None = Field(None, description="The rows behind `batch_errors`, in shard order; "
                                                                  "absent when none failed")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"failed_rows"})


class FastPassSummary(EngineStageSummary):
    stage: Literal["fast_pass"] = "fast_pass"
    capture: str = Field(description="capture.parquet: run_id, logprobs, label_mass, refusal")
    shard_rows: int
    readout_errors: int = 0
    key_fallbacks: int = 0

    def errors(self) -> FastPassErrors:
        return FastPassErrors(context_refusals=self.context_refusals, batch_errors=self.batch_errors,
                              readout_errors=self.readout_errors, key_fallbacks=self.key_fallbacks)


class RationaleTokens(Record):
    mean: float
    max: int
    hit_max_tokens: int


class ReasonSummary(EngineStageSummary):
    stage: Literal["reason"] = "reason"
    reasoned: str = Field(description="reasoned.parquet: rationale, token ids, post-thought readout")
    mechanism_failures: int = 0
    rationale_tokens: RationaleTokens

    def errors(self) -> ReasonErrors:
        return ReasonErrors(context_refusals=self.context_refusals, batch_errors=self.batch_errors,
                            mechanism_failures=self.mechanism_failures)


class GenerateErrors(TypedDict):
    """The generate stage's error counters, disjoint (`generate_error_counters`)."""

    context_refusals: int
    batch_errors: int


class ThoughtCounts(Record):
    """The thoughts of a reasoning catalog's generations (thought and answer share its max_tokens)."""

    generations: int = Field(description="Generations of the reasoning catalogs")
    mean: float = Field(description="Mean tokens of a thought (a thought never closed: every token)")
    max: int
    unclosed: int = Field(description="Generations that never closed their thought (read whole, as lm-eval reads "
                                      "them)")
    unclosed_at_max_tokens: int = Field(description="Of those, the ones that reached the token limit")


class GenerateSummary(EngineStageSummary):
    """Every generative row's continuations (the answers and verdicts are the score stage's)."""

    stage: Literal["generate"] = "generate"
    generated: str = Field(description="generated.parquet: run_id, generation, token ids, finish reason, refusal "
                                       "[, sample][, thought_tokens]")
    generated_tokens: RationaleTokens
    samples: int | None = Field(None, description="Generations in all, when a catalog samples (`rows` counts rows)")
    thinking: ThoughtCounts | None = Field(None, description="When a catalog thinks: its thoughts")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"failed_rows", "samples", "thinking"})

    def errors(self) -> GenerateErrors:
        return GenerateErrors(context_refusals=self.context_refusals, batch_errors=self.batch_errors)


class GateSummary(StageSummary):
    """The gated rows (the coverage gate's, or the speculative proof's sample of them)."""

    stage: Literal["gate", "spec_proof_sample"] = "gate"
    gated: str = Field(description="gated.parquet: the rows that get a rationale")
    rows: int
    coverage: float | None = None
    panel_rows: int | None = None
    max_margin: float | None = None


class FoldSummary(StageSummary):
    stage: Literal["fold"] = "fold"
    folded: str
    fold_json: str
    errors: dict[str, int]


class CalibrateSummary(StageSummary):
    stage: Literal["calibrate"] = "calibrate"
    calibrated: str
    calibration_json: str


class OverlaySummary(StageSummary):
    stage: Literal["overlay"] = "overlay"
    predictions: str
    applied: list[dict[str, Any]]


class ScoreSummary(StageSummary):
    stage: Literal["score"] = "score"
    score_json: str
    baseline_json: str
    full: float | None
    baseline_full: float | None
    reference_agreement: float | None = None
    reference: bool = False
    predictions: str | None = Field(None, description="predictions.parquet: the overlay's and the generative rows' "
                                                      "verdicts (absent when the suite has no generative catalog: "
                                                      "the overlay's predictions are the run's)")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"predictions"})


class StagePlan(Record):
    """Where an engine stage's shards go and how many there are (computed without loading an engine)."""

    stage: EngineStageName
    key: str
    folder: str
    shards_dir: str
    shards: int
    complete: bool
    engine: EngineFingerprint


class CampaignSummaries(Record):
    """The summaries of one campaign run, filled stage by stage (the flow's state)."""

    model_config = ConfigDict(frozen=False, extra="forbid")
    bundle: BundleSummary | None = None
    fast_pass: FastPassSummary | None = None
    gate: GateSummary | None = None
    reason: ReasonSummary | None = None
    spec_proof_sample: GateSummary | None = None
    spec_proof: ReasonSummary | None = None
    generate: GenerateSummary | None = None
    fold: FoldSummary | None = None
    calibrate: CalibrateSummary | None = None
    overlay: OverlaySummary | None = None
    score: ScoreSummary | None = None

    @classmethod
    def summary_type(cls, name: str) -> type[StageSummary]:
        """The summary record of stage `name` (a field of this record)."""
        annotation = cls.model_fields[name].annotation
        summary: type[StageSummary] = next(t for t in get_args(annotation) if t is not type(None))
        return summary

    def done(self) -> dict[str, StageSummary]:
        """The stages run so far, in campaign order."""
        return {name: s for name in type(self).model_fields if (s := getattr(self, name)) is not None}

    def finished(self) -> FinishedCampaign:
        """The summaries of a campaign whose every stage has run (raises naming a missing one)."""
        done = self.done()
        return FinishedCampaign.model_validate({k: v for k, v in done.items() if k in FinishedCampaign.model_fields})


class FinishedCampaign(Record):
    """Every stage summary of a finished campaign (what the run folder is written from)."""

    bundle: BundleSummary
    fast_pass: FastPassSummary
    gate: GateSummary
    reason: ReasonSummary
    generate: GenerateSummary | None = None
    fold: FoldSummary
    calibrate: CalibrateSummary
    overlay: OverlaySummary
    score: ScoreSummary
