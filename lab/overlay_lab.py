"""Overlay research on a frozen capture: mining, the pre-registered test, the ladder, the disclosure.

Everything here reads a finished run folder (predictions + the bundle's rows) and never an engine.

- `mine`: per catalog, where are errors systematic? Gold-position against predicted-position
  distributions, and per-option threshold sweeps whose gain is measured out-of-fold (thresholds
  chosen on the other folds, by question).
- the pre-registered test (`overlay_test`, `jex overlays gate`): settings are written and hashed
  before any candidate is scored. A candidate passes only if (1) the paired clustered bootstrap
  interval of the full-index delta of its out-of-fold decisions lies above zero (each fold's
  threshold refitted on the other folds, folds by question, as the calibrate stage does; the
  in-sample interval is recorded beside it), (2) a permutation test gives p < alpha, and (3) no
  catalog but its target moves. The permutation null is that option position
  carries no information: each permutation shuffles the option positions of every row of the target
  catalog (probabilities, base choice and gold together), re-applies the rule and
  measures its gain; p = (1 + #{gain_perm >= gain}) / (1 + permutations).
- `ladder`: passing rules one flag at a time in declared order, every leave-one-out, and the base,
  with the reversibility and no-degrade checks asserted on every run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict, cast

import numpy as np
import polars as pl

from jex.errors import InputError
from jex.fileio import canonical_json, toml_tables_text, write_json
from jex.lab.experiment_report import register_with_base, stage_summaries
from jex.numerics import logit, named_rng, question_folds
from jex.overlays.apply import apply_overlays, no_degrade_check, reversibility_check
from jex.overlays.rules import IsotonicShrink, OverlayRuleBase
from jex.run_records import STAGES_FILE
from jex.settings import BOOTSTRAP_SEED
from jex.tasks.bundle.suite_table import ScoreSpec, load_suite_table
from jex.tasks.decisions import Decision, now
from jex.tasks.run_store import run_summaries
from jex.tasks.scoring.bootstrap_ci import paired_bootstrap_ci
from jex.tasks.scoring.index import catalog_chances, score_predictions, scored_frame


@dataclass(frozen=True)
class Capture:
    spec: ScoreSpec
    rows: pl.DataFrame  # run_id, catalog, question_id, gold, n_options
    base: pl.DataFrame  # rows + choice, probs, stage

    def full(self, choices: pl.Series) -> float:
        preds = pl.DataFrame({"run_id": self.base["run_id"], "choice": choices})
        return score_predictions(self.rows, preds, self.spec).full

    def skills(self, choices: pl.Series) -> dict[str, float]:
        """Each catalog's skill (chance-normalised accuracy), in index points (x 100)."""
        preds = pl.DataFrame({"run_id": self.base["run_id"], "choice": choices})
        return {c: 100 * v.skill for c, v in score_predictions(self.rows, preds, self.spec).catalogs.items()}


