"""Inspect AI eval logs in and out, through `inspect_ai.log` itself (optional extra `interop`).

Out (`export_inspect`): one `EvalSample` per row of `samples.parquet`: id = run_id, input = the rendered
fast-pass prompt, choices = the options, target = the gold label; the messages are the prompt the model
reasoned from and its rationale (or, for rows that were not gated, its one-label answer); the `jex`
score is C/I with the chosen label as answer and the final probabilities, the fast-pass and
post-thought readouts and the deciding stage in its metadata. Rows the suite excludes from scoring
carry no score (Inspect's explicit "unscored"). The log's task is `jex/<suite name>`; its results hold
accuracy, its stderr and the jex index with its clustered-bootstrap interval.

In (`read_inspect` / `score_inspect`): any multiple-choice log: choices, target (a label), and per
sample the score whose answer is a label (the `jex` score when present; its metadata's probabilities
are kept).
"""

from __future__ import annotations

import json
import math
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import polars as pl

from jex.errors import InputError
from jex.fileio import atomic_path, read_json
from jex.run_records import CAMPAIGN_FILE
from jex.tasks.documents import ScoreDoc
from jex.tasks.outputs.interop.common import (
    LABELS,
    ImportRecord,
    MapMode,
    RunToExport,
    ToolSample,
    catalog_summary,
    load_suite_rows,
    map_samples,
    read_run_to_export,
    run_suite_manifest,
    score_mapped,
    synthesized_suite,
)

SCORER = "jex"


def _inspect() -> Any:
    try:
        import inspect_ai.log as log
    except ImportError as e:
        raise InputError("inspect-ai is not installed: pip install 'jex[interop]'") from e
    return log


def run_suite_name(run_dir: Path) -> str:
    """The suite name of a run, from its bundle's manifest (the bundle named in stages.json)."""
    return str(run_suite_manifest(run_dir).name)


def export_inspect(run_dir: str | Path, out: str | Path) -> Path:
    """Write `<out>/<created>_jex-<suite>_<run>.eval`; returns its path (written to a temp name first)."""
    ilog = _inspect()
    run = read_run_to_export(run_dir, as_what="Inspect inputs")
    model = f"jex/{run.spec.engine.model or 'SmolLM2-135M-Instruct'}"
    suite = run_suite_name(run.run_dir)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    task_id = run.run_dir.name.rsplit("-", 1)[-1]  # the run's identity hash
    samples = [_eval_sample(r, model) for r in run.samples.iter_rows(named=True)]
    log = ilog.EvalLog(version=2, status="success", eval=_eval_spec(run, suite, model, now, task_id),
                       plan=ilog.EvalPlan(name="jex", steps=[ilog.EvalPlanStep(solver=s) for s in STAGES]),
                       results=_eval_results(run), stats=ilog.EvalStats(started_at=now, completed_at=now),
                       samples=samples)
    path = Path(out) / f"{now.replace(':', '-')}_jex-{_slug(suite)}_{task_id}.eval"  # Inspect's {created}_{task}_{id}
    with atomic_path(path) as tmp:
        ilog.write_eval_log(log, str(tmp), format="eval")
    return path


STAGES = ("fast_pass", "gate", "reason", "generate", "fold", "calibrate", "overlay")
"""The campaign's stages, as the log's plan steps."""


def _generated_sample(r: dict[str, Any], model: str, prompt: str | None) -> Any:
    """A generative row as an `EvalSample`: the prompt in, the generation out (every sample of a sampled row, one
    output choice each), target the reference; the `jex` score is C/I with the row's verdict, every filter's
    answer and verdict in its metadata (and each sample's answer and verdict, pass@k, the thoughts' tokens)."""
    from inspect_ai.model import ChatCompletionChoice, ChatMessageAssistant, ChatMessageUser, ModelOutput
    from inspect_ai.scorer import Score

    text = r["generation"] or ""
    sampled = {k: r[k] for k in ("sample_answers", "sample_verdicts", "thought_tokens", "thought_closed",
                                 "pass_at_k") if r.get("samples") is not None}
    scores = {}
    if r["scored"]:
        scores[SCORER] = Score(value="C" if r["correct"] else "I", answer=(r["answers"] or [None])[0],
                               explanation="exact_match of the primary filter's answer",
                               metadata={"filters": r["filters"], "answers": r["answers"], "verdicts": r["verdicts"],
                                         "decided_by": r["decided_by"], **sampled})
    output = ModelOutput.from_content(model=model, content=text)
    if r.get("samples") is not None:
        output = ModelOutput(model=model, choices=[
            ChatCompletionChoice(message=ChatMessageAssistant(content=t, model=model),
                                 stop_reason="max_tokens" if why == "length" else "stop")
            for t, why in zip(r["sample_generations"], r["sample_finish_reasons"], strict=True)] or output.choices)
    return _inspect().EvalSample(
        id=r["run_id"], epoch=1, input=prompt or "", target=r["reference"],
        messages=[ChatMessageUser(content=prompt or ""), ChatMessageAssistant(content=text, model=model)],
        output=output, scores=scores,
        metadata={"run_id": r["run_id"], "catalog": r["catalog"], "question_id": r["question_id"],
                  "generation_tokens": r["generation_tokens"], "finish_reason": r["finish_reason"],
                  "scored": r["scored"], "row_metadata": json.loads(r["metadata"]) if r["metadata"] else None})


