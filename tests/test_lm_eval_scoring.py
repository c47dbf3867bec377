"""lm-eval tasks are imported with all their scoring, or refused with one line: never silently re-scored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jex.lm_eval_scoring import ScoringRefusal, TaskScoring, task_scoring
from jex.suite import iter_rows, load_manifest
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
        scoring = task_scoring(name, cfg)
        if isinstance(scoring, TaskScoring):  # what lm-eval would report for it is what jex computes
            reported = [m["metric"] for m in cfg.get("metric_list") or ()] or ["acc", "acc_norm"]
            assert set(reported) <= set(scoring.metrics), name
            assert (cfg.get("process_results") is None) == (scoring.scoring == "accuracy"), name
            assert not cfg.get("filter_list"), name
            accepted += 1
        else:
            refusal = scoring
            line = refusal.line()
            assert "\n" not in line and f"task '{name}'" in line and refusal.field.split("[")[0] in line, line
            refused += 1
    assert accepted > refused > 0


@pytest.mark.parametrize(("task", "scored_by"), [
    ("truthfulqa_mc2", "true_mass"), ("truthfulqa_mc1", "accuracy"), ("arc_challenge", "accuracy"),
    ("hellaswag", "accuracy"), ("piqa", "accuracy"), ("mmlu_anatomy", "accuracy"), ("winogrande", "accuracy"),
    ("crows_pairs_english", "refused: process_results"),
    ("truthfulqa-multi_mc2_en", "refused: process_results"),  # its mc2 sums in Python's order: other bits
])
def test_the_leaderboard_tasks_as_shipped(multiple_choice_yamls, task, scored_by):
    scoring = task_scoring(task, multiple_choice_yamls[task])
    assert (f"refused: {scoring.field}" if isinstance(scoring, ScoringRefusal) else scoring.scoring) == scored_by


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
    task = _task_with(tmp_path, "metric_list:\n  - metric: acc\n  - metric: acc_mutual_info\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1
    assert "field 'metric_list[1].metric': task 'scored': metric_list[1].metric is 'acc_mutual_info'" in result.output
    assert not (tmp_path / "suite").exists()


def test_the_metrics_a_task_reports_are_recorded_for_the_export(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: acc\n  - metric: acc_bytes\n  - metric: mcc\n"
                                "    aggregation: matthews_corrcoef\n  - metric: brier_score\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    manifest = load_manifest(tmp_path / "suite")
    assert manifest.source["tasks"]["scored"]["metrics"] == ["acc", "acc_bytes", "mcc", "brier_score"]
    assert manifest.catalogs[0].scoring == "accuracy"  # jex's own skill stays the catalog's accuracy


def test_an_aggregation_other_than_lm_evals_own_is_refused(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: mcc\n    aggregation: mean\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1
    assert "metric_list[0].aggregation of mcc is 'mean'; jex aggregates it by lm-eval's matthews_corrcoef" \
        in result.output


def test_binary_f1_on_rows_of_more_than_two_choices_is_refused_naming_the_row(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: f1\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and "row scored-0" in line and "binary F1" in line, line
    assert not (tmp_path / "suite").exists()


def test_metric_keyword_arguments_lm_eval_ignores_for_multiple_choice_import(tmp_path):
    task = _task_with(tmp_path, "metric_list:\n  - metric: acc\n    aggregation: mean\n    ignore_case: true\n"
                                "  - metric: acc_norm\n    higher_is_better: true\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    assert load_manifest(tmp_path / "suite").catalogs[0].scoring == "accuracy"


def test_the_shipped_truthfulqa_mc2_imports_as_a_true_mass_catalog(tmp_path):
    rows = tmp_path / "tqa.jsonl"
    rows.write_text(json.dumps({"question": "Is the sky blue?",
                                "mc1_targets": {"choices": ["Yes.", "No."], "labels": [1, 0]},
                                "mc2_targets": {"choices": ["Yes.", "It is blue.", "No."], "labels": [1, 1, 0]}})
                    + "\n")
    result = run_cli("suite", "import", "lm-eval", "--task", "truthfulqa_mc2", "--data-files", f"validation={rows}",
                     "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    (cat,) = load_manifest(tmp_path / "suite").catalogs
    (row,) = iter_rows(tmp_path / "suite")
    assert (cat.scoring, cat.readout) == ("true_mass", "loglikelihood")
    assert (row.options, row.gold, row.true_options) == (["Yes.", "It is blue.", "No."], 0, [0, 1])
    assert row.prompt.endswith("Q: Is the sky blue?\nA:")  # lm-eval's own six-shot preamble before it


def test_a_copy_of_mc2_that_sums_in_another_order_is_refused(tmp_path):
    task = _task_with(tmp_path, "process_results: !function utils.process_results_mc2\n")
    (task.parent / "utils.py").write_text(
        "def process_results_mc2(doc, results):\n    lls, _ = zip(*results)\n    return {'acc': sum(lls)}\n")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1 and "process_results is the task's own function" in result.output


def _winogrande_task(tmp_path: Path, extra: str = "") -> Path:
    """lm-eval's own Winogrande YAML pointed at two local rows."""
    import lm_eval.tasks

    rows = tmp_path / "wino.jsonl"
    docs = (("The trophy does not fit in the suitcase because the _ is too big.", "trophy", "suitcase", "1"),
            ("Anna thanked Maria because _ had helped her move.", "Anna", "Maria", "2"))
    rows.write_text("".join(json.dumps({"sentence": s, "option1": a, "option2": b, "answer": g}) + "\n"
                            for s, a, b, g in docs))
    shipped = Path(lm_eval.tasks.__file__).parent / "winogrande" / "default.yaml"
    task = tmp_path / "wino.yaml"
    task.write_text(f"include: {shipped}\ntask: wino\ndataset_path: json\ndataset_name: null\ntraining_split: null\n"
                    f"dataset_kwargs:\n  data_files:\n    validation: {rows}\n{extra}")
    return task


def test_winogrande_imports_as_partial_evaluation(tmp_path):
    result = run_cli("suite", "import", "lm-eval", "--task", _winogrande_task(tmp_path), "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    (cat,) = load_manifest(tmp_path / "suite").catalogs
    first, second = iter_rows(tmp_path / "suite")
    assert (cat.readout, cat.prompt_format, cat.scoring) == ("partial_loglikelihood", "verbatim", "accuracy")
    assert first.options == ["The trophy does not fit in the suitcase because the trophy",
                             "The trophy does not fit in the suitcase because the suitcase"]
    assert (first.prompt, first.gold, second.gold) == ("is too big.", 0, 1)  # the one continuation; answer "2" -> 1


def test_a_multiple_input_task_asking_for_acc_norm_is_refused(tmp_path):
    result = run_cli("suite", "import", "lm-eval", "--task", _winogrande_task(tmp_path, "metric_list: null\n"),
                     "-o", tmp_path / "suite")
    assert result.exit_code == 1 and "task 'wino': metric_list is lm-eval's default (acc and acc_norm)" in result.output
