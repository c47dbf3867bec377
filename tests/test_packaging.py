"""Installing jex adds one top-level name, `jex`: the rooms are `jex.engine`, `jex.tasks`, ... (issue 18)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("engine", "tasks", "flows", "infra", "overlays", "deployments")


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
