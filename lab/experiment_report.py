"""An experiment's products: the pre-registered test (the arms file's `[gate]`, registered before any arm
runs), verdicts, `experiment.json`, `report.md`, the forest and sweep plots, the twin audit and the
append-only decision ledger. The files keep the names `gate-settings.json`, `"gate"` and `gate_sha256`.

Nothing here runs an engine: it reads finished run folders (predictions, provenance, stage summaries).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import polars as pl
from pydantic import Field

from jex.errors import InputError
from jex.fileio import canonical_json, sha256_json, write_json, write_text
from jex.lab.arms import ArmsFile, ExperimentTestSettings
from jex.lab.experiment_stats import ArmStats, Delta, DeltaJson, OofChoice, versus
from jex.record import Record, read_record
from jex.tasks.bundle.suite_table import SuiteTable
from jex.tasks.decisions import Decision, now, read_decisions
from jex.tasks.records import FinishedCampaign
from jex.tasks.run_store import run_summaries


class ParquetDifference(TypedDict):
    """Where two Parquet files first differ (row and column None when the shapes or metadata differ)."""

    row: int | None
    run_id: str | None
    column: str | None
    detail: str


class ArtifactDifference(ParquetDifference):
    artifact: str  # fast_pass | reason | predictions


class TwinAudit(TypedDict):
    """A twin run against the base, byte for byte (the flow adds the twin's `store`)."""

    identical: bool
    first_difference: ArtifactDifference | None
    sha256: dict[str, list[str]]  # stage -> [base, twin]
    folders: dict[str, list[str]]  # stage -> [base key, twin key]
    store: NotRequired[str]


class _ArmEntryCore(TypedDict):
    kind: str
    delta: float
    ci: list[float]
    p: float
    vs_placebo: DeltaJson | None
    verdict: str
    checks: dict[str, bool]
    index: float
    full: DeltaJson
    wall_ratio: float
    token_ratio: float
    legs: dict[str, DeltaJson]
    catalogs: dict[str, DeltaJson]
    run: str
    engine_calls: dict[str, int]
    sub_run_wall_s: float


class ArmEntry(_ArmEntryCore, total=False):
    """One arm of `experiment.json` (the output contract in docs/experiments.md)."""

    placebo_delta: float
    retention: float | None
    sweep: str
    value: Any


class SweepPoint(TypedDict):
    value: Any
    name: str
    delta: float
    ci: list[float]
    verdict: str


class SweepDoc(TypedDict):
    parameter: str | None
    points: list[SweepPoint]
    oof: OofChoice
    plot: str  # the plot's file name in the experiment folder


class PanelSpec(TypedDict):
    """The panel an experiment ran on: each catalog's share of the full weight, and the share asserted."""

    shares: Mapping[str, float]
    asserted_share: float | None


class PanelArm(TypedDict):
    panel_delta: float
    panel_ci: list[float]
    projected: DeltaJson


class PanelDoc(TypedDict):
    catalogs: list[str]
    share: float
    asserted_share: float | None
    shares: dict[str, float]
    arms: dict[str, PanelArm]


class ExperimentDoc(TypedDict):
    """`experiment.json`."""

    name: str
    base: dict[str, Any]  # index, run, engine_calls, wall_s
    gate: dict[str, Any]  # the pre-registered test: settings_sha256 and its settings
    arms: dict[str, ArmEntry]
    twin: dict[str, TwinAudit]
    sweeps: dict[str, SweepDoc]
    panel: NotRequired[PanelDoc]
    provenance: dict[str, Any]


# --- experiment.json, as a record: every write goes through it, and every read -----------------------

class DeltaRecord(Record):
    delta: float
    ci: list[float]


class OofRecord(Record):
    choice: Any
    fold_choices: list[Any]
    oof_delta: float
    in_sample_best: Any
    folds: int


class DifferenceRecord(Record):
    row: int | None
    run_id: str | None
    column: str | None
    detail: str
    artifact: str


class TwinRecord(Record):
    identical: bool
    first_difference: DifferenceRecord | None
    sha256: dict[str, list[str]]
    folders: dict[str, list[str]]
    store: str | None = None


class ArmRecord(Record):
    kind: str
    delta: float
    ci: list[float]
    p: float
    vs_placebo: DeltaRecord | None
    verdict: str
    checks: dict[str, bool]
    index: float
    full: DeltaRecord
    wall_ratio: float
    token_ratio: float
    legs: dict[str, DeltaRecord]
    catalogs: dict[str, DeltaRecord]
    run: str
    engine_calls: dict[str, int]
    sub_run_wall_s: float
    placebo_delta: float | None = None
    retention: float | None = None
    sweep: str | None = None
    value: Any = None


class SweepPointRecord(Record):
    value: Any
    name: str
    delta: float
    ci: list[float]
    verdict: str


class SweepRecord(Record):
    parameter: str | None
    points: list[SweepPointRecord]
    oof: OofRecord
    plot: str


class PanelArmRecord(Record):
    panel_delta: float
    panel_ci: list[float]
    projected: DeltaRecord


class PanelRecord(Record):
    catalogs: list[str]
    share: float
    asserted_share: float | None
    shares: dict[str, float]
    arms: dict[str, PanelArmRecord]


EXPERIMENT_FILE = "experiment.json"


class ExperimentRecord(Record):
    """`experiment.json` (the output contract in docs/experiments.md), the record of an `ExperimentDoc`:
    written through it (`write_experiment`: the keys the document holds, as before) and read back through
    it (`read_experiment`). `ledger`: the store ledger the flow appended the decisions to."""

    version: Literal[1] = Field(1, description="The record's version (absent in the file: 1)")
    name: str
    base: dict[str, Any] = Field(description="index, run, engine_calls, wall_s")
    gate: dict[str, Any] = Field(description="The pre-registered test: settings_sha256 and its settings")
    arms: dict[str, ArmRecord]
    twin: dict[str, TwinRecord]
    sweeps: dict[str, SweepRecord]
    panel: PanelRecord | None = None
    provenance: dict[str, Any]
    ledger: str | None = Field(None, description="Absent in a file an older jex wrote")


def write_experiment(out: Path, doc: ExperimentDoc, *, ledger: Path | None = None) -> str:
    """`OUT/experiment.json`: `doc` validated as `ExperimentRecord`, with the keys it holds (floats as they
    are: a NaN stays one); returns the sha256 written."""
    record = ExperimentRecord.model_validate({**doc, **({"ledger": str(ledger)} if ledger is not None else {})})
    return write_json(out / EXPERIMENT_FILE, record.model_dump(exclude_unset=True))


def read_experiment(out: Path) -> ExperimentRecord:
    return read_record(ExperimentRecord, out / EXPERIMENT_FILE)


def register_experiment_test(arms: ArmsFile, out: Path) -> str:
    """Write `gate-settings.json` (the pre-registered test and every arm as declared) before any arm runs;
    its sha256.

    Re-running the same experiment registers the same bytes; a changed test or arm list is refused
    (it would be a new experiment in the same folder: pick another OUT).
    """
    # an unset retention gate is left out, so an experiment registered before the gate existed keeps its bytes
    unset = {"min_retention"} if arms.test.min_retention is None else None
    doc = {"gate": arms.test.model_dump(mode="json", exclude=unset), "arms_file_sha256": arms.sha256,
           "arms": [a.model_dump(mode="json") for a in arms.arms], "base": arms.base.model_dump(mode="json")}
    text = canonical_json(doc)
    path = out / "gate-settings.json"
    if path.exists() and path.read_text() != text:
        raise InputError("this folder holds an experiment registered with other gate settings or arms; "
                         "write the new experiment to another folder", file=str(path))
    return write_json(path, doc)


@dataclass(frozen=True)
class ArmRun:
    """One finished sub-run of an arm (or a sweep point)."""

    name: str
    kind: str
    run_dir: Path
    engine_calls: dict[str, int]
    wall_s: float
    sweep: str | None = None
    value: Any = None


def predictions(run_dir: Path) -> pl.DataFrame:
    """run_id, choice, probs, and `abstain` when an overlay set it (the scorer reads it per catalog)."""
    return pl.read_parquet(run_dir / "predictions.parquet").select(pl.exclude("stage"))


def stage_summaries(run_dir: Path) -> FinishedCampaign:
    """The stage summaries a finished run used (`stages.json` names them, the store that holds them now has them)."""
    return run_summaries(run_dir).finished()


def engine_cost(run_dir: Path) -> tuple[float, float]:
    """(engine compute seconds of the capture, mean rationale tokens), whether computed now or reused."""
    s = stage_summaries(run_dir)
    return s.fast_pass.compute_seconds + s.reason.compute_seconds, s.reason.rationale_tokens.mean


def verdict(stats: ArmStats, vs_placebo: Delta | None, test: ExperimentTestSettings) -> tuple[str, dict[str, bool]]:
    """GO only when every pre-registered check passes (the checks come back with the verdict)."""
    worst = min(d.delta for d in stats.catalogs.values())
    checks = {"ci_above_min_effect": stats.metric.ci[0] > test.min_effect,
              "p_below_alpha": stats.p < test.alpha,
              "above_placebo": vs_placebo is not None and vs_placebo.ci[0] > 0,
              "no_catalog_degrades": worst >= -test.catalog_tolerance}
    if test.min_retention is not None:
        checks["retention_at_least_min"] = stats.retention is not None and stats.retention >= test.min_retention
    return ("GO" if all(checks.values()) else "NO-GO"), checks


def first_difference(a: Path, b: Path) -> ParquetDifference | None:
    """None when two Parquet files hold equal bytes; else the first differing row and column."""
    if a.read_bytes() == b.read_bytes():
        return None
    fa, fb = pl.read_parquet(a), pl.read_parquet(b)
    if fa.columns != fb.columns or fa.height != fb.height:
        return {"row": None, "run_id": None, "column": None,
                "detail": f"shape {fa.shape} vs {fb.shape}, columns {fa.columns} vs {fb.columns}"}
    for i, (ra, rb) in enumerate(zip(fa.iter_rows(named=True), fb.iter_rows(named=True), strict=True)):
        for col in fa.columns:
            if ra[col] != rb[col]:
                return {"row": i, "run_id": ra.get("run_id"), "column": col,
                        "detail": f"{str(ra[col])[:120]!r} vs {str(rb[col])[:120]!r}"}
    return {"row": None, "run_id": None, "column": None, "detail": "same values, different bytes (metadata)"}


def twin_audit(base_dir: Path, twin_dir: Path) -> TwinAudit:
    """Compare the twin's capture, rationales and predictions with the base's, byte for byte."""
    b, t = stage_summaries(base_dir), stage_summaries(twin_dir)
    files = {"fast_pass": (Path(b.fast_pass.capture), Path(t.fast_pass.capture)),
             "reason": (Path(b.reason.reasoned), Path(t.reason.reasoned)),
             "predictions": (base_dir / "predictions.parquet", twin_dir / "predictions.parquet")}
    diffs = {k: first_difference(x, y) for k, (x, y) in files.items()}
    first: ArtifactDifference | None = None
    for k, v in diffs.items():
        if v is not None:
            first = {"artifact": k, **v}
            break
    return {"identical": first is None, "first_difference": first,
            "sha256": {"fast_pass": [b.fast_pass.sha256, t.fast_pass.sha256],
                       "reason": [b.reason.sha256, t.reason.sha256]},
            "folders": {"fast_pass": [b.fast_pass.key, t.fast_pass.key], "reason": [b.reason.key, t.reason.key]}}


def forest_plot(arms: Mapping[str, ArmEntry], placebo: ArmEntry | None, path: Path,
                metric: str) -> None:
    """Each arm's delta with its 95% CI; the test's placebo's interval as a shaded band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(arms)
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.45 * len(names)))
    if placebo is not None:
        ax.axvspan(*placebo["ci"], color="tab:orange", alpha=0.18, label="placebo 95% CI")
        ax.axvline(placebo["delta"], color="tab:orange", ls="--", lw=1, label="placebo delta")
    for i, n in enumerate(names):
        a = arms[n]
        color = {"GO": "tab:green", "NO-GO": "tab:red", "placebo": "tab:orange"}.get(a["verdict"], "tab:grey")
        # the interval drawn as it is, not as error bars: a percentile interval need not hold its point (a
        # collapsed one can miss it by float noise, a negative bar matplotlib refuses)
        ax.hlines(i, a["ci"][0], a["ci"][1], color=color)
        ax.plot(a["ci"], [i, i], "|", ms=8, color=color)
        ax.plot(a["delta"], i, "o", color=color)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set(xlabel=f"delta vs base ({metric} index points, paired 95% CI)", title="Arms against the base")
    if placebo is not None:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_plot(name: str, parameter: str, points: list[SweepPoint], oof: OofChoice, path: Path) -> None:
    """Index delta and CI against the swept parameter, with the out-of-fold choice marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(len(points)))
    fig, ax = plt.subplots(figsize=(6, 4))
    d = [p["delta"] for p in points]
    ax.fill_between(x, [p["ci"][0] for p in points], [p["ci"][1] for p in points], alpha=0.25, label="95% CI")
    ax.plot(x, d, "o-", label="delta vs base")
    chosen = next(i for i, p in enumerate(points) if p["value"] == oof["choice"])
    ax.axvline(chosen, color="tab:red", ls="--", label=f"out-of-fold choice ({oof['choice']})")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, [str(p["value"]) for p in points])
    ax.set(xlabel=parameter, ylabel="delta (index points)", title=f"Sweep {name}: plateau or cliff?")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ci(ci: list[float] | tuple[float, float]) -> str:
    return f"[{ci[0]:+.3f}, {ci[1]:+.3f}]"


