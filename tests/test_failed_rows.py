"""Rows that fail inside a batch: retried by the row policy, recorded beside their shard and in the stage
summary, named in the results, and a retry of the stage sends only them to the engine again."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from jex.engine.types import EngineDeadError, EngineError
from jex.tasks.capture.batch_errors import RowRetryPolicy
from jex.tasks.documents import FoldDoc, failed_rows_line
from jex.tasks.records import FailedRow, FailedRows
from jex.tasks.store import ShardRows, carry_failed_rows, run_sharded, stage_failed_rows

NO_WAIT = RowRetryPolicy(attempts=3, backoff_s=0)


# --- run_sharded: the record beside the shard, and a retry of only the failed rows ------------------

def computing(failing: set[str], sent: list[list[str]]):
    """A shard's compute that fails (recorded, refusal `batch error`) the rows in `failing`."""
    def compute(chunk):
        sent.append(list(chunk))
        frame = pl.DataFrame({"run_id": list(chunk), "refusal": ["batch error: x" if c in failing else None
                                                                  for c in chunk]},
                             schema={"run_id": pl.String, "refusal": pl.String})
        return ShardRows(frame, [FailedRow(run_id=c, attempts=3, error_type="EngineError", error="x")
                                 for c in chunk if c in failing])
    return compute


ITEMS = [f"r{i}" for i in range(6)]  # shards of 3: r0-r2, r3-r5


def test_a_shard_keeps_the_record_of_its_failed_rows_and_a_retry_computes_only_them(tmp_path):
    first, sent = tmp_path / "old" / "shards-3", []
    run_sharded(ITEMS, shard_rows=3, folder=first, compute=computing({"r4"}, sent))
    assert sorted(p.name for p in first.iterdir()) == ["shard-00000.parquet", "shard-00001.failed.json",
                                                      "shard-00001.parquet"]
    assert FailedRows.model_validate_json((first / "shard-00001.failed.json").read_text()).rows[0].run_id == "r4"

    fresh = tmp_path / "new"
    assert carry_failed_rows(tmp_path / "old", fresh) == 1
    assert sorted(p.name for p in (fresh / "shards-3").iterdir()) == [
        ".shard-00001.partial.parquet", "shard-00000.parquet", "shard-00001.failed.json"]
    sent.clear()
    stats = run_sharded(ITEMS, shard_rows=3, folder=fresh / "shards-3", compute=computing({"r4"}, sent))
    assert sent == [["r4"]] and stats.computed == [1] and stats.reused == [0] and stats.computed_rows == 1
    record = FailedRows.model_validate_json((fresh / "shards-3" / "shard-00001.failed.json").read_text())
    assert [(r.run_id, r.attempts) for r in record.rows] == [("r4", 6)]  # its tries over both computations

    sent.clear()
    carry_failed_rows(fresh, tmp_path / "third")
    run_sharded(ITEMS, shard_rows=3, folder=tmp_path / "third" / "shards-3", compute=computing(set(), sent))
    third = tmp_path / "third" / "shards-3"
    assert sent == [["r4"]] and sorted(p.name for p in third.iterdir()) == ["shard-00000.parquet",
                                                                           "shard-00001.parquet"]
    clean = tmp_path / "clean"
    run_sharded(ITEMS, shard_rows=3, folder=clean, compute=computing(set(), []))
    for shard in ("shard-00000.parquet", "shard-00001.parquet"):
        assert (third / shard).read_bytes() == (clean / shard).read_bytes()
    assert (first / "shard-00001.failed.json").exists()  # the retired folder never changes


def test_nothing_is_carried_without_failed_rows_and_stale_records_are_dropped(tmp_path):
    run_sharded(ITEMS, shard_rows=3, folder=tmp_path / "old" / "shards-3", compute=computing(set(), []))
    assert carry_failed_rows(tmp_path / "old", tmp_path / "new") == 0 and not (tmp_path / "new").exists()

    shards = tmp_path / "old" / "shards-3"  # a record its shard no longer bears out (computed again elsewhere)
    (shards / "shard-00001.failed.json").write_text(FailedRows(rows=[
        FailedRow(run_id="r4", attempts=3, error_type="EngineError", error="x")]).model_dump_json())
    assert stage_failed_rows(shards, 2, failing=set()) == []
    assert not (shards / "shard-00001.failed.json").exists()


