"""Every TOML file jex writes reads back equal through `tomllib`: one writer (`jex.fileio`, over tomli-w),
None refused with one line naming its key, every control character escaped, and no hand-written
TOML writer left in the rooms."""

from __future__ import annotations

import ast
import datetime as dt
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jex.errors import InputError
from jex.fileio import toml_tables_text, toml_text, write_toml

ROOT = Path(__file__).resolve().parent.parent
CONTROL = [chr(i) for i in range(0x20)] + ["\x7f"]
"""Every control character TOML forbids raw in a basic string (tab included: it must round-trip too)."""

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None)
pytestmark = pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies")
"""Hypothesis notes a change of the global `random` state while it draws; these strategies use none, but in
`make test` a thread another test file left in the worker (Prefect draws its jitter from the global `random`)
may draw meanwhile, and the note then names a test of this file."""

text = st.text(st.characters(codec="utf-8") | st.sampled_from(CONTROL), max_size=12)
scalars = (text | st.booleans() | st.integers(-(2 ** 63), 2 ** 63 - 1) | st.floats(allow_nan=True)
           | st.dates() | st.datetimes())
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                      max_leaves=20)
documents = st.dictionaries(text, values, max_size=6)
tables = st.dictionaries(text, values, max_size=4)


def same(a: Any, b: Any) -> bool:
    """Equal, NaN equal to NaN and -0.0 told from 0.0 (what `==` would let through)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@PROPERTY
@given(doc=documents)
def test_every_document_reads_back_equal(doc):
    assert same(tomllib.loads(toml_text(doc)), doc)


@PROPERTY
@given(old=st.lists(tables, max_size=3), new=st.lists(tables, min_size=1, max_size=3), name=text)
def test_tables_appended_after_others_read_back_as_one_array(old, new, name):
    """The ledger's append: however short, each new table is a `[[name]]` table after the old ones."""
    head = toml_tables_text(name, old)
    appended = head + ("\n" if head else "") + toml_tables_text(name, new)
    assert appended.startswith(head)
    assert same(tomllib.loads(appended), {name: old + new} if old or new else {})


@pytest.mark.parametrize("c", CONTROL, ids=[f"0x{ord(c):02x}" for c in CONTROL])
def test_every_control_character_round_trips_in_keys_values_arrays_and_tables(c):
    def doc(c: str) -> dict[str, Any]:
        return {f"k{c}": f"a{c}b", "array": [c, f"{c}{c}"], "table": {c: c}, "tables": [{"v": c}, {c: [c]}]}

    written = toml_text(doc(c))
    assert tomllib.loads(written) == doc(c)
    # escaped (`\uXXXX`, or `\n`, `\b` ...), never raw: the text has the lines and characters it has for "x"
    assert c == "\t" or written.count(c) == toml_text(doc("x")).count(c)


def test_what_the_old_writer_got_wrong():
    """`toml_value` wrote `[1, None]` as `[1, "None"]` and a DEL raw (a file tomllib refuses)."""
    with pytest.raises(InputError):
        toml_text({"a": [1, None]})
    assert tomllib.loads(toml_text({"s": "a\x7fb"})) == {"s": "a\x7fb"}


@pytest.mark.parametrize(("doc", "where"), [
    ({"revision": None}, "revision"),
    ({"source": {"columns": {"id": None}}}, "source.columns.id"),
    ({"catalogs": [{"id": "a"}, {"id": "b", "chance": None}]}, "catalogs[1].chance"),
    ({"ci": [0.1, None]}, "ci[1]"),
    ({"m": [[1], [2, None]]}, "m[1][1]"),
])
def test_none_is_refused_with_one_line_naming_its_key(tmp_path, doc, where):
    with pytest.raises(InputError) as refused:
        toml_text(doc)
    message = str(refused.value)
    assert "\n" not in message and f"field '{where}'" in message and "TOML has no null" in message
    path = tmp_path / "suite.toml"
    with pytest.raises(InputError) as refused:
        write_toml(path, doc)
    assert f"file {path}" in str(refused.value) and refused.value.field == where
    assert not path.exists()  # nothing half-written


