"""The campaign report: Markdown and PNG plots in the run folder (the flow also publishes them to Prefect)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import Field, JsonValue

from jex.engine_identity import EngineFingerprint
from jex.tasks.bundle.suite_table import ScoreSpec
from jex.tasks.documents import CalibrationDoc, FoldDoc, ScoreDoc
from jex.tasks.records import FastPassSummary, FinishedCampaign, GateSummary, GenerateSummary, ReasonSummary, Record
from jex.tasks.scoring.reference_audit import audit_markdown
from jex.tasks.scoring.score import area_table, catalog_table


class MachinesSection(Record):
    """What the report shows of a run's machines; the flows room renders it from its `machines.json`
    (`flows/machines/machines_doc.py`), which this room may not read."""

    markdown: list[str] = Field(description="The report's machines section, as Markdown lines")
    shards: dict[str, int] = Field(description="Shard artifacts the machines' jobs handed over, by job (stage)")
    audit: dict[str, JsonValue] | None = Field(None, description="The settings audit that covers the engine: its "
                                                                 "status (proven, unproven), power, size and what "
                                                                 "it covers, for provenance.json")


def skill_plot(baseline: ScoreDoc, policy: ScoreDoc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cats = list(policy.catalogs)
    x = np.arange(len(cats))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cats)), 4))
    for off, (name, doc) in zip((-0.18, 0.18), (("baseline (fast pass)", baseline), ("policy", policy)), strict=True):
        s = [doc.catalogs[c].skill for c in cats]
        lo = [s[i] - doc.catalogs[c].ci[0] for i, c in enumerate(cats)]
        hi = [doc.catalogs[c].ci[1] - s[i] for i, c in enumerate(cats)]
        ax.errorbar(x + off, s, yerr=[lo, hi], fmt="o", capsize=3, label=name)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, cats, rotation=45, ha="right")
    ax.set(ylabel="skill (chance-normalised)", title="Per-catalog skill with 95% clustered CIs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def reliability_plot(calibration: CalibrationDoc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for rel, name in ((calibration.reliability_before, "before"), (calibration.reliability_after, "after")):
        if rel is None:  # nothing calibrated (no multiple-choice row): the diagonal alone
            continue
        ax.plot([b.confidence for b in rel.bins], [b.accuracy for b in rel.bins], marker="o",
                label=f"{name} (ECE {rel.ece:.3f})")
    ax.set(xlabel="confidence (top-1 probability)", ylabel="accuracy", title="Reliability", xlim=(0, 1), ylim=(0, 1))
    if calibration.reliability_before is not None:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _f(x: Any, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


class RunDocs(Record):
    """A finished run's documents, as the stages wrote them."""

    policy: ScoreDoc = Field(description="score.json")
    baseline: ScoreDoc = Field(description="baseline_score.json: the fast pass alone")
    fold: FoldDoc = Field(description="fold.json: dry-run counters and every error counter")
    calibration: CalibrationDoc = Field(description="calibration.json")


def render_report(name: str, docs: RunDocs, s: FinishedCampaign, timings: dict[str, float],
                  machines: MachinesSection | None = None, *, notes: Sequence[str] = (),
                  score_spec: ScoreSpec | None = None) -> str:
    """`report.md` of a finished run; `notes`: lines after the score (`prompt_notes`, `OWN_CLUSTERS`);
    `score_spec`: the suite's, for the per-area table."""
    lines = [f"# Campaign report: {name}", "", *_headline(docs, s.fast_pass.engine), *_stack_lines(s.fast_pass.stacks),
             *_fold_section(docs.fold, s.gate),
             *_score_section(docs.policy, score_spec), *notes,
             *_calibration_section(docs.calibration), "## Overlays", ""]
    applied = [f"- `{a['id']}` on `{a['target']}`: {a['changed']} choices changed" for a in s.overlay.applied]
    if any(a.get("unverified") for a in s.overlay.applied):
        lines.append(UNVERIFIED)
    lines += applied or ["None applied."]
    lines += _stages_section(s, timings, machines)
    lines += machines.markdown if machines else IN_PROCESS
    return "\n".join(lines) + "\n"


