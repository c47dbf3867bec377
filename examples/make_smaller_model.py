"""The second model of `examples/models.toml`: the embedded SmolLM2-135M with only its first decoder
layers (20 of 30 by default, ~106M parameters), as a model folder any engine loads. A real, different
model made on this machine in seconds, with nothing downloaded.

    python examples/make_smaller_model.py                 # -> runs/smollm2-20-layers
    python examples/make_smaller_model.py --layers 10 --out runs/smollm2-10-layers

The weights are the embedded model's (its GGUF converted to safetensors by jex), the later layers' tensors
dropped; the tokenizer and chat template are copied. Written under a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path


def smaller_model(out: Path, layers: int) -> Path:
    """Write the embedded model with its first `layers` decoder layers to `out` (kept if already there)."""
    from safetensors.torch import load_file, save_file

    from jex.engine.hf import DEFAULT_CACHE
    from jex.engine.models import resolve_model

    if (out / "config.json").exists():
        return out
    src = resolve_model(None, DEFAULT_CACHE).path
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers: expected 1 to {config['num_hidden_layers'] - 1}, got {layers}")
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    layer_of = re.compile(r"^model\.layers\.(\d+)\.")
    for weights in src.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(weights).items()
                   if not (m := layer_of.match(k)) or int(m.group(1)) < layers}
        save_file(tensors, tmp / weights.name, metadata={"format": "pt"})
    for f in src.iterdir():
        jex_files = f.name.startswith(("jex-", ".jex"))  # the conversion's own records
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" and not jex_files:
            shutil.copy(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.replace(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers kept (of 30)")
    ap.add_argument("--out", type=Path, default=Path("runs/smollm2-20-layers"))
    a = ap.parse_args()
    print(smaller_model(a.out, a.layers))


if __name__ == "__main__":
    main()
