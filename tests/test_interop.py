"""Real campaigns out and other tools' runs in: `jex export lm-eval|inspect`, `jex score --from lm-eval|inspect`.

The tools are the real ones: lm-evaluation-harness's CLI runs the embedded model (converted to a local
HF folder) on a local multiple_choice task, its own file helpers read jex's export back, and
`inspect_ai.log` reads the log jex writes. One main-job run is shared by the session (conftest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app

pytestmark = pytest.mark.slow

QUESTIONS = [  # question, choices, gold
    ("What color is a clear daytime sky?", ["green", "blue", "red", "black"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Which animal says moo?", ["cow", "cat", "dog", "duck"], 0),
    ("What is the capital of France?", ["Rome", "Berlin", "Madrid", "Paris"], 3),
    ("Water freezes at what temperature in Celsius?", ["0 degrees", "50 degrees", "100 degrees", "-40 degrees"], 0),
]
TASK = "jex_toy_mc"


def cli(*args: str) -> object:
    result = CliRunner().invoke(app, list(args))
    return result


@pytest.fixture(scope="module")
def lm_task(tmp_path_factory) -> Path:
    """A local lm-eval multiple_choice task: a YAML and its JSONL test split (absolute paths)."""
    d = tmp_path_factory.mktemp("lm-task")
    with open(d / "test.jsonl", "w") as f:
        for i, (q, choices, gold) in enumerate(QUESTIONS):
            f.write(json.dumps({"id": f"q{i}", "question": q, "choices": choices, "label": gold}) + "\n")
    (d / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'test.jsonl'}\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1.0\n")
    return d / f"{TASK}.yaml"


@pytest.fixture(scope="module")
def lm_run(lm_task, tmp_path_factory) -> Path:
    """`lm_eval run --log_samples` with the HF backend on the embedded model, converted to a local folder."""
    from jex.engine.models import resolve_model
    from jex.engine_spec import EngineSpec

    model = resolve_model(None, Path(EngineSpec().cache_dir)).path
    out = tmp_path_factory.mktemp("lm-out")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_CACHE": str(out / "hf-datasets")}
    subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                    f"pretrained={model},dtype=float32", "--tasks", TASK, "--include_path", str(lm_task.parent),
                    "--device", "cpu", "--batch_size", "8", "--limit", str(len(QUESTIONS)), "--log_samples",
                    "--output_path", str(out / "lm")], check=True, env=env, capture_output=True, timeout=600)
    return out / "lm"


def lm_results(folder: Path) -> tuple[dict, list[str]]:
    """The latest results file and the samples files, found by lm-eval's own helpers."""
    from lm_eval.utils import get_latest_filename, get_results_filenames, get_sample_results_filenames

    files = [os.path.join(dp, f) for dp, _, fs in os.walk(folder) for f in fs]
    return json.loads(Path(get_latest_filename(get_results_filenames(files))).read_text()), \
        get_sample_results_filenames(files)


@pytest.fixture(scope="module")
def imported_suite(lm_task, tmp_path_factory) -> Path:
    """The same task imported by `jex suite import lm-eval` (rows keep {"task", "doc_id"})."""
    out = tmp_path_factory.mktemp("imported") / "suite"
    result = cli("suite", "import", "lm-eval", "--task", str(lm_task), "-o", str(out))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def imported_run(imported_suite, tmp_path_factory, prefect_harness) -> Path:
    """That suite run through a jex campaign (in-process)."""
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    root = tmp_path_factory.mktemp("imported-run")
    spec = CampaignSpec(name="lmeval", suite=str(imported_suite), coverage=0.34, reason_max_tokens=8,
                        bootstrap_draws=200, store=str(root / "store"), out=str(root / "runs"),
                        machines=MachinesSpec(provider="inprocess"))
    return Path(campaign(spec))