UNVERIFIED = ('<span style="color:red">**UNVERIFIED OVERLAYS**</span>: applied with `--unverified-overlays`, '
              "without a passed gate record for every rule on this suite and capture; the rows they decided are "
              "marked `overlay-unverified:<id>` in `samples.parquet` (`decided_by`).\n")

OWN_CLUSTERS = ["Every row is its own cluster: no two rows of a catalog share a `question_id`, so the "
                "bootstrap resamples rows, as if no two were variants of one question (`jex suite import "
                "--cluster COL` names the column that groups them).", ""]


def prompt_notes(chat_template: str, verbatim: Sequence[str]) -> list[str]:
    """What a run with verbatim catalogs (an imported harness's own prompts) read, and whether that is
    the harness's default: lm-eval applies no chat template unless asked. Nothing for other runs."""
    if not verbatim:
        return []
    which = {"auto": "no chat template (lm-eval's default; `--chat-template model` or FILE asks for one)",
             "none": "no chat template (lm-eval's default)",
             "model": "the model's chat template (asked for with `--chat-template model`; lm-eval applies none "
                      "by default, so these numbers are not lm-eval's defaults)"}.get(
        chat_template, "a chat template given as text (lm-eval applies none by default)")
    return [f"Prompts of {', '.join(f'`{c}`' for c in verbatim)}: lm-eval's own context, read verbatim, with "
            f"{which}.", ""]


def every_row_own_cluster(samples: pl.DataFrame) -> bool:
    """Whether, in every catalog, the scored rows' question_ids are all distinct (the bootstrap's clusters
    are then single rows: an importer's default without `--cluster`)."""
    counts = samples.filter(pl.col("scored")).group_by("catalog").agg(
        rows=pl.len(), clusters=pl.col("question_id").n_unique())
    return counts.height > 0 and bool((counts["rows"] == counts["clusters"]).all())


def _headline(docs: RunDocs, engine: EngineFingerprint) -> list[str]:
    policy, baseline = docs.policy, docs.baseline
    lo, hi = policy.ci
    dlo, dhi = docs.fold.delta_full_ci
    return [f"**Full index {policy.full:.2f}** (95% CI {lo:.2f} to {hi:.2f}) against the fast-pass baseline "
            f"{baseline.full:.2f}: delta {policy.full - baseline.full:+.2f} with fold, calibration and "
            f"overlays; the fold alone has a paired 95% CI of {dlo:+.2f} to {dhi:+.2f}.", "",
            f"Engine: `{engine.kind}`{engine_scope(engine)}, {_model_line(engine)}, renderer "
            f"`{engine.renderer.version}`.", ""]


def engine_scope(engine: EngineFingerprint) -> str:
    """The engine's span over several GPUs and, for the control engine, that it gives no batch-invariance
    guarantee (the audited engine's span is its settings audit's to allow: the machines section names it)."""
    span = f" over {engine.tensor_parallel_size} GPUs (tensor parallel)" if engine.tensor_parallel_size else ""
    return span + (" (**control: no batch-invariance guarantee**)" if engine.kind == "vllm-control" else "")


def _model_line(engine: EngineFingerprint) -> str:
    """The weights the engine read, or the served model (marked: its batch invariance is not proven)."""
    if engine.weights_sha256 is not None:
        return f"weights sha256 `{engine.weights_sha256[:16]}…`"
    return f"served model `{engine.served_model}` at `{engine.endpoint}` (**served: batch invariance not proven**)"


STACK_FIELDS = ("vllm", "torch", "triton", "transformers", "cuda", "driver", "gpu", "device_type")
"""What the report shows of each engine stack that computed the fast pass (the whole block is in the stage's
`_SUCCESS.json`, `stacks`)."""


