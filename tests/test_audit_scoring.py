"""Scoring kinds: accuracy, brier, log_loss and calibrated_accuracy, with their chance baselines.

A manifest mixing the kinds is scored by both scorers and by an independent check written here
from the definitions; all three agree bit for bit.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import numpy as np
import pytest

from jex.errors import InputError
from jex.tasks.bundle.suite_table import load_predictions, load_suite_table
from jex.tasks.records import CalibrateSummary, FoldSummary
from jex.tasks.scoring.bootstrap_ci import bootstrap_ci, bootstrap_loop
from jex.tasks.scoring.index import catalog_chances, scored_frame
from jex.tasks.scoring.score import score_files, score_twice
from tests.conftest import row, write_suite

KINDS = {"acc": "accuracy", "bri": "brier", "ll": "log_loss", "cal": "calibrated_accuracy"}


def mixed_suite(root, rows_per_catalog=12, seed=1, secondary=None):
    rnd = random.Random(seed)
    rows = {}
    for cid in KINDS:
        rows[cid] = [row(f"{cid}{i}", cid, q=f"{cid}q{i // 3}", k=rnd.choice([2, 3, 4]), gold=0)
                     for i in range(rows_per_catalog)]
        for r in rows[cid]:
            r["gold"] = rnd.randrange(len(r["options"]))
    suite = write_suite(root, rows, legs={"P": 1.0, "Q": 2.0}, catalogs=[
        {"id": "acc", "leg": "P"}, {"id": "bri", "leg": "P", "weight": 2.0}, {"id": "ll", "leg": "Q"},
        {"id": "cal", "leg": "Q", "weight": 0.5}])
    text = (suite / "suite.toml").read_text()
    for cid, kind in KINDS.items():
        extra = f'id = "{cid}"\nscoring = "{kind}"\n'
        if secondary and cid in secondary:
            extra += f"secondary = {json.dumps(secondary[cid])}\n"
        text = text.replace(f'id = "{cid}"\n', extra)
    (suite / "suite.toml").write_text(text)
    return suite, rows


def random_predictions(path, rows, seed=2, missing=("acc3", "bri4", "ll5"), abstain=()):
    rnd = random.Random(seed)
    with open(path, "w") as f:
        for cid in rows:
            for r in rows[cid]:
                if r["run_id"] in missing:
                    continue
                w = [rnd.random() + 0.01 for _ in r["options"]]
                probs = [x / math.fsum(w) for x in w]
                rec = {"run_id": r["run_id"], "choice": max(range(len(probs)), key=probs.__getitem__), "probs": probs}
                if r["run_id"] in abstain:
                    rec["abstain"] = True
                f.write(json.dumps(rec) + "\n")
    return path


def independent(rows, preds_path, legs, weights, declared_abstain=()):
    """The definitions, written out once more: exact rationals where they are rational, fsum otherwise."""
    preds = {json.loads(x)["run_id"]: json.loads(x) for x in open(preds_path)}
    skills, accs = {}, {}
    for cid, kind in KINDS.items():
        vals, correct, inv, logs = [], 0, Fraction(0), Fraction(0)
        for r in rows[cid]:
            k, g = len(r["options"]), r["gold"]
            p = preds.get(r["run_id"], {})
            if p.get("abstain") and cid in declared_abstain:
                p = {}
            correct += p.get("choice") == g
            inv += Fraction(1, k)
            logs += Fraction(math.log(k))
            probs = p.get("probs") or [1.0 / k] * k
            if kind == "brier":
                vals += [(q - (i == g)) * (q - (i == g)) for i, q in enumerate(probs)]
            elif kind == "log_loss":
                vals.append(-math.log(max(probs[g], 1e-15)))
            else:
                vals.append(probs[g])
        n = len(rows[cid])
        accs[cid] = correct / n
        value = accs[cid] if kind == "accuracy" else math.fsum(vals) / n
        chance = {"accuracy": float(inv / n), "calibrated_accuracy": float(inv / n), "brier": float(1 - inv / n),
                  "log_loss": float(logs / n)}[kind]
        best = 0.0 if kind in ("brier", "log_loss") else 1.0
        skills[cid] = (value - chance) / (best - chance)
    index = {leg: 100.0 * math.fsum(w * skills[c] for c, (lg, w) in weights.items() if lg == leg)
             / math.fsum(w for lg, w in weights.values() if lg == leg) for leg in legs}
    return math.fsum(w * index[leg] for leg, w in legs.items()) / math.fsum(legs.values()), skills


def test_mixed_kinds_agree_bit_for_bit_across_both_scorers_and_the_independent_check(tmp_path):
    suite, rows = mixed_suite(tmp_path / "s")
    preds = random_predictions(tmp_path / "p.jsonl", rows)
    doc = score_files(suite, preds, tmp_path / "out", draws=50).model_dump()  # raises ScorerDisagreement on any bit
    full, skills = independent(rows, preds, {"P": 1.0, "Q": 2.0},
                               {"acc": ("P", 1.0), "bri": ("P", 2.0), "ll": ("Q", 1.0), "cal": ("Q", 0.5)})
    assert doc["full"] == full
    assert {c: v["skill"] for c, v in doc["catalogs"].items()} == skills
    assert {c: v["kind"] for c, v in doc["catalogs"].items()} == KINDS
    assert doc["catalogs"]["bri"]["unsupported"] == 1 and doc["catalogs"]["acc"]["unsupported"] == 1
    assert "| bri | P | brier |" in (tmp_path / "out" / "score.md").read_text()


def test_chance_baselines_are_the_uniform_guess():
    """Predicting the uniform distribution on every row scores skill 0 under every kind."""
    import polars as pl

    from jex.tasks.bundle.suite_table import CatalogSpec, ScoreSpec
    from jex.tasks.scoring.index import score_predictions

    spec = ScoreSpec(legs={"L": 1.0}, catalogs=tuple(CatalogSpec(c, "L", 1.0, None, scoring=k)
                                                     for c, k in KINDS.items() if k != "accuracy"))
    rows = pl.DataFrame({"run_id": [f"{c}{i}" for c in KINDS for i in range(4)],
                         "catalog": [c for c in KINDS for _ in range(4)],
                         "question_id": [f"{c}{i}" for c in KINDS for i in range(4)],
                         "gold": [i % 2 for _ in KINDS for i in range(4)], "n_options": [4] * 16},
                        schema={"run_id": pl.String, "catalog": pl.String, "question_id": pl.String,
                                "gold": pl.Int32, "n_options": pl.Int32}).filter(pl.col("catalog") != "acc")
    uniform = rows.select("run_id", choice=pl.lit(0, dtype=pl.Int32),
                          probs=pl.lit([0.25] * 4, dtype=pl.List(pl.Float64)))
    score = score_predictions(rows, uniform, spec)
    assert score.catalogs["bri"].chance == 0.75 and score.catalogs["ll"].chance == math.log(4)
    assert {c: s.skill for c, s in score.catalogs.items()} == {"bri": 0.0, "ll": 0.0, "cal": 0.0}


def test_abstain_is_read_only_where_the_catalog_declares_it(tmp_path):
    suite, rows = mixed_suite(tmp_path / "s", secondary={"acc": ["abstain"]})
    preds = random_predictions(tmp_path / "p.jsonl", rows, missing=(), abstain=("acc0", "acc1", "bri0"))
    doc = score_files(suite, preds, tmp_path / "out", draws=20).model_dump()
    assert doc["catalogs"]["acc"]["abstained"] == 2 and doc["catalogs"]["acc"]["unsupported"] == 2
    assert doc["catalogs"]["bri"]["abstained"] == 0  # bri does not declare abstain: the flag is ignored
    full, _ = independent(rows, preds, {"P": 1.0, "Q": 2.0},
                          {"acc": ("P", 1.0), "bri": ("P", 2.0), "ll": ("Q", 1.0), "cal": ("Q", 0.5)},
                          declared_abstain={"acc"})
    assert doc["full"] == full


def test_bootstrap_resamples_each_kinds_values_like_the_readable_loop(tmp_path):
    suite, rows = mixed_suite(tmp_path / "s", rows_per_catalog=30)
    table = load_suite_table(suite)
    preds = load_predictions(random_predictions(tmp_path / "p.jsonl", rows), table.rows)
    score_twice(table.rows, preds, table.spec)
    frame = scored_frame(table.rows, preds, table.spec)
    chance = catalog_chances(frame, table.spec)
    ci = bootstrap_ci(frame, table.spec, chance, draws=200, seed=7)
    loop = bootstrap_loop(frame, table.spec, chance, draws=200, seed=7)
    lo, hi = np.percentile(loop, [2.5, 97.5])
    assert ci["full"] == pytest.approx([lo, hi], rel=1e-12)


@pytest.mark.parametrize("probs, words", [([0.5, 0.6], "sum to 1"), ([1.0], "one per option"),
                                          (["a", "b"], "2 numbers in")])
def test_bad_probs_name_file_row_and_field(tmp_path, probs, words):
    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a", k=2)]})
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"run_id": "a1", "choice": 0, "probs": probs}) + "\n")
    with pytest.raises(InputError, match=rf"p.jsonl, row 1, field 'probs'.*{words}"):
        load_predictions(path, load_suite_table(suite).rows)


def test_unknown_scoring_kind_is_refused(tmp_path):
    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a")]})
    (suite / "suite.toml").write_text((suite / "suite.toml").read_text().replace('id = "a"\n',
                                                                                  'id = "a"\nscoring = "f1"\n'))
    with pytest.raises(InputError, match="scoring"):
        load_suite_table(suite)


def test_an_overlay_sets_abstain_and_the_campaigns_score_reads_it(tmp_path):
    """overlay stage -> score stage: an `abstain-below` rule flags the target's unsure rows, keeps their
    choices, and the score counts them as the scorer of a predictions file with those flags does."""
    import polars as pl

    from jex.fileio import read_json
    from jex.overlays import AbstainBelow
    from jex.tasks.capture.stages import bundle_stage
    from jex.tasks.decision_stages import overlay_stage, score_stage
    from jex.tasks.store import LocalStore, write_parquet

    suite, rows = mixed_suite(tmp_path / "s", secondary={"acc": ["abstain"]})
    preds_path = random_predictions(tmp_path / "p.jsonl", rows, missing=())
    preds = [json.loads(x) for x in open(preds_path)]
    by_id = {r["run_id"]: r for cid in rows for r in rows[cid]}
    calibrated = pl.DataFrame(
        {"run_id": [p["run_id"] for p in preds], "catalog": [by_id[p["run_id"]]["catalog"] for p in preds],
         "question_id": [by_id[p["run_id"]]["question_id"] for p in preds],
         "choice": [p["choice"] for p in preds], "folded": [False] * len(preds),
         "calibrated_logprobs": [[math.log(q) for q in p["probs"]] for p in preds]},
        schema_overrides={"choice": pl.Int32})
    write_parquet(calibrated, tmp_path / "calibrated.parquet")
    write_parquet(calibrated.select("run_id", logprobs="calibrated_logprobs", fast_choice="choice"),
                  tmp_path / "folded.parquet")
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=suite)
    rule = AbstainBelow(id="unsure", target="acc", projection_class="fitted-on-public-oof", p_min=0.45)
    calibrated_summary = CalibrateSummary(key="c", sha256="c", calibrated=str(tmp_path / "calibrated.parquet"),
                                          calibration_json="")
    overlay = overlay_stage(store, calibrated=calibrated_summary, rules=[rule], rules_sha256="r")
    out = pl.read_parquet(overlay.predictions)
    unsure = {p["run_id"] for p in preds if p["run_id"].startswith("acc") and p["probs"][p["choice"]] < 0.45}
    assert unsure and set(out.filter("abstain")["run_id"]) == unsure
    assert out["choice"].to_list() == [p["choice"] for p in preds]  # choices kept
    assert overlay.applied[0]["changed"] == len(unsure)
    fold = FoldSummary(key="f", sha256="f", folded=str(tmp_path / "folded.parquet"), fold_json="", errors={})
    score = read_json(score_stage(store, bundle=bundle, overlay=overlay, fold=fold, draws=20, seed=1).score_json)
    assert score["catalogs"]["acc"]["abstained"] == len(unsure)
    flagged = random_predictions(tmp_path / "flagged.jsonl", rows, missing=(), abstain=tuple(unsure))
    assert score["full"] == score_files(suite, flagged, tmp_path / "out", draws=20).full
