"""Stage cache keys are pinned: a refactor that changed how a key is hashed would silently miss every
stored stage (store and Prefect cache alike) and recompute it. A deliberate change (a stage
version bump) updates the pin."""

from __future__ import annotations

from jex.engine.fingerprint import EngineFingerprint, RenderDigest
from jex.engine_spec import EngineSpec
from jex.tasks.inputs import FastPassInputs, GateInputs, ReasonInputs
from jex.tasks.keys import STAGE_VERSIONS, stage_key
from jex.tasks.records import BundleSummary, FastPassSummary, GateSummary

PINNED = {
    "bundle": "b5e24ba2da9a7d5cd21e8566a68d0a01",
    "calibrate": "bf96c99012a95db5f1f27b34237db4b2",
    "compile_cache": "d5f1557e71d6aa733cc2d3bf2bae851c",
    "fast_pass": "d489d8d184a14a6db9bacedfca6e4935",
    "fold": "e244b03fcfa1801fc4419e7f895c6335",
    "gate": "4ce47151fa5bae9cf149e460f1ce6839",
    "generate": "e2cdb350489b00e29c68711aa03546d1",
    "golden": "90616bdc9767f11d9bbe3c08b8c51d60",
    "overlay": "38e2a312b0ce886a2e602a55550ef581",
    "reason": "ff71dc182b1f5642476515a7c63767f5",
    "report": "c84540d60b0c345eb90f77952a7a1bed",
    "score": "f8b194c3f81f8ad2c108942372654822",
    "spec_proof_sample": "d14298cb8f1afbc48a51be34248fe177",
}
FP = EngineFingerprint(kind="hf", engine_version=1, weights_sha256="cd" * 32, tokenizer_sha256="ef" * 32,
                       device_type="cpu", renderer=RenderDigest(version="jex-render/2", sha256="01" * 32))
BUNDLE = BundleSummary(key="k", sha256="ab" * 32, bundle="b.tar.gz", rows=9)


def test_every_stage_key_hashes_as_pinned():
    keys = {stage: stage_key(stage, {"max_tokens": 48, "bundle": "ab" * 32, "engine": FP.key_doc()})
            for stage in STAGE_VERSIONS}
    assert keys == PINNED


def test_the_engine_stage_records_hash_as_pinned():
    fast = FastPassInputs(bundle=BUNDLE, engine=EngineSpec(), engine_fp=FP)
    gated = GateSummary(key="k", sha256="12" * 32, gated="g.parquet", rows=3)
    reason = ReasonInputs(bundle=BUNDLE, gate=gated, engine=EngineSpec(), engine_fp=FP, max_tokens=48)
    capture = FastPassSummary(key="k", sha256="34" * 32, capture="c.parquet", shard_rows=4, rows=9, shards=1,
                              engine=FP)
    gate = GateInputs(bundle=BUNDLE, fast=capture, coverage=0.1)
    assert (fast.key(), reason.key(), gate.key()) == (
        "fcebb41aa6a0d816c220b96484f7bb07", "dbe113c0bea07761e8c3394191bbc48a", "0ad0fda40b5ea86ec37cfbbebb60e317")
