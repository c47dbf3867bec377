"""A panel: a suite folder holding a subset of another suite's catalogs (for `--panel-catalogs`).

The panel keeps each catalog's manifest entry (weight, chance, exclusions, scoring) and its legs, and
writes the catalog's rows (and few-shot rows) as JSONL in suite order, so the same source and catalog
list always give the same bytes. The source is a suite folder or a bundle.

`prepare_panel` is the one place `--panel-catalogs` is applied, for `jex experiment` and `jex run` alike:
the catalogs' share of the full index's weight (checked against a declared share), then the panel folder.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jex.errors import InputError
from jex.fileio import atomic_open, write_toml
from jex.suite import SuiteManifest, SuiteRow, iter_fewshot_rows, iter_rows, load_manifest

FIELDS = ("run_id", "catalog", "question_id", "prompt", "options", "labels", "gold")
SHARE_TOLERANCE = 5e-4
"""How far a declared panel share may be from the computed one."""


@dataclass(frozen=True)
class Panel:
    """A panel written for a run: its suite folder and each catalog's share of the full index's weight."""

    suite: Path
    shares: dict[str, float]

    @property
    def share(self) -> float:
        return sum(self.shares.values())


def prepare_panel(source: str | Path, dest: str | Path, catalogs: Sequence[str], *,
                  declared_share: float | None = None) -> Panel:
    """The panel of `catalogs` of the suite at `source`: shares first (an unknown catalog, or a share
    more than SHARE_TOLERANCE from `declared_share`, is an `InputError` before anything is written)."""
    from jex.lab.experiment_stats import panel_share
    from jex.tasks.bundle.suite_table import load_suite_table

    try:
        spec = load_suite_table(source).spec
        shares = panel_share(spec, catalogs)
    except ValueError as e:
        raise InputError(str(e), field="panel_catalogs") from None
    generative = [c.id for c in spec.catalogs if c.id in catalogs and c.generative]
    if generative:
        raise InputError(f"catalog(s) {generative} are generative: a panel projects the fast pass and the "
                         "decisions of multiple-choice catalogs only", field="panel_catalogs")
    total = sum(shares.values())
    if declared_share is not None and abs(total - declared_share) > SHARE_TOLERANCE:
        raise InputError(f"the panel's share of the full weight is {total:.5f}, not the declared "
                         f"{declared_share}", field="panel_share")
    return Panel(suite=panel_suite(source, dest, catalogs), shares=shares)


def panel_projection(run_dir: str | Path, panel: Panel, *, draws: int, seed: int) -> dict[str, Any]:
    """A campaign run on `panel`, projected onto the full index as experiments project an arm: the final
    predictions against the fast-pass baseline on the same rows (paired, clustered, `draws` draws), each
    catalog's delta weighted by its share of the full weight (`project`), other catalogs unchanged."""
    import polars as pl

    from jex.lab.experiment_stats import paired_arms, project
    from jex.tasks.bundle.suite_table import load_suite_table
    from jex.tasks.decision_stages import fast_pass_predictions
    from jex.tasks.run_store import run_summaries

    s = run_summaries(run_dir)
    if s.overlay is None or s.fold is None:
        raise InputError("the run has no final predictions to project", file=str(run_dir))
    table = load_suite_table(panel.suite)
    final = pl.read_parquet(s.overlay.predictions).select(pl.exclude("stage"))
    fast = fast_pass_predictions(pl.read_parquet(s.fold.folded))
    _, stats = paired_arms(table.rows, table.spec, fast, {"campaign": final}, draws=draws, seed=seed)
    arm, projected = stats["campaign"], project(stats["campaign"], panel.shares)
    return {"catalogs": sorted(panel.shares), "shares": panel.shares, "share": panel.share,
            "panel_delta": arm.full.to_json(), "projected_full_delta": projected.to_json(), "draws": draws,
            "note": "final predictions minus the fast-pass baseline; panel_delta on the panel's own index, "
                    "projected_full_delta in full-index points (sum of share x catalog delta)"}


def _write_rows(path: Path, rows: Iterable[SuiteRow]) -> None:
    with atomic_open(path) as f:
        for r in rows:
            f.write(json.dumps(r.model_dump(exclude_none=True), sort_keys=True) + "\n")


def panel_suite(source: str | Path, dest: str | Path, catalogs: Sequence[str]) -> Path:
    """Write the panel of `catalogs` of the suite at `source` (folder or bundle) into `dest`."""
    source, dest = Path(source), Path(dest)
    if source.is_file():
        from jex.tasks.bundle.bundle_file import open_bundle

        with tempfile.TemporaryDirectory(prefix="jex-panel-") as tmp:
            return _panel_of_folder(open_bundle(source, tmp).root, dest, catalogs, from_bundle=True)
    return _panel_of_folder(source, dest, catalogs)


def _panel_of_folder(source: Path, dest: Path, catalogs: Sequence[str], *, from_bundle: bool = False) -> Path:
    manifest: SuiteManifest = load_manifest(source)
    ids = [c.id for c in manifest.catalogs]
    unknown = [c for c in catalogs if c not in ids]
    if unknown:
        raise InputError(f"panel catalog(s) {unknown} are not in the suite ({ids})", file=str(source / "suite.toml"),
                         field="panel_catalogs")
    keep = [c for c in manifest.catalogs if c.id in catalogs]
    legs = {c.leg: manifest.legs[c.leg] for c in keep}
    rows: dict[str, list[SuiteRow]] = {c.id: [] for c in keep}
    shots: dict[str, list[SuiteRow]] = {c.id: [] for c in keep}
    if from_bundle:
        import polars as pl

        for folder, into in (("rows", rows), ("fewshot", shots)):
            shards = sorted((source / folder).glob("shard-*.parquet"))
            frame = pl.read_parquet(shards) if shards else None
            for rec in frame.select(*FIELDS).iter_rows(named=True) if frame is not None else ():
                if rec["catalog"] in into:
                    into[rec["catalog"]].append(SuiteRow(**rec))
    else:
        for r in iter_rows(source, manifest):
            if r.catalog in rows:
                rows[r.catalog].append(r)
        for r in iter_fewshot_rows(source, manifest):
            if r.catalog in shots:
                shots[r.catalog].append(r)
    entries = []
    for c in keep:
        _write_rows(dest / "rows" / f"{c.id}.jsonl", rows[c.id])
        entry = c.manifest_entry()
        entry["files"] = [f"rows/{c.id}.jsonl"]
        if shots[c.id]:
            _write_rows(dest / "fewshot" / f"{c.id}.jsonl", shots[c.id])
            entry["fewshot_files"] = [f"fewshot/{c.id}.jsonl"]
        else:
            entry.pop("fewshot_files", None)
        entries.append({k: v for k, v in entry.items() if v != ()})
    write_toml(dest / "suite.toml", {"name": manifest.name + "-panel", "legs": legs, "catalogs": entries})
    return dest
