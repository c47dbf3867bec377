"""Generative catalogs (issue 45, its first part): the suite format declares them (a prompt and a reference
answer per row; stop sequences, max tokens, lm-eval's filters and exact_match settings per catalog),
`jex suite import lm-eval` reads lm-eval's `generate_until` tasks into them through the harness itself (its
shipped GSM8K YAML on local documents), whatever jex does not reproduce is refused in one line
(tests/test_generation_stage.py runs them in campaigns)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from jex.cli import app
from jex.errors import InputError
from jex.suite import GenerationRow, iter_all_rows, iter_rows, load_manifest, validate_suite
from tests.conftest import GSM, gsm_task, row

pytestmark = pytest.mark.usefixtures("no_user_settings")

GENERATIVE = """
[[catalogs]]
id = "gen"
name = "Generative"
leg = "public"
files = ["rows/gen.jsonl"]
kind = "generate"
scoring = "exact_match"
prompt_format = "verbatim"
{extra}
[catalogs.generation]
until = ["\\n\\n"]
max_tokens = 32

[[catalogs.filters]]
name = "number"
steps = [{{function = "regex", regex_pattern = "(\\\\d+)"}}, {{function = "take_first"}}]

[catalogs.match]
ignore_case = true
"""


def cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args])


def mixed_suite(root: Path, *, extra: str = "", gen_rows: list[dict] | None = None) -> Path:
    """A multiple-choice catalog and a generative one."""
    (root / "rows").mkdir(parents=True)
    (root / "rows" / "mc.jsonl").write_text(json.dumps(row("m1", "mc")) + "\n")
    rows = gen_rows if gen_rows is not None else [
        {"run_id": "g1", "catalog": "gen", "question_id": "g1", "prompt": "2 + 2 =", "answer": "4"},
        {"run_id": "g2", "catalog": "gen", "question_id": "g2", "prompt": "3 + 4 =", "answer": "7"}]
    (root / "rows" / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "suite.toml").write_text('[legs]\npublic = 1.0\n\n[[catalogs]]\nid = "mc"\nname = "MC"\nleg = "public"\n'
                                     'files = ["rows/mc.jsonl"]\n' + GENERATIVE.format(extra=extra))
    return root


def test_a_generative_catalog_validates_beside_a_multiple_choice_one(tmp_path):
    suite = mixed_suite(tmp_path)
    assert validate_suite(suite) == []
    gen = load_manifest(suite).catalog("gen")
    assert gen.generation is not None and gen.generation.until == ("\n\n",) and gen.generation.max_tokens == 32
    assert [f.name for f in gen.answer_filters()] == ["number"] and gen.match.ignore_case
    assert [type(r).__name__ for r in iter_all_rows(suite)] == ["SuiteRow", "GenerationRow", "GenerationRow"]
    assert [r.run_id for r in iter_rows(suite)] == ["m1"]  # what the multiple-choice stages read


def test_a_multiple_choice_catalog_keeps_its_declared_bytes():
    from jex.suite import Catalog

    doc = Catalog(id="a", name="A", leg="public", files=("rows/a.jsonl",)).declared()
    assert not {"kind", "generation", "filters", "match", "primary_filter"} & set(doc)


@pytest.mark.parametrize(("bad", "field", "words"), [
    ({"options": ["4", "5"]}, "options", "unknown field"),
    ({"answer": None}, "answer", "string"),
    ({"prompt": " "}, "prompt", "empty prompt"),
])
def test_a_bad_generative_row_is_named_by_file_row_and_field(tmp_path, bad, field, words):
    good = {"run_id": "g1", "catalog": "gen", "question_id": "g1", "prompt": "2 + 2 =", "answer": "4"}
    suite = mixed_suite(tmp_path, gen_rows=[good, {**good, "run_id": "g2", **bad}])
    (problem,) = validate_suite(suite)
    assert (problem.row, problem.field) == (2, field) and problem.file.endswith("gen.jsonl")
    assert words in str(problem)


@pytest.mark.parametrize(("extra", "words"), [
    ('primary_filter = "other"', "primary_filter 'other' is none of its filters"),
    ('fewshot_files = ["rows/gen.jsonl"]', "few-shot examples belong in its prompts"),
])
def test_a_bad_generative_catalog_is_named_in_the_manifest(tmp_path, extra, words):
    with pytest.raises(InputError, match=words):
        load_manifest(mixed_suite(tmp_path, extra=extra))


def test_exact_match_scores_generative_catalogs_only(tmp_path):
    suite = mixed_suite(tmp_path)
    text = (suite / "suite.toml").read_text().replace('kind = "generate"\n', "")
    (suite / "suite.toml").write_text(text)
    with pytest.raises(InputError, match="exact_match scores generative catalogs"):
        load_manifest(suite)


def test_suite_ls_lists_a_generative_catalog(tmp_path):
    out = cli("suite", "ls", mixed_suite(tmp_path))
    assert out.exit_code == 0, out.output
    assert any(line.split()[:5] == ["gen", "public", "1", "2", "generate"] for line in out.output.splitlines())


# --- lm-eval's generate_until tasks ------------------------------------------------------------------

def test_an_lm_eval_generate_until_task_becomes_a_generative_catalog(tmp_path):
    out = cli("suite", "import", "lm-eval", "--task", gsm_task(tmp_path / "task"), "-o", tmp_path / "suite")
    assert out.exit_code == 0, out.output
    cat = load_manifest(tmp_path / "suite").catalog("fid_gsm")
    assert cat.kind == "generate" and cat.scoring == "exact_match" and cat.prompt_format == "verbatim"
    assert cat.generation is not None
    assert cat.generation.until == ("Question:", "</s>", "<|im_end|>") and cat.generation.max_tokens == 48
    assert [f.name for f in cat.filters] == ["strict-match", "flexible-extract"]
    assert cat.match.ignore_case and cat.match.regexes_to_ignore == (",", "\\$", "(?s).*#### ", "\\.$")
    rows = [r for r in iter_all_rows(tmp_path / "suite") if isinstance(r, GenerationRow)]
    assert [r.answer for r in rows] == [a for _, a in GSM]
    assert rows[0].prompt.endswith(f"Question: {GSM[0][0]}\nAnswer:") and rows[0].prompt.count("Question:") == 3


def test_greedy_settings_lm_eval_reads_as_greedy_import_and_a_map_without_default_round_trips(tmp_path):
    task = gsm_task(tmp_path / "task", generation="generation_kwargs:\n  until: [\"Question:\"]\n  do_sample: false\n"
                                                   "  temperature: 0.7\n",
                    filters="filter_list:\n  - name: yes-no\n    filter:\n      - function: map\n        mapping_dict:"
                            "\n          'A': 'yes'\n      - function: take_first\n")
    out = cli("suite", "import", "lm-eval", "--task", task, "-o", tmp_path / "suite")
    assert out.exit_code == 0, out.output
    (f,) = load_manifest(tmp_path / "suite").catalog("fid_gsm").filters
    assert f.steps[0].function == "map" and f.steps[0].default_value is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("override", "field"), [
    ({"metric": "metric_list:\n  - metric: bleu\n"}, "metric_list"),
    ({"generation": "generation_kwargs:\n  until: [\"\\n\"]\n  do_sample: true\n"}, "generation_kwargs"),
    ({"generation": "generation_kwargs:\n  until: [\"\\n\"]\n  min_p: 0.1\n"}, "generation_kwargs.min_p"),
    ({"filters": "filter_list:\n  - name: vote\n    filter:\n      - function: majority_vote\n"}, "filter_list[0]"),
    ({"filters": "filter_list:\n  - name: vote\n    filter:\n      - function: take_first_k\n        k: 4\n"
                 "      - function: majority_vote\n      - function: take_first\n"}, "filter_list"),
])
def test_what_jex_does_not_reproduce_of_a_generative_task_is_refused_in_one_line(tmp_path, override, field):
    out = cli("suite", "import", "lm-eval", "--task", gsm_task(tmp_path / "task", **override), "-o", tmp_path / "s")
    assert out.exit_code == 1 and "task 'fid_gsm'" in out.output and field in out.output, out.output
    assert "Traceback" not in out.output and not (tmp_path / "s").exists()


def test_a_bundle_of_generative_catalogs_alone_passes_the_preflight(tmp_path):
    """Its manifest counts no multiple-choice row, but its generative rows are rows to run."""
    from jex.cli.preflight import suite
    from jex.tasks.bundle.bundle_file import build_bundle

    root = tmp_path / "suite"
    (root / "rows").mkdir(parents=True)
    (root / "rows" / "gen.jsonl").write_text(json.dumps(
        {"run_id": "g1", "catalog": "gen", "question_id": "g1", "prompt": "2 + 2 =", "answer": "4"}) + "\n")
    (root / "suite.toml").write_text("[legs]\npublic = 1.0\n" + GENERATIVE.format(extra=""))
    bundle = build_bundle(root, tmp_path / "gen.tar.gz").path
    assert suite(bundle) == bundle
