"""Suites from data a user already has: a Hugging Face dataset, or an lm-evaluation-harness task.

Both importers write a normal jex suite (`suite.toml` + JSONL rows, and few-shot rows where the
source has them) into a temporary folder next to the output and rename it into place only when
every row passed, so a failed import leaves nothing behind. The source (dataset id, revision,
fingerprint, file sha256s; or the task's name, YAML sha256 and version) goes into the manifest's
`[source]` table and from there into every bundle's provenance.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from jex.errors import InputError
from jex.fileio import sha256_file, write_toml
from jex.lm_eval_scoring import (
    BINARY_METRICS,
    ScoringRefusal,
    TaskScoring,
    generative_scoring,
    task_config,
    task_scoring,
)
from jex.suite import MANIFEST_NAME, GenerationSettings, load_manifest

LETTERS = string.ascii_uppercase
LOCAL_FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


@dataclass(frozen=True)
class ImportedRow:
    """One imported multiple-choice row, before it is written."""

    run_id: str
    question_id: str
    prompt: str
    options: tuple[str, ...]
    labels: tuple[str, ...]
    gold: int
    metadata: dict[str, Any] = field(default_factory=dict)
    true_options: tuple[int, ...] | None = None

    def record(self, catalog: str) -> dict[str, Any]:
        record = {"run_id": self.run_id, "catalog": catalog, "question_id": self.question_id, "prompt": self.prompt,
                  "options": list(self.options), "labels": list(self.labels), "gold": self.gold,
                  "metadata": self.metadata}
        return record if self.true_options is None else {**record, "true_options": list(self.true_options)}


@dataclass(frozen=True)
class ImportedGenerationRow:
    """One imported generative row: the context the model continues and the reference answer."""

    run_id: str
    question_id: str
    prompt: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def record(self, catalog: str) -> dict[str, Any]:
        return {"run_id": self.run_id, "catalog": catalog, "question_id": self.question_id, "prompt": self.prompt,
                "answer": self.answer, "metadata": self.metadata}


@dataclass(frozen=True)
class ReadoutSettings:
    """How a catalog's rows are read (the `Catalog` fields of the same names; written only when not
    the default, so a suite that does not use them keeps its bytes)."""

    readout: str = "label_slot"
    prompt_format: str = "template"
    target_delimiter: str = " "
    scoring: str = "accuracy"

    def declared(self) -> dict[str, str]:
        """The settings that are not the default, as the catalog's manifest keys."""
        default = ReadoutSettings()
        return {k: getattr(self, k) for k in ("readout", "prompt_format", "target_delimiter", "scoring")
                if getattr(self, k) != getattr(default, k)}


LM_EVAL_READOUT = ReadoutSettings(readout="loglikelihood", prompt_format="verbatim")
"""An lm-eval multiple_choice task: lm-eval's own context read as it is, each choice's continuation
log-likelihood (its target_delimiter set per task), accuracy (acc_norm reported beside it)."""


@dataclass(frozen=True)
class ImportedCatalog:
    id: str
    rows: Sequence[ImportedRow | ImportedGenerationRow]
    fewshot: list[ImportedRow] = field(default_factory=list)
    weight: float = 1.0
    leg: str = "public"
    name: str | None = None
    readout: ReadoutSettings = ReadoutSettings()
    generative: dict[str, Any] | None = None
    """A generative catalog's manifest keys (kind, scoring, prompt_format, generation, filters, match)."""


@dataclass(frozen=True)
class ImportResult:
    suite_dir: Path
    rows: dict[str, int]
    fewshot_rows: dict[str, int]


@dataclass(frozen=True)
class Where:
    """The place in the source an import error names: file, row and field."""

    file: str
    row: int | None = None
    field: str | None = None

    def at(self, field: str) -> Where:
        return replace(self, field=field)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.file, row=self.row, field=self.field)


# --- answers ---------------------------------------------------------------------------------------

def answer_index(answer: Any, options: Sequence[str], labels: Sequence[str], *, where: Where) -> int:
    """The gold index from an answer given as an index, a label/letter, or the option text."""
    if isinstance(answer, bool) or answer is None:
        raise where.error(f"answer {answer!r} is neither an index, a letter nor an option's text")
    if isinstance(answer, int | float) and float(answer).is_integer():
        i = int(answer)
        if not 0 <= i < len(options):
            raise where.error(f"answer index {i} out of range for {len(options)} options")
        return i
    if isinstance(answer, str):
        text = answer.strip()
        if text in labels:
            return list(labels).index(text)
        if len(text) == 1 and text.upper() in LETTERS[:len(options)]:
            return LETTERS.index(text.upper())
        matches = [i for i, o in enumerate(options) if o.strip() == text]
        if len(matches) == 1:
            return matches[0]
        if re.fullmatch(r"\d+", text) and int(text) < len(options):
            return int(text)
        raise where.error(f"answer {answer!r} is not an index, a label of {list(labels)} or one option's text")
    raise where.error(f"answer {answer!r} of type {type(answer).__name__} is not understood")


