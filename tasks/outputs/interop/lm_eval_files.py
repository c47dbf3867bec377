"""lm-evaluation-harness files in and out: `samples_<task>_<date>.jsonl` + `results_<date>.json`.

In (`read_lm_eval`): a `--log_samples` output folder (or one samples file) of a `multiple_choice` task
becomes `ToolSample`s: the options are the continuations (`arguments[*].arg_1` less the task's
target delimiter), the context is `arg_0`, the choice is lm-eval's own decision for `acc`
(argmax of the log-likelihoods in `filtered_resps`, ties to the first), the probabilities are those
log-likelihoods renormalised over the options, and gold is `target`. File names are read with
lm-eval's own helpers (`lm_eval.utils.get_results_filenames`, `get_file_task_name`, ...).

Out (`export_lm_eval`): a run folder's `samples.parquet` in the same layout, one samples file per
catalog (task = catalog id; doc_id = the row's imported document id, else its index in the catalog),
with `arguments` = the rendered prompt and the label continuations jex read, `filtered_resps` = the
final log-probabilities, `acc` = the final choice is gold, and a `jex` block per sample (run_id,
choice, decided_by, gated, rationale). A generative catalog becomes a `generate_until` task: one line per
document and filter (`resps` the generation, `filtered_resps` the filter's answer, `exact_match` its
verdict), `exact_match,<filter>` per filter in the results, its generation_kwargs and filter_list in its
config. Rows the suite excludes from scoring are left out, as lm-eval has no such notion.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast
from unittest import mock

import polars as pl

from jex.errors import InputError
from jex.fileio import read_json

# argmaxes tie to the first, as numpy (and lm-eval)
from jex.numerics import argmax, byte_normalised_choice, choice_softmax, length_normalised_choice
from jex.run_records import RunStages
from jex.suite import LOGLIKELIHOOD_READOUTS, GenerationSettings
from jex.tasks.documents import ScoreDoc
from jex.tasks.outputs.interop.common import (
    ImportRecord,
    MapMode,
    RunToExport,
    TaskAgreement,
    ToolSample,
    catalog_summary,
    load_suite_rows,
    map_samples,
    read_run_to_export,
    run_suite_manifest,
    score_mapped,
    softmax,
    synthesized_suite,
)


@dataclass(frozen=True)
class LmEvalRun:
    """The samples of an lm-eval run, and what its results file reports per task (`acc,none`)."""

    samples: list[ToolSample]
    reported: dict[str, float]
    files: list[str]
    reported_norm: dict[str, float] = field(default_factory=dict)  # `acc_norm,none` per task


def _lm_utils() -> Any:
    try:
        from lm_eval import utils
    except ImportError as e:
        raise InputError("lm-eval is not installed: pip install 'jex[interop]'") from e
    return utils


@dataclass(frozen=True)
class _SamplesFile:
    """One `--log_samples` file, told apart by what it holds: its lines' `doc_id`, `arguments` and
    `filtered_resps`, and the task hash lm-eval records for it in the results file (`task_hashes`)."""

    path: str
    task_hash: str | None  # sha256 of every line's doc_hash + prompt_hash + target_hash, as lm-eval hashes it
    jex_task: str | None  # a jex export names its catalog in each line's `jex` block


@dataclass(frozen=True)
class _ResultsFile:
    path: str
    doc: dict[str, Any]

    def task_of_hash(self, task_hash: str | None) -> str | None:
        hashes = self.doc.get("task_hashes") or {}
        return next((t for t, h in hashes.items() if task_hash and h == task_hash), None)

    def tasks(self) -> list[str]:
        return list(self.doc.get("configs") or self.doc.get("results") or {})


def _sniff_samples(path: str) -> _SamplesFile | None:
    """The file as a samples file, or None when its first line is not an lm-eval sample."""
    from lm_eval.utils import hash_string

    hashes: list[str | None] = []
    jex_task = None
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f):
                if not line.strip():
                    continue
                rec = json.loads(line)
                if n == 0 and not (isinstance(rec, dict) and {"doc_id", "arguments", "filtered_resps"} <= rec.keys()):
                    return None
                hashes.append(f"{rec.get('doc_hash')}{rec.get('prompt_hash')}{rec.get('target_hash')}"
                              if all(k in rec for k in ("doc_hash", "prompt_hash", "target_hash")) else None)
                jex_task = jex_task or (rec.get("jex") or {}).get("task")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    if not hashes:
        return None
    whole = [h for h in hashes if h is not None]
    return _SamplesFile(path, hash_string("".join(whole)) if len(whole) == len(hashes) else None, jex_task)


def _sniff_results(path: str) -> _ResultsFile | None:
    try:
        doc = read_json(path)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return _ResultsFile(path, doc) if isinstance(doc, dict) and isinstance(doc.get("results"), dict) else None


def _candidates(source: Path) -> tuple[list[_SamplesFile], list[_ResultsFile]]:
    """Every samples file and results file of the folder (or beside the one samples file), by content."""
    if not source.exists():
        raise InputError("no lm-eval samples file or output folder here", file=str(source))
    folder = source.parent if source.is_file() else source
    files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(folder.resolve()) for f in fs)
    results = [r for f in files if f.endswith(".json") and (r := _sniff_results(f)) is not None]
    if source.is_file():
        one = _sniff_samples(str(source.resolve()))
        if one is None:
            raise InputError("not an lm-eval --log_samples file (its first line has no doc_id, arguments and "
                             "filtered_resps)", file=str(source), row=1)
        return [one], results
    samples = [s for f in files if f.endswith(".jsonl") and (s := _sniff_samples(f)) is not None]
    if not samples:
        raise InputError("no lm-eval samples file here (a .jsonl of doc_id, arguments, filtered_resps): run "
                         "lm_eval with --log_samples --output_path", file=str(source))
    return samples, results


def find_files(source: Path) -> tuple[dict[str, str], str | None]:
    """{samples file: task} and the results file of an lm-eval run (the latest one in a folder).

    A samples file's task is read from its contents: the results file whose `task_hashes` holds its
    hash names it (lm-eval hashes each task's samples); else the task its `jex` block names (a jex
    export); else the only task of the results file; else, last, lm-eval's file name
    `samples_<task>_<date>.jsonl`. A renamed samples file therefore keeps its task."""
    samples, results = _candidates(Path(source))
    by_hash = {s.path: next(((r, t) for r in results if (t := r.task_of_hash(s.task_hash))), None) for s in samples}
    matched = [m[0] for m in by_hash.values() if m]
    if matched:
        latest: _ResultsFile | None = max(matched, key=lambda r: (r.doc.get("date") or 0, r.path))
        samples = [s for s in samples if (m := by_hash[s.path]) is not None and m[0] is latest]
    else:
        samples, latest = _latest_by_name(samples, results)
    return {s.path: _task_of(s, by_hash[s.path], latest, single=len(samples) == 1) for s in samples}, \
        (latest.path if latest else None)


def _latest_by_name(samples: list[_SamplesFile], results: list[_ResultsFile]
                    ) -> tuple[list[_SamplesFile], _ResultsFile | None]:
    """No task hash to go by (an older lm-eval, or edited files): lm-eval's own file names pick the
    latest run's samples and its results file, where they follow lm-eval's naming."""
    u = _lm_utils()
    named = u.get_sample_results_filenames([s.path for s in samples])
    if not named:
        return samples, results[0] if len(results) == 1 else None
    stamp = u.get_file_datetime(os.path.basename(u.get_latest_filename(named)))
    samples = [s for s in samples if s.path in named and u.get_file_datetime(os.path.basename(s.path)) == stamp]
    names = u.get_results_filenames([r.path for r in results])
    return samples, next((r for r in results if r.path in names and
                          u.get_file_datetime(os.path.basename(r.path)).removesuffix(".json") == stamp), None)


def _task_of(s: _SamplesFile, hashed: tuple[_ResultsFile, str] | None, results: _ResultsFile | None, *,
             single: bool) -> str:
    if hashed:
        return hashed[1]
    if s.jex_task:
        return s.jex_task
    if results is not None and single and len(results.tasks()) == 1:
        return results.tasks()[0]
    name = os.path.basename(s.path)
    if name.startswith("samples_") and name.count("_") >= 2:
        return _lm_utils().get_file_task_name(name)
    raise InputError("cannot tell which task this samples file holds: no results file beside it records its task "
                     "hash (lm-eval's `task_hashes`), and its name is not samples_<task>_<date>.jsonl",
                     file=s.path)


def read_lm_eval(source: str | Path, *, metric: str = "acc") -> LmEvalRun:
    """Every document of the samples files (filter `none`), validated line by line."""
    samples_files, results_file = find_files(Path(source))
    results = read_json(results_file) if results_file else {}
    out: list[ToolSample] = []
    for path, task in samples_files.items():
        config = (results.get("configs") or {}).get(task) or {}
        if config.get("output_type", "multiple_choice") != "multiple_choice":
            raise InputError(f"task '{task}' is {config['output_type']!r}; only multiple_choice tasks can be scored",
                             file=results_file, field="configs.output_type")
        delimiter = config.get("target_delimiter", " ")
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    s = _sample(line, path=path, line=line_no, task=task, delimiter=delimiter, metric=metric)
                    if s is not None:
                        out.append(s)
    if not out:
        raise InputError("no documents in the samples file(s)", file=next(iter(samples_files)))
    reported = {t: float(v[f"{metric},none"]) for t, v in (results.get("results") or {}).items()
                if f"{metric},none" in v}
    reported_norm = {t: float(v["acc_norm,none"]) for t, v in (results.get("results") or {}).items()
                     if "acc_norm,none" in v}
    return LmEvalRun(out, reported, [*samples_files, *([results_file] if results_file else [])], reported_norm)


def _sample(text: str, *, path: str, line: int, task: str, delimiter: str, metric: str) -> ToolSample | None:
    def bad(field: str, msg: str) -> InputError:
        return InputError(msg, file=path, row=line, field=field)

    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad("", f"not JSON ({e.msg})") from None
    for key in ("doc_id", "arguments", "filtered_resps", "target"):
        if key not in rec:
            raise bad(key, "missing: not an lm-eval --log_samples line")
    if rec.get("filter", "none") != "none":
        return None
    args = list(rec["arguments"].values()) if isinstance(rec["arguments"], dict) else rec["arguments"]
    try:
        contexts = [a["arg_0"] if isinstance(a, dict) else a[0] for a in args]
        conts = [a["arg_1"] if isinstance(a, dict) else a[1] for a in args]
        lls = [float(r[0]) for r in rec["filtered_resps"]]
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise bad("filtered_resps", f"not a multiple_choice sample (one [loglik, is_greedy] per choice): {e}") from None
    if len(lls) != len(conts) or len(conts) < 2:
        raise bad("filtered_resps", f"{len(lls)} log-likelihoods for {len(conts)} choices")
    options = tuple(c[len(delimiter):] if delimiter and c.startswith(delimiter) else c for c in conts)
    jex = rec.get("jex") if isinstance(rec.get("jex"), dict) else {}
    doc = rec.get("doc") if isinstance(rec.get("doc"), dict) else {}
    if jex and isinstance(doc.get("options"), list) and len(doc["options"]) == len(options):
        options = tuple(doc["options"])  # a jex export: the continuations are labels, the texts are in the doc
    choice = jex["choice"] if "choice" in jex else argmax(lls)
    probs = jex["probs"] if "probs" in jex else softmax(lls)
    ids = {**doc, "id": jex["run_id"]} if "run_id" in jex else doc  # a jex export names its rows
    norm = jex.get("acc_norm_choice") if jex else (length_normalised_choice(lls, options) if all(options) else None)
    return ToolSample(file=path, where=line, task=task, doc_id=int(rec["doc_id"]), ids=ids, context=contexts[0],
                      options=options, choice=choice, probs=tuple(probs) if probs is not None else None,
                      gold=_gold(rec["target"], options, bad),
                      reported_correct=float(rec[metric]) if metric in rec else None, acc_norm_choice=norm)


def _gold(target: Any, options: tuple[str, ...], bad: Any) -> int:
    text = str(target).strip()
    if text.lstrip("-").isdigit():
        gold = int(text)
    elif text in options:
        gold = options.index(text)
    else:
        raise bad("target", f"target {target!r} is neither an option index nor an option")
    if not 0 <= gold < len(options):
        raise bad("target", f"target {gold} out of range for {len(options)} choices")
    return gold


def export_lm_eval(run_dir: str | Path, out: str | Path) -> Path:
    """Write `<out>/<model>/results_<date>.json` and one `samples_<catalog>_<date>.jsonl` per catalog.

    Everything is written in a staging folder and moved into place at the end; returns the folder.
    """
    u = _lm_utils()
    run = read_run_to_export(run_dir, as_what="lm-eval arguments")
    manifest = run_suite_manifest(run.run_dir)
    model = run.spec.engine.model or "jex-embedded-SmolLM2-135M-Instruct"
    stamp = datetime.now().isoformat().replace(":", "-")
    model_dir = u.sanitize_model_name(model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".jex-lm-eval-", dir=out))
    try:
        tasks = [_write_task_samples(run, _ExportCatalog.of(manifest, catalog),
                                     stage / f"samples_{catalog}_{stamp}.jsonl")
                 for catalog in dict.fromkeys(run.samples["catalog"].to_list())]
        _write_results(run, tasks, _RunHeader(model, model_dir, manifest.source), stage / f"results_{stamp}.json")
        target = out / model_dir
        target.mkdir(parents=True, exist_ok=True)
        for item in sorted(stage.iterdir()):
            os.replace(item, target / item.name)
        return target
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@dataclass(frozen=True)
class _ExportCatalog:
    """A catalog as an lm-eval task: how its rows were read and what lm-eval's config would say."""

    id: str
    name: str  # the imported task's name (rows' metadata.task), else the catalog's name
    loglikelihood: bool  # the continuation readout: resps are each choice's [loglikelihood, is_greedy]
    multi_gold: bool  # scored by true_mass: lm-eval's `acc` is the mass of the true options (TruthfulQA mc2)
    partial: bool  # partial evaluation (Winogrande): each option a context, the prompt the one continuation
    target_delimiter: str
    version: Any
    settings: dict[str, Any]  # the imported task's settings (`[source.tasks.<name>]`), or {}
    generative: Any = None  # a generative catalog's `jex.suite.Catalog`: a generate_until task, one line per filter

    @classmethod
    def of(cls, manifest: Any, catalog: str) -> _ExportCatalog:
        c = manifest.catalog(catalog)
        imported = manifest.source.get("importer") == "lm-eval"
        settings = ((manifest.source.get("tasks") or {}).get(c.name) or {}) if imported else {}
        return cls(catalog, c.name, c.readout in LOGLIKELIHOOD_READOUTS, c.scoring == "true_mass",
                   c.readout == "partial_loglikelihood", c.target_delimiter, settings.get("version", "jex"), settings,
                   c if c.kind == "generate" else None)

    @property
    def metrics(self) -> list[str]:
        """The metrics lm-eval reports for the task: exact_match for a generative one, the imported task's
        metric_list, else acc and acc_norm (acc alone for a label-slot, multi-gold or partial catalog)."""
        if self.generative is not None:
            return ["exact_match"]
        if self.settings.get("metrics"):
            return list(self.settings["metrics"])
        return ["acc", "acc_norm"] if self.loglikelihood and not (self.multi_gold or self.partial) else ["acc"]

    def pairs(self, prompt: str, options: list[str]) -> list[tuple[str, str]]:
        """The (context, continuation) lm-eval reads for each option (its `arguments`)."""
        if self.partial:
            return [(o, f"{self.target_delimiter}{prompt}") for o in options]
        return [(prompt, f"{self.target_delimiter}{o}") for o in options]


