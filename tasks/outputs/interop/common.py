"""What both importers share: another tool's per-document answers, mapped onto a suite's run_ids, then
scored by jex's own scorers (`tasks/scoring/score.py: score_files`: both scorers and the clustered bootstrap).

A document maps to a run_id in one of three ways (`MapMode`):
    doc_id   the suite row's metadata holds the tool's task and document id ({"task", "doc_id"}, what
             `jex suite import lm-eval` writes): (task, doc_id) -> run_id
    id       a declared id: the document's `id_field` value (or the Inspect sample id) equals the row's
             metadata[id_field] or, failing that, its run_id
    content  content hash: sha256 of the row's options picks the candidates, and the one whose question
             text (stripped) appears in the text the tool's model read is the row
`auto` picks doc_id when the suite's rows carry document ids for the task and the documents have
them, id when an id field is declared; otherwise a document whose id is a run_id (jex's own exports)
maps by it and any other by content (recorded as `auto-id`).

Every problem is an `InputError` naming the tool's file, the line (or sample id) and the field, and is
raised before anything is written: the output folder is filled from a staging folder by renames only
after scoring succeeded.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, TypedDict

import polars as pl
from pydantic import BaseModel, ConfigDict, Field

from jex.errors import InputError
from jex.fileio import write_toml
from jex.record import Record
from jex.run_records import STAGES_FILE, RecordedCampaign
from jex.tasks.documents import ScoreDoc, read_doc
from jex.tasks.run_store import run_summaries

MapMode = Literal["auto", "doc_id", "id", "content"]
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class ToolSample:
    """One document as another tool logged it: where it is, how to identify it, what the model chose."""

    file: str
    where: int | str  # 1-based line (lm-eval) or sample id (Inspect)
    task: str
    doc_id: int | None
    ids: dict[str, Any]  # declared-id candidates: the document's own fields (or the Inspect sample id)
    context: str  # the text the tool's model read (question inside)
    options: tuple[str, ...]
    choice: int | None
    probs: tuple[float, ...] | None = None
    gold: int | None = None
    reported_correct: float | None = None  # the tool's own per-document verdict (lm-eval `acc`)
    acc_norm_choice: int | None = None  # lm-eval's length-normalised choice (continuation log-likelihoods only)


@dataclass(frozen=True)
class SuiteRows:
    """A suite's rows with what mapping needs (prompt, options, metadata), and where they came from."""

    source: str
    name: str
    catalogs: tuple[str, ...]
    rows: pl.DataFrame  # run_id, catalog, question_id, prompt, options, labels, gold, metadata (JSON text)


class TaskAgreement(Record):
    """One lm-eval task in `import.json`: its documents, and the accuracy lm-eval reported for them."""


    documents: int
    lm_eval_results_acc: float | None = Field(description="`acc,none` of the results file, if any")
    lm_eval_samples_acc: float | None = Field(description="mean per-document `acc` of the samples files, if any")
    lm_eval_results_acc_norm: float | None = Field(None, description="`acc_norm,none` of the results file, if any")

    omit_if_none: ClassVar[frozenset[str]] = frozenset({"lm_eval_results_acc_norm"})


class ImportRecord(BaseModel):
    """Where imported decisions came from: `import.json` (with the mapping) and the score's settings."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    tool: str = Field(alias="from", description="The tool whose outputs were read: lm-eval | inspect")
    source: str = Field(description="The file or folder read")
    task: str | None = Field(None, description="The Inspect log's task")
    model: str | None = Field(None, description="The Inspect log's model")
    suite: str = Field(description="The suite folder, or 'made from the ...' when none was given")
    files: dict[str, str] = Field(description="sha256 of every file read")


@dataclass(frozen=True)
class MappedPredictions:
    """The tool's decisions keyed by suite run_id (in document order), and how each task was mapped."""

    run_ids: list[str]
    choices: list[int | None]
    probs: list[list[float] | None]
    mode: dict[str, str]  # task -> mode used
    tasks: dict[str, TaskAgreement] = field(default_factory=dict)
    acc_norm: list[int | None] = field(default_factory=list)  # lm-eval's length-normalised choices, if any