def choices_of(value: Any, *, where: Where) -> tuple[list[str], list[str] | None]:
    """Options (and their own labels, when the column carries them as {"text": [...], "label": [...]})."""
    labels = None
    if isinstance(value, dict) and "text" in value:
        labels = [str(x) for x in value.get("label") or []] or None
        value = value["text"]
    if not isinstance(value, list | tuple) or not all(isinstance(x, str | int | float) for x in value):
        raise where.error(f"choices must be a list of strings, got {type(value).__name__}")
    options = [str(x) for x in value]
    if len(options) < 2:
        raise where.error(f"{len(options)} option(s): a multiple-choice row needs at least 2")
    if len(options) > len(LETTERS) and labels is None:
        raise where.error(f"{len(options)} options: more than {len(LETTERS)} need their own labels")
    if labels is not None and len(labels) != len(options):
        raise where.error(f"{len(labels)} labels for {len(options)} options")
    return options, labels


# --- writing ---------------------------------------------------------------------------------------

def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "catalog"


def write_suite(out: str | Path, catalogs: Sequence[ImportedCatalog], *, name: str, source: dict[str, Any],
                force: bool = False) -> ImportResult:
    """Write a suite atomically: into `<out>.tmp-<pid>`, validated by `load_manifest`, then renamed."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError("output folder exists and is not empty (pass --force to replace it)", file=str(out))
    ids = [c.id for c in catalogs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise InputError(f"two catalogs would share the id(s) {dup}", file=str(out))
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rows").mkdir(parents=True)
    manifest: dict[str, Any] = {"name": name, "legs": dict.fromkeys(sorted({c.leg for c in catalogs}), 1.0),
                                "catalogs": []}
    try:
        for cat in catalogs:
            slug = _slug(cat.id)
            _write_jsonl(tmp / "rows" / f"{slug}.jsonl", (r.record(cat.id) for r in cat.rows))
            entry = {"id": cat.id, "name": cat.name or cat.id, "leg": cat.leg, "weight": cat.weight,
                     "files": [f"rows/{slug}.jsonl"], **(cat.generative or cat.readout.declared())}
            if cat.fewshot:
                _write_jsonl(tmp / "rows" / f"{slug}.fewshot.jsonl", (r.record(cat.id) for r in cat.fewshot))
                entry["fewshot_files"] = [f"rows/{slug}.fewshot.jsonl"]
            manifest["catalogs"].append(entry)
        manifest["source"] = _without_none(source)
        write_toml(tmp / MANIFEST_NAME, manifest)
        load_manifest(tmp)  # what we wrote must read back
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ImportResult(out, {c.id: len(c.rows) for c in catalogs}, {c.id: len(c.fewshot) for c in catalogs})


def _without_none(value: Any) -> Any:
    """`value` with the None entries of its tables left out, at every depth (TOML has no null: an unset
    source field, such as a Hub revision not given, is absent from `[source]`)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_without_none(v) for v in value]
    return value


def _write_jsonl(path: Path, records: Iterable[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False, sort_keys=True) + "\n")


# --- Hugging Face datasets ---------------------------------------------------------------------------

def looks_local(dataset: str) -> bool:
    """`dataset` names a local file or folder, not a Hub id (`org/name`): a data file's suffix, a path
    from `/`, `.` or `~`, or more than one `/`."""
    return Path(dataset).suffix in LOCAL_FORMATS or dataset.startswith(("/", ".", "~")) or dataset.count("/") > 1


