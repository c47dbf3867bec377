#!/usr/bin/env bash
# Run a command with the local services the tests need, and stop them (by PID) afterwards.
# Services that later issues add (OpenSSH, an S3 server, a Prefect server) are started by the
# test fixtures themselves, on 127.0.0.1 only; this wrapper only isolates Prefect's home folder.
set -euo pipefail
export PREFECT_HOME="${PREFECT_HOME:-$(mktemp -d /tmp/jex-prefect-home.XXXXXX)}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_LEVEL=WARNING
exec "$@"