@dataclass(frozen=True)
class _RowIds:
    """What a suite row's metadata says about its identity in another tool."""

    task: Any  # the tool's task, or None
    doc_id: Any  # the tool's document id, or None
    has_doc_id: bool
    declared: Any  # metadata[id_field], or None
    has_declared: bool


@dataclass(frozen=True)
class RunToExport:
    """A finished run folder as the exporters read it."""

    run_dir: Path
    samples: pl.DataFrame  # samples.parquet
    spec: RecordedCampaign  # campaign.json
    score: ScoreDoc  # score.json


def read_run_to_export(run_dir: str | Path, *, as_what: str) -> RunToExport:
    """The run's samples, campaign and score; an InputError when its prompts were not kept (they
    become the other tool's inputs, `as_what`)."""
    from jex.tasks.outputs.samples import read_samples

    run_dir = Path(run_dir)
    samples = read_samples(run_dir)
    if samples["prompt"].null_count() and samples["prompt_ref"].null_count() == samples.height:
        raise InputError(f"the run has no rendered prompts to export as {as_what} ({samples['prompt_missing'][0]})",
                         file=str(run_dir / "samples.parquet"), field="prompt")
    return RunToExport(run_dir, samples, RecordedCampaign.read(run_dir),
                       read_doc(ScoreDoc, run_dir / "score.json"))


class CatalogSummary(TypedDict):
    """A catalog's result as the exports carry it."""

    leg: str
    n: int
    acc: float
    skill: float
    ci: list[float]


def catalog_summary(run: RunToExport) -> dict[str, CatalogSummary]:
    """Per catalog of the run's score: leg, n, acc, skill and its interval."""
    return {c: {"leg": v.leg, "n": v.n, "acc": v.acc, "skill": v.skill, "ci": list(v.ci)}
            for c, v in run.score.catalogs.items()}


def _norm(text: str) -> str:
    return " ".join(text.split())


def options_hash(options: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps([_norm(o) for o in options], ensure_ascii=False).encode()).hexdigest()


def load_suite_rows(source: str | Path) -> SuiteRows:
    """Rows of a suite folder (validated) or a bundle file (verified), metadata included."""
    from jex.suite import iter_rows, load_manifest

    source = Path(source)
    if not source.exists():
        raise InputError("no suite folder or bundle here", file=str(source))
    if source.is_file():
        from jex.tasks.bundle.bundle_file import open_bundle

        with tempfile.TemporaryDirectory(prefix="jex-interop-") as tmp:
            opened = open_bundle(source, tmp)
            manifest = opened.suite_manifest()
            rows = opened.rows(["run_id", "catalog", "question_id", "prompt", "options", "labels", "gold",
                                "metadata"])
    else:
        manifest = load_manifest(source)
        recs = [r.model_dump() for r in iter_rows(source, manifest)]
        rows = pl.DataFrame({"run_id": [r["run_id"] for r in recs], "catalog": [r["catalog"] for r in recs],
                             "question_id": [r["question_id"] for r in recs],
                             "prompt": [r["prompt"] for r in recs], "options": [r["options"] for r in recs],
                             "labels": [r["labels"] for r in recs], "gold": [r["gold"] for r in recs],
                             "metadata": [None if r["metadata"] is None else json.dumps(r["metadata"], sort_keys=True)
                                          for r in recs]},
                            schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                    "prompt": pl.String, "options": pl.List(pl.String),
                                    "labels": pl.List(pl.String), "gold": pl.Int64, "metadata": pl.String})
    multi_gold = [c.id for c in manifest.catalogs if c.scoring == "true_mass"]
    if multi_gold:  # the tools' logs are mapped to choices, not to the masses these catalogs are scored by
        raise InputError(f"catalog(s) {multi_gold} are scored by true_mass, which an imported log does not carry: "
                         "score them with `jex run`", file=str(source), field="scoring")
    return SuiteRows(str(source), manifest.name, tuple(c.id for c in manifest.catalogs), rows)