def _stack_lines(stacks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The engine stacks the fast pass ran on, as read where its shards were computed."""
    if not stacks:
        return []
    shown = ["; ".join(f"{k} {st[k]}" for k in STACK_FIELDS if st.get(k) is not None) for st in stacks]
    return [f"Engine stack (read where the fast pass ran): {' | '.join(f'`{x}`' for x in shown)}.", ""]


def _fold_section(fold: FoldDoc, gate: GateSummary) -> list[str]:
    o = fold.overall
    lines = ["## Fold (dry-run counters)", "", "| counter | value |", "|---|---:|"]
    for k in ("panel_rows", "gated", "reasoned", "folded", "fold_missing", "fixed", "flipped", "gated_wrong_before",
              "fix_rate", "baseline_acc", "policy_acc"):
        lines.append(f"| {k} | {_f(getattr(o, k))} |")
    for k, v in fold.errors:
        lines.append(f"| error: {k} | {v} |")
    rt = fold.rationale_tokens
    lines += [f"| rationale tokens (mean / max / hit max_tokens) | {rt.mean:.1f} / {rt.max} / "
              f"{rt.hit_max_tokens} |", f"| fold rule | {fold.rule.rule} (w = {fold.rule.weight}) |",
              f"| coverage | {gate.coverage} ({gate.rows} rows gated) |", "",
              "| catalog | n | gated | fixed | flipped | fix rate | baseline acc | policy acc | delta skill | 95% CI |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c, v in fold.catalogs.items():
        ci = v.delta_skill_ci
        lines.append(f"| {c} | {v.panel_rows} | {v.gated} | {v.fixed} | {v.flipped} | "
                     f"{_f(v.fix_rate, 3)} "
                     f"| {_f(v.baseline_acc, 3)} | {_f(v.policy_acc, 3)} | {v.delta_skill:+.4f} | "
                     f"{ci[0]:+.3f} to {ci[1]:+.3f} |")
    return lines + failed_rows_section(fold) + error_rows_section(fold)


def _score_section(policy: ScoreDoc, spec: ScoreSpec | None = None) -> list[str]:
    lines = ["", "## Score", "", "| leg | index | 95% CI | raw |", "|---|---:|---|---:|"]
    for leg, v in policy.legs.items():
        lines.append(f"| {leg} | {v.index:.2f} | {v.ci[0]:.2f} to {v.ci[1]:.2f} | {v.raw:.2f} |")
    lines += area_table(policy, spec) if spec is not None else []
    lines += catalog_table(policy)
    if policy.reference_audit:
        lines += audit_markdown(policy.reference_audit)
    return lines + ["", "![per-catalog skill](skill.png)", ""]


def _calibration_section(calibration: CalibrationDoc) -> list[str]:
    before, after = calibration.reliability_before, calibration.reliability_after
    if before is None or after is None or calibration.nll_before is None or calibration.nll_after is None:
        return ["## Calibration", "", "No multiple-choice row: nothing was calibrated.", ""]
    return ["## Calibration", "",
            f"Temperature scaling out-of-fold by question ({len(calibration.folds)} folds; T = "
            + ", ".join(f"{t.temperature:.3f}" for t in calibration.folds)
            + f"). NLL {calibration.nll_before:.4f} -> {calibration.nll_after:.4f}; ECE "
            f"{before.ece:.4f} -> {after.ece:.4f}; "
            f"choices changed: {calibration.argmax_changed} "
            f"(ties made by rounding, choice kept: {calibration.rounding_ties}).", "",
            "![reliability](reliability.png)", ""]


def _stages_section(s: FinishedCampaign, timings: dict[str, float], machines: MachinesSection | None) -> list[str]:
    on_machines = machines.shards if machines else {}
    lines = ["", "## Stages", "", "| stage | seconds | shards computed here | shards computed on machines | "
             "shards reused |", "|---|---:|---:|---:|---:|"]
    sharded: dict[str, FastPassSummary | ReasonSummary | GenerateSummary] = {"fast_pass": s.fast_pass,
                                                                             "reason": s.reason}
    if s.generate is not None:
        sharded["generate"] = s.generate
    for stage, secs in timings.items():
        summary = sharded.get(stage)
        remote = on_machines.get(stage, 0) if summary else None
        reused = len(summary.reused_shards) - (remote or 0) if summary else None
        lines.append(f"| {stage} | {secs:.2f} | {len(summary.computed_shards) if summary else '-'} | "
                     f"{'-' if remote is None else remote} | {'-' if reused is None else reused} |")
    return lines


def generation_section(samples: pl.DataFrame, generated: GenerateSummary) -> list[str]:
    """The generative catalogs: how the rows were generated, and each filter's exact_match per catalog (lm-eval's
    `exact_match,<filter>`), from the samples record."""
    tokens = generated.generated_tokens
    how = "greedily" if generated.samples is None else f"({generated.samples} generations, sampled by their seeds)"
    lines = ["", "## Generation", "", f"{generated.rows} rows generated {how}: {tokens.mean:.1f} tokens on average, "
             f"at most {tokens.max}; {tokens.hit_max_tokens} reached their token limit; "
             f"{generated.context_refusals} refused (prompt too long), {generated.batch_errors} failed"
             + (": " + ", ".join(f"{r.run_id} ({r.attempts} attempts, {r.error_type})" for r in generated.failed_rows)
                if generated.failed_rows else "") + ".", *_thought_lines(generated), "",
             "| catalog | filter | exact_match | matches | n |", "|---|---|---:|---:|---:|"]
    rows = samples.filter(pl.col("decided_by") == "generate", pl.col("scored"))
    sampled = "samples" in rows.columns  # the index reads each row's verdict (a majority's) or its pass@k
    for catalog in dict.fromkeys(rows["catalog"].to_list()):
        sub = rows.filter(pl.col("catalog") == catalog)
        names: list[str] = next((f for f in sub["filters"].to_list() if f is not None), [])
        for k, name in enumerate(names):
            hits = sum(1 for v in sub["verdicts"].to_list() if v is not None and v[k])
            mark = "" if k else " (primary)" if sampled else " (scored)"
            lines.append(f"| {catalog} | {name}{mark} | {hits / sub.height:.4f} | {hits} | {sub.height} |")
        if sampled:
            lines += _sampled_scores(catalog, sub)
    return [*lines, ""]


def _sampled_scores(catalog: str, sub: pl.DataFrame) -> list[str]:
    """What the index reads of a sampled catalog's rows: their verdicts (a maj_at_k catalog's: its majorities'),
    and a pass_at_k catalog's mean pass@k."""
    hits = int(sub["exact_match"].fill_null(False).sum())
    passes = sub["pass_at_k"].drop_nulls().to_list()
    if passes:
        return [f"| {catalog} | pass@k (scored) | {sum(passes) / sub.height:.4f} | - | {sub.height} |"]
    return [f"| {catalog} | row verdict (scored) | {hits / sub.height:.4f} | {hits} | {sub.height} |"]


