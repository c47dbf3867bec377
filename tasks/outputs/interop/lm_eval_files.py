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
choice, decided_by, gated, rationale). Rows the suite excludes from scoring are left out, as lm-eval
has no such notion.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, TypedDict, cast

import polars as pl

from jex.errors import InputError
from jex.fileio import read_json
from jex.numerics import argmax  # ties to the first, as numpy (and so lm-eval) does
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


def _lm_utils() -> Any:
    try:
        from lm_eval import utils
    except ImportError as e:
        raise InputError("lm-eval is not installed: pip install 'jex[interop]'") from e
    return utils


def find_files(source: Path) -> tuple[list[str], str | None]:
    """(samples files, results file) of an lm-eval output folder (latest run) or of one samples file."""
    u = _lm_utils()
    if not source.exists():
        raise InputError("no lm-eval samples file or output folder here", file=str(source))
    if source.is_file():
        folder, samples = source.parent, [str(source.resolve())]
    else:
        folder, samples = source, []
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(folder.resolve()) for f in fs]
    results = u.get_results_filenames(files)
    if not samples:
        found = u.get_sample_results_filenames(files)
        if not found:
            raise InputError("no samples_<task>_<date>.jsonl here: run lm_eval with --log_samples --output_path",
                             file=str(source))
        latest = u.get_file_datetime(os.path.basename(u.get_latest_filename(found)))
        samples = sorted(f for f in found if u.get_file_datetime(os.path.basename(f)) == latest)
    stamp = u.get_file_datetime(os.path.basename(samples[0]))
    match = [r for r in results if u.get_file_datetime(os.path.basename(r)).removesuffix(".json") == stamp]
    return samples, (match[0] if match else None)


def read_lm_eval(source: str | Path, *, metric: str = "acc") -> LmEvalRun:
    """Every document of the samples files (filter `none`), validated line by line."""
    u = _lm_utils()
    samples_files, results_file = find_files(Path(source))
    results = read_json(results_file) if results_file else {}
    out: list[ToolSample] = []
    for path in samples_files:
        task = u.get_file_task_name(os.path.basename(path))
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
        raise InputError("no documents in the samples file(s)", file=samples_files[0])
    reported = {t: float(v[f"{metric},none"]) for t, v in (results.get("results") or {}).items()
                if f"{metric},none" in v}
    return LmEvalRun(out, reported, samples_files + ([results_file] if results_file else []))


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
    return ToolSample(file=path, where=line, task=task, doc_id=int(rec["doc_id"]), ids=ids, context=contexts[0],
                      options=options, choice=choice, probs=tuple(probs) if probs is not None else None,
                      gold=_gold(rec["target"], options, bad),
                      reported_correct=float(rec[metric]) if metric in rec else None)


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
    model = run.spec["engine"].get("model") or "jex-embedded-SmolLM2-135M-Instruct"
    stamp = datetime.now().isoformat().replace(":", "-")
    model_dir = u.sanitize_model_name(model)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".jex-lm-eval-", dir=out))
    try:
        tasks = [_write_task_samples(run, catalog, stage / f"samples_{catalog}_{stamp}.jsonl")
                 for catalog in dict.fromkeys(run.samples["catalog"].to_list())]
        _write_results(run, tasks, model, model_dir, stage / f"results_{stamp}.json")
        target = out / model_dir
        target.mkdir(parents=True, exist_ok=True)
        for item in sorted(stage.iterdir()):
            os.replace(item, target / item.name)
        return target
    finally:
        shutil.rmtree(stage, ignore_errors=True)


@dataclass(frozen=True)
class _ExportedTask:
    """One catalog written as an lm-eval task: its per-document `acc` and its size before filtering."""

    catalog: str
    accs: list[float]  # one per exported (scored) row
    original: int  # rows of the catalog, scored or not


def _write_task_samples(run: RunToExport, catalog: str, path: Path) -> _ExportedTask:
    """The catalog's scored rows as one lm-eval samples file."""
    rows = run.samples.filter((pl.col("catalog") == catalog) & pl.col("scored"))
    lines = [_export_line(r, i, catalog) for i, r in enumerate(rows.iter_rows(named=True))]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(ln, ensure_ascii=False) + "\n" for ln in lines)
    return _ExportedTask(catalog, [ln["acc"] for ln in lines],
                         run.samples.filter(pl.col("catalog") == catalog).height)