def hub_offline() -> bool:
    """No Hub to ask: `HF_HUB_OFFLINE` / `HF_DATASETS_OFFLINE` set (now, or when huggingface_hub was
    imported), or the Hub's host does not resolve (a machine without a network)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v, "").upper() in constants.ENV_VARS_TRUE_VALUES
                                       for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname or "huggingface.co", 443)
    except OSError:
        return True
    return False


OFFLINE_WHY = "is offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, or no network)"


@contextmanager
def hub_access(*, local: bool) -> Iterator[bool]:
    """Around a `datasets` / lm-eval load: the libraries' logging (retry notices, reader errors) silenced, and
    their own offline switches on when the input is `local` or `hub_offline()`, so nothing is retried
    against a Hub that cannot answer. Yields whether the Hub is offline; restores both on exit."""
    import datasets
    from huggingface_hub import constants
    from huggingface_hub.utils import logging as hub_logging

    offline = local or hub_offline()
    levels, switches = (datasets.logging.get_verbosity(), hub_logging.get_verbosity()), (
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE)
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its reader errors, raised to us as well
    hub_logging.set_verbosity_error()
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = offline
    try:
        yield offline
    finally:
        datasets.logging.set_verbosity(levels[0])
        hub_logging.set_verbosity(levels[1])
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = switches


def _load_dataset(dataset: str, *, config: str | None, split: str, revision: str | None) -> tuple[Any, dict]:
    """A `datasets.Dataset` and where it came from (local files with their sha256, or the Hub id); a
    local path that does not exist is refused as one, never looked up on the Hub."""
    local = Path(dataset)
    if not local.exists() and looks_local(dataset):
        raise InputError(f"--dataset: no such file: {dataset} (expected a local Parquet/JSON/CSV file or folder, "
                         "or a Hub id org/name)")
    with hub_access(local=local.exists()) as offline:
        return _read_dataset(dataset, config=config, split=split, revision=revision, offline=offline)


def _read_dataset(dataset: str, *, config: str | None, split: str, revision: str | None,
                  offline: bool) -> tuple[Any, dict]:
    import datasets

    local = Path(dataset)
    if local.exists():
        files = sorted(p for p in local.rglob("*") if p.suffix in LOCAL_FORMATS) if local.is_dir() else [local]
        kinds = {LOCAL_FORMATS.get(p.suffix) for p in files}
        if not files or None in kinds or len(kinds) != 1:
            raise InputError("expected Parquet, JSON/JSONL or CSV file(s) of one kind", file=dataset)
        try:
            ds = datasets.load_dataset(kinds.pop(), data_files={split: [str(p) for p in files]}, split=split)
        except Exception as e:  # noqa: BLE001 - any reader failure is a bad input file
            cause = e.__cause__ or e  # datasets' DatasetGenerationError wraps the reader's own error
            raise InputError(f"cannot read the dataset: {type(cause).__name__}: {one_line(cause)}",
                             file=dataset) from None
        return ds, {"kind": "local files", "files": {p.name: sha256_file(p) for p in files},
                    "fingerprint": ds._fingerprint}
    try:
        ds = datasets.load_dataset(dataset, config, split=split, revision=revision)
    except ConnectionError:  # offline (OfflineModeIsEnabled) or the Hub unreachable, and not in the cache
        raise InputError(f"--dataset {dataset}: not in the local Hugging Face cache, and the Hub "
                         f"{OFFLINE_WHY if offline else 'cannot be reached'}: download it where the Hub answers, "
                         "or give a local Parquet/JSON/CSV file") from None
    except Exception as e:  # noqa: BLE001 - not cached, not reachable, no such split or config
        raise InputError(f"dataset {dataset!r} (config {config!r}, split {split!r}) cannot be loaded from the "
                         f"local cache or the Hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                         file=dataset) from None
    return ds, {"kind": "hub", "dataset": dataset, "config": config, "revision": revision,
                "fingerprint": ds._fingerprint, "version": str(ds.info.version) if ds.info.version else None}


def _column(ds: Any, col: str | None, flag: str, dataset: str) -> None:
    if col is not None and col not in ds.column_names:
        raise InputError(f"no column {col!r} (columns: {ds.column_names})", file=dataset, field=f"{flag} {col}")


def cluster_of(record: Any, column: str | None, *, catalog: str, default: str, where: Where) -> str:
    """The row's question_id: `<catalog>-<record[column]>` (rows of one question resample together in
    the clustered bootstrap), or `default` (the run_id: every row its own cluster) without a column."""
    if column is None:
        return default
    value = record.get(column) if isinstance(record, dict) else None
    if value is None or (isinstance(value, str) and not value.strip()):
        raise where.at(column).error(f"no cluster value in {column!r} (--cluster): every row needs one")
    if isinstance(value, dict | list):
        raise where.at(column).error(f"cluster value {value!r} is not a scalar (--cluster names an id column)")
    return f"{catalog}-{value}"


def mc_rows_from_records(records: Iterable[dict[str, Any]], *, catalog: str, question: str, choices: str,
                         answer: str, id_col: str | None, file: str, cluster: str | None = None,
                         prompt_of: Callable[[dict[str, Any]], str] | None = None) -> list[ImportedRow]:
    """Records with a question, a choices list and an answer into validated rows (unique ids); with
    `cluster`, the column whose value is the row's question_id (its bootstrap cluster)."""
    rows: list[ImportedRow] = []
    seen: dict[str, int] = {}
    for i, rec in enumerate(records):
        where = Where(file, i)
        options, own_labels = choices_of(rec[choices], where=where.at(choices))
        labels = own_labels or list(LETTERS[:len(options)])
        if len(set(labels)) != len(labels):
            raise where.at(choices).error(f"labels must be distinct, got {labels}")
        gold = answer_index(rec[answer], options, labels, where=where.at(answer))
        ident = str(rec[id_col]) if id_col else str(i)
        if ident in seen:
            raise where.at(id_col or "index").error(f"duplicate id {ident!r} (first at row {seen[ident]})")
        seen[ident] = i
        prompt = prompt_of(rec) if prompt_of else rec[question]
        if not isinstance(prompt, str) or not prompt.strip():
            raise where.at(question).error("empty or non-text question")
        qid = cluster_of(rec, cluster, catalog=catalog, default=f"{catalog}-{ident}", where=where)
        rows.append(ImportedRow(f"{catalog}-{ident}", qid, prompt, tuple(options), tuple(labels), gold,
                                {"source_row": i, **({"id": rec[id_col]} if id_col else {})}))
    if not rows:
        raise InputError("the split has no rows", file=file)
    return rows


