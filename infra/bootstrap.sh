#!/usr/bin/env bash
# Worker bootstrap, uploaded by the orchestrator and run on the machine. Idempotent: a second run
# with the same code and stack finds everything in place and only rewrites provenance.json.
#   bash bootstrap.sh WORKDIR CODE_SHA PYTHON   (stdin: one JSON line of watchdog credentials, or empty)
# WORKDIR holds code-CODE_SHA.tar.gz and stack.lock (pip requirement pins), installed into a venv when the
# interpreter does not satisfy them (with uv, pip the fallback; JEX_PIP_ARGS: options for both, e.g. an
# index URL). Prints one JSON line:
# the python the jobs must use, the folder put first on their PATH (BIN: the stack's bin folder, beside that
# python) and whether the stack was reused or installed. JEX_REQUIRED_TOOLS: executables the engine needs on
# PATH ("a|b": any one of them), looked up with BIN first, as the jobs will; a missing one exits 4 with one
# line naming it. JEX_POWEROFF_AFTER_S (a cloud machine): its hard time to live; JEX_POWEROFF_COMMAND: how
# it powers off, when not `shutdown -h`.
set -euo pipefail
W=$1; SHA=$2; PY=$3
cd "$W"
CODE="$W/code/$SHA"
if [ ! -f "$CODE/.unpacked" ]; then
  rm -rf "$CODE" && mkdir -p "$CODE"
  tar -xzf "code-$SHA.tar.gz" -C "$CODE"
  touch "$CODE/.unpacked"
fi