@dataclass(frozen=True)
class _RunHeader:
    model: str
    model_dir: str
    source: dict[str, Any]  # the suite's [source]


@dataclass(frozen=True)
class _ExportedTask:
    """One catalog written as an lm-eval task: its per-document metrics, its size before filtering, and
    lm-eval's task hash of the lines (`task_hashes`)."""

    catalog: _ExportCatalog
    values: dict[str, list[Any]]  # "metric,filter" -> its per-document item of each exported (scored) row, lm-eval's
    original: int  # rows of the catalog, scored or not
    task_hash: str

    @property
    def effective(self) -> int:
        return len(next(iter(self.values.values())))


def _write_task_samples(run: RunToExport, catalog: _ExportCatalog, path: Path) -> _ExportedTask:
    """The catalog's scored rows as one lm-eval samples file."""
    from lm_eval.utils import hash_string

    rows = run.samples.filter((pl.col("catalog") == catalog.id) & pl.col("scored"))
    lines: list[Any]
    if catalog.generative is not None:  # lm-eval's generate_until samples: one line per document and filter
        lines = [ln for i, r in enumerate(rows.iter_rows(named=True)) for ln in _generation_lines(r, i, catalog)]
        values = {f"exact_match,{f.name}": [ln["exact_match"] for ln in lines if ln["filter"] == f.name]
                  for f in catalog.generative.answer_filters()}
    else:
        lines = [_export_line(r, i, catalog) for i, r in enumerate(rows.iter_rows(named=True))]
        values = {f"{m},none": [cast(dict, ln)[m] for ln in lines] for m in catalog.metrics}
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(ln, ensure_ascii=False) + "\n" for ln in lines)
    return _ExportedTask(catalog, values,
                         run.samples.filter(pl.col("catalog") == catalog.id).height,
                         hash_string("".join(ln["doc_hash"] + ln["prompt_hash"] + ln["target_hash"] for ln in lines)))


