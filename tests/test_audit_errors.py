"""Every error counted: failing batches retried, split and counted; counters disjoint and enforced."""

from __future__ import annotations

import polars as pl
import pytest

from jex.engine.types import EngineDeadError, EngineError
from jex.tasks.capture.batch_errors import BatchLog, RowRetryPolicy, compute_resilient
from jex.tasks.capture.stages import fast_pass_error_counters, reason_error_counters
from jex.tasks.documents import ErrorRow
from jex.tasks.probabilities.fold import ErrorCountersNotZero, error_counters, error_rows, require_zero


class Flaky:
    """Fails every batch holding a poisoned id; fails the first `transient` calls whatever they hold."""

    def __init__(self, poisoned: set[str], transient: int = 0):
        self.poisoned, self.transient, self.calls = poisoned, transient, []

    def __call__(self, items):
        self.calls.append(list(items))
        if self.transient:
            self.transient -= 1
            raise EngineError("transient: device busy")
        if self.poisoned & set(items):
            raise EngineError("poisoned batch\nsecond line")
        return pl.DataFrame({"run_id": list(items), "refusal": [None] * len(items)},
                            schema={"run_id": pl.String, "refusal": pl.String})


def failed(items, why):
    return pl.DataFrame({"run_id": list(items), "refusal": [why] * len(items)})


def test_failing_batch_is_retried_then_split_and_its_rows_counted():
    items = [f"r{i}" for i in range(8)]
    compute, log = Flaky({"r5"}), BatchLog()
    out = compute_resilient(items, compute, failed, retries=1, policy=RowRetryPolicy(attempts=3, backoff_s=0),
                            log=log)
    assert out["run_id"].to_list() == items  # one row per item, in order: nothing dropped
    assert out.filter(pl.col("refusal").is_not_null())["run_id"].to_list() == ["r5"]
    assert out["refusal"][5] == "batch error: EngineError: poisoned batch"
    assert [(r.run_id, r.attempts, r.error_type, r.error) for r in log.failed_rows] == [
        ("r5", 3, "EngineError", "poisoned batch")]
    assert log.splits == 3 and log.retries == 5  # 8 -> 4 -> 2 each retried once, then the row alone tried 3 times
    assert compute.calls[:2] == [items, items]  # the whole batch first, then its retry
    assert compute.calls.count(["r5"]) == 3


def test_the_row_retry_policy_waits_longer_before_each_try():
    policy = RowRetryPolicy(attempts=4, backoff_s=0.5)
    assert [policy.wait_before(a) for a in (1, 2, 3, 4)] == [0.0, 0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="attempts"):
        RowRetryPolicy(attempts=0)


def test_a_transient_failure_is_absorbed_by_the_retry():
    log = BatchLog()
    out = compute_resilient(["a", "b"], Flaky(set(), transient=1), failed, log=log)
    assert out["refusal"].null_count() == 2 and log.retries == 1 and log.splits == 0


def test_a_dead_engine_is_not_retried():
    def dead(items):
        raise EngineDeadError("CUDA error")

    with pytest.raises(EngineDeadError):
        compute_resilient(["a", "b"], dead, failed)


def capture_frame():
    return pl.DataFrame({
        "run_id": ["ok", "fb", "ctx", "lab", "bat"],
        "logprobs": [[-0.1, -2.4], [-0.5, -0.9], None, None, None],
        "label_mass": [0.9, None, None, None, None],
        "refusal": [None, None, "context: 900 prompt tokens + 1 > 512", "label token: ' AB' is not a single token",
                    "batch error: EngineError: x"]},
        schema={"run_id": pl.String, "logprobs": pl.List(pl.Float64), "label_mass": pl.Float64, "refusal": pl.String})


def reasoned_frame():
    return pl.DataFrame({
        "run_id": ["g1", "g2", "g3", "g4"], "finish_reason": ["stop", "length", "refused", "error"],
        "post_logprobs": [[-0.1, -2.4], None, None, None],
        "refusal": [None, "context: 600 prompt tokens + 1 > 512", "context: rationale prompt too long",
                    "batch error: EngineError: y"]},
        schema={"run_id": pl.String, "finish_reason": pl.String, "post_logprobs": pl.List(pl.Float64),
                "refusal": pl.String})


def test_counters_are_disjoint_and_all_reach_fold_json():
    fast = fast_pass_error_counters(capture_frame())
    assert fast == {"context_refusals": 1, "batch_errors": 1, "readout_errors": 1, "key_fallbacks": 1}
    reason = reason_error_counters(reasoned_frame())
    assert reason == {"context_refusals": 1, "batch_errors": 1, "mechanism_failures": 1}
    errors = error_counters(fast, reason, unmatched=0)
    assert errors.model_dump() == {"context_refusals": 2, "readout_errors": 1, "unmatched_rows": 0, "key_fallbacks": 1,
                      "batch_errors": 2, "mechanism_failures": 1}
    rows = error_rows(capture_frame(), reasoned_frame())
    assert [r.run_id for r in rows["batch_errors"]] == ["bat", "g4"]
    assert rows["mechanism_failures"] == [ErrorRow(run_id="g2", why="context: 600 prompt tokens + 1 > 512")]
    assert [r.run_id for r in rows["key_fallbacks"]] == ["fb"]


def test_require_zero_names_every_nonzero_counter():
    require_zero({"batch_errors": 0, "key_fallbacks": 0})
    with pytest.raises(ErrorCountersNotZero, match=r"'batch_errors': 2.*'mechanism_failures': 1"):
        require_zero({"batch_errors": 2, "key_fallbacks": 0, "mechanism_failures": 1})


@pytest.mark.slow
def test_multi_token_labels_are_read_through_the_fallback_and_counted(tmp_path):
    from jex.engine_spec import EngineSpec
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage
    from jex.tasks.store import LocalStore
    from tests.conftest import row, write_suite

    rows = [row("one", "c", k=2), row("long", "c", k=2, labels=["Alpha-one", "Bravo-two"])]
    store = LocalStore(tmp_path / "store")
    bundle = bundle_stage(store, suite=write_suite(tmp_path / "s", {"c": rows}))
    fast = fast_pass_stage(store, bundle=bundle, engine=EngineSpec(), shard_rows=2)
    capture = pl.read_parquet(fast.capture)
    assert fast.key_fallbacks == 1 and fast.readout_errors == 0
    long = capture.row(1, named=True)
    assert long["logprobs"] is not None and long["label_mass"] is None and long["refusal"] is None
    assert capture.row(0, named=True)["label_mass"] is not None  # single-token labels: the label slot
