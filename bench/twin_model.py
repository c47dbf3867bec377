"""A fine-tune's stand-in for issue 54's bench: the base model's weights with small seeded noise, same config.

    python3 bench/twin_model.py --src /tmp/smollm2 --out /tmp/smollm2-twin

Its architecture shape (`engine/models.py: architecture_shape`) is the base's, its weights' bytes are not: a
settings audit stored for the base covers it. The noise (each tensor + N(0, (0.02 * its std)^2)) keeps the
answers close to the base's, so its generations cost what the base's cost.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="the base model's folder (bf16 safetensors)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scale", type=float, default=0.02, help="the noise's std as a share of each tensor's std")
    a = ap.parse_args()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.src, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * float(p.float().std())
            p.add_((a.scale * noise).to(p.dtype))
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    for f in a.src.iterdir():
        if not (a.out / f.name).exists() and f.is_file() and not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, a.out / f.name)
    print(json.dumps({"out": str(a.out), "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