def _write_results(run: RunToExport, tasks: list[_ExportedTask], head: _RunHeader, path: Path) -> None:
    """lm-eval's results file, field for field (`lm_eval.result_schema.EvalResults`): per task each
    metric and its stderr, configs, versions, counts, task hashes, version fields, the evaluation time;
    jex's index in a `jex` block."""
    from jex.fileio import canonical_json

    results: dict[str, dict[str, Any]] = {
        t.catalog.id: {"name": t.catalog.id, "alias": t.catalog.id, "sample_len": t.effective,
                       **_metric_values(t, run.spec.bootstrap_draws)} for t in tasks}
    declared = {name: g for name, g in (head.source.get("groups") or {}).items() if set(g["catalogs"]) <= set(results)}
    groups = {name: _group_entry(name, g, results) for name, g in declared.items()}
    configs = {t.catalog.id: _task_config(run, t.catalog) for t in tasks}
    subtasks = {**{name: list(g["catalogs"]) for name, g in declared.items()}, **{c: [] for c in results}}
    doc = {"results": {**groups, **results}, "groups": groups, "group_subtasks": subtasks, "configs": configs,
           "versions": {t.catalog.id: t.catalog.version for t in tasks},
           "n-shot": {c: configs[c]["num_fewshot"] for c in results},
           "higher_is_better": {t.catalog.id: {m: _higher_is_better(m) for m in t.catalog.metrics} for t in tasks},
           "n-samples": {t.catalog.id: {"original": t.original, "effective": t.effective} for t in tasks},
           **_run_fields(run, head), "task_hashes": {t.catalog.id: t.task_hash for t in tasks},
           "total_evaluation_time_seconds": str(_run_seconds(run)),
           "jex": {"run": run.run_dir.name, "full": run.score.full, "ci": list(run.score.ci),
                   "legs": {k: v.model_dump(mode="json") for k, v in run.score.legs.items()},
                   "catalogs": catalog_summary(run),
                   "note": "acc, f1 and mcc read jex's final choice (after fold, calibration and overlays); a "
                           "generative catalog's exact_match is per filter, as lm-eval's generate_until tasks; "
                           "for a loglikelihood catalog resps hold each choice's [loglikelihood, is_greedy], and "
                           "acc_norm, acc_bytes, exact_match and brier_score are lm-eval's, of those; else "
                           "filtered_resps hold the final log-probabilities of the label continuations",
                   "provenance": run.score.provenance}}
    path.write_text(canonical_json(doc), encoding="utf-8")


