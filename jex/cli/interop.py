"""`jex show`, `jex diff`, `jex compare`, `jex export inspect|lm-eval|mlflow|wandb|hub` and `jex score --from
lm-eval|inspect`: a run's samples out, runs side by side, results where teams look, other tools' outputs in. Thin
shells over `tasks.samples`, `tasks.interop` and `lab.model_comparison` (imported lazily)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from jex.cli.common import fail, field_flags
from jex.errors import InputError, JexError
from jex.tasks.campaign_spec import MlflowTarget
from jex.tasks.outputs.interop.wandb_run import WandbTarget

if TYPE_CHECKING:
    from jex.tasks.outputs.interop.common import MapMode

export_app = typer.Typer(no_args_is_help=True, help="Export a run folder to another tool's format.")


def show(run: Annotated[Path, typer.Argument(help="A run folder (holds samples.parquet)")],
         catalog: Annotated[str | None, typer.Option(help="Only this catalog")] = None,
         wrong: Annotated[bool, typer.Option("--wrong", help="Only rows whose final choice is wrong")] = False,
         limit: Annotated[int, typer.Option(help="At most N rows (0 = all)")] = 20,
         run_id: Annotated[list[str] | None, typer.Option("--run-id", help="Only this run_id (repeatable)")] = None,
         prompt: Annotated[bool, typer.Option("--prompt", help="Also print the rendered prompt")] = False) -> None:
    """Print a run's per-sample record: options, readouts, rationale, fold/overlay decision, verdict."""
    from jex.cli import preflight
    from jex.tasks.outputs.samples import format_sample, read_samples, select_samples

    try:
        preflight.existing_dir(run, "RUN")
        preflight.at_least(limit, "--limit", 0)
        frame = read_samples(run)
        picked = select_samples(frame, catalog=catalog, wrong=wrong, run_ids=run_id or (),
                                limit=limit or None)
        for r in picked.iter_rows(named=True):
            typer.echo(format_sample(r, prompt=prompt) + "\n")
    except JexError as e:
        fail(e)
    scored = frame.filter(frame["scored"])
    typer.echo(f"{picked.height} of {frame.height} rows shown; {int(scored['correct'].sum())}/{scored.height} "
               f"scored rows right")


def diff(run_a: Annotated[Path, typer.Argument(help="A run folder")],
         run_b: Annotated[Path, typer.Argument(help="Another run folder of the same bundle")],
         catalog: Annotated[str | None, typer.Option(help="Only this catalog's rows")] = None,
         limit: Annotated[int, typer.Option(help="At most N differing rows printed (0 = all)")] = 20,
         as_json: Annotated[bool, typer.Option("--json", help="The whole comparison as one JSON object")] = False,
         out: Annotated[Path | None, typer.Option("-o", "--out", help="Write the differing rows (prompts, both "
                                                                      "choices, probabilities, rationales) "
                                                                      "as Parquet")] = None) -> None:
    """The rows whose final decision differs between two runs of the same bundle, with counts per catalog
    and which way each went (fixed: wrong in A, right in B; broken: the reverse; changed: neither)."""
    from jex.cli import preflight
    from jex.tasks.outputs.run_diff import diff_frame, diff_runs
    from jex.tasks.store import write_parquet

    try:
        preflight.existing_dir(run_a, "RUN_A")
        preflight.existing_dir(run_b, "RUN_B")
        preflight.at_least(limit, "--limit", 0)
        result = diff_runs(run_a, run_b)
    except JexError as e:
        fail(e)
    if catalog is not None:
        rows = [r for r in result.rows_differing if r.catalog == catalog]
        result = result.model_copy(update={"rows_differing": rows, "differing": len(rows),
                                           "catalogs": {catalog: result.catalogs[catalog]}
                                           if catalog in result.catalogs else {}})
    if out is not None:
        write_parquet(diff_frame(result), out)
    if as_json:
        typer.echo(result.model_dump_json())
        return
    typer.echo("| catalog | rows | differing | fixed | broken | changed |\n|---|---:|---:|---:|---:|---:|")
    for name, c in result.catalogs.items():
        typer.echo(f"| {name} | {c.rows} | {c.differing} | {c.fixed} | {c.broken} | {c.changed} |")
    for r in result.rows_differing[:limit or None]:
        typer.echo(f"{r.run_id} ({r.catalog}, gold {r.gold}): {r.label_a} -> {r.label_b} [{r.way}; decided by "
                   f"{r.decided_by_a} -> {r.decided_by_b}]")
    typer.echo(f"{result.differing} of {result.rows} rows differ (bundle {result.bundle[:12]})")


