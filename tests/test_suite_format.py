"""The suite format: every validation error names the file, the row and the field."""

from __future__ import annotations

import pytest

from jex.errors import InputError
from jex.suite import iter_rows, load_manifest
from tests.conftest import row, write_suite


def read_all(path):
    return list(iter_rows(path))


def test_valid_suite_streams_rows_in_manifest_order(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a"), row("a2", "a")], "b": [row("b1", "b", k=2)]})
    assert [r.run_id for r in read_all(suite)] == ["a1", "a2", "b1"]


def test_duplicate_run_id_names_both_places(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("x", "a")], "b": [row("x", "b")]})
    with pytest.raises(InputError) as e:
        read_all(suite)
    assert e.value.field == "run_id" and e.value.row == 1 and e.value.file.endswith("b.jsonl")
    assert "a.jsonl:1" in str(e.value)


@pytest.mark.parametrize("bad, field, words", [
    ({"gold": 4}, "gold", "out of range"),
    ({"gold": -1}, "gold", "out of range"),
    ({"labels": ["A", "B", "C"]}, "labels", "3 labels for 4 options"),
    ({"labels": ["A", "A", "B", "C"]}, "labels", "distinct"),
    ({"prompt": "   "}, "prompt", "empty prompt"),
    ({"catalog": "zzz"}, "catalog", "unknown catalog"),
    ({"options": ["x"], "labels": ["A"], "gold": 0}, "options", "at least 2"),
    ({"gold": "1"}, "gold", "integer"),
    ({"extra": 1}, "extra", "unknown field"),
])
def test_row_errors_name_file_row_and_field(tmp_path, bad, field, words):
    suite = write_suite(tmp_path, {"a": [row("a1", "a"), {**row("a2", "a"), **bad}]})
    with pytest.raises(InputError) as e:
        read_all(suite)
    assert (e.value.row, e.value.field) == (2, field)
    assert e.value.file.endswith("a.jsonl")
    assert words in str(e.value)


def test_missing_field_is_named(tmp_path):
    r = row("a1", "a")
    del r["question_id"]
    suite = write_suite(tmp_path, {"a": [r]})
    with pytest.raises(InputError) as e:
        read_all(suite)
    assert e.value.field == "question_id"


def test_row_in_another_catalogs_file_is_refused(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "b")], "b": [row("b1", "b")]})
    with pytest.raises(InputError, match="listed under 'a'"):
        read_all(suite)


def test_non_utf8_line_is_located(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]})
    with open(suite / "rows" / "a.jsonl", "ab") as f:
        f.write(b'{"run_id": "\xff\xfe"}\n')
    with pytest.raises(InputError, match="not UTF-8") as e:
        read_all(suite)
    assert e.value.row == 2


def test_invalid_json_is_located(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]})
    with open(suite / "rows" / "a.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(InputError, match="invalid JSON") as e:
        read_all(suite)
    assert e.value.row == 2


def test_manifest_leg_must_exist(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]}, legs={"public": 1.0},
                        catalogs=[{"id": "a", "leg": "eqS"}])
    with pytest.raises(InputError, match="leg 'eqS'") as e:
        load_manifest(suite)
    assert e.value.file.endswith("suite.toml")


def test_manifest_leg_without_catalog_is_refused(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]}, legs={"public": 1.0, "eqS": 1.0},
                        catalogs=[{"id": "a", "leg": "public"}])
    with pytest.raises(InputError, match="have no catalog"):
        load_manifest(suite)


def test_manifest_unknown_key_is_named(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]})
    (suite / "suite.toml").write_text((suite / "suite.toml").read_text() + "colour = 'red'\n")
    with pytest.raises(InputError) as e:
        load_manifest(suite)
    assert "colour" in str(e.value)


def test_missing_row_file_is_named(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]})
    (suite / "rows" / "a.jsonl").unlink()
    with pytest.raises(InputError, match="does not exist"):
        read_all(suite)


def test_exclusion_of_unknown_run_id_is_refused(tmp_path):
    suite = write_suite(tmp_path, {"a": [row("a1", "a")]}, catalogs=[{"id": "a", "leg": "public",
                                                                        "exclusions": ["nope"]}])
    with pytest.raises(InputError, match="excludes unknown"):
        read_all(suite)


def test_parquet_row_files_are_read(tmp_path):
    import polars as pl

    suite = write_suite(tmp_path, {"a": [row("a1", "a"), row("a2", "a", gold=2)]})
    rows = [r.model_dump(exclude={"metadata"}) for r in read_all(suite)]
    pl.DataFrame(rows).write_parquet(suite / "rows" / "a.parquet")
    toml = (suite / "suite.toml").read_text().replace("a.jsonl", "a.parquet")
    (suite / "suite.toml").write_text(toml)
    assert [r.gold for r in read_all(suite)] == [0, 2]
