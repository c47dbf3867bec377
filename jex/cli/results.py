"""What `jex run` and `jex experiment run` print when a run ends: the results, as lm-eval prints its table.

`print_results(run_dir, style)` reads the run folder's documents (`score.json`, `fold.json`,
`stages.json`, `engine_calls.json`) and prints, by style: `table` (the full index with its interval,
each leg, each catalog, the fold's non-zero counters, the rows that failed (by id), engine calls and
wall time, then the run folder), `quiet` (the run folder only, for scripts) or `json` (the same summary
as one JSON object). The run folder's path is always the last line of the table and quiet styles.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from jex.run_records import ENGINE_CALLS_FILE, EngineCalls, RunStages

ResultsStyle = Literal["table", "quiet", "json"]


class CatalogLine(BaseModel):
    model_config = ConfigDict(frozen=True)
    catalog: str
    leg: str
    kind: str
    n: int
    acc: float
    skill: float
    ci: tuple[float, float]


class RunResults(BaseModel):
    """The summary a finished run prints (`--json` prints it as it is)."""

    model_config = ConfigDict(frozen=True)
    run_dir: str
    full: float
    full_ci: tuple[float, float]
    legs: dict[str, tuple[float, tuple[float, float]]]
    catalogs: list[CatalogLine]
    fold: dict[str, int]
    failed_rows: list[str] = []
    """`N rows failed after K attempts: ids ...`, one line per engine stage with failed rows (`FoldDoc`)."""
    engine_calls: int | None
    wall_s: float | None


def run_results(run_dir: Path) -> RunResults:
    """The summary of a finished run folder, from its documents."""
    from jex.tasks.documents import FoldDoc, ScoreDoc, read_doc

    score = read_doc(ScoreDoc, run_dir / "score.json")
    fold = read_doc(FoldDoc, run_dir / "fold.json")
    counters = {k: v for k, v in fold.overall.model_dump().items() if isinstance(v, int) and v}
    counters.update({k: v for k, v in fold.errors.model_dump().items() if v})
    stages = RunStages.read(run_dir)
    calls = EngineCalls.read(run_dir) if (run_dir / ENGINE_CALLS_FILE).is_file() else None
    return RunResults(
        run_dir=str(run_dir), full=score.full, full_ci=score.ci,
        legs={leg: (s.index, s.ci) for leg, s in score.legs.items()},
        catalogs=[CatalogLine(catalog=c, leg=r.leg, kind=r.kind, n=r.n, acc=r.acc, skill=r.skill, ci=r.ci)
                  for c, r in sorted(score.catalogs.items())],
        fold=counters,
        failed_rows=fold.failed_lines(),
        engine_calls=calls.total() if calls is not None else None,
        wall_s=round(stages.seconds(), 1) if stages.root else None)


def _ci(ci: tuple[float, float]) -> str:
    return f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def print_results(run_dir: Path, style: ResultsStyle = "table") -> None:
    """Print a finished run's results in `style`; the run folder is the last line of `table`/`quiet`."""
    import typer

    if style == "quiet":
        typer.echo(run_dir)
        return
    try:
        results = run_results(run_dir)
    except (OSError, ValueError) as e:  # a run folder without its documents: the path is still the answer
        typer.echo(f"(no results table: {e})", err=True)
        typer.echo(run_dir)
        return
    if style == "json":
        typer.echo(json.dumps(results.model_dump(mode="json"), indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"full index {results.full:.1f}  95% CI {_ci(results.full_ci)}", title_justify="left")
    for col in ("catalog", "leg", "scoring", "n", "accuracy", "skill", "95% CI (skill)"):
        table.add_column(col, justify="left" if col in ("catalog", "leg", "scoring") else "right")
    for c in results.catalogs:
        table.add_row(c.catalog, c.leg, c.kind, str(c.n), f"{c.acc:.3f}", f"{c.skill:.3f}",
                      f"[{c.ci[0]:.3f}, {c.ci[1]:.3f}]")
    console = Console(highlight=False, soft_wrap=True)
    console.print(table)
    console.print("legs: " + ", ".join(f"{leg} {index:.1f} {_ci(ci)}" for leg, (index, ci) in results.legs.items()))
    if results.fold:
        console.print("fold: " + ", ".join(f"{k} {v}" for k, v in results.fold.items()))
    for line in results.failed_rows:
        console.print(f"FAILED ROWS {line}")
    tail = [f"engine calls {results.engine_calls}" if results.engine_calls is not None else None,
            f"stages {results.wall_s} s" if results.wall_s is not None else None]
    if any(tail):
        console.print(", ".join(t for t in tail if t))
    typer.echo(run_dir)
