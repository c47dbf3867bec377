"""Pre-flight: every input of a command checked before Prefect starts or anything is written.

Each check names the flag, the file (and row or field) and what was expected, as an `InputError`;
a command calls the checks for its inputs first, so a refused run leaves no run folder, store
entry or flow run behind. The checks only read (a suite's manifest and first row, a model's
header, a rule file), so they take well under a second.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

from jex.errors import InputError, os_error

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
"""`org/name[@revision]`: the syntax of a Hub model id (as `engine/models.py` resolves it)."""
GGUF_MAGIC = b"GGUF"
PROVIDERS = ("inprocess", "local", "ssh", "ec2", "command")
ENGINE_KINDS = ("hf", "hf-batched", "vllm", "vllm-control")


def existing_file(path: Path | str, flag: str) -> Path:
    """`path` is a readable file (not a folder)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{flag}: no such file", file=str(path))
    if not path.is_file():
        raise InputError(f"{flag}: expected a file, found a folder", file=str(path))
    if not os.access(path, os.R_OK):
        raise InputError(f"{flag}: the file is not readable (permission denied)", file=str(path))
    return path


def existing_dir(path: Path | str, flag: str, *, holds: str | None = None) -> Path:
    """`path` is a readable folder (and holds the file `holds`, when given)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{flag}: no such folder", file=str(path))
    if not path.is_dir():
        raise InputError(f"{flag}: expected a folder, found a file", file=str(path))
    if not os.access(path, os.R_OK | os.X_OK):
        raise InputError(f"{flag}: the folder is not readable (permission denied)", file=str(path))
    if holds and not (path / holds).is_file():
        raise InputError(f"{flag}: expected a folder holding {holds}", file=str(path))
    return path


def text_file(path: Path | str, flag: str) -> str:
    """The UTF-8 text of a readable file."""
    path = existing_file(path, flag)
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{flag}: not UTF-8 text ({e.reason} at byte {e.start}); expected a text file",
                         file=str(path)) from None
    except OSError as e:
        raise os_error(e, what=flag) from None


def text_head(path: Path | str, flag: str, size: int = 1 << 16) -> None:
    """The first `size` bytes of a file are UTF-8 text (a binary file where text belongs is refused
    without reading it all)."""
    path = existing_file(path, flag)
    with open(path, "rb") as f:
        head = f.read(size)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not a multi-byte character cut at the end of the head
            raise InputError(f"{flag}: not UTF-8 text ({e.reason} at byte {e.start}); expected a text file",
                             file=str(path)) from None


def toml_file(path: Path | str, flag: str) -> dict[str, Any]:
    """The tables of a TOML file."""
    try:
        return tomllib.loads(text_file(path, flag))
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{flag}: not valid TOML: {e}", file=str(path)) from None


def json_file(path: Path | str, flag: str, *, kind: type = dict) -> Any:
    """The value of a JSON file, which must be a `kind` (an object by default)."""
    try:
        value = json.loads(text_file(path, flag))
    except json.JSONDecodeError as e:
        raise InputError(f"{flag}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})",
                         file=str(path)) from None
    if not isinstance(value, kind):
        raise InputError(f"{flag}: expected a JSON {'object' if kind is dict else kind.__name__}, "
                         f"found {type(value).__name__}", file=str(path))
    return value


def writable_dir(path: Path | str, flag: str) -> Path:
    """`path` is a folder jex may create or write into: no file in the way, at it or above it."""
    return _writable(Path(path), flag, folder=True)


def writable_file(path: Path | str, flag: str) -> Path:
    """`path` is a file jex may create or replace: not a folder, and its folder can be made."""
    return _writable(Path(path), flag, folder=False)


def _writable(path: Path, flag: str, *, folder: bool) -> Path:
    if path.exists():
        if folder and not path.is_dir():
            raise InputError(f"{flag}: expected a folder, found a file", file=str(path))
        if not folder and path.is_dir():
            raise InputError(f"{flag}: expected a file, found a folder", file=str(path))
        target = path if folder else path.parent
        if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            raise InputError(f"{flag}: not writable (permission denied)", file=str(target))
        return path
    above = path.absolute().parent
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise InputError(f"{flag}: cannot create it: {above} is a file, not a folder", file=str(path))
    if not os.access(above, os.W_OK | os.X_OK):
        raise InputError(f"{flag}: cannot create it: {above} is not writable (permission denied)", file=str(path))
    return path


def suite(path: Path | str, flag: str = "--suite", *, bundle_ok: bool = True) -> Path:
    """A suite folder whose manifest loads and whose first row is valid, or (`bundle_ok`) a bundle file."""
    from jex.suite import iter_rows, load_manifest

    path = Path(path)
    if bundle_ok and path.is_file():
        if not path.name.endswith((".tar.gz", ".tgz")):
            raise InputError(f"{flag}: expected a suite folder (holds suite.toml) or a bundle (.tar.gz)",
                             file=str(path))
        return existing_file(path, flag)
    existing_dir(path, flag)
    manifest = load_manifest(path)
    if next(iter(iter_rows(path, manifest)), None) is None:
        raise InputError(f"{flag}: the suite has no rows", file=str(path))
    return path


def model(value: str | None, flag: str = "--model") -> None:
    """A model folder (holds config.json), a GGUF file (its header magic), or a Hub id `org/name[@rev]`."""
    if value is None:
        return
    path = Path(value)
    if path.is_dir():
        existing_dir(path, flag, holds="config.json")
    elif path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{flag}: expected a model folder, a .gguf file or a Hub id", file=value)
        with open(existing_file(path, flag), "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise InputError(f"{flag}: not a GGUF file (its first bytes are not 'GGUF')", file=value)
    elif path.exists() or not HUB_ID.match(value):
        raise InputError(f"{flag}: no such model folder or file, and not a Hub id (org/name[@revision])",
                         file=value)


def rules(path: Path | str | None, flag: str = "--overlays") -> None:
    """An overlay rule file: TOML of `[[rules]]` tables (at least one), each a known rule kind."""
    if path is None:
        return
    from jex.overlays import load_rule_file

    existing_file(path, flag)
    if not load_rule_file(Path(path)):
        raise InputError(f"{flag}: the rule file holds no [[rules]] table", file=str(path))


def rows_file(path: Path | str, flag: str, *, needs: tuple[str, ...] = ("run_id",)) -> Path:
    """A JSONL or Parquet file of rows whose first row has the fields `needs` (read: one row only)."""
    from jex.suite import read_row_file

    path = existing_file(path, flag)
    if path.suffix not in (".jsonl", ".ndjson", ".parquet"):
        raise InputError(f"{flag}: expected a .jsonl or .parquet file of rows", file=str(path))
    if path.suffix != ".parquet":
        text_head(path, flag)
    try:
        first = next(iter(read_row_file(path)), None)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"{flag}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                         file=str(path)) from None
    if first is None:
        raise InputError(f"{flag}: the file holds no rows", file=str(path))
    line, record = first
    missing = [f for f in needs if not isinstance(record, dict) or f not in record]
    if missing:
        raise InputError(f"{flag}: expected the fields {', '.join(needs)}", file=str(path), row=line, field=missing[0])
    return path


def reachable(host: str, port: int, flag: str, timeout: float = 5.0) -> None:
    """An SSH server answers at `host:port` (its banner, `SSH-...`): a host that cannot be reached is
    refused now, not after a machine's retries inside a flow."""
    import socket

    from jex.errors import InfraError

    try:
        conn = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise InfraError(f"{flag} {host}: port {port} cannot be reached ({e.strerror or e or 'timed out'})") from None
    try:
        banner = conn.recv(256)
    except OSError:
        banner = b""
    finally:
        conn.close()
    if not banner.startswith(b"SSH-"):
        raise InfraError(f"{flag} {host}: no SSH server answers on port {port} (no SSH banner)")


def choice(value: str | None, flag: str, allowed: tuple[str, ...]) -> None:
    """`value` is one of `allowed` (or not given)."""
    if value is not None and value not in allowed:
        raise InputError(f"{flag}: expected one of {', '.join(allowed)}, got {value!r}")


def at_least(value: float | None, flag: str, low: float) -> None:
    """`value` is `low` or more (or not given)."""
    if value is not None and value < low:
        raise InputError(f"{flag}: expected a number >= {low:g}, got {value:g}")


def share(value: float | None, flag: str) -> None:
    """`value` is a share in [0, 1] (or not given)."""
    if value is not None and not 0 <= value <= 1:
        raise InputError(f"{flag}: expected a share between 0 and 1, got {value:g}")


def int_list(text: str, flag: str, *, low: int = 1) -> list[int]:
    """A comma-separated list of integers, each `low` or more (`1,8,16`)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError(f"{flag}: expected comma-separated integers (e.g. 1,8,16), got {text!r}") from None
    if not values or min(values) < low:
        raise InputError(f"{flag}: expected comma-separated integers >= {low}, got {text!r}")
    return values
