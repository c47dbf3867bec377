#!/usr/bin/env bash
# One call of issue 54's day-one bench on the GPU device, after the staging (bench/device_wheels.sh's header):
#     bash bench/device_cell.sh NAME [day_one.py flags...]
# runs `bench/day_one.py ... --out $OUT/NAME.json` and leaves in $OUT, whatever happened, NAME.json (the cells
# measured so far), NAME.out (its output: a line per run as it ends) and NAME-logs.tar.gz (every run's logs,
# machines.json and audit files: what a failed call needs to be fixed without another call).
# DAY_ONE_TIMEOUT (default 570 s) bounds the bench, so that the logs still come back from a call that would
# outlast the device's 600 s.
set -uo pipefail
NAME=$1; shift
source /tmp/stage/env.sh
source bench/device_jex.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${DAY_ONE_TIMEOUT:-570}" python3 bench/day_one.py --out "$OUT/$NAME.json" "$@" 2>&1 | tee "$OUT/$NAME.out"
rc=${PIPESTATUS[0]}
WORK=$(python3 -c 'import sys; a=sys.argv[1:]; print(a[a.index("--work")+1] if "--work" in a else "/tmp/day-one")' "$@")
find "$WORK" \( -name '*.log' -o -name machines.json -o -name 'probe*.json' -o -name 'arm-*.json' \
  -o -name 'control-s*.json' -o -name bakeoff.json -o -name 'audit*.json' -o -name 'engine-start*.json' \) \
  -size -2M -print0 2>/dev/null | tar czf "$OUT/$NAME-logs.tar.gz" --null -T - 2>/dev/null
exit $rc
