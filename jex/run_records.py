"""The run folder's own records, written and read through these models, never by key.

A campaign's run folder holds, beside its products (`predictions.parquet`, `score.json`, ...):
- `campaign.json`: the campaign spec (the flows room's `CampaignSpec`; what the rooms below flows read of
  it, the engine and the bootstrap draws, is `RecordedCampaign`);
- `stages.json`: `RunStages`, one `StageRecord` per stage the run used: its key, its folder in the
  store, its seconds. A stage folder is named by its key (`<store>/<stage>/<key>`), so the record
  finds the folder in any store that holds the key (`StageRecord.in_store`), wherever the store lives now;
- `engine_calls.json`: `EngineCalls`, the shards the run sent to an engine, by stage.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, RootModel

from jex.engine_spec import EngineSpec
from jex.fileio import write_json
from jex.record import Record

StageName = Literal["bundle", "fast_pass", "gate", "reason", "generate", "fold", "calibrate", "overlay", "score"]
"""The campaign's stages, in order (what `retry-stage` and `redo` name; `generate` runs only in a campaign of a
suite with generative catalogs)."""
STAGE_NAMES: tuple[StageName, ...] = get_args(StageName)
ProofStageName = Literal["spec_proof_sample", "spec_proof"]
"""The stages a speculative profile adds (its proof's sample of the gated rows and their base rationales)."""
RecordedStage = StageName | ProofStageName
EngineStageName = Literal["fast_pass", "reason", "generate"]
ENGINE_STAGES: tuple[EngineStageName, ...] = get_args(EngineStageName)
"""The stages that call the engine: a runner computes their shards, and a retry of one computes only its
failed rows again."""

STAGES_FILE = "stages.json"
ENGINE_CALLS_FILE = "engine_calls.json"
CAMPAIGN_FILE = "campaign.json"


class StageRecord(Record):
    """One stage of a run: which folder of the store it used, found again by its key."""

    key: str
    folder: str = Field(description="The stage folder when the run used it: <store>/<stage>/<key>")
    seconds: float = Field(0.0, description="Wall seconds the stage took in the run that recorded it")

    @property
    def in_store(self) -> str:
        """`<stage>/<key>`: where the folder lies in any store that holds it."""
        return "/".join(Path(self.folder).parts[-2:])


class RunStages(RootModel[dict[RecordedStage, StageRecord]]):
    """`stages.json`: the stages a run used, in campaign order."""

    root: dict[RecordedStage, StageRecord] = Field(default_factory=dict)

    @classmethod
    def read(cls, run_dir: str | Path) -> RunStages:
        """The run folder's record; empty when the run recorded no stage yet."""
        path = Path(run_dir) / STAGES_FILE
        return cls.model_validate_json(path.read_bytes()) if path.is_file() else cls()

    def write(self, run_dir: str | Path) -> None:
        write_json(Path(run_dir) / STAGES_FILE, self.model_dump(mode="json"))

    def seconds(self) -> float:
        """The stages' wall seconds, summed."""
        return math.fsum(s.seconds for s in self.root.values())


class RecordedMachines(BaseModel):
    """What the exports read of the campaign's `machines` table: where its engine stages ran."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    provider: str


class RecordedCampaign(BaseModel):
    """What the rooms below the flows read of a run's `campaign.json` (the exports: the engine, the
    bootstrap draws, the coverage and where the engine ran; parity against a run: its rationale length); the
    spec's other fields are the flows room's (`CampaignSpec`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    engine: EngineSpec
    bootstrap_draws: int
    reason_max_tokens: int
    coverage: float
    machines: RecordedMachines

    @classmethod
    def read(cls, run_dir: str | Path) -> RecordedCampaign:
        return cls.model_validate_json((Path(run_dir) / CAMPAIGN_FILE).read_bytes())


class EngineCalls(Record):
    """`engine_calls.json`: what a run asked of engines. `calls` counts the shards computed by engines
    anywhere (machines, worker processes, this process); `in_process` those this process computed."""

    redo: list[StageName] = Field(default_factory=list, description="Stages computed again on purpose")
    retired: list[str] = Field(default_factory=list, description="Stage folders set aside for `redo`")
    in_process: dict[EngineStageName, int]
    calls: dict[EngineStageName, int]

    @classmethod
    def read(cls, run_dir: str | Path) -> EngineCalls:
        return cls.model_validate_json((Path(run_dir) / ENGINE_CALLS_FILE).read_bytes())

    def write(self, run_dir: str | Path) -> None:
        write_json(Path(run_dir) / ENGINE_CALLS_FILE, self.model_dump(mode="json"))

    def total(self) -> int:
        return sum(self.calls.values())
