"""Score + 2,000-draw clustered bootstrap on a 150,759-row suite whose catalogs mix the scoring kinds.

    .venv/bin/python bench/scoring_kinds.py [--rows 150759] [--draws 2000] [--out bench/out/scoring-kinds.json]

The embedded sample suite's 9 catalogs get the kinds accuracy, brier, log_loss, calibrated_accuracy in
turn; predictions carry probabilities (a fixed-seed Dirichlet, 60% of the mass tilted to gold on 60% of
rows) and choice = argmax. What is timed is what the score stage does per prediction set
(`tasks.score.score_with_ci`): both scorers (checked bit for bit), the scored frame, the chance levels
and the bootstrap. The same predictions scored with every catalog on accuracy are timed too.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from jex.sample_suite import write_sample_suite  # noqa: E402

KINDS = ("accuracy", "brier", "log_loss", "calibrated_accuracy")


def mix_kinds(suite: Path) -> dict[str, str]:
    """Give the suite's catalogs the four kinds in turn (edits suite.toml); returns id -> kind."""
    from jex.suite import load_manifest

    kinds = {c.id: KINDS[i % len(KINDS)] for i, c in enumerate(load_manifest(suite).catalogs)}
    text = (suite / "suite.toml").read_text()
    for cid, kind in kinds.items():
        text = text.replace(f'id = "{cid}"\n', f'id = "{cid}"\nscoring = "{kind}"\n', 1)
    (suite / "suite.toml").write_text(text)
    return kinds


def predictions(rows, seed: int = 0):
    import polars as pl

    rng = np.random.default_rng(seed)
    probs, choice = [], []
    for g, k in zip(rows["gold"].to_list(), rows["n_options"].to_list(), strict=True):
        p = rng.dirichlet(np.ones(k))
        if rng.random() < 0.6:
            p = 0.4 * p
            p[g] += 0.6
        probs.append(p.tolist())
        choice.append(int(np.argmax(p)))
    return pl.DataFrame({"run_id": rows["run_id"], "choice": choice, "probs": probs},
                        schema={"run_id": pl.String, "choice": pl.Int32, "probs": pl.List(pl.Float64)})


def timed_score(rows, preds, spec, draws: int) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one `score_with_ci` (CPU time is what a busy shared machine cannot inflate)."""
    from jex.tasks.scoring.score import score_with_ci

    t0, c0 = time.perf_counter(), time.process_time()
    doc = score_with_ci(rows, preds, spec, draws=draws).model_dump(mode="json")
    return time.perf_counter() - t0, time.process_time() - c0, doc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=150_759)
    p.add_argument("--draws", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/out/scoring-kinds.json")
    args = p.parse_args()
    from jex.tasks.bundle.bundle_file import build_bundle
    from jex.tasks.bundle.suite_table import load_suite_table

    res: dict = {"rows": args.rows, "draws": args.draws, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        suite = write_sample_suite(Path(tmp) / "suite", rows=args.rows)
        res["kinds"] = mix_kinds(suite)
        build_bundle(suite, Path(tmp) / "b.tar.gz")
        table = load_suite_table(Path(tmp) / "b.tar.gz")
    preds = predictions(table.rows)
    for name, spec in (("mixed", table.spec), ("accuracy_only", table.spec.as_accuracy())):
        seconds, cpu, doc = [], [], {}
        for _ in range(args.repeats):
            s, c, doc = timed_score(table.rows, preds, spec, args.draws)
            seconds.append(s)
            cpu.append(c)
        res[name] = {"score_and_bootstrap_seconds": seconds, "median_seconds": float(np.median(seconds)),
                     "cpu_seconds": cpu, "median_cpu_seconds": float(np.median(cpu)),
                     "full": doc["full"], "ci_full": doc["ci"],
                     "catalogs": {c: {k: v[k] for k in ("kind", "n", "value", "chance", "skill", "ci")}
                                  for c, v in doc["catalogs"].items()}}
    res["target_seconds"] = 5.0
    res["within_target"] = res["mixed"]["median_seconds"] <= 5.0
    res["load_average_1min"] = os.getloadavg()[0]  # other work on the machine while this ran
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    medians = {k: {"wall": res[k]["median_seconds"], "cpu": res[k]["median_cpu_seconds"]}
               for k in ("mixed", "accuracy_only")}
    print(json.dumps({k: v for k, v in res.items() if k not in medians} | medians, indent=1))


if __name__ == "__main__":
    main()
