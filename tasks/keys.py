"""Stage cache keys: what a stage's output depends on, hashed.

key = sha256(stage name, stage code version, parameters, sha256 of every input artifact, engine
fingerprint). Never the request alone: changing the model, the render, the engine profile or the
stage code changes exactly the keys downstream of the change.
"""

from __future__ import annotations

from typing import Any

from jex.fileio import sha256_json

# Bump a stage's version when its code changes what it writes.
STAGE_VERSIONS = {"bundle": 1, "fast_pass": 2, "gate": 1, "reason": 2, "fold": 2, "calibrate": 1,
                  "overlay": 1, "score": 2, "report": 1, "spec_proof_gate": 1, "compile_cache": 1}


def stage_key(stage: str, *, params: dict[str, Any], inputs: dict[str, str],
              engine: dict[str, Any] | None = None) -> str:
    doc = {"stage": stage, "version": STAGE_VERSIONS[stage], "params": params, "inputs": inputs,
           "engine": engine}
    return sha256_json(doc)[:32]
