"""The files in examples/ load through the loaders the CLI uses: each is valid as shipped. (The arms file
also runs end to end: tests/test_experiments.py's experiment is examples/arms.toml.)"""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


pytestmark = pytest.mark.usefixtures("no_user_settings")


def test_the_arms_example_parses_as_jex_experiment_run_reads_it():
    from jex.lab.arms import parse_arms

    arms = parse_arms((EXAMPLES / "arms.toml").read_text(), path="examples/arms.toml")
    assert [a.name for a in arms.arms] == ["hidden-options", "system", "reworded", "twin", "fold-weight"]
    assert arms.name == "sample" and arms.test.placebo == "reworded"


def test_the_campaign_example_is_a_spec_file_of_jex_run():
    from jex.cli.run import spec_from
    from jex.settings import load_settings

    flags = {"coverage": 0.3, "render": None, "chat_template": None, "system_prompt": None, "num_fewshot": None}
    spec = spec_from(load_settings(), spec_file=EXAMPLES / "campaign.toml", flags=flags)
    assert spec.name == "example" and spec.sample_rows == 36 and spec.coverage == 0.3  # the flag wins
    assert spec.engine.render.system_prompt and spec.machines.golden_rows == 16


def test_the_overlays_example_is_a_rule_file_on_the_sample_suites_catalogs():
    from jex.overlays import load_rule_file
    from jex.sample_suite import CATALOGS

    rules = load_rule_file(EXAMPLES / "overlays.toml")
    assert [r.id for r in rules] == ["R-sorted", "R-bool", "R-compare", "R-unsure"]
    assert {r.target for r in rules} <= {c[0] for c in CATALOGS}


def test_the_models_example_names_two_models_and_is_otherwise_a_campaign_file():
    from jex.cli.run import spec_file_models, spec_from
    from jex.settings import load_settings

    assert spec_file_models(EXAMPLES / "models.toml") == ["embedded", "runs/smollm2-20-layers"]
    flags = {"render": None, "chat_template": None, "system_prompt": None, "num_fewshot": None}
    spec = spec_from(load_settings(), spec_file=EXAMPLES / "models.toml", flags=flags)
    assert spec.name == "models" and spec.engine.model is None and spec.machines.provider == "inprocess"
    assert spec.with_model("embedded") == spec  # 'embedded' is the embedded model, as an empty model is