def test_retire_stages_leaves_the_shards_of_a_folder_with_failed_rows_to_its_retry(tmp_path):
    from jex.flows.campaign import retire_stages

    folder = tmp_path / "store" / "fast_pass" / "k1"
    run_sharded(ITEMS, shard_rows=3, folder=folder / "shards-3", compute=computing({"r1"}, []))
    (folder / "_SUCCESS.json").write_text("{}")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "stages.json").write_text(json.dumps({"fast_pass": {"key": "k1", "folder": str(folder)}}))
    [retired] = retire_stages(tmp_path / "run", ["fast_pass"])
    assert (Path(retired) / "_SUCCESS.json").exists() and not (folder / "_SUCCESS.json").exists()
    assert sorted(p.name for p in (folder / "shards-3").iterdir()) == [
        ".shard-00000.partial.parquet", "shard-00000.failed.json", "shard-00001.parquet"]


# --- the results name a failed row --------------------------------------------------------------------

def test_the_results_name_each_failed_row_with_its_attempts():
    rows = [FailedRow(run_id=f"q{i}", attempts=3 + (i == 2), error_type="EngineError", error="x") for i in range(3)]
    assert failed_rows_line("fast_pass", rows[:1]) == "fast pass: 1 row failed after 3 attempts: ids q0"
    assert (failed_rows_line("reason", rows, shown=2)
            == "reason: 3 rows failed after 3 to 4 attempts: ids q0, q1 and 1 more")
    doc = FoldDoc.model_construct(failed_rows={"fast_pass": rows[:2]})
    assert doc.failed_lines() == ["fast pass: 2 rows failed after 3 attempts: ids q0, q1"]


def test_jex_show_marks_a_failed_row_apart_from_a_refusal():
    from jex.tasks.outputs.samples import _why_missing

    assert _why_missing("batch error: EngineError: x").startswith("   FAILED after every retry (batch error:")
    assert _why_missing("context: 900 prompt tokens + 1 > 512") == "   refused: context: 900 prompt tokens + 1 > 512"
    assert _why_missing(None) == ""


# --- the fast pass on the embedded model --------------------------------------------------------------

class FlakyEngine:
    """The real engine, except that a readout batch holding `poisoned` fails (a recoverable error) the
    first `fails` times (every time: None); `sent` lists the run_ids of every readout call."""

    def __init__(self, real, poisoned: str, fails: int | None = None):
        self.real, self.poisoned, self.fails, self.sent = real, poisoned, fails, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def readout(self, requests, *args, **kwargs):
        ids = [r.run_id for r in requests]
        self.sent.append(ids)
        if self.poisoned in ids and (self.fails is None or self.fails > 0):
            self.fails = None if self.fails is None else self.fails - 1
            raise EngineError("planted: device lost this batch")
        return self.real.readout(requests, *args, **kwargs)


@pytest.fixture
def fast_pass(tmp_path, monkeypatch):
    """`run(store_name, engine=None)`: the fast pass of a 6-row suite in shards of 3 (the real engine, or a
    `FlakyEngine` around it) under the row policy `NO_WAIT`; returns the summary."""
    import jex.tasks.capture.stages as stages
    from jex.engine_spec import EngineSpec
    from jex.tasks.execution.engine_pool import get_engine
    from jex.tasks.store import LocalStore
    from tests.conftest import row, write_suite

    suite = write_suite(tmp_path / "suite", {"c": [row(f"q{i}", "c") for i in range(6)]})
    monkeypatch.setattr(stages, "ROW_RETRIES", NO_WAIT)

    def run(store: str, engine: FlakyEngine | None = None):
        monkeypatch.setattr(stages, "get_engine", (lambda spec: engine) if engine else get_engine)
        s = LocalStore(tmp_path / store)
        return stages.fast_pass_stage(s, bundle=stages.bundle_stage(s, suite=suite), engine=EngineSpec(), shard_rows=3)

    run.real = lambda: get_engine(EngineSpec())
    return run


def summary_doc(summary) -> dict:
    """A summary's `_SUCCESS.json` less what differs between two computations of the same stage."""
    doc = json.loads((Path(summary.folder) / "_SUCCESS.json").read_text())
    return {k: v for k, v in doc.items() if k not in ("folder", "capture", "compute_seconds", "engine_start_seconds")}