def import_hf(dataset: str, out: str | Path, *, split: str, question: str, choices: str, answer: str,
              config: str | None = None, id_col: str | None = None, catalog: str | None = None,
              revision: str | None = None, fewshot_split: str | None = None, cluster: str | None = None,
              force: bool = False) -> ImportResult:
    """A Hugging Face dataset (Hub id through the local cache, or local files) as a one-catalog suite;
    `cluster`: the column that names a row's question (its question_id, the bootstrap cluster)."""
    ds, source = _load_dataset(dataset, config=config, split=split, revision=revision)
    for col, flag in ((question, "--question"), (choices, "--choices"), (answer, "--answer"), (id_col, "--id"),
                      (cluster, "--cluster")):
        _column(ds, col, flag, dataset)
    cat = _slug(catalog or (Path(dataset).stem if Path(dataset).exists() else dataset.split("/")[-1]))
    rows_of = partial(mc_rows_from_records, catalog=cat, question=question, choices=choices, answer=answer,
                      id_col=id_col, cluster=cluster)
    rows = rows_of(ds, file=f"{dataset} [{split}]")
    fewshot: list[ImportedRow] = []
    if fewshot_split:
        shots, _ = _load_dataset(dataset, config=config, split=fewshot_split, revision=revision)
        fewshot = [ImportedRow(f"{r.run_id}-shot", r.question_id + "-shot", r.prompt, r.options, r.labels, r.gold,
                         r.metadata) for r in rows_of(shots, file=f"{dataset} [{fewshot_split}]")]
    src = {"importer": "hf", "split": split, **source, "columns": {"question": question, "choices": choices,
                                                                    "answer": answer, "id": id_col,
                                                                    "cluster": cluster}}
    return write_suite(out, [ImportedCatalog(cat, rows, fewshot)], name=cat, source=src, force=force)


# --- lm-evaluation-harness tasks ---------------------------------------------------------------------

MAX_FEWSHOT_ROWS = 100
"""Few-shot rows kept per catalog: enough for any sensible `num_fewshot`, small in the bundle."""


def _lm_eval_spec(task: str, data_files: dict[str, str] | None, *, defaults: bool) -> tuple[Any, Any, str]:
    """The TaskManager, what to load (a name, a YAML path, or a full config with local data files), and
    the name to report errors under."""
    from lm_eval.tasks import TaskManager

    path = Path(task)
    is_yaml = path.suffix in (".yaml", ".yml")
    if is_yaml and not path.is_file():
        raise InputError("no such task YAML", file=task)
    from lm_eval.tasks._index import TaskIndex

    manager = TaskManager(include_path=str(path.resolve().parent) if is_yaml else None,
                          include_defaults=defaults or not is_yaml)
    if not data_files:
        if not is_yaml:
            return manager, task, task
        head = task_yaml(path, file=task, resolve_func=False, recursive=False)
        check_local_data(task_yaml(path, file=task, resolve_func=False) if "include" in head else head, None,
                         file=task)
        # by its registered name: a group file loaded by path is read as a task
        name = head.get("group") if isinstance(head.get("group"), str) and "task" in head else head.get("task")
        return manager, name if isinstance(name, str) else str(path.resolve()), task

    if is_yaml:
        task_yaml(path, file=task, resolve_func=False)  # a broken file named here, before lm-eval's index reads it
    entry = TaskIndex.entry_from_path(path.resolve()) if is_yaml else manager._entry(task)
    if entry is None or entry.yaml_path is None:
        raise InputError(f"no lm-eval task named {task!r} (and it is not a YAML file)", file=task)
    cfg = task_yaml(Path(entry.yaml_path), file=task)
    if "task" not in cfg or not isinstance(cfg["task"], str):
        raise InputError("--data-files applies to one task, not a group", file=task)
    kinds = {LOCAL_FORMATS.get(Path(f).suffix) for f in data_files.values()}
    if None in kinds or len(kinds) != 1:
        raise InputError(f"--data-files must be Parquet, JSON/JSONL or CSV of one kind, got {data_files}", file=task)
    for f in data_files.values():
        if not Path(f).is_file():
            raise InputError("data file does not exist", file=f)
    check_local_data({**cfg, "dataset_path": next(iter(kinds))}, data_files, file=task)
    cfg.pop("dataset_name", None)
    cfg.update(dataset_path=kinds.pop(), dataset_kwargs={"data_files": {k: str(Path(v).resolve())
                                                                         for k, v in data_files.items()}})
    return manager, cfg, task