def render_report(doc: ExperimentDoc) -> str:
    """`report.md`: the pre-registered test and its hash, the arms table, the twin audit, sweeps, panel projection."""
    g = doc["gate"]
    lines = [f"# Experiment: {doc['name']}", "",
             f"Base index **{doc['base']['index']:.3f}** ({doc['base']['run']}).", "",
             f"Pre-registered test (`[gate]`, registered before any arm ran, sha256 `{g['settings_sha256']}`"
             + (f"; with the suite and the model: `{g['sha256']}`, the ledger's `gate_sha256`" if "sha256" in g else "")
             + "): "
             f"metric `{g['metric']}`, alpha {g['alpha']}, minimum effect {g['min_effect']}, placebo "
             f"`{g['placebo']}`, catalog tolerance {g['catalog_tolerance']}; {g['draws']} paired clustered draws "
             f"(seed {g['seed']}), {g['permutations']} sign-flip permutations"
             + (f"; retention gate: an arm keeps at least {g['min_retention']} of the base's correct rows"
                if g.get("min_retention") is not None else "") + ".", "",
             "| arm | kind | delta | 95% CI | p | vs placebo | verdict | wall ratio | engine calls (fast/reason) |",
             "|---|---|---:|---|---:|---|---|---:|---|"]
    for name, a in doc["arms"].items():
        vp = a["vs_placebo"]
        vs = f"{vp['delta']:+.3f} {_ci(vp['ci'])}" if vp else "-"
        calls = a["engine_calls"]
        lines.append(f"| {name} | {a['kind']} | {a['delta']:+.3f} | {_ci(a['ci'])} | {a['p']:.4f} | {vs} | "
                     f"**{a['verdict']}** | {a['wall_ratio']:.2f} | {calls.get('fast_pass', 0)}/"
                     f"{calls.get('reason', 0)} |")
    lines += ["", "![forest](forest.png)", ""]
    for name, a in doc["arms"].items():
        if a["kind"] in ("arm", "sweep") and a["verdict"] == "NO-GO":
            failed = [k for k, v in a["checks"].items() if not v]
            kept = f"; retention {a['retention']:.3f}" if a.get("retention") is not None else ""
            lines.append(f"- {name}: NO-GO ({', '.join(failed)}{kept})")
    if doc.get("twin"):
        t = doc["twin"]
        lines += ["", "## Twin audit", ""]
        for name, audit in t.items():
            if audit["identical"]:
                lines.append(f"- {name}: **identical** (capture, rationales and predictions byte-identical; the "
                             f"engine stages ran in a fresh process, store `{audit['store']}`)")
            else:
                f = audit["first_difference"]
                assert f is not None  # not identical: twin_audit recorded the first difference
                lines.append(f"- {name}: **DIFFERENT**: first difference in {f['artifact']}, row {f['row']} "
                             f"(run_id {f['run_id']}), column {f['column']}: {f['detail']}")
    for name, s in doc.get("sweeps", {}).items():
        lines += ["", f"## Sweep {name} ({s['parameter']})", "",
                  f"Out-of-fold choice **{s['oof']['choice']}** (fold choices {s['oof']['fold_choices']}, "
                  f"out-of-fold delta {s['oof']['oof_delta']:+.3f}; in-sample best {s['oof']['in_sample_best']}).",
                  "", "| value | delta | 95% CI | verdict |", "|---|---:|---|---|"]
        lines += [f"| {p['value']} | {p['delta']:+.3f} | {_ci(p['ci'])} | {p['verdict']} |" for p in s["points"]]
        lines += ["", f"![sweep {name}]({s['plot']})"]
    if doc.get("panel"):
        p = doc["panel"]
        lines += ["", "## Panel projection", "",
                  f"Panel catalogs {', '.join(p['catalogs'])}: **share of the full weight {p['share']:.5f}** "
                  f"(asserted {p['asserted_share']}).", "",
                  "| arm | panel-scale delta | 95% CI | projected full delta | 95% CI |", "|---|---:|---|---:|---|"]
        for name, v in p["arms"].items():
            lines.append(f"| {name} | {v['panel_delta']:+.3f} | {_ci(v['panel_ci'])} | {v['projected']['delta']:+.3f}"
                         f" | {_ci(v['projected']['ci'])} |")
    return "\n".join(lines) + "\n"


