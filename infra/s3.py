"""S3 artifact storage: uploads verified by sha256, idempotent, every call logged without secrets.

Objects carry their content's sha256 in metadata (`x-amz-meta-sha256`); an upload is complete only
when a HEAD of the object shows that sha256 and the right size. Large files go up in multipart
chunks (boto3's transfer manager). Layout under `s3://BUCKET/PREFIX/`:
    store/<stage>/<key>/...     stage folders (content-addressed, shared between campaigns);
                                `_SUCCESS.json` goes up last, so a folder with it is complete
    runs/<run folder>/...       a campaign's products; `campaign.json` and `stages.json` go up after
                                every stage (`checkpoint`), so a new orchestrator can resume
    campaigns/<run folder>/machines/<machine>/<job>/...   what machines computed (shards)

The store is read back too: `pull_campaign` brings a campaign's run record, its complete stage
folders and its machines' shards into an empty local store, every object checked against its sha256
and every stage folder against its `_SUCCESS.json`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jex.errors import InfraError, InputError
from jex.fileio import sha256_file, write_json
from jex.infra.records import ObjectHead, S3Manifest, S3Object, S3Upload
from jex.run_records import CAMPAIGN_FILE, STAGES_FILE, RunStages
from jex.store_layout import SUCCESS

if TYPE_CHECKING:
    from jex.settings import InfraSettings, StoreSettings

log = logging.getLogger("jex.infra.s3")
MULTIPART_BYTES = 64 * 1024 * 1024


class UploadError(InfraError):
    """An object in S3 does not match the file that was uploaded."""


@dataclass
class S3Store:
    bucket: str
    prefix: str = "jex"
    client: Any = None
    """A boto3 S3 client (boto3 ships no types)."""

    @classmethod
    def from_settings(cls, store: StoreSettings, infra: InfraSettings | None) -> S3Store:
        from jex.infra.aws import aws_client

        if not store.s3_bucket:
            raise InputError("no S3 bucket configured: set JEX_STORE__S3_BUCKET", field="store.s3_bucket")
        client = aws_client("s3", region=store.s3_region, endpoint_url=store.s3_endpoint_url, infra=infra)
        return cls(store.s3_bucket, store.s3_prefix.strip("/"), client)

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def head(self, key: str) -> ObjectHead | None:
        """The object's size and recorded sha256, or None when there is no such object."""
        from botocore.exceptions import ClientError

        try:
            got = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return ObjectHead(sha256=(got.get("Metadata") or {}).get("sha256"), bytes=got["ContentLength"])

    def put_file(self, path: Path, key: str) -> S3Upload:
        """Upload unless an identical object is there; verify sha256 and size afterwards."""
        from boto3.s3.transfer import TransferConfig

        sha, size = sha256_file(path), path.stat().st_size
        want = ObjectHead(sha256=sha, bytes=size)
        if self.head(key) == want:
            log.info("s3 skip (identical) s3://%s/%s", self.bucket, key)
            return S3Upload(key=key, sha256=sha, bytes=size, uploaded=False)
        log.info("s3 put s3://%s/%s (%d bytes)", self.bucket, key, size)
        self.client.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha}},
                                Config=TransferConfig(multipart_threshold=MULTIPART_BYTES,
                                                      multipart_chunksize=MULTIPART_BYTES))
        if self.head(key) != want:
            raise UploadError(f"s3://{self.bucket}/{key}: after upload the object does not match {path}")
        return S3Upload(key=key, sha256=sha, bytes=size, uploaded=True)

    def get_file(self, key: str, dest: Path) -> Path:
        """Download and check the content against the sha256 in the object's metadata."""
        log.info("s3 get s3://%s/%s", self.bucket, key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        self.client.download_file(self.bucket, key, str(tmp))
        head = self.head(key)
        if head is None or head.sha256 != sha256_file(tmp):
            tmp.unlink(missing_ok=True)
            raise UploadError(f"s3://{self.bucket}/{key}: content does not match its sha256 metadata")
        tmp.replace(dest)
        return dest

    def list_objects(self, key_prefix: str) -> list[S3Object]:
        """Every object under `key_prefix` (a full key prefix, e.g. `self.key('runs') + '/'`): key and size."""
        log.info("s3 list s3://%s/%s", self.bucket, key_prefix)
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=key_prefix)
        return [S3Object(key=o["Key"], bytes=o["Size"]) for page in pages for o in page.get("Contents", [])]

    def put_tree(self, folder: Path, key_prefix: str) -> list[S3Upload]:
        return [self.put_file(p, self.key(key_prefix, p.relative_to(folder).as_posix()))
                for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")]


class HasFolder(Protocol):
    """A typed stage summary: all a sync needs of it is its folder."""

    @property
    def folder(self) -> str: ...


def push_campaign(s3: S3Store, run_dir: Path, summaries: Mapping[str, HasFolder], store_root: Path) -> S3Manifest:
    """Upload the stage folders a campaign used (each summary names its folder) and its run folder;
    write the manifest to `s3.json` there."""
    uploaded: list[S3Upload] = []
    for summary in summaries.values():
        folder = Path(summary.folder)
        rel = folder.resolve().relative_to(Path(store_root).resolve()).as_posix()
        uploaded += s3.put_tree(folder, f"store/{rel}")
    uploaded += s3.put_tree(run_dir, f"runs/{run_dir.name}")
    manifest = S3Manifest(bucket=s3.bucket, prefix=s3.prefix, objects=uploaded)
    write_json(run_dir / "s3.json", manifest.model_dump())
    return manifest


RUN_RECORD = (CAMPAIGN_FILE, STAGES_FILE)


def stage_rel(folder: str | Path) -> str:
    """`<stage>/<key>` of a stage folder, wherever its store lives."""
    parts = Path(folder).parts
    if len(parts) < 2:
        raise UploadError(f"{folder} is not a stage folder (<store>/<stage>/<key>)")
    return "/".join(parts[-2:])


def checkpoint(s3: S3Store, run_dir: Path, stage_folder: str | Path | None) -> list[S3Upload]:
    """After a stage: its folder (if complete; `_SUCCESS.json` last), then the run record, to S3."""
    done: list[S3Upload] = []
    folder = Path(stage_folder) if stage_folder else None
    if folder is not None and (folder / SUCCESS).exists():
        rel = stage_rel(folder)
        files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")
                 and p.name != SUCCESS]
        for p in [*files, folder / SUCCESS]:
            done.append(s3.put_file(p, s3.key("store", rel, p.relative_to(folder).as_posix())))
    for name in RUN_RECORD:
        if (run_dir / name).exists():
            done.append(s3.put_file(run_dir / name, s3.key("runs", run_dir.name, name)))
    return done