def _metric_values(t: _ExportedTask, bootstrap_iters: int) -> dict[str, float | str]:
    """`<metric>,none` and `<metric>_stderr,none`: lm-eval's own aggregation of the per-document items and
    its stderr (closed form for a mean, lm-eval's bootstrap for f1 and mcc, none for brier_score), as its
    `TaskOutput.calculate_aggregate_metric` computes them."""
    from lm_eval.api.metrics import stderr_for_metric
    from lm_eval.api.registry import get_aggregation

    from jex.lm_eval_scoring import METRIC_AGGREGATIONS

    out: dict[str, float | str] = {}
    # lm-eval's bootstrap forks a pool unless DISABLE_MULTIPROC is set (the same draws either way) and prints
    # its progress; scikit-learn warns about degenerate resamples
    with mock.patch.dict(os.environ, {"DISABLE_MULTIPROC": "1"}), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for key, items in t.values.items():
            m, filter_name = key.split(",", 1)
            aggregate = get_aggregation(METRIC_AGGREGATIONS[m])
            out[key] = float(aggregate(items))
            stderr = stderr_for_metric(aggregate, bootstrap_iters=bootstrap_iters)
            out[f"{m}_stderr,{filter_name}"] = float(stderr(items)) if stderr is not None and len(items) > 1 \
                else "N/A"
    return out


