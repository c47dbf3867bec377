"""Atomic writes (JSON, TOML through tomli-w, text, tar.gz) and content hashes: nothing is ever half-written."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, BinaryIO

from jex.errors import InputError

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


def toml_text(doc: Mapping[str, Any], *, comment: str | None = None) -> str:
    """`doc` as TOML, written by tomli-w (its default basic strings: every control character, DEL included,
    escaped as `\\uXXXX`, so the text reads back equal through `tomllib`), after `comment` as `# ` lines.
    None anywhere is refused (TOML has no null): an `InputError` naming its key path; leave the key out."""
    return _toml(doc, comment=comment)


def toml_tables_text(name: str, tables: Sequence[Mapping[str, Any]]) -> str:
    """`tables` as `[[name]]` tables, each however short: text that may follow a file's other tables (the
    decision ledger appends its entries so, the entries before keep their bytes). tomli-w writes an array
    whose every table is short as one inline array (`name = [{ ... }]`), which may not follow a table;
    beside a table too long to be inline it writes each one as `[[name]]`: that one's text is cut off."""
    if not tables:
        return ""
    text = toml_text({name: [*tables, _NEVER_INLINE]})
    tail = "\n" + toml_text({name: [_NEVER_INLINE]})
    if not text.endswith(tail):  # pragma: no cover - a tomli-w that lays arrays of tables out otherwise
        raise AssertionError(f"tomli-w wrote the array of tables {name!r} in an unexpected layout")
    return text[:-len(tail)]


def write_toml(path: str | Path, doc: Mapping[str, Any], *, comment: str | None = None) -> str:
    """Atomically write `doc` as TOML (`toml_text`; None refused naming the file and the key path); returns
    the sha256 of the bytes written."""
    text = _toml(doc, comment=comment, file=str(path))
    with atomic_open(path, "w") as f:
        f.write(text)
    return sha256_bytes(text.encode())


def _toml(doc: Mapping[str, Any], *, comment: str | None, file: str | None = None) -> str:
    import tomli_w  # here, not above: a machine's jobs write no TOML, and its stack (STACK_PACKAGES) has none

    _refuse_none(doc, "", file)
    head = "".join(f"# {line}\n" for line in comment.splitlines()) if comment else ""
    if any(c in _COMMENT_CTRL for c in head):
        raise ValueError(f"a TOML comment may not hold a control character: {comment!r}")
    return head + tomli_w.dumps(doc)


_COMMENT_CTRL = frozenset(chr(i) for i in range(32) if chr(i) not in "\t\n") | {"\x7f"}
_NEVER_INLINE = {"_": "_" * 100}
"""A table tomli-w never writes inline (its inline tables fit in a 100-character line)."""


def _refuse_none(value: Any, where: str, file: str | None) -> None:
    """An `InputError` naming the key path (`catalogs[2].chance`) of the first None in `value`."""
    if value is None:
        raise InputError("None cannot be written to TOML (TOML has no null): leave the key out", file=file,
                         field=where or "(the document)")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _refuse_none(v, f"{where}.{k}" if where else str(k), file)
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _refuse_none(v, f"{where}[{i}]", file)


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
