from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from jex.sample_suite import write_sample_suite

# Test processes (pytest-xdist runs two) each get their own Prefect home and orchestrator state, set
# before Prefect is first imported (it reads its settings once): nothing is shared but the model cache.
# One compute thread per process: two test processes (and the engine processes their machines start)
# share the 2 cores; with torch's default of a thread per core they oversubscribe them, and a readout
# measured 5x slower than alone (1 thread each: 1.6x). The HF engine's readouts are bit-identical
# with 1 or 2 threads (checked on the sample rows).
os.environ.setdefault("OMP_NUM_THREADS", "1")
_WORKER_TMP = Path(tempfile.mkdtemp(prefix=f"jex-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-"))
os.environ["PREFECT_HOME"] = str(_WORKER_TMP / "prefect")
os.environ.setdefault("JEX_INFRA__STATE_DIR", str(_WORKER_TMP / "infra"))

FILE_SECONDS = Path(__file__).with_name("durations.json")
"""Seconds of the slowest test files in a whole `make test` run (re-recorded from its JUnit XML by
`bench/test_durations.py`); a file not listed counts 0."""


SLOW_FIXTURES = frozenset({"prefect_harness", "main_job_run", "embedded_model_dir"})
"""Fixtures that start a Prefect test API, run a whole campaign or load the embedded model: a test using one
(directly or through its own fixtures) is `slow` as pyproject's marker says, marked here if its file did not."""


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects (`make test-fast`: -m "not slow")
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (pytest-xdist hands files out in this order, `--no-loadscope-reorder`
    in the Makefile), so the run does not end with one worker alone on a long file that started late."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    seconds = json.loads(FILE_SECONDS.read_text())
    items.sort(key=lambda item: -seconds.get(item.path.name, 0))  # stable: each file's own order is kept


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


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the servers the tests start)."""
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
    port = free_port()
    (d / "sshd_config").write_text("\n".join([
        f"Port {port}", "ListenAddress 127.0.0.1", f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d}/authorized_keys", "Subsystem sftp internal-sftp",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        "PermitRootLogin prohibit-password", "PidFile none", "MaxStartups 50", "MaxSessions 50",
        # an SSH session starts from a fresh environment: the engines it starts get the tests' thread count here
        f"SetEnv OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}", ""]))
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    # in the foreground (-D), so its PID is known at once: a daemon writes its PID file after it listens,
    # and a loaded machine once read the file before it was there
    server = subprocess.Popen([exe, "-D", "-f", str(d / "sshd_config"), "-E", str(d / "sshd.log")])
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                log = (d / "sshd.log").read_text() if (d / "sshd.log").exists() else ""
                pytest.fail(f"the test sshd did not listen on 127.0.0.1:{port}: {log}")
            time.sleep(0.1)
    kind, b64 = (d / "host_key.pub").read_text().split()[:2]
    (d / "known_hosts").write_text(f"[127.0.0.1]:{port} {kind} {b64}\n")
    yield {"port": port, "key_path": d / "user_key", "known_hosts": d / "known_hosts", "pid": server.pid, "dir": d}
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=10)


@pytest.fixture()
def s3_bucket(s3_server):
    """A fresh bucket on the session's S3 server, and an S3Store over it."""
    import uuid

    import boto3

    from jex.infra.s3 import S3Store

    client = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
    name = f"jex-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=name)
    return S3Store(name, "jex", client)


@pytest.fixture(scope="session")
def main_job_run(tmp_path_factory, prefect_harness) -> Path:
    """The main job (default campaign spec; rationales cut to 16 tokens) on a 36-row sample suite,
    in-process, run once per session: the run folder the samples, show, export and import tests read."""
    from jex.flows.campaign import campaign
    from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec

    root = tmp_path_factory.mktemp("main-job")
    spec = CampaignSpec(sample_rows=36, reason_max_tokens=16, store=str(root / "store"), out=str(root / "runs"),
                        machines=MachinesSpec(provider="inprocess"))
    return Path(campaign(spec))


def write_hub_cache(cache: Path, repo_id: str, source: Path, *, drop_chat_template: bool = False) -> str:
    """A local Hugging Face Hub cache holding `source` (a model folder) as `repo_id` at one commit.

    The layout is the Hub client's own: `models--org--name/{blobs,refs/main,snapshots/<commit>/}`,
    weight files as blobs named by their sha256 (as the Hub names LFS files), the rest by git's
    blob sha1, and snapshot entries as relative symlinks. Returns the commit sha.
    """
    import hashlib
    import os

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    files = {}
    for p in sorted(source.iterdir()):
        if not p.is_file() or p.name.startswith(".jex"):
            continue
        data = p.read_bytes()
        if drop_chat_template and p.name == "tokenizer_config.json":
            cfg = json.loads(data)
            cfg.pop("chat_template", None)
            data = json.dumps(cfg).encode()
        if drop_chat_template and p.name == "chat_template.jinja":
            continue
        lfs = p.suffix in (".safetensors", ".bin")
        blob = hashlib.sha256(data).hexdigest() if lfs else \
            hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        files[p.name] = (blob, data)
    commit = hashlib.sha1("".join(sorted(b for b, _ in files.values())).encode()).hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    for name, (blob, data) in files.items():
        (repo / "blobs" / blob).write_bytes(data)
        link = repo / "snapshots" / commit / name
        if not link.exists():
            os.symlink(os.path.join("..", "..", "blobs", blob), link)
    (repo / "refs" / "main").write_text(commit)
    return commit


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded SmolLM2 converted to a safetensors folder (converted once per machine)."""
    from jex.engine.hf import DEFAULT_CACHE
    from jex.engine.models import resolve_model

    return resolve_model(None, DEFAULT_CACHE).path


@pytest.fixture(scope="session")
def prefect_harness():
    """One Prefect test API for every test module that runs flows in-process. Its database starts as a copy of jex's
    migrated template (`jex.flows.local_api.migrated_template`, what every temporary server of jex starts from)
    instead of an empty file its server migrates first: 9-10 s to start here where it took 17-18."""
    import shutil
    from contextlib import ExitStack
    from unittest import mock

    import prefect.testing.utilities as harness

    from jex.flows.local_api import migrated_template

    make_folder = harness.mkdtemp

    def seeded_folder(*args, **kwargs) -> str:  # the harness's database folder, its `prefect-test.db` migrated
        folder = make_folder(*args, **kwargs)
        shutil.copyfile(migrated_template(), Path(folder) / "prefect-test.db")
        return folder

    with ExitStack() as running:
        with mock.patch.object(harness, "mkdtemp", seeded_folder):
            running.enter_context(harness.prefect_test_harness(server_startup_timeout=120))
        yield


@pytest.fixture(scope="session")
def prefect_api_url(prefect_harness) -> str:
    """The API URL of this process's Prefect test API (`prefect_harness`), for a `jex` subprocess's PREFECT_API_URL:
    its flows report there instead of each command starting a temporary server (~8 s of CPU). Its Prefect home,
    and with it the result storage Prefect's cache lives in, stays whatever the test gives it."""
    from prefect.settings import PREFECT_API_URL

    return str(PREFECT_API_URL.value())


