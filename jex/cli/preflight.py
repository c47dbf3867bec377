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
from typing import TYPE_CHECKING, Any

from jex.errors import InputError, os_error
from jex.settings import PROVIDER_NAMES

if TYPE_CHECKING:
    from jex.engine_spec import EngineSpec
    from jex.settings import JexSettings

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
"""`org/name[@revision]`: the syntax of a Hub model id (as `engine/models.py` resolves it)."""
PROVIDERS = PROVIDER_NAMES
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
    from jex.suite import iter_all_rows, load_manifest

    path = Path(path)
    if bundle_ok and path.is_file():
        if not path.name.endswith((".tar.gz", ".tgz")):
            raise InputError(f"{flag}: expected a suite folder (holds suite.toml) or a bundle (.tar.gz)",
                             file=str(path))
        from jex.tasks.bundle.bundle_file import bundle_manifest

        existing_file(path, flag)
        manifest_doc = bundle_manifest(path)
        if manifest_doc.rows + (manifest_doc.generate_rows or 0) < 1:  # multiple-choice and generative
            raise InputError(f"{flag}: the bundle has no rows", file=str(path))
        return path
    existing_dir(path, flag)
    manifest = load_manifest(path)
    if next(iter(iter_all_rows(path, manifest)), None) is None:
        raise InputError(f"{flag}: the suite has no rows", file=str(path))
    return path


def local_engine(engine: EngineSpec, provider: str) -> None:
    """An HF engine that runs on this machine (the `inprocess` and `local` providers) needs torch and
    transformers, which the orchestrator's core install leaves out: one line naming the `cpu` extra."""
    from jex.extras import LOCAL_ENGINE_MODULES, check_extra

    if provider in ("inprocess", "local") and engine.kind in ("hf", "hf-batched"):
        for module in LOCAL_ENGINE_MODULES:
            check_extra(module, "cpu", why=f" (the {engine.kind} engine runs on this machine)")


def model(value: str | None, flag: str = "--model") -> None:
    """A model folder (holds config.json), a GGUF file (its header: magic, a version jex reads, counts
    its size can hold; `engine.models.gguf_header_problem`), or a Hub id `org/name[@rev]`."""
    from jex.engine_spec import EMBEDDED_MODEL, SERVED_PREFIX

    if value is None or value in ("", EMBEDDED_MODEL) or value.startswith(SERVED_PREFIX):  # served: its server's
        return
    path = Path(value)
    if path.is_dir():
        existing_dir(path, flag, holds="config.json")
    elif path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{flag}: expected a model folder, a .gguf file or a Hub id", file=value)
        from jex.engine.models import gguf_header_problem

        try:
            problem = gguf_header_problem(existing_file(path, flag))
        except OSError as e:
            raise os_error(e, what=flag) from None
        if problem:
            raise InputError(f"{flag}: {problem}", file=value)
    elif path.exists() or not HUB_ID.match(value):
        raise InputError(f"{flag}: no such model folder or file, and not a Hub id (org/name[@revision])",
                         file=value)


def results_survive_poweroff(provider: str, settings: JexSettings) -> None:
    """A campaign on a provider whose machines lose their disk when they power off (`ec2`, `command`
    unless JEX_INFRA__COMMAND_KEEPS_DISK) has a bucket for its results: refused in one line otherwise
    (`jex.infra.reaper.check_results_survive`, which the fleet applies too)."""
    from jex.infra.reaper import check_results_survive, keeps_disk

    if provider != "inprocess":
        check_results_survive(provider, keeps_disk=keeps_disk(provider, settings.infra),
                              bucket=settings.store.s3_bucket, watchdog=settings.infra.watchdog)


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


SAMPLE_PROMPT_TOKENS = 86
"""Tokens of a reason prompt of the embedded sample suite, chat template included (mean measured on the
H200: 86,211 prompt tokens over 1,000 rows, `bench/results/h200-real-size.json`)."""
CHARS_PER_TOKEN = 3
"""Characters per token assumed for a suite's longest prompt (English averages ~4: on the safe side)."""
TEMPLATE_TOKENS = 64
"""Tokens the question template, chat template and system turn add to a row's text (assumed)."""


def model_fits(engine: EngineSpec, *, gpu_kind: str, gpu_kinds: dict[str, float], reason_max_tokens: int,
               suite: str | None = None) -> str | None:
    """The memory pre-flight of a vLLM engine on CUDA (`engine/memory.py`): raises `InputError` when the
    model cannot fit one GPU of `gpu_kind`, returns a one-line warning when its KV cache holds fewer than
    64 reason sequences, None otherwise. Skipped (None) for CPU or HF engines, the embedded model, a
    GGUF file, a Hub model not in the local cache and a config that is not a decoder's."""
    from jex.engine.memory import GPU_KINDS, FitRequest, GpuKind, ModelShape, estimate_fit
    from jex.engine.models import safetensors_index_size

    if not engine.device.startswith("cuda") or not engine.kind.startswith("vllm"):
        return None
    folder = _model_folder(engine.model)
    if folder is None:
        return None
    kinds = GPU_KINDS | {name: GpuKind(name=name, memory_gib=gib) for name, gib in gpu_kinds.items()}
    if gpu_kind not in kinds:
        raise InputError(f"unknown GPU kind {gpu_kind!r}; known: {', '.join(sorted(kinds))} (declare others in "
                         "JEX_INFRA__GPU_KINDS, e.g. '{\"L40S\": 44.4}')", field="JEX_INFRA__GPU_KIND")
    config = json_file(folder / "config.json", "--model")
    try:
        shape = ModelShape.from_config(config.get("text_config") or config)
    except (KeyError, TypeError, ValueError):
        return None  # not a decoder config we can size: vLLM's own profiling will tell
    prompt_tokens = _prompt_tokens(suite)
    seq = prompt_tokens + reason_max_tokens
    fit = estimate_fit(FitRequest(
        shape=shape, dtype=engine.dtype, weights_bytes_on_disk=safetensors_index_size(folder), gpu=kinds[gpu_kind],
        vllm=engine.vllm,
        reason_seq_tokens=min(seq, engine.max_model_len) if engine.max_model_len else seq))
    if fit.refusal:
        raise InputError(f"--model: {fit.refusal}", file=str(folder))
    return fit.warning


def _model_folder(model: str | None) -> Path | None:
    """The folder holding the model's config.json: a model folder, or a Hub id's snapshot in the local
    cache (never downloaded here); None for the embedded model, a GGUF file or an uncached Hub id."""
    if model is None:
        return None
    path = Path(model)
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    match = HUB_ID.match(model)
    if path.exists() or not match:
        return None
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(match["repo"], revision=match["revision"], local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local Hub cache: nothing to estimate from
        return None
    return folder if (folder / "config.json").is_file() else None


def _prompt_tokens(suite: str | None) -> int:
    """Tokens of the longest reason prompt: the longest of a suite folder's first 256 rows (characters /
    CHARS_PER_TOKEN + TEMPLATE_TOKENS); the sample suite's measured mean without a suite folder (the
    embedded suite, or a bundle, whose rows are not unpacked here)."""
    if not suite or not Path(suite).is_dir():
        return SAMPLE_PROMPT_TOKENS
    from itertools import islice

    from jex.suite import iter_rows

    longest = max((len(row.prompt) + sum(len(o) + 4 for o in row.options) for row in islice(iter_rows(suite), 256)),
                  default=0)
    return longest // CHARS_PER_TOKEN + TEMPLATE_TOKENS