check_stack() {  # prints the pins the interpreter does not satisfy; empty output = all satisfied
  "$1" - stack.lock <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, want = line.partition("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want and (have or "").split("+")[0] != want:  # ==2.13.0 takes 2.13.0+cpu, as pip's PEP 440 does
        print(f"{name}: want {want}, have {have}")
EOF
}

# shellcheck disable=SC2086  # JEX_PIP_ARGS is a list of pip options (e.g. an index URL)
install_stack() {  # stack.lock into the venv $W/stack: with uv where it can stand in for pip, else with pip
  "$PY" -m venv "$W/stack"
  local SPY="$W/stack/bin/python" UV=""
  # uv downloads and unpacks in parallel where pip goes one wheel at a time (a torch or vLLM stack is
  # gigabytes). It reads JEX_PIP_ARGS but not pip's configuration: a machine whose pip is configured
  # (pip.conf or PIP_*: an index, find-links, a certificate, a constraint file) keeps pip, which reads it.
  # uv is the machine's own, else its wheel (one static binary, no dependencies) from the same index, kept
  # beside the stack; it installs the same pins as pip would (several indexes read as pip reads them:
  # unsafe-best-match; the system's certificates; bytecode compiled as pip does), and whatever it refuses
  # or fails at falls back to pip. The same check follows either way.
  local PIPCONF
  PIPCONF=$("$SPY" -m pip config list 2>/dev/null || true)
  if ! grep -Eq '\.(index-url|extra-index-url|find-links|no-index|cert|client-cert|trusted-host|constraint|proxy)=' \
      <<< "$PIPCONF"; then
    UV=$(PATH="$PATH:${HOME:-/nonexistent}/.local/bin:${HOME:-/nonexistent}/.cargo/bin" command -v uv || true)
    if [ -z "$UV" ] && { [ -x "$W/uv/bin/uv" ] || "$SPY" -m pip install -q ${JEX_PIP_ARGS:-} --target "$W/uv" uv \
        >> bootstrap.log 2>&1; } && [ -x "$W/uv/bin/uv" ]; then
      UV="$W/uv/bin/uv"
    fi
  fi
  if [ -n "$UV" ] && UV_NATIVE_TLS=1 "$UV" pip install --python "$SPY" --index-strategy unsafe-best-match \
      --compile-bytecode -q ${JEX_PIP_ARGS:-} -r stack.lock >> bootstrap.log 2>&1; then
    echo "stack installed with $("$UV" --version)" >> bootstrap.log
  else
    [ -z "$UV" ] || echo "uv ($UV) failed; installing with pip" >> bootstrap.log
    "$SPY" -m pip install -q ${JEX_PIP_ARGS:-} -r stack.lock >> bootstrap.log 2>&1
    echo "stack installed with pip" >> bootstrap.log
  fi
}

STACK=reused
MISSING=$(check_stack "$PY")
if [ -n "$MISSING" ]; then
  if [ ! -x "$W/stack/bin/python" ] || [ -n "$(check_stack "$W/stack/bin/python")" ]; then
    install_stack
    STACK=installed
  fi
  PY="$W/stack/bin/python"
  MISSING=$(check_stack "$PY")
  [ -z "$MISSING" ] || { echo "stack still unsatisfied: $MISSING" >&2; exit 3; }
fi

# the tools the engine needs, looked up where the jobs will look: the orchestrator starts every job with
# BIN first on PATH (BootInfo.bin, MachineSession._env)
BIN=$(dirname "$PY")
for TOOL in ${JEX_REQUIRED_TOOLS:-}; do
  FOUND=""
  for T in ${TOOL//|/ }; do
    if PATH="$BIN:$PATH" command -v "$T" > /dev/null 2>&1; then FOUND=$T; break; fi
  done
  [ -n "$FOUND" ] || { echo "machine pre-flight: ${TOOL//|/ or } not found on PATH (the engine needs it;" \
    "install it on the machine image)" >&2; exit 4; }
done

# The dead-man's switch (infra/watchdog.py), when the orchestrator sent its watchdog.json: started once,
# detached, with the credentials it reads from this script's stdin (never written to disk).
if [ -f "$W/watchdog.json" ]; then
  IFS= read -r CREDS || CREDS=""
  touch "$W/lease"
  if ! { [ -f "$W/watchdog.pid" ] && kill -0 -- "-$(cat "$W/watchdog.pid")" 2>/dev/null; }; then
    printf '%s\n' "$CREDS" | PYTHONPATH="$CODE${PYTHONPATH:+:$PYTHONPATH}" setsid nohup "$PY" -m jex.infra.watchdog "$W" \
      >> "$W/watchdog.log" 2>&1 &
    echo $! > "$W/watchdog.pid"
  fi
  unset CREDS
  # a cloud machine that powers off terminates (EC2: InstanceInitiatedShutdownBehavior=terminate): the backstop,
  # in whole minutes from now (after the watchdog's own deadline), in case the watchdog dies
  if [ -n "${JEX_POWEROFF_AFTER_S:-}" ]; then
    M=$(( (JEX_POWEROFF_AFTER_S + 59) / 60 ))
    if [ -z "${JEX_POWEROFF_COMMAND:-}" ]; then
      sudo -n shutdown -h "+$M" >/dev/null 2>&1 || shutdown -h "+$M" >/dev/null 2>&1 || true
    elif ! { [ -f "$W/poweroff.pid" ] && kill -0 -- "-$(cat "$W/poweroff.pid")" 2>/dev/null; }; then
      setsid nohup sh -c "sleep $(( M * 60 )); $JEX_POWEROFF_COMMAND" > /dev/null 2>&1 < /dev/null &  # its own way
      echo $! > "$W/poweroff.pid"
    fi
  fi
fi

GPU=$(nvidia-smi -L 2>/dev/null | tr '\n' ';' || true)
PYTHONPATH="$CODE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SHA" "$STACK" "$GPU" <<'EOF' > provenance.json.part
import json, platform, socket, sys
from importlib.metadata import PackageNotFoundError, version


def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


pins = [line.split("==")[0].strip() for line in open("stack.lock") if "==" in line]
print(json.dumps({"host": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
                  "executable": sys.executable, "code_sha256": sys.argv[1], "stack": sys.argv[2],
                  "packages": {p: installed(p) for p in pins}, "gpus": sys.argv[3]}, sort_keys=True))
EOF
mv provenance.json.part provenance.json
printf '{"python": "%s", "code": "%s", "stack": "%s", "bin": "%s"}\n' "$PY" "$CODE" "$STACK" "$BIN"
