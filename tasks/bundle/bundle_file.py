"""Bundle build and read: a suite streamed into a byte-reproducible tar.gz of Parquet shards.

Layout of a bundle:

    manifest.json              (first member) format, suite summary, per-catalog counts, sha256 of every member
    suite.toml                 the suite manifest, verbatim
    rows/shard-00000.parquet   multiple-choice rows in suite order, `shard_rows` per shard
    generate/shard-00000.parquet   optional generative rows (prompt, reference answer), in suite order
    fewshot/shard-00000.parquet   optional solved examples for few-shot prompts (never scored)
    reference/shard-00000.parquet   optional banked capture (run_id, choice, probs), 1:1 with rows

The archive is byte-identical across runs: members sorted, mtime/uid/gid fixed, mode 0644,
gzip header mtime 0. Rows stream through a bounded buffer: memory does not grow with the suite.
"""

from __future__ import annotations

import errno
import json
import shutil
import tarfile
import tempfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, ClassVar, Literal

import polars as pl
from pydantic import Field, SerializationInfo, SerializerFunctionWrapHandler, ValidationError, model_serializer

from jex.errors import InputError, JexError
from jex.fileio import atomic_path, canonical_json, sha256_file, write_json, write_tar_gz
from jex.provenance import provenance
from jex.record import Record
from jex.suite import (
    GENERATIVE_FIELDS,
    MANIFEST_NAME,
    READOUT_FIELDS,
    Catalog,
    GenerationRow,
    SuiteManifest,
    SuiteRow,
    iter_all_rows,
    iter_fewshot_rows,
    load_manifest,
    read_row_file,
    without_defaults,
)
from jex.tasks.store import write_parquet

PolarsType = pl.DataType | type[pl.DataType]
BUNDLE_FORMAT = "jex-bundle/2"
READABLE_FORMATS = ("jex-bundle/1", BUNDLE_FORMAT)
"""jex-bundle/1 carried provenance inside the hashed manifest; it is still read."""
MANIFEST_MEMBER = "manifest.json"
DEFAULT_SHARD_ROWS = 16384
ROW_SCHEMA: dict[str, PolarsType] = {
    "run_id": pl.String, "catalog": pl.String, "question_id": pl.String, "prompt": pl.String,
    "options": pl.List(pl.String), "labels": pl.List(pl.String), "gold": pl.Int32,
    "metadata": pl.String,  # JSON text: a stable schema whatever the rows carry
}
TRUE_OPTIONS_SCHEMA: dict[str, PolarsType] = {"true_options": pl.List(pl.Int32)}
"""The rows' extra column in a bundle with a `true_mass` catalog (null on its other rows); a bundle
without one keeps ROW_SCHEMA, and so its bytes."""


def row_schema(manifest: SuiteManifest) -> dict[str, PolarsType]:
    """The row shards' columns for a suite: ROW_SCHEMA, plus TRUE_OPTIONS_SCHEMA when a catalog is
    scored by `true_mass`."""
    multi_gold = any(c.scoring == "true_mass" for c in manifest.catalogs)
    return {**ROW_SCHEMA, **TRUE_OPTIONS_SCHEMA} if multi_gold else ROW_SCHEMA
