"""`jex store pull`: bring a campaign back from S3 into an empty local store (a new orchestrator).

Every object is checked against the sha256 in its metadata, every stage folder against its
`_SUCCESS.json`; a stage whose folder in S3 is incomplete is left to be computed again. `jex run
--resume RUN` does the same first when S3 is configured, so a campaign whose orchestrator died
continues on a fresh one with no engine call for what S3 already holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from jex.cli.common import print_path
from jex.errors import InfraError, InputError
from jex.run_records import CAMPAIGN_FILE
from jex.settings import load_settings

if TYPE_CHECKING:
    from jex.infra.s3 import PullReport, S3Store

store_app = typer.Typer(no_args_is_help=True, help="The artifact store: bring campaigns back from S3.")


def _s3() -> S3Store:
    from jex.infra.s3 import S3Store

    settings = load_settings()
    if not settings.store.s3_bucket:
        raise InputError("no S3 bucket configured; set JEX_STORE__S3_BUCKET (and _S3_ENDPOINT_URL, _S3_PREFIX)")
    infra = settings.infra
    if infra.aws_credentials_block or infra.aws_access_key_id_block or infra.aws_secret_access_key_block:
        from jex.cli.common import connect_prefect
        from jex.flows.credentials import with_block_credentials

        connect_prefect(settings)  # the blocks live on the Prefect server
        settings = with_block_credentials(settings)
    return S3Store.from_settings(settings.store, settings.infra)


def pull(campaign: str, out: Path, store: Path | None = None) -> PullReport:
    """Pull `campaign` (a campaign name with one run in S3, or a run folder name) into `out` and `store`
    (default: OUT/store, beside the run folder, where `jex run --resume` looks for it)."""
    from jex.cli import preflight
    from jex.errors import user_error
    from jex.infra.s3 import pull_campaign

    store = store if store is not None else out / "store"
    preflight.writable_dir(out, "--out")
    preflight.writable_dir(store, "--store")
    s3 = _s3()
    try:
        return pull_campaign(s3, campaign, out=out, store=store)
    except Exception as e:  # a dead endpoint, refused credentials: botocore's errors, named with the bucket
        err = user_error(e)
        if err is None or not type(e).__module__.startswith(("botocore", "boto3", "s3transfer")):
            raise
        settings = load_settings().store
        raise InfraError(f"S3 bucket {settings.s3_bucket!r} at {settings.s3_endpoint_url or 'AWS'}: {err}") from None


def resume_from_s3(run_dir: Path, store: Path | None = None) -> None:
    """Before `jex run --resume RUN [--store S]`: with S3 configured, pull RUN's record and the stage
    folders it records that no store here holds (by their keys), into the store the run will use."""
    if not load_settings().store.s3_bucket:
        return
    if (run_dir / CAMPAIGN_FILE).is_file():
        from jex.tasks.campaign_spec import load_spec
        from jex.tasks.run_store import find_run_store

        spec = load_spec(run_dir)
        search = find_run_store(run_dir, given=store, recorded=spec.store)
        if search.found is not None:
            return  # every recorded stage is here
        store = search.store
    report = pull(Path(run_dir).name, Path(run_dir).parent, store)
    typer.echo(_summary(report), err=True)


def _summary(report: PullReport) -> str:
    return (f"pulled {len(report.pulled)} stage folder(s) and {report.shards} machine shard(s) "
            f"({report.objects} objects, {report.bytes} bytes, sha256 verified) into {report.store}; "
            f"{len(report.present)} already here; incomplete in S3: {report.incomplete or 'none'}")


@store_app.command("pull")
def pull_cmd(campaign: Annotated[str, typer.Option(help="Campaign name (one run in S3) or run folder name")],
             out: Annotated[Path, typer.Option(help="Folder for the run folder")] = Path("runs"),
             store: Annotated[Path | None, typer.Option(help="Local store (default: OUT/store)")] = None
             ) -> None:
    """Bring a campaign's run record, complete stage folders and machine shards back from S3 (verified).

    The last line printed is the run folder: `jex run --resume RUN_FOLDER` continues it.
    """
    report = pull(campaign, out, store)
    typer.echo(_summary(report))
    print_path(report.run_dir)


def register(app: typer.Typer) -> None:
    app.add_typer(store_app, name="store")
