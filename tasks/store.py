"""The local artifact store: content-addressed stage folders, atomic shards, completion records.

Layout: `<root>/<stage>/<key>/...` where `key` is the stage's cache key (see `keys.py`). A stage
folder is complete when `_SUCCESS.json` exists; it is written last, with the sha256 of every file,
so a crash leaves at worst some finished shards (reused on resume) and never a half-written one.
Copying a store to S3 and back is the infra room's job (`infra/`); the stages only see paths.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import polars as pl

from jex.engine.types import RefusalKind
from jex.fileio import atomic_path, sha256_file, write_json
from jex.provenance import ProvenanceBlock
from jex.run_records import EngineStageName
from jex.store_layout import PROVENANCE, SHARD_FOLDERS, SUCCESS, extracted_bundle, shard_file, stage_dir
from jex.tasks.records import FailedRow, FailedRows, PartialSummary, StageSummary

S = TypeVar("S", bound=StageSummary)


@dataclass(frozen=True)
class StageDir:
    """`<root>/<stage>/<key>/`: one stage's folder in the store."""

    path: Path

    @property
    def stage(self) -> str:
        return self.path.parent.name

    @property
    def key(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        return (self.path / SUCCESS).exists()

    def read(self, kind: type[S]) -> S:
        """The completion record, validated as `kind`, its paths where this folder is now."""
        return kind.model_validate_json((self.path / SUCCESS).read_text()).moved_to(self.path)

    def finish(self, summary: S, provenance: ProvenanceBlock | None = None) -> S:
        """Record the provenance, every file's sha256 and the summary; this marks the stage complete."""
        if provenance is not None:
            write_json(self.path / PROVENANCE, provenance)
        files = {p.relative_to(self.path).as_posix(): sha256_file(p) for p in sorted(self.path.rglob("*"))
                 if p.is_file() and p.name not in (SUCCESS, PROVENANCE) and not p.name.startswith(".")}
        done = summary.model_copy(update={"files": files, "folder": str(self.path)})
        write_json(self.path / SUCCESS, done.model_dump(mode="json"))
        return done


class LocalStore:
    """A store folder on this machine. Its root is absolute, so every path a stage records names the
    folder from anywhere (a run resumed from another working folder reads the same store)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().absolute()

    def stage(self, stage: str, key: str) -> StageDir:
        path = stage_dir(self.root, stage, key)
        path.mkdir(parents=True, exist_ok=True)
        return StageDir(path)

    def holds(self, stage: str, key: str) -> bool:
        """Whether the store holds the complete folder of `stage` under `key` (nothing is created)."""
        return (stage_dir(self.root, stage, key) / SUCCESS).is_file()

    def extracted_bundle(self, bundle_key: str) -> Path:
        """Where the stages read a bundle's rows (`jex.store_layout.extracted_bundle`)."""
        return extracted_bundle(self.root, bundle_key)


def write_parquet(frame: pl.DataFrame, path: Path) -> None:
    """Deterministic Parquet, atomically: fixed compression, no statistics, one row group, so the bytes
    depend only on the data and the polars version."""
    with atomic_path(path) as tmp:
        frame.write_parquet(tmp, compression="zstd", compression_level=9, statistics=False,
                            row_group_size=max(len(frame), 1))


@dataclass(frozen=True)
class ShardStats:
    shards: int
    computed: list[int]
    reused: list[int]
    compute_seconds: float = 0.0
    """Wall seconds spent computing the shards this call computed (reused ones cost nothing)."""
    computed_rows: int = 0
    start_seconds: float = 0.0
    """Wall seconds `prepare` (the engine start) took in this call, off the compute clock."""


@dataclass(frozen=True)
class ShardRows:
    """What `run_sharded`'s `compute` may return instead of a frame: the frame (one row per item, in order,
    with a `run_id` column) and the records of its rows that failed (kept beside the shard, `failed_path`)."""

    frame: pl.DataFrame
    failed: list[FailedRow] = field(default_factory=list)


def row_id(item: Any) -> str:
    """An item's id: its `run_id`, or the item itself as text."""
    return str(getattr(item, "run_id", item))


def run_sharded(items: Sequence[Any], *, shard_rows: int, folder: Path,
                compute: Callable[[Any], pl.DataFrame | ShardRows], worker: int = 0, workers: int = 1,
                on_shard: Callable[[int, int], None] | None = None,
                prepare: Callable[[], Any] | None = None, claim: bool = False,
                prepare_chunk: Callable[[Sequence[Any]], Any] | None = None, prepare_ahead: bool = True) -> ShardStats:
    """Compute `items` in shards of `shard_rows`, each written atomically as `shard-NNNNN.parquet`.

    Shards that exist are reused (a crashed run resumes at the first missing shard). With several
    workers, worker w takes shards w, w+N, w+2N, ...; `merge_shards` gives the same bytes whatever
    the split, as long as each row's result does not depend on its neighbours (batch invariance).
    `prepare` (an engine start) runs once, before the first shard to compute and off the clock, so
    `compute_seconds` is the work alone; it never runs when every shard exists.

    With `claim`, several processes share the same shards (the engine processes of one machine):
    each shard goes to whoever claims it first (`.shard-NNNNN.claim`, holding the claimer's pid), so
    an engine that starts late or runs slow takes fewer shards. A claim whose process is gone is
    taken over; at worst a shard is computed twice, to the same bytes.

    With `prepare_chunk`, `compute` gets `prepare_chunk(chunk)` instead of the chunk (the CPU side of a
    shard, such as its prompts rendered and tokenised). With `prepare_ahead` one background thread
    prepares the next shard this call computes while `compute` runs on the current one; that shard is
    claimed before it is prepared, so a call holds at most one claim beyond the shard it computes (at the
    end of a stage, the last shard may wait for a busy engine while another is free), and gives it back
    if it fails before reaching it. An exception from `prepare_chunk` is raised at its
    shard's turn, as `compute` would raise it: the shards before it are written, none after it is begun.

    Failed rows (`compute` returns `ShardRows` with some): their record (`shard-NNNNN.failed.json`) is
    written before the shard, so a shard never exists without it. A finished shard is reused as it is,
    failed rows included; a missing shard whose partial and record lie beside it (`carry_failed_rows`: a
    retry of the stage) is computed from its failed rows alone, spliced into the partial in order (the
    same bytes as the whole shard, by batch invariance), their attempts added to the record's.
    """
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = (len(items) + shard_rows - 1) // shard_rows
    run = _ShardRun(items, shard_rows, folder, range(worker, n_shards, workers), claim, on_shard, compute)
    current = run.next_to_compute()
    started = time.perf_counter()
    if current is not None and prepare is not None:
        prepare()
    start_seconds = time.perf_counter() - started if current is not None and prepare is not None else 0.0
    if prepare_chunk is None or not prepare_ahead:
        while current is not None:
            t0 = time.perf_counter()
            chunk = run.chunk(current)
            run.compute_shard(current, chunk if prepare_chunk is None else prepare_chunk(chunk), t0)
            current = run.next_to_compute()
    else:
        given_back = (lambda i: _claim_path(folder, i).unlink(missing_ok=True)) if claim else (lambda i: None)
        _compute_prepared_ahead(current, run.next_to_compute, lambda i: prepare_chunk(run.chunk(i)),
                                run.compute_shard, given_back)
    return ShardStats(n_shards, run.computed, run.reused, run.seconds, run.rows, start_seconds)


@dataclass
class _ShardRun:
    """One `run_sharded` call's shards: which are its own (`mine`), which it reused or computed."""

    items: Sequence[Any]
    shard_rows: int
    folder: Path
    mine: range
    claim: bool
    on_shard: Callable[[int, int], None] | None
    compute: Callable[[Any], pl.DataFrame | ShardRows]
    computed: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    seconds: float = 0.0
    rows: int = 0
    retrying: dict[int, list[FailedRow]] = field(default_factory=dict)
    """Shards taken up to compute only their failed rows, with the record of those rows."""

    def __post_init__(self) -> None:
        self.todo = iter(self.mine)

    def chunk(self, i: int) -> Sequence[Any]:
        """The items shard `i` computes: all of its items, or the failed ones of a shard being retried."""
        items = self.items[i * self.shard_rows:(i + 1) * self.shard_rows]
        if i not in self.retrying:
            return items
        ids = {r.run_id for r in self.retrying[i]}
        return [x for x in items if row_id(x) in ids]

    def take_up(self, i: int) -> None:
        """Compute only the failed rows of shard `i` when its partial and their record lie beside it."""
        record = failed_path(self.folder, i)
        if _partial_path(self.folder, i).exists() and record.exists():
            self.retrying[i] = FailedRows.model_validate_json(record.read_text()).rows
            if not self.chunk(i):  # a record of none of its items: the whole shard is computed
                del self.retrying[i]

    def progress(self) -> None:
        if self.on_shard:
            self.on_shard(len(self.computed) + len(self.reused), len(self.mine))

    def next_to_compute(self) -> int | None:
        """The next of this call's shards to compute (claimed with `claim`), reusing those that exist."""
        for i in self.todo:
            if shard_file(self.folder, i).exists():
                self.reused.append(i)
                self.progress()
            elif not self.claim or _claim(_claim_path(self.folder, i)):
                self.take_up(i)
                return i
        return None

    def compute_shard(self, i: int, value: Any, t0: float) -> None:
        rows = len(self.chunk(i))
        out = self.compute(value)
        got = out if isinstance(out, ShardRows) else ShardRows(out)
        tried = self.retrying.pop(i, None)
        if tried is None:
            _record_failed(self.folder, i, got.failed)  # first: a shard never exists without this record
            write_parquet(got.frame, shard_file(self.folder, i))
        else:
            partial = _partial_path(self.folder, i)
            write_parquet(_spliced(pl.read_parquet(partial), got.frame), shard_file(self.folder, i))
            before = {r.run_id: r.attempts for r in tried}  # after the shard: the record may only list too many
            _record_failed(self.folder, i, [r.model_copy(update={"attempts": before.get(r.run_id, 0) + r.attempts})
                                            for r in got.failed])
            partial.unlink(missing_ok=True)
        self.seconds += time.perf_counter() - t0
        self.rows += rows
        self.computed.append(i)
        self.progress()


def _compute_prepared_ahead(first: int | None, next_shard: Callable[[], int | None], prepare: Callable[[int], Any],
                            compute: Callable[[int, Any, float], None], give_back: Callable[[int], None]) -> None:
    """Compute shards from `first` on, each prepared on one background thread while the one before it
    computes; a shard prepared but never begun (the call failed first) is given back."""
    with ThreadPoolExecutor(1, thread_name_prefix="prepare-shard") as pool:
        def begin(i: int | None) -> tuple[int, Future[Any]] | None:
            return None if i is None else (i, pool.submit(prepare, i))

        ahead = None  # the next shard: claimed and being prepared, not begun
        try:
            t0 = time.perf_counter()
            shard = begin(first)
            while shard is not None:
                value = shard[1].result()  # this shard's preparation error surfaces here
                ahead = begin(next_shard())
                compute(shard[0], value, t0)
                shard, ahead = ahead, None
                t0 = time.perf_counter()
        finally:
            if ahead is not None:
                give_back(ahead[0])


def _claim_path(folder: Path, shard: int) -> Path:
    return folder / f".shard-{shard:05d}.claim"


FAILED_ROWS = "shard-*.failed.json"
"""Beside a shard that holds failed rows: their records (`FailedRows`), an artifact of the stage folder."""


def failed_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.failed.json"


def _partial_path(folder: Path, shard: int) -> Path:
    """A shard carried for a retry of its failed rows (`carry_failed_rows`): not a finished shard."""
    return folder / f".shard-{shard:05d}.partial.parquet"


def _record_failed(folder: Path, shard: int, rows: list[FailedRow]) -> None:
    """Write the record of a shard's failed rows (atomically), or remove it when none failed."""
    if rows:
        write_json(failed_path(folder, shard), FailedRows(rows=rows).model_dump(mode="json"))
    else:
        failed_path(folder, shard).unlink(missing_ok=True)


def _spliced(shard: pl.DataFrame, redone: pl.DataFrame) -> pl.DataFrame:
    """`shard` with the rows of `redone`'s run_ids replaced by `redone`'s, in the shard's order (a row's
    samples, when the frame has several per row, each in its place)."""
    kept = shard.with_row_index("_at").filter(~pl.col("run_id").is_in(redone["run_id"].to_list()))
    keys = ["run_id", "sample"] if "sample" in shard.columns else ["run_id"]
    at = shard.select(keys).with_row_index("_at")
    fresh = redone.join(at, on=keys, how="left").select(kept.columns).cast(kept.schema)
    return pl.concat([kept, fresh]).sort("_at").drop("_at").rechunk()


def stage_failed_rows(folder: Path, n_shards: int, failing: Collection[str]) -> list[FailedRow]:
    """The failed rows recorded beside a stage's shards (every one finished), in shard order, as far as the
    shards still hold them (`failing`: their run_ids). A record listing rows its shard no longer holds as
    failed (the shard computed again on a machine and collected) is rewritten or removed, and a partial
    left beside a finished shard is removed."""
    out: list[FailedRow] = []
    for i in range(n_shards):
        _partial_path(folder, i).unlink(missing_ok=True)
        record = failed_path(folder, i)
        if not record.exists():
            continue
        rows = FailedRows.model_validate_json(record.read_text()).rows
        kept = [r for r in rows if r.run_id in failing]
        if kept != rows:
            _record_failed(folder, i, kept)
        out += kept
    return out


def holds_failed_rows(folder: Path) -> bool:
    """Whether an engine stage folder's shards hold rows that failed every try (their records beside them)."""
    return any(folder.glob(f"{SHARD_FOLDERS}/{FAILED_ROWS}"))


def carry_failed_rows(retired: Path, folder: Path) -> int:
    """Carry the shards of a retired engine stage folder to its fresh `folder` when some hold failed rows,
    so that computing the stage again sends only those rows to the engine; returns how many failed rows were
    carried (none: nothing is carried, and the stage is computed again whole).

    A shard without failed rows is carried as it is; one with some as its partial beside their record (a
    missing shard, which `run_sharded` computes from its failed rows alone); the records of work too. Each
    file is hard-linked (copied where links fail): every write in the store replaces a file, so the retired
    folder never changes."""
    carried = 0
    for src in sorted(d for d in retired.glob(SHARD_FOLDERS) if d.is_dir() and any(d.glob(FAILED_ROWS))):
        dst = folder / src.name
        dst.mkdir(parents=True, exist_ok=True)
        for path in sorted(src.iterdir()):
            if not path.is_file() or path.name.startswith(".shard-"):  # claims, partials, temporary files
                continue
            name = path.name
            if name.endswith(".parquet") and (src / name.replace(".parquet", ".failed.json")).exists():
                name = f".{name.removesuffix('.parquet')}.partial.parquet"
            elif name.endswith(".failed.json"):
                carried += len(FailedRows.model_validate_json(path.read_text()).rows)
            _link(path, dst / name)
    return carried


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def partial_summary(stage: EngineStageName, key: str, stats: ShardStats) -> PartialSummary:
    """What one of several workers sharing a stage returns: its own shards and their compute time."""
    return PartialSummary(stage=stage, key=key, computed_shards=stats.computed,
                          compute_seconds=stats.compute_seconds, computed_rows=stats.computed_rows,
                          engine_start_seconds=stats.start_seconds)


def _claim(path: Path) -> bool:
    """Create the claim file holding this pid (in one step: a link, so no claim is ever empty), or
    take it over from a process that no longer runs, or from this one (a claim left by an earlier
    failed attempt); False when another live process holds it."""
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        for _ in range(3):
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                if _held_by_other_live_process(path):
                    return False
                path.unlink(missing_ok=True)
        return False
    finally:
        os.unlink(tmp)


def _held_by_other_live_process(path: Path) -> bool:
    try:
        pid = int(path.read_text())
    except (OSError, ValueError):  # gone meanwhile, or not a claim this code wrote: stale
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def merge_shards(folder: Path, n_shards: int, out: Path) -> pl.DataFrame:
    paths = [shard_file(folder, i) for i in range(n_shards)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{folder}: shards missing: {missing[:5]}")
    frame = pl.concat([pl.read_parquet(p) for p in paths]) if paths else pl.DataFrame()
    write_parquet(frame, out)
    return frame


def refused(kind: RefusalKind) -> pl.Expr:
    """The rows of a capture or a reasoned frame whose refusal is of `kind` (a null refusal is none)."""
    return pl.col("refusal").str.starts_with(kind.value).fill_null(False)