REFERENCE_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "choice": pl.Int32, "probs": pl.List(pl.Float64)}
GENERATE_SCHEMA: dict[str, PolarsType] = {"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                          "prompt": pl.String, "answer": pl.String, "metadata": pl.String}
"""The generative catalogs' rows (`generate/`): the prompt the model continues and the reference answer."""


class BundleError(JexError):
    """A bundle that fails its checks: tampered, unsafe or inconsistent."""


class MemberEntry(Record):
    """One bundle member as the manifest lists it."""

    sha256: str
    bytes: int = Field(ge=0)


class ReferenceInfo(Record):
    """The banked capture a bundle carries: its rows and shards, and the source file's sha256."""

    rows: int
    shards: int
    source_sha256: str


class BundleCatalog(Catalog):
    """A catalog as the bundle's manifest lists it: the core's `Catalog` as declared (`Catalog.declared`:
    the readout and generative fields left out at their defaults), with its row counts and chance level."""

    chance: float = Field(ge=0, lt=1, description="The manifest's chance, else the mean of 1/len(options)")
    rows: int
    scored_rows: int
    chance_source: str = Field(description="manifest, or how the chance level was computed")

    @model_serializer(mode="wrap")
    def _as_declared(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """The bytes `{**catalog.declared(), rows, scored_rows, chance, chance_source}` had."""
        return without_defaults(handler(self), (*READOUT_FIELDS, *GENERATIVE_FIELDS), json=info.mode_is_json())


class SuiteSummary(Record):
    name: str
    legs: dict[str, float]
    catalogs: list[BundleCatalog]


class BundleManifest(Record):
    """`manifest.json`, the bundle's first member (written as canonical JSON by `manifest_text`, the bytes
    the bundle's identity covers). `rows` counts the multiple-choice rows (`rows/`); `generate_rows` the
    generative ones (`generate/`), present only when the suite has some (a multiple-choice suite's bundle
    keeps the bytes it had before they existed). Its version is `format` (`READABLE_FORMATS`)."""

    format: Literal["jex-bundle/1", "jex-bundle/2"]
    suite: SuiteSummary
    rows: int
    shard_rows: int
    row_shards: int
    generate_rows: int | None = None
    generate_shards: int | None = None
    reference: ReferenceInfo | None
    members: dict[str, MemberEntry]
    provenance: dict[str, Any] | None = Field(None, description="jex-bundle/1 only: provenance in the manifest")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"generate_rows", "generate_shards", "provenance"})

    def text(self) -> str:
        """The manifest's bytes: canonical JSON, as the bundle holds them."""
        return canonical_json(self.model_dump(mode="json"))


@dataclass(frozen=True)
class BuildResult:
    path: Path
    sha256: str
    rows: int
    manifest: BundleManifest


def _flush(buffer: list[dict[str, Any]], schema: Mapping[str, PolarsType], folder: Path, index: int) -> int:
    """Write `buffer` as shard `index` of `folder` (made on first use) and empty it; the next shard's index."""
    folder.mkdir(exist_ok=True)
    write_parquet(pl.DataFrame(buffer, schema=schema, orient="row"), folder / f"shard-{index:05d}.parquet")
    buffer.clear()
    return index + 1


def _reference_rows(path: Path) -> Any:
    for line, rec in read_row_file(path):
        if not isinstance(rec, dict) or "run_id" not in rec or "choice" not in rec:
            raise InputError("reference rows need 'run_id' and 'choice'", file=str(path), row=line,
                             field="run_id" if not isinstance(rec, dict) or "run_id" not in rec else "choice")
        yield line, rec


def _check_reference(path: Path, suite_ids: dict[str, int], stage: Path, shard_rows: int) -> ReferenceInfo:
    """Write the reference capture in suite order; it must match the suite 1:1 on run_id."""
    seen: dict[str, dict[str, Any]] = {}
    duplicated: list[str] = []
    extra: list[str] = []
    for line, rec in _reference_rows(path):
        rid = str(rec["run_id"])
        if rid in seen:
            duplicated.append(rid)
            continue
        if rid not in suite_ids:
            extra.append(rid)
            continue
        choice = rec["choice"]
        if choice is not None and (not isinstance(choice, int) or isinstance(choice, bool)):
            raise InputError(f"choice must be an integer or null, got {choice!r}", file=str(path), row=line,
                             field="choice")
        seen[rid] = {"run_id": rid, "choice": choice, "probs": rec.get("probs")}
    missing = [rid for rid in suite_ids if rid not in seen]
    if missing or extra or duplicated:
        parts = [f"{name}: {len(ids)} (first: {ids[:3]})"
                 for name, ids in (("missing", missing), ("extra", extra), ("duplicated", duplicated)) if ids]
        raise InputError("reference rows do not match the suite 1:1 on run_id; " + "; ".join(parts),
                         file=str(path), field="run_id")
    folder = stage / "reference"
    buffer: list[dict[str, Any]] = []
    shards = 0
    for rid in suite_ids:  # suite order
        buffer.append(seen[rid])
        if len(buffer) == shard_rows:
            shards = _flush(buffer, REFERENCE_SCHEMA, folder, shards)
    if buffer:
        shards = _flush(buffer, REFERENCE_SCHEMA, folder, shards)
    return ReferenceInfo(rows=len(seen), shards=shards, source_sha256=sha256_file(path))