def _group_entry(name: str, group: dict[str, Any], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A group's entry as lm-eval's `Group.aggregate` (0.4.13) writes it from its leaf tasks' results: per
    aggregate metric the size-weighted (or plain) mean, the pooled (or unweighted-mean) stderr, and the
    group's sample counts."""
    from lm_eval.api.metrics import aggregate_subtask_metrics, pooled_sample_stderr, unweighted_mean_stderr

    leaves = [results[c] for c in group["catalogs"]]
    entry: dict[str, Any] = {"alias": name, "name": name, "sample_len": sum(t["sample_len"] for t in leaves)}
    counts = {}
    for aggregate in group["aggregate"]:
        key, stderr_key = f"{aggregate['metric']},none", f"{aggregate['metric']}_stderr,none"
        having = [t for t in leaves if key in t]
        if not having:
            continue
        sizes = [t["sample_len"] for t in having]
        entry[key] = aggregate_subtask_metrics([t[key] for t in having], sizes, aggregate["weight_by_size"])
        counts[key] = sum(sizes)
        stderrs = [t.get(stderr_key) for t in having]
        entry[stderr_key] = "N/A" if "N/A" in stderrs or None in stderrs else \
            pooled_sample_stderr(stderrs, sizes) if aggregate["weight_by_size"] else unweighted_mean_stderr(stderrs)
    if counts:
        entry["sample_count"] = counts
    return entry


def _higher_is_better(metric: str) -> bool:
    from lm_eval.api.registry import is_higher_better

    return bool(is_higher_better(metric))


def _task_config(run: RunToExport, c: _ExportCatalog) -> dict[str, Any]:
    """The task's config as lm-eval writes it (the imported task's settings where the suite has them)."""
    from jex.lm_eval_scoring import METRIC_AGGREGATIONS

    render = run.spec.engine.render
    s = c.settings
    if c.generative is not None:
        return _generation_config(run, c)
    return {"task": c.id, "output_type": "multiple_choice", "target_delimiter": c.target_delimiter,
            "fewshot_delimiter": s.get("fewshot_delimiter", "\n\n"), "description": s.get("description") or "",
            "num_fewshot": (s.get("num_fewshot") or 0) if s else render.num_fewshot,
            "fewshot_split": s.get("fewshot_split"),
            "metric_list": [{"metric": m, "aggregation": METRIC_AGGREGATIONS[m],
                             "higher_is_better": _higher_is_better(m)} for m in c.metrics],
            "metadata": {"version": c.version, "jex_catalog": c.id, "jex_leg": run.score.catalogs[c.id].leg,
                         "jex_readout": "loglikelihood" if c.loglikelihood else "label_slot"}}


class _GenerationKwargs(TypedDict):
    """lm-eval's generation_kwargs of a generate_until task."""

    until: list[str]
    max_gen_toks: int
    do_sample: bool
    temperature: NotRequired[float]
    top_p: NotRequired[float]
    top_k: NotRequired[int]


def _generation_kwargs(generation: GenerationSettings) -> _GenerationKwargs:
    """A generative catalog's generation settings as lm-eval's generation_kwargs: stop sequences, token
    limit, greedy (or sampled: the temperature, and top_p and top_k where they narrow it)."""
    kwargs: _GenerationKwargs = {"until": list(generation.until), "max_gen_toks": generation.max_tokens,
                                 "do_sample": generation.sampled}
    if generation.sampled:
        kwargs["temperature"] = generation.temperature
        if generation.top_p != 1:
            kwargs["top_p"] = generation.top_p
        if generation.top_k:
            kwargs["top_k"] = generation.top_k
    return kwargs


def _generation_config(run: RunToExport, c: _ExportCatalog) -> dict[str, Any]:
    """A generative catalog's config as lm-eval writes a generate_until task's: generation_kwargs, filter_list
    (each filter's steps as lm-eval's `function` entries) and exact_match with its settings."""
    catalog, s = c.generative, c.settings
    return {"task": c.id, "output_type": "generate_until", "target_delimiter": c.target_delimiter,
            "fewshot_delimiter": s.get("fewshot_delimiter", "\n\n"), "description": s.get("description") or "",
            "num_fewshot": s.get("num_fewshot") or 0, "fewshot_split": s.get("fewshot_split"),
            "generation_kwargs": _generation_kwargs(catalog.generation),
            **({"repeats": catalog.generation.samples} if catalog.generation.samples > 1 else {}),
            "filter_list": [{"name": f.name, "filter": [step.model_dump(mode="json") for step in f.steps]}
                            for f in catalog.answer_filters()],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             **catalog.match.model_dump(mode="json")}],
            "metadata": {"version": c.version, "jex_catalog": c.id, "jex_leg": run.score.catalogs[c.id].leg,
                         "jex_readout": "generate"}}


