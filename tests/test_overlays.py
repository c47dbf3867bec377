"""Overlay rules on hand-computed cases; the pre-registered test, the ladder, no-degrade and reversibility."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from jex.errors import InputError
from jex.lab.overlay_lab import (
    Capture,
    OverlayTestSettings,
    disclosure,
    ladder,
    mine,
    overlay_test,
    overlay_test_rule,
)
from jex.overlays import IsotonicShrink, PositionalThreshold, SignedLogitThreshold, load_rule_file
from jex.overlays.apply import NoDegradeViolation, apply_overlays, no_degrade_check
from jex.overlays.rules import isotonic_apply, isotonic_fit
from jex.tasks.bundle.suite_table import CatalogSpec, ScoreSpec


def frame(probs, choice, gold=None, catalog="c"):
    n = len(probs)
    return pl.DataFrame({"run_id": [f"r{i}" for i in range(n)], "catalog": [catalog] * n,
                         "question_id": [f"q{i}" for i in range(n)], "choice": choice,
                         "gold": gold if gold is not None else [0] * n, "probs": probs, "stage": ["base"] * n},
                        schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                "choice": pl.Int32, "gold": pl.Int32, "probs": pl.List(pl.Float64),
                                "stage": pl.String})


def test_positional_threshold_by_hand():
    # logit(0.3) = -0.847, logit(0.05) = -2.944: tau = -2 fires on the first row only
    f = frame([[0.3, 0.7], [0.95, 0.05]], [1, 0])
    rule = PositionalThreshold(id="p", target="c", projection_class="positional-construction-reuse",
                               label_index=0, tau=-2.0)
    assert rule.decide(f).to_list() == [0, 0]
    rule1 = PositionalThreshold(id="p", target="c", projection_class="positional-construction-reuse",
                                label_index=1, tau=math.log(0.05 / 0.95))  # exactly at the threshold: fires
    assert rule1.decide(f).to_list() == [1, 1]


def test_signed_logit_threshold_both_directions():
    f = frame([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]], [1, 0])
    above = SignedLogitThreshold(id="s", target="c", projection_class="fitted-on-public-oof", option_index=2,
                                 tau=-1.0, direction="above")  # logit(0.3) = -0.85 >= -1
    assert above.decide(f).to_list() == [2, 2]
    below = SignedLogitThreshold(id="s", target="c", projection_class="fitted-on-public-oof", option_index=0,
                                 tau=-1.0, direction="below")  # logit(0.2) = -1.39 < -1: best other = 1
    assert below.decide(f).to_list() == [1, 0]


def test_isotonic_fit_pools_violators():
    right, values = isotonic_fit(np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.0, 1.0, 0.0, 1.0]))
    assert values.tolist() == [0.0, 0.5, 1.0] and right.tolist() == [0.1, 0.3, 0.4]
    assert isotonic_apply((right, values), np.array([0.05, 0.25, 0.9])).tolist() == [0.0, 0.5, 1.0]


def test_isotonic_fit_pools_ties_first_so_row_order_does_not_matter():
    x = np.array([0.2, 0.5, 0.5, 0.8])
    a = isotonic_fit(x, np.array([0.0, 0.0, 1.0, 1.0]))
    b = isotonic_fit(x, np.array([0.0, 1.0, 0.0, 1.0]))  # the same points, the tied rows swapped
    assert a[0].tolist() == b[0].tolist() == [0.2, 0.5, 0.8] and a[1].tolist() == b[1].tolist() == [0.0, 0.5, 1.0]
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 5, 60) / 4, rng.integers(0, 2, 60).astype(float)
    order = rng.permutation(60)
    shuffled = isotonic_fit(x[order], y[order])
    direct = isotonic_fit(x, y)
    assert shuffled[0].tolist() == direct[0].tolist() and shuffled[1].tolist() == direct[1].tolist()


def test_isotonic_shrink_is_out_of_fold_and_thresholds_at_half():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 400)
    gold = (rng.uniform(0, 1, 400) < 0.2).astype(int)  # option 0 is the positive; it is mostly wrong
    gold = np.where(gold == 1, 0, 1)
    f = frame([[x, 1 - x] for x in p], [0 if x >= 0.5 else 1 for x in p], gold.tolist())
    rule = IsotonicShrink(id="i", target="c", projection_class="fitted-on-public-oof", positive_index=0, shrink=1.0,
                          folds=5)
    q = rule.calibrated(f)
    assert np.all((q >= 0) & (q <= 1))
    new = rule.decide(f).to_numpy()
    assert (new == gold).mean() > (f["choice"].to_numpy() == gold).mean()  # the map learned "rarely positive"


def test_apply_touches_only_the_target_and_records_the_stage():
    other = frame([[0.4, 0.6]], [1], catalog="other").with_columns(run_id=pl.lit("o"))
    f = pl.concat([frame([[0.4, 0.6]], [1]), other])
    rule = PositionalThreshold(id="p", target="c", projection_class="positional-construction-reuse",
                               label_index=0, tau=-5)
    out, rec = apply_overlays(f, [rule])
    assert out["choice"].to_list() == [0, 1] and out["stage"].to_list() == ["overlay:p", "base"]
    assert rec[0]["changed"] == 1 and rec[0]["tau"] == -5


def test_no_degrade_names_catalog_and_rows():
    base = pl.DataFrame({"run_id": ["a", "b", "c"], "catalog": ["t", "x", "x"], "choice": [0, 0, 1]})
    moved = base.with_columns(choice=pl.Series([1, 1, 1]))
    with pytest.raises(NoDegradeViolation, match=r"catalog 'x': 1 rows \(first: \['b'\]\)"):
        no_degrade_check(base, moved, targets={"t"})


# --- a small capture: catalog 'pos' puts gold at option 3, the model prefers option 2 -------------------------

@pytest.fixture
def capture():
    rng = np.random.default_rng(4)
    rows, probs, choice = [], [], []
    for cat, n in (("pos", 80), ("other", 80)):
        for i in range(n):
            gold = 3 if (cat == "pos" and rng.uniform() < 0.85) else int(rng.integers(0, 4))
            p = rng.dirichlet([1, 1, 4, 1 + 2 * (gold == 3 and cat == "pos")])
            rows.append({"run_id": f"{cat}{i}", "catalog": cat, "question_id": f"{cat}q{i}", "gold": gold,
                         "n_options": 4})
            probs.append(p.tolist())
            choice.append(int(np.argmax(p)))
    rows_df = pl.DataFrame(rows, schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                         "gold": pl.Int32, "n_options": pl.Int32})
    base = rows_df.with_columns(pl.Series("choice", choice, dtype=pl.Int32),
                                pl.Series("probs", probs, dtype=pl.List(pl.Float64)), stage=pl.lit("base"))
    spec = ScoreSpec(legs={"L": 1.0}, catalogs=(CatalogSpec("pos", "L", 1.0, None), CatalogSpec("other", "L", 1.0,
                                                                                                 None)))
    return Capture(spec, rows_df, base)


def test_mining_finds_the_positional_rule(capture):
    doc = mine(capture)
    best = doc["candidates"][0]
    assert (best["catalog"], best["kind"], best["label_index"]) == ("pos", "positional-threshold", 3)
    assert doc["catalogs"]["pos"]["gold_position"][3] > 60 and best["oof_gain_full"] > 0


def _rule(**kw):
    return PositionalThreshold(**{"id": "R", "target": "pos", "projection_class": "positional-construction-reuse",
                                  "label_index": 3, "tau": -3.0, **kw})


def test_the_preregistered_test_passes_the_positional_rule_and_registers_settings_first(capture, tmp_path):
    doc = overlay_test(capture, [_rule()], OverlayTestSettings(draws=300, permutations=99), tmp_path)
    r = doc["results"][0]
    assert r["passed"] and r["ci_full"][0] > 0 and r["permutation_p"] < 0.05
    assert (tmp_path / "gate-settings.json").exists() and len(doc["settings_sha256"]) == 64


def test_planted_harmful_rule_fails_the_preregistered_test(capture, tmp_path):
    harmful = _rule(id="H", label_index=0, tau=-6.0)  # emit option 0 nearly always: gold is at 3
    r = overlay_test(capture, [harmful], OverlayTestSettings(draws=300, permutations=99), tmp_path)["results"][0]
    assert not r["passed"] and not r["in_sample"]["checks"]["ci_above_zero"] and r["in_sample"]["gain_full"] < 0


class LeakyPositional(PositionalThreshold):
    """A buggy rule: decides every row, not only its target's."""

    def apply(self, frame):
        return self.decide(frame)