@pytest.mark.slow
def test_a_row_that_fails_in_its_batch_is_retried_and_stored_as_in_a_clean_run(fast_pass):
    clean = fast_pass("clean")
    flaky = FlakyEngine(fast_pass.real(), "q4", fails=5)  # its shard twice, its half twice, itself once
    got = fast_pass("flaky", flaky)
    assert flaky.sent[:5] == [["q0", "q1", "q2"], ["q3", "q4", "q5"], ["q3", "q4", "q5"], ["q3"], ["q4", "q5"]]
    assert flaky.sent.count(["q4"]) == 2  # failed alone once, then read on its retry
    assert got.batch_errors == 0 and got.failed_rows is None
    assert Path(got.capture).read_bytes() == Path(clean.capture).read_bytes()
    assert summary_doc(got) == summary_doc(clean)  # no failed_rows key, no record among the files
    assert not list(Path(got.folder).rglob("*.failed.json"))


@pytest.mark.slow
def test_a_row_failing_every_time_is_named_and_a_retry_sends_only_it(fast_pass):
    dead = FlakyEngine(fast_pass.real(), "q4")
    got = fast_pass("store", dead)
    assert [(r.run_id, r.attempts, r.error_type, r.error) for r in got.failed_rows] == [
        ("q4", 3, "EngineError", "planted: device lost this batch")]
    assert got.batch_errors == 1 and dead.sent.count(["q4"]) == 3
    written = json.loads((Path(got.folder) / "_SUCCESS.json").read_text())
    assert written["failed_rows"][0]["run_id"] == "q4" and "shards-3/shard-00001.failed.json" in written["files"]
    capture = pl.read_parquet(got.capture)
    assert capture.filter(pl.col("logprobs").is_not_null()).height == 5  # the other rows are stored

    folder = Path(got.folder)  # a retry of the stage (`retire_stages`): the folder set aside, its shards carried
    retired = folder.with_name(folder.name + ".retired")
    folder.rename(retired)
    assert carry_failed_rows(retired, folder) == 1
    healed = FlakyEngine(fast_pass.real(), "q4", fails=0)
    again = fast_pass("store", healed)
    assert healed.sent == [["q4"]] and again.computed_rows == 6 + 1  # every record of work: the first run's, and q4
    assert again.failed_rows is None and again.batch_errors == 0
    clean = fast_pass("clean")
    assert Path(again.capture).read_bytes() == Path(clean.capture).read_bytes()
    for shard in ("shard-00000.parquet", "shard-00001.parquet"):
        assert (folder / "shards-3" / shard).read_bytes() == (Path(clean.folder) / "shards-3" / shard).read_bytes()
    assert not list(folder.rglob("*.failed.json")) and not list(folder.rglob(".shard-*"))


def test_a_dead_engine_still_stops_the_row_retries():
    from jex.tasks.capture.batch_errors import compute_resilient

    calls = []

    def dead(items):
        calls.append(list(items))
        raise EngineDeadError("CUDA error")

    with pytest.raises(EngineDeadError):
        compute_resilient(["a"], dead, lambda items, why: pl.DataFrame(), policy=NO_WAIT)
    assert calls == [["a"]]


class DeadEngine(FlakyEngine):
    """The real engine, dead at its first readout (a CUDA error: nothing more can be served)."""

    def readout(self, requests, *args, **kwargs):
        self.sent.append([r.run_id for r in requests])
        raise EngineDeadError("planted: CUDA error, the engine is gone")


def test_a_dead_engine_is_released_and_its_stage_not_retried(fast_pass, monkeypatch):
    from jex.engine_spec import EngineSpec
    from jex.tasks.execution import engine_pool

    dead = DeadEngine(fast_pass.real(), "q0")
    monkeypatch.setitem(engine_pool._ENGINES, EngineSpec().loaded_key(), dead)
    with pytest.raises(EngineDeadError):
        fast_pass("store")
    assert dead.sent == [["q0", "q1", "q2"]]  # no retry of the batch, no split, no row retries
    assert not engine_pool.is_loaded(EngineSpec())  # the next stage that needs it starts a new one
