"""The command line: one app of command groups, `--version`, shell completion, and `jex run` taking a
campaign from settings, then `--spec FILE`, then flags (the flow itself is not run here)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

import jex.flows.campaign as campaign_module
from jex.cli import app
from jex.cli.run import CAMPAIGN_FIELD_OF_FLAG, run, spec_help
from jex.tasks.campaign_spec import CampaignSpec, spec_field

EVERY_FIELD = {
    "name": "full", "suite": "suites/mine", "sample_rows": 36, "coverage": 0.25, "per_catalog_cap": 0.5,
    "reason_max_tokens": 12, "spec_proof_rows": 5, "fold_rule": "replace", "fold_weight": 0.25,
    "calibration_folds": 3, "overlays": "rules.toml", "bootstrap_draws": 50, "bootstrap_seed": 1,
    "fast_shard_rows": 16, "reason_shard_rows": 4, "store": "s", "out": "o", "reference": "ref.parquet",
    "require_zero_errors": True, "samples_prompts": "sha256", "reference_min_agreement": 0.9,
    "unverified_overlays": True, "mlflow": {"tracking_uri": "sqlite:///runs/mlflow.db", "experiment": "evals"},
    "engine": {"kind": "vllm", "profile": "audit-ngram", "model": "org/name", "device": "cuda", "batch_size": 0,
               "max_num_seqs": 4, "max_num_batched_tokens": 512, "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
               "kv_cache_memory_gib": 6.0, "max_model_len": 1024, "cache_dir": "cache",
               "cudagraph_mode": "FULL_DECODE_ONLY", "base_url": "http://h:1/v1", "api_key_env": "MY_KEY",
               "max_concurrency": 3, "max_retries": 1, "request_timeout_s": 30.0, "price_input_per_mtok": 0.5,
               "price_output_per_mtok": 1.5, "tensor_parallel_size": 2,
               "render": {"system_prompt": "Be brief.", "chat_template": "none", "num_fewshot": 2}},
    "machines": {"provider": "ssh", "hosts": ["h1", "h2"], "workers": 2, "budget_usd": 5.0, "price_per_hour": 1.5,
                 "budget_hours": 2.0, "heartbeat_timeout_s": 30.0, "golden_rows": 8, "golden_tolerance": 0.001,
                 "golden_generation_rows": 2, "golden_generation_tokens": 7, "audit": "always", "audit_prompts": 4,
                 "audit_tokens": 9,
                 "concurrent": False, "engine_hosts": False, "gpus_per_machine": 2, "engines_per_gpu": 2,
                 "host_stall_s": 90.0, "fresh_processes": True, "aws_credentials_block": "jex-aws"},
}
"""A value other than the default for every CampaignSpec field (and every engine and machines field)."""


pytestmark = pytest.mark.usefixtures("no_user_settings")


@pytest.fixture
def ran(monkeypatch) -> list[CampaignSpec]:
    """The campaigns `jex run` hands to the flow (which is not run)."""
    specs: list[CampaignSpec] = []
    monkeypatch.setattr("jex.cli.run.connect_prefect", lambda settings, **how: False)  # a configured server
    monkeypatch.setattr("jex.cli.run.check_campaign", lambda spec: None)  # the paths named here need not exist
    monkeypatch.setattr(campaign_module, "run_campaign", lambda spec, **how: specs.append(spec) or "RUN")
    monkeypatch.setattr("jex.cli.run.project_panel", lambda run_dir, panel, spec: None)  # no run to project
    return specs


def toml(doc: dict, table: str = "") -> str:
    """A TOML document of scalars, lists and nested tables (JSON literals are TOML literals here)."""
    scalars = [f"{k} = {json.dumps(v)}" for k, v in doc.items() if not isinstance(v, dict)]
    tables = [toml(v, f"{table}{k}.") for k, v in doc.items() if isinstance(v, dict)]
    return "\n".join(([f"[{table[:-1]}]"] if table else []) + scalars + tables) + "\n"


def test_version_prints_the_package_version_and_commit():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("jex 0.1.0 (commit "), result.output


def test_shell_completion_is_offered():
    output = CliRunner().invoke(app, ["--help"]).output
    assert "--install-completion" in output and "--show-completion" in output


def test_calibrate_is_the_budget_projection_and_says_so():
    """`jex calibrate` stays the verb; its help says it projects time and cost (not temperature scaling)."""
    help_text = " ".join(CliRunner().invoke(app, ["calibrate", "--help"]).output.split())
    assert "Project a campaign's time and cost per coverage" in help_text and "--budget-usd" in help_text


def test_importing_the_cli_imports_no_flow_and_no_prefect():
    """`python -m jex stage run` on a machine: no Prefect, no flows at import time (nor the trackers' SDKs, which
    only their `jex export` commands import)."""
    code = ("import sys, jex.cli; print([m for m in sys.modules if m.startswith(('prefect', 'jex.flows', 'mlflow', "
            "'wandb'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_run_flag_sets_a_campaign_field():
    own = {"spec", "resume", "render", "chat_template", "system_prompt", "num_fewshot",  # files, engine.render
           "panel_catalogs", "panel_share",  # set `suite` to the panel it writes (its share checked)
           "quiet", "as_json",  # what is printed at the end
           "recompute", "retry"}  # flow parameters: what to compute again
    assert set(inspect.signature(run).parameters) - own == set(CAMPAIGN_FIELD_OF_FLAG)
    for path in CAMPAIGN_FIELD_OF_FLAG.values():
        model = CampaignSpec
        for part in path.split("."):
            field = model.model_fields[part]
            model = field.annotation
    assert EVERY_FIELD.keys() == CampaignSpec.model_fields.keys()


def test_every_campaign_flag_takes_its_help_and_default_from_the_spec_field():
    """One declaration: a flag's help is its field's description and says where the field's default comes
    from (settings, else the field's default); the flag itself defaults to None, so it changes nothing."""
    renders = {"chat_template": "engine.render.chat_template", "system_prompt": "engine.render.system_prompt",
               "num_fewshot": "engine.render.num_fewshot"}
    hints = typing.get_type_hints(run, include_extras=True)
    for flag, path in {**CAMPAIGN_FIELD_OF_FLAG, **renders}.items():
        help_text = hints[flag].__metadata__[0].help
        assert help_text.startswith(spec_field(path).description), flag
        assert help_text.endswith(spec_help(path).removeprefix(spec_field(path).description)), flag
        assert inspect.signature(run).parameters[flag].default is None, flag
    assert spec_help("engine.device").endswith("(default: JEX_ENGINE__DEVICE, else cpu)")
    assert spec_help("machines.workers").endswith("(default: 1)")


def test_flags_beat_settings(ran, monkeypatch):
    monkeypatch.setenv("JEX_ENGINE__BATCH_SIZE", "4")
    monkeypatch.setenv("JEX_ENGINE__DEVICE", "cuda")
    result = CliRunner().invoke(app, ["run", "--batch-size", "2", "--out", "elsewhere"])
    assert result.exit_code == 0, result.output
    assert (ran[0].engine.batch_size, ran[0].engine.device, ran[0].store) == (2, "cuda", "elsewhere/store")


def test_panel_catalogs_runs_the_campaign_on_those_catalogs_only(ran, sample_suite, tmp_path):
    from pathlib import Path

    from jex.suite import load_manifest

    result = CliRunner().invoke(app, ["run", "--suite", str(sample_suite), "--out", str(tmp_path),
                                      "--panel-catalogs", "arith, boolean"])
    assert result.exit_code == 0, result.output
    assert "share of the full weight" in result.output
    assert [c.id for c in load_manifest(Path(ran[0].suite)).catalogs] == ["arith", "boolean"]


def test_a_panel_whose_share_is_not_the_declared_one_is_refused_before_the_run(ran, sample_suite, tmp_path):
    result = CliRunner().invoke(app, ["run", "--suite", str(sample_suite), "--out", str(tmp_path),
                                      "--panel-catalogs", "arith,boolean", "--panel-share", "0.9"])
    assert result.exit_code == 1 and "not the declared 0.9" in result.output and ran == []


@pytest.mark.slow
def test_a_panel_campaign_projects_its_delta_onto_the_full_index(tmp_path, prefect_api_url):
    """The run's final predictions against its fast pass, each panel catalog's delta weighted by its share of
    the full weight, recomputed here from the run's own catalog scores."""
    from jex.lab.experiment_stats import panel_share
    from jex.sample_suite import write_sample_suite
    from jex.tasks.bundle.suite_table import load_suite_table
    from jex.tasks.records import ScoreSummary

    sample_suite = write_sample_suite(tmp_path / "suite", rows=144, seed=0)  # 16 rows a catalog: 32 in the panel
    shares = panel_share(load_suite_table(sample_suite).spec, ["arith", "boolean"])
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url}
    done = subprocess.run([sys.executable, "-m", "jex", "run", "--suite", str(sample_suite), "--provider",
                           "inprocess", "--coverage", "0.3", "--reason-max-tokens", "6", "--panel-catalogs",
                           "arith,boolean", "--panel-share", f"{sum(shares.values()):.6f}", "--name", "panel",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = Path(done.stdout.strip().splitlines()[-1])
    doc = json.loads((run_dir / "panel.json").read_text())
    assert doc["shares"] == pytest.approx(shares) and "projected onto the full index" in done.stderr
    stages = json.loads((run_dir / "stages.json").read_text())
    score = ScoreSummary.model_validate_json((Path(stages["score"]["folder"]) / "_SUCCESS.json").read_text())
    final, fast = (json.loads(Path(p).read_text())["catalogs"] for p in (score.score_json, score.baseline_json))
    expected = sum(s * 100 * (final[c]["skill"] - fast[c]["skill"]) for c, s in shares.items())
    assert doc["projected_full_delta"]["delta"] == pytest.approx(expected, abs=1e-9)
    lo, hi = doc["projected_full_delta"]["ci"]
    assert lo <= hi


def test_an_unknown_panel_catalog_is_one_line_naming_it(ran, sample_suite, tmp_path):
    result = CliRunner().invoke(app, ["run", "--suite", str(sample_suite), "--out", str(tmp_path),
                                      "--panel-catalogs", "arith,nope"])
    assert result.exit_code != 0 and "nope" in result.output and "Traceback" not in result.output
    assert ran == []


def test_spec_file_round_trips_every_field(ran, tmp_path):
    (tmp_path / "campaign.toml").write_text(toml(EVERY_FIELD))
    result = CliRunner().invoke(app, ["run", "--spec", str(tmp_path / "campaign.toml")])
    assert result.exit_code == 0, result.output
    assert ran[0] == CampaignSpec.model_validate(EVERY_FIELD)
    assert ran[0].model_dump(exclude={"engine": {"render"}}) == {
        **EVERY_FIELD, "engine": {k: v for k, v in EVERY_FIELD["engine"].items() if k != "render"}}


def test_flags_beat_the_spec_file(ran, tmp_path):
    (tmp_path / "campaign.toml").write_text('coverage = 0.3\n[engine]\nbatch_size = 4\n[engine.render]\n'
                                            'system_prompt = "x"\n')
    result = CliRunner().invoke(app, ["run", "--spec", "campaign.toml", "--coverage", "0.2", "--num-fewshot", "1"])
    assert result.exit_code == 0, result.output
    assert (ran[0].coverage, ran[0].engine.batch_size, ran[0].engine.render.system_prompt,
            ran[0].engine.render.num_fewshot) == (0.2, 4, "x", 1)


@pytest.mark.parametrize(("text", "where"), [
    ("coverage = 5\n", "file campaign.toml, field 'coverage'"),
    ("[machines]\nworkerz = 2\n", "file campaign.toml, field 'machines.workerz'"),
    ("coverage = \n", "file campaign.toml: cannot read the campaign spec"),
], ids=["bad-value", "unknown-field", "not-toml"])
def test_a_bad_spec_file_is_named_with_its_field(ran, tmp_path, text, where):
    (tmp_path / "campaign.toml").write_text(text)
    result = CliRunner().invoke(app, ["run", "--spec", "campaign.toml"])
    assert result.exit_code == 1 and result.stderr.startswith(f"error: {where}"), result.stderr
    assert not ran


def test_a_misspelt_engine_key_in_a_spec_file_is_refused_with_the_closest_name(ran, tmp_path):
    (tmp_path / "campaign.toml").write_text("[engine]\nbatch_sise = 4\n")
    result = CliRunner().invoke(app, ["run", "--spec", "campaign.toml"])
    assert result.exit_code == 1 and "field 'engine.batch_sise'" in result.stderr, result.stderr
    assert "did you mean 'batch_size'?" in result.stderr and not ran


# --- what a command prints: its output's path last -------------------------------------------------------------

def projected(spec):
    """The budget projection of a measured sample (1 s per fast-pass row, 4 s per reasoned row, 1,000 rows) under
    `spec`'s price and budget: what `budget_projection` returns, without the campaign that measures it."""
    from jex.flows.budget import BudgetRun, Measured, project, row_budget

    terms = {"rows": 1000, "fast_s_per_row": 1.0, "reason_s_per_row": 4.0, "coverages": spec.coverages,
             "price": spec.price_per_gpu_hour, "gpus": spec.gpus, "budget_hours": spec.budget_hours,
             "budget_usd": spec.budget_usd}
    return BudgetRun(spec=spec, measured=Measured(sample_rows=100, gated=30, fast_s_per_row=1.0, reason_s_per_row=4.0,
                                                  fix_rate=0.5, fixed=3, flipped=1),
                     projection_rows=1000, projection=project(**terms), row_budget=row_budget(**terms))


@pytest.mark.parametrize(("budget_usd", "recommendation"), [
    ("1000", "**Recommended coverage: 0.3**"),
    ("0.01", "**No coverage fits the budget: the smallest projected, 0.05 of 1000 rows, needs ~$0.67, over "
             "--budget-usd 0.01; raise the budget or lower --target-rows**"),
], ids=["fits", "none-fits"])
def test_calibrate_prints_its_table_and_recommendation_then_its_folder(budget_usd, recommendation, monkeypatch,
                                                                        tmp_path):
    monkeypatch.setattr("jex.cli.run.connect_prefect", lambda settings, notice=True: False)
    monkeypatch.setattr("jex.flows.budget.budget_projection", projected)
    result = CliRunner().invoke(app, ["calibrate", "--out", "runs", "--price", "2", "--budget-usd", budget_usd])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert "| coverage | reasoned rows | wall | cost | fits |" in lines and "| 0.05 | 50 | ~0.3 h | ~$1 | " \
        f"{'yes' if budget_usd == '1000' else 'no'} |" in lines
    assert recommendation in lines and "None" not in result.stdout
    assert Path(lines[-1]).parent == tmp_path / "runs" and lines[-1].endswith("-budget")


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    """A suite, its predictions, local rows and an lm-eval task reading them; the bake-off flow replaced by its
    summary (no engine runs here)."""
    from jex.lab.jobs import BakeoffSummary
    from tests.conftest import row, write_suite

    write_suite(tmp_path / "s", {"a": [row("a1", "a")]})
    (tmp_path / "p.jsonl").write_text('{"run_id": "a1", "choice": 0}\n')
    (tmp_path / "rows.jsonl").write_text('{"question": "1 + 1?", "choices": ["2", "3"], "answer": 0}\n')
    (tmp_path / "t.yaml").write_text('task: t\ndataset_path: json\noutput_type: multiple_choice\ntest_split: test\n'
                                     'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                                     'doc_to_target: answer\n')
    monkeypatch.setattr("jex.cli.engines.connect_prefect", lambda settings, notice=True: False)
    monkeypatch.setattr("jex.flows.lab.bakeoff", lambda job, out, machines: BakeoffSummary(
        verdict="invariant", tax={}, errors={}, out=out))


@pytest.mark.parametrize(("argv", "written"), [
    (["suite", "sample", "-o", "out"], "out"),
    (["suite", "import", "hf", "--dataset", "rows.jsonl", "--split", "test", "--question", "question", "--choices",
      "choices", "--answer", "answer", "-o", "out"], "out"),
    (["suite", "import", "lm-eval", "--task", "t.yaml", "--data-files", "test=rows.jsonl", "-o", "out"], "out"),
    (["bundle", "build", "s", "-o", "b.tar.gz"], "b.tar.gz"),
    (["score", "--suite", "s", "--predictions", "p.jsonl", "-o", "out", "--bootstrap", "20"], "out"),
    (["bakeoff", "-o", "out"], "out"),
], ids=["suite-sample", "suite-import-hf", "suite-import-lm-eval", "bundle-build", "score", "bakeoff"])
def test_a_command_that_writes_prints_its_path_last(argv, written, outputs, tmp_path):
    """As `jex run` ends with its run folder: the absolute path of what was written, on the last line."""
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / written)


def test_a_command_freezes_the_heap_before_the_interpreter_collects_it_at_exit():
    """The interpreter's last collection would walk every object a campaign imported (1.5-2 s of each exit):
    by then `jex` has frozen them, after its other exit handlers ran."""
    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0))  # runs after jex's, LIFO\n"
            "sys.argv = ['jex', '--version']\n"
            "from jex.cli import main\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "frozen True", done.stderr