def _eval_sample(r: dict[str, Any], model: str) -> Any:
    """One `samples.parquet` row as an `EvalSample`: the prompt in, the rationale and answer out, and
    the `jex` score (none on a row the suite does not score); a generative row by `_generated_sample`."""
    from inspect_ai.model import ChatMessageAssistant, ChatMessageUser, ModelOutput
    from inspect_ai.scorer import Score

    from jex.tasks.outputs.samples import resolve_prompt_ref

    if r.get("decided_by") == "generate":
        return _generated_sample(r, model, r["prompt"] if r["prompt"] is not None or not r["prompt_ref"]
                                 else resolve_prompt_ref(r["prompt_ref"])[0])
    prompt, reason_prompt = (r["prompt"], r["reason_prompt"]) if r["prompt"] is not None else \
        resolve_prompt_ref(r["prompt_ref"])
    labels = r["labels"]
    answer = labels[r["choice"]] if r["choice"] is not None else None
    reply = (f"{(r['rationale'] or '').strip()}\n\nANSWER: {answer}" if r["gated"] else f"ANSWER: {answer}")
    scores = {}
    if r["scored"]:
        scores[SCORER] = Score(
            value="C" if r["correct"] else "I", answer=answer,
            explanation=f"decided by {r['decided_by']}" + (" after a rationale" if r["gated"] else ""),
            metadata={"choice": r["choice"], "probs": r["final_probs"], "fast_logprobs": r["label_logprobs"],
                      "post_logprobs": r["post_logprobs"], "decided_by": r["decided_by"]})
    return _inspect().EvalSample(
        id=r["run_id"], epoch=1, input=prompt, target=labels[r["gold"]], choices=list(r["options"]),
        messages=[ChatMessageUser(content=reason_prompt if r["gated"] else prompt),
                  ChatMessageAssistant(content=reply, model=model)],
        output=ModelOutput.from_content(model=model, content=reply), scores=scores,
        metadata={"run_id": r["run_id"], "catalog": r["catalog"], "question_id": r["question_id"],
                  "labels": list(labels), "gated": r["gated"], "rationale_tokens": r["rationale_tokens"],
                  "finish_reason": r["finish_reason"], "scored": r["scored"],
                  "row_metadata": json.loads(r["metadata"]) if r["metadata"] else None})


def _eval_spec(run: RunToExport, suite: str, model: str, created: str, task_id: str) -> Any:
    """The log's header: task `jex/<suite>`, the dataset's sample ids, the campaign and provenance."""
    import inspect_ai

    ilog = _inspect()
    return ilog.EvalSpec(created=created, task=f"jex/{suite}", task_id=task_id, run_id=run.run_dir.name,
                         dataset=ilog.EvalDataset(name=suite, samples=run.samples.height,
                                                  sample_ids=run.samples["run_id"].to_list()),
                         model=model, config=ilog.EvalConfig(),
                         packages={"inspect_ai": inspect_ai.__version__, "jex": _jex_version()},
                         metadata={"jex": {"run": run.run_dir.name, "suite": suite,
                                           "campaign": read_json(run.run_dir / CAMPAIGN_FILE),  # as it is
                                           "provenance": run.score.provenance}})


def _eval_results(run: RunToExport) -> Any:
    """Accuracy and its standard error over the scored rows, and the jex index with its interval."""
    ilog = _inspect()
    total = run.samples.height
    scored = run.samples.filter(pl.col("scored"))
    acc = [1.0 if c else 0.0 for c in scored["correct"].to_list()]
    mean = sum(acc) / len(acc)
    stderr = math.sqrt(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1) / len(acc)) if len(acc) > 1 else 0.0
    score = run.score
    metrics = {"accuracy": mean, "stderr": stderr, "jex_index": score.full, "jex_index_ci_low": score.ci[0],
               "jex_index_ci_high": score.ci[1]}
    return ilog.EvalResults(
        total_samples=total, completed_samples=total,
        scores=[ilog.EvalScore(name=SCORER, scorer=SCORER, scored_samples=scored.height,
                               unscored_samples=total - scored.height,
                               metrics={k: ilog.EvalMetric(name=k, value=v) for k, v in metrics.items()})],
        metadata={"jex_legs": {k: v.model_dump(mode="json") for k, v in score.legs.items()},
                  "jex_catalogs": catalog_summary(run)})


