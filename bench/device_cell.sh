#!/usr/bin/env bash
# One call of issue 54's day-one bench on the GPU device, after the staging (bench/device_wheels.sh's header):
#     bash bench/device_cell.sh NAME --work DIR [day_one.py flags...]
# `bench/device_bench.sh NAME day_one.py ...`: NAME.json (the cells measured so far), NAME.out and
# NAME-logs.tar.gz (every run's logs, machines.json and audit files) in $OUT, whatever happened.
# DAY_ONE_TIMEOUT (default 570 s) bounds the bench, so that the logs still come back from a call that would
# outlast the device's 600 s.
set -uo pipefail
NAME=$1; shift
BENCH_TIMEOUT="${DAY_ONE_TIMEOUT:-570}" exec bash "$(dirname "$0")/device_bench.sh" "$NAME" day_one.py "$@"