def load_capture(run_dir: str | Path) -> Capture:
    """A finished run's rows and predictions (its provenance names the bundle); errors name the file."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise InputError("expected a finished run folder (holds provenance.json and predictions.parquet)",
                         file=str(run_dir))
    summaries = run_summaries(run_dir)  # its store found wherever it lies now
    if summaries.bundle is None:
        raise InputError("no bundle stage recorded; expected a finished run", file=str(run_dir / STAGES_FILE))
    table = load_suite_table(summaries.bundle.bundle).multiple_choice()  # rules decide multiple-choice rows
    try:
        preds = pl.read_parquet(run_dir / "predictions.parquet")
    except (OSError, pl.exceptions.PolarsError) as e:
        raise InputError(f"unreadable ({str(e).splitlines()[0]})", file=str(run_dir / "predictions.parquet")) from None
    base = table.rows.join(preds, on="run_id", how="left", maintain_order="left")
    return Capture(table.spec.as_accuracy(), table.rows, base)  # rules change choices: tested on accuracy


def _oof_positional(frame: pl.DataFrame, index: int, folds: int = 5) -> tuple[np.ndarray, float]:
    """Choices with tau fitted on the other folds (by question), and tau fitted on all rows."""
    z = logit(np.array([ps[index] if ps is not None and index < len(ps) else np.nan
                        for ps in frame["probs"].to_list()]))
    gold, base = frame["gold"].to_numpy(), frame["choice"].to_numpy()
    fold = question_folds(frame["question_id"].to_list(), folds)

    def best_tau(mask: np.ndarray) -> float:
        grid = np.unique(np.nanquantile(z[mask], np.linspace(0, 1, 41))) if mask.any() else np.array([np.inf])
        scores = [(np.where(z[mask] >= t, index, base[mask]) == gold[mask]).mean() for t in grid]
        keep = (base[mask] == gold[mask]).mean()
        i = int(np.argmax(scores))
        return float(grid[i]) if scores[i] > keep else float("inf")

    out = base.copy()
    for k in range(folds):
        test = fold == k
        if test.any():
            tau = best_tau(~test)
            out[test] = np.where(z[test] >= tau, index, base[test])
    return out, best_tau(np.ones(len(z), dtype=bool))


class CatalogPositions(TypedDict):
    gold_position: list[int]  # rows per gold option index
    predicted_position: list[int]  # rows per chosen option index (no choice: not counted)
    acc: float


class _CandidateCore(TypedDict):
    catalog: str
    kind: str  # positional-threshold | isotonic-shrink
    oof_gain_full: float
    projection_class: str


class Candidate(_CandidateCore, total=False):
    """A mined rule with its out-of-fold gain and the parameters its kind takes."""

    label_index: int
    tau: float
    gold_share_at_index: float
    positive_index: int
    shrink: float
    folds: int


class MiningDoc(TypedDict):
    """`mining.json`."""

    base_full: float
    catalogs: dict[str, CatalogPositions]
    candidates: list[Candidate]  # best first


class _Checks(TypedDict):
    gain_full: float
    ci_full: list[float]
    checks: dict[str, bool]
    passed: bool


class RuleVerdict(_Checks):
    """One rule through the pre-registered test: out-of-fold numbers (what decides), in-sample ones beside them."""

    rule: dict[str, Any]  # the rule's parameters (`OverlayRuleBase.record`)
    fold_taus: list[Any]
    target_acc_gain: float
    permutation_p: float
    no_degrade_error: str | None
    in_sample: _Checks


class OverlayTestDoc(TypedDict):
    """`gate.json`: the pre-registered test's settings, their sha256 and each rule's verdict."""

    settings: dict[str, Any]
    settings_sha256: str
    results: list[RuleVerdict]
    passed: list[str]  # rule ids


class LadderStep(TypedDict, total=False):
    step: str
    rule: str
    target: str
    full: float


class LeaveOneOut(TypedDict):
    variant: str
    full: float


class LadderDoc(TypedDict):
    """`ladder.json`."""

    base_full: float
    steps: list[LadderStep]
    leave_one_out: list[LeaveOneOut]
    applied: Any
    catalogs_moved: list[str]
    catalogs_identical: int


def _rate(hits: pl.Series) -> float:
    """The mean of a boolean Series (polars types `mean()` as any scalar)."""
    return cast(float, hits.mean())


def mine(capture: Capture, *, folds: int = 5) -> MiningDoc:
    """Candidates per catalog with their out-of-fold gain, best first."""
    report: dict[str, CatalogPositions] = {}
    candidates: list[Candidate] = []
    base_full = capture.full(capture.base["choice"])
    for c in capture.spec.catalogs:
        f = capture.base.filter(pl.col("catalog") == c.id)
        k = int(cast(int, f["n_options"].max()))
        gold_pos = np.bincount(f["gold"].to_numpy(), minlength=k)
        pred_pos = np.bincount(f["choice"].fill_null(-1).to_numpy() + 1, minlength=k + 1)[1:]
        report[c.id] = {"gold_position": gold_pos.tolist(), "predicted_position": pred_pos.tolist(),
                        "acc": float(_rate(f["choice"] == f["gold"]))}
        for index in range(k):
            oof, tau = _oof_positional(f, index, folds)
            if not np.isfinite(tau):
                continue
            choices = capture.base["choice"].to_numpy().copy()
            choices[(capture.base["catalog"] == c.id).to_numpy()] = oof
            gain = capture.full(pl.Series(choices, dtype=pl.Int32)) - base_full
            if gain > 0:
                share = gold_pos[index] / gold_pos.sum()
                candidates.append({"catalog": c.id, "kind": "positional-threshold", "label_index": index,
                                   "tau": tau, "oof_gain_full": gain, "gold_share_at_index": float(share),
                                   "projection_class": "positional-construction-reuse"})
        if k == 2:
            rule = IsotonicShrink(id=f"iso-{c.id}", target=c.id, projection_class="fitted-on-public-oof")
            gain = capture.full(rule.apply(capture.base)) - base_full
            if gain > 0:
                candidates.append({"catalog": c.id, "kind": "isotonic-shrink", "positive_index": 0, "shrink": 0.75,
                                   "folds": 10, "oof_gain_full": gain, "projection_class": "fitted-on-public-oof"})
    candidates.sort(key=lambda x: -x["oof_gain_full"])
    return {"base_full": base_full, "catalogs": report, "candidates": candidates}


def candidate_rules_toml(candidates: list[Candidate], top: int = 5) -> str:
    """A rule file for the best candidates (a person keeps what the pre-registered test passed)."""
    rules = [{"id": f"M{i + 1}-{c['catalog']}", "kind": c["kind"], "target": c["catalog"],
              "projection_class": c["projection_class"], "enabled": True,
              **{k: v for k, v in c.items() if k in ("label_index", "tau", "positive_index", "shrink", "folds")}}
             for i, c in enumerate(candidates[:top])]
    return toml_tables_text("rules", rules)


@dataclass(frozen=True)
class OverlayTestSettings:
    """The overlay lab's pre-registered test (an overlay rule must pass it to be applied), as an
    experiment's arms are judged by theirs (`lab/arms.py: ExperimentTestSettings`)."""

    alpha: float = 0.05
    draws: int = 2000
    seed: int = BOOTSTRAP_SEED
    permutations: int = 200
    folds: int = 5
    """Question-grouped folds (crc32(question_id) % folds, as calibration) for the out-of-fold refit."""
    catalog_tolerance: float = 1.0
    """No-degrade: no catalog's skill may drop more than this (index points) under the rule."""

    def register(self, path: Path) -> str:
        """Write the settings before any candidate is scored; returns their sha256. Write-once: a folder
        registered with other settings is refused (a new test goes to another folder)."""
        if path.exists() and path.read_text() != canonical_json(asdict(self)):  # as `write_json` wrote it
            raise InputError("this folder holds a pre-registered test with other settings; write the new test to "
                             "another folder (settings are written once)", file=str(path))
        return write_json(path, asdict(self))