def _row_ids(text: str | None, id_field: str | None) -> _RowIds:
    meta = json.loads(text) if text else {}
    declared = bool(id_field) and id_field in meta
    return _RowIds(meta.get("task"), meta.get("doc_id"), "doc_id" in meta,
                   meta[id_field] if declared else None, declared)


@dataclass(frozen=True)
class _SuiteRow:
    """What mapping reads of one suite row."""

    run_id: str
    prompt: str
    options: list[str]
    gold: int
    ids: _RowIds


@dataclass(frozen=True)
class _RowIndex:
    """A suite's rows looked up four ways: by (task, doc_id), run_id, declared id, options hash."""

    by_doc: dict[tuple[Any, Any], _SuiteRow]
    by_run: dict[str, _SuiteRow]
    by_declared: dict[str, _SuiteRow]
    by_options: dict[str, list[_SuiteRow]]

    @classmethod
    def of(cls, suite: SuiteRows, id_field: str | None) -> _RowIndex:
        rows = [_SuiteRow(r["run_id"], r["prompt"], r["options"], r["gold"], _row_ids(r["metadata"], id_field))
                for r in suite.rows.select("run_id", "prompt", "options", "gold", "metadata").iter_rows(named=True)]
        by_options: dict[str, list[_SuiteRow]] = {}
        for r in rows:
            by_options.setdefault(options_hash(r.options), []).append(r)
        return cls(by_doc={(r.ids.task, r.ids.doc_id): r for r in rows if r.ids.has_doc_id},
                   by_run={r.run_id: r for r in rows},
                   by_declared={str(r.ids.declared): r for r in rows if r.ids.has_declared},
                   by_options=by_options)


def map_samples(samples: Sequence[ToolSample], suite: SuiteRows, *, mode: MapMode = "auto",
                id_field: str | None = None) -> MappedPredictions:
    """Each tool document onto exactly one suite row; an InputError for the first one that cannot be."""
    index = _RowIndex.of(suite, id_field)
    modes = {t: _pick_mode(t, [s for s in samples if s.task == t], mode, id_field, index, suite)
             for t in sorted({s.task for s in samples})}
    out = MappedPredictions([], [], [], modes)
    taken: dict[str, ToolSample] = {}
    for s in samples:
        row = _matching_row(s, modes[s.task], index, suite, id_field)
        _check_match(s, row)
        if row.run_id in taken:
            first = taken[row.run_id]
            raise InputError(f"document maps to run_id '{row.run_id}', as did {first.file} {first.where}",
                             file=s.file, row=s.where, field="doc_id")
        taken[row.run_id] = s
        out.run_ids.append(row.run_id)
        out.choices.append(s.choice)
        out.probs.append(list(s.probs) if s.probs is not None else None)
        out.acc_norm.append(s.acc_norm_choice)
    return out


