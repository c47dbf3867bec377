"""S3 artifact storage: uploads verified by sha256, idempotent, every call logged without secrets.

Objects carry their content's sha256 in metadata (`x-amz-meta-sha256`); an upload is complete only
when a HEAD of the object shows that sha256 and the right size. Large files go up in multipart
chunks (boto3's transfer manager). Layout under `s3://BUCKET/PREFIX/`:
    store/<stage>/<key>/...     stage folders (content-addressed, shared between campaigns)
    runs/<run folder>/...       a campaign's products
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jex.fileio import sha256_file, write_json

log = logging.getLogger("jex.infra.s3")
MULTIPART_BYTES = 64 * 1024 * 1024


class UploadError(RuntimeError):
    """An object in S3 does not match the file that was uploaded."""


@dataclass
class S3Store:
    bucket: str
    prefix: str = "jex"
    client: Any = None

    @classmethod
    def from_settings(cls, store: Any, infra: Any) -> S3Store:
        from infra.aws import aws_client

        client = aws_client("s3", region=store.s3_region, endpoint_url=store.s3_endpoint_url, infra=infra)
        return cls(store.s3_bucket, store.s3_prefix.strip("/"), client)

    def key(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p)

    def head(self, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def put_file(self, path: Path, key: str) -> dict[str, Any]:
        """Upload unless an identical object is there; verify sha256 and size afterwards."""
        from boto3.s3.transfer import TransferConfig

        sha, size = sha256_file(path), path.stat().st_size
        existing = self.head(key)
        if existing and existing.get("Metadata", {}).get("sha256") == sha and existing["ContentLength"] == size:
            log.info("s3 skip (identical) s3://%s/%s", self.bucket, key)
            return {"key": key, "sha256": sha, "bytes": size, "uploaded": False}
        log.info("s3 put s3://%s/%s (%d bytes)", self.bucket, key, size)
        self.client.upload_file(str(path), self.bucket, key, ExtraArgs={"Metadata": {"sha256": sha}},
                                Config=TransferConfig(multipart_threshold=MULTIPART_BYTES,
                                                      multipart_chunksize=MULTIPART_BYTES))
        got = self.head(key)
        if not got or got.get("Metadata", {}).get("sha256") != sha or got["ContentLength"] != size:
            raise UploadError(f"s3://{self.bucket}/{key}: after upload the object does not match {path}")
        return {"key": key, "sha256": sha, "bytes": size, "uploaded": True}

    def get_file(self, key: str, dest: Path) -> Path:
        """Download and check the content against the sha256 in the object's metadata."""
        log.info("s3 get s3://%s/%s", self.bucket, key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        self.client.download_file(self.bucket, key, str(tmp))
        want = (self.head(key) or {}).get("Metadata", {}).get("sha256")
        if want != sha256_file(tmp):
            tmp.unlink(missing_ok=True)
            raise UploadError(f"s3://{self.bucket}/{key}: content does not match its sha256 metadata")
        tmp.replace(dest)
        return dest

    def put_tree(self, folder: Path, key_prefix: str) -> list[dict[str, Any]]:
        return [self.put_file(p, self.key(key_prefix, p.relative_to(folder).as_posix()))
                for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")]


def sync_campaign(s3: S3Store, run_dir: Path, summaries: dict[str, Any], store_root: Path) -> dict[str, Any]:
    """Upload the stage folders a campaign used and its run folder; write `s3.json` there."""
    uploaded: list[dict[str, Any]] = []
    for summary in summaries.values():
        folder = Path(summary["folder"])
        rel = folder.resolve().relative_to(Path(store_root).resolve()).as_posix()
        uploaded += s3.put_tree(folder, f"store/{rel}")
    uploaded += s3.put_tree(run_dir, f"runs/{run_dir.name}")
    manifest = {"bucket": s3.bucket, "prefix": s3.prefix, "objects": uploaded}
    write_json(run_dir / "s3.json", manifest)
    return manifest
