"""A built bundle read for the stages: its rows as the engine stages read them, and its scored suite
table, each checked against the bundle's recorded sha256."""

from __future__ import annotations

import functools

import polars as pl

from jex.tasks.bundle.bundle_file import open_bundle
from jex.tasks.bundle.suite_table import SuiteTable, load_suite_table
from jex.tasks.records import BundleSummary
from jex.tasks.store import LocalStore

ENGINE_ROW_COLUMNS = ["run_id", "catalog", "question_id", "prompt", "options", "labels", "gold"]


def bundle_rows(bundle: BundleSummary, store: LocalStore) -> pl.DataFrame:
    """The bundle's multiple-choice rows, the columns an engine stage reads; refused if the file changed."""
    opened = open_bundle(bundle.bundle, store.extracted_bundle(bundle.key))
    if opened.sha256 != bundle.sha256:
        raise RuntimeError(f"{bundle.bundle} changed since it was built")
    return opened.rows(ENGINE_ROW_COLUMNS)


def scored_suite(bundle: BundleSummary) -> SuiteTable:
    """Every scored row of the bundle, generative catalogs included (what the score stage scores)."""
    return _suite_table(bundle.bundle, bundle.sha256)


@functools.lru_cache(maxsize=4)
def _suite_table(path: str, sha256: str) -> SuiteTable:
    """Read and verified once per process (keyed by content, not path alone)."""
    return load_suite_table(path)
