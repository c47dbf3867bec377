"""Clustered bootstrap: matches a readable loop, is paired, seeded and clustered."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from jex.tasks.bundle.suite_table import load_suite_table
from jex.tasks.scoring.bootstrap_ci import (
    ClusterLayout,
    bootstrap_ci,
    bootstrap_loop,
    paired_bootstrap_ci,
    resampled_accuracy,
)
from jex.tasks.scoring.index import catalog_chances, scored_frame


@pytest.fixture(scope="module")
def scored(sample_suite):
    table = load_suite_table(sample_suite)
    n = table.rows["n_options"].to_list()
    choice = pl.DataFrame({"run_id": table.rows["run_id"], "choice": [(i * 31) % k for i, k in enumerate(n)]},
                          schema={"run_id": pl.String, "choice": pl.Int32})
    frame = scored_frame(table.rows, choice, table.spec)
    return table.spec, frame, catalog_chances(frame, table.spec)


def test_vectorised_draws_equal_the_readable_loop(scored):
    spec, frame, chance = scored
    layout = ClusterLayout.from_frame(frame, spec)
    (acc,) = resampled_accuracy(layout, [layout.per_cluster(frame, "correct", spec)], draws=300, seed=7)
    from jex.tasks.scoring.bootstrap_ci import statistics_per_draw

    fast = statistics_per_draw(spec, acc, chance)["full"]
    slow = bootstrap_loop(frame, spec, chance, draws=300, seed=7)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-9)


def test_same_seed_same_interval_other_seed_differs(scored):
    spec, frame, chance = scored
    a = bootstrap_ci(frame, spec, chance, draws=200, seed=1)
    assert a == bootstrap_ci(frame, spec, chance, draws=200, seed=1)
    assert a != bootstrap_ci(frame, spec, chance, draws=200, seed=2)


def test_interval_brackets_the_point_estimate(scored):
    from jex.tasks.scoring.index import aggregate

    spec, frame, chance = scored
    acc = {c.id: frame.filter(pl.col("catalog") == c.id)["correct"].mean() for c in spec.catalogs}
    full = aggregate(spec, acc, chance)[0]
    lo, hi = bootstrap_ci(frame, spec, chance, draws=500, seed=3)["full"]
    assert lo < full < hi


def test_paired_interval_of_identical_sets_is_zero(scored):
    spec, frame, chance = scored
    ci = paired_bootstrap_ci(frame, frame, spec, chance, draws=100)
    assert ci["full"] == [0.0, 0.0]


def test_paired_interval_is_narrower_than_unpaired_difference(scored):
    spec, frame, chance = scored
    # the policy fixes a handful of rows: the paired interval of the delta stays tight and positive
    fixed = frame.with_columns(correct=pl.col("correct") | (pl.int_range(pl.len()) % 9 == 0))
    paired = paired_bootstrap_ci(frame, fixed, spec, chance, draws=400)["full"]
    a = bootstrap_ci(frame, spec, chance, draws=400, seed=11)["full"]
    b = bootstrap_ci(fixed, spec, chance, draws=400, seed=12)["full"]
    assert paired[0] > 0
    assert paired[1] - paired[0] < (b[1] - b[0]) + (a[1] - a[0])


def test_clusters_move_together():
    """One catalog of two questions with 10 rows each: every draw's accuracy is 0, 0.5 or 1."""
    from jex.tasks.bundle.suite_table import CatalogSpec, ScoreSpec

    spec = ScoreSpec(legs={"L": 1.0}, catalogs=(CatalogSpec("c", "L", 1.0, 0.5),))
    frame = pl.DataFrame({"run_id": [str(i) for i in range(20)], "catalog": ["c"] * 20,
                          "question_id": ["q1"] * 10 + ["q2"] * 10, "correct": [True] * 10 + [False] * 10})
    layout = ClusterLayout.from_frame(frame, spec)
    (acc,) = resampled_accuracy(layout, [layout.per_cluster(frame, "correct", spec)], draws=200, seed=0)
    assert set(np.unique(acc["c"])) <= {0.0, 0.5, 1.0}