class RegisteredTest(Record):
    """The pre-registered test as the ledger keys it: the settings file's sha256 with the suite's and the
    base model's fingerprints (taken from the base run, before any arm runs). The same test on another
    suite or model is another registration, so its decisions are new ledger entries."""

    settings_sha256: str = Field(description="gate-settings.json (the test and every arm as declared)")
    suite_sha256: str = Field(description="The base run's bundle (rows, suite manifest, reference)")
    model: str = Field(description="sha256 of the base engine's weights and tokenizer")
    model_name: str | None = None
    model_params: float | None = None

    @property
    def sha256(self) -> str:
        return sha256_json({"settings_sha256": self.settings_sha256, "suite_sha256": self.suite_sha256,
                            "model": self.model})


def register_with_base(settings_sha256: str, base_dir: Path, *, model_name: str | None = None,
                       model_params: float | None = None) -> RegisteredTest:
    """The registration of the test on the base run's suite and model (`RegisteredTest`)."""
    s = stage_summaries(base_dir)
    fp = s.fast_pass.engine
    return RegisteredTest(settings_sha256=settings_sha256, suite_sha256=s.bundle.sha256,
                          model=sha256_json({"weights": fp.weights_sha256, "tokenizer": fp.tokenizer_sha256}),
                          model_name=model_name, model_params=model_params)


