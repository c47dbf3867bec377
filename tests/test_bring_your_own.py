"""Bringing a benchmark and a model in: Hugging Face datasets and lm-eval tasks become suites, a Hub
id in a local Hub cache becomes the model, and both run through `jex run`."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.errors import InputError
from jex.suite import iter_fewshot_rows, iter_rows, load_manifest, validate_suite
from jex.suite_import import import_hf

QUESTIONS = [("q1", "What colour is a clear daytime sky?", ["blue", "green", "red"]),
             ("q2", "How many legs does a spider have?", ["six", "eight", "ten", "four"]),
             ("q3", "Which is a prime number?", ["4", "9", "7"]),
             ("q4", "What is frozen water called?", ["steam", "ice"]),
             ("q5", "Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury"]),
             ("q6", "What do bees make?", ["honey", "milk", "silk"])]
GOLD = {"q1": 0, "q2": 1, "q3": 2, "q4": 1, "q5": 2, "q6": 0}


def run_cli(*args: str) -> object:
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture()
def parquet_dataset(tmp_path) -> Path:
    path = tmp_path / "data" / "test.parquet"
    path.parent.mkdir()
    pl.DataFrame({"id": [q for q, _, _ in QUESTIONS], "question": [t for _, t, _ in QUESTIONS],
                  "choices": [c for _, _, c in QUESTIONS], "answer": [GOLD[q] for q, _, _ in QUESTIONS]}
                 ).write_parquet(path)
    return path


def test_hf_import_of_local_parquet_keeps_every_row(parquet_dataset, tmp_path):
    result = import_hf(str(parquet_dataset), tmp_path / "suite", split="test", question="question",
                       choices="choices", answer="answer", id_col="id", catalog="trivia")
    rows = list(iter_rows(result.suite_dir))
    assert [(r.run_id, r.prompt, r.options, r.gold) for r in rows] == \
        [(f"trivia-{q}", t, c, GOLD[q]) for q, t, c in QUESTIONS]
    assert all(r.labels == list("ABCD"[:len(r.options)]) for r in rows)
    source = load_manifest(result.suite_dir).source
    assert source["importer"] == "hf" and source["files"]["test.parquet"] and source["fingerprint"]


def test_hf_import_understands_answers_as_index_letter_label_or_text(tmp_path):
    records = [{"id": 1, "q": "A?", "choices": {"text": ["x", "y", "z"], "label": ["1", "2", "3"]}, "a": "2"},
               {"id": 2, "q": "B?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "a": "B"},
               {"id": 3, "q": "C?", "choices": {"text": ["red", "blue"], "label": ["A", "B"]}, "a": "blue"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = import_hf(str(path), tmp_path / "suite", split="validation", question="q", choices="choices",
                       answer="a", id_col="id")
    rows = list(iter_rows(result.suite_dir))
    assert [r.gold for r in rows] == [1, 1, 1]
    assert rows[0].labels == ["1", "2", "3"]


@pytest.mark.parametrize("mutate, field, message", [
    (lambda r: r, "--choices nope", "no column 'nope'"),
    (lambda r: {**r, "answer": 7 if r["id"] == "q3" else r["answer"]}, "answer", "out of range"),
    (lambda r: {**r, "answer": "Pluto" if r["id"] == "q3" else str(r["answer"])}, "answer", "'Pluto'"),
    (lambda r: {**r, "id": "q1"}, "id", "duplicate id 'q1'"),
])
def test_bad_datasets_are_refused_naming_the_field_and_nothing_is_written(tmp_path, mutate, field, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(mutate({"id": q, "question": t, "choices": c, "answer": GOLD[q]})) + "\n"
                            for q, t, c in QUESTIONS))
    choices = "nope" if field.startswith("--choices") else "choices"
    with pytest.raises(InputError) as err:
        import_hf(str(path), tmp_path / "suite", split="test", question="question", choices=choices,
                  answer="answer", id_col="id")
    assert f"field '{field}'" in str(err.value) and message in str(err.value)
    if field != "--choices nope":
        assert "row 2" in str(err.value) or field == "id"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]  # no suite, no temp folder


def test_validate_reports_every_problem_with_file_row_and_field(tmp_path):
    from tests.conftest import row, write_suite

    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a"), row("a2", "a", gold=9), row("a3", "a", k=1)],
                                         "b": [row("b1", "b"), row("a1", "b")]})
    problems = validate_suite(suite)
    where = [(Path(p.file).name, p.row, p.field) for p in problems]
    assert where == [("a.jsonl", 2, "gold"), ("a.jsonl", 3, "options"), ("b.jsonl", 2, "run_id")]
    result = run_cli("suite", "validate", suite)
    assert result.exit_code == 1 and "3 problem(s)" in result.output


def test_suite_ls_shows_catalogs_rows_options_chance_and_legs(tmp_path):
    from tests.conftest import row, write_suite

    suite = write_suite(tmp_path / "s", {"a": [row("a1", "a", k=2), row("a2", "a", k=4)], "b": [row("b1", "b")]},
                        legs={"public": 2.0, "eqS": 1.0},
                        catalogs=[{"id": "a", "leg": "public", "weight": 3.0}, {"id": "b", "leg": "eqS"}])
    out = run_cli("suite", "ls", suite).output
    assert "legs public=2, eqS=1" in out
    assert [line.split()[:6] for line in out.splitlines()[2:4]] == [["a", "public", "3", "2", "2-4", "0.3750"],
                                                                    ["b", "eqS", "1", "1", "4", "0.2500"]]


# --- lm-evaluation-harness tasks ----------------------------------------------------------------------

TASK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    train: {shots}
output_type: {output_type}
test_split: test
fewshot_split: train
num_fewshot: 1
description: "Answer the question.\\n\\n"
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def write_lm_eval_task(folder: Path, name: str = "trivia", output_type: str = "multiple_choice",
                       questions=QUESTIONS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(
        json.dumps({"question": t, "choices": c, "answer": GOLD[q]}) + "\n" for q, t, c in questions))
    (folder / f"{name}-shots.jsonl").write_text(json.dumps({"question": "What is 1 + 1?", "choices": ["2", "3"],
                                                            "answer": 0}) + "\n")
    path = folder / f"{name}.yaml"
    path.write_text(TASK_YAML.format(name=name, data=folder / f"{name}.jsonl", shots=folder / f"{name}-shots.jsonl",
                                     output_type=output_type))
    return path


@pytest.fixture(scope="module")
def lm_eval_suite(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval")
    task = write_lm_eval_task(folder / "task")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", folder / "suite")
    assert result.exit_code == 0, result.output
    return folder / "suite"


def test_lm_eval_task_is_read_through_the_harness_with_doc_ids_and_few_shot_rows(lm_eval_suite):
    rows = list(iter_rows(lm_eval_suite))
    assert [(r.run_id, r.metadata) for r in rows] == [(f"trivia-{i}", {"task": "trivia", "doc_id": i})
                                                      for i in range(len(QUESTIONS))]
    # lm-eval's own context: the description, its one few-shot example (answered, fewshot_delimiter after
    # it), then the question; read verbatim, each option a continuation after the target delimiter
    assert [r.prompt for r in rows] == [f"Answer the question.\n\nQuestion: What is 1 + 1?\nAnswer: 2\n\n"
                                        f"Question: {t}\nAnswer:" for _, t, _ in QUESTIONS]
    assert [(r.options, r.gold) for r in rows] == [(c, GOLD[q]) for q, c in ((q, c) for q, _, c in QUESTIONS)]
    assert [r.question_id for r in rows] == [r.run_id for r in rows]  # no --cluster: every row its own cluster
    shots = list(iter_fewshot_rows(lm_eval_suite))
    assert [(s.prompt, s.options, s.gold) for s in shots] == [("Question: What is 1 + 1?\nAnswer:", ["2", "3"], 0)]
    manifest = load_manifest(lm_eval_suite)
    assert manifest.source["tasks"]["trivia"]["num_fewshot"] == 1
    assert (manifest.source["importer"], manifest.source["chat_template"]) == ("lm-eval", "none")
    cat = manifest.catalogs[0]
    assert (cat.readout, cat.prompt_format, cat.target_delimiter, cat.scoring) == \
        ("loglikelihood", "verbatim", " ", "accuracy")


MMLU_YAML = """\
task: letters
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}\\n{{% for c in choices %}}{{{{'ABCD'[loop.index0]}}}}. {{{{c}}}}\\n{{% endfor %}}Answer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
"""


def test_lm_eval_letter_task_keeps_the_letters_as_options_and_clusters_by_a_doc_field(tmp_path):
    """MMLU style: the options are in the prompt already, the choices are the letters (once, not as a
    second option block), and --cluster makes rows of one question one bootstrap cluster."""
    data = tmp_path / "letters.jsonl"
    data.write_text("".join(json.dumps({"question": f"Q{i}?", "choices": ["w", "x", "y", "z"], "answer": i % 4,
                                        "topic": f"t{i // 2}"}) + "\n" for i in range(4)))
    (tmp_path / "letters.yaml").write_text(MMLU_YAML.format(data=data))
    result = run_cli("suite", "import", "lm-eval", "--task", tmp_path / "letters.yaml", "--cluster", "topic",
                     "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    rows = list(iter_rows(tmp_path / "suite"))
    assert rows[1].prompt == "Q1?\nA. w\nB. x\nC. y\nD. z\nAnswer:"
    assert [(r.options, r.labels, r.gold) for r in rows][:2] == [(["A", "B", "C", "D"], ["A", "B", "C", "D"], 0),
                                                               (["A", "B", "C", "D"], ["A", "B", "C", "D"], 1)]
    assert [r.question_id for r in rows] == ["letters-t0", "letters-t0", "letters-t1", "letters-t1"]
    missing = run_cli("suite", "import", "lm-eval", "--task", tmp_path / "letters.yaml", "--cluster", "nope",
                      "-o", tmp_path / "suite2")
    assert missing.exit_code != 0 and "field '--cluster nope'" in missing.output and "topic" in missing.output
    assert not (tmp_path / "suite2").exists()


def test_hf_import_clusters_by_a_column(parquet_dataset, tmp_path):
    pl.read_parquet(parquet_dataset).with_columns(topic=pl.Series(["a", "a", "b", "b", "c", "c"])) \
        .write_parquet(parquet_dataset)
    result = run_cli("suite", "import", "hf", "--dataset", parquet_dataset, "--split", "test", "--question",
                     "question", "--choices", "choices", "--answer", "answer", "--id", "id", "--cluster", "topic",
                     "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    rows = list(iter_rows(tmp_path / "suite"))
    assert [r.question_id for r in rows] == ["test-a", "test-a", "test-b", "test-b", "test-c", "test-c"]
    assert load_manifest(tmp_path / "suite").source["columns"]["cluster"] == "topic"


def test_lm_eval_group_becomes_catalogs_weighted_by_size(tmp_path):
    write_lm_eval_task(tmp_path, "alpha", questions=QUESTIONS[:2])
    write_lm_eval_task(tmp_path, "beta", questions=QUESTIONS[2:])
    (tmp_path / "both.yaml").write_text("group: both\ntask:\n  - alpha\n  - beta\naggregate_metric_list:\n"
                                        "  - metric: acc\n    weight_by_size: true\n")
    result = run_cli("suite", "import", "lm-eval", "--task", tmp_path / "both.yaml", "-o", tmp_path / "suite")
    assert result.exit_code == 0, result.output
    assert [(c.id, c.weight) for c in load_manifest(tmp_path / "suite").catalogs] == [("alpha", 2.0), ("beta", 4.0)]


def test_lm_eval_task_neither_multiple_choice_nor_generative_is_refused(tmp_path):
    task = write_lm_eval_task(tmp_path / "t", "ppl", output_type="loglikelihood_rolling")
    result = run_cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert result.exit_code == 1 and "task 'ppl': output_type is 'loglikelihood_rolling', not multiple_choice" \
        in result.output
    assert not (tmp_path / "suite").exists()


# --- models from a Hub cache --------------------------------------------------------------------------

def test_hub_id_missing_from_an_offline_cache_names_the_id(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from jex.engine.models import resolve_hub
    from jex.engine.types import EngineDeadError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EngineDeadError, match="model 'nobody/nothing' is not in the local Hub cache"):
        resolve_hub("nobody/nothing", cache_dir=tmp_path)


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch, embedded_model_dir):
    """A local Hub cache with the embedded model as `jex-test/smol-base` (its chat template removed: a
    base model) and offline mode on, in this process and in any it starts."""
    from huggingface_hub import constants

    from tests.conftest import write_hub_cache

    cache = tmp_path / "hub"
    commit = write_hub_cache(cache, "jex-test/smol-base", embedded_model_dir, drop_chat_template=True)
    for name, value in (("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", True)):
        monkeypatch.setattr(constants, name, str(value) if name == "HF_HUB_CACHE" else value)
        monkeypatch.setenv(name, "1" if value is True else str(value))
    return commit


def test_hub_model_fingerprint_records_repo_commit_and_blob_hashes(offline_hub):
    from jex.engine.fingerprint import engine_fingerprint
    from jex.engine_spec import EngineSpec

    fp = engine_fingerprint(EngineSpec(model="jex-test/smol-base"))
    assert fp.hub is not None and (fp.hub.repo, fp.hub.commit) == ("jex-test/smol-base", offline_hub)
    pinned = engine_fingerprint(EngineSpec(model=f"jex-test/smol-base@{offline_hub}"))
    assert pinned.weights_sha256 == fp.weights_sha256


@pytest.mark.slow
def test_imported_suites_run_with_a_hub_base_model_and_few_shot_prompts(parquet_dataset, lm_eval_suite, tmp_path,
                                                                       offline_hub, prefect_harness):
    import_hf(str(parquet_dataset), tmp_path / "hf-suite", split="test", question="question", choices="choices",
              answer="answer", id_col="id", catalog="trivia")
    common = ["--provider", "inprocess", "--coverage", "0.34", "--reason-max-tokens", "4", "--out", tmp_path / "runs"]
    runs = {}
    for name, suite, extra in (
            ("hub", tmp_path / "hf-suite", ["--model", "jex-test/smol-base", "--chat-template", "none"]),
            ("fewshot", lm_eval_suite, ["--chat-template", "none", "--num-fewshot", "1"])):
        result = run_cli("run", "--name", name, "--suite", suite, *extra, *common)
        assert result.exit_code == 0, result.output
        runs[name] = Path(result.output.strip().splitlines()[-1])
    for name, suite in (("hub", tmp_path / "hf-suite"), ("fewshot", lm_eval_suite)):
        predictions = pl.read_parquet(runs[name] / "predictions.parquet")
        inputs = list(iter_rows(suite))
        assert predictions["run_id"].to_list() == [r.run_id for r in inputs]  # every row, in suite order
        for r, probs in zip(inputs, predictions["probs"].to_list(), strict=True):
            assert len(probs) == len(r.options) and abs(sum(probs) - 1) < 1e-9
        samples = pl.read_parquet(runs[name] / "samples.parquet")
        assert samples["gold"].to_list() == [r.gold for r in inputs]  # row by row against the inputs
        assert samples["options"].to_list() == [list(r.options) for r in inputs]
        assert samples["correct"].to_list() == [c == r.gold for c, r in zip(samples["choice"], inputs, strict=True)]
        assert not any("<|im_start|>" in p for p in samples["prompt"].to_list())  # plain text: no chat template
        score = json.loads((runs[name] / "score.json").read_text())
        assert score["catalogs"]["trivia"]["n"] == len(inputs)
        assert score["catalogs"]["trivia"]["correct"] == sum(samples["correct"].to_list())
    stages = json.loads((runs["hub"] / "stages.json").read_text())
    fast = json.loads((Path(stages["fast_pass"]["folder"]) / "_SUCCESS.json").read_text())
    assert fast["engine"]["hub"] == {"repo": "jex-test/smol-base", "commit": offline_hub}
