"""`jex bundle build` and `jex score`: a suite into a reproducible bundle; predictions into a score."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from jex.cli import interop as cli_interop
from jex.cli import preflight
from jex.cli.common import fail, print_path
from jex.errors import JexError
from jex.settings import load_settings

bundle_app = typer.Typer(no_args_is_help=True, help="Bundles: deterministic archives of a suite.")


@bundle_app.command("build")
def bundle_build(suite: Annotated[Path, typer.Argument(help="Suite folder (holds suite.toml)")],
                 out: Annotated[Path, typer.Option("-o", "--out", help="Bundle file (.tar.gz)")],
                 reference: Annotated[Path | None, typer.Option(help="Banked capture, 1:1 on run_id")] = None,
                 shard_rows: Annotated[int, typer.Option(help="Rows per Parquet shard")] = 16384) -> None:
    """Stream a suite into a byte-reproducible bundle; prints its sha256."""
    from jex.tasks.bundle.bundle_file import build_bundle, provenance_sidecar

    try:
        preflight.suite(suite, "SUITE", bundle_ok=False)
        preflight.writable_file(out, "--out")
        if reference is not None:
            preflight.rows_file(reference, "--reference", needs=("run_id", "choice"))
        preflight.at_least(shard_rows, "--shard-rows", 1)
        result = build_bundle(suite, out, reference=reference, shard_rows=shard_rows,
                              provenance_out=provenance_sidecar(out))
    except JexError as e:
        fail(e)
    typer.echo(f"{result.sha256}  {result.path}  ({result.rows} rows)")
    print_path(result.path)


def score(out: Annotated[Path, typer.Option("-o", "--out", help="Folder for score.json and score.md")],
          suite: Annotated[Path | None, typer.Option(help="Suite folder or bundle file (optional with --from)")] = None,
          predictions: Annotated[Path | None, typer.Option(help="JSONL or Parquet: run_id, choice[, probs]; a "
                                                                "generative row: run_id, exact_match")] = None,
          bootstrap: Annotated[int | None, typer.Option(help="Bootstrap draws (default: JEX_BOOTSTRAP_DRAWS, "
                                                             "2000)")] = None,
          seed: Annotated[int | None, typer.Option(help="Bootstrap seed (default: JEX_BOOTSTRAP_SEED)")] = None,
          source: Annotated[Path | None, typer.Argument(help="--from: lm-eval samples file or output folder, or an "
                                                             "Inspect log")] = None,
          from_: Annotated[str | None, typer.Option("--from", help="lm-eval | inspect: score that tool's output "
                                                                   "(docs/bring-your-own.md)")] = None,
          map_by: Annotated[str, typer.Option(help="--from: auto | doc_id | id | content")] = "auto",
          id_field: Annotated[str | None, typer.Option(help="--from: the documents' id field")] = None) -> None:
    """Score predictions twice (vectorised and plain), with clustered bootstrap intervals."""
    from jex.tasks.scoring.score import score_files

    try:  # pre-flight
        preflight.at_least(bootstrap, "--bootstrap", 1)
        preflight.at_least(seed, "--seed", 0)
        preflight.writable_dir(out, "--out")
        if suite is not None:
            preflight.suite(suite)
        if predictions is not None:
            preflight.rows_file(predictions, "--predictions", needs=("run_id", "choice"))
        if source is not None and not source.exists():
            raise JexError(f"SOURCE {source}: no such file or folder")
    except JexError as e:
        fail(e)
    settings = load_settings()
    bootstrap = settings.bootstrap_draws if bootstrap is None else bootstrap
    seed = settings.bootstrap_seed if seed is None else seed
    if from_ is not None:  # another tool's per-document output (jex/cli/interop.py)
        return cli_interop.score_from(from_, source, out=out, suite=suite, draws=bootstrap, seed=seed, map_by=map_by,
                                      id_field=id_field)
    try:
        if suite is None or predictions is None:
            raise JexError("--suite and --predictions are both needed (or --from lm-eval|inspect SOURCE)")
        doc = score_files(suite, predictions, out, draws=bootstrap, seed=seed,
                          settings=settings.public_dict())
    except JexError as e:
        fail(e)
    lo, hi = doc.ci
    typer.echo(f"full {doc.full:.4f}  95% CI [{lo:.4f}, {hi:.4f}]")
    print_path(out)


def register(app: typer.Typer) -> None:
    app.add_typer(bundle_app, name="bundle")
    app.command("score")(score)
