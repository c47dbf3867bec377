"""Dependencies point one way: cli -> flows -> lab -> tasks -> engine/overlays -> core (flows reach tasks
directly too); infra only from flows and the CLI; every import of our own code goes through the one `jex`
namespace."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("engine", "tasks", "lab", "flows", "infra", "overlays", "deployments")
OURS = {"jex", *ROOMS}
"""`jex.<room>` is the repository folder `<room>/` (pyproject.toml); the other `jex.*` modules are the
core (errors, files, settings, suites, provenance, numerics) and the CLI (`jex/cli/`)."""
FORBIDDEN = {
    "core": {"engine", "tasks", "lab", "flows", "infra", "overlays", "deployments", "cli", "prefect", "boto3",
             "paramiko"},
    "engine": {"tasks", "lab", "flows", "infra", "overlays", "deployments", "cli", "prefect", "boto3", "paramiko"},
    "overlays": {"engine", "tasks", "lab", "flows", "infra", "deployments", "cli", "prefect", "boto3", "paramiko"},
    "tasks": {"lab", "flows", "infra", "deployments", "cli", "boto3", "paramiko"},
    "lab": {"flows", "infra", "deployments", "cli", "prefect", "boto3", "paramiko"},
    "infra": {"engine", "tasks", "lab", "flows", "overlays", "deployments", "cli", "prefect"},
    "flows": {"engine", "deployments", "cli"},
    "deployments": {"engine", "tasks", "lab", "infra", "overlays", "cli"},
    "cli": set(),
}


def room_of(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    if parts[0] == "jex":
        return "cli" if parts[1] in ("cli", "__main__.py") else "core"
    return parts[0]


def sources(room: str) -> list[Path]:
    if room in ("core", "cli"):
        return [p for p in (ROOT / "jex").rglob("*.py") if room_of(p) == room]
    return list((ROOT / room).rglob("*.py"))


def imported(path: Path) -> set[str]:
    """Absolute module names imported by a file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def target(module: str) -> str:
    """What a module name reaches: a room, `cli`, `core`, or a third-party top-level name."""
    parts = module.split(".")
    if parts[0] != "jex":
        return parts[0]
    if len(parts) == 1:
        return "core"
    return parts[1] if parts[1] in (*ROOMS, "cli") else "core"


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room):
    bad = {str(p.relative_to(ROOT)): sorted({target(m) for m in imported(p)} & FORBIDDEN[room]) for p in sources(room)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"{room} reaches into rooms it must not: {bad}"


def test_our_code_is_imported_only_through_the_jex_namespace():
    """`tasks.x` would be a second copy of `jex.tasks.x` (and a name that collides in a user's site-packages)."""
    files = [p for r in FORBIDDEN for p in sources(r)] + list((ROOT / "tests").rglob("*.py"))
    bad = {str(p.relative_to(ROOT)): m for p in files for m in imported(p) if m.split(".")[0] in ROOMS}
    assert not bad, f"imports outside the jex namespace: {bad}"


def test_prefect_appears_in_tasks_only_in_the_wrappers():
    users = sorted(str(p.relative_to(ROOT)) for p in sources("tasks") if any(m.split(".")[0] == "prefect"
                                                                             for m in imported(p)))
    assert users == ["tasks/prefect_tasks.py"]


PRODUCT = ("core", "cli", *ROOMS)


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_function_is_longer_than_60_lines():
    """Long functions hide what they do; split them (docstrings count, blank lines too)."""
    long = {f"{p.relative_to(ROOT)}:{f.name}": (f.end_lineno or f.lineno) - f.lineno + 1
            for room in PRODUCT for p in sources(room) for f in _functions(p)
            if (f.end_lineno or f.lineno) - f.lineno + 1 > 60}
    assert not long, f"functions over 60 lines: {long}"


def test_no_cache_key_is_computed_from_loose_keywords():
    """A stage's key comes from its inputs record (`tasks/inputs.py`), never from `**kwargs` that would
    let an input reach the body but not the key."""
    loose = {f"{p.relative_to(ROOT)}:{f.name}" for room in PRODUCT for p in sources(room) for f in _functions(p)
             if "key" in f.name and f.name != "compute_key" and f.args.kwarg is not None}  # Prefect's protocol
    assert not loose, f"key functions taking **kwargs: {loose}"


def test_untyped_dicts_in_signatures_stay_rare():
    """`dict[str, Any]` in a product function's parameters or return: under 3 per 1,000 lines (typed
    records cross boundaries instead)."""
    lines = count = 0
    for room in PRODUCT:
        for p in sources(room):
            lines += len(p.read_text().splitlines())
            for f in _functions(p):
                annotations = [a.annotation for a in (*f.args.args, *f.args.kwonlyargs) if a.annotation]
                count += sum("dict[str, Any]" in ast.unparse(a) for a in [*annotations, *[f.returns] * bool(f.returns)])
    assert count / lines * 1000 < 3, f"{count} dict[str, Any] in signatures over {lines} lines"


def test_scoring_probabilities_and_stage_inputs_do_not_import_the_capture():
    """They read the bundle (`tasks/bundle/`) and the stage summaries, never the engine stages."""
    files = [*(ROOT / "tasks" / "scoring").rglob("*.py"), *(ROOT / "tasks" / "probabilities").rglob("*.py"),
             ROOT / "tasks" / "inputs.py", ROOT / "tasks" / "records.py", ROOT / "tasks" / "documents.py"]
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.startswith("jex.tasks.capture"))
           for p in files}
    assert not {k: v for k, v in bad.items() if v}