def test_planted_rule_touching_a_second_catalog_fails_no_degrade(capture, tmp_path):
    leaky = LeakyPositional(id="L", target="pos", projection_class="positional-construction-reuse", label_index=3,
                            tau=-3.0)
    r = overlay_test(capture, [leaky], OverlayTestSettings(draws=100, permutations=19), tmp_path)["results"][0]
    assert not r["passed"] and "catalog 'other'" in r["no_degrade_error"]
    with pytest.raises(NoDegradeViolation, match="catalog 'other'"):
        ladder(capture, [leaky])


def test_ladder_leave_one_out_reversibility_and_disclosure(capture):
    a, b = _rule(id="A"), _rule(id="B", label_index=2, tau=10.0)  # B never fires
    doc = ladder(capture, [a, b])
    base, step_a, step_b = (s["full"] for s in doc["steps"])
    assert base == capture.full(capture.base["choice"])  # all flags off: the base, bit-exactly
    assert step_a > base and step_b == step_a
    assert [v["variant"] for v in doc["leave_one_out"]] == ["no A", "no B"]
    assert doc["leave_one_out"][0]["full"] == base and doc["catalogs_moved"] == ["pos"]
    sheet = disclosure(doc, [a, b])
    assert "positional-construction-reuse" in sheet and "public-suite projection" in sheet