def _pack(stage: Path, out: Path) -> None:
    """Tar+gzip `stage` deterministically into `out`."""
    members = sorted((p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file()),
                     key=lambda name: (name != MANIFEST_MEMBER, name))  # the manifest first: readers check it first
    with atomic_path(out) as tmp, open(tmp, "wb") as raw:
        write_tar_gz(raw, ((name, stage / name) for name in members), compresslevel=6)


def catalog_chance(catalog_counts: dict[int, int]) -> float:
    """Chance level of a catalog: the mean of 1/len(options) over its scored rows, exactly rounded."""
    n = sum(catalog_counts.values())
    return float(sum((Fraction(c, k) for k, c in catalog_counts.items()), Fraction(0)) / n)


def suite_files(suite_dir: Path, manifest: SuiteManifest) -> list[Path]:
    """The row and few-shot files a suite's manifest lists (what a bundle's identity covers)."""
    return [suite_dir / f for c in manifest.catalogs for f in (*c.files, *c.fewshot_files)]


@dataclass
class _RowCensus:
    """What streaming the suite's rows into shards counted: run_id order, rows and option counts."""

    suite_ids: dict[str, int] = field(default_factory=dict)  # run_id -> position in suite order (multiple choice)
    counts: Counter[str] = field(default_factory=Counter)  # rows per catalog
    options_hist: dict[str, Counter[int]] = field(default_factory=dict)  # scored rows per number of options
    shards: int = 0
    generated: int = 0  # generative rows
    generate_shards: int = 0
    scored_generative: Counter[str] = field(default_factory=Counter)  # scored rows per generative catalog


def _row_record(row: SuiteRow, schema: Mapping[str, PolarsType]) -> dict[str, Any]:
    """A suite row as a record of `schema` (`row_schema`; metadata as canonical JSON text)."""
    record = {**row.model_dump(), "metadata": None if row.metadata is None else
              json.dumps(row.metadata, sort_keys=True, ensure_ascii=False)}
    return {k: record[k] for k in schema}


def _generation_record(row: GenerationRow) -> dict[str, Any]:
    """A generative row as a record of GENERATE_SCHEMA (metadata as canonical JSON text)."""
    return {**row.model_dump(), "metadata": None if row.metadata is None else
            json.dumps(row.metadata, sort_keys=True, ensure_ascii=False)}


def _write_row_shards(suite_dir: Path, manifest: SuiteManifest, stage: Path, shard_rows: int) -> _RowCensus:
    """Stream the suite's rows into `shard_rows`-row Parquet shards through bounded buffers: the
    multiple-choice rows into `rows/`, the generative ones into `generate/`."""
    census = _RowCensus(options_hist={c.id: Counter() for c in manifest.catalogs})
    excluded = {c.id: set(c.exclusions) for c in manifest.catalogs}
    choices: list[dict[str, Any]] = []
    generative: list[dict[str, Any]] = []
    schema = row_schema(manifest)
    (stage / "rows").mkdir()
    for row in iter_all_rows(suite_dir, manifest):
        census.counts[row.catalog] += 1
        if isinstance(row, GenerationRow):
            census.generated += 1
            census.scored_generative[row.catalog] += row.run_id not in excluded[row.catalog]
            generative.append(_generation_record(row))
            if len(generative) == shard_rows:
                census.generate_shards = _flush(generative, GENERATE_SCHEMA, stage / "generate",
                                                     census.generate_shards)
            continue
        census.suite_ids[row.run_id] = len(census.suite_ids)
        if row.run_id not in excluded[row.catalog]:
            census.options_hist[row.catalog][len(row.options)] += 1
        choices.append(_row_record(row, schema))
        if len(choices) == shard_rows:
            census.shards = _flush(choices, schema, stage / "rows", census.shards)
    if choices:
        census.shards = _flush(choices, schema, stage / "rows", census.shards)
    if generative:
        census.generate_shards = _flush(generative, GENERATE_SCHEMA, stage / "generate", census.generate_shards)
    if not census.suite_ids and not census.generated:
        raise InputError("the suite has no rows", file=str(suite_dir / MANIFEST_NAME))
    return census


