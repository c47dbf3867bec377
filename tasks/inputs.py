"""One typed record per stage: the single declaration of what the stage takes.

The record drives everything: its key (`StageInputs.key()`, from all of its fields), the stage's body
(`CachedStage.run(store, inputs)`), its Prefect task (`tasks/prefect_tasks.py`: the task takes the
record and caches on its key) and, for the engine stages, the machine job that carries it
(`EngineJob`: what `jex stage run --args` reads, what a worker process or an engine host reads). The
flow builds each record once. A field that does not change the output is marked `Unkeyed(why)`; a
field that enters the key in another form is marked `KeyedBy(how, why)`; every other field enters
the key as its value (a stage summary by its artifact's sha256). `tests/test_stage_inputs.py` walks
every record and shows that each keyed field changes the key and no unkeyed one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator

from jex.engine.fingerprint import engine_fingerprint
from jex.engine_identity import EngineFingerprint
from jex.engine_spec import EngineSpec
from jex.errors import InputError
from jex.fileio import sha256_file
from jex.overlays.rules import OverlayRuleBase
from jex.settings import GOLDEN_ROWS, PROOF_ROWS
from jex.tasks.keys import KeyDoc, KeyedBy, KeyedThrough, KeyedWhenSet, Unkeyed, keyed_value, stage_key
from jex.tasks.records import (
    BundleSummary,
    CalibrateSummary,
    FastPassSummary,
    FoldSummary,
    GateSummary,
    GenerateSummary,
    OverlaySummary,
    ReasonSummary,
    Record,
)

SHARDS_MERGE = Unkeyed("shards merge to the same bytes whatever their size")
FAST_SHARD_ROWS = 32
REASON_SHARD_ROWS = 64
"""Rows per reason shard (the unit of a checkpoint and of a machine's work): the HF engine decodes a
shard's rows in lock-step, so a larger shard reads the weights fewer times per token (the main job's 36
rationales in one shard: 1.7x shards of 8)."""
GENERATE_SHARD_ROWS = 64
"""Rows per generate shard: as the reason stage's (lock-step decoding on the CPU)."""
GPU_SHARDS_PER_ENGINE = 8
"""On a GPU a stage's rows are cut into about this many shards per engine: each a checkpoint of seconds, and
enough of them that engines which start late still share the work (claims, first come first served)."""
GPU_SHARD_MAX_ROWS = 4096


