from __future__ import annotations

import json
from pathlib import Path

import pytest

from jex.sample_suite import write_sample_suite


def write_suite(root: Path, rows_by_catalog: dict[str, list[dict]], *, legs: dict[str, float] | None = None,
                catalogs: list[dict] | None = None) -> Path:
    """A small suite made in the test: one JSONL file per catalog and a matching suite.toml."""
    legs = legs or {"public": 1.0}
    (root / "rows").mkdir(parents=True, exist_ok=True)
    if catalogs is None:
        catalogs = [{"id": cid, "leg": next(iter(legs))} for cid in rows_by_catalog]
    lines = ["[legs]", *(f"{k} = {v}" for k, v in legs.items())]
    for cat in catalogs:
        cid = cat["id"]
        with open(root / "rows" / f"{cid}.jsonl", "w") as f:
            for r in rows_by_catalog.get(cid, []):
                f.write(json.dumps(r) + "\n")
        lines += ["", "[[catalogs]]", f'id = "{cid}"', f'name = "{cid} name"', f'leg = "{cat["leg"]}"',
                  f'weight = {cat.get("weight", 1.0)}', f'files = ["rows/{cid}.jsonl"]']
        if "chance" in cat:
            lines.append(f"chance = {cat['chance']}")
        if "exclusions" in cat:
            lines.append(f"exclusions = {json.dumps(cat['exclusions'])}")
    (root / "suite.toml").write_text("\n".join(lines) + "\n")
    return root


def row(run_id: str, catalog: str, *, q: str | None = None, k: int = 4, gold: int = 0, **kw) -> dict:
    return {"run_id": run_id, "catalog": catalog, "question_id": q or run_id, "prompt": f"Question {run_id}?",
            "options": [f"opt{i}" for i in range(k)], "labels": list("ABCDE"[:k]), "gold": gold, **kw}


@pytest.fixture(scope="session")
def sample_suite(tmp_path_factory) -> Path:
    return write_sample_suite(tmp_path_factory.mktemp("sample") / "suite", rows=360, seed=0)


@pytest.fixture(scope="session")
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
