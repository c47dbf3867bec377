"""Atomic writes and content hashes: nothing is ever half-written."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO

CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of compact JSON with sorted keys (library objects as str): the content hash behind
    cache keys and identities. Its bytes are pinned by tests/test_keys_pinned.py."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=str).encode())


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_open(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temporary file beside `path` for writing; it replaces `path` on success only."""
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, full float precision (repr), library objects as str."""
    return json.dumps(obj, sort_keys=True, indent=2, default=str, allow_nan=True) + "\n"


def toml_value(v: Any) -> str:
    """`v` as a TOML value: booleans, numbers, strings (as JSON strings, which are valid TOML basic
    strings), arrays, and inline tables (None entries left out, TOML has no null)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{toml_value(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    return json.dumps(str(v), ensure_ascii=False)


def write_json(path: str | Path, obj: Any) -> str:
    """Atomically write canonical JSON; returns the sha256 of the bytes written."""
    text = canonical_json(obj)
    with atomic_open(path, "w") as f:
        f.write(text)
    return sha256_bytes(text.encode())


def read_json(path: str | Path) -> Any:
    """The JSON document in a UTF-8 file."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_text(path: str | Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_tar_gz(fileobj: BinaryIO, members: Iterable[tuple[str, Path]], *, compresslevel: int = 9) -> None:
    """Tar+gzip `(name in the archive, file)` pairs, in the order given, byte-reproducibly: no gzip
    name or time, every member mode 0o644, owner 0 and time 0 (PAX format)."""
    with gzip.GzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0, compresslevel=compresslevel) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, path in members:
                info = tarfile.TarInfo(name)
                info.size = path.stat().st_size
                info.mtime, info.uid, info.gid, info.mode = 0, 0, 0, 0o644
                info.uname = info.gname = ""
                with open(path, "rb") as f:
                    tar.addfile(info, f)