def experiment_decisions(doc: ExperimentDoc, arms: ArmsFile, registered: RegisteredTest, *, source: Path,
                         date: str | None = None) -> list[Decision]:
    """One ledger decision per decided arm (GO / NO-GO), under the registration's hash."""
    out = []
    for name, a in doc["arms"].items():
        if a["verdict"] not in ("GO", "NO-GO"):
            continue
        decl = next((d for d in arms.arms if d.name == name.split("@")[0]), None)
        vp = a["vs_placebo"]
        out.append(Decision(
            kind="experiment-arm", subject=name, status=a["verdict"], source=str(source.resolve()),
            date=date or now(), experiment=doc["name"], gate_sha256=registered.sha256,
            settings_sha256=registered.settings_sha256, suite_sha256=registered.suite_sha256,
            model=registered.model, model_name=registered.model_name, model_params=registered.model_params,
            metric=doc["gate"]["metric"], effect=a["delta"], ci=a["ci"], p=a["p"], placebo=doc["gate"]["placebo"],
            placebo_effect=a.get("placebo_delta"), vs_placebo_ci=vp["ci"] if vp else None,
            hypothesis=(decl.hypothesis or None) if decl else None,
            reopen_when=(decl.reopen_when if decl else "") or "not given", reopen_if=decl.reopen_if if decl else None))
    return out


