"""The embedded sample suite: deterministic, valid, checkable, with one positional catalog."""

from __future__ import annotations

import collections
import re
from datetime import date, timedelta

from jex.sample_suite import CATALOGS, WEEKDAYS, write_sample_suite
from jex.suite import iter_rows, load_manifest


def test_same_seed_same_bytes_and_other_seed_differs(tmp_path):
    a = write_sample_suite(tmp_path / "a", rows=200, seed=3)
    b = write_sample_suite(tmp_path / "b", rows=200, seed=3)
    c = write_sample_suite(tmp_path / "c", rows=200, seed=4)
    for cid, *_ in CATALOGS:
        assert (a / "rows" / f"{cid}.jsonl").read_bytes() == (b / "rows" / f"{cid}.jsonl").read_bytes()
    assert (a / "rows" / "arith.jsonl").read_bytes() != (c / "rows" / "arith.jsonl").read_bytes()


def test_shape_legs_and_row_count(sample_suite):
    manifest = load_manifest(sample_suite)
    rows = list(iter_rows(sample_suite))
    assert len(rows) == 360 and len(manifest.catalogs) >= 8
    assert set(manifest.legs) == {"public", "eqS", "eqO"} and manifest.legs["eqS"] == 0.5
    assert {len(r.options) for r in rows} == {2, 3, 4, 5}


def test_gold_answers_are_right(sample_suite):
    checked = 0
    for r in iter_rows(sample_suite):
        gold = r.options[r.gold]
        if m := re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", r.prompt):
            assert int(gold) == eval(f"{m[1]} {m[2]} {m[3]}")
            checked += 1
        elif m := re.fullmatch(r"Which number is larger: (\d+) or (\d+)\?", r.prompt):
            assert int(gold) == max(int(m[1]), int(m[2]))
            checked += 1
        elif m := re.fullmatch(r"If today is (\w+), what day of the week is it (\d+) days from now\?", r.prompt):
            monday = date(2024, 1, 1)
            day = monday + timedelta(WEEKDAYS.index(m[1]) + int(m[2]))
            assert gold == day.strftime("%A")
            checked += 1
        elif r.catalog == "word_order":
            assert gold == min(r.options)
            checked += 1
        elif r.catalog == "sorted_max":
            assert int(gold) == max(map(int, r.options))
            checked += 1
    assert checked > 150


def test_positional_catalog_puts_gold_mostly_last(tmp_path):
    suite = write_sample_suite(tmp_path, rows=900)
    golds = collections.Counter(r.gold for r in iter_rows(suite) if r.catalog == "sorted_max")
    assert golds[3] / sum(golds.values()) > 0.8


def test_some_questions_have_two_rows(sample_suite):
    clusters = collections.Counter(r.question_id for r in iter_rows(sample_suite))
    assert max(clusters.values()) == 2 and min(clusters.values()) == 1