def _generation_lines(r: dict[str, Any], index: int, catalog: _ExportCatalog) -> list[dict[str, Any]]:
    """One scored generative row as lm-eval's samples lines, one per filter: the context and generation
    kwargs (`arguments`), the responses (`resps`: every sample, after its thought, as lm-eval's `repeats`), the
    filter's answer (`filtered_resps`) and its `exact_match`. A row that was not generated has an empty response
    and no answer (scored 0, as by jex)."""
    from lm_eval.utils import hash_string

    from jex.tasks.outputs.samples import resolve_prompt_ref

    meta = json.loads(r["metadata"]) if r["metadata"] else {}
    doc_id = _doc_id(meta, index, catalog)
    prompt = r["prompt"] if r["prompt"] is not None else resolve_prompt_ref(r["prompt_ref"])[0] \
        if r["prompt_ref"] else None
    doc = {"run_id": r["run_id"], "question_id": r["question_id"], "answer": r["reference"],
           **({"metadata": meta} if meta else {})}
    names = r["filters"] or [f.name for f in catalog.generative.answer_filters()]
    answers, verdicts = r["answers"] or [None] * len(names), r["verdicts"] or [False] * len(names)
    kwargs = _generation_kwargs(catalog.generative.generation)
    common = {"doc_id": doc_id, "doc": doc, "target": r["reference"],
              "arguments": {"gen_args_0": {"arg_0": prompt, "arg_1": kwargs}},
              "resps": [r.get("sample_responses") or [r["generation"] or ""]], "metrics": ["exact_match"],
              "doc_hash": hash_string(json.dumps(doc, indent=2, ensure_ascii=False)),
              "prompt_hash": hash_string(prompt or ""), "target_hash": hash_string(r["reference"])}
    return [{**common, "filtered_resps": [answer], "filter": name, "exact_match": 1.0 if ok else 0.0,
             "jex": {"task": catalog.id, "run_id": r["run_id"], "finish_reason": r["finish_reason"],
                     "generation_tokens": r["generation_tokens"], "primary": k == 0}}
            for k, (name, answer, ok) in enumerate(zip(names, answers, verdicts, strict=True))]


