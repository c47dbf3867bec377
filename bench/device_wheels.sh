#!/usr/bin/env bash
# Wheels the GPU device lacks, for the campaign benchmarks there (`bench/gpu_campaign.py`), built here:
#   .whl/   polars and its runtime (~53 MB)           -> install to /tmp/site2 on the device
#   .whl2/  prefect, boto3, pydantic-settings and the rest of their closure that neither the device
#           image nor the vLLM staging (../shared/device) holds (~47 MB) -> /tmp/site3
# Each folder travels in its own `run` call (64 MiB per call). Versions come from constraints.txt,
# for the device's Python 3.12 on x86_64. Both folders are git-ignored (.git/info/exclude).
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
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.whl2/\n' >> .git/info/exclude
du -sh .whl .whl2
