"""Installing jex adds one top-level name, `jex`: the rooms are `jex.engine`, `jex.tasks`, ... (issue 18)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("engine", "tasks", "lab", "flows", "infra", "overlays", "deployments")


def test_every_package_folder_is_installed_under_jex():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    inits = [p for room in ("jex", *ROOMS) for p in (ROOT / room).rglob("__init__.py")]
    folders = {p.parent.relative_to(ROOT).as_posix() for p in inits}
    expected = {f.replace("/", ".") if f.startswith("jex") else "jex." + f.replace("/", ".") for f in folders}
    assert set(config["packages"]) == expected
    assert config["package-dir"] == {"jex": "jex", **{f"jex.{r}": r for r in ROOMS}}


def test_the_rooms_are_not_importable_as_top_level_names(tmp_path):
    """Run outside the checkout: only the installed `jex` can be found."""
    probe = f"import importlib.util as u, jex.tasks.store; print([n for n in {ROOMS!r} if u.find_spec(n)])"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


_MACHINE_JOB = """
import json, sys
from pathlib import Path

import jex
from jex.infra.cost_ledger import CostLedger
from jex.infra.machine import MachineSession, Policy, RemoteJob
from jex.infra.providers import LocalProvider

tmp, policy = Path(sys.argv[1]), Policy(**json.loads(sys.argv[2]))
provider = LocalProvider(tmp / "machines")
session = MachineSession(provider, campaign="c1", ledger=CostLedger(tmp / "state" / "ledger.json"), policy=policy,
                         python=sys.executable, state_dir=tmp / "state")
imports = "import jex.engine.render, jex.tasks.records; open('where.txt', 'w').write(jex.engine.render.__file__)"
with session:
    session.run(RemoteJob("j", ["-c", imports], ["where.txt"], tmp / "got"))
print(json.dumps({"installed": jex.__file__, "code": session.code_dir, "ran": (tmp / "got" / "where.txt").read_text(),
                  "left": [m.id for m in provider.list_machines()]}))
"""


def _install_wheel(tmp_path: Path) -> Path:
    """jex built as a wheel from this checkout and installed into a fresh virtualenv that sees this
    one's dependencies (a .pth naming its site-packages: their own .pth files, the editable install's
    import hook among them, are not run); returns the new interpreter."""
    import shutil
    import sysconfig

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("jex", *ROOMS):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("jex-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "jex-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True)
    return python


def test_a_wheel_install_runs_a_machine_job_with_the_code_it_installed(tmp_path):
    """No checkout: the machine's code bundle is built from the installed package."""
    from tests.test_machines import FAST

    python = _install_wheel(tmp_path)
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the wheel's jex to import
    out = subprocess.run([python, "-c", _MACHINE_JOB, str(run), json.dumps(FAST)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    done = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(done["installed"]).is_relative_to(tmp_path / "venv")  # the wheel's jex, not the checkout's
    assert Path(done["ran"]).is_relative_to(done["code"])  # the job imported the bundle the machine unpacked
    assert done["left"] == []


def test_the_machines_code_bundle_holds_what_a_machine_job_imports():
    """A machine runs stage jobs (`jex.tasks`) and lab jobs (`python -m jex.lab.jobs`, the bake-off's arm
    processes) from the code bundle alone: from a checkout too, where `lab/` is not inside `jex/`."""
    from jex.infra.machine import bundle_files

    names = {arcname for _, arcname in bundle_files()}
    assert {"jex/tasks/inputs.py", "jex/lab/jobs.py", "jex/lab/bakeoff.py"} <= names


LOCAL_ENGINE_ONLY = ("torch", "transformers", "gguf", "accelerate", "safetensors")
"""What the `cpu` extra brings: only an engine on this machine imports them."""

_CORE_COMMANDS = """
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None  # not installed: `import name` fails and find_spec(name) is None
from typer.testing import CliRunner
from jex.cli import app
runner, out = CliRunner(), {}
for args in (["--help"], ["run", "--help"], ["suite", "sample", "-o", sys.argv[2], "--rows", "24"],
             ["suite", "validate", sys.argv[2]], ["run", "--suite", sys.argv[2], "--out", sys.argv[3]]):
    r = runner.invoke(app, args)
    out[" ".join(args[:2])] = [r.exit_code, r.output.strip().splitlines()[-1] if r.output.strip() else ""]
out["imported"] = sorted(n for n in json.loads(sys.argv[1]) if sys.modules.get(n) is not None)
print(json.dumps(out))
"""


def test_the_core_install_leaves_torch_and_transformers_to_the_cpu_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=\[ ]", d)[0] for d in project["dependencies"]}
    assert not core & set(LOCAL_ENGINE_ONLY)
    cpu = {re.split(r"[<>=\[ ]", d)[0] for d in project["optional-dependencies"]["cpu"]}
    assert cpu == set(LOCAL_ENGINE_ONLY)
    assert "jex[cpu]" in project["optional-dependencies"]["dev"], "the README's set-up installs everything"


def test_the_orchestrator_commands_run_without_the_cpu_extra_and_a_local_engine_names_it(tmp_path):
    """torch and transformers absent (as after `pip install jex`): help, suite commands work; a campaign whose
    HF engine would run on this machine is one line naming the extra, before any flow."""
    out = subprocess.run([sys.executable, "-c", _CORE_COMMANDS, json.dumps(LOCAL_ENGINE_ONLY), str(tmp_path / "suite"),
                          str(tmp_path / "runs")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert [got[k][0] for k in ("--help", "run --help", "suite sample", "suite validate")] == [0, 0, 0, 0]
    assert got["run --suite"] == [1, "error: torch is not installed (the hf engine runs on this machine): "
                                     "pip install 'jex[cpu]'"]
    assert got["imported"] == []
    assert not (tmp_path / "runs").exists()
