"""Issue 55: where a test run's CPU goes, by kind of process (engine hosts, Prefect servers, test workers, ...).

    python3 bench/suite_cpu.py --out bench/results/X.json -- bash .ci/services.sh .venv/bin/python -m pytest -q \
        -p no:cacheprovider tests/test_machines.py tests/test_engine_host.py -n 2

Runs the command and samples /proc every 0.3 s meanwhile: each process's command line (the last one seen: a
forked process shows its parent's until it execs, an exited one none) and its CPU seconds (user + system, the
last seen). Processes that live less than a sample are missed (their CPU is small by that token); a process's
children are counted apart from it; every process on the machine is counted, the command's or not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

KINDS = (  # (what the command line holds, the kind it is counted as), first match wins
    ("jex.tasks.execution.engine_host", "engine host"),
    ("jex.tasks.capture.invariance", "audit control arm"),
    ("worker_protocol status", "machine status poll"),
    ("jex.infra.worker_protocol", "machine job wrapper"),
    ("jex.infra.watchdog", "machine watchdog"),
    ("prefect.server.api.server", "Prefect server"),
    ("exec(eval(sys.stdin.readline()))", "pytest-xdist worker"),
    ("-m prefect.engine", "Prefect deployment run"),
    ("jex stage", "jex stage (machine job)"),
    ("-m jex stage", "jex stage (machine job)"),
    ("jex run", "jex run"),
    ("lm_eval", "lm_eval"),
    ("mypy", "mypy"),
)


def kind(command: str) -> str:
    for needle, name in KINDS:
        if needle in command:
            return name
    return " ".join(command.split()[:2])[:80] or "(exited before its command line was read)"


def sample(seen: dict[str, tuple[str, float]], stop: threading.Event) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    while not stop.is_set():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            key = f"{pid}:{fields[19]}"  # pid and start time: a reused pid is another process
            last = seen.get(key, ("", 0.0))[0]  # after exec the last command line seen; a zombie shows none
            seen[key] = (command.strip() or last, (int(fields[11]) + int(fields[12])) / tick)
        stop.wait(0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    seen: dict[str, tuple[str, float]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(seen, stop), daemon=True)
    sampler.start()
    started = time.perf_counter()
    rc = subprocess.run(command).returncode
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for command_line, cpu in seen.values():
        entry = by_kind[kind(command_line)]
        entry[0] += 1
        entry[1] += cpu
    rows = sorted(by_kind.items(), key=lambda kv: -kv[1][1])
    doc = {"command": command, "rc": rc, "wall_s": round(wall, 1), "cpu_s": round(sum(v[1] for _, v in rows), 1),
           "by_kind": [{"kind": k, "processes": int(n), "cpu_s": round(cpu, 1)} for k, (n, cpu) in rows if cpu >= 1]}
    a.out.write_text(json.dumps(doc, indent=1))
    for row in doc["by_kind"]:
        print(f"{row['cpu_s']:8.1f} s {row['processes']:5d}  {row['kind']}")


if __name__ == "__main__":
    main()