def test_rule_file_errors_are_located(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('[[rules]]\nid = "x"\nkind = "nope"\ntarget = "c"\nprojection_class = "fitted-on-public-oof"\n')
    with pytest.raises(InputError, match="unknown kind 'nope'") as e:
        load_rule_file(f)
    assert e.value.row == 0
    f.write_text('[[rules]]\nid = "x"\nkind = "positional-threshold"\ntarget = "c"\nprojection_class = "guess"\n')
    with pytest.raises(InputError, match="projection_class"):
        load_rule_file(f)


def noise_capture(seed: int, n: int = 200) -> Capture:
    """Gold drawn independently of the probabilities: no rule can have a real gain here."""
    rng = np.random.default_rng(seed)
    rows, probs, choice = [], [], []
    for cat in ("noise", "other"):
        for i in range(n):
            p = rng.dirichlet([1, 1])
            rows.append({"run_id": f"{cat}{i}", "catalog": cat, "question_id": f"{cat}q{i}",
                         "gold": int(rng.integers(0, 2)), "n_options": 2})
            probs.append(p.tolist())
            choice.append(int(np.argmax(p)))
    rows_df = pl.DataFrame(rows, schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                         "gold": pl.Int32, "n_options": pl.Int32})
    base = rows_df.with_columns(pl.Series("choice", choice, dtype=pl.Int32),
                                pl.Series("probs", probs, dtype=pl.List(pl.Float64)), stage=pl.lit("base"))
    spec = ScoreSpec(legs={"L": 1.0}, catalogs=(CatalogSpec("noise", "L", 1.0, None),
                                                CatalogSpec("other", "L", 1.0, None)))
    return Capture(spec, rows_df, base)