def experiment_ledger(out: Path) -> tuple[Path, list[Decision]]:
    """The store ledger an experiment folder appended to (`experiment.json`'s `ledger`) and its decisions
    taken in that folder; an InputError when the folder holds no experiment."""
    doc_path = out / "experiment.json"
    if not doc_path.exists():
        raise InputError("no experiment.json here (it names the store's ledger.toml): run `jex experiment run` "
                         "with -o this folder first", file=str(doc_path))
    ledger = Path(read_experiment(out).ledger or "")
    if not ledger.name:
        raise InputError("experiment.json names no ledger (written by an older jex): run the experiment again",
                         file=str(doc_path))
    here = str(out.resolve())
    return ledger, [d for d in read_decisions(ledger) if d.source == here]


def arm_entry(run: ArmRun, stats: ArmStats, vs: Delta | None, verdict_: str, checks: dict[str, bool],
              base_cost: tuple[float, float], placebo_delta: float | None) -> ArmEntry:
    """One arm of `experiment.json` (the output contract in docs/experiments.md)."""
    seconds, tokens = engine_cost(run.run_dir)
    entry: ArmEntry = {"kind": run.kind, "delta": stats.metric.delta, "ci": list(stats.metric.ci), "p": stats.p,
                       "vs_placebo": vs.to_json() if vs else None, "verdict": verdict_, "checks": checks,
                       "index": stats.index, "full": stats.full.to_json(),
                       "wall_ratio": seconds / base_cost[0] if base_cost[0] else float("nan"),
                       "token_ratio": tokens / base_cost[1] if base_cost[1] else float("nan"),
                       "legs": {k: v.to_json() for k, v in stats.legs.items()},
                       "catalogs": {k: v.to_json() for k, v in stats.catalogs.items()},
                       "run": str(run.run_dir), "engine_calls": run.engine_calls, "sub_run_wall_s": run.wall_s}
    if placebo_delta is not None:
        entry["placebo_delta"] = placebo_delta
    if stats.retention is not None:
        entry["retention"] = stats.retention
    if run.sweep:
        entry["sweep"] = run.sweep
        entry["value"] = run.value
    return entry


