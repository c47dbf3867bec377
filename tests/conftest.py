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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 with a generated host key and user key; stopped by its PID."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import time

    exe = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(exe).exists():
        pytest.skip("OpenSSH server not installed (`.ci/services.sh` installs it from Debian as root)")
    if os.geteuid() != 0:
        pytest.skip("a private sshd needs root here (CI runs as root)")
    d = tmp_path_factory.mktemp("sshd")
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    port = _free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d}/authorized_keys", "Subsystem sftp internal-sftp",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PermitRootLogin prohibit-password", f"PidFile {d / 'sshd.pid'}", "MaxStartups 50", "MaxSessions 50", ""]))
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    subprocess.run([exe, "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")], check=True)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    kind, b64 = (d / "host_key.pub").read_text().split()[:2]
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {kind} {b64}\n")
    pid = int((d / "sshd.pid").read_text())
    yield {"port": port, "key_path": d / "user_key", "known_hosts": d / "known_hosts", "pid": pid, "dir": d}
    os.kill(pid, signal.SIGTERM)


@pytest.fixture()
def s3_bucket(s3_server):
    """A fresh bucket on the session's S3 server, and an S3Store over it."""
    import uuid

    import boto3

    from infra.s3 import S3Store

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
    name = f"jex-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return S3Store(name, "jex", client)