def bundle_of(run_dir: Path) -> str:
    stages = json.loads((run_dir / "stages.json").read_text())
    return json.loads((Path(stages["bundle"]["folder"]) / "_SUCCESS.json").read_text())["bundle"]


def same_index(a: dict, b: dict) -> None:
    """Two score.json bodies agree on the index, its CI, the legs and every catalog (provenance aside)."""
    assert (a["full"], a["ci"], a["legs"]) == (b["full"], b["ci"], b["legs"])
    assert a["catalogs"] == b["catalogs"]


# --- lm-evaluation-harness -------------------------------------------------------------------------

def test_a_real_lm_eval_run_scores_to_exactly_the_accuracy_lm_eval_reports(lm_run, tmp_path):
    results, samples_files = lm_results(lm_run)
    reported = results["results"][TASK]["acc,none"]
    result = cli("score", "--from", "lm-eval", str(lm_run), "-o", str(tmp_path / "s"), "--bootstrap", "200")
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "s" / "score.json").read_text())
    assert doc["catalogs"][TASK]["n"] == len(QUESTIONS)
    assert doc["catalogs"][TASK]["acc"] == reported  # exactly, not approximately
    imported = json.loads((tmp_path / "s" / "import.json").read_text())
    assert imported["mapping"] == {TASK: "doc_id"} and imported["tasks"][TASK]["lm_eval_results_acc"] == reported
    assert sorted(imported["files"]) == sorted([*samples_files, *get_results(lm_run)])


def get_results(folder: Path) -> list[str]:
    from lm_eval.utils import get_results_filenames

    return get_results_filenames([os.path.join(dp, f) for dp, _, fs in os.walk(folder) for f in fs])


def test_lm_eval_documents_map_to_the_imported_suite_by_doc_id(lm_run, imported_suite, tmp_path):
    results, _ = lm_results(lm_run)
    result = cli("score", "--from", "lm-eval", str(lm_run), "--suite", str(imported_suite), "-o", str(tmp_path / "s"),
                 "--bootstrap", "200")
    assert result.exit_code == 0, result.output
    preds = [json.loads(x) for x in (tmp_path / "s" / "predictions.jsonl").read_text().splitlines()]
    assert [p["run_id"] for p in preds] == [f"{TASK}-{i}" for i in range(len(QUESTIONS))]
    doc = json.loads((tmp_path / "s" / "score.json").read_text())
    assert doc["catalogs"][TASK]["acc"] == results["results"][TASK]["acc,none"]
    assert not (tmp_path / "s" / "suite").exists()  # the user's suite was used, not one made from the documents


