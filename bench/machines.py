"""Machine lifecycle benchmarks (issues 6, 17): teardown latency, lease expiry, S3 upload throughput.

    .venv/bin/python bench/machines.py [--upload-mib 1024] [--out bench/results/cpu-machines.json]
    .venv/bin/python bench/machines.py --only lease [--lease-s 20]      # lease figures only, merged into --out

- SUCCESS marker -> machine deleted, on the local and ssh providers (target < 30 s)
- heartbeat loss (the job's processes frozen) -> machine deleted (target < timeout + 30 s)
- a 1 GiB artifact uploaded to a local S3 server (moto, its own process) by `S3Store.put_file`
  (sha256 in metadata, verified by HEAD afterwards) against plain boto3 `upload_file`, same run.
- lease expiry (the orchestrator stops polling) -> artifacts in S3 with SELF_TERMINATED.json -> machine
  gone, with the shipped watchdog check interval (target: under the lease + 60 s after the last poll)
The ssh rows need root and Debian's openssh-server (as in CI); they are skipped with a reason otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
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

from jex.infra.cost_ledger import CostLedger  # noqa: E402
from jex.infra.machine import JobFailed, MachineSession, Policy, RemoteJob  # noqa: E402
from jex.infra.providers import LocalProvider, SSHProvider  # noqa: E402


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
    return MachineSession(provider, campaign="bench", ledger=CostLedger(work / "state" / "ledger.json"), policy=policy,
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
            pgid = sess.started.shell.run(f"cat {sess.run_dir(j)}/worker.pgid").stdout.strip()
            sess.started.shell.run(f"kill -STOP -- -{pgid}")
            stopped["t"] = time.time()

    s.on_poll = freeze
    try:
        with s:
            s.run(job("sleep 600", work / "got"))
    except JobFailed as e:
        assert e.outcome.status == "heartbeat_lost", e.outcome.status
    assert provider.describe(s.machine.id) is None
    return time.time() - stopped["t"]


@contextlib.contextmanager
def moto_s3():
    """A local S3 server (moto) in its own process; yields a boto3 client with a bucket 'bench'."""
    import boto3

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
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                              aws_access_key_id="x", aws_secret_access_key="x")
        client.create_bucket(Bucket="bench")
        yield client
    finally:
        server.terminate()
        server.wait()


def lease_expiry(provider, work: Path, policy: Policy, client) -> dict:
    """The orchestrator launches a job, then never polls again: time from the last lease renewal to
    the artifacts (and SELF_TERMINATED.json) in S3, and to the machine gone."""
    from jex.infra.s3 import S3Store

    s3 = S3Store("bench", f"lease-{work.name}", client)
    s = MachineSession(provider, campaign="bench", ledger=CostLedger(work / "state" / "ledger.json"), policy=policy,
                       python=sys.executable, state_dir=work / "state", echo=lambda m: None, s3=s3,
                       machine_credentials=lambda: {"aws_access_key_id": "x", "aws_secret_access_key": "x"})
    s.start()
    s.launch(job("head -c 1000000 /dev/urandom > a.bin; sleep 600", work / "got"))
    s.started.shell.run(f"touch {s.machine.workdir}/lease")  # the last poll
    last = time.time()
    marker = s3.key("campaigns", "bench", "machines", s.machine.id, "SELF_TERMINATED.json")
    in_s3 = gone = None
    while time.time() - last < policy.lease_s + 300 and (in_s3 is None or gone is None):
        if in_s3 is None and s3.head(marker) is not None:
            in_s3 = time.time() - last
        if gone is None and provider.describe(s.machine.id) is None:
            gone = time.time() - last
        time.sleep(0.2)
    assert in_s3 is not None and gone is not None, "the machine did not stop itself"
    assert s3.head(s3.key("campaigns", "bench", "machines", s.machine.id, "j", "a.bin")) is not None
    s.teardown("bench done")
    return {"last_poll_to_in_s3_s": round(in_s3, 2), "last_poll_to_gone_s": round(gone, 2),
            "after_lease_gone_s": round(gone - policy.lease_s, 2)}


def upload_throughput(mib: int, work: Path) -> dict:
    from jex.infra.s3 import S3Store

    with moto_s3() as client:
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
        assert rec.uploaded
        f.unlink()
        return {"mib": mib, "boto3_upload_file_s": round(baseline, 2), "s3store_put_file_s": round(verified, 2),
                "boto3_mib_per_s": round(mib / baseline, 1), "s3store_mib_per_s": round(mib / verified, 1),
                "ratio_s3store_over_boto3_time": round(verified / baseline, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--upload-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu-machines.json")
    ap.add_argument("--lease-s", type=float, default=20.0, help="lease for the expiry rows (shipped: 900)")
    ap.add_argument("--only", choices=["all", "lease"], default="all")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jex-bench-machines-"))
    if a.only == "lease":
        result = json.loads(a.out.read_text()) if a.out.exists() else {}
        result["lease_expiry"] = lease_rows(a, work)
        a.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"-> {a.out}")
        return
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
    result["lease_expiry"] = lease_rows(a, work)
    result["upload"] = upload_throughput(a.upload_mib, work)
    print("upload", json.dumps(result["upload"]), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {a.out}")


def lease_rows(a: argparse.Namespace, work: Path) -> dict:
    """Lease-expiry rows on the local and ssh providers (shipped watchdog check interval)."""
    policy = Policy(lease_s=a.lease_s)
    out: dict = {"lease_s": a.lease_s, "watchdog_check_s": min(policy.watchdog_check_s, a.lease_s / 3),
                 "target": "last poll -> machine gone under lease + 60 s", "providers": {}}
    sshd = start_sshd(Path(tempfile.mkdtemp(prefix="sshd-")))
    providers = {"local": lambda w: LocalProvider(w / "machines")}
    if sshd:
        providers["ssh"] = lambda w: SSHProvider(str(w / "remote"), ["127.0.0.1"], port=sshd["port"],
                                                 key_path=sshd["dir"] / "user_key",
                                                 known_hosts=sshd["dir"] / "known_hosts")
    else:
        out["providers"]["ssh"] = "skipped: needs root and openssh-server"
    try:
        with moto_s3() as client:
            for name, make in providers.items():
                rows = [lease_expiry(make(work / f"lease-{name}-{r}"), work / f"lease-{name}-{r}", policy, client)
                        for r in range(a.repeats)]
                out["providers"][name] = rows
                print("lease", name, json.dumps(rows), flush=True)
    finally:
        if sshd:
            os.kill(sshd["pid"], signal.SIGTERM)
    return out


if __name__ == "__main__":
    main()