def task_yaml(path: Path, *, file: str, resolve_func: bool = True, recursive: bool = True) -> dict[str, Any]:
    """A task YAML as lm-eval reads it (`load_yaml`: includes merged unless not `recursive`, `!function`
    resolved when `resolve_func`); any failure is one line naming `file`."""
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        return load_yaml(path.resolve(), resolve_func=resolve_func, recursive=recursive)
    except Exception as e:  # noqa: BLE001 - any YAML, include or !function failure is a bad input file
        raise InputError(f"cannot read the task YAML: {' '.join(str(e).split())}", file=file) from None


LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
"""`datasets` builders that read local files: with no data files they read the current folder."""


def read_splits(cfg: dict[str, Any]) -> dict[str, str]:
    """The splits lm-eval reads when it builds a task, each with the config field naming it: the
    evaluation docs (`test_split`, else `validation_split`) and the few-shot docs (`fewshot_split`, else
    the training, validation or test split, as `Task.fewshot_docs` falls back)."""
    fields = [next((f for f in ("test_split", "validation_split") if cfg.get(f)), None),
              next((f for f in ("fewshot_split", "training_split", "validation_split", "test_split") if cfg.get(f)),
                   None)]
    return {str(cfg[f]): f for f in reversed(fields) if f}


def check_local_data(cfg: dict[str, Any], data_files: Collection[str] | None, *, file: str) -> None:
    """A task that reads local files (`dataset_path: json`, ...) has data for every split lm-eval reads
    (`data_files`: the splits `--data-files` gives, else the YAML's `dataset_kwargs.data_files`); else
    `datasets` would read the current folder, or lm-eval fail on the split's KeyError."""
    task = cfg.get("task")
    if not isinstance(task, str) or cfg.get("dataset_path") not in LOCAL_BUILDERS:
        return
    if data_files is None:
        declared = (cfg.get("dataset_kwargs") or {}).get("data_files")
        data_files = list(declared) if isinstance(declared, dict) else ["train"] * bool(declared)
    missing = {split: f for split, f in read_splits(cfg).items() if split not in data_files}
    if not missing:
        return
    add = "add " + " ".join(f"--data-files {split}=FILE" for split in missing)
    if not data_files:
        raise InputError(f"task '{task}' reads dataset_path: {cfg['dataset_path']} from local files, and none are "
                         f"given: {add}", file=file, field="dataset_kwargs.data_files")
    split, field_name = next(iter(missing.items()))
    raise InputError(f"task '{task}' reads split '{split}' ({field_name}), and no data file is given for it "
                     f"(given: {', '.join(sorted(data_files))}): {add}", file=file, field=field_name)