def gpu_shard_rows(rows: int, engines: int, floor: int, fill: int = 0) -> int:
    """Rows per shard of a stage on GPU engines: the stage's `rows` split into GPU_SHARDS_PER_ENGINE shards
    per engine, at least `floor` (the CPU size) and at most GPU_SHARD_MAX_ROWS. vLLM's scheduler batches
    within a shard, so a shard of CPU size (32 rows) leaves the GPU idle between calls. A generating stage
    passes `fill`, the scheduler's sequences: its shards hold at least that many rows (up to an engine's
    share), since each shard decodes to its longest row and a smaller one leaves decode slots empty."""
    engines = max(1, engines)
    split = max(floor, min(GPU_SHARD_MAX_ROWS, -(-rows // (engines * GPU_SHARDS_PER_ENGINE))))
    return max(split, min(fill, GPU_SHARD_MAX_ROWS, -(-rows // engines)))


FP_MEASURED = KeyedThrough("engine", "the fingerprint measured where the shards are computed replaces this "
                                      "process's in the `engine` entry")


class StageInputs(Record):
    """What a stage takes; `key()` hashes every field by its marker (module docstring)."""

    stage: str

    def key_doc(self) -> KeyDoc:
        """The inputs as they enter the key: every field but the unkeyed ones and `stage` (the name)."""
        doc: KeyDoc = {}
        for name, field in type(self).model_fields.items():
            marker = next((m for m in field.metadata
                           if isinstance(m, Unkeyed | KeyedBy | KeyedThrough | KeyedWhenSet)), None)
            if name == "stage" or isinstance(marker, Unkeyed | KeyedThrough):
                continue
            if isinstance(marker, KeyedWhenSet) and getattr(self, name) is None:
                continue
            doc[name] = marker.by(self) if isinstance(marker, KeyedBy) else keyed_value(getattr(self, name))
        return doc

    def key(self) -> str:
        return stage_key(self.stage, self.key_doc())


# -- bundle ----------------------------------------------------------------------------------------
def suite_content(suite_dir: str | Path) -> dict[str, str]:
    """sha256 of every file a bundle is built from (the suite manifest and the files it lists), or of
    a bundle file given as it was built (`{"bundle": sha256}`)."""
    from jex.suite import MANIFEST_NAME, load_manifest
    from jex.tasks.bundle.bundle_file import suite_files

    folder = Path(suite_dir)
    if folder.is_file():
        return {"bundle": sha256_file(folder)}
    files = [folder / MANIFEST_NAME, *suite_files(folder, load_manifest(folder))]
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def file_content(path: str | Path | None) -> str | None:
    """sha256 of a file's bytes (None for no file): how a file given by its path enters an identity."""
    return sha256_file(path) if path else None


def engine_content(engine: EngineSpec) -> JsonValue:
    """What an engine's numbers depend on, as content: its fingerprint's key (weights, tokenizer, render,
    kind, dtype, the settings that change numbers), never the model's path, the cache folder or the device
    index. A Hub model not on this machine (its machines download it) enters by its id and revision."""
    from jex.engine.models import HUB_ID
    from jex.engine.types import EngineDeadError

    try:
        return engine_fingerprint(engine).key_doc()
    except EngineDeadError as e:
        if engine.is_served() or not (engine.model and HUB_ID.match(engine.model) and not Path(engine.model).exists()):
            raise InputError(str(e), field="engine.model") from None
        return {"hub": engine.model, "spec": engine.model_dump(mode="json", exclude={"model", "cache_dir", "device"})}


class BundleInputs(StageInputs):
    stage: Literal["bundle"] = "bundle"
    suite: Annotated[str, KeyedBy(lambda i: suite_content(i.suite), "by the content of the suite's files")]
    reference: Annotated[str | None, KeyedBy(lambda i: sha256_file(i.reference) if i.reference else None,
                                             "by the reference rows file's content")] = None

    @field_validator("suite", "reference", mode="before")
    @classmethod
    def _path_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value

    @model_validator(mode="after")
    def _reference_of_a_bundle(self) -> BundleInputs:
        if self.reference and Path(self.suite).is_file():
            raise ValueError(f"{self.suite} is a bundle: its reference rows are inside it (build it with `jex "
                             f"bundle build --reference`); a separate reference file is refused")
        return self


# -- engine stages ---------------------------------------------------------------------------------
class EngineStageInputs(StageInputs):
    """What both engine stages take: the rows (a bundle), the engine, and how shards are cut."""

    bundle: BundleSummary
    engine: EngineSpec
    engine_fp: Annotated[EngineFingerprint | None, FP_MEASURED] = None
    shard_rows: Annotated[int, SHARDS_MERGE] = Field(FAST_SHARD_ROWS, ge=1)

    def fingerprint(self) -> EngineFingerprint:
        """The fingerprint measured where the shards are computed, else this process's."""
        return self.engine_fp or engine_fingerprint(self.engine)


class FastPassInputs(EngineStageInputs):
    stage: Literal["fast_pass"] = "fast_pass"
    engine: Annotated[EngineSpec, KeyedBy(lambda i: i.fingerprint().audited().key_doc(),
                                          "by its audited fingerprint: speculation changes only generation")]


class ReasonInputs(EngineStageInputs):
    stage: Literal["reason"] = "reason"
    engine: Annotated[EngineSpec, KeyedBy(lambda i: i.fingerprint().key_doc(), "by its fingerprint")]
    gate: GateSummary = Field(description="The rows to reason on (the coverage gate's, or the proof sample)")
    max_tokens: int = Field(ge=1, description="Rationale length limit")
    shard_rows: Annotated[int, SHARDS_MERGE] = Field(REASON_SHARD_ROWS, ge=1)


class GenerateInputs(EngineStageInputs):
    """Every generative row of the bundle, continued greedily with its catalog's stop sequences and token
    limit (both in the bundle's suite.toml, so in its sha256)."""

    stage: Literal["generate"] = "generate"
    engine: Annotated[EngineSpec, KeyedBy(lambda i: i.fingerprint().key_doc(), "by its fingerprint")]
    shard_rows: Annotated[int, SHARDS_MERGE] = Field(GENERATE_SHARD_ROWS, ge=1)


EngineInputs = Annotated[FastPassInputs | ReasonInputs | GenerateInputs, Field(discriminator="stage")]


class EngineJob(Record):
    """An engine stage to compute somewhere else: `jex stage run --args JOB.json` on a machine, a
    data-parallel worker process, an engine host's request."""

    inputs: EngineInputs
    store: str

    def with_paths(self, *, store: str, bundle: str, gated: str | None = None) -> EngineJob:
        """The same job with its files elsewhere (a machine's job folder): the key does not change, as
        files enter it by their content."""
        inputs = self.inputs
        update: dict[str, Any] = {"bundle": inputs.bundle.model_copy(update={"bundle": bundle})}
        if isinstance(inputs, ReasonInputs) and gated is not None:
            update["gate"] = inputs.gate.model_copy(update={"gated": gated})
        return EngineJob(inputs=inputs.model_copy(update=update), store=store)

    def resolved(self, base: Path) -> EngineJob:
        """The job with its relative paths (store, bundle, gated rows) made absolute against `base`."""
        def under(path: str) -> str:
            return str(path if Path(path).is_absolute() else (base / path).resolve())

        gated = under(self.inputs.gate.gated) if isinstance(self.inputs, ReasonInputs) else None
        return self.with_paths(store=under(self.store), bundle=under(self.inputs.bundle.bundle), gated=gated)



class GoldenInputs(StageInputs):
    """The golden replay's rows: the bundle's first `rows` rows read by the engine (a machine's
    pre-flight, `tasks/capture/golden.py`); keyed like the fast pass, whose readout it repeats."""

    stage: Literal["golden"] = "golden"
    bundle: BundleSummary
    engine_fp: Annotated[EngineFingerprint, KeyedBy(lambda i: i.engine_fp.audited().key_doc(),
                                                    "by its audited fingerprint, as the fast pass")]
    rows: int = Field(ge=1)


# -- decision stages -------------------------------------------------------------------------------
class GateInputs(StageInputs):
    stage: Literal["gate"] = "gate"
    bundle: BundleSummary
    fast: FastPassSummary
    coverage: float = Field(ge=0, le=1, description="Share of rows gated for a rationale")
    per_catalog_cap: float | None = Field(None, gt=0, le=1, description="Max gated share of one catalog")
    sample_every: int | None = Field(None, ge=1, description="Gate only the questions with crc32(question_id) "
                                                             "% k == 0 (a stratified sample; the budget projection)")


class ProofSampleInputs(StageInputs):
    """The speculative proof's sample of the gated rows (`tasks/capture/spec_proof.py`)."""

    stage: Literal["spec_proof_sample"] = "spec_proof_sample"
    bundle: BundleSummary
    gate: GateSummary
    rows: int = Field(PROOF_ROWS, ge=1)
    golden_rows: int = Field(GOLDEN_ROWS, ge=0, description="Leading rows of the bundle (the golden replay's) "
                                                           "proved first")


class FoldInputs(StageInputs):
    stage: Literal["fold"] = "fold"
    bundle: BundleSummary
    fast: FastPassSummary
    gate: GateSummary
    reason: ReasonSummary
    rule: Literal["replace", "mix"]
    weight: float = Field(ge=0, le=1)
    draws: int = Field(ge=1)
    seed: int


class CalibrateInputs(StageInputs):
    stage: Literal["calibrate"] = "calibrate"
    bundle: BundleSummary
    fold: FoldSummary
    folds: int = Field(ge=2)


class OverlayInputs(StageInputs):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    stage: Literal["overlay"] = "overlay"
    calibrated: CalibrateSummary
    rules: Annotated[list[OverlayRuleBase], KeyedBy(lambda i: [r.record() for r in i.rules]
                                                    + (["unverified"] if i.unverified else []),
                                                    "by each rule's record (kind and parameters), and "
                                                    "whether they are applied unverified")] = []
    rules_sha256: str | None = Field(None, description="sha256 of the rule file the rules came from")
    unverified: Annotated[bool, KeyedThrough("rules", "an unverified application adds its mark to the rules' "
                                                      "entry (absent otherwise: keys of verified runs unchanged)")] = \
        Field(False, description="Applied with --unverified-overlays: some rule has no passed gate record; its "
                                 "rows are marked `overlay-unverified:<id>`")

    @classmethod
    def from_file(cls, calibrated: CalibrateSummary, rules_file: str | None, *,
                  unverified: bool = False) -> OverlayInputs:
        """The enabled rules of a TOML rule file (none without a file)."""
        from jex.overlays.loading import load_rules

        rules, sha = load_rules(rules_file)
        return cls(calibrated=calibrated, rules=rules, rules_sha256=sha, unverified=unverified and bool(rules))


class ScoreInputs(StageInputs):
    stage: Literal["score"] = "score"
    bundle: BundleSummary
    overlay: OverlaySummary
    fold: FoldSummary
    draws: int = Field(ge=1)
    seed: int
    generated: Annotated[GenerateSummary | None, KeyedWhenSet("by its artifact's sha256; absent from the key "
                                                              "without generative catalogs")] = None


STAGE_INPUTS: tuple[type[StageInputs], ...] = (BundleInputs, FastPassInputs, ReasonInputs, GenerateInputs, GoldenInputs,
                                               GateInputs, ProofSampleInputs, FoldInputs, CalibrateInputs,
                                               OverlayInputs, ScoreInputs)
"""Every stage's inputs record (the key-coverage test walks them all)."""
