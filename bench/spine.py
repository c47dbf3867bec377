"""Benchmarks of the campaign spine on a 150,759-row generated suite.

    .venv/bin/python bench/spine.py [--rows 150759] [--out bench/out/spine.json]
1. `jex bundle build` under /usr/bin/time -v: wall time and peak RSS (target <= 400 MB, <= 60 s).
2. Score + 2,000-draw clustered bootstrap from the bundle (target <= 5 s), and in the same run the
   same bootstrap as a naive per-draw loop, reported as a ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

from jex.sample_suite import write_sample_suite  # noqa: E402
from jex.settings import BOOTSTRAP_SEED  # noqa: E402


def naive_bootstrap(frame, spec, chance, draws: int, seed: int) -> list[float]:
    """The per-draw loop people write first: resample each catalog's clusters, one draw at a time."""
    import polars as pl

    from jex.tasks.scoring.index import aggregate

    per_cat = {}
    for c in spec.catalogs:
        sub = frame.filter(pl.col("catalog") == c.id)
        per_cat[c.id] = sub.group_by("question_id").agg(pl.col("correct").sum().alias("hits"), pl.len().alias("n"))
    rngs = {c.id: np.random.default_rng([seed, zlib.crc32(c.id.encode())]) for c in spec.catalogs}
    out = []
    for _ in range(draws):
        acc = {}
        for c in spec.catalogs:
            t = per_cat[c.id]
            idx = rngs[c.id].integers(0, t.height, size=t.height)
            picked = t[idx]
            acc[c.id] = picked["hits"].sum() / picked["n"].sum()
        out.append(aggregate(spec, acc, chance)[0])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=150_759)
    p.add_argument("--draws", type=int, default=2000)
    p.add_argument("--out", default="bench/out/spine.json")
    args = p.parse_args()
    res: dict = {"rows": args.rows}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        suite = write_sample_suite(tmp / "suite", rows=args.rows)
        res["generate_seconds"] = time.perf_counter() - t0
        cmd = ["/usr/bin/time", "-v", str(ROOT / ".venv/bin/jex"), "bundle", "build", str(suite), "-o",
               str(tmp / "b.tar.gz")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)[1])
        wall = re.search(r"Elapsed \(wall clock\) time.*: (.+)", proc.stderr)[1]
        m, s = wall.split(":")[-2:]
        res["bundle"] = {"peak_rss_mb": rss / 1024, "wall_seconds": int(m) * 60 + float(s),
                         "bytes": (tmp / "b.tar.gz").stat().st_size, "stdout": proc.stdout.strip()}
        # predictions: a fixed-seed mix of right and wrong answers
        import polars as pl

        from jex.tasks.bundle.suite_table import load_suite_table
        from jex.tasks.scoring.bootstrap_ci import bootstrap_ci
        from jex.tasks.scoring.index import catalog_chances, scored_frame
        from jex.tasks.scoring.score import score_twice

        t0 = time.perf_counter()
        table = load_suite_table(tmp / "b.tar.gz")
        res["load_bundle_seconds"] = time.perf_counter() - t0
        rng = random.Random(0)
        golds, n_opts = table.rows["gold"].to_list(), table.rows["n_options"].to_list()
        choice = [g if rng.random() < 0.6 else rng.randrange(k) for g, k in zip(golds, n_opts, strict=True)]
        preds = pl.DataFrame({"run_id": table.rows["run_id"], "choice": choice},
                             schema={"run_id": pl.String, "choice": pl.Int32})
        t0 = time.perf_counter()
        score_twice(table.rows, preds, table.spec)
        frame = scored_frame(table.rows, preds, table.spec)
        chance = catalog_chances(frame, table.spec)
        ci = bootstrap_ci(frame, table.spec, chance, draws=args.draws)
        res["score_and_bootstrap_seconds"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        naive = naive_bootstrap(frame, table.spec, chance, args.draws, BOOTSTRAP_SEED)
        res["naive_bootstrap_seconds"] = time.perf_counter() - t0
        res["ratio_naive_over_vectorised"] = res["naive_bootstrap_seconds"] / res["score_and_bootstrap_seconds"]
        res["ci_full_vectorised"] = ci["full"]
        res["ci_full_naive"] = [float(np.percentile(naive, 2.5)), float(np.percentile(naive, 97.5))]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
