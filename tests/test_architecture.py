"""Dependencies point one way: flows -> tasks -> engine/overlays; infra only from flows and the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "engine": {"prefect", "tasks", "flows", "infra", "overlays", "deployments", "boto3", "paramiko"},
    "tasks": {"flows", "infra", "deployments", "boto3", "paramiko"},
    "overlays": {"engine", "infra", "flows", "deployments", "boto3", "paramiko"},
    "infra": {"engine", "tasks", "flows", "deployments", "prefect"},
    "deployments": {"engine", "tasks", "infra"},
    "flows": {"engine", "deployments"},
}


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    bad = {str(p.relative_to(ROOT)): sorted(imports(p) & FORBIDDEN[room]) for p in (ROOT / room).rglob("*.py")}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{room}/ reaches into rooms it must not: {bad}"


def test_prefect_appears_in_tasks_only_in_the_wrappers():
    users = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tasks").rglob("*.py") if "prefect" in imports(p))
    assert users == ["tasks/prefect_tasks.py"]