def _jex_version() -> str:
    import jex

    return jex.__version__


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "-" for c in name)


def read_inspect(source: str | Path) -> tuple[Any, list[ToolSample]]:
    """The log's header and one `ToolSample` per sample (epoch 1); InputErrors name the file and sample."""
    ilog = _inspect()
    source = Path(source)
    if not source.is_file():
        raise InputError("no Inspect log here", file=str(source))
    try:
        log = ilog.read_eval_log(str(source))
    except Exception as e:  # noqa: BLE001 - any failure to parse means: not a readable Inspect log
        raise InputError(f"not a readable Inspect log: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                         file=str(source)) from None
    out = []
    for s in log.samples or []:
        if s.epoch != 1:
            continue

        def bad(field: str, msg: str, sid: Any = s.id) -> InputError:
            return InputError(msg, file=str(source), row=f"sample {sid!r}", field=field)

        if not s.choices or len(s.choices) < 2:
            raise bad("choices", "not a multiple-choice sample (no choices)")
        labels = list((s.metadata or {}).get("labels") or LABELS[:len(s.choices)])
        target = s.target if isinstance(s.target, str) else (s.target[0] if len(s.target) == 1 else None)
        if target not in labels:
            raise bad("target", f"target {s.target!r} is not one of the labels {labels}")
        choice, probs = _decision(s, labels, bad)
        meta = s.metadata or {}
        row_meta = meta.get("row_metadata") or {}
        text = s.input if isinstance(s.input, str) else "\n".join(m.text for m in s.input)
        out.append(ToolSample(file=str(source), where=f"sample {s.id!r}", task=meta.get("catalog") or log.eval.task,
                              doc_id=row_meta.get("doc_id"), ids={"id": s.id, **meta}, context=text,
                              options=tuple(s.choices), choice=choice, probs=probs, gold=labels.index(target)))
    if not out:
        raise InputError("the log has no samples (written with --no-log-samples?)", file=str(source))
    return log, out


def _decision(s: Any, labels: list[str], bad: Any) -> tuple[int | None, tuple[float, ...] | None]:
    """The chosen option: the `jex` score, else the first score whose answer is a label; None if unscored."""
    scores = s.scores or {}
    ordered = ([scores[SCORER]] if SCORER in scores else []) + [v for k, v in scores.items() if k != SCORER]
    for sc in ordered:
        meta = sc.metadata or {}
        if isinstance(meta.get("choice"), int):
            probs = meta.get("probs")
            return meta["choice"], tuple(probs) if probs else None
        if sc.answer is not None and sc.answer.strip() in labels:
            return labels.index(sc.answer.strip()), None
    if scores:
        raise bad("scores", f"no score names a chosen label (answers: {[v.answer for v in scores.values()]})")
    return None, None


def score_inspect(source: str | Path, out: str | Path, *, suite: str | Path | None = None, draws: int, seed: int,
                  mode: MapMode = "auto", id_field: str | None = None) -> ScoreDoc:
    """`jex score --from inspect LOG.eval [--suite DIR]`: the log's decisions through jex's index."""
    from jex.fileio import sha256_file

    log, samples = read_inspect(source)
    with tempfile.TemporaryDirectory(prefix="jex-inspect-") as tmp:
        suite_path = Path(suite) if suite else synthesized_suite(samples, Path(tmp) / "suite",
                                                                 name=f"inspect {log.eval.task}")
        rows = load_suite_rows(suite_path)
        task = log.eval.task
        if suite and task.startswith("jex/") and task != f"jex/{rows.name}":
            raise InputError(f"the log is of task '{task}', the suite is '{rows.name}' ({suite}): a log of another "
                             "task", file=str(source), field="eval.task")
        mapped = map_samples(samples, rows, mode=mode, id_field=id_field)
        record = ImportRecord(tool="inspect", source=str(source), task=task, model=log.eval.model,
                              suite=str(suite) if suite else "made from the samples",
                              files={str(source): sha256_file(source)})
        return score_mapped(mapped, suite_path, out, draws=draws, seed=seed, record=record,
                            extra=[] if suite else [("suite", suite_path)])
