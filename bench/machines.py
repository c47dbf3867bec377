"""Machine lifecycle benchmarks (issue 6): teardown latency and S3 upload throughput.

    .venv/bin/python bench/machines.py [--upload-mib 1024] [--out bench/results/cpu-machines.json]

- SUCCESS marker -> machine deleted, on the local and ssh providers (target < 30 s)
- heartbeat loss (the job's processes frozen) -> machine deleted (target < timeout + 30 s)
- a 1 GiB artifact uploaded to a local S3 server (moto, its own process) by `S3Store.put_file`
  (sha256 in metadata, verified by HEAD afterwards) against plain boto3 `upload_file`, same run.
The ssh rows need root and Debian's openssh-server (as in CI); they are skipped with a reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from infra.ledger import Ledger  # noqa: E402
from infra.providers import LocalProvider, SSHProvider  # noqa: E402
from infra.remote import JobFailed, MachineSession, Policy, RemoteJob  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_sshd(d: Path) -> dict | None:
    exe = shutil.which("sshd") or "/usr/sbin/sshd"
    if not Path(exe).exists() or os.geteuid() != 0:
        return None
    for name in ("host_key", "user_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
    (d / "authorized_keys").write_text((d / "user_key.pub").read_text())
    port = free_port()
    (d / "cfg").write_text(f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nAuthorizedKeysFile "
                           f"{d}/authorized_keys\nSubsystem sftp internal-sftp\nPasswordAuthentication no\nUsePAM no\n"
                           f"StrictModes no\nPidFile {d}/pid\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    subprocess.run([exe, "-f", str(d / "cfg"), "-E", str(d / "log")], check=True)
    time.sleep(0.5)
    kind, b64 = (d / "host_key.pub").read_text().split()[:2]
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {kind} {b64}\n")
    return {"port": port, "pid": int((d / "pid").read_text()), "dir": d}


def session(provider, work: Path, policy: Policy) -> MachineSession:
    return MachineSession(provider, campaign="bench", ledger=Ledger(work / "state" / "ledger.json"), policy=policy,
                          python=sys.executable, state_dir=work / "state", echo=lambda s: None)


def job(script: str, dest: Path) -> RemoteJob:
    return RemoteJob("j", ["-c", f"import os; os.execvp('sh', ['sh', '-c', {script!r}])"], ["*.bin"], dest)


def success_to_deleted(provider, work: Path, policy: Policy) -> float:
    s = session(provider, work, policy)
    with s:
        s.run(job("echo x > a.bin; date +%s.%N > end.bin", work / "got"))
    deleted = time.time()
    assert provider.describe(s.machine.id) is None
    return deleted - float((work / "got" / "end.bin").read_text())


def heartbeat_loss_to_deleted(provider, work: Path, policy: Policy) -> float:
    s = session(provider, work, policy)
    stopped: dict[str, float] = {}

    def freeze(sess, j, poll):
        if poll == 2:
            pgid = sess.shell.run(f"cat {sess.run_dir(j)}/worker.pgid").stdout.strip()
            sess.shell.run(f"kill -STOP -- -{pgid}")
            stopped["t"] = time.time()

    s.on_poll = freeze
    try:
        with s:
            s.run(job("sleep 600", work / "got"))
    except JobFailed as e:
        assert e.outcome.status == "heartbeat_lost", e.outcome.status
    assert provider.describe(s.machine.id) is None
    return time.time() - stopped["t"]


def upload_throughput(mib: int, work: Path) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig  # noqa: F401 - boto3 defaults on the baseline side

    from infra.s3 import S3Store

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                              aws_secret_access_key="x")
        client.create_bucket(Bucket="bench")
        f = work / "artifact.bin"
        with open(f, "wb") as out:
            for _ in range(mib):
                out.write(os.urandom(1 << 20))
        t0 = time.perf_counter()
        client.upload_file(str(f), "bench", "baseline/artifact.bin")
        baseline = time.perf_counter() - t0
        client.delete_object(Bucket="bench", Key="baseline/artifact.bin")
        t0 = time.perf_counter()
        rec = S3Store("bench", "jex", client).put_file(f, "jex/verified/artifact.bin")
        verified = time.perf_counter() - t0
        assert rec["uploaded"]
        f.unlink()
        return {"mib": mib, "boto3_upload_file_s": round(baseline, 2), "s3store_put_file_s": round(verified, 2),
                "boto3_mib_per_s": round(mib / baseline, 1), "s3store_mib_per_s": round(mib / verified, 1),
                "ratio_s3store_over_boto3_time": round(verified / baseline, 2)}
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upload-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu-machines.json")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jex-bench-machines-"))
    production = Policy()  # poll 2 s, heartbeat 5 s, as shipped
    hb = Policy(heartbeat_timeout_s=15.0)
    result: dict = {"policy": {"poll_s": production.poll_s, "heartbeat_s": production.heartbeat_s,
                               "heartbeat_timeout_s_for_loss_test": hb.heartbeat_timeout_s}, "providers": {}}
    sshd = start_sshd(Path(tempfile.mkdtemp(prefix="sshd-")))
    providers = {"local": lambda w: LocalProvider(w / "machines")}
    if sshd:
        providers["ssh"] = lambda w: SSHProvider(str(w / "remote"), ["127.0.0.1"], port=sshd["port"],
                                                 key_path=sshd["dir"] / "user_key",
                                                 known_hosts=sshd["dir"] / "known_hosts")
    else:
        result["providers"]["ssh"] = "skipped: needs root and openssh-server"
    try:
        for name, make in providers.items():
            rows = {"success_to_deleted_s": [], "heartbeat_loss_to_deleted_s": []}
            for r in range(a.repeats):
                w = work / f"{name}-{r}"
                rows["success_to_deleted_s"].append(round(success_to_deleted(make(w), w / "a", production), 2))
                rows["heartbeat_loss_to_deleted_s"].append(round(heartbeat_loss_to_deleted(make(w), w / "b", hb), 2))
            rows["max_success_to_deleted_s"] = max(rows["success_to_deleted_s"])
            rows["max_heartbeat_loss_to_deleted_s"] = max(rows["heartbeat_loss_to_deleted_s"])
            result["providers"][name] = rows
            print(name, json.dumps(rows), flush=True)
    finally:
        if sshd:
            os.kill(sshd["pid"], signal.SIGTERM)
    result["upload"] = upload_throughput(a.upload_mib, work)
    print("upload", json.dumps(result["upload"]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {a.out}")


if __name__ == "__main__":
    main()