def _write_fewshot(suite_dir: Path, manifest: SuiteManifest, stage: Path) -> None:
    """The catalogs' few-shot rows into one shard, when the suite has any."""
    schema = row_schema(manifest)
    fewshot = [_row_record(r, schema) for r in iter_fewshot_rows(suite_dir, manifest)]
    if fewshot:
        _flush(fewshot, schema, stage / "fewshot", 0)


def _catalog_entries(suite_dir: Path, manifest: SuiteManifest, census: _RowCensus) -> list[BundleCatalog]:
    """Each catalog as declared, with its row counts and chance level; a catalog without (scored)
    rows is an InputError."""
    catalogs = []
    for c in manifest.catalogs:
        if census.counts[c.id] == 0:
            raise InputError(f"catalog '{c.id}' has no rows", file=str(suite_dir / MANIFEST_NAME), field="files")
        generative = c.kind == "generate"
        scored = census.scored_generative[c.id] if generative else sum(census.options_hist[c.id].values())
        if scored == 0:
            raise InputError(f"catalog '{c.id}' excludes every row", file=str(suite_dir / MANIFEST_NAME),
                             field="exclusions")
        computed = (0.0, "exact_match: no answer by chance") if generative else (
            catalog_chance(census.options_hist[c.id]), "mean 1/len(options)")
        catalogs.append(BundleCatalog(**{**dict(c), "rows": census.counts[c.id], "scored_rows": scored,
                                         "chance": c.chance if c.chance is not None else computed[0],
                                         "chance_source": "manifest" if c.chance is not None else computed[1]}))
    return catalogs


def provenance_sidecar(bundle: Path) -> Path:
    """Where a bundle built outside the store keeps its provenance: `NAME.provenance.json` beside it."""
    return bundle.with_name(bundle.name.removesuffix(".tar.gz") + ".provenance.json")


def build_bundle(suite_dir: str | Path, out: str | Path, *, reference: str | Path | None = None,
                 shard_rows: int = DEFAULT_SHARD_ROWS, settings: dict[str, Any] | None = None,
                 provenance_out: Path | None = None) -> BuildResult:
    """Stream a suite into a deterministic bundle at `out`; returns its path, sha256 and manifest.

    The bundle's bytes hold only what decides the rows the engine reads (rows, suite manifest,
    reference, format), so its sha256, and every key after it, is the same whatever jex commit or
    library versions built it. Provenance (those versions, the input files' sha256, `settings`) is
    written beside it, to `provenance_out` (a stage folder records its own: `StageDir.finish`)."""
    suite_dir, out = Path(suite_dir), Path(out)
    manifest = load_manifest(suite_dir)
    with tempfile.TemporaryDirectory(prefix="jex-bundle-", dir=out.parent if out.parent.exists() else None) as t:
        stage = Path(t)
        shutil.copyfile(suite_dir / MANIFEST_NAME, stage / MANIFEST_NAME)
        census = _write_row_shards(suite_dir, manifest, stage, shard_rows)
        _write_fewshot(suite_dir, manifest, stage)
        ref_info = _check_reference(Path(reference), census.suite_ids, stage, shard_rows) if reference else None
        inputs = {f"suite/{p.relative_to(suite_dir).as_posix()}": sha256_file(p)
                  for p in [suite_dir / MANIFEST_NAME, *suite_files(suite_dir, manifest)]}
        if ref_info is not None:
            inputs["reference"] = ref_info.source_sha256
        members = {p.relative_to(stage).as_posix(): MemberEntry(sha256=sha256_file(p), bytes=p.stat().st_size)
                   for p in sorted(stage.rglob("*")) if p.is_file()}
        doc = BundleManifest(
            format=BUNDLE_FORMAT,
            suite=SuiteSummary(name=manifest.name, legs=manifest.legs,
                               catalogs=_catalog_entries(suite_dir, manifest, census)),
            rows=len(census.suite_ids), shard_rows=shard_rows, row_shards=census.shards, reference=ref_info,
            members=members, generate_rows=census.generated or None,
            generate_shards=census.generate_shards if census.generated else None)
        (stage / MANIFEST_MEMBER).write_text(doc.text(), encoding="utf-8")
        _pack(stage, out)
    if provenance_out is not None:
        write_json(provenance_out, provenance(inputs=inputs, settings=settings or {}))
    return BuildResult(path=out, sha256=sha256_file(out), rows=len(census.suite_ids), manifest=doc)


