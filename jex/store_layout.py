"""Where things lie in a store: the one declaration every room that reads or writes a store follows (the
stages, the S3 mirror, the machines' jobs).

    <store>/<stage>/<key>/                      a stage folder, named by its inputs' key
        _SUCCESS.json                           its summary, written last: the folder is complete
        _PROVENANCE.json                        what computed it (versions, commit), never in a key
        shards-<rows>/shard-NNNNN.parquet       an engine stage's shards of <rows> rows
    <store>/bundle/<key>/extracted/             a bundle's members, extracted once per store
    <store>/golden/<bundle>/<key>/reference.parquet              the golden replay's reference readout
    <store>/golden/<bundle>/generation/<key>/reference.parquet   its reference greedy generation
    <store>/bakeoff/<key>/                      a settings audit's bake-off (`bakeoff.json`, ...)
    <store>/compile_cache/<key>/                an engine's compile cache on a kind of machine
    <store>/.machines/<machine>/<job>/          a machine job's inbox (its inputs and collected files)
"""

from __future__ import annotations

from pathlib import Path

SUCCESS = "_SUCCESS.json"
PROVENANCE = "_PROVENANCE.json"
"""What computed a stage folder (jex commit, package versions, the keyed inputs): beside the artifacts,
never in a key."""


def stage_dir(root: str | Path, stage: str, key: str) -> Path:
    return Path(root) / stage / key


SHARD_FOLDERS = "shards-*"
"""Every shard folder of a stage folder (a glob)."""


def shards_dir(stage_folder: str | Path, shard_rows: int) -> Path:
    """An engine stage's shards (their size names the folder: shards of another size are other files)."""
    return Path(stage_folder) / f"shards-{shard_rows}"


def shard_file(shards: str | Path, shard: int) -> Path:
    return Path(shards) / f"shard-{shard:05d}.parquet"


def extracted_bundle(root: str | Path, bundle_key: str) -> Path:
    """Where the stages read a bundle's rows: extracted once per store, beside its stage folder."""
    return stage_dir(root, "bundle", bundle_key) / "extracted"


def golden_dir(root: str | Path, bundle_key: str) -> Path:
    """Every golden reference of a bundle: readouts under `<key>/`, generations under `generation/<key>/`."""
    return Path(root) / "golden" / bundle_key


def bakeoff_dir(root: str | Path, key: str) -> Path:
    """A settings audit's bake-off, named by what it audits (`flows/machines/audit.py: audit_key`)."""
    return Path(root) / "bakeoff" / key


def compile_cache_dir(root: str | Path, key: str) -> Path:
    """An engine's compile cache on a kind of machine (`tasks/execution/engine_pool.py: compile_cache_key`)."""
    return Path(root) / "compile_cache" / key


def machine_inbox(root: str | Path, machine: str, job: str) -> Path:
    """A machine job's inbox in the orchestrator's store: the job's inputs, and what it collected."""
    return Path(root) / ".machines" / machine / job
