#!/usr/bin/env bash
# Run a command with the local services the tests need.
# System packages the fixtures start (OpenSSH server, Chromium for the UI test) are installed from
# Debian when missing and we are root; the servers themselves (sshd, the S3 server, the Prefect
# server) are started by the test fixtures on 127.0.0.1 only and stopped by PID.
set -euo pipefail
need=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing from Debian: ${need[*]}"
  (apt-get install -y -q "${need[@]}" >/dev/null 2>&1) || (apt-get update -q >/dev/null && apt-get install -y -q "${need[@]}" >/dev/null)
fi
export PREFECT_HOME="${PREFECT_HOME:-$(mktemp -d /tmp/jex-prefect-home.XXXXXX)}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_LOGGING_LEVEL=WARNING
exec "$@"
