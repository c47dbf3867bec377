"""Failing engine batches: retried, then split, then the rows that still fail are counted.

A recoverable engine error (`engine.types.EngineError`) on a batch is not fatal for its shard:
the batch is tried again (`retries` times), then split in halves and each half handled the same way,
down to single rows. A row that fails on its own becomes a row of its stage's frame with no
readout and a refusal starting with `BATCH_ERROR` (`batch error: <type>: <message>`), so it is
counted in the stage summary, `fold.json` and the report, never silently dropped. A fatal
`EngineDeadError` is not caught: the engine cannot serve anything more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from jex.engine.types import EngineError

BATCH_ERROR = "batch error"


@dataclass
class BatchLog:
    """What happened to the batches of one call: attempts, retries, splits and rows given up."""

    attempts: int = 0
    retries: int = 0
    splits: int = 0
    failed_rows: list[str] = field(default_factory=list)


def batch_error_text(error: BaseException) -> str:
    """The refusal text of a row that failed on its own (first line of the message, 200 chars)."""
    msg = (str(error).splitlines() or [""])[0][:200]
    return f"{BATCH_ERROR}: {type(error).__name__}: {msg}"


def compute_resilient(items: Sequence[Any], compute: Callable[[Sequence[Any]], pl.DataFrame],
                      failed: Callable[[Sequence[Any], str], pl.DataFrame], *, retries: int = 1,
                      log: BatchLog | None = None) -> pl.DataFrame:
    """`compute(items)`, or on `EngineError` retry, split and finally `failed(rows, refusal text)`.

    The result holds one row per item in item order whatever happened, because `compute` and
    `failed` each return one row per item they are given and halves are concatenated in order.
    """
    log = log if log is not None else BatchLog()
    error: EngineError | None = None
    for attempt in range(retries + 1):
        log.attempts += 1
        log.retries += attempt > 0
        try:
            return compute(items)
        except EngineError as e:
            error = e
    assert error is not None
    if len(items) == 1:
        log.failed_rows.append(str(getattr(items[0], "run_id", items[0])))
        return failed(items, batch_error_text(error))
    log.splits += 1
    mid = len(items) // 2
    return pl.concat([compute_resilient(items[:mid], compute, failed, retries=retries, log=log),
                      compute_resilient(items[mid:], compute, failed, retries=retries, log=log)])