def _matching_row(s: ToolSample, m: str, index: _RowIndex, suite: SuiteRows, id_field: str | None) -> _SuiteRow:
    """The suite row of one document under mapping mode `m`; an InputError when none or several match."""
    if m == "doc_id":
        row = index.by_doc.get((s.task, s.doc_id))
        how = f"task '{s.task}', doc_id {s.doc_id}"
    elif m == "id" or (m == "auto-id" and str(s.ids.get("id")) in index.by_run):
        key = s.ids.get(id_field) if id_field else s.ids.get("id")
        row = index.by_declared.get(str(key)) or index.by_run.get(str(key))
        how = f"{id_field or 'id'} {key!r}"
    else:
        cands = [r for r in index.by_options.get(options_hash(s.options), [])
                 if _norm(r.prompt) in _norm(s.context)]
        longest = max((len(_norm(r.prompt)) for r in cands), default=0)
        cands = [r for r in cands if len(_norm(r.prompt)) == longest]  # a question inside another: the longer
        if len(cands) > 1:
            ids = [r.run_id for r in cands][:3]
            raise InputError(f"document matches {len(cands)} suite rows by content ({ids}); declare an id "
                             "field (--id-field)", file=s.file, row=s.where, field="doc")
        row = cands[0] if cands else None
        how = "content hash of question + options"
    if row is None:
        hint = "" if s.task in suite.catalogs else \
            f"; task '{s.task}' is not a catalog of it ({list(suite.catalogs)}): samples of another task?"
        raise InputError(f"document ({how}) matches no row of suite {suite.source} (mapping: {m}){hint}",
                         file=s.file, row=s.where, field="doc_id" if m == "doc_id" else "doc")
    return row


def _check_match(s: ToolSample, row: _SuiteRow) -> None:
    """The document's options and gold must be the row's."""
    if [_norm(o) for o in row.options] != [_norm(o) for o in s.options]:
        raise InputError(f"options {list(s.options)[:4]} differ from suite row '{row.run_id}' "
                         f"({list(row.options)[:4]}): samples of another task or another suite?",
                         file=s.file, row=s.where, field="options")
    if s.gold is not None and s.gold != row.gold:
        raise InputError(f"gold {s.gold} differs from suite row '{row.run_id}' (gold {row.gold})",
                         file=s.file, row=s.where, field="target")


def _pick_mode(task: str, samples: list[ToolSample], mode: MapMode, id_field: str | None,
               index: _RowIndex, suite: SuiteRows) -> str:
    if mode != "auto":
        if mode == "doc_id" and not any(t == task for t, _ in index.by_doc):
            raise InputError(f"task '{task}' has no rows with a document id in suite {suite.source} (its "
                             f"catalogs: {list(suite.catalogs)}): samples of another task?",
                             file=samples[0].file, field="task")
        return mode
    if any(t == task for t, _ in index.by_doc) and all(s.doc_id is not None for s in samples):
        return "doc_id"
    if id_field:
        return "id"
    if any(str(s.ids.get("id")) in index.by_run for s in samples if s.ids.get("id") is not None):
        return "auto-id"  # documents whose id is a run_id map by it, the others by content
    return "content"


def softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = math.fsum(exps)
    return [e / total for e in exps]


def synthesized_suite(samples: Sequence[ToolSample], folder: Path, *, name: str) -> Path:
    """A suite made from the tool's own documents (one catalog per task, one leg): what the index is
    computed against when no --suite is given. run_id = f"{task}-{doc_id}", as `jex suite import` names rows."""
    tasks = sorted({s.task for s in samples})
    (folder / "rows").mkdir(parents=True, exist_ok=True)
    catalogs: list[dict[str, Any]] = []
    for t in tasks:
        fname = f"rows/{_slug(t)}.jsonl"
        with open(folder / fname, "w", encoding="utf-8") as f:
            for s in samples:
                if s.task != t:
                    continue
                if s.gold is None:
                    raise InputError("the document has no gold answer the suite could be made from; pass --suite",
                                     file=s.file, row=s.where, field="target")
                f.write(json.dumps(_synthesized_row(s, t), ensure_ascii=False) + "\n")
        catalogs.append({"id": t, "name": t, "leg": "public", "files": [fname]})
        if any(s.acc_norm_choice is not None for s in samples if s.task == t):  # continuation log-likelihoods
            catalogs[-1] |= {"readout": "loglikelihood", "prompt_format": "verbatim"}
    write_toml(folder / "suite.toml", {"name": name, "legs": {"public": 1.0}, "catalogs": catalogs})
    return folder