def compare(runs: Annotated[list[Path], typer.Argument(help="Two or more run folders of the same bundle")],
            as_json: Annotated[bool, typer.Option("--json", help="The whole comparison as one JSON object")] = False,
            out: Annotated[Path | None, typer.Option("-o", "--out", help="Write compare.md, compare.json and "
                                                                         "compare.png into this folder")] = None,
            draws: Annotated[int | None, typer.Option(help="Bootstrap draws; empty = the first run's")] = None,
            seed: Annotated[int | None, typer.Option(help="Bootstrap seed; empty = the first run's")] = None,
            permutations: Annotated[int, typer.Option(help="Sign-flip permutations per pair")] = 2000) -> None:
    """Models side by side on the same rows: every model's score with its interval, every pair's difference
    with a paired clustered bootstrap interval (per catalog, leg and the full index), ranked only where
    the intervals separate them. From the run folders alone."""
    from jex.cli import preflight
    from jex.lab.model_comparison import compare_runs, render_comparison, write_comparison

    try:
        for run in runs:
            preflight.existing_dir(run, "RUN")
        if draws is not None:
            preflight.at_least(draws, "--draws", 1)
        preflight.at_least(seed, "--seed", 0)
        preflight.at_least(permutations, "--permutations", 1)
        doc = compare_runs(runs, draws=draws, seed=seed, permutations=permutations)
    except JexError as e:
        fail(e)
    if out is not None:
        write_comparison(doc, out)
    if as_json:
        typer.echo(doc.model_dump_json())
        return
    typer.echo(render_comparison(doc, plot=None).rstrip())
    if out is not None:
        typer.echo(str(out.resolve()))


def register(app: typer.Typer) -> None:
    """Add `show`, `diff`, `compare` and `export` to the main CLI."""
    app.command("show")(show)
    app.command("diff")(diff)
    app.command("compare")(compare)
    app.add_typer(export_app, name="export")


FROM = ("lm-eval", "inspect")
MAP_BY: dict[str, MapMode] = {"auto": "auto", "doc_id": "doc_id", "id": "id", "content": "content"}
"""`--map-by` values: how another tool's documents map to run_ids."""


def score_from(tool: str, source: Path | None, *, out: Path, suite: Path | None, draws: int, seed: int,
               map_by: str, id_field: str | None) -> None:
    """`jex score --from lm-eval|inspect SOURCE [--suite DIR]`: another tool's documents through jex's index."""
    from jex.cli import preflight
    from jex.errors import InputError

    try:
        if tool not in FROM:
            raise InputError(f"--from must be one of {list(FROM)}, got {tool!r}", field="--from")
        if source is None:
            raise InputError(f"--from {tool} needs the file or folder to read (jex score --from {tool} SOURCE -o OUT)")
        if tool == "lm-eval" and source.is_file():
            preflight.text_head(source, "SOURCE")
        mode = MAP_BY.get(map_by)
        if mode is None:
            raise InputError(f"--map-by must be auto, doc_id, id or content, got {map_by!r}", field="--map-by")
        if tool == "lm-eval":
            from jex.tasks.outputs.interop.lm_eval_files import score_lm_eval as score_tool
        else:
            from jex.tasks.outputs.interop.inspect_log import score_inspect as score_tool
        doc = score_tool(source, out, suite=suite, draws=draws, seed=seed, mode=mode, id_field=id_field)
    except JexError as e:
        fail(e)
    lo, hi = doc.ci
    typer.echo(f"full {doc.full:.4f}  95% CI [{lo:.4f}, {hi:.4f}]  -> {out / 'score.json'}")
    for cid, c in doc.catalogs.items():
        norm = getattr(c, "acc_norm", None)
        typer.echo(f"  {cid:<24} n {c.n:>5}  acc {c.acc:.4f}  " + (f"acc_norm {norm:.4f}  " if norm is not None else "")
                   + f"skill {c.skill:+.4f}  CI [{c.ci[0]:+.4f}, {c.ci[1]:+.4f}]")


@export_app.command("lm-eval")
def export_lm_eval_cmd(run: Annotated[Path, typer.Argument(help="A run folder")],
                       out: Annotated[Path, typer.Option("-o", "--out", help="Output folder (lm-eval --output_path)")]
                       ) -> None:
    """results_<date>.json and samples_<catalog>_<date>.jsonl in lm-evaluation-harness's layout."""
    try:
        from jex.tasks.outputs.interop.lm_eval_files import export_lm_eval

        folder = export_lm_eval(run, out)
    except JexError as e:
        fail(e)
    typer.echo(folder)