def test_a_jex_run_of_the_imported_task_exports_to_lm_eval_and_back(imported_run, imported_suite, tmp_path):
    result = cli("export", "lm-eval", str(imported_run), "-o", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    results, samples_files = lm_results(tmp_path / "out")  # lm-eval's own loaders find and name them
    from lm_eval.utils import get_file_task_name

    assert [get_file_task_name(os.path.basename(f)) for f in samples_files] == [TASK]
    run_score = json.loads((imported_run / "score.json").read_text())
    assert results["results"][TASK]["acc,none"] == run_score["catalogs"][TASK]["acc"]
    lines = [json.loads(x) for x in Path(samples_files[0]).read_text().splitlines()]
    samples = pl.read_parquet(imported_run / "samples.parquet")
    assert [ln["doc_id"] for ln in lines] == list(range(len(QUESTIONS)))  # the task's own document ids
    assert [ln["arguments"]["gen_args_0"]["arg_0"] for ln in lines] == samples["prompt"].to_list()
    assert [ln["acc"] for ln in lines] == [float(c) for c in samples["correct"].to_list()]
    assert "Every row is its own cluster" in (imported_run / "report.md").read_text()  # imported without --cluster
    back = cli("score", "--from", "lm-eval", str(tmp_path / "out"), "--suite", bundle_of(imported_run), "-o",
               str(tmp_path / "s"), "--bootstrap", "200")
    assert back.exit_code == 0, back.output
    same_index(json.loads((tmp_path / "s" / "score.json").read_text()), run_score)


# --- Inspect AI --------------------------------------------------------------------------------------

def test_inspect_export_is_read_back_with_every_sample_and_score(main_job_run, tmp_path):
    from inspect_ai.log import list_eval_logs, read_eval_log

    result = cli("export", "inspect", str(main_job_run), "-o", str(tmp_path / "logs"))
    assert result.exit_code == 0, result.output
    path = Path(result.output.strip().splitlines()[-1])
    log = read_eval_log(str(path))
    samples = pl.read_parquet(main_job_run / "samples.parquet")
    assert log.status == "success" and len(log.samples) == samples.height == 36
    by_id = {s.id: s for s in log.samples}
    assert sorted(by_id) == sorted(samples["run_id"].to_list())
    for r in samples.iter_rows(named=True):
        s = by_id[r["run_id"]]
        assert s.input == r["prompt"] and s.choices == r["options"] and s.target == r["labels"][r["gold"]]
        assert s.scores["jex"].value == ("C" if r["correct"] else "I")
        assert s.scores["jex"].answer == r["labels"][r["choice"]]
        assert s.scores["jex"].metadata["probs"] == r["final_probs"]
        if r["gated"]:
            assert s.messages[0].text == r["reason_prompt"] and r["rationale"].strip() in s.messages[1].text
    metrics = {k: m.value for k, m in log.results.scores[0].metrics.items()}
    assert metrics["accuracy"] == samples["correct"].mean()
    assert metrics["jex_index"] == json.loads((main_job_run / "score.json").read_text())["full"]
    listed = list_eval_logs(str(tmp_path / "logs"))  # what `inspect view` lists
    assert [Path(i.name).name for i in listed] == [path.name]


def test_score_from_inspect_reproduces_the_run_index(main_job_run, tmp_path):
    result = cli("export", "inspect", str(main_job_run), "-o", str(tmp_path / "logs"))
    log = result.output.strip().splitlines()[-1]
    run_score = json.loads((main_job_run / "score.json").read_text())
    spec = json.loads((main_job_run / "campaign.json").read_text())
    back = cli("score", "--from", "inspect", log, "--suite", bundle_of(main_job_run), "-o", str(tmp_path / "s"),
               "--bootstrap", str(spec["bootstrap_draws"]), "--seed", str(spec["bootstrap_seed"]))
    assert back.exit_code == 0, back.output
    same_index(json.loads((tmp_path / "s" / "score.json").read_text()), run_score)
    assert json.loads((tmp_path / "s" / "import.json").read_text())["mapping"] == \
        {c: "auto-id" for c in run_score["catalogs"]}


def test_score_from_inspect_without_a_suite_keys_rows_by_sample_id(main_job_run, tmp_path):
    """A log jex exported needs no --suite: the suite made from it keeps the run's run_ids (the sample
    ids), question_ids and labels, so every catalog scores to the run's accuracy."""
    log = cli("export", "inspect", str(main_job_run), "-o", str(tmp_path / "logs")).output.strip().splitlines()[-1]
    back = cli("score", "--from", "inspect", log, "-o", str(tmp_path / "s"), "--bootstrap", "200")
    assert back.exit_code == 0, back.output
    run_score = json.loads((main_job_run / "score.json").read_text())
    doc = json.loads((tmp_path / "s" / "score.json").read_text())
    assert {c: (v["n"], v["acc"]) for c, v in doc["catalogs"].items()} == \
        {c: (v["n"], v["acc"]) for c, v in run_score["catalogs"].items()}
    assert json.loads((tmp_path / "s" / "import.json").read_text())["mapping"] == \
        {c: "auto-id" for c in run_score["catalogs"]}
    made = pl.read_parquet(main_job_run / "samples.parquet")
    rows = [json.loads(x) for f in sorted((tmp_path / "s" / "suite" / "rows").glob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert sorted((r["run_id"], r["question_id"]) for r in rows) == sorted(made.select("run_id", "question_id").rows())


def test_renamed_lm_eval_samples_keep_their_task_and_doc_ids(lm_run, tmp_path):
    """The task is read from the files' contents (the results file's task hash), not their names."""
    import shutil

    results, samples_files = lm_results(lm_run)
    folder = tmp_path / "renamed"
    folder.mkdir()
    shutil.copyfile(samples_files[0], folder / "answers.jsonl")
    shutil.copyfile(get_results(lm_run)[0], folder / "summary_results.json")
    for source in (folder, folder / "answers.jsonl"):
        out = tmp_path / f"s-{source.name}"
        result = cli("score", "--from", "lm-eval", str(source), "-o", str(out), "--bootstrap", "200")
        assert result.exit_code == 0, result.output
        doc = json.loads((out / "score.json").read_text())
        assert doc["catalogs"][TASK]["acc"] == results["results"][TASK]["acc,none"]
        assert json.loads((out / "import.json").read_text())["mapping"] == {TASK: "doc_id"}


# --- bad inputs: a clear error naming what and where, nothing written ----------------------------------

def assert_refused(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    for n in needles:
        assert n in result.output, result.output
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no staging left over


def test_lm_eval_samples_of_another_task_are_refused(lm_run, main_job_run, tmp_path):
    _, samples_files = lm_results(lm_run)
    out = tmp_path / "s"
    result = cli("score", "--from", "lm-eval", samples_files[0], "--suite", bundle_of(main_job_run), "-o", str(out))
    assert_refused(result, out, samples_files[0], "row 1", f"task '{TASK}' is not a catalog of it",
                   "samples of another task")


def test_an_inspect_log_of_another_task_is_refused(main_job_run, imported_suite, tmp_path):
    log = cli("export", "inspect", str(main_job_run), "-o", str(tmp_path / "logs")).output.strip().splitlines()[-1]
    out = tmp_path / "s"
    result = cli("score", "--from", "inspect", log, "--suite", str(imported_suite), "-o", str(out))
    assert_refused(result, out, log, "field 'eval.task'", "a log of another task")


def test_documents_that_match_no_row_are_refused_and_nothing_is_written(lm_run, imported_suite, tmp_path):
    _, samples_files = lm_results(lm_run)
    lines = Path(samples_files[0]).read_text().splitlines()
    bad = json.loads(lines[2])
    bad["doc_id"] = 99
    lines[2] = json.dumps(bad)
    edited = tmp_path / "lm" / "model" / os.path.basename(samples_files[0])
    edited.parent.mkdir(parents=True)
    edited.write_text("\n".join(lines) + "\n")
    out = tmp_path / "s"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    result = cli("score", "--from", "lm-eval", str(edited), "--suite", str(imported_suite), "-o", str(out))
    assert_refused(result, out, str(edited), "row 3", f"task '{TASK}', doc_id 99", "matches no row of suite")


def test_an_inspect_sample_that_matches_no_row_is_refused(main_job_run, tmp_path):
    from inspect_ai.log import read_eval_log, write_eval_log

    exported = cli("export", "inspect", str(main_job_run), "-o", str(tmp_path / "logs"))
    log_path = exported.output.strip().splitlines()[-1]
    log = read_eval_log(log_path)
    victim = log.samples[4]
    victim.id = "renamed"
    victim.choices = [c + " (edited)" for c in victim.choices]
    edited = tmp_path / "edited.eval"
    write_eval_log(log, str(edited))
    out = tmp_path / "s"
    result = cli("score", "--from", "inspect", str(edited), "--suite", bundle_of(main_job_run), "-o", str(out))
    assert_refused(result, out, str(edited), "sample 'renamed'", "matches no row of suite")