def _thought_lines(generated: GenerateSummary) -> list[str]:
    """The reasoning catalogs' thoughts (none without thinking delimiters)."""
    t = generated.thinking
    if t is None:
        return []
    return ["", f"Thoughts of {t.generations} generations: {t.mean:.1f} tokens on average, at most {t.max}; "
                f"{t.unclosed} never closed (read whole), {t.unclosed_at_max_tokens} of them at the token limit."]


def failed_rows_section(fold: FoldDoc) -> list[str]:
    """The rows whose engine calls still failed after every retry, named by stage (from fold.json); nothing
    on a clean run."""
    lines = fold.failed_lines()
    if not lines:
        return []
    return ["", "Failed rows (engine errors after every retry: no answer, counted in `batch_errors`; the "
            "retry-stage flow from their stage computes only them again):", "", *[f"- {line}" for line in lines]]


def error_rows_section(fold: FoldDoc) -> list[str]:
    """The rows behind each non-zero error counter (the first 50 of each, from fold.json)."""
    if not fold.error_rows:
        return []
    lines = ["", "Rows behind the error counters:", "", "| counter | run_id | why |", "|---|---|---|"]
    for counter, items in fold.error_rows.items():
        lines += [f"| {counter} | {r.run_id} | {r.why.replace('|', '/')} |" for r in items]
    return lines


IN_PROCESS = ["", "## Machines", "", "Engine stages ran in the orchestrator's process (provider `inprocess`)."]
"""The machines section of a run without machines."""