@export_app.command("inspect")
def export_inspect_cmd(run: Annotated[Path, typer.Argument(help="A run folder")],
                       out: Annotated[Path, typer.Option("-o", "--out", help="Log folder (inspect view --log-dir)")]
                       ) -> None:
    """An Inspect AI log (.eval): one sample per row, the rationale as the model's message, the score."""
    try:
        from jex.tasks.outputs.interop.inspect_log import export_inspect

        path = export_inspect(run, out)
    except JexError as e:
        fail(e)
    typer.echo(path)


T = TypeVar("T", bound=BaseModel)


def target_from_flags(record: type[T], flags: dict[str, Any]) -> T:
    """The tracker target the flags give; a refused value is one line naming its flag, never echoing the value (a
    URI may hold a password)."""
    try:
        return record(**flags)
    except ValidationError as e:
        first = e.errors()[0]
        raise InputError(first["msg"].removeprefix("Value error, "),
                         field="--" + str(first["loc"][0]).replace("_", "-")) from None


MLFLOW_FLAGS = {name: (f, str(f.description)) for name, f in MlflowTarget.model_fields.items()}
WANDB_FLAGS = {name: (f, str(f.description)) for name, f in WandbTarget.model_fields.items()}
Runs = Annotated[list[Path], typer.Argument(help="Finished run folders (what `jex run` printed last)")]


@export_app.command("mlflow")
@field_flags(MLFLOW_FLAGS, defaults=True)
def export_mlflow_cmd(runs: Runs, parent: Annotated[str | None, typer.Option(
        help="Nest the runs under a parent run of this name (a model comparison), made if missing")] = None,
        **flags: Any) -> None:
    """One MLflow run per jex run: parameters, metrics with their intervals, tags, report, plots, samples.

    The MLflow run is found again by its `jex.run` tag: exporting again updates it (one value per metric)."""
    from jex.cli import preflight

    try:
        for run in runs:
            preflight.existing_dir(run, "RUN")
        from jex.tasks.outputs.interop.mlflow_run import export_mlflow

        ids = export_mlflow(runs, target_from_flags(MlflowTarget, flags), parent=parent)
    except JexError as e:
        fail(e)
    for run, run_id in zip(runs, ids, strict=True):
        typer.echo(f"{run.name}: MLflow run {run_id}")


@export_app.command("wandb")
@field_flags(WANDB_FLAGS, defaults=True)
def export_wandb_cmd(runs: Runs, **flags: Any) -> None:
    """One W&B run per jex run: summary metrics, config, a samples table, the plots, the report as an artifact.

    Its id is the run folder's name, so exporting again updates it. Offline (WANDB_MODE=offline) it is written
    under WANDB_DIR, and `wandb sync` sends it later."""
    from jex.cli import preflight

    try:
        for run in runs:
            preflight.existing_dir(run, "RUN")
        from jex.tasks.outputs.interop.wandb_run import export_wandb

        logged = export_wandb(runs, target_from_flags(WandbTarget, flags))
    except JexError as e:
        fail(e)
    for run, w in zip(runs, logged, strict=True):
        typer.echo(f"{run.name}: W&B run {w.id} " + (f"offline in {w.where} (send it: wandb sync {w.where})"
                                                        if w.offline else f"at {w.where}"))


@export_app.command("hub")
def export_hub_cmd(run: Annotated[Path, typer.Argument(help="A finished run folder")],
                   out: Annotated[Path, typer.Option("-o", "--out", help="The results folder (lm-eval's Hub layout "
                                                                         "and a dataset card)")],
                   repo_id: Annotated[str | None, typer.Option(help="Also push the folder to this Hub dataset "
                                                                    "repository, ORG/NAME (needs HF_TOKEN)")] = None,
                   public: Annotated[bool, typer.Option("--public", help="With --repo-id: a public repository "
                                                                         "(else private)")] = False) -> None:
    """Results JSON, per-task samples and a dataset card in lm-eval's Hugging Face Hub layout.

    As lm-eval's EvaluationTracker pushes them; `datasets.load_dataset(DIR, "<model>__results")` reads them."""
    from jex.cli import preflight

    try:
        preflight.existing_dir(run, "RUN")
        from jex.tasks.outputs.interop.hub_results import export_hub

        folder = export_hub(run, out, repo_id=repo_id, public=public)
    except JexError as e:
        fail(e)
    typer.echo(f"pushed to the Hub dataset {repo_id}: {folder}" if repo_id else folder)
