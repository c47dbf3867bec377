"""Resume from anywhere (issue 39), on this machine, through the CLI a user types:

    .venv/bin/python bench/resume_anywhere.py [--out bench/out/resume-anywhere.json]

1. The main job (`jex run`, embedded defaults, the default `local` provider) in folder A: wall time.
2. `jex run --resume A/runs/RUN` from folder B with another HOME: wall time and engine calls (want 0).
3. The run folder and its store moved to folder C: `jex run --resume C/runs/RUN`, the same.
4. `jex run --resume ... --store EMPTY`: the one-line refusal, and how long it takes to say it.
Predictions' sha256 in every step (want one value).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jex.run_records import EngineCalls

JEX = str(Path(sys.executable).with_name("jex"))


def place(root: Path) -> dict[str, str]:
    """An environment with its own HOME and Prefect home (the machine's Prefect database template linked in)."""
    home = root / "home"
    (home / ".cache" / "jex").mkdir(parents=True, exist_ok=True)
    template = Path.home() / ".cache" / "jex" / "prefect-db"
    if template.exists() and not (home / ".cache" / "jex" / "prefect-db").exists():
        (home / ".cache" / "jex" / "prefect-db").symlink_to(template)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JEX_", "PREFECT_"))}
    return {**env, "HOME": str(home), "PREFECT_HOME": str(root / "prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "JEX_ENGINE__CACHE_DIR": str(Path.home() / ".cache" / "jex")}  # the converted model, not the point here


def jex(root: Path, *args: str, ok: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    p = subprocess.run([JEX, *args], capture_output=True, text=True, cwd=root, env=place(root), timeout=1800)
    wall = time.perf_counter() - t0
    if (p.returncode == 0) != ok:
        raise SystemExit(f"jex {' '.join(args)}: exit {p.returncode}\n{p.stderr[-3000:]}")
    return wall, p


def facts(run_dir: Path, out: subprocess.CompletedProcess) -> dict[str, object]:
    """Engine calls of the flow run (none when every stage and the report were found stored: no flow ran)."""
    stored = "every stage stored: nothing to run" in out.stdout + out.stderr
    calls = {"fast_pass": 0, "reason": 0} if stored else dict(EngineCalls.read(run_dir).calls)
    return {"flow_ran": not stored, "engine_calls": calls,
            "predictions_sha256": hashlib.sha256((run_dir / "predictions.parquet").read_bytes()).hexdigest()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/resume-anywhere.json")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jex-bench-resume-"))
    res: dict[str, object] = {"command": "bench/resume_anywhere.py"}
    try:
        wall, out = jex(tmp / "A", "run", "--out", "runs", "--quiet")
        run_dir = Path(out.stdout.strip().splitlines()[-1])
        res["main_job"] = {"wall_s": round(wall, 1), **facts(run_dir, out)}
        wall, out = jex(tmp / "B", "run", "--resume", str(run_dir), "--quiet")
        res["resume_from_another_folder_and_home"] = {"wall_s": round(wall, 1), **facts(run_dir, out)}
        moved = tmp / "C" / "runs"
        moved.parent.mkdir(parents=True)
        shutil.move(str(run_dir.parent), str(moved))
        wall, out = jex(tmp / "B", "run", "--resume", str(moved / run_dir.name), "--quiet")
        res["resume_moved_with_its_store"] = {"wall_s": round(wall, 1), **facts(moved / run_dir.name, out)}
        wall, refused = jex(tmp / "B", "run", "--resume", str(moved / run_dir.name), "--store", str(tmp / "empty"),
                            ok=False)
        res["refused_without_its_store"] = {"wall_s": round(wall, 1), "stderr": refused.stderr.strip()}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
