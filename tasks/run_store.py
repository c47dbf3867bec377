"""Which store holds a run's stages: a run folder finds its store wherever both live now.

A run folder records the key and folder of every stage it used (`stages.json`). A stage folder is
named by its key (`<store>/<stage>/<key>`) and its content never depends on where it lies, so any
store holding the key serves the run. Looked in, in order: the store the user names (`--store`,
and then only it); else the store the run recorded (`campaign.json`) and the stores its stage
folders were in (a relative path, written by older runs, read against each folder above the run
folder), then the store beside the run folder (`OUT/store`: the default layout, and where `jex store
pull` puts a run). A stage recorded but held by none of them would be computed again: the flows
refuse that unless asked (`StoresLacking`), never silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import cast

from jex.errors import FlowError
from jex.run_records import RunStages
from jex.store_layout import SUCCESS
from jex.tasks.records import CampaignSummaries
from jex.tasks.store import LocalStore


class StoresLacking(FlowError):
    """Stages a run recorded are in none of the stores looked in."""


@dataclass(frozen=True)
class StoreSearch:
    """The stores looked in for a run's recorded stages, in order, and the first that holds them all."""

    run_dir: Path
    stages: RunStages
    looked_in: tuple[Path, ...]
    found: Path | None
    given: bool = False
    """Whether the user named the store (then it is the only one looked in, and the one used)."""

    @property
    def store(self) -> Path:
        """The store the run goes on with: the one named, else the one holding every recorded stage,
        else the first that exists (its missing stages to be pulled or computed again), else the one
        beside the run folder."""
        if self.given or self.found is not None:
            return self.looked_in[0] if self.given else cast(Path, self.found)
        return next((p for p in self.looked_in if p.is_dir()), self.run_dir.parent / "store")

    def missing(self, *, but: frozenset[str] = frozenset()) -> dict[str, str]:
        """Recorded stages (name -> `<stage>/<key>`) that `self.store` lacks, but those in `but`."""
        return lacking(self.store, self.stages, but=but)

    def refusal(self, missing: dict[str, str], *, recompute_flag: bool = True) -> StoresLacking:
        """One line: what is missing, where jex looked, and the ways on."""
        shown = ", ".join(f"{name} ({rel.split('/')[-1][:12]})" for name, rel in missing.items())
        others = [str(p) for p in self.looked_in if p != self.store]
        return StoresLacking(
            f"run {self.run_dir}: stage(s) {shown} are recorded in its stages.json but not in the store {self.store}"
            + (f" (also looked in {', '.join(others)})" if others else "")
            + ": point at the store that holds them with --store DIR (or bring them back with `jex store pull`)"
            + (", or pass --recompute to compute them again" if recompute_flag else ""))


def lacking(store: Path, stages: RunStages, *, but: frozenset[str] = frozenset()) -> dict[str, str]:
    """The recorded stages (name -> `<stage>/<key>`) whose complete folder `store` does not hold."""
    return {name: rec.in_store for name, rec in stages.root.items()
            if name not in but and not (store / rec.in_store / SUCCESS).is_file()}


def _anchored(path: Path, run_dir: Path) -> list[Path]:
    """An absolute path as it is; a relative one (older runs) under each folder above the run folder
    where it exists, else from here."""
    if path.is_absolute():
        return [path]
    return [a / path for a in run_dir.parents if (a / path).exists()] or [path.absolute()]


def find_run_store(run_dir: str | Path, *, given: str | Path | None = None,
                   recorded: str | Path | None = None) -> StoreSearch:
    """Look for the store of a run folder: only `given` when the user named one; else `recorded` (the
    campaign's store), the stores of the recorded stage folders, and the store beside the run folder."""
    run_dir = Path(run_dir).absolute()
    stages = RunStages.read(run_dir)
    if given is not None:
        candidates = [Path(given).expanduser().absolute()]
    else:
        named = [Path(recorded).expanduser()] if recorded else []
        named += [Path(rec.folder).parent.parent for rec in stages.root.values()]
        candidates = [p for path in named for p in _anchored(path, run_dir)] + [run_dir.parent / "store"]
    looked_in = tuple(dict.fromkeys(p.absolute() for p in candidates))
    found = next((p for p in looked_in if not lacking(p, stages)), None)
    return StoreSearch(run_dir, stages, looked_in, found, given=given is not None)


def run_summaries(run_dir: str | Path, *, store: str | Path | None = None) -> CampaignSummaries:
    """The stage summaries a run used, read from the store that holds them now (`find_run_store`), their
    paths where that store lies; `StoresLacking` naming the stores looked in when none holds them all."""
    search = find_run_store(run_dir, given=store)
    if search.found is None:
        raise search.refusal(search.missing(), recompute_flag=False)
    held = LocalStore(search.found)
    summaries = CampaignSummaries()
    for name, rec in search.stages.root.items():
        stage, key = rec.in_store.split("/")
        setattr(summaries, name, held.stage(stage, key).read(CampaignSummaries.summary_type(name)))
    return summaries
