#!/usr/bin/env bash
# One call of a bench script on the GPU device, after the staging (bench/device_wheels.sh's header):
#     bash bench/device_bench.sh NAME SCRIPT --work DIR [SCRIPT's flags...]   (e.g. gpu_sampled.py --work /tmp/w ...)
# runs `python3 bench/SCRIPT ... --out $OUT/NAME.json` and leaves in $OUT, whatever happened, NAME.json (what was
# measured so far), NAME.out (its output) and NAME-logs.tar.gz (every run's logs and small records under its
# --work: what a failed call needs to be fixed without another call). BENCH_TIMEOUT (default 570 s) bounds the
# script, so that the logs still come back from a call that would outlast the device's 600 s.
set -uo pipefail
NAME=$1; SCRIPT=$2; shift 2
WORK=$(python3 -c 'import sys; a=sys.argv[1:]; print(a[a.index("--work")+1] if "--work" in a else "")' "$@")
[ -n "$WORK" ] || { echo "device_bench.sh: give the script's --work folder (its logs are packed from there)"; exit 2; }
source /tmp/stage/env.sh
source bench/device_jex.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${BENCH_TIMEOUT:-570}" python3 "bench/$SCRIPT" --out "$OUT/$NAME.json" "$@" 2>&1 | tee "$OUT/$NAME.out"
rc=${PIPESTATUS[0]}
find "$WORK" \( -name '*.log' -o -name machines.json -o -name 'result.json' -o -name 'served.json' \
  -o -name 'stages.json' -o -name 'engine-start*.json' -o -name 'probe*.json' -o -name 'arm-*.json' \
  -o -name 'control-s*.json' -o -name bakeoff.json -o -name 'audit*.json' \) -size -2M -print0 2>/dev/null \
  | tar czf "$OUT/$NAME-logs.tar.gz" --null -T - 2>/dev/null
exit $rc