def _leaf_tasks(loaded: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(name, task, weight_by_size) for every leaf task of `TaskManager.load`'s result; a task is
    weighted by size when a group that holds it aggregates with `weight_by_size`."""
    by_size: set[str] = set()
    for name, group in loaded.get("groups", {}).items():
        metrics = getattr(group, "aggregate_metric_list", None) or []
        if any(getattr(m, "weight_by_size", False) for m in metrics):
            by_size |= set(loaded.get("group_map", {}).get(name, []))
    return [(name, task, name in by_size) for name, task in loaded["tasks"].items()]


def _group_aggregates(loaded: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every loaded group that reports aggregates (its `aggregate_metric_list`): its leaf tasks' catalogs
    and, per metric, whether lm-eval weights the tasks by size; `jex export lm-eval` writes the group's
    entry from them as lm-eval's `Group.aggregate` does."""
    out = {}
    for name, group in loaded.get("groups", {}).items():
        aggregates = getattr(group, "aggregate_metric_list", None) or []
        if not aggregates:
            continue
        out[name] = {"catalogs": [_slug(t.task_name) for t in group.get_all_tasks()],
                     "aggregate": [{"metric": a.metric, "weight_by_size": bool(a.weight_by_size)} for a in aggregates]}
    return out


@dataclass(frozen=True)
class LmEvalRequest:
    """What lm-eval sends the model for one document, one (context, continuation) pair per choice
    (`arguments[i]`): one context and target_delimiter + each choice; for a multiple-input task
    (Winogrande) a context per choice and one continuation, target_delimiter + doc_to_target."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]


def lm_eval_requests(task: Any, *, file: str) -> dict[int, LmEvalRequest]:
    """Every evaluation document's request, built by the harness itself as `lm_eval run` builds it:
    num_fewshot unset means 0, the few-shot sampler seeded with the CLI's default seed (1234), no
    chat template, no system instruction, documents in order (so `--limit N` gives the same first N)."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    if task.get_config("num_fewshot") is None:
        task.set_config(key="num_fewshot", value=0)
    task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
    import lm_eval.api.task as task_module
    import lm_eval.utils as lm_utils

    bar, compile_template = task_module.tqdm, lm_utils.env.from_string
    task_module.tqdm = partial(bar, disable=True)  # its progress bar per task
    # lm-eval compiles each Jinja template again for every document (~97% of its request building, measured
    # at 10,000 rows); a template compiled once from the same source in the same environment renders the same
    lm_utils.env.from_string = lru_cache(maxsize=256)(compile_template)
    try:
        task.build_all_requests(limit=None, rank=0, world_size=1)
    except Exception as e:  # noqa: BLE001 - a template or sampler failure is a bad task
        raise InputError(f"lm-eval cannot build the task's requests: {type(e).__name__}: {e}", file=file) from None
    finally:
        task_module.tqdm, lm_utils.env.from_string = bar, compile_template
    by_doc: dict[int, list[Any]] = {}
    for inst in task.instances:
        by_doc.setdefault(int(inst.doc_id), []).append(inst)
    out = {}
    for doc_id, insts in by_doc.items():
        args = [i.arguments for i in sorted(insts, key=lambda i: i.idx) if i.arguments[0]]
        out[doc_id] = LmEvalRequest(tuple(a[0] for a in args), tuple(a[1] for a in args))
    return out


def _lm_eval_gold(target: Any, options: Sequence[str], labels: Sequence[str], *, where: Where) -> int:
    """The gold index as lm-eval reads it (an index, or the choice's text), else as `answer_index` does."""
    if isinstance(target, list):
        raise where.error("multiple targets per document are not supported")
    if isinstance(target, str) and target in options:
        return list(options).index(target)
    return answer_index(target, options, labels, where=where)


def _task_rows(name: str, task: Any, docs: Iterable[Any], *, file: str, run_suffix: str = "",
               requests: dict[int, LmEvalRequest] | None = None, cluster: str | None = None,
               scoring: TaskScoring = TaskScoring()) -> list[ImportedRow]:
    """One row per document: with `requests`, the prompt is lm-eval's own context for it (description,
    few-shot examples and doc_to_text, as the harness joins them) and the options its choices exactly as
    lm-eval continues the context with them; without (few-shot rows), the prompt is doc_to_text. A
    multi-gold task's rows list their true options as its scoring function reads them."""
    rows = []
    delimiter = task.config.target_delimiter
    for doc_id, doc in enumerate(docs):
        where = Where(file, doc_id)
        choices, _ = choices_of(task.doc_to_choice(doc), where=where.at("doc_to_choice"))
        labels = list(LETTERS[:len(choices)])
        request = requests[doc_id] if requests is not None else None
        if task.multiple_input:  # Winogrande: the choices are contexts, the target the one continuation
            options = list(request.contexts) if request is not None else choices
            gold = _lm_eval_gold(task.doc_to_text(doc), options, labels, where=where.at("doc_to_text"))
            text = task.doc_to_target(doc)
            if request is not None and (len(options) != len(choices) or set(request.continuations) != {
                    f"{delimiter}{text}"}):
                raise where.at("doc_to_target").error(
                    f"lm-eval's continuations {list(request.continuations)[:4]} are not the target {text!r} after "
                    f"the target delimiter {delimiter!r}, once per choice")
        else:
            options = choices
            gold = _lm_eval_gold(task.doc_to_target(doc), options, labels, where=where.at("doc_to_target"))
            if request is not None and len(set(request.contexts)) != 1:
                raise where.at("doc_to_text").error(f"{len(set(request.contexts))} contexts for one document")
            text = task.doc_to_text(doc) if request is None else request.contexts[0]
            if request is not None and list(request.continuations) != [f"{delimiter}{o}" for o in options]:
                raise where.at("doc_to_choice").error(
                    f"lm-eval's continuations {list(request.continuations)[:4]} are not the choices "
                    f"{options[:4]} after the target delimiter {delimiter!r}")
        if not isinstance(text, str) or not text.strip():
            raise where.at("doc_to_target" if task.multiple_input else "doc_to_text").error(f"it gave {text!r}")
        run_id = f"{name}-{doc_id}{run_suffix}"
        qid = cluster_of(doc, cluster, catalog=name, default=run_id, where=where)
        true = None
        if scoring.true_options is not None:
            try:
                true = tuple(scoring.true_options(doc))
            except (KeyError, TypeError, IndexError) as e:
                raise where.at("process_results").error(f"the document's true options cannot be read: "
                                                        f"{type(e).__name__}: {e}") from None
            if gold not in true:
                raise where.at("doc_to_target").error(f"the gold option {gold} is not among the true options {true}")
        rows.append(ImportedRow(run_id, qid + run_suffix if cluster else qid, text, tuple(options), tuple(labels),
                                gold, {"task": name, "doc_id": doc_id}, true))
    return rows


def import_lm_eval(task: str, out: str | Path, *, data_files: dict[str, str] | None = None, leg: str = "public",
                   cluster: str | None = None, force: bool = False) -> ImportResult:
    """An lm-evaluation-harness `multiple_choice` or `generate_until` task (or a group of them) as a jex suite
    (a generate_until task: a generative catalog, `_generative_catalog`).

    Documents are read through the harness's own machinery (`doc_to_text`, `doc_to_choice`,
    `doc_to_target`, Jinja or `!function`); each row's prompt is the context lm-eval sends for it
    (`lm_eval_requests`: description, few-shot examples and delimiters included), read verbatim with
    the log-likelihood readout; each row keeps the task's document id (its index in the task's
    evaluation docs) as `metadata.doc_id` and `run_id = f"{task}-{doc_id}"`; `cluster` names the doc
    field whose value is the row's question_id. A group's tasks become catalogs, weighted by size when
    the group aggregates with `weight_by_size`. The task's few-shot split becomes the catalog's few-shot
    rows; its `num_fewshot` is recorded in `[source]`.
    """
    loaded, shown = _load_lm_eval(task, data_files)
    catalogs, settings = [], {}
    for name, t, by_size in _leaf_tasks(loaded):
        file = f"{shown} [{name}]"
        fields = list(getattr(t, "features", None) or [])
        if cluster is not None and cluster not in fields:
            raise InputError(f"no doc field {cluster!r} (fields: {fields})", file=file,
                             field=f"--cluster {cluster}")
        make = _generative_catalog if t.config.output_type == "generate_until" else _choice_catalog
        catalog, settings[name] = make(name, t, shown=shown, leg=leg, cluster=cluster)
        catalogs.append(replace(catalog, weight=float(len(catalog.rows)) if by_size else 1.0))
    from importlib import metadata

    from lm_eval.defaults import DEFAULT_OTHER_SEED

    source = {"importer": "lm-eval", "task": shown, "lm_eval": metadata.version("lm_eval"),
              "yaml_sha256": sha256_file(Path(task)) if Path(task).is_file() else None,
              "data_files": {k: sha256_file(Path(v)) for k, v in (data_files or {}).items()} or None,
              "prompts": "lm-eval", "chat_template": "none", "fewshot_seed": DEFAULT_OTHER_SEED,
              "cluster": cluster, "tasks": settings}
    groups = _group_aggregates(loaded)
    if groups:
        source["groups"] = groups
    suite_name = catalogs[0].name if len(catalogs) == 1 else Path(shown).stem
    return write_suite(out, catalogs, name=suite_name or "suite", source=source, force=force)


def _choice_catalog(name: str, task: Any, *, shown: str, leg: str, cluster: str | None
                    ) -> tuple[ImportedCatalog, dict[str, Any]]:
    """A `multiple_choice` task as a catalog read by lm-eval's log-likelihoods (its few-shot split as few-shot
    rows), with the settings `[source.tasks]` records; what jex does not reproduce refused in one line."""
    scoring = task_scoring(name, task_config(task), multiple_input=bool(task.multiple_input))
    if isinstance(scoring, ScoringRefusal):
        raise InputError(scoring.line(), file=shown, field=scoring.field)
    file = f"{shown} [{name}]"
    rows = _task_rows(name, task, task.eval_docs, file=file, requests=lm_eval_requests(task, file=file),
                      cluster=cluster, scoring=scoring)
    binary = [m for m in scoring.metrics if m in BINARY_METRICS]
    wide = next((r for r in rows if len(r.options) > 2), None)
    if binary and wide is not None:
        raise InputError(f"task '{name}': {binary[0]} is lm-eval's binary F1 (scikit-learn's default), "
                         f"undefined on rows of more than two choices ({len(wide.options)} here)",
                         file=file, row=wide.run_id, field="metric_list")
    shots_docs = task.fewshot_docs() if task.config.fewshot_split else None
    shots = _task_rows(name, task, list(shots_docs)[:MAX_FEWSHOT_ROWS], file=f"{shown} [{name} few-shot]",
                       run_suffix="-shot", cluster=cluster, scoring=scoring) if shots_docs is not None else []
    readout = replace(LM_EVAL_READOUT, target_delimiter=task.config.target_delimiter, scoring=scoring.scoring,
                      readout="partial_loglikelihood" if task.multiple_input else "loglikelihood")
    settings = {"num_fewshot": task.config.num_fewshot, "fewshot_split": task.config.fewshot_split,
                "target_delimiter": task.config.target_delimiter,
                "fewshot_delimiter": task.config.fewshot_delimiter,
                "description": task.config.description or None,
                "version": (task.config.metadata or {}).get("version"), "metrics": list(scoring.metrics)}
    return ImportedCatalog(_slug(name), rows, shots, 1.0, leg, name, readout), settings


def _generative_catalog(name: str, task: Any, *, shown: str, leg: str, cluster: str | None
                        ) -> tuple[ImportedCatalog, dict[str, Any]]:
    """A `generate_until` task as a generative catalog: each document's context as lm-eval builds it (few-shot
    examples included), its target as the reference answer (lm-eval's: a choice's text where the task has
    choices is refused, a number as its text), the task's greedy generation settings, filters and exact_match
    settings (`generative_scoring`; anything else refused in one line)."""
    file = f"{shown} [{name}]"
    scoring = generative_scoring(name, task_config(task), task.config.generation_kwargs)
    if isinstance(scoring, ScoringRefusal):
        raise InputError(scoring.line(), file=file, field=scoring.field)
    if task.config.doc_to_choice is not None:
        raise InputError(f"task '{name}': doc_to_choice is set; jex compares a generative answer with the target "
                         "text itself", file=file, field="doc_to_choice")
    requests = lm_eval_requests(task, file=file)
    rows = []
    for doc_id, doc in enumerate(task.eval_docs):
        where = Where(file, doc_id)
        contexts = requests[doc_id].contexts
        if len(contexts) != 1 or not contexts[0].strip():
            raise where.at("doc_to_text").error(f"lm-eval built {len(contexts)} contexts for one document")
        target = task.doc_to_target(doc)
        if isinstance(target, list):
            raise where.at("doc_to_target").error("multiple targets per document are not supported")
        run_id = f"{name}-{doc_id}"
        rows.append(ImportedGenerationRow(run_id, cluster_of(doc, cluster, catalog=name, default=run_id, where=where),
                                          contexts[0], str(target), {"task": name, "doc_id": doc_id}))
    generative = {"kind": "generate", "scoring": "exact_match", "prompt_format": "verbatim",
                  "generation": GenerationSettings(until=scoring.until, max_tokens=scoring.max_tokens,
                                                   temperature=scoring.temperature, top_p=scoring.top_p,
                                                   top_k=scoring.top_k, samples=scoring.samples
                                                   ).model_dump(mode="json"),
                  "filters": [f.model_dump(mode="json", exclude_none=True) for f in scoring.filters],
                  "match": scoring.match.model_dump(mode="json")}
    settings = {"num_fewshot": task.config.num_fewshot, "fewshot_split": task.config.fewshot_split,
                "fewshot_delimiter": task.config.fewshot_delimiter, "description": task.config.description or None,
                "version": (task.config.metadata or {}).get("version"), "metrics": ["exact_match"],
                "filters": [f.name for f in scoring.filters] or ["none"]}
    if scoring.temperature > 0 and "top_k" not in (task.config.generation_kwargs or {}):
        settings["top_k"] = "unset: all tokens, as vLLM samples (lm-eval's HF backend: the model's generation config)"
    return ImportedCatalog(_slug(name), rows, leg=leg, name=name, generative=generative), settings


def _load_lm_eval(task: str, data_files: dict[str, str] | None) -> tuple[dict[str, Any], str]:
    """`TaskManager.load` of the task (a YAML alone first: indexing the ~10,000 built-in tasks is slow),
    and the name to report errors under."""
    import logging

    from datasets.exceptions import DatasetGenerationError

    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # per-task notes about default metric settings
    for defaults in (False, True):  # a task YAML rarely needs the ~10,000 built-in tasks indexed (slow)
        manager, spec, shown = _lm_eval_spec(task, data_files, defaults=defaults)
        with hub_access(local=bool(data_files)) as offline:
            try:
                return manager.load([spec]), shown
            except KeyError as e:  # a name only the built-in index knows (a group of built-in tasks)
                error: Exception = e
            except ConnectionError:  # OfflineModeIsEnabled, or the Hub unreachable: a Hub dataset not cached
                raise InputError(f"task {shown!r} reads a Hub dataset that is not in the local Hugging Face cache, "
                                 f"and the Hub {OFFLINE_WHY if offline else 'cannot be reached'}: add --data-files "
                                 "SPLIT=FILE, or download it where the Hub answers", file=shown) from None
            except DatasetGenerationError as e:  # the task's data files do not parse as its dataset_path says
                error = e.__cause__ or e
                break
            except (ValueError, FileNotFoundError, OSError) as e:
                error = e
                break
    raise InputError(f"lm-eval cannot load task {shown!r}: {type(error).__name__}: {one_line(error)}",
                     file=shown) from None


def one_line(error: BaseException) -> str:
    """An exception's message on one line: its first line (a library's message may run over many)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
