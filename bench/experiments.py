"""Experiment benchmark (issue 12): a 5-configuration experiment against 5 separate runs.

    .venv/bin/python bench/experiments.py [--rows 72] [--reason-max-tokens 48] [--out FILE.json]

The five configurations: the base, a render arm (a system prompt) and a fold-weight sweep of three
points. (a) `jex experiment run` with those arms, one process, one store: the sweep points reuse the
base's capture and rationales. (b) The same five campaigns as five separate runs, each its own
process and store, as `jex run` does it (`ensure_local_api()` then `run_campaign(spec)`; `jex run`
has no --fold-weight flag, so the bench starts the same function itself). Both use the in-process
provider and a cold store. Target: (b) / (a) >= 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ARMS = '''name = "bench"

[gate]
draws = 2000
permutations = 2000

[[arms]]
name = "system"
reopen_when = "a larger model"
[arms.render]
system_prompt = "You are a careful expert. Answer with the letter of the correct option."

[[arms]]
name = "fw"
kind = "sweep"
parameter = "fold_weight"
grid = [0.25, 0.75, 1.0]
'''

SEPARATE = """
import sys
from jex.flows.local_api import ensure_local_api
ensure_local_api()
from jex.flows.campaign import run_campaign
from jex.tasks.campaign_spec import CampaignSpec
print(run_campaign(CampaignSpec.model_validate_json(sys.argv[1])))
"""


def _env(tmp: Path, name: str) -> dict[str, str]:
    env = {**os.environ, "PREFECT_HOME": str(tmp / f"prefect-{name}"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    return env


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=72, help="Rows of the embedded sample suite")
    p.add_argument("--reason-max-tokens", type=int, default=48, help="Rationale length limit")
    p.add_argument("--out", default="bench/results/cpu-experiments.json")
    args = p.parse_args()
    from jex.flows.lab import ExperimentSpec, plan_experiment
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    tmp = Path(tempfile.mkdtemp(prefix="jex-bench-exp-"))
    arms_file = tmp / "arms.toml"
    arms_file.write_text(ARMS)
    base = CampaignSpec(name="base", sample_rows=args.rows, reason_max_tokens=args.reason_max_tokens,
                        store=str(tmp / "exp" / "store"), out=str(tmp / "exp"),
                        machines=MachinesSpec(provider="inprocess"))
    plan = plan_experiment(ExperimentSpec(campaign=base, arms_toml=ARMS, out=str(tmp / "exp")))
    specs = {"base": plan.base, **{pt.name: pt.spec for pt in plan.points}}
    separate = {}
    for name, spec in specs.items():  # (b) first: five processes, five stores
        own = spec.model_copy(update={"store": str(tmp / f"sep-{name}" / "store"), "out": str(tmp / f"sep-{name}")})
        t1 = time.perf_counter()
        subprocess.run([sys.executable, "-c", SEPARATE, own.model_dump_json()], env=_env(tmp, name), cwd=ROOT,
                       check=True, capture_output=True, text=True)
        separate[name] = time.perf_counter() - t1
        print(f"separate {name}: {separate[name]:.1f} s", flush=True)
    t0 = time.perf_counter()  # (a) the experiment, cold store
    subprocess.run([sys.executable, "-m", "jex", "experiment", "run", "--arms", str(arms_file), "-o",
                    str(tmp / "exp"), "--sample-rows", str(args.rows), "--provider", "inprocess",
                    "--reason-max-tokens", str(args.reason_max_tokens)],
                   env=_env(tmp, "exp"), cwd=ROOT, check=True, capture_output=True, text=True)
    experiment_s = time.perf_counter() - t0
    doc = json.loads((tmp / "exp" / "experiment.json").read_text())
    total = sum(separate.values())
    result = {"rows": args.rows, "configurations": list(specs), "experiment_wall_s": experiment_s,
              "separate_wall_s": separate, "separate_total_s": total, "speedup": total / experiment_s,
              "engine_calls": {"base": doc["base"]["engine_calls"],
                               **{n: a["engine_calls"] for n, a in doc["arms"].items()}},
              "verdicts": {n: a["verdict"] for n, a in doc["arms"].items()}, "target": ">= 2x",
              "reason_max_tokens": args.reason_max_tokens,
              "command": f".venv/bin/python bench/experiments.py --rows {args.rows} --reason-max-tokens "
                         f"{args.reason_max_tokens}"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