def degradation(capture: Capture, base: pl.DataFrame, overlaid: pl.DataFrame, rule: OverlayRuleBase,
                tolerance: float) -> str | None:
    """The seeds' no-degrade check of a rule as written: every other catalog bit-identical, and no
    catalog's skill (its target's included) dropping more than `tolerance` index points. None: it holds."""
    problems = []
    try:
        no_degrade_check(base, overlaid, targets={rule.target}, what=f"rule {rule.id!r}")
    except Exception as e:  # noqa: BLE001 - recorded as the failed check
        problems.append(str(e))
    before, after = capture.skills(base["choice"]), capture.skills(overlaid["choice"])
    drops = {c: after[c] - before[c] for c in before if after[c] - before[c] < -tolerance}
    if drops:
        problems.append(f"rule {rule.id!r} lowers the skill of " + ", ".join(
            f"catalog '{c}' by {-d:.2f} index points" for c, d in drops.items()) + f" (tolerance {tolerance})")
    return "; ".join(problems) or None


def _permuted(frame: pl.DataFrame, rng: np.random.Generator) -> pl.DataFrame:
    probs, gold, choice = [], [], []
    for ps, g, ch in zip(frame["probs"].to_list(), frame["gold"].to_list(), frame["choice"].to_list(), strict=True):
        k = len(ps) if ps is not None else 0
        if k == 0:
            probs.append(ps)
            gold.append(g)
            choice.append(ch)
            continue
        perm = rng.permutation(k)  # new position i shows old option perm[i]
        inv = np.argsort(perm)
        probs.append([ps[j] for j in perm])
        gold.append(int(inv[g]))
        choice.append(None if ch is None else int(inv[ch]))
    return frame.with_columns(pl.Series("probs", probs, dtype=pl.List(pl.Float64)),
                              pl.Series("gold", gold, dtype=pl.Int32), pl.Series("choice", choice, dtype=pl.Int32))


def out_of_fold_choices(rule: OverlayRuleBase, frame: pl.DataFrame, folds: int) -> tuple[np.ndarray, list[Any]]:
    """Choices for every row of `frame` with the rule refitted on the other folds of its target rows
    (folds by question); rows outside the target keep their choice. Returns them and each fold's tau."""
    choices = frame["choice"].to_numpy().copy()
    is_target = (frame["catalog"] == rule.target).to_numpy()
    target = frame.filter(pl.Series(is_target))
    if not target.height:
        return choices, []
    if rule.fits_out_of_fold:
        choices[is_target] = rule.decide(target).to_numpy()
        return choices, []
    fold = question_folds(target["question_id"].to_list(), folds)
    decided = target["choice"].to_numpy().copy()
    fitted = []
    for k in range(folds):
        test = fold == k
        if not test.any():
            continue
        train = target.filter(pl.Series(~test))
        refit = rule.fit(train) if train.height else rule
        decided[test] = refit.decide(target.filter(pl.Series(test))).to_numpy()
        fitted.append(getattr(refit, "tau", None))
    choices[is_target] = decided
    return choices, fitted