# --- reading -------------------------------------------------------------------------------------

def _safe_member(member: tarfile.TarInfo, bundle: Path) -> None:
    name = member.name
    if not member.isfile():
        kind = ("a symbolic link" if member.issym() else "a hard link" if member.islnk() else
                "a device" if member.isdev() else "a directory" if member.isdir() else "not a regular file")
        raise BundleError(f"{bundle}: unsafe member '{name}': {kind}")
    if name.startswith("/") or Path(name).is_absolute():
        raise BundleError(f"{bundle}: unsafe member '{name}': absolute path")
    if ".." in Path(name).parts or "\\" in name:
        raise BundleError(f"{bundle}: unsafe member '{name}': path leaves the bundle")


@dataclass(frozen=True)
class Bundle:
    """An opened, verified bundle extracted into `root`."""

    path: Path
    sha256: str
    root: Path
    manifest: BundleManifest

    def suite_manifest(self) -> SuiteManifest:
        return load_manifest(self.root)

    def row_shards(self) -> list[Path]:
        return sorted((self.root / "rows").glob("shard-*.parquet"))

    def rows(self, columns: list[str] | None = None) -> pl.DataFrame:
        """The multiple-choice rows in suite order (scan of the shards, so `columns` limits what is read); none
        in a suite of generative catalogs alone."""
        shards = self.row_shards()
        if not shards:
            return pl.DataFrame(schema=row_schema(self.suite_manifest())).select(columns or pl.all())
        return pl.scan_parquet(shards).select(columns or pl.all()).collect()

    def generation_rows(self) -> pl.DataFrame:
        """The generative catalogs' rows in suite order (GENERATE_SCHEMA; empty when the suite has none)."""
        shards = sorted((self.root / "generate").glob("shard-*.parquet"))
        return pl.read_parquet(shards) if shards else pl.DataFrame(schema=GENERATE_SCHEMA)

    def fewshot(self) -> pl.DataFrame | None:
        """The catalogs' few-shot example rows (ROW_SCHEMA), or None when the suite has none."""
        shards = sorted((self.root / "fewshot").glob("shard-*.parquet"))
        return pl.read_parquet(shards) if shards else None

    def reference(self) -> pl.DataFrame | None:
        shards = sorted((self.root / "reference").glob("shard-*.parquet"))
        return pl.read_parquet(shards) if shards else None

    def catalogs(self) -> list[BundleCatalog]:
        return self.manifest.suite.catalogs


MAX_MANIFEST_BYTES = 64 * 1024 * 1024


