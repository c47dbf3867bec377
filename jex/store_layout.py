"""Where things lie in a store: the one declaration every room that reads or writes a store follows (the
stages, the S3 mirror, the machines' jobs).

    <store>/<stage>/<key>/                      a stage folder, named by its inputs' key
        _SUCCESS.json                           its summary, written last: the folder is complete
        _PROVENANCE.json                        what computed it (versions, commit), never in a key
        shards-<rows>/shard-NNNNN.parquet       an engine stage's shards of <rows> rows
    <store>/bundle/<key>/extracted/             a bundle's members, extracted once per store
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
