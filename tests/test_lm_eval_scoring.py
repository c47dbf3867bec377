"""lm-eval tasks are imported with all their scoring, or refused with one line: never silently re-scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jex.lm_eval_scoring import REPRODUCED_METRICS, scoring_refusal
from jex.suite import load_manifest
from tests.test_bring_your_own import run_cli, write_lm_eval_task


@pytest.fixture(scope="module")
def multiple_choice_yamls() -> dict[str, dict]:
    """Every YAML-configured multiple_choice task shipped inside the installed lm_eval, by name, its
    includes resolved and its functions left as names (lm-eval's own task index)."""
    import lm_eval.tasks
    from lm_eval.tasks._index import Kind, TaskIndex

    index = TaskIndex.build([Path(lm_eval.tasks.__file__).parent])
    return {name: e.cfg for name, e in index.items()
            if e.kind == Kind.TASK and e.cfg and e.cfg.get("output_type") == "multiple_choice"}


def test_every_shipped_multiple_choice_task_is_reproduced_or_refused_in_one_line(multiple_choice_yamls):
    assert len(multiple_choice_yamls) > 1000  # the walk found lm-eval's task tree
    accepted = refused = 0
    for name, cfg in multiple_choice_yamls.items():
        refusal = scoring_refusal(name, cfg)
        if refusal is None:  # what lm-eval would report for it is what jex computes
            reported = [m["metric"] for m in cfg.get("metric_list") or ()] or ["acc", "acc_norm"]
            assert set(reported) <= set(REPRODUCED_METRICS), name
            assert cfg.get("process_results") is None and not cfg.get("filter_list"), name
            accepted += 1
        else:
            line = refusal.line()
            assert "\n" not in line and f"task '{name}'" in line and refusal.field.split("[")[0] in line, line
            refused += 1
    assert accepted > refused > 0


@pytest.mark.parametrize(("task", "field"), [("truthfulqa_mc2", "process_results"),
                                             ("truthfulqa_mc1", None), ("arc_challenge", None),
                                             ("hellaswag", None), ("piqa", None), ("mmlu_anatomy", None),
                                             ("crows_pairs_english", "process_results")])
def test_the_leaderboard_tasks_as_shipped(multiple_choice_yamls, task, field):
    refusal = scoring_refusal(task, multiple_choice_yamls[task])
    assert (refusal.field if refusal else None) == field


def _task_with(tmp_path: Path, extra: str) -> Path:
    path = write_lm_eval_task(tmp_path / "t", "scored")
    path.write_text(path.read_text() + extra)
    return path


def test_a_task_with_its_own_process_results_is_refused_naming_the_field(tmp_path):
    task = _task_with(tmp_path, "process_results: !function utils.mass_of_true\n")
    (task.parent / "utils.py").write_text("def mass_of_true(doc, results):\n    return {'acc': 0.5}\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "task 'scored': process_results is the task's own function" in line
    assert "utils.mass_of_true" in line and not (tmp_path / "suite").exists()


def test_a_metric_jex_does_not_compute_is_refused_naming_it(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: acc\n  - metric: mcc\n    aggregation: matthews_corrcoef\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1
    assert "field 'metric_list[1].metric': task 'scored': metric_list[1].metric is 'mcc'" in result.output
    assert not (tmp_path / "suite").exists()


def test_metric_keyword_arguments_lm_eval_ignores_for_multiple_choice_import(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: acc\n    aggregation: mean\n    ignore_case: true\n"
                                "  - metric: acc_norm\n    higher_is_better: true\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    assert load_manifest(tmp_path / "suite").catalogs[0].scoring == "accuracy"


def test_the_shipped_truthfulqa_mc2_on_local_rows_is_refused(tmp_path):
    rows = tmp_path / "tqa.jsonl"
    rows.write_text(json.dumps({"question": "Is the sky blue?",
                                "mc1_targets": {"choices": ["Yes.", "No."], "labels": [1, 0]},
                                "mc2_targets": {"choices": ["Yes.", "It is blue.", "No."], "labels": [1, 1, 0]}})
                    + "\n")
    result = run_cli("suite", "import", "lm-eval", "--task", "truthfulqa_mc2", "--data-files", f"validation={rows}",
                     "-o", tmp_path / "suite")
    assert result.exit_code == 1
    assert "task 'truthfulqa_mc2': process_results is the task's own function" in result.output
    assert "process_results_mc2" in result.output and not (tmp_path / "suite").exists()