def test_a_rule_fitted_to_in_sample_noise_fails_the_out_of_fold_test():
    # seed 6: the in-sample best threshold on option 1 happens to pass the in-sample interval and the
    # permutation test (found by scanning seeds 0-39; 3 of 80 noise fits passed in-sample)
    capture = noise_capture(6)
    target = capture.base.filter(pl.col("catalog") == "noise")
    rule = PositionalThreshold(id="N", target="noise", projection_class="positional-construction-reuse",
                               label_index=1, tau=0.0).fit(target)  # the threshold fitted on all rows
    r = overlay_test_rule(capture, rule, OverlayTestSettings(draws=300, permutations=99))
    assert r["in_sample"]["passed"] and r["in_sample"]["ci_full"][0] > 0  # an in-sample test would pass it
    assert not r["passed"] and r["ci_full"][0] < 0 < r["ci_full"][1]  # its out-of-fold decisions do not
    assert len(r["fold_taus"]) == 5 and len(set(r["fold_taus"])) > 1  # one threshold refitted per fold


def test_refit_keeps_the_declared_threshold_on_a_tie():
    frame = pl.DataFrame({"choice": [0, 0], "gold": [0, 0], "probs": [[0.9, 0.1], [0.8, 0.2]]},
                         schema={"choice": pl.Int32, "gold": pl.Int32, "probs": pl.List(pl.Float64)})
    rule = PositionalThreshold(id="T", target="t", projection_class="positional-construction-reuse",
                               label_index=1, tau=5.0)
    assert rule.fit(frame).tau == 5.0  # never firing is already best: the declared tau stays


def test_abstain_below_flags_only_the_targets_unsure_rows_and_keeps_every_choice():
    from jex.overlays import AbstainBelow

    f = pl.concat([frame([[0.4, 0.35, 0.25], [0.9, 0.1, 0.0]], [0, 0]),
                   frame([[0.3, 0.3, 0.4]], [2], catalog="other").with_columns(run_id=pl.lit("o0"))])
    rule = AbstainBelow(id="u", target="c", projection_class="fitted-on-public-oof", p_min=0.5)
    out, applied = apply_overlays(f, [rule])
    assert out["abstain"].to_list() == [True, False, False]  # 'other' is below 0.5 too, but not the target
    assert out["choice"].to_list() == f["choice"].to_list() and out["stage"].to_list() == ["base"] * 3
    assert applied[0]["changed"] == 1
    with pytest.raises(NoDegradeViolation, match="catalog 'other'"):
        no_degrade_check(f, out.with_columns(abstain=pl.Series([True, False, True])), targets={"c"})


def test_the_preregistered_test_and_the_ladder_refuse_a_rule_that_sets_abstain(capture):
    from jex.overlays import AbstainBelow

    rule = AbstainBelow(id="u", target="pos", projection_class="fitted-on-public-oof")
    with pytest.raises(InputError, match="sets the 'abstain' flag; the pre-registered test"):
        overlay_test_rule(capture, rule, OverlayTestSettings(draws=10, permutations=10))
    with pytest.raises(InputError, match="sets the 'abstain' flag; the ladder"):
        ladder(capture, [rule])


# --- the binding gate: no-degrade as the seeds had it, settings written once, campaigns refuse ungated rules ---

def test_no_degrade_fails_a_rule_that_lowers_a_catalogs_skill_and_passes_a_helpful_one(capture, tmp_path):
    """Rules write only their target's rows, so 'other catalogs bit-identical' alone cannot fail; the check
    also refuses any catalog (the target's included) losing skill beyond the tolerance."""
    degrading = _rule(id="D", label_index=0, tau=-6.0)  # emit option 0 nearly always: gold is at 3
    settings = OverlayTestSettings(draws=100, permutations=19, catalog_tolerance=1.0)
    doc = overlay_test(capture, [degrading, _rule(id="R")], settings, tmp_path)
    bad, good = doc["results"]
    assert bad["checks"]["no_degrade"] is False and "lowers the skill of catalog 'pos'" in bad["no_degrade_error"]
    assert "catalog 'other'" not in bad["no_degrade_error"]  # the other catalog stayed bit-identical
    assert good["checks"]["no_degrade"] is True and good["no_degrade_error"] is None