@dataclass
class PullReport:
    """What `pull_campaign` brought back (every object sha256-verified)."""

    run_dir: Path
    store: Path
    pulled: list[str] = field(default_factory=list)
    """Stage folders (`<stage>/<key>`) downloaded and verified against their `_SUCCESS.json`."""
    present: list[str] = field(default_factory=list)
    """Stage folders already complete in the local store (left alone)."""
    incomplete: list[str] = field(default_factory=list)
    """Stages the run record names whose folder in S3 is not complete (computed again on resume)."""
    shards: int = 0
    """Shards the campaign's machines uploaded, placed in the local store."""
    objects: int = 0
    bytes: int = 0


def find_run(s3: S3Store, campaign: str) -> str:
    """The run folder name in S3 of `campaign` (a run folder name, or a campaign name with one run)."""
    prefix = s3.key("runs") + "/"
    runs = sorted({o.key[len(prefix):].split("/", 1)[0] for o in s3.list_objects(prefix)
                   if o.key.endswith("/" + CAMPAIGN_FILE)})
    match = [r for r in runs if r == campaign] or [r for r in runs if r.rsplit("-", 1)[0] == campaign]
    if not match:
        raise UploadError(f"no campaign {campaign!r} in s3://{s3.bucket}/{prefix} (runs there: {runs[:20]})")
    if len(match) > 1:
        raise UploadError(f"campaign {campaign!r} has {len(match)} runs in S3 ({match}); name the run folder")
    return match[0]


def _get_verified(s3: S3Store, key: str, dest: Path) -> int:
    """Download unless `dest` already holds the object's bytes (sha256 from its metadata)."""
    head = s3.head(key)
    if head is None or head.sha256 is None:
        raise UploadError(f"s3://{s3.bucket}/{key}: no sha256 in its metadata; refusing to trust it")
    want = head.sha256
    if dest.exists() and sha256_file(dest) == want:
        return 0
    s3.get_file(key, dest)
    return dest.stat().st_size


def _pull_stage(s3: S3Store, rel: str, store: Path, report: PullReport) -> None:
    prefix = s3.key("store", rel) + "/"
    objects = {o.key[len(prefix):]: o for o in s3.list_objects(prefix)}
    if SUCCESS not in objects:
        report.incomplete.append(rel)
        return
    final = store / rel
    tmp = final.with_name(f".{final.name}.pull-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for name in sorted(objects):
            report.bytes += _get_verified(s3, prefix + name, tmp / name)
            report.objects += 1
        record = json.loads((tmp / SUCCESS).read_text())
        files = {n for n in objects if n != SUCCESS and not Path(n).name.startswith(".")}
        listed = record.get("files") or {}
        if not set(listed) <= files:
            raise UploadError(f"s3 stage folder {rel}: {SUCCESS} lists files S3 lacks: "
                              f"{sorted(set(listed) - files)[:5]}")
        for name, sha in listed.items():
            if sha256_file(tmp / name) != sha:
                raise UploadError(f"s3 stage folder {rel}: {name} does not match its {SUCCESS}")
        for name in sorted(objects, key=lambda n: n == SUCCESS):  # the completion record last
            (final / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp / name, final / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report.pulled.append(rel)


def pull_campaign(s3: S3Store, campaign: str, *, out: Path, store: Path) -> PullReport:
    """Bring a campaign back from S3 into `out/<run folder>` and `store`: the run record, every complete
    stage folder it names (found by its key, `<stage>/<key>`), its machines' shards."""
    run = find_run(s3, campaign)
    run_dir = Path(out) / run
    prefix = s3.key("runs", run) + "/"
    objects = s3.list_objects(prefix)
    for o in objects:
        _get_verified(s3, o.key, run_dir / o.key[len(prefix):])
    store = Path(store)
    report = PullReport(run_dir=run_dir, store=store, objects=len(objects))
    for rec in RunStages.read(run_dir).root.values():
        rel = rec.in_store
        if (store / rel / SUCCESS).exists():
            report.present.append(rel)
        else:
            _pull_stage(s3, rel, store, report)
    machines = s3.key("campaigns", run, "machines") + "/"
    for o in s3.list_objects(machines):
        rest = o.key[len(machines):].split("/", 2)  # <machine>/<job>/<path in the job folder>
        if len(rest) == 3 and rest[2].startswith("store/"):
            report.bytes += _get_verified(s3, o.key, store / rest[2].removeprefix("store/"))
            report.shards += 1
    return report
