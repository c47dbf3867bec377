"""A machine's engine compile cache: vLLM's `torch.compile` output, packed once and carried to later starts.

A machine's engine folder (HOME) has one folder per engine slot (`HOME/slot-S/`); each slot's engine
process writes vLLM's cache under `HOME/slot-S/vllm-cache` (`VLLM_CACHE_ROOT`, `cache_env`). After the
machine's first engine start the slot's cache is packed to `HOME/compile-cache.tar.gz` and unpacked
for the machine's later slots; `HOME/compile-cache.in.tar.gz` is one brought from an earlier machine
of the same engine, unpacked before a slot's first start. Each slot has its own folder: engines that
start together never write one cache at the same time. The cache only saves time: a cache that does
not unpack or pack is printed and dropped, never raised. Where the orchestrator keeps the cache
between machines (its store key) is the orchestrator's business, not this module's.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from jex.fileio import atomic_path

COMPILE_CACHE = "compile-cache.tar.gz"
"""`HOME/compile-cache.tar.gz`: the machine's packed compile cache (see the module docstring)."""
COMPILE_CACHE_IN = "compile-cache.in.tar.gz"
"""`HOME/compile-cache.in.tar.gz`: a compile cache brought from an earlier machine of the same engine."""
CACHE_ROOT_FILE = ".jex-cache-root"
"""Inside a packed compile cache: the absolute folder it was packed from. vLLM's index of compiled
artifacts (`vllm_compile_cache.py`) names each artifact by absolute path, so a cache restored under
another folder has those paths rewritten to its new folder (without that, the start fails with
FileNotFoundError on the first machine's path, as found on the H200)."""
_CACHE_INDEX = "vllm_compile_cache.py"
_SLOT, _SLOT_CACHE = "slot-", "vllm-cache"


MODELINFOS = "modelinfos"
"""`VLLM_CACHE_ROOT/modelinfos/`: vLLM's record of each model architecture it inspected (one JSON file per model
class, keyed by the hash of vLLM's model file). A start that finds none inspects the architecture in a fresh
Python process that imports vLLM: 20 s of each of the two engine starts of a first campaign on the H200 (the
campaign engine's and the settings audit's control, each with a cache folder of its own)."""


def slot_dir(home: Path, slot: int) -> Path:
    """The folder of one engine slot under a machine's engine folder: its engine process's files."""
    return home / f"{_SLOT}{slot}"


def cache_dir(home: Path, slot: int) -> Path:
    """The slot's vLLM cache folder (`VLLM_CACHE_ROOT` of its engine process)."""
    return slot_dir(home, slot) / _SLOT_CACHE


def cache_env(home: Path, slot: int) -> dict[str, str]:
    """The environment that points the slot's engine process at its cache folder."""
    return {"VLLM_CACHE_ROOT": str(cache_dir(home, slot))}


def restore_compile_cache(home: Path, slot: int) -> str:
    """Before a slot's engine start: fill its empty cache folder from the machine's packed cache (an
    earlier slot compiled: `warm`) or from one brought from an earlier machine (`restored`). Returns
    how the start finds its cache (`cold`, `warm` or `restored`). An archive that does not unpack is
    dropped and the start goes on without it."""
    cache = cache_dir(home, slot)
    if cache.is_dir() and any(cache.iterdir()):
        return "warm"
    for archive, how in ((home / COMPILE_CACHE, "warm"), (home / COMPILE_CACHE_IN, "restored")):
        if archive.exists() and _unpack_cache(archive, cache):
            return how
    return "cold"