def _read_manifest(tar: tarfile.TarFile, path: Path) -> tuple[tarfile.TarInfo, BundleManifest]:
    """The first member, which must be `manifest.json` (packed first), read in memory."""
    first = tar.next()
    if first is None:
        raise BundleError(f"{path}: empty bundle")
    _safe_member(first, path)
    if first.name != MANIFEST_MEMBER:
        raise BundleError(f"{path}: the first member is '{first.name}', not {MANIFEST_MEMBER}")
    if first.size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path}: {MANIFEST_MEMBER} is {first.size} bytes (limit {MAX_MANIFEST_BYTES})")
    try:
        manifest = json.loads(tar.extractfile(first).read().decode("utf-8"))  # type: ignore[union-attr]
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: manifest.json unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in READABLE_FORMATS:
        raise BundleError(f"{path}: unknown bundle format "
                          f"{manifest.get('format') if isinstance(manifest, dict) else None!r}")
    if not isinstance(manifest.get("members"), dict):
        raise BundleError(f"{path}: manifest.json lists no members")
    for name, meta in manifest["members"].items():
        size = meta.get("bytes") if isinstance(meta, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise BundleError(f"{path}: manifest.json: member '{name}' has no valid size (bytes: {size!r})")
    try:
        return first, BundleManifest.model_validate(manifest)
    except ValidationError as e:
        raise BundleError(f"{path}: manifest.json is not a valid bundle manifest: {e}") from None


def _intact(folder: Path, listed: dict[str, MemberEntry]) -> bool:
    return folder.is_dir() and all((folder / name).is_file() and sha256_file(folder / name) == meta.sha256
                                   for name, meta in listed.items())


def _verify(folder: Path, listed: dict[str, MemberEntry], path: Path) -> None:
    for name, meta in listed.items():
        actual = sha256_file(folder / name)
        if actual != meta.sha256:
            shutil.rmtree(folder, ignore_errors=True)
            raise BundleError(f"{path}: checksum mismatch for '{name}': manifest {meta.sha256[:16]}…, "
                              f"file {actual[:16]}… (the bundle was modified or corrupted)")


def _publish(fresh: Path, dest: Path, listed: dict[str, MemberEntry]) -> None:
    """Rename a verified extraction into place. When another process published the same bundle
    first, its copy is kept and this one dropped; a damaged `dest` (an interrupted older
    extraction) is set aside and replaced."""
    for _ in range(3):
        try:
            fresh.rename(dest)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                shutil.rmtree(fresh, ignore_errors=True)
                raise
        if _intact(dest, listed):  # published by another process: same bytes, verified there
            shutil.rmtree(fresh, ignore_errors=True)
            return
        stale = Path(tempfile.mkdtemp(prefix=f".{dest.name}.stale.", dir=dest.parent))
        dest.rename(stale / dest.name)
        shutil.rmtree(stale, ignore_errors=True)
    raise BundleError(f"{dest}: could not publish the extracted bundle")


@dataclass(frozen=True)
class BundleLimits:
    """The most a bundle may unpack to: per member and in all (`JEX_STORE__BUNDLE_MEMBER_MAX_BYTES`,
    `JEX_STORE__BUNDLE_TOTAL_MAX_BYTES`), checked from the manifest before a byte is written."""

    member_bytes: int = 4 << 30
    total_bytes: int = 64 << 30

    @classmethod
    def from_settings(cls) -> BundleLimits:
        from jex.settings import load_settings

        store = load_settings().store
        return cls(member_bytes=store.bundle_member_max_bytes, total_bytes=store.bundle_total_max_bytes)


def _check_sizes(listed: dict[str, MemberEntry], path: Path, limits: BundleLimits) -> None:
    """The manifest's sizes: each a whole number within the member cap, all within the total cap."""
    total = 0
    for name, meta in listed.items():
        size = meta.bytes
        if size > limits.member_bytes:
            raise BundleError(f"{path}: member '{name}' is {size} bytes, over the limit of {limits.member_bytes} "
                              "per member (JEX_STORE__BUNDLE_MEMBER_MAX_BYTES)")
        total += size
    if total > limits.total_bytes:
        raise BundleError(f"{path}: the members add up to {total} bytes, over the limit of {limits.total_bytes} "
                          "(JEX_STORE__BUNDLE_TOTAL_MAX_BYTES)")


def _extract(tar: tarfile.TarFile, members: list[tarfile.TarInfo], fresh: Path, path: Path) -> None:
    """Stream each checked member into `fresh`, never past its declared size (a member that grows
    past it is cut off there and refused)."""
    for m in members:
        target = fresh / m.name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = tar.extractfile(m)
        if source is None:
            raise BundleError(f"{path}: member '{m.name}' has no data")
        written = 0
        with open(target, "wb") as out:
            while block := source.read(min(1 << 20, m.size - written + 1)):
                written += len(block)
                if written > m.size:
                    raise BundleError(f"{path}: member '{m.name}' grows past its declared {m.size} bytes; cut off")
                out.write(block)
        if written != m.size:
            raise BundleError(f"{path}: member '{m.name}' is {written} bytes, declared {m.size} (truncated bundle)")


def _check_members(tar: tarfile.TarFile, path: Path, listed: dict[str, MemberEntry]) -> list[tarfile.TarInfo]:
    """Every member's header against the manifest, one header at a time: an unlisted, oversized or
    duplicated member is refused before its data is read, and before anything is written."""
    members, seen = [], set()
    while (m := tar.next()) is not None:  # lazy: the next header skips only data already vouched for
        _safe_member(m, path)
        meta = listed.get(m.name)
        if meta is None:
            raise BundleError(f"{path}: members differ from the manifest: unlisted ['{m.name}'] ({m.size} bytes)")
        if m.name in seen:
            raise BundleError(f"{path}: member '{m.name}' appears twice")
        if m.size != meta.bytes:
            raise BundleError(f"{path}: member '{m.name}' is {m.size} bytes, the manifest says {meta.bytes}")
        seen.add(m.name)
        members.append(m)
    if seen != set(listed):
        raise BundleError(f"{path}: members differ from the manifest: unlisted [], absent {sorted(set(listed) - seen)}")
    return members


def is_bundle_file(path: str | Path) -> bool:
    """A bundle is given as its file (`jex bundle build`'s .tar.gz), a suite as its folder."""
    return Path(path).is_file()


def bundle_manifest(path: str | Path) -> BundleManifest:
    """The manifest of a bundle file (its first member), read without extracting anything."""
    path = Path(path)
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            return _read_manifest(tar, path)[1]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleError(f"{path}: not a readable bundle ({e})") from None


def take_bundle(source: str | Path, out: str | Path) -> BuildResult:
    """A bundle built elsewhere (`jex bundle build`) taken as it is: verified (every member against
    the manifest's sha256), then copied to `out`. Its bytes are the bundle's identity, so a campaign on
    it reads what a campaign on the suite folder it was built from reads."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="jex-bundle-check-") as tmp:
        opened = open_bundle(source, Path(tmp) / "members")
    with atomic_path(out) as part:
        shutil.copyfile(source, part)
    if sha256_file(out) != opened.sha256:
        raise BundleError(f"{source}: changed while it was copied")
    return BuildResult(path=out, sha256=opened.sha256, rows=opened.manifest.rows, manifest=opened.manifest)


def open_bundle(path: str | Path, dest: str | Path, *, limits: BundleLimits | None = None) -> Bundle:
    """Extract `path` into `dest` after checking every member's name, type and size against the
    manifest and the size limits (nothing is written before all passed); then verify every member's sha256.

    Safe for several processes at once (the engine processes of one machine): an intact `dest` is
    reused as is, and a new extraction is verified in a private folder, then renamed into place."""
    path, dest = Path(path), Path(dest)
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            first, manifest = _read_manifest(tar, path)
            listed = manifest.members
            _check_sizes(listed, path, limits or BundleLimits.from_settings())
            if not _intact(dest, listed):
                members = _check_members(tar, path, listed)
                dest.parent.mkdir(parents=True, exist_ok=True)
                fresh = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
                try:
                    _extract(tar, [first, *members], fresh, path)
                    _verify(fresh, listed, path)
                except BaseException:
                    shutil.rmtree(fresh, ignore_errors=True)
                    raise
                _publish(fresh, dest, listed)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise BundleError(f"{path}: not a readable bundle ({e})") from None
    return Bundle(path=path, sha256=sha256_file(path), root=dest, manifest=manifest)