@PROPERTY
@given(doc=documents, data=st.data())
def test_a_none_anywhere_is_refused(doc, data):
    """None put at any depth of any document is refused, and the message names the key path to it."""
    wrapper: dict[str, Any] = {"root": doc}
    node: Any = wrapper
    key: str | int = "root"
    where = "root"
    while isinstance(node[key], dict | list) and node[key] and data.draw(st.booleans()):
        node = node[key]
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        where += f"[{key}]" if isinstance(key, int) else f".{key}"
    node[key] = None
    with pytest.raises(InputError) as refused:
        toml_text(wrapper)
    assert refused.value.field == where and "\n" not in str(refused.value).replace(where, "")


def test_write_toml_with_a_comment_reads_back_and_returns_its_sha256(tmp_path):
    import hashlib

    doc = {"name": "s", "legs": {"public": 1.0}, "catalogs": [{"id": "a", "files": ["rows/a.jsonl"]}]}
    sha = write_toml(tmp_path / "suite.toml", doc, comment="generated by a test")
    data = (tmp_path / "suite.toml").read_bytes()
    assert data.startswith(b"# generated by a test\n") and hashlib.sha256(data).hexdigest() == sha
    assert tomllib.loads(data.decode()) == doc
    with pytest.raises(ValueError, match="control character"):
        toml_text({}, comment="a\x7f")


def test_a_short_ledger_entry_is_still_an_array_table(tmp_path):
    from jex.tasks.decisions import Decision, append_decisions, read_decisions

    ledger = tmp_path / "ledger.toml"
    first = Decision(kind="campaign", subject="r", status="DONE", source="s", date="d", index=float("nan"))
    append_decisions(ledger, [first])
    before = ledger.read_bytes()
    second = Decision(kind="campaign", subject="q\x7f", status="DONE", source="s", date="d", ci=[0.1, float("nan")])
    append_decisions(ledger, [second])
    assert ledger.read_bytes().startswith(before)  # earlier entries keep their bytes
    assert ledger.read_text().count("[[decisions]]") == 2
    back = read_decisions(ledger)
    assert back[0] == first.model_copy(update={"index": None})  # a NaN index is left out, not written "None"
    assert back[1].subject == "q\x7f" and back[1].ci is not None and math.isnan(back[1].ci[1])


HEADER = re.compile(r"\s*\[\[?[\w.\"-]+\]\]?\s*")
NOT_HEADERS = {"[invalid]"}
"""Strings of that shape that are no TOML: lm-eval's regex-filter fallback answer (`jex.answer_extraction`)."""
ROOMS = ("jex", "engine", "tasks", "lab", "flows", "infra", "overlays", "deployments")


def test_no_hand_written_toml_writer_is_left():
    """No room writes a TOML table header as a string (`"[[catalogs]]"`, `"[legs]"`), calls the old
    `toml_value` or imports tomli-w itself: `jex.fileio` is the one writer."""
    found = []
    for path in (p for room in ROOMS for p in sorted((ROOT / room).rglob("*.py"))):
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and HEADER.fullmatch(node.value) \
                    and node.value not in NOT_HEADERS:
                found.append(f"{where}:{node.lineno} {node.value!r}")
            elif isinstance(node, ast.Name) and node.id == "toml_value":
                found.append(f"{where}:{node.lineno} toml_value")
            elif isinstance(node, ast.Import | ast.ImportFrom) and where != Path("jex/fileio.py"):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{where}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "tomli_w"]
    assert not found, found


def test_dates_round_trip():
    doc = {"d": dt.date(1, 1, 1), "t": dt.datetime(2026, 12, 3, 4, 5, 6, 789)}
    assert tomllib.loads(toml_text(doc)) == doc