def _unpack_cache(archive: Path, cache: Path) -> bool:
    cache.parent.mkdir(parents=True, exist_ok=True)
    fresh = Path(tempfile.mkdtemp(prefix=".vllm-cache.", dir=cache.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(fresh, filter="data")
        _relocate_cache_index(fresh, cache)
        shutil.rmtree(cache, ignore_errors=True)
        fresh.rename(cache)
        return True
    except (tarfile.TarError, OSError, EOFError, UnicodeDecodeError) as e:
        print(f"compile cache {archive} not used: {e}", flush=True)
        shutil.rmtree(fresh, ignore_errors=True)
        archive.unlink(missing_ok=True)
        return False


def _relocate_cache_index(unpacked: Path, cache: Path) -> None:
    """Point the absolute paths in an unpacked cache's artifact indexes at `cache`, its final folder."""
    marker = unpacked / CACHE_ROOT_FILE
    if not marker.exists():
        return
    old, new = marker.read_text().strip().rstrip("/") + "/", str(cache.resolve()) + "/"
    marker.unlink()
    for index in unpacked.rglob(_CACHE_INDEX):
        text = index.read_text()
        if old in text:
            index.write_text(text.replace(old, new))


def pack_compile_cache(home: Path, slot: int) -> Path | None:
    """After a machine's own engine start: pack the slot's cache folder, once per machine (None when
    there is nothing, or when packing failed: the cache only saves time, so a failure is printed,
    never raised)."""
    cache, out = cache_dir(home, slot), home / COMPILE_CACHE
    files = sorted(p for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else []
    if out.exists() or not files:
        return out if out.exists() else None
    t0, raw = time.perf_counter(), 0
    try:
        # level 1: the golden job waits for this; tarfile's default (9) is several times slower for ~10% less
        with atomic_path(out) as tmp, tarfile.open(tmp, "w:gz", compresslevel=1) as tar:
            for p in files:
                tar.add(p, arcname=p.relative_to(cache).as_posix())
                raw += p.stat().st_size
            root = str(cache.resolve()).encode()
            info = tarfile.TarInfo(CACHE_ROOT_FILE)
            info.size = len(root)
            tar.addfile(info, io.BytesIO(root))
        print(f"compile cache packed: {len(files)} files, {raw / 1e6:.1f} MB -> {out.stat().st_size / 1e6:.1f} MB "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
    except (tarfile.TarError, OSError) as e:
        print(f"compile cache not packed: {e}", flush=True)
        return None
    return out


def bring_compile_cache(home: Path, path: Path) -> None:
    """Place a compile cache from an earlier machine where this machine's first engine start finds it."""
    target = home / COMPILE_CACHE_IN
    if path.exists() and not target.exists():
        with atomic_path(target) as tmp:
            shutil.copyfile(path, tmp)


def take_compile_cache(home: Path, dest: Path) -> bool:
    """Copy this machine's packed compile cache to `dest` (a job artifact); False when there is none."""
    packed = home / COMPILE_CACHE
    if not packed.exists():
        return False
    with atomic_path(dest) as tmp:
        shutil.copyfile(packed, tmp)
    return True


def seed_modelinfos(cache_root: Path, home: Path) -> int:
    """Before an engine start with its own cache folder `cache_root` (the audit's control): copy in the
    architecture inspections the machine's engine slots under `home` already made, where it lacks them. Returns
    how many files it copied. Like the compile cache it only saves time: a copy that fails is printed, never
    raised, and vLLM inspects again."""
    copied = 0
    for source in sorted(home.glob(f"{_SLOT}*/{_SLOT_CACHE}/{MODELINFOS}/*.json")):
        target = cache_root / MODELINFOS / source.name
        if target.exists():
            continue
        try:
            with atomic_path(target) as tmp:
                shutil.copyfile(source, tmp)
            copied += 1
        except OSError as e:
            print(f"model info {source} not copied: {e}", flush=True)
    return copied


__all__ = ["CACHE_ROOT_FILE", "COMPILE_CACHE", "COMPILE_CACHE_IN", "bring_compile_cache", "cache_dir", "cache_env",
           "pack_compile_cache", "restore_compile_cache", "seed_modelinfos", "slot_dir", "take_compile_cache"]