def analyse(arms: ArmsFile, *, base: ArmRun, runs: list[ArmRun], test_sha256: str, out: Path,
            registered: RegisteredTest | None = None,
            twins: Mapping[str, TwinAudit] | None = None, panel: PanelSpec | None = None,
            settings: Mapping[str, Any] | None = None) -> ExperimentDoc:
    """Paired statistics, verdicts, sweeps and panel projection of finished sub-runs; writes
    `experiment.json`, `report.md`, `forest.png` and one `sweep-NAME.png` per sweep. Returns the doc."""
    from jex.lab.experiment_stats import paired_arms
    from jex.provenance import provenance
    from jex.tasks.bundle.suite_table import load_suite_table

    test = arms.test
    bundle = stage_summaries(base.run_dir).bundle
    table = load_suite_table(bundle.bundle)
    base_preds = predictions(base.run_dir)
    base_index, stats = paired_arms(table.rows, table.spec, base_preds,
                                    {r.name: predictions(r.run_dir) for r in runs}, metric=test.metric,
                                    draws=test.draws, seed=test.seed, permutations=test.permutations)
    entries = _arm_entries(arms, runs, stats, twins or {}, engine_cost(base.run_dir))
    doc: ExperimentDoc = {
        "name": arms.name, "base": {"index": base_index, "run": str(base.run_dir), "engine_calls": base.engine_calls,
                                    "wall_s": base.wall_s},
        "gate": {"settings_sha256": test_sha256, **test.model_dump(mode="json"),
                 **({"sha256": registered.sha256, "suite_sha256": registered.suite_sha256,
                     "model_sha256": registered.model} if registered else {})},
        "arms": entries, "twin": dict(twins or {}),
        "sweeps": _sweeps(arms, runs, entries, table, base_preds, out),
        "provenance": {}}
    if panel:
        doc["panel"] = _panel(panel, stats)
    doc["provenance"] = provenance(inputs={"arms_file": arms.sha256, "bundle": bundle.sha256},
                                   settings=dict(settings or {}), gate_sha256=test_sha256)
    placebo_entry = entries.get(test.placebo) if test.placebo else None
    forest_plot(entries, placebo_entry, out / "forest.png", test.metric)
    write_experiment(out, doc)
    write_text(out / "report.md", render_report(doc))
    return doc