@pytest.fixture
def no_user_settings(monkeypatch, tmp_path):
    """No JEX_* variable and no .env of the person running the tests (the working directory is tmp_path)."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("JEX_")]:
        monkeypatch.delenv(name)


# --- a GSM8K-shaped generative task ---------------------------------------------------------------------

GSM = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "Tom has 3 + 4 = 7 apples.\n#### 7"),
       ("A pen costs $2. How much do 5 pens cost?", "5 pens cost 5 * 2 = $10.\n#### 10"),
       ("There are 20 birds. 8 fly away. How many remain?", "20 - 8 = 12 birds remain.\n#### 12"),
       ("Sara read 12 pages on Monday and twice as many on Tuesday. How many pages did she read?",
        "Tuesday: 12 * 2 = 24. Total: 12 + 24 = 36.\n#### 36"),
       ("A box holds 6 eggs. How many eggs are in 4 boxes?", "4 * 6 = 24 eggs.\n#### 24"),
       ("Jim earns $1,200 a week. How much does he earn in 3 weeks?", "3 * 1,200 = $3,600.\n#### 3600")]
"""GSM8K-shaped documents (question, worked answer ending in `#### N`)."""
SHOTS = [("Ann has 2 cats and 3 dogs. How many pets?", "2 + 3 = 5 pets.\n#### 5"),
         ("Bob had 10 candies and ate 4. How many are left?", "10 - 4 = 6 candies.\n#### 6")]


def gsm_task(folder: Path, **overrides: str) -> Path:
    """lm-eval's shipped GSM8K YAML on local documents (2-shot, 48 new tokens at most), `overrides` appended."""
    import lm_eval.tasks

    folder.mkdir(parents=True, exist_ok=True)
    for split, docs in (("test", GSM), ("train", SHOTS)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                       for q, a in docs))
    shipped = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    text = (f"include: {shipped}\ntask: fid_gsm\ntag: []\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    train: {folder / 'train.jsonl'}\n    test: {folder / 'test.jsonl'}\n"
            "num_fewshot: 2\n")
    text += overrides.get("generation", 'generation_kwargs:\n  until: ["Question:", "</s>", "<|im_end|>"]\n'
                                        "  do_sample: false\n  temperature: 0.0\n  max_gen_toks: 48\n")
    text += "".join(v for k, v in overrides.items() if k != "generation")
    (folder / "fid_gsm.yaml").write_text(text)
    return folder / "fid_gsm.yaml"


def sc_task(folder: Path, *, repeats: int = 3, docs: int = 3, max_tokens: int = 32,
            sampling: str = "  do_sample: false\n") -> Path:
    """lm-eval's `gsm8k_cot_self_consistency` shape on `GSM`'s first `docs` documents (2-shot, as `gsm_task`):
    `repeats` responses per document, scored on the first (`score-first`), by majority over all (`maj@N`) and over
    the first two (`maj@2`, take_first_k); `sampling`: the generation_kwargs besides until and max_gen_toks."""
    import lm_eval.tasks

    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in (("test", GSM[:docs]), ("train", SHOTS)):  # beside gsm_task's files, if in its folder
        (folder / f"sc_{split}.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n"
                                                          for q, a in rows))
    shipped = Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k.yaml"
    strict = '      - function: regex\n        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"\n'
    (folder / "sc_gsm.yaml").write_text(
        f"include: {shipped}\ntask: sc_gsm\ntag: []\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    train: {folder / 'sc_train.jsonl'}\n"
        f"    test: {folder / 'sc_test.jsonl'}\n"
        f"num_fewshot: 2\nrepeats: {repeats}\ngeneration_kwargs:\n  until: [\"Question:\", \"</s>\", \"<|im_end|>\"]\n"
        f"  max_gen_toks: {max_tokens}\n{sampling}filter_list:\n"
        f"  - name: score-first\n    filter:\n{strict}      - function: take_first\n"
        f"  - name: maj@{repeats}\n    filter:\n{strict}      - function: majority_vote\n      - function: take_first\n"
        f"  - name: maj@2\n    filter:\n      - function: take_first_k\n        k: 2\n{strict}"
        "      - function: majority_vote\n      - function: take_first\n")
    return folder / "sc_gsm.yaml"
