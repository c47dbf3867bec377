"""`jex suite import hf|lm-eval|validate|ls|sample`: bringing a benchmark in, and the embedded sample."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jex.cli.common import fail, print_path
from jex.errors import JexError

if TYPE_CHECKING:
    from jex.suite_import import ImportResult

suite_app = typer.Typer(no_args_is_help=True, help="Suites: import, validate, list, and the sample generator.")
import_app = typer.Typer(no_args_is_help=True, help="Import a suite from a Hugging Face dataset or an lm-eval task.")
suite_app.add_typer(import_app, name="import")


def _report(result: ImportResult) -> None:
    for cat, n in result.rows.items():
        shots = result.fewshot_rows.get(cat, 0)
        typer.echo(f"{cat}: {n} rows" + (f", {shots} few-shot rows" if shots else ""))
    print_path(result.suite_dir)


@import_app.command("hf")
def import_hf_cmd(dataset: Annotated[str, typer.Option(help="Hub dataset id (local cache first) or local "
                                                             "Parquet/JSON/CSV file or folder")],
                  split: Annotated[str, typer.Option(help="Split to import")],
                  question: Annotated[str, typer.Option(help="Column with the question text")],
                  choices: Annotated[str, typer.Option(help="Column with the options (list, or {text, label})")],
                  answer: Annotated[str, typer.Option(help="Column with the answer: index, letter or option text")],
                  out: Annotated[Path, typer.Option("-o", "--out", help="Suite folder to write")],
                  config: Annotated[str | None, typer.Option(help="Dataset config (subset)")] = None,
                  id: Annotated[str | None, typer.Option("--id", help="Column with a unique row id")] = None,
                  catalog: Annotated[str | None, typer.Option(help="Catalog id (default: from the dataset)")] = None,
                  revision: Annotated[str | None, typer.Option(help="Hub revision (branch, tag or commit)")] = None,
                  fewshot_split: Annotated[str | None, typer.Option(help="Split whose rows become few-shot "
                                                                         "examples")] = None,
                  cluster: Annotated[str | None, typer.Option(help="Column naming each row's question: rows of one "
                                                                   "question resample together in the bootstrap "
                                                                   "(default: every row its own cluster)")] = None,
                  force: Annotated[bool, typer.Option(help="Replace a non-empty output folder")] = False) -> None:
    """A Hugging Face dataset as a one-catalog jex suite (prints the suite folder last)."""
    from jex.cli import preflight
    from jex.suite_import import import_hf

    try:
        preflight.writable_dir(out, "--out")
        result = import_hf(dataset, out, split=split, question=question, choices=choices, answer=answer,
                           config=config, id_col=id, catalog=catalog, revision=revision,
                           fewshot_split=fewshot_split, cluster=cluster, force=force)
    except JexError as e:
        fail(e)
    _report(result)


@import_app.command("lm-eval")
def import_lm_eval_cmd(task: Annotated[str, typer.Option(help="lm-eval task or group name, or a task YAML file")],
                       out: Annotated[Path, typer.Option("-o", "--out", help="Suite folder to write")],
                       data_files: Annotated[list[str] | None, typer.Option(
                           "--data-files", help="SPLIT=FILE, repeatable: read the task's data from local files")
                       ] = None,
                       cluster: Annotated[str | None, typer.Option(
                           help="Doc field naming each document's question: rows of one question resample "
                                "together in the bootstrap (default: every row its own cluster)")] = None,
                       force: Annotated[bool, typer.Option(help="Replace a non-empty output folder")] = False) -> None:
    """An lm-evaluation-harness multiple_choice task (or group) as a jex suite, one catalog per task: each
    row's prompt is lm-eval's own context, read verbatim with its log-likelihood readout. A generate_until
    task becomes a generative catalog (its generation settings, filters and exact_match settings)."""
    from jex.cli import preflight

    try:
        from jex.suite_import import import_lm_eval
    except ImportError as e:
        fail(JexError(f"lm-evaluation-harness is not installed (pip install 'jex[interop]'): {e}"))
    files = {}
    for item in data_files or []:
        split, sep, path = item.partition("=")
        if not sep or not split or not path:
            fail(JexError(f"--data-files {item!r}: expected SPLIT=FILE, e.g. test=rows.jsonl"))
        files[split] = path
    try:
        preflight.writable_dir(out, "--out")
        result = import_lm_eval(task, out, data_files=files or None, cluster=cluster, force=force)
    except JexError as e:
        fail(e)
    _report(result)


@suite_app.command("validate")
def suite_validate(suite: Annotated[Path, typer.Argument(help="Suite folder (holds suite.toml)")],
                   limit: Annotated[int, typer.Option(help="Stop after this many problems")] = 1000) -> None:
    """Check a suite and print every problem with its file, row and field (exit 1 if any)."""
    from jex.cli import preflight
    from jex.suite import validate_suite

    try:
        preflight.existing_dir(suite, "SUITE")
        preflight.at_least(limit, "--limit", 1)
    except JexError as e:
        fail(e)
    problems = validate_suite(suite, limit=limit)
    for p in problems:
        typer.echo(f"{p}")
    if problems:
        typer.echo(f"{len(problems)} problem(s){' (stopped at --limit)' if len(problems) >= limit else ''}", err=True)
        raise typer.Exit(1)
    typer.echo("ok")


@suite_app.command("ls")
def suite_ls(suite: Annotated[Path, typer.Argument(help="Suite folder (holds suite.toml)")]) -> None:
    """Catalogs with their rows, options, chance, leg and weight; the legs and their weights."""
    from jex.cli import preflight
    from jex.suite import SuiteRow, iter_all_rows, iter_fewshot_rows, load_manifest
    from jex.tasks.bundle.bundle_file import catalog_chance

    try:
        manifest = load_manifest(preflight.existing_dir(suite, "SUITE"))
        options: dict[str, Counter[int]] = {c.id: Counter() for c in manifest.catalogs}
        for row in iter_all_rows(suite, manifest):
            options[row.catalog][len(row.options) if isinstance(row, SuiteRow) else 0] += 1
        shots = Counter(r.catalog for r in iter_fewshot_rows(suite, manifest))
    except JexError as e:
        fail(e)
    typer.echo(f"suite {manifest.name}: legs " + ", ".join(f"{k}={v:g}" for k, v in manifest.legs.items()))
    typer.echo(f"{'catalog':<24} {'leg':<10} {'weight':>7} {'rows':>7} {'options':>9} {'chance':>7} {'few-shot':>8}")
    for c in manifest.catalogs:
        hist = options[c.id]
        ks = f"{min(hist)}-{max(hist)}" if hist and min(hist) != max(hist) else str(min(hist, default=0))
        if c.kind == "generate":  # exact match of an extracted answer: no options, chance 0
            ks, chance = "generate", 0.0
        else:
            chance = c.chance if c.chance is not None else (catalog_chance(hist) if hist else float("nan"))
        typer.echo(f"{c.id:<24} {c.leg:<10} {c.weight:>7g} {sum(hist.values()):>7} {ks:>9} {chance:>7.4f} "
                   f"{shots.get(c.id, 0):>8}")
    if manifest.source:
        typer.echo(f"source: {manifest.source.get('importer', '?')} "
                   f"{manifest.source.get('dataset') or manifest.source.get('task') or ''}".rstrip())


@suite_app.command("sample")
def suite_sample(out: Annotated[Path, typer.Option("-o", "--out", help="Suite folder to write")],
                 rows: Annotated[int, typer.Option(help="Total rows over all catalogs")] = 360,
                 seed: Annotated[int, typer.Option(help="Generator seed")] = 0) -> None:
    """Write the embedded sample suite (deterministic for a given --rows and --seed)."""
    from jex.cli import preflight
    from jex.sample_suite import write_sample_suite

    try:
        preflight.writable_dir(out, "--out")
        preflight.at_least(seed, "--seed", 0)
        print_path(write_sample_suite(out, rows=rows, seed=seed))
    except (JexError, ValueError) as e:
        fail(e)


def register(app: typer.Typer) -> None:
    app.add_typer(suite_app, name="suite")
