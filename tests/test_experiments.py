"""Experiments: arms files, paired statistics, the pre-registered test, the ledger, sweeps, panels, and one
end-to-end run.

Most tests are fast: statistics on suites made in the test, checked against plain loops. One module
fixture runs a whole experiment (render arm, system-prompt arm, placebo, twin, fold-weight sweep) on
the embedded sample with the embedded model; the slow tests read what it wrote.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from jex.errors import InputError
from jex.lab.arms import parse_arms
from jex.lab.experiment_stats import (
    arm_rng,
    oof_choice,
    paired_arms,
    panel_share,
    row_contributions,
    versus,
)
from jex.tasks.bundle.suite_table import load_suite_table
from jex.tasks.scoring.index import aggregate, catalog_chances, score_predictions, scored_frame
from tests.conftest import row, write_suite

GOOD = '''
[gate]
placebo = "reworded"

[[arms]]
name = "system"
[arms.render]
system_prompt = "Be careful."

[[arms]]
name = "reworded"
kind = "placebo"
[arms.render]
question_template = "{prompt}\\n\\n{options}\\n\\nReply with a letter."

[[arms]]
name = "twin"
kind = "twin"

[[arms]]
name = "fw"
kind = "sweep"
parameter = "fold_weight"
grid = [0.25, 1.0]
'''


# ---------------------------------------------------------------- arms files

def test_a_good_arms_file_parses_into_arms_and_sweep_points():
    arms = parse_arms(GOOD)
    assert [a.name for a in arms.arms] == ["system", "reworded", "twin", "fw"]
    assert arms.test.placebo == "reworded"
    assert [n for n, _ in arms.arm("fw").points()] == ["fw@0.25", "fw@1.0"]
    assert arms.arm("fw").points()[1][1].campaign == {"fold_weight": 1.0}


@pytest.mark.parametrize(("text", "arm", "field"), [
    ('[[arms]]\nname = "a"\ntemperature = 0.7\n', "a", "temperature"),
    ('[[arms]]\nname = "a"\n[arms.render]\nlabel_colour = "red"\n', "a", "render.label_colour"),
    ('[[arms]]\nname = "a"\nfold_weight = 0.2\n[[arms]]\nname = "a"\nfold_weight = 0.3\n', "a", "name"),
    ('[[arms]]\nname = "s"\nkind = "sweep"\nparameter = "fold_weight"\n', "s", "grid"),
    ('[[arms]]\nname = "s"\nkind = "sweep"\nparameter = "fold_weight"\ngrid = []\n', "s", "grid"),
    ('[[arms]]\nname = "p"\nkind = "placebo"\n[arms.render]\nanswer_slot = "Reply:"\n', "p", "render.answer_slot"),
    ('[[arms]]\nname = "p"\nkind = "placebo"\nfold_weight = 0.9\n', "p", "fold_weight"),
    ('[[arms]]\nname = "t"\nkind = "twin"\nmodel = "other.gguf"\n', "t", "model"),
    ('[[arms]]\nname = "r"\n[arms.render]\nquestion_template = "{options} only"\n', "r", "render.question_template"),
])
def test_a_bad_arms_file_names_the_arm_and_the_field(text, arm, field):
    with pytest.raises(InputError) as err:
        parse_arms(text, path="bad.toml")
    assert err.value.field == field and err.value.file == "bad.toml"
    assert f"arm '{arm}'" in str(err.value) and field in str(err.value)


def test_a_bad_arms_file_fails_in_the_cli_before_any_engine_or_prefect_starts(tmp_path):
    from typer.testing import CliRunner

    from jex.cli import app
    from jex.tasks.execution.engine_pool import CALLS

    bad = tmp_path / "arms.toml"
    bad.write_text('[[arms]]\nname = "p"\nkind = "placebo"\n[arms.render]\nanswer_slot = "Reply:"\n')
    before = dict(CALLS)
    result = CliRunner().invoke(app, ["experiment", "run", "--arms", str(bad), "-o", str(tmp_path / "out"),
                                      "--sample-rows", "18", "--provider", "inprocess"])
    assert result.exit_code == 1
    assert "arm 'p'" in result.output and "render.answer_slot" in result.output and str(bad) in result.output
    assert dict(CALLS) == before and not (tmp_path / "out" / "runs").exists()


def test_a_derived_arm_with_a_bad_campaign_value_names_the_arm(tmp_path):
    from jex.flows.lab import ExperimentSpec, plan_experiment
    from jex.tasks.campaign_spec import CampaignSpec

    spec = ExperimentSpec(campaign=CampaignSpec(sample_rows=18, store=str(tmp_path / "s")), out=str(tmp_path),
                          arms_toml='[[arms]]\nname = "big"\nfold_weight = 1.5\n', arms_path="a.toml")
    with pytest.raises(InputError, match="arm 'big'") as err:
        plan_experiment(spec)
    assert err.value.field == "fold_weight"


def test_the_default_render_fingerprint_is_unchanged_by_the_option_order_field():
    import hashlib

    from jex.engine_spec import RenderSpec

    doc = RenderSpec().model_dump(mode="json")
    del doc["option_order_seed"]
    assert RenderSpec().digest()["sha256"] == hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
    assert RenderSpec(option_order_seed=3).digest() != RenderSpec().digest()


def test_shuffled_options_are_shown_in_a_seeded_order_and_restored():
    from jex.engine.render import option_order
    from jex.engine.types import Readout, ReadoutMode
    from jex.engine_spec import RenderSpec
    from jex.tasks.capture.engine_calls import _restored, _shown, as_row

    spec = RenderSpec(option_order_seed=7)
    r = as_row({"run_id": "q1", "prompt": "?", "labels": list("ABCD"), "options": ["w", "x", "y", "z"]})
    order = option_order(spec, "q1", 4)
    assert sorted(order) == [0, 1, 2, 3] and order == option_order(spec, "q1", 4)
    shown = _shown(spec, r)
    assert shown == [r.options[j] for j in order]
    # the engine reads the shown options; the option shown at position i is option order[i]
    read = Readout("q1", tuple(float(-ord(o)) for o in shown), None, 0.9, ReadoutMode.LABEL_SLOT)
    (back,) = _restored(spec, [read])
    assert back.logprobs == tuple(float(-ord(o)) for o in r.options)
    assert _shown(RenderSpec(), r) == r.options


# ---------------------------------------------------------------- paired statistics

@pytest.fixture(scope="module")
def small_suite(tmp_path_factory):
    rng = random.Random(3)
    rows = {}
    for cid, k in (("c1", 4), ("c2", 2), ("c3", 3)):
        rows[cid] = [row(f"{cid}-{i}", cid, q=f"{cid}-q{i // 2}", k=k, gold=rng.randrange(k)) for i in range(24)]
    root = write_suite(tmp_path_factory.mktemp("exp") / "suite", rows, legs={"A": 0.6, "B": 0.4},
                       catalogs=[{"id": "c1", "leg": "A"}, {"id": "c2", "leg": "A", "weight": 2.0},
                                 {"id": "c3", "leg": "B"}])
    return load_suite_table(root)


def _preds(table, *, p_right: float, seed: int, first: bool = False) -> pl.DataFrame:
    """Choices right with probability p_right (else a wrong option); `first`: always label 0."""
    rng = random.Random(seed)
    out = []
    for rid, gold, k in table.rows.select("run_id", "gold", "n_options").iter_rows():
        ch = 0 if first else gold if rng.random() < p_right else (gold + 1 + rng.randrange(k - 1)) % k
        out.append({"run_id": rid, "choice": ch, "probs": None})
    return pl.DataFrame(out, schema={"run_id": pl.String, "choice": pl.Int32, "probs": pl.List(pl.Float64)})


def _loop_deltas(table, base, arm, *, draws, seed):
    """Plain loop: for each draw, resample each catalog's question clusters (the same generator calls
    as the bootstrap), count hits and rows by hand, and aggregate both sets into full indices."""
    spec = table.spec
    frames = [scored_frame(table.rows, p, spec) for p in (base, arm)]
    chance = catalog_chances(frames[0], spec)
    out = []
    picks = {}
    clusters = {}
    for c in spec.catalogs:
        sub = frames[0].filter(pl.col("catalog") == c.id)
        qids = sorted(set(sub["question_id"].to_list()))
        clusters[c.id] = qids
        gen = np.random.default_rng([seed, zlib.crc32(c.id.encode())])
        picks[c.id] = []
        for start in range(0, draws, 128):
            picks[c.id].extend(gen.integers(0, len(qids), size=(min(128, draws - start), len(qids))).tolist())
    hits = [{(r["catalog"], r["question_id"]): 0 for r in frames[0].iter_rows(named=True)} for _ in frames]
    size = {}
    for s, f in enumerate(frames):
        for r in f.iter_rows(named=True):
            hits[s][(r["catalog"], r["question_id"])] += int(r["correct"])
            if s == 0:
                size[(r["catalog"], r["question_id"])] = size.get((r["catalog"], r["question_id"]), 0) + 1
    for b in range(draws):
        fulls = []
        for s in range(2):
            acc = {}
            for c in spec.catalogs:
                h = n = 0
                for i in picks[c.id][b]:
                    key = (c.id, clusters[c.id][i])
                    h += hits[s][key]
                    n += size[key]
                acc[c.id] = h / n
            fulls.append(aggregate(spec, acc, chance)[0])
        out.append(fulls[1] - fulls[0])
    return out


def test_paired_deltas_agree_with_a_plain_loop_over_draws(small_suite):
    base, arm = _preds(small_suite, p_right=0.5, seed=1), _preds(small_suite, p_right=0.7, seed=2)
    _, stats = paired_arms(small_suite.rows, small_suite.spec, base, {"arm": arm}, draws=300, seed=11,
                           permutations=50)
    loop = _loop_deltas(small_suite, base, arm, draws=300, seed=11)
    np.testing.assert_allclose(stats["arm"].draws["full"], loop, rtol=0, atol=1e-12)
    lo, hi = np.percentile(loop, [2.5, 97.5])
    assert abs(stats["arm"].full.ci[0] - lo) < 1e-12 and abs(stats["arm"].full.ci[1] - hi) < 1e-12
    point = score_predictions(small_suite.rows, arm, small_suite.spec).full - \
        score_predictions(small_suite.rows, base, small_suite.spec).full
    assert stats["arm"].full.delta == point


def test_the_permutation_p_agrees_with_swapping_predictions_question_by_question(small_suite):
    base, arm = _preds(small_suite, p_right=0.45, seed=5), _preds(small_suite, p_right=0.6, seed=6)
    perms = 60
    _, stats = paired_arms(small_suite.rows, small_suite.spec, base, {"arm": arm}, draws=20, seed=9,
                           permutations=perms)
    # the same sign matrix, applied by swapping whole question clusters and scoring from scratch
    clusters = [(c.id, q) for c in small_suite.spec.catalogs
                for q in sorted(set(small_suite.rows.filter(pl.col("catalog") == c.id)["question_id"].to_list()))]
    signs = arm_rng(9, "arm").integers(0, 2, size=(perms, len(clusters))) * 2 - 1
    qid = dict(small_suite.rows.select("run_id", "question_id").iter_rows())
    cat = dict(small_suite.rows.select("run_id", "catalog").iter_rows())
    b, a = dict(base.select("run_id", "choice").iter_rows()), dict(arm.select("run_id", "choice").iter_rows())

    def delta(flip: set) -> float:
        rows_a, rows_b = [], []
        for rid in base["run_id"].to_list():
            swap = (cat[rid], qid[rid]) in flip
            rows_a.append({"run_id": rid, "choice": b[rid] if swap else a[rid]})
            rows_b.append({"run_id": rid, "choice": a[rid] if swap else b[rid]})
        sa = score_predictions(small_suite.rows, pl.DataFrame(rows_a), small_suite.spec).full
        sb = score_predictions(small_suite.rows, pl.DataFrame(rows_b), small_suite.spec).full
        return sa - sb

    obs = abs(delta(set()))
    hits = 0
    for p in range(perms):
        d = delta({clusters[i] for i in range(len(clusters)) if signs[p, i] < 0})
        hits += abs(d) >= obs - 1e-9
    assert stats["arm"].p == pytest.approx((1 + hits) / (1 + perms), abs=1e-12)


def test_a_planted_arm_that_hides_the_options_is_a_no_go_with_a_ci_below_zero(small_suite):
    """Hiding the options leaves a model the first label only: planted as 'always label 0'."""
    from jex.lab.arms import ExperimentTestSettings
    from jex.lab.experiment_report import verdict

    base = _preds(small_suite, p_right=0.9, seed=1)
    planted = _preds(small_suite, p_right=0.0, seed=0, first=True)
    placebo = _preds(small_suite, p_right=0.9, seed=1)
    _, stats = paired_arms(small_suite.rows, small_suite.spec, base, {"hidden": planted, "placebo": placebo},
                           draws=500, seed=20260929, permutations=500)
    v, checks = verdict(stats["hidden"], versus(stats["hidden"], stats["placebo"]), ExperimentTestSettings())
    assert v == "NO-GO" and stats["hidden"].metric.ci[1] < 0 and stats["hidden"].p < 0.01
    assert not checks["ci_above_min_effect"] and not checks["above_placebo"]


def test_the_preregistered_test_says_go_only_above_zero_and_above_the_placebo(small_suite):
    from jex.lab.arms import ExperimentTestSettings
    from jex.lab.experiment_report import verdict

    base = _preds(small_suite, p_right=0.3, seed=1)
    better, placebo_same = _preds(small_suite, p_right=0.95, seed=2), _preds(small_suite, p_right=0.3, seed=1)
    placebo_also_better = _preds(small_suite, p_right=0.95, seed=3)
    _, stats = paired_arms(small_suite.rows, small_suite.spec, base,
                           {"arm": better, "p0": placebo_same, "p1": placebo_also_better}, draws=500, seed=1,
                           permutations=500)
    settings = ExperimentTestSettings(catalog_tolerance=100.0)
    assert verdict(stats["arm"], versus(stats["arm"], stats["p0"]), settings)[0] == "GO"
    v, checks = verdict(stats["arm"], versus(stats["arm"], stats["p1"]), settings)
    assert v == "NO-GO" and checks == {"ci_above_min_effect": True, "p_below_alpha": True, "above_placebo": False,
                                       "no_catalog_degrades": True}
    strict = ExperimentTestSettings(min_effect=1000.0)
    assert verdict(stats["arm"], versus(stats["arm"], stats["p0"]), strict)[0] == "NO-GO"


def test_the_retention_gate_judges_the_share_of_the_base_correct_rows_the_arm_keeps(small_suite):
    from jex.lab.arms import ExperimentTestSettings
    from jex.lab.experiment_report import verdict

    base = _preds(small_suite, p_right=1.0, seed=1)  # every row right
    n = base.height
    # the arm breaks the first quarter of the rows (and is right on the rest): it keeps 3/4 of the base's
    wrong = [(gold + 1) % k for gold, k in small_suite.rows.select("gold", "n_options").iter_rows()]
    broken = base.with_columns(choice=pl.Series([w if i < n // 4 else c for i, (w, c) in
                                                 enumerate(zip(wrong, base["choice"], strict=True))], dtype=pl.Int32))
    _, stats = paired_arms(small_suite.rows, small_suite.spec, base, {"arm": broken}, draws=20, seed=1,
                           permutations=20)
    assert stats["arm"].retention == pytest.approx(1 - (n // 4) / n)
    _, strict = verdict(stats["arm"], None, ExperimentTestSettings(min_retention=0.8))
    _, lenient = verdict(stats["arm"], None, ExperimentTestSettings(min_retention=0.7))
    assert strict["retention_at_least_min"] is False and lenient["retention_at_least_min"] is True
    assert "retention_at_least_min" not in verdict(stats["arm"], None, ExperimentTestSettings())[1]


def test_the_out_of_fold_choice_picks_the_value_that_wins_on_held_out_questions(small_suite):
    base = row_contributions(small_suite.rows, small_suite.spec, _preds(small_suite, p_right=0.4, seed=1))
    points = {v: row_contributions(small_suite.rows, small_suite.spec, _preds(small_suite, p_right=p, seed=s))
              for v, p, s in ((0.25, 0.2, 4), (0.5, 0.9, 5), (1.0, 0.4, 1))}
    oof = oof_choice(base, points, folds=4)
    assert oof["choice"] == 0.5 and oof["in_sample_best"] == 0.5 and oof["oof_delta"] > 0
    # contributions are index points: their difference is the full-index delta
    full = {s: score_predictions(small_suite.rows, _preds(small_suite, p_right=p, seed=s), small_suite.spec).full
            for p, s in ((0.4, 1), (0.9, 5))}
    assert points[0.5]["contribution"].sum() - base["contribution"].sum() == pytest.approx(full[5] - full[1],
                                                                                           abs=1e-9)


def test_a_panel_suites_manifest_keeps_its_bytes(sample_suite, tmp_path):
    """A panel's suite.toml is its bundle's, so every key after it: a new catalog field at its default (the
    generative ones) must not change it. Pinned: the bytes jex wrote before generative catalogs existed."""
    from jex.fileio import sha256_file
    from jex.lab.panel import panel_suite

    manifest = panel_suite(sample_suite, tmp_path / "panel", ["arith", "boolean"]) / "suite.toml"
    assert sha256_file(manifest) == "4cbda2c9987eb112b98f58c7ea958d0ff7755eee72966cc66839e283a42d4b95"


def test_the_panel_share_is_the_catalogs_weight_in_the_full_index(sample_suite, tmp_path):
    from jex.lab.panel import panel_suite
    from jex.suite import iter_rows, load_manifest

    spec = load_suite_table(sample_suite).spec
    shares = panel_share(spec, ["arith", "boolean"])
    # arith: public 0.20 of the composite, 1 of 3 public catalogs; boolean: eqS 0.50, 1 of 3
    assert shares == pytest.approx({"arith": 0.2 / 3, "boolean": 0.5 / 3})
    panel = panel_suite(sample_suite, tmp_path / "panel", ["arith", "boolean"])
    manifest = load_manifest(panel)
    assert [c.id for c in manifest.catalogs] == ["arith", "boolean"] and set(manifest.legs) == {"public", "eqS"}
    want = [r for r in iter_rows(sample_suite) if r.catalog in ("arith", "boolean")]
    assert list(iter_rows(panel)) == want
    from jex.tasks.bundle.bundle_file import build_bundle

    bundle = build_bundle(sample_suite, tmp_path / "b.tar.gz").path
    of_bundle = panel_suite(bundle, tmp_path / "panel-b", ["arith", "boolean"])
    assert list(iter_rows(of_bundle)) == want and load_manifest(of_bundle) == manifest
    with pytest.raises(ValueError, match="nope"):
        panel_share(spec, ["nope"])


# ---------------------------------------------------------------- test registration and ledger

def test_the_preregistered_test_is_registered_once_and_a_changed_one_is_refused(tmp_path):
    from jex.lab.experiment_report import register_experiment_test

    sha = register_experiment_test(parse_arms(GOOD), tmp_path)
    assert sha == register_experiment_test(parse_arms(GOOD), tmp_path) and len(sha) == 64
    assert json.loads((tmp_path / "gate-settings.json").read_text())["gate"]["placebo"] == "reworded"
    with pytest.raises(InputError, match="other gate settings"):
        changed = GOOD.replace('placebo = "reworded"', 'placebo = "reworded"\nalpha = 0.01', 1)
        register_experiment_test(parse_arms(changed), tmp_path)


def _doc(verdicts: dict[str, str]) -> dict:
    arms = {n: {"kind": "arm", "verdict": v, "delta": -1.5, "ci": [-2.0, -1.0], "p": 0.01, "placebo_delta": 0.2,
                "vs_placebo": {"delta": -1.7, "ci": [-2.5, -0.9]}} for n, v in verdicts.items()}
    return {"name": "e", "gate": {"settings_sha256": "a" * 64, "metric": "full", "placebo": "reworded"}, "arms": arms}


def test_the_forest_plot_draws_an_arm_whose_collapsed_interval_misses_its_point_by_float_noise(tmp_path):
    """A bootstrap interval that collapses (every draw equal) can sit 1e-15 off its point estimate: the plot
    still draws it (matplotlib refuses a negative error bar)."""
    from jex.lab.experiment_report import forest_plot

    delta = 0.1 + 0.2
    arms = {"collapsed": {**_doc({"collapsed": "NO-GO"})["arms"]["collapsed"], "delta": delta, "ci": [0.3, 0.3]}}
    forest_plot(arms, None, tmp_path / "forest.png", "full")
    assert (tmp_path / "forest.png").stat().st_size > 0


def test_one_ledger_per_store_keyed_by_test_suite_and_model_and_the_ledger_command(tmp_path):
    """Decisions of experiments and campaigns go to the store's one ledger, append-only; the same test on
    another model is a new registration (a new decision), and a typed reopen condition comes true when
    the ledger learns of a large enough model."""
    from typer.testing import CliRunner

    from jex.cli import app
    from jex.fileio import write_json
    from jex.lab.arms import parse_arms
    from jex.lab.experiment_report import RegisteredTest, experiment_decisions
    from jex.tasks.decisions import Decision, append_decisions, ledger_path, read_decisions

    arms = parse_arms(GOOD.replace('name = "system"\n', 'name = "system"\nreopen_when = "a model of 1B parameters '
                                   'or more"\nreopen_if = {model_params_at_least = 1e9}\n', 1))
    small = RegisteredTest(settings_sha256="a" * 64, suite_sha256="s" * 64, model="m" * 64, model_name="small",
                           model_params=1.35e8)
    other = small.model_copy(update={"model": "n" * 64, "model_name": "other"})
    assert len({small.sha256, other.sha256, small.model_copy(update={"suite_sha256": "t" * 64}).sha256}) == 3
    path, exp = ledger_path(tmp_path / "store"), tmp_path / "exp"
    exp.mkdir()
    doc = _doc({"system": "NO-GO", "reworded": "placebo"})
    assert len(append_decisions(path, experiment_decisions(doc, arms, small, source=exp, date="2026-12-01"))) == 1
    first = path.read_bytes()
    assert append_decisions(path, experiment_decisions(doc, arms, small, source=exp)) == []  # decided already
    assert len(append_decisions(path, experiment_decisions(doc, arms, other, source=exp))) == 1  # another model
    assert path.read_bytes().startswith(first)
    system = read_decisions(path)[0]
    assert (system.kind, system.subject, system.status, system.reopen_when, system.gate_sha256) == (
        "experiment-arm", "system", "NO-GO", "a model of 1B parameters or more", small.sha256)
    assert system.reopen_if.model_params_at_least == 1e9 and system.ci == [-2.0, -1.0]
    write_json(exp / "experiment.json", {"name": "e", "base": {}, "gate": {}, "arms": {}, "twin": {}, "sweeps": {},
                                         "provenance": {}, "ledger": str(path)})  # the least experiment record
    out = CliRunner().invoke(app, ["experiment", "ledger", str(exp)])
    assert out.exit_code == 0 and "2 decision(s)" in out.output and "NO-GO" in out.output, out.output
    listed = CliRunner().invoke(app, ["ledger", "--store", str(tmp_path / "store"), "--reopened"])
    assert listed.exit_code == 0 and "0 of 2 decision(s)" in listed.output and "REOPEN" not in listed.output
    append_decisions(path, [Decision(kind="campaign", subject="big-run", status="DONE", source="/r", date="d",
                                     model_name="big", model_params=1.7e9, coverage=0.1, index=12.0)])
    listed = CliRunner().invoke(app, ["ledger", "--store", str(tmp_path / "store"), "--reopened"])
    assert listed.exit_code == 0 and "2 of 3 decision(s)" in listed.output, listed.output
    assert "REOPEN experiment-arm system" in listed.output and "big (1.7e+09 parameters" in listed.output
    campaigns = CliRunner().invoke(app, ["ledger", "--store", str(tmp_path / "store"), "--kind", "campaign"])
    assert "1 of 3 decision(s)" in campaigns.output and "big-run" in campaigns.output
    assert "0 of 3" in CliRunner().invoke(app, ["ledger", "--store", str(tmp_path / "store"), "--status",
                                                "GO"]).output
    missing = CliRunner().invoke(app, ["ledger", "--store", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "ledger.toml" in missing.output


def test_the_twin_audit_reports_the_first_differing_row(tmp_path):
    from jex.lab.experiment_report import first_difference
    from jex.tasks.store import write_parquet

    a = pl.DataFrame({"run_id": ["r1", "r2", "r3"], "logprobs": [[-0.1, -2.0], [-0.5, -1.0], [-1.0, -0.4]]})
    write_parquet(a, tmp_path / "a.parquet")
    write_parquet(a, tmp_path / "same.parquet")
    write_parquet(a.with_columns(pl.when(pl.col("run_id") == "r2").then(pl.lit([-0.5, -1.0000001]))
                                 .otherwise(pl.col("logprobs")).alias("logprobs")), tmp_path / "b.parquet")
    assert first_difference(tmp_path / "a.parquet", tmp_path / "same.parquet") is None
    diff = first_difference(tmp_path / "a.parquet", tmp_path / "b.parquet")
    assert (diff["row"], diff["run_id"], diff["column"]) == (1, "r2", "logprobs")


# ---------------------------------------------------------------- one whole experiment (slow)

ARMS_E2E = (Path(__file__).resolve().parent.parent / "examples" / "arms.toml").read_text()
"""The shipped example arms file (the docs' sample): the experiment below runs it end to end."""


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prefect_harness):
    from jex.flows.lab import ExperimentSpec, experiment
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    tmp = tmp_path_factory.mktemp("experiment")
    # The least sample that keeps the statistics honest (the engine arms' cost is in proportion to it): 27 rows
    # are 3 a catalog, 2 or more question clusters in each (18 leave most catalogs one, a degenerate bootstrap),
    # and the planted arm's CI stays well below zero; 4-token rationales still give the reason stage and the
    # fold-weight sweep something to fold. Every arm of the shipped file still runs.
    base = CampaignSpec(sample_rows=27, coverage=0.2, reason_max_tokens=4, bootstrap_draws=50,
                        store=str(tmp / "store"), machines=MachinesSpec(provider="inprocess"))
    spec = ExperimentSpec(campaign=base, arms_toml=ARMS_E2E, arms_path="examples/arms.toml", out=str(tmp / "out"))
    out = Path(experiment(spec))
    return out, json.loads((out / "experiment.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_an_experiment_writes_the_output_contract(finished):
    out, doc = finished
    assert isinstance(doc["base"]["index"], float) and Path(doc["base"]["run"]).is_dir()
    assert len(doc["gate"]["settings_sha256"]) == 64 and doc["provenance"]["gate_sha256"] == \
        doc["gate"]["settings_sha256"]
    assert set(doc["arms"]) == {"hidden-options", "system", "reworded", "twin", *(f"fold-weight@{v}" for v in
                                                                                     (0.25, 0.5, 0.75, 1.0))}
    for name, a in doc["arms"].items():
        assert a["kind"] in ("arm", "placebo", "twin", "sweep")
        assert a["ci"][0] <= a["delta"] <= a["ci"][1] and 0 < a["p"] <= 1 and a["wall_ratio"] > 0
        assert set(a["catalogs"]) == set(doc["arms"]["system"]["catalogs"]) and set(a["legs"]) == {"public", "eqS",
                                                                                                 "eqO"}
        assert (a["vs_placebo"] is None) == (a["kind"] in ("placebo", "twin")), name
    assert {a["verdict"] for n, a in doc["arms"].items() if a["kind"] in ("arm", "sweep")} <= {"GO", "NO-GO"}
    assert doc["arms"]["reworded"]["verdict"] == "placebo"
    for f in ("report.md", "forest.png", "sweep-fold-weight.png", "gate-settings.json"):
        assert (out / f).stat().st_size > 0, f
    report = (out / "report.md").read_text()
    assert doc["gate"]["settings_sha256"] in report and "Twin audit" in report and "out-of-fold choice" in \
        report.lower()


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_render_that_hides_the_options_is_a_no_go_with_a_ci_below_zero(finished):
    _, doc = finished
    hidden = doc["arms"]["hidden-options"]
    assert hidden["verdict"] == "NO-GO" and hidden["ci"][1] < 0 and hidden["delta"] < 0
    assert not hidden["checks"]["ci_above_min_effect"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_twin_is_byte_identical_and_ran_its_engine_in_another_process(finished):
    _, doc = finished
    twin = doc["arms"]["twin"]
    assert twin["verdict"] == "identical" and doc["twin"]["twin"]["identical"]
    assert twin["delta"] == 0.0 and twin["engine_calls"]["fast_pass"] > 0  # counted in the fresh process
    sha = doc["twin"]["twin"]["sha256"]
    assert sha["fast_pass"][0] == sha["fast_pass"][1] and sha["reason"][0] == sha["reason"][1]
    assert "twin-twin" in doc["twin"]["twin"]["store"]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_arms_that_change_only_decision_stages_make_no_engine_calls(finished):
    _, doc = finished
    assert doc["base"]["engine_calls"]["fast_pass"] > 0 and doc["base"]["engine_calls"]["reason"] > 0
    for point in ("fold-weight@0.25", "fold-weight@1.0"):
        assert doc["arms"][point]["engine_calls"] == {"fast_pass": 0, "reason": 0}
        assert doc["arms"][point]["wall_ratio"] == 1.0  # the same capture, reused
    for arm in ("hidden-options", "system", "reworded"):  # what the engine reads changed: recomputed
        assert doc["arms"][arm]["engine_calls"]["fast_pass"] > 0
    sweep = doc["sweeps"]["fold-weight"]
    assert sweep["oof"]["choice"] in (0.25, 0.5, 0.75, 1.0)
    assert [p["value"] for p in sweep["points"]] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_experiment_ledger_records_the_decided_arms(finished):
    from jex.lab.experiment_report import experiment_ledger

    out, doc = finished
    path, entries = experiment_ledger(out)
    assert path.parent.name == "store"  # the store's one ledger, beside the stage folders
    decided = {n for n, a in doc["arms"].items() if a["verdict"] in ("GO", "NO-GO")}
    assert {e.subject for e in entries if e.kind == "experiment-arm"} == decided
    system = next(e for e in entries if e.subject == "system")
    assert system.reopen_when == "a model of 1B parameters or more"
    assert system.gate_sha256 == doc["gate"]["sha256"] != doc["gate"]["settings_sha256"]  # suite and model in it
    assert system.effect == doc["arms"]["system"]["delta"] and system.model_params > 1e8
