#!/usr/bin/env bash
# Wheels the GPU device lacks, for the campaign benchmarks there (`bench/gpu_campaign.py`), built here:
#   .whl/   polars and its runtime (~53 MB)           -> install to /tmp/site2 on the device
#   .whl2/  prefect, boto3, pydantic-settings and the rest of their closure that neither the device
#           image nor the vLLM staging (../shared/device) holds (~47 MB) -> /tmp/site3
#   .whl3/  the machines' stack lock (infra/stack-vllm.lock) at its pins where the image holds another
#           version: accelerate, gguf, pydantic (+ its pydantic-core), safetensors, typer (~4 MB)
#   .whl4/  pyarrow at its pin (~53 MB), .whl5/ numpy at its pin (~16 MB: small enough to ride with a
#           staging part)                                                 .whl3-5 -> /tmp/site4, first on PYTHONPATH
# With /tmp/site4 first, a `local`-provider campaign's machine bootstrap finds the lock satisfied (it checks
# every pin and would otherwise try to install the whole stack, offline). Each folder travels in its own
# `run` call (64 MiB per call), or beside a staging part where it fits. Versions come from constraints.txt
# and the stack lock, for the device's Python 3.12 on x86_64. The folders are git-ignored (.git/info/exclude).
# Staging that worked on an H100 (2026-12-05, 8 back-to-back calls, ~4 min of device time with the machine's
# start): p1 + .whl3, p2, p3, p4, p5 + .whl5 (../shared/device/build_payload.sh's parts), .whl, .whl4, .whl2;
# each wheel folder installed with `python3 -m pip install -q --no-index --no-deps --no-compile --upgrade
# --target /tmp/siteN FOLDER/*.whl` (site2: .whl, site3: .whl2, site4: .whl3-5); then `source
# bench/device_jex.sh` puts them on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=$(mktemp -d)
python3 -m pip download -q -c constraints.txt --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$ALL" prefect polars pydantic-settings boto3 tomli-w
python3 - "$ALL" <<'PY'
import pathlib, shutil, sys
kinds = pathlib.Path("/work/.library/device/KINDS.md").read_text()
line = next(l for l in kinds.splitlines() if "nvidia-h200" in l and "Packages:" in l)
norm = lambda n: n.strip().lower().replace("_", "-")
have = {norm(n) for n in line.split("Packages:")[1].rstrip(".").split(",")}
have |= {norm(l.split("==")[0]) for l in open("../shared/device/deplist.txt") if "==" in l}
for folder in (".whl", ".whl2"):
    shutil.rmtree(folder, ignore_errors=True)
    pathlib.Path(folder).mkdir()
for w in pathlib.Path(sys.argv[1]).glob("*.whl"):
    name = norm(w.name.split("-")[0])
    if name.startswith("polars"):
        shutil.copy(w, ".whl")
    elif name not in have:
        shutil.copy(w, ".whl2")
PY
rm -rf "$ALL"
# the stack lock's pins the image holds at another version (torch, transformers and vllm come from the image
# and the vLLM staging; polars and boto3 from .whl and .whl2)
LOCK=$(mktemp -d)
grep -vE '^(torch|transformers|vllm|polars|boto3)==' infra/stack-vllm.lock > "$LOCK/pins.txt"
CORE=$(grep -i '^pydantic-core==' constraints.txt)  # the core the pinned pydantic requires
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$LOCK/w" -r "$LOCK/pins.txt" $CORE
rm -rf .whl3 .whl4 .whl5 && mkdir .whl3 .whl4 .whl5
for w in "$LOCK"/w/*.whl; do
  case "$(basename "$w")" in pyarrow-*) mv "$w" .whl4 ;; numpy-*) mv "$w" .whl5 ;; *) mv "$w" .whl3 ;; esac
done
rm -rf "$LOCK"
for f in /.whl/ /.whl2/ /.whl3/ /.whl4/ /.whl5/; do grep -qx "$f" .git/info/exclude 2>/dev/null || echo "$f" >> .git/info/exclude; done
du -sh .whl .whl2 .whl3 .whl4 .whl5
