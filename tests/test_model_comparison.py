"""Many models, one comparison (issue 44): one campaign per model on one suite, the comparison with
paired intervals (`compare.md`, `compare.json`), `jex compare` reproducing it from the run folders,
and a model added later computed alone. Real CPU campaigns: the embedded SmolLM2 and the same model cut
to fewer layers (examples/make_smaller_model.py), on a small sample suite."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = pytest.mark.usefixtures("no_user_settings")


def smaller_model(out: Path, layers: int) -> str:
    spec = importlib.util.spec_from_file_location("make_smaller_model", EXAMPLES / "make_smaller_model.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.smaller_model(out, layers))


@pytest.fixture(scope="module")
def models_run(tmp_path_factory, prefect_harness):
    """Two models through the models flow, then the same campaign with a third model added."""
    from jex.flows.lab import run_models
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    root = tmp_path_factory.mktemp("models")
    m20, m10 = smaller_model(root / "smollm2-20", 20), smaller_model(root / "smollm2-10", 10)
    spec = CampaignSpec(name="two", sample_rows=27, coverage=0.2, reason_max_tokens=8, bootstrap_draws=300,
                        store=str(root / "store"), out=str(root / "runs"), machines=MachinesSpec(provider="inprocess"))
    two = run_models(spec, ["embedded", m20])
    three = run_models(spec, ["embedded", m20, m10])
    return {"two": two, "three": three, "m20": m20, "m10": m10, "root": root}


def read(folder: Path) -> dict:
    return json.loads((folder / "compare.json").read_text())


def index_by_hand(run_dir: str) -> float:
    """The full index from the run's samples and the sample suite's declaration alone (not jex's scorer):
    per catalog accuracy, skill = (acc - 1/k) / (1 - 1/k), each leg the mean skill of its catalogs (equal
    weights) x 100, the index the legs' weighted mean."""
    from jex.sample_suite import CATALOGS, LEG_WEIGHTS

    samples = pl.read_parquet(Path(run_dir) / "samples.parquet", columns=["catalog", "correct"])
    skill = {}
    for cid, _name, _leg, _area, k in CATALOGS:
        acc = samples.filter(pl.col("catalog") == cid)["correct"].mean()
        skill[cid] = (acc - 1 / k) / (1 - 1 / k)
    legs = {leg: 100 * sum(skill[c[0]] for c in CATALOGS if c[2] == leg) / sum(c[2] == leg for c in CATALOGS)
            for leg in LEG_WEIGHTS}
    return sum(LEG_WEIGHTS[g] * legs[g] for g in legs) / sum(LEG_WEIGHTS.values())


def test_each_model_gets_its_own_run_and_the_comparison_its_files(models_run):
    doc = read(models_run["two"])
    assert [m["model"] for m in doc["models"]] == ["embedded", models_run["m20"]]
    assert len({m["run_dir"] for m in doc["models"]}) == 2
    assert [(p["a"], p["b"]) for p in doc["pairs"]] == [("embedded", "smollm2-20")]
    assert {"compare.md", "compare.json", "compare.png"} <= {p.name for p in models_run["two"].iterdir()}
    md = (models_run["two"] / "compare.md").read_text()
    assert "| smollm2-20 - embedded |" in md and "![models and pairs](compare.png)" in md


def test_a_models_score_is_its_runs_own_index(models_run):
    for m in read(models_run["two"])["models"]:
        score = json.loads((Path(m["run_dir"]) / "score.json").read_text())
        assert m["full"]["value"] == pytest.approx(score["full"], abs=1e-12)
        assert m["full"]["ci"][0] <= m["full"]["value"] <= m["full"]["ci"][1]


def test_a_pairs_difference_matches_an_independent_recomputation(models_run):
    doc = read(models_run["two"])
    (pair,) = doc["pairs"]
    run = {m["label"]: m["run_dir"] for m in doc["models"]}
    by_hand = index_by_hand(run[pair["b"]]) - index_by_hand(run[pair["a"]])
    assert pair["full"]["value"] == pytest.approx(by_hand, abs=1e-12)
    assert pair["full"]["ci"][0] <= pair["full"]["value"] <= pair["full"]["ci"][1]


def test_jex_compare_reproduces_the_comparison_from_the_run_folders_alone(models_run, tmp_path):
    from jex.cli import app

    doc = read(models_run["two"])
    runs = [m["run_dir"] for m in doc["models"]]
    out = CliRunner().invoke(app, ["compare", *runs, "--json", "-o", str(tmp_path / "again")])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == doc == read(tmp_path / "again")


def test_a_model_added_later_is_the_only_one_computed(models_run):
    doc = read(models_run["three"])
    assert [m["model"] for m in doc["models"]] == ["embedded", models_run["m20"], models_run["m10"]]
    assert len(doc["pairs"]) == 3
    calls = {m["label"]: json.loads((Path(m["run_dir"]) / "engine_calls.json").read_text())["calls"]
             for m in doc["models"]}
    assert calls["embedded"] == calls["smollm2-20"] == {"fast_pass": 0, "reason": 0}
    assert calls["smollm2-10"]["fast_pass"] > 0
    before = {m["label"]: m["full"] for m in read(models_run["two"])["models"]}
    assert {m["label"]: m["full"] for m in doc["models"][:2]} == before  # same rows, same draws


def test_jex_diff_of_two_models_lists_exactly_the_rows_whose_predictions_differ(models_run):
    from jex.cli import app

    a_dir, b_dir = (m["run_dir"] for m in read(models_run["two"])["models"])
    out = CliRunner().invoke(app, ["diff", a_dir, b_dir, "--json"])
    assert out.exit_code == 0, out.output
    a, b = (pl.read_parquet(Path(r) / "predictions.parquet").select("run_id", "choice") for r in (a_dir, b_dir))
    both = a.join(b, on="run_id", suffix="_b")
    expected = set(both.filter(pl.col("choice").ne_missing(pl.col("choice_b")))["run_id"].to_list())
    assert expected and {r["run_id"] for r in json.loads(out.output)["rows_differing"]} == expected


def test_models_are_ranked_only_where_their_paired_interval_separates_them(models_run):
    doc = read(models_run["three"])
    above = {m["label"]: 0 for m in doc["models"]}
    for p in doc["pairs"]:
        lo, hi = p["full"]["ci"]
        if lo > 0 or hi < 0:
            above[p["b"] if p["full"]["value"] > 0 else p["a"]] += 1
    assert {m["label"]: m["rank"] for m in doc["models"]} == {k: 1 + v for k, v in above.items()}


def test_runs_of_different_bundles_are_refused_in_one_line(models_run, tmp_path):
    from jex.cli import app

    runs = [m["run_dir"] for m in read(models_run["two"])["models"]]
    other = tmp_path / "other-run"
    shutil.copytree(runs[1], other)
    stages = json.loads((other / "stages.json").read_text())
    stages["bundle"]["key"] = "0" * 64
    (other / "stages.json").write_text(json.dumps(stages))
    out = CliRunner().invoke(app, ["compare", runs[0], str(other)])
    assert out.exit_code == 1
    assert "different bundles" in out.output and "Traceback" not in out.output


def test_one_run_is_not_a_comparison(models_run):
    from jex.cli import app

    out = CliRunner().invoke(app, ["compare", read(models_run["two"])["models"][0]["run_dir"]])
    assert out.exit_code == 1 and "at least two run folders" in out.output


def test_several_models_take_no_resume(tmp_path):
    from jex.cli import app

    for folder, file in (("run", "campaign.json"), ("model", "config.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / file).write_text("{}")
    out = CliRunner().invoke(app, ["run", "--model", "embedded", "--model", str(tmp_path / "model"), "--resume",
                                   str(tmp_path / "run")])
    assert out.exit_code == 1 and "take one model" in out.output
