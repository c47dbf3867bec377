"""A model folder served to vLLM through a link named by its architecture shape, so that a fine-tune starts
from its base's compile cache.

vLLM names its compile cache by a hash of its configuration, and that hash holds the model path it is given
(`ModelConfig.compute_hash` hashes the `model` field with the model's `config.json`). Two models of one shape
at two paths (a base and its fine-tune) therefore compile twice, although their compiled graphs are the same:
only the weights differ, and compiled code does not hold weights. Given through one link per shape
(`ROOT/<architecture>-<shape sha16>`), they share vLLM's cache on a machine and the cache jex carries to the
next machine (`engine/compile_cache.py`). vLLM still hashes the whole `config.json`: a fine-tune whose config
differs in any value compiles anew, as it would without the link.

A link names one model at a time. An engine holds a shared lock on it for its start (where vLLM reads the
folder's config, tokenizer and weights); pointing it at another model takes the exclusive lock, so a start
of another model of the same shape waits for the starts under way. The link only saves time: where it
cannot be made, the engine is given the folder itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from jex.engine.models import architecture_shape
from jex.engine.types import EngineDeadError


def shape_link_name(folder: Path) -> str:
    """The link's name for a model folder: its architecture and the sha256 of its shape (16 hex digits)."""
    shape = architecture_shape(folder)
    return f"{shape.architecture}-{hashlib.sha256(shape.model_dump_json().encode()).hexdigest()[:16]}"


def _points_at(link: Path, target: Path) -> bool:
    try:
        return link.is_symlink() and Path(os.readlink(link)) == target
    except OSError:
        return False


@contextmanager
def served_by_shape(folder: Path, root: Path) -> Iterator[Path]:
    """The path to give vLLM for `folder` while it starts: `root/<shape link name>`, pointing at `folder`
    and held (shared) until the context ends; `folder` itself where no link can be made (printed)."""
    try:
        link = root / shape_link_name(folder)
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f"{link.name}.lock", "a")  # noqa: SIM115 - held for the start, closed below
    except (OSError, EngineDeadError) as e:
        print(f"{folder}: served by its own path, not by its shape's link ({type(e).__name__}: {e})", flush=True)
        yield folder
        return
    with lock:
        try:
            _hold(lock, link, folder.resolve())
        except OSError as e:
            print(f"{folder}: served by its own path, not by {link} ({type(e).__name__}: {e})", flush=True)
            yield folder
            return
        try:
            yield link
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _hold(lock: IO[str], link: Path, target: Path) -> None:
    """Return holding `lock` shared, with `link` pointing at `target`."""
    while True:
        fcntl.flock(lock, fcntl.LOCK_SH)
        if _points_at(link, target):
            return
        fcntl.flock(lock, fcntl.LOCK_UN)
        fcntl.flock(lock, fcntl.LOCK_EX)  # no start of another model holds the link now
        try:
            fresh = link.with_name(f".{link.name}.{os.getpid()}")
            fresh.unlink(missing_ok=True)
            fresh.symlink_to(target)
            os.replace(fresh, link)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)  # then shared again: another model may have taken it meanwhile


__all__ = ["served_by_shape", "shape_link_name"]
