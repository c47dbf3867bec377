"""The campaign report: Markdown and PNG plots in the run folder (the flow also publishes them to Prefect)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jex.tasks.records import FastPassSummary, FinishedCampaign, GateSummary, ReasonSummary
from jex.tasks.scoring.reference_audit import audit_markdown
from jex.tasks.scoring.score import catalog_table

MachinesDoc = dict[str, Any]
"""`machines.json` of a run with machines, as `flows/fleet.py` reports it (the flows room's JSON)."""


def skill_plot(baseline: dict[str, Any], policy: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cats = list(policy["catalogs"])
    x = np.arange(len(cats))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(cats)), 4))
    for off, (name, doc) in zip((-0.18, 0.18), (("baseline (fast pass)", baseline), ("policy", policy)), strict=True):
        s = [doc["catalogs"][c]["skill"] for c in cats]
        lo = [s[i] - doc["catalogs"][c]["ci"][0] for i, c in enumerate(cats)]
        hi = [doc["catalogs"][c]["ci"][1] - s[i] for i, c in enumerate(cats)]
        ax.errorbar(x + off, s, yerr=[lo, hi], fmt="o", capsize=3, label=name)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(x, cats, rotation=45, ha="right")
    ax.set(ylabel="skill (chance-normalised)", title="Per-catalog skill with 95% clustered CIs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def reliability_plot(calibration: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    for key, name in (("reliability_before", "before"), ("reliability_after", "after")):
        bins = calibration[key]["bins"]
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o",
                label=f"{name} (ECE {calibration[key]['ece']:.3f})")
    ax.set(xlabel="confidence (top-1 probability)", ylabel="accuracy", title="Reliability", xlim=(0, 1), ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _f(x: Any, nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class RunDocs:
    """A finished run's JSON documents, as the stages wrote them."""

    policy: dict[str, Any]
    """score.json"""
    baseline: dict[str, Any]
    """baseline_score.json: the fast pass alone"""
    fold: dict[str, Any]
    """fold.json: dry-run counters and every error counter"""
    calibration: dict[str, Any]
    """calibration.json"""


def render_report(name: str, docs: RunDocs, s: FinishedCampaign, timings: dict[str, float],
                  machines: MachinesDoc | None = None) -> str:
    """`report.md` of a finished run."""
    lines = [f"# Campaign report: {name}", "", *_headline(docs, s.fast_pass.engine), *_fold_section(docs.fold, s.gate),
             *_score_section(docs.policy), *_calibration_section(docs.calibration), "## Overlays", ""]
    applied = [f"- `{a['id']}` on `{a['target']}`: {a['changed']} choices changed" for a in s.overlay.applied]
    lines += applied or ["None applied."]
    lines += _stages_section(s, timings, machines)
    lines += machines_section(machines)
    return "\n".join(lines) + "\n"


def _headline(docs: RunDocs, engine: dict[str, Any]) -> list[str]:
    policy, baseline = docs.policy, docs.baseline
    lo, hi = policy["ci"]
    dlo, dhi = docs.fold["delta_full_ci"]
    return [f"**Full index {policy['full']:.2f}** (95% CI {lo:.2f} to {hi:.2f}) against the fast-pass baseline "
            f"{baseline['full']:.2f}: delta {policy['full'] - baseline['full']:+.2f} with fold, calibration and "
            f"overlays; the fold alone has a paired 95% CI of {dlo:+.2f} to {dhi:+.2f}.", "",
            f"Engine: `{engine.get('kind')}`, weights sha256 `{str(engine.get('weights_sha256'))[:16]}…`, "
            f"renderer `{engine.get('renderer', {}).get('version')}`.", ""]


def _fold_section(fold: dict[str, Any], gate: GateSummary) -> list[str]:
    o = fold["overall"]
    lines = ["## Fold (dry-run counters)", "", "| counter | value |", "|---|---:|"]
    for k in ("panel_rows", "gated", "reasoned", "folded", "fold_missing", "fixed", "flipped", "gated_wrong_before",
              "fix_rate", "baseline_acc", "policy_acc"):
        lines.append(f"| {k} | {_f(o.get(k))} |")
    for k, v in fold["errors"].items():
        lines.append(f"| error: {k} | {v} |")
    rt = fold["rationale_tokens"]
    lines += [f"| rationale tokens (mean / max / hit max_tokens) | {rt['mean']:.1f} / {rt['max']} / "
              f"{rt['hit_max_tokens']} |", f"| fold rule | {fold['rule']['rule']} (w = {fold['rule']['weight']}) |",
              f"| coverage | {gate.coverage} ({gate.rows} rows gated) |", "",
              "| catalog | n | gated | fixed | flipped | fix rate | baseline acc | policy acc | delta skill | 95% CI |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c, v in fold["catalogs"].items():
        ci = v["delta_skill_ci"]
        lines.append(f"| {c} | {v['panel_rows']} | {v['gated']} | {v['fixed']} | {v['flipped']} | "
                     f"{_f(v['fix_rate'], 3)} "
                     f"| {_f(v['baseline_acc'], 3)} | {_f(v['policy_acc'], 3)} | {v['delta_skill']:+.4f} | "
                     f"{ci[0]:+.3f} to {ci[1]:+.3f} |")
    return lines + error_rows_section(fold)


def _score_section(policy: dict[str, Any]) -> list[str]:
    lines = ["", "## Score", "", "| leg | index | 95% CI | raw |", "|---|---:|---|---:|"]
    for leg, v in policy["legs"].items():
        lines.append(f"| {leg} | {v['index']:.2f} | {v['ci'][0]:.2f} to {v['ci'][1]:.2f} | {v['raw']:.2f} |")
    lines += catalog_table(policy)
    if policy.get("reference_audit"):
        lines += audit_markdown(policy["reference_audit"])
    return lines + ["", "![per-catalog skill](skill.png)", ""]


def _calibration_section(calibration: dict[str, Any]) -> list[str]:
    return ["## Calibration", "",
            f"Temperature scaling out-of-fold by question ({len(calibration['folds'])} folds; T = "
            + ", ".join(f"{t['temperature']:.3f}" for t in calibration["folds"])
            + f"). NLL {calibration['nll_before']:.4f} -> {calibration['nll_after']:.4f}; ECE "
            f"{calibration['reliability_before']['ece']:.4f} -> {calibration['reliability_after']['ece']:.4f}; "
            f"choices changed: {calibration['argmax_changed']} "
            f"(ties made by rounding, choice kept: {calibration.get('rounding_ties', 0)}).", "",
            "![reliability](reliability.png)", ""]


def _stages_section(s: FinishedCampaign, timings: dict[str, float], machines: MachinesDoc | None) -> list[str]:
    on_machines: dict[str, int] = {}
    for m in (machines or {}).get("machines", []):
        for j in m["jobs"]:
            on_machines[j["job"]] = on_machines.get(j["job"], 0) + len(j["artifacts"])
    lines = ["", "## Stages", "", "| stage | seconds | shards computed here | shards computed on machines | "
             "shards reused |", "|---|---:|---:|---:|---:|"]
    sharded: dict[str, FastPassSummary | ReasonSummary] = {"fast_pass": s.fast_pass, "reason": s.reason}
    for stage, secs in timings.items():
        summary = sharded.get(stage)
        remote = on_machines.get(stage, 0) if summary else None
        reused = len(summary.reused_shards) - (remote or 0) if summary else None
        lines.append(f"| {stage} | {secs:.2f} | {len(summary.computed_shards) if summary else '-'} | "
                     f"{'-' if remote is None else remote} | {'-' if reused is None else reused} |")
    return lines


def error_rows_section(fold: dict[str, Any]) -> list[str]:
    """The rows behind each non-zero error counter (the first 50 of each, from fold.json)."""
    rows = fold.get("error_rows") or {}
    if not rows:
        return []
    lines = ["", "Rows behind the error counters:", "", "| counter | run_id | why |", "|---|---|---|"]
    for counter, items in rows.items():
        lines += [f"| {counter} | {r['run_id']} | {str(r['why']).replace('|', '/')} |" for r in items]
    return lines


def machines_section(machines: MachinesDoc | None) -> list[str]:
    """Each machine's life, cost and end, the golden replays, and the campaign's running total."""
    if machines is None:
        return ["", "## Machines", "", "Engine stages ran in the orchestrator's process (provider `inprocess`)."]
    slots = machines.get("slots", 1)
    lines = ["", "## Machines", "", f"Provider `{machines['provider']}`, {machines['workers']} worker(s), "
             f"{slots} engine process(es) each, {machines.get('engine_starts', 0)} engine start(s) in all.", "",
             "| machine | life (s) | cost ($) | ended because | teardown attempts | engine starts | jobs |",
             "|---|---:|---:|---|---:|---:|---|"]
    for m in machines["machines"]:
        t = m.get("teardown") or {}
        jobs = ", ".join(f"{j['job']}: {j['status']} ({len(j['artifacts'])} artifacts)" for j in m["jobs"])
        lines.append(f"| {m['machine']['id']} | {_f(m.get('life_s'), 1)} | {_f(m.get('cost_usd'), 4)} | "
                     f"{t.get('reason', 'running')} | {t.get('attempts', '-')} | {m.get('engine_starts', '-')} | "
                     f"{jobs} |")
    if not machines["machines"]:
        lines.append("| (none: every engine stage was cached) | | | | | | |")
    for g in machines["golden"]:
        how = "reference established" if g.get("established") else f"against {g['reference']}"
        lines.append(f"\nGolden replay on {g['machine']}: {g['rows']} rows, max |dp| {g['max_abs_dp']:.3g} "
                     f"(tolerance {g['tolerance']:.0e}), {how}.")
    lines.append(f"\nCampaign machine cost so far: ${machines['ledger']['total_usd']:.4f} over "
                 f"{machines['ledger']['machine_seconds']:.0f} machine-seconds.")
    return lines
