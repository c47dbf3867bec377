"""Stage cache keys are pinned: a refactor that changed how a key is hashed would silently miss every
stored stage (store and Prefect cache alike) and recompute it. A deliberate change (a stage
version bump) updates the pin."""

from __future__ import annotations

from jex.tasks.keys import STAGE_VERSIONS, stage_key

PINNED = {
    "bundle": "68a95db65eec021e30d0c416473ba297",
    "calibrate": "82818919b05f054921a40bae924cb96a",
    "compile_cache": "1d8f04f390828796e05fb87183397cbf",
    "fast_pass": "a0a8b9ac17aaf6922ba819b6c5ab3d62",
    "fold": "bcc67b09ee727a7dae0a9d716858a130",
    "gate": "7c47b2d0cce39207fc6af4a8e5d06d02",
    "overlay": "2bcb9ce898fc706492fed45b383b621c",
    "reason": "c419e7b0544255ff573e86c702b1cfaf",
    "report": "203fa147334901e1decf869a957f18b2",
    "score": "25c468bfe4b21cb7bbf9d29bd743dc49",
    "spec_proof_gate": "92b3f8ebf2e3ace37e6d9a6d07aab6e3",
}


def test_every_stage_key_hashes_as_pinned():
    keys = {stage: stage_key(stage, params={"max_tokens": 48, "mode": "label_slot"}, inputs={"bundle": "ab" * 32},
                             engine={"kind": "hf", "weights_sha256": "cd" * 32}) for stage in STAGE_VERSIONS}
    assert keys == PINNED