def test_the_flows_import_one_face_of_execution():
    """`jex.tasks.execution` (its `__init__`) is what the orchestrator may name; its modules are its own."""
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m.startswith("jex.tasks.execution."))
           for p in sources("flows")}
    assert not {k: v for k, v in bad.items() if v}


def test_no_private_name_is_imported_across_modules():
    """A leading underscore means "this module's own": another module that needs it needs a public name."""
    files = [p for room in PRODUCT for p in sources(room)] + list((ROOT / "bench").rglob("*.py"))
    bad = {f"{p.relative_to(ROOT)}: {node.module}.{a.name}"
           for p in files for node in ast.walk(ast.parse(p.read_text()))
           if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jex")
           for a in node.names if a.name.startswith("_") and not a.name.startswith("__")}
    assert not bad, sorted(bad)


RAW_JSON_READERS = {
    # the one reader, and the modules that read a record's file themselves before validating it
    "jex/fileio.py": "defines read_json",
    "tasks/bundle/bundle_file.py": "defines BundleManifest: checks the format and member sizes before validating",
    # foreign formats, and JSON that is not a file the house writes
    "jex/settings.py": "JSON values of environment variables",
    "jex/suite.py": "suite row files (JSONL a user writes), each validated as a SuiteRow",
    "jex/cli/preflight.py": "a user's flag file",
    "engine/models.py": "a model folder's config.json, safetensors index and headers (Hugging Face), its size cache",
    "tasks/outputs/interop/": "lm-eval and Inspect files, and rows' metadata column (JSON text)",
}
"""Where `read_json(` or `json.loads(` may appear among the rooms that write the house's documents (core,
CLI, tasks, lab, flows, engine): every file the project writes is read back through its record
(`jex.record.read_record`, `Model.model_validate_json`), so a renamed or missing key is a validation error
naming the file. (infra/ and deployments/ parse their machine protocol and state files defensively, each
validated at the call: not covered here.)"""


def _raw_json_reads(path: Path) -> int:
    calls = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "read_json") or (
                    isinstance(f, ast.Attribute) and f.attr in ("loads", "load") and isinstance(f.value, ast.Name)
                    and f.value.id == "json"):
                calls += 1
    return calls


def test_house_documents_are_read_through_their_records():
    """A `read_json(`/`json.loads(` outside `RAW_JSON_READERS` reads a document by key: read it through its
    record instead. Every entry is still needed (a stale one is an error too)."""
    found = {str(p.relative_to(ROOT)) for room in ("core", "cli", "tasks", "lab", "flows", "engine")
             for p in sources(room) if _raw_json_reads(p)}

    def allowed(name: str) -> bool:
        return any(name == k or (k.endswith("/") and name.startswith(k)) for k in RAW_JSON_READERS)

    assert not {f for f in found if not allowed(f)}, "read these files through their records"
    assert not {k for k in RAW_JSON_READERS if not any(f == k or f.startswith(k) for f in found)}, "stale entries"