def _choice_rules_only(rules: list[OverlayRuleBase], what: str) -> None:
    for rule in rules:
        if rule.sets != "choice":
            raise InputError(f"rule {rule.id!r} ({rule.kind}) sets the '{rule.sets}' flag; {what} measures rules "
                             "that change choices (an abstention's effect is read in the campaign's score, per "
                             "catalog)", field="kind")


def overlay_test_rule(capture: Capture, rule: OverlayRuleBase, settings: OverlayTestSettings) -> RuleVerdict:
    """One rule through the pre-registered test. The interval is of the out-of-fold decisions
    (`out_of_fold_choices`), so a rule cannot pass on its own fit; the in-sample numbers are recorded beside them."""
    _choice_rules_only([rule], "the pre-registered test")
    base = capture.base
    new = rule.apply(base)
    overlaid = base.with_columns(new.alias("choice"))
    degrade = degradation(capture, base, overlaid, rule, settings.catalog_tolerance)
    oof, taus = out_of_fold_choices(rule, base, settings.folds)
    oof_choices = pl.Series("choice", oof, dtype=pl.Int32)
    frame_a = scored_frame(capture.rows, base.select("run_id", "choice"), capture.spec)
    frame_b = scored_frame(capture.rows, overlaid.select("run_id", "choice"), capture.spec)
    frame_oof = scored_frame(capture.rows, base.select("run_id").with_columns(oof_choices), capture.spec)
    chance = catalog_chances(frame_a, capture.spec)
    ci_in = paired_bootstrap_ci(frame_a, frame_b, capture.spec, chance, draws=settings.draws, seed=settings.seed)
    ci = paired_bootstrap_ci(frame_a, frame_oof, capture.spec, chance, draws=settings.draws, seed=settings.seed)
    base_full = capture.full(base["choice"])
    target = base.filter(pl.col("catalog") == rule.target)
    obs = float(_rate(rule.decide(target) == target["gold"]) - _rate(target["choice"] == target["gold"]))
    rng = named_rng(settings.seed, rule.id)
    null = []
    for _ in range(settings.permutations):
        t = _permuted(target, rng)
        null.append(float(_rate(rule.decide(t) == t["gold"]) - _rate(t["choice"] == t["gold"])))
    p = (1 + sum(g >= obs for g in null)) / (1 + settings.permutations)
    perm_ok = p < settings.alpha
    checks = {"ci_above_zero": ci["full"][0] > 0, "permutation_p_below_alpha": perm_ok, "no_degrade": degrade is None}
    in_checks = {"ci_above_zero": ci_in["full"][0] > 0, "permutation_p_below_alpha": perm_ok,
                 "no_degrade": degrade is None}
    return {"rule": rule.record(), "gain_full": capture.full(oof_choices) - base_full, "ci_full": ci["full"],
            "fold_taus": taus, "target_acc_gain": obs, "permutation_p": p, "no_degrade_error": degrade,
            "checks": checks, "passed": all(checks.values()),
            "in_sample": {"gain_full": capture.full(new) - base_full, "ci_full": ci_in["full"], "checks": in_checks,
                          "passed": all(in_checks.values())}}


def overlay_test(capture: Capture, rules: list[OverlayRuleBase], settings: OverlayTestSettings,
                 out_dir: Path) -> OverlayTestDoc:
    """The pre-registered test: register the settings, then score each rule; writes gate-settings.json and
    gate.json."""
    sha = settings.register(out_dir / "gate-settings.json")
    results = [overlay_test_rule(capture, r, settings) for r in rules]
    doc: OverlayTestDoc = {"settings": asdict(settings), "settings_sha256": sha, "results": results,
           "passed": [r["rule"]["id"] for r in results if r["passed"]]}
    write_json(out_dir / "gate.json", doc)
    return doc