def test_the_gate_settings_are_written_once(capture, tmp_path):
    OverlayTestSettings(draws=100, permutations=19).register(tmp_path / "gate-settings.json")
    OverlayTestSettings(draws=100, permutations=19).register(tmp_path / "gate-settings.json")  # the same: fine
    with pytest.raises(InputError, match="other settings"):
        overlay_test(capture, [_rule()], OverlayTestSettings(draws=100, permutations=19, alpha=0.2), tmp_path)


def test_the_ledger_gate_check_needs_a_pass_of_the_rules_hash_on_the_suite_and_capture():
    from jex.tasks.decisions import Decision, ungated_rules

    rule = _rule()
    passed = Decision(kind="overlay-rule", subject="R", status="PASS", source="/g", date="d", rule_sha256=rule.sha256(),
                      suite_sha256="s1", capture_sha256="c1")
    ids = [("R", rule.sha256())]
    assert ungated_rules([passed], ids, suite_sha256="s1", capture_sha256="c1") == []
    assert ungated_rules([passed], ids, suite_sha256="s1") == []  # before the fast pass: the suite alone
    assert "another capture" in ungated_rules([passed], ids, suite_sha256="s1", capture_sha256="c2")[0]
    assert "another suite" in ungated_rules([passed], ids, suite_sha256="s2")[0]
    assert "no gate record" in ungated_rules([passed], [("R", _rule(tau=-2.0).sha256())], suite_sha256="s1")[0]
    failed = passed.model_copy(update={"status": "FAIL"})
    assert "['FAIL']" in ungated_rules([failed], ids, suite_sha256="s1")[0]
    assert _rule(enabled=False).sha256() == rule.sha256()  # the flag is not the rule


def test_unverified_overlays_mark_the_rows_they_decide_and_their_records(tmp_path):
    from jex.tasks.decision_stages import overlay_stage
    from jex.tasks.inputs import OverlayInputs
    from jex.tasks.records import CalibrateSummary
    from jex.tasks.store import LocalStore

    frame = pl.DataFrame({"run_id": ["a", "b"], "catalog": ["pos", "other"], "choice": [0, 1], "folded": [False, True],
                          "calibrated_logprobs": [[-3.0, -3.0, -3.0, -0.2], [-0.5, -1.0, -3.0, -3.0]]},
                         schema_overrides={"choice": pl.Int32})
    frame.write_parquet(tmp_path / "calibrated.parquet")
    calibrated = CalibrateSummary(key="k", sha256="ab" * 32, calibrated=str(tmp_path / "calibrated.parquet"),
                                  calibration_json="")
    store = LocalStore(tmp_path / "store")
    inputs = OverlayInputs(calibrated=calibrated, rules=[_rule()])
    marked = overlay_stage(store, inputs.model_copy(update={"unverified": True}))
    plain = overlay_stage(store, inputs)
    assert marked.key != plain.key
    assert pl.read_parquet(marked.predictions)["stage"].to_list() == ["overlay-unverified:R", "fold"]
    assert pl.read_parquet(plain.predictions)["stage"].to_list() == ["overlay:R", "fold"]
    assert marked.applied[0]["unverified"] is True and "unverified" not in plain.applied[0]


@pytest.mark.slow
def test_a_campaign_refuses_an_ungated_rule_file_before_any_engine_stage(tmp_path, prefect_harness):
    from jex.errors import FlowError
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nid = "R"\nkind = "positional-threshold"\ntarget = "arith"\n'
                     'projection_class = "positional-construction-reuse"\nlabel_index = 0\ntau = -1.0\n')
    spec = CampaignSpec(sample_rows=18, overlays=str(rules), store=str(tmp_path / "store"), out=str(tmp_path),
                        machines=MachinesSpec(provider="inprocess"))
    with pytest.raises(FlowError, match="not gated for this suite.*rule 'R': no gate record.*--unverified-overlays"):
        campaign(spec)
    assert not (tmp_path / "store" / "fast_pass").exists()  # refused before any engine stage
