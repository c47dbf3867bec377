"""Issue 41, item 4: `jex suite import lm-eval` beside lm-eval's own request building, same task, same rows.

    .venv/bin/python bench/import_lm_eval.py --rows 10000 --out bench/results/cpu-import-lm-eval-DATE.json

For each task shape of `bench/gpu_peer.py` (ARC-style text choices, MMLU letters with 5 shots), in one run:
lm-eval building every request of the task (`TaskManager` then `build_all_requests`, what `lm_eval run` does
before it calls a model), each in a fresh process, then `jex suite import lm-eval` of the same task in a
fresh process (which builds the requests through lm-eval too, then writes the suite). Wall seconds each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_peer import make_tasks  # noqa: E402

BUILD = """
import sys
from lm_eval.tasks import TaskManager
task_file = sys.argv[1]
tm = TaskManager(include_path=str(__import__("pathlib").Path(task_file).parent))
task = tm.load_task_or_group([__import__("pathlib").Path(task_file).stem])[__import__("pathlib").Path(task_file).stem]
if task.get_config("num_fewshot") is None:
    task.set_config(key="num_fewshot", value=0)
task.set_fewshot_seed(seed=1234)
task.build_all_requests(limit=None, rank=0, world_size=1)
print(len(task.instances))
"""


def seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jex-import-bench-"))
    cells = []
    for kind in ("text", "letters"):
        task = make_tasks(kind, a.rows, work / kind)
        lm = seconds([sys.executable, "-c", BUILD, str(task)])
        jex = seconds([sys.executable, "-m", "jex", "suite", "import", "lm-eval", "--task", str(task), "--cluster",
                       "topic", "-o", str(work / f"suite-{kind}")])
        cells.append({"task": kind, "rows": a.rows, "lm_eval_build_requests_s": lm, "jex_import_s": jex,
                      "jex_over_lm_eval": jex / lm})
        print(json.dumps(cells[-1]), flush=True)
    a.out.write_text(json.dumps({"command": " ".join(sys.argv), "cells": cells}, indent=2))


if __name__ == "__main__":
    main()