def _run_fields(run: RunToExport, head: _RunHeader) -> dict[str, Any]:
    """The run-level fields lm-eval's `simple_evaluate` and `EvaluationTracker` add."""
    from importlib import metadata

    from lm_eval.utils import hash_string

    engine = run.spec.engine
    system, chosen = engine.render.system_prompt, engine.render.chat_template
    template = None if chosen == "none" or (chosen == "auto" and head.source.get("importer") == "lm-eval") else chosen
    provenance = run.score.provenance or {}
    return {"config": {"model": f"jex-{engine.kind}", "model_args": {"pretrained": head.model},
                       "batch_size": engine.requests_per_call(), "batch_sizes": [], "device": engine.device,
                       "use_cache": None, "limit": None, "bootstrap_iters": run.spec.bootstrap_draws,
                       "gen_kwargs": {}, "fewshot_seed": head.source.get("fewshot_seed")},
            "git_hash": (provenance.get("jex") or {}).get("commit"), "date": datetime.now().timestamp(),
            "transformers_version": _version(metadata, "transformers"),
            "lm_eval_version": _version(metadata, "lm_eval"),
            "jex_version": (provenance.get("jex") or {}).get("version"), "upper_git_hash": None,
            "model_source": f"jex-{engine.kind}", "model_name": head.model, "model_name_sanitized": head.model_dir,
            "system_instruction": system, "system_instruction_sha": hash_string(system) if system else None,
            "fewshot_as_multiturn": None, "chat_template": template,
            "chat_template_sha": hash_string(template) if template else None}


def _version(metadata: Any, package: str) -> str:
    try:
        return str(metadata.version(package))
    except metadata.PackageNotFoundError:
        return "N/A"


def _run_seconds(run: RunToExport) -> float:
    """The campaign's stage time (stages.json's `seconds`, summed), lm-eval's evaluation time."""
    return RunStages.read(run.run_dir).seconds()


class LmEvalSampleLine(TypedDict):
    """One line of an lm-eval `--log_samples` file, as lm-eval writes it, plus jex's own block."""

    doc_id: int
    doc: dict[str, Any]
    target: str
    arguments: dict[str, dict[str, str]]
    resps: list[list[list[str]]]
    filtered_resps: list[list[str]]
    filter: str
    metrics: list[str]
    doc_hash: str
    prompt_hash: str
    target_hash: str
    acc: float
    acc_norm: NotRequired[float]
    acc_bytes: NotRequired[float]
    exact_match: NotRequired[int]
    f1: NotRequired[tuple[int, int]]  # (gold, choice)
    mcc: NotRequired[tuple[int, int]]
    brier_score: NotRequired[tuple[int, list[float]]]  # (gold, lm-eval's softmax of the log-likelihoods)
    jex: dict[str, Any]  # task, run_id, choice, probs, decided_by, gated, rationale


def _doc_id(meta: Mapping[str, Any], index: int, catalog: _ExportCatalog) -> int:
    """lm-eval's doc_id of a row imported from the catalog's lm-eval task (kept in its metadata); else the
    row's index in its catalog."""
    return int(meta["doc_id"]) if meta.get("task") in (catalog.id, catalog.name) and "doc_id" in meta else index


def _export_line(r: dict[str, Any], index: int, catalog: _ExportCatalog) -> LmEvalSampleLine:
    """One scored `samples.parquet` row (`index`-th of its catalog) as an lm-eval samples line."""
    from lm_eval.utils import hash_string

    from jex.tasks.outputs.samples import resolve_prompt_ref

    meta = json.loads(r["metadata"]) if r["metadata"] else {}
    doc_id = _doc_id(meta, index, catalog)
    # every row of a prompts file has its prompt (only `reason_prompt` may be null)
    prompt: str = r["prompt"] if r["prompt"] is not None else cast(str, resolve_prompt_ref(r["prompt_ref"])[0])
    doc = {"run_id": r["run_id"], "question_id": r["question_id"], "options": r["options"], "labels": r["labels"],
           "gold": r["gold"], **({"metadata": meta} if meta else {})}
    resps, pairs, extra = _readout_of(r, catalog, prompt)
    line: LmEvalSampleLine = {
        "doc_id": doc_id, "doc": doc, "target": str(r["gold"]),
        "arguments": {f"gen_args_{i}": {"arg_0": ctx, "arg_1": c} for i, (ctx, c) in enumerate(pairs)},
        "resps": [[x] for x in resps], "filtered_resps": resps, "filter": "none", "metrics": catalog.metrics,
        "doc_hash": hash_string(json.dumps(doc, indent=2, ensure_ascii=False)),
        "prompt_hash": hash_string(prompt), "target_hash": hash_string(str(r["gold"])),
        "acc": _mass(r) if catalog.multi_gold else 1.0 if r["correct"] else 0.0,
        "jex": {"task": catalog.id, "run_id": r["run_id"], "choice": r["choice"], "probs": r["final_probs"],
                "decided_by": r["decided_by"], "gated": r["gated"], "rationale": r["rationale"], **extra}}
    if "acc_norm" in catalog.metrics:
        line["acc_norm"] = 1.0 if extra.get("acc_norm_choice") == r["gold"] else 0.0
    _add_choice_metrics(line, r, catalog.metrics)
    return line