def _write_results(run: RunToExport, tasks: list[_ExportedTask], model: str, model_dir: str, path: Path) -> None:
    """lm-eval's results file: per task acc and its stderr, configs, counts; jex's index in a `jex` block."""
    from lm_eval.api.metrics import mean, mean_stderr

    from jex.fileio import canonical_json

    spec, score = run.spec, run.score
    results = {t.catalog: {"name": t.catalog, "alias": t.catalog, "sample_len": len(t.accs), "acc,none": mean(t.accs),
                           "acc_stderr,none": mean_stderr(t.accs) if len(t.accs) > 1 else "N/A"} for t in tasks}
    configs = {t.catalog: {"task": t.catalog, "output_type": "multiple_choice", "target_delimiter": " ",
                           "num_fewshot": spec["engine"]["render"]["num_fewshot"],
                           "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
                           "metadata": {"jex_catalog": t.catalog, "jex_leg": score.catalogs[t.catalog].leg}}
               for t in tasks}
    doc = {"results": results, "group_subtasks": {c: [] for c in results}, "configs": configs,
           "versions": {c: "jex" for c in results}, "n-shot": {c: configs[c]["num_fewshot"] for c in results},
           "higher_is_better": {c: {"acc": True} for c in results},
           "n-samples": {t.catalog: {"original": t.original, "effective": len(t.accs)} for t in tasks},
           "config": {"model": f"jex-{spec['engine']['kind']}", "model_args": {"pretrained": model},
                      "batch_size": spec["engine"]["batch_size"], "device": spec["engine"]["device"]},
           "model_name": model, "model_name_sanitized": model_dir,
           "date": datetime.now().timestamp(),
           "jex": {"run": run.run_dir.name, "full": score.full, "ci": list(score.ci),
                   "legs": {k: v.model_dump(mode="json") for k, v in score.legs.items()},
                   "catalogs": catalog_summary(run),
                   "note": "acc is jex's final choice (after fold, calibration and overlays); filtered_resps "
                           "hold the final log-probabilities of the label continuations",
                   "provenance": score.provenance}}
    path.write_text(canonical_json(doc), encoding="utf-8")


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
    jex: dict[str, Any]  # run_id, choice, probs, decided_by, gated, rationale


def _export_line(r: dict[str, Any], index: int, catalog: str) -> LmEvalSampleLine:
    """One scored `samples.parquet` row (`index`-th of its catalog) as an lm-eval samples line."""
    from lm_eval.utils import hash_string

    from jex.tasks.outputs.samples import resolve_prompt_ref

    meta = json.loads(r["metadata"]) if r["metadata"] else {}
    doc_id = int(meta["doc_id"]) if meta.get("task") == catalog and "doc_id" in meta else index
    # every row of a prompts file has its prompt (only `reason_prompt` may be null)
    prompt: str = r["prompt"] if r["prompt"] is not None else cast(str, resolve_prompt_ref(r["prompt_ref"])[0])
    final = r["final_probs"]  # None: the row was never read (a counted refusal): NaN, and the jex block says so
    lls = [math.log(p) if p > 0 else -math.inf for p in final] if final is not None else [math.nan] * len(r["labels"])
    doc = {"run_id": r["run_id"], "question_id": r["question_id"], "options": r["options"], "labels": r["labels"],
           "gold": r["gold"], **({"metadata": meta} if meta else {})}
    arguments = {f"gen_args_{i}": {"arg_0": prompt, "arg_1": f" {lab}"} for i, lab in enumerate(r["labels"])}
    resps = [[str(x), "False"] for x in lls]
    return {"doc_id": doc_id, "doc": doc, "target": str(r["gold"]), "arguments": arguments,
            "resps": [[x] for x in resps], "filtered_resps": resps, "filter": "none", "metrics": ["acc"],
            "doc_hash": hash_string(json.dumps(doc, indent=2, ensure_ascii=False)),
            "prompt_hash": hash_string(prompt), "target_hash": hash_string(str(r["gold"])),
            "acc": 1.0 if r["correct"] else 0.0,
            "jex": {"run_id": r["run_id"], "choice": r["choice"], "probs": r["final_probs"],
                    "decided_by": r["decided_by"], "gated": r["gated"], "rationale": r["rationale"]}}


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
                                  lm_eval_samples_acc=sum(verdicts) / len(verdicts) if verdicts else None)
    return out