def _synthesized_row(s: ToolSample, task: str) -> dict[str, Any]:
    """A suite row made from one document. A document jex itself exported names its row (its id is
    the row's run_id, and it carries the row's question_id and labels): the row keeps them, so the
    log maps back by id and the bootstrap clusters as the run did. Any other is `<task>-<doc_id>`
    (or `<task>-<where>`), its own cluster."""
    own = s.ids.get("run_id")
    if isinstance(own, str) and own and s.ids.get("id") == own:
        labels = s.ids.get("labels")
        labels = list(labels) if isinstance(labels, list) and len(labels) == len(s.options) \
            else list(LABELS[:len(s.options)])
        qid = s.ids.get("question_id")
        return {"run_id": own, "catalog": task, "question_id": qid if isinstance(qid, str) and qid else own,
                "prompt": s.context, "options": list(s.options), "labels": labels, "gold": s.gold,
                "metadata": {"task": task, "doc_id": s.doc_id} if s.doc_id is not None else {"task": task, "id": own}}
    key = s.doc_id if s.doc_id is not None else s.where
    return {"run_id": f"{task}-{key}", "catalog": task, "question_id": f"{task}-{key}", "prompt": s.context,
            "options": list(s.options), "labels": list(LABELS[:len(s.options)]), "gold": s.gold,
            "metadata": {"task": task, "doc_id": s.doc_id} if s.doc_id is not None else {"task": task,
                                                                                          "id": str(s.where)}}


def run_suite_manifest(run_dir: Path) -> Any:
    """The `SuiteManifest` of a run, from its bundle (the bundle stage its stages.json records)."""
    from jex.tasks.bundle.bundle_file import open_bundle

    bundle = run_summaries(run_dir).bundle
    if bundle is None:
        raise InputError("no bundle stage recorded; expected a finished run", file=str(run_dir / STAGES_FILE))
    with tempfile.TemporaryDirectory(prefix="jex-interop-") as tmp:
        return open_bundle(bundle.bundle, tmp).suite_manifest()


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def score_mapped(mapped: MappedPredictions, suite: str | Path, out: str | Path, *, draws: int, seed: int,
                 record: ImportRecord, extra: Iterable[tuple[str, Path]] = ()) -> ScoreDoc:
    """Write predictions.jsonl, score.json, score.md and import.json (+ `extra` (name, path) items) into
    `out`: everything is made in a staging folder beside it and moved in only when scoring succeeded.
    Returns the score document (`score.json`)."""
    from jex.fileio import write_json
    from jex.tasks.scoring.score import score_files
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        preds = stage / "predictions.jsonl"
        with open(preds, "w", encoding="utf-8") as f:
            norm = mapped.acc_norm if any(n is not None for n in mapped.acc_norm) else [None] * len(mapped.run_ids)
            for rid, c, p, n in zip(mapped.run_ids, mapped.choices, mapped.probs, norm, strict=True):
                f.write(json.dumps({"run_id": rid, "choice": c, "probs": p,
                                    **({"acc_norm_choice": n} if n is not None else {})}) + "\n")
        as_json = record.model_dump(by_alias=True, exclude_unset=True)  # keyed `from`, ...; unset fields left out
        doc = score_files(suite, preds, stage, draws=draws, seed=seed, settings={"import": as_json})
        write_json(stage / "import.json", {**as_json, "mapping": mapped.mode,
                                           "tasks": {t: a.model_dump() for t, a in mapped.tasks.items()},
                                           "documents": len(mapped.run_ids)})
        for name, path in extra:
            shutil.copytree(path, stage / name) if Path(path).is_dir() else shutil.copyfile(path, stage / name)
        out.mkdir(parents=True, exist_ok=True)
        for item in sorted(stage.iterdir()):
            target = out / item.name
            if target.is_dir() and item.is_dir():
                shutil.rmtree(target)
            os.replace(item, target)
        return doc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