def _add_choice_metrics(line: LmEvalSampleLine, r: dict[str, Any], metrics: list[str]) -> None:
    """The per-document items of lm-eval's other multiple-choice metrics (0.4.13
    `ConfigurableTask.process_results`): acc_bytes and brier_score from each choice's log-likelihood,
    exact_match from whether the gold's continuation is the greedy one, f1 and mcc the (gold, choice) pair
    of `acc`. A row never read (no log-likelihoods) scores 0 and forecasts uniformly."""
    lls, gold, options = r.get(LL_COLUMN), int(r["gold"]), r["options"]
    if "acc_bytes" in metrics:
        line["acc_bytes"] = 1.0 if lls is not None and byte_normalised_choice(lls, options) == gold else 0.0
    if "exact_match" in metrics:
        line["exact_match"] = int(bool((r.get(GREEDY_COLUMN) or [False] * len(options))[gold]))
    pair = (gold, -1 if r["choice"] is None else int(r["choice"]))
    if "f1" in metrics:
        line["f1"] = pair
    if "mcc" in metrics:
        line["mcc"] = pair
    if "brier_score" in metrics:
        line["brier_score"] = (gold, choice_softmax(lls) if lls is not None else [1 / len(options)] * len(options))


def _mass(r: dict[str, Any]) -> float:
    """A true_mass row's `acc`: its mass, or the uniform forecast's (t/k) where it was never read, as the
    scorer counts it."""
    return float(r["true_mass"]) if r["true_mass"] is not None else len(r["true_options"]) / len(r["options"])


def _readout_of(r: dict[str, Any], catalog: _ExportCatalog, prompt: str
                ) -> tuple[list[list[str]], list[tuple[str, str]], dict[str, Any]]:
    """(resps, (context, continuation) pairs, extra jex fields) of a row. A loglikelihood catalog: each
    choice's [loglikelihood, is_greedy] of its pair (`_ExportCatalog.pairs`), as lm-eval logs them, and
    the length-normalised choice; else the final log-probabilities of the label continuations jex read."""
    if catalog.loglikelihood:
        pairs = catalog.pairs(prompt, r["options"])
        lls = r.get(LL_COLUMN)
        greedy = r.get(GREEDY_COLUMN) or [False] * len(r["options"])
        if lls is None:  # never read (a counted refusal): NaN, and the jex block says so
            return [[str(math.nan), "False"] for _ in r["options"]], pairs, {"acc_norm_choice": None}
        norm = r.get("acc_norm_choice")
        if norm is None:
            norm = length_normalised_choice(lls, r["options"])
        return [[str(float(x)), str(bool(g))] for x, g in zip(lls, greedy, strict=True)], pairs, \
            {"acc_norm_choice": norm}
    final = r["final_probs"]
    lls = [math.log(p) if p > 0 else -math.inf for p in final] if final is not None else [math.nan] * len(r["labels"])
    return [[str(x), "False"] for x in lls], [(prompt, f" {lab}") for lab in r["labels"]], {}


LL_COLUMN = "choice_loglikelihoods"
"""samples.parquet: each option's summed continuation log-likelihood (loglikelihood catalogs)."""
GREEDY_COLUMN = "choice_is_greedy"
"""samples.parquet: whether each option's continuation is the greedy one (lm-eval's is_greedy)."""


def score_lm_eval(source: str | Path, out: str | Path, *, suite: str | Path | None = None, draws: int, seed: int,
                  mode: MapMode = "auto", id_field: str | None = None) -> ScoreDoc:
    """`jex score --from lm-eval`: map the documents to run_ids, score them with jex's scorers and the
    clustered bootstrap; without a suite, against a suite made of the documents themselves."""
    from jex.fileio import sha256_file

    run = read_lm_eval(source)
    with tempfile.TemporaryDirectory(prefix="jex-lm-eval-") as tmp:
        suite_path = Path(suite) if suite else synthesized_suite(run.samples, Path(tmp) / "suite",
                                                                 name="lm-eval documents")
        mapped = map_samples(run.samples, load_suite_rows(suite_path), mode=mode, id_field=id_field)
        record = ImportRecord(tool="lm-eval", source=str(source),
                              suite=str(suite) if suite else "made from the documents",
                              files={f: sha256_file(f) for f in run.files})
        return score_mapped(replace(mapped, tasks=_agreement(run)), suite_path, out, draws=draws, seed=seed,
                            record=record, extra=[] if suite else [("suite", suite_path)])


def _agreement(run: LmEvalRun) -> dict[str, TaskAgreement]:
    """Per task: its documents, and the accuracy lm-eval reported (results file, samples' own `acc`)."""
    out = {}
    for task in sorted({s.task for s in run.samples}):
        docs = [s for s in run.samples if s.task == task]
        verdicts = [s.reported_correct for s in docs if s.reported_correct is not None]
        out[task] = TaskAgreement(documents=len(docs), lm_eval_results_acc=run.reported.get(task),
                                  lm_eval_results_acc_norm=run.reported_norm.get(task),
                                  lm_eval_samples_acc=sum(verdicts) / len(verdicts) if verdicts else None)
    return out