def _arm_entries(arms: ArmsFile, runs: list[ArmRun], stats: Mapping[str, ArmStats],
                 twins: Mapping[str, TwinAudit], base_cost: tuple[float, float]) -> dict[str, ArmEntry]:
    """Each sub-run's entry: arms and sweep points get the test's verdict (against their placebo),
    placebos are marked, twins say whether they were byte-identical."""
    entries: dict[str, ArmEntry] = {}
    for r in runs:
        decl = arms.arm(r.sweep or r.name)
        placebo = arms.placebo_of(decl) if r.kind in ("arm", "sweep") else None
        vs = versus(stats[r.name], stats[placebo]) if placebo else None
        if r.kind in ("arm", "sweep"):
            v, checks = verdict(stats[r.name], vs, arms.test)
        elif r.kind == "placebo":
            v, checks = "placebo", {}
        else:
            v, checks = ("identical" if twins[r.name]["identical"] else "DIFFERENT"), {}
        entries[r.name] = arm_entry(r, stats[r.name], vs, v, checks, base_cost,
                                    stats[placebo].metric.delta if placebo else None)
    return entries


def _sweeps(arms: ArmsFile, runs: list[ArmRun], entries: Mapping[str, ArmEntry], table: SuiteTable,
            base_preds: pl.DataFrame, out: Path) -> dict[str, SweepDoc]:
    """Per declared sweep: its points, the out-of-fold choice of its value, and its plot (written)."""
    from jex.lab.experiment_stats import oof_choice, row_contributions

    metric = arms.test.metric
    sweeps: dict[str, SweepDoc] = {}
    for decl in (a for a in arms.arms if a.kind == "sweep"):
        points = [r for r in runs if r.sweep == decl.name]
        contrib = {r.value: row_contributions(table.rows, table.spec, predictions(r.run_dir), metric=metric)
                   for r in points}
        oof = oof_choice(row_contributions(table.rows, table.spec, base_preds, metric=metric), contrib,
                         folds=min(5, table.rows["question_id"].n_unique()))
        rows: list[SweepPoint] = [{"value": r.value, "name": r.name, "delta": entries[r.name]["delta"],
                                   "ci": entries[r.name]["ci"], "verdict": entries[r.name]["verdict"]}
                                  for r in points]
        plot = f"sweep-{decl.name}.png"
        sweep_plot(decl.name, decl.parameter or "", rows, oof, out / plot)
        sweeps[decl.name] = {"parameter": decl.parameter, "points": rows, "oof": oof, "plot": plot}
    return sweeps


def _panel(panel: PanelSpec, stats: Mapping[str, ArmStats]) -> PanelDoc:
    """Each arm's panel-scale delta and its projection onto the full index."""
    from jex.lab.experiment_stats import project

    shares = panel["shares"]
    return {"catalogs": list(shares), "share": sum(shares.values()), "asserted_share": panel.get("asserted_share"),
            "shares": dict(shares),
            "arms": {n: {"panel_delta": st.full.delta, "panel_ci": list(st.full.ci),
                         "projected": project(st, shares).to_json()} for n, st in stats.items()}}


__all__ = ["ArmRun", "RegisteredTest", "analyse", "arm_entry", "experiment_decisions", "experiment_ledger",
           "first_difference", "forest_plot", "register_experiment_test", "register_with_base", "render_report",
           "sweep_plot", "twin_audit", "verdict", "versus"]
