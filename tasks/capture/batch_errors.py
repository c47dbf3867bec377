"""Failing engine batches: retried, split down to the row, and a row that keeps failing retried by policy.

A recoverable engine error (`engine.types.EngineError`) on a batch is not fatal for its shard: the batch
is tried again (`retries` times), then split in halves and each half handled the same way, down to single
rows. A row on its own is tried as the row retry policy says (`ROW_RETRIES`, one policy for both engine
stages). A row that still fails becomes a row of its stage's frame with no readout and a refusal of the
kind `RefusalKind.BATCH_ERROR` (`batch error: <type>: <message>`), and a `FailedRow` record (run_id,
attempts, last error): its shard keeps the record beside it (`tasks/store.py: run_sharded`), the stage summary lists it
(`failed_rows`), fold.json, the report and `jex run`'s results name it, and a retry of the stage sends only
the failed rows to the engine again (`tasks/store.py: carry_failed_rows`). A fatal `EngineDeadError` is not
caught: the engine cannot serve anything more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl
from pydantic import Field

from jex.engine.types import EngineError, RefusalKind
from jex.record import Record
from jex.tasks.records import FailedRow
from jex.tasks.store import row_id


class RowRetryPolicy(Record):
    """How a row that fails on its own (its batch split down to it) is retried: the cap and the wait."""

    attempts: int = Field(3, ge=1, description="Tries of the row on its own, the first included")
    backoff_s: float = Field(0.5, ge=0, description="Seconds before the second try, doubled before each next")

    def wait_before(self, attempt: int) -> float:
        """Seconds to wait before try `attempt` (1-based): none before the first."""
        return 0.0 if attempt <= 1 else self.backoff_s * 2 ** (attempt - 2)


ROW_RETRIES = RowRetryPolicy()
"""The row retry policy of both engine stages (fast pass and reason)."""


@dataclass
class BatchLog:
    """What happened to the batches of one call: attempts, retries, splits and rows given up."""

    attempts: int = 0
    retries: int = 0
    splits: int = 0
    failed_rows: list[FailedRow] = field(default_factory=list)


def error_line(error: BaseException) -> str:
    """The first line of an error's message, 200 characters at most."""
    return (str(error).splitlines() or [""])[0][:200]


def batch_error_text(error: BaseException) -> str:
    """The refusal text of a row that failed on its own."""
    return RefusalKind.BATCH_ERROR.refusal(f"{type(error).__name__}: {error_line(error)}")


def compute_resilient(items: Sequence[Any], compute: Callable[[Sequence[Any]], pl.DataFrame],
                      failed: Callable[[Sequence[Any], str], pl.DataFrame], *, retries: int = 1,
                      policy: RowRetryPolicy = ROW_RETRIES, log: BatchLog | None = None) -> pl.DataFrame:
    """`compute(items)`, or on `EngineError` retry, split, retry each row as `policy` says and finally
    `failed(row, refusal text)`, recording the row in `log.failed_rows`.

    The result holds one row per item in item order whatever happened, because `compute` and
    `failed` each return one row per item they are given and halves are concatenated in order.
    """
    log = log if log is not None else BatchLog()
    alone = len(items) == 1
    tries = policy.attempts if alone else retries + 1
    error: EngineError | None = None
    for attempt in range(1, tries + 1):
        if alone and (wait := policy.wait_before(attempt)):
            time.sleep(wait)
        log.attempts += 1
        log.retries += attempt > 1
        try:
            return compute(items)
        except EngineError as e:
            error = e
    assert error is not None
    if alone:
        log.failed_rows.append(FailedRow(run_id=row_id(items[0]), attempts=tries, error_type=type(error).__name__,
                                         error=error_line(error)))
        return failed(items, batch_error_text(error))
    log.splits += 1
    mid = len(items) // 2
    return pl.concat([compute_resilient(items[:mid], compute, failed, retries=retries, policy=policy, log=log),
                      compute_resilient(items[mid:], compute, failed, retries=retries, policy=policy, log=log)])