def gate_decisions(doc: OverlayTestDoc, rules: list[OverlayRuleBase], run_dir: Path, *, source: Path,
                   model_name: str | None = None, model_params: float | None = None) -> list[Decision]:
    """One ledger decision per tested rule (PASS / FAIL), naming the rule's hash, the run's suite (bundle)
    and capture (fast pass): what a campaign's overlay gate looks for before it applies the rule."""
    registered = register_with_base(doc["settings_sha256"], run_dir, model_name=model_name, model_params=model_params)
    capture = stage_summaries(run_dir).fast_pass.sha256
    by_id = {r.id: r for r in rules}
    return [Decision(kind="overlay-rule", subject=r["rule"]["id"], status="PASS" if r["passed"] else "FAIL",
                     source=str(source.resolve()), date=now(), gate_sha256=registered.sha256,
                     settings_sha256=doc["settings_sha256"], suite_sha256=registered.suite_sha256,
                     model=registered.model, model_name=model_name, model_params=model_params,
                     effect=r["gain_full"], ci=list(r["ci_full"]), p=r["permutation_p"],
                     rule_sha256=by_id[r["rule"]["id"]].sha256(), capture_sha256=capture,
                     hypothesis=f"{r['rule']['kind']} on {r['rule']['target']}",
                     reopen_when="the suite or the capture changes")
            for r in doc["results"]]


def ladder(capture: Capture, rules: list[OverlayRuleBase]) -> LadderDoc:
    """Base, each step in declared order, every leave-one-out; reversibility and no-degrade asserted."""
    _choice_rules_only(rules, "the ladder")
    base = capture.base.with_columns(stage=pl.lit("base"))
    off, _ = apply_overlays(base, [])
    reversibility_check(base, off)
    base_full = capture.full(base["choice"])
    if capture.full(off["choice"]) != base_full:
        raise AssertionError("all flags off must give the base score bit-exactly")
    steps: list[LadderStep] = [{"step": "base", "full": base_full}]
    current: list[OverlayRuleBase] = []
    for r in rules:
        current.append(r)
        frame, _ = apply_overlays(base, current)
        steps.append({"step": f"+{r.id}", "rule": r.id, "target": r.target, "full": capture.full(frame["choice"])})
    frame, applied = apply_overlays(base, rules)
    no_degrade_check(base, frame, targets={r.target for r in rules})
    loo: list[LeaveOneOut] = [
        {"variant": f"no {r.id}", "full": capture.full(apply_overlays(base, [x for x in rules if x is not r])[0]
                                                        ["choice"])} for r in rules]
    moved = sorted(set(frame.filter(pl.col("choice").ne_missing(base["choice"]))["catalog"].to_list()))
    return {"base_full": base_full, "steps": steps, "leave_one_out": loo, "applied": applied,
            "catalogs_moved": moved, "catalogs_identical": len(capture.spec.catalogs) - len(moved)}


CLASS_SENTENCES = {
    "positional-construction-reuse": "It exploits the option position the public construction assigns the correct "
    "answer: a public-suite projection; on a private re-run whose construction is not a twin of the public one its "
    "effect is unverifiable.",
    "fitted-on-public-oof": "It is fitted on public data out-of-fold: an in-sample-family fit that may regress toward "
    "the base rate on a private panel.",
}


def disclosure(ladder_doc: LadderDoc, rules: list[OverlayRuleBase]) -> str:
    """The disclosure sheet: each overlay's class, target, rule and gain; the ladder and leave-one-outs."""
    gains = {s["rule"]: s["full"] - prev["full"] for prev, s in zip(ladder_doc["steps"], ladder_doc["steps"][1:],
                                                                     strict=False)}
    lines = ["# Overlay disclosure sheet", "",
             f"Base {ladder_doc['base_full']:.4f}; with every overlay {ladder_doc['steps'][-1]['full']:.4f}. "
             f"Catalogs moved: {', '.join(ladder_doc['catalogs_moved']) or 'none'}; "
             f"{ladder_doc['catalogs_identical']} others bit-identical. Every overlay is one flag: turning all off "
             "gives the base back exactly.", "",
             "| overlay | class | target | rule | gain (index) |", "|---|---|---|---|---:|"]
    for r in rules:
        lines.append(f"| {r.id} | {r.projection_class} | {r.target} | {r.describe()} | {gains[r.id]:+.4f} |")
    lines += [""] + [f"- **{r.id}**: {CLASS_SENTENCES[r.projection_class]}" for r in rules]
    lines += ["", "## Ladder", "", "| step | full index |", "|---|---:|"]
    lines += [f"| {s['step']} | {s['full']:.4f} |" for s in ladder_doc["steps"]]
    lines += ["", "| leave-one-out | full index |", "|---|---:|"]
    lines += [f"| {v['variant']} | {v['full']:.4f} |" for v in ladder_doc["leave_one_out"]]
    return "\n".join(lines) + "\n"
