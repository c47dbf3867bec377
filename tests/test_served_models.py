"""Served models (issue 56): any OpenAI-compatible server as an engine, in the same campaigns, comparisons and
reports. On the CPU against a real server: `transformers serve` (the pinned transformers) on 127.0.0.1 serving
the embedded model, started once for the module. Its access log counts the requests jex sends (`POST /v1/...`;
the identity lookup, `GET /v1/models`, is not a row). It answers completions without prompt log-probabilities,
so it shows the refusal of multiple-choice catalogs; the multiple-choice readout itself is checked on a recorded
answer in vLLM's shape (`read_options`), the parsing step a vLLM server's answer goes through.
(The GPU half, `vllm serve` against jex's in-process vLLM engine, is not here.)"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from jex.cli import app
from tests.conftest import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from make_mixed_suite import GENERATIVE_CATALOG, mixed_suite, problem, prompt  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_user_settings")
ROWS = 6
KEY = "sk-jex-served-test-7f3e9a1c"
"""The API key the campaigns run with: it must appear in nothing jex writes or logs."""


class Server:
    """`transformers serve` on 127.0.0.1 with the embedded model; each start logs to its own file."""

    def __init__(self, model: Path, folder: Path):
        self.model, self.folder, self.port = str(model), folder, free_port()
        self.logs: list[Path] = []
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> None:
        import httpx

        log = self.folder / f"serve-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [str(Path(sys.executable).with_name("transformers")), "serve", self.model, "--host", "127.0.0.1",
                 "--port", str(self.port), "--device", "cpu", "--dtype", "float32", "--log-level", "info"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, log.read_text()[-2000:]
            time.sleep(0.3)
        raise AssertionError(f"transformers serve did not answer: {log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=30)

    def posts(self) -> int:
        """Requests for rows (completions and chat completions) the server has received, over all its starts."""
        return sum(log.read_text(errors="replace").count('"POST /v1/') for log in self.logs if log.exists())


@pytest.fixture(scope="module")
def served(tmp_path_factory, embedded_model_dir):
    server = Server(embedded_model_dir, tmp_path_factory.mktemp("serve"))
    server.start()
    yield server
    server.kill()


def gen_suite(out: Path, rows: int = ROWS) -> Path:
    """GSM8K-shaped word problems (`examples/make_mixed_suite.py`'s), 16 new tokens at most, and nothing else."""
    from jex.fileio import write_toml

    (out / "rows").mkdir(parents=True)
    rng = random.Random("served")
    lines = []
    for i in range(rows):
        question, answer = problem(rng)
        rid = f"arith_gen-{i:04d}"
        lines.append(json.dumps({"run_id": rid, "catalog": "arith_gen", "question_id": rid, "prompt": prompt(question),
                                 "answer": f"#### {answer}"}) + "\n")
    (out / "rows" / "arith_gen.jsonl").write_text("".join(lines))
    catalog = {**GENERATIVE_CATALOG, "generation": {**GENERATIVE_CATALOG["generation"], "max_tokens": 16}}
    write_toml(out / "suite.toml", {"legs": {"public": 1.0}, "catalogs": [catalog]})
    return out


def run_args(served: Server, suite: Path, out: Path, *more: str) -> list[str]:
    """`jex run` of `suite` through the server: 2 requests in flight, shards of 2 rows, a golden check of 2 rows
    of 8 tokens (sent twice), 200 bootstrap draws."""
    spec = out.with_name(out.name + "-campaign.toml")
    spec.write_text("bootstrap_draws = 200\n\n[machines]\ngolden_generation_rows = 2\ngolden_generation_tokens = 8\n")
    return ["run", "--spec", str(spec), "--suite", str(suite), "--engine", "openai", "--base-url", served.url,
            "--model", served.model, "--out", str(out), "--max-concurrency", "2", "--reason-shard-rows", "2",
            "--name", "served", *more]


def jex(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def first(tmp_path_factory, served, prefect_harness):
    """A generative campaign through the server, with an API key set, and what it sent; the flow's log records
    at INFO (the suite's default is WARNING) so they reach the Prefect API the key is looked for in."""
    root = tmp_path_factory.mktemp("served-run")
    suite = gen_suite(root / "suite")
    loggers = [logging.getLogger(name) for name in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [logger.level for logger in loggers]
    before = served.posts()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("JEX_ENGINE__API_KEY", KEY)
        for logger in loggers:  # as they are, and as Prefect's logging set up again by the run (its env overrides)
            env.setenv(f"PREFECT_LOGGING_LOGGERS_{logger.name.upper().replace('.', '_')}_LEVEL", "INFO")
            logger.setLevel(logging.INFO)
        try:
            code, output = jex(*run_args(served, suite, root / "runs"))
        finally:
            for logger, level in zip(loggers, levels, strict=True):
                logger.setLevel(level)
    assert code == 0, output
    from jex.settings import load_settings

    return {"root": root, "suite": suite, "run": Path(output.splitlines()[-1]), "output": output,
            "sent": served.posts() - before, "ledger": Path(load_settings().infra.state_dir).resolve() / "ledger.json"}


def test_every_row_is_generated_through_the_server_and_scored(first):
    from jex.tasks.outputs.samples import read_samples

    run = first["run"]
    generated = pl.read_parquet(next((first["root"] / "runs" / "store" / "generate").glob("*/generated.parquet")))
    assert generated.height == ROWS and generated["finish_reason"].is_in(["stop", "length"]).all()
    assert generated["generation"].str.len_chars().min() > 0
    samples = read_samples(run)
    assert samples.height == ROWS and samples["scored"].all() and samples["verdicts"].is_not_null().all()
    assert json.loads((run / "score.json").read_text())["catalogs"]["arith_gen"]["n"] == ROWS
    assert first["sent"] == ROWS + 2 * 2  # the rows, and the golden check's 2 rows twice


def test_the_report_and_served_json_mark_the_run_and_count_its_tokens(first, served):
    report = (first["run"] / "report.md").read_text()
    assert "served: batch invariance not proven" in report and "## Served model" in report
    assert "Golden check: 2 rows generated (8 tokens), twice, at concurrency 1 and 2: identical." in report
    doc = json.loads((first["run"] / "served.json").read_text())
    assert doc["usage"]["requests"] == ROWS and doc["usage"]["completion_tokens"] > 0
    assert (doc["model"], doc["endpoint"], doc["note"]) == (served.model, f"http://127.0.0.1:{served.port}",
                                                           "served: batch invariance not proven")


def test_the_cost_ledger_holds_the_campaigns_served_usage_beside_its_machines(first):
    from jex.infra.cost_ledger import CostLedger

    ledger = CostLedger(first["ledger"])
    entries = ledger.served(first["run"].name)  # one per answer journal: the stages that sent rows
    doc = json.loads((first["run"] / "served.json").read_text())
    assert entries and [sum(getattr(e, k) for e in entries) for k in ("requests", "prompt_tokens", "completion_tokens")
                        ] == [doc["usage"][k] for k in ("requests", "prompt_tokens", "completion_tokens")]
    assert {e.cost_usd for e in entries} == {None} and ledger.total(first["run"].name) == 0.0  # no price set


def test_the_same_campaign_again_sends_no_request(first, served, monkeypatch):
    from jex.infra.cost_ledger import CostLedger

    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(first["ledger"].parent))  # the first run's cost ledger
    recorded = CostLedger(first["ledger"]).served(first["run"].name)
    before = served.posts()
    code, output = jex(*run_args(served, first["suite"], first["root"] / "runs"))
    assert code == 0, output
    assert Path(output.splitlines()[-1]) == first["run"] and served.posts() == before
    assert CostLedger(first["ledger"]).served(first["run"].name) == recorded  # not rewritten: recorded_at kept


def test_the_api_key_appears_in_no_file_parameter_or_log(first):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["campaign"])),
                                     sort=FlowRunSort.START_TIME_DESC, limit=5)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])))
    assert [r for r in runs if r.parameters["spec"]["engine"]["kind"] == "openai"] and logs
    assert not [r for r in runs if KEY in json.dumps(r.parameters)]
    assert not [log for log in logs if KEY in log.message] and KEY not in first["output"]
    written = [p for p in (first["root"] / "runs").rglob("*") if p.is_file()]  # the run folder and the store
    assert written and not [p for p in written if KEY.encode() in p.read_bytes()]


def test_a_server_without_prompt_logprobs_is_refused_after_one_probe_naming_the_catalogs(served, tmp_path,
                                                                                        prefect_harness):
    suite = mixed_suite(tmp_path / "suite", rows=18, generated=2)
    before = served.posts()
    code, output = jex(*run_args(served, suite, tmp_path / "runs"))
    assert code == 1 and "Traceback" not in output
    (line,) = [x for x in output.splitlines() if x.startswith("error:")]
    assert "multiple-choice catalog(s)" in line and "'arith'" in line and "no prompt log-probabilities" in line
    assert served.posts() - before == 1  # the probe; no row


def test_the_server_killed_mid_campaign_is_one_line_and_a_resume_sends_only_the_missing_rows(served, tmp_path,
                                                                                              prefect_harness):
    from jex.engine.openai_engine import read_journal

    suite = gen_suite(tmp_path / "suite")
    start = served.posts()

    def kill_after_two_rows() -> None:
        deadline = time.time() + 300
        while served.posts() < start + 2 * 2 + 2 and time.time() < deadline:  # the golden check, then 2 rows
            time.sleep(0.05)
        served.kill()

    killer = threading.Thread(target=kill_after_two_rows)
    killer.start()
    code, output = jex(*run_args(served, suite, tmp_path / "runs", "--max-retries", "1"))
    killer.join()
    assert code == 1 and "Traceback" not in output
    (line,) = [x for x in output.splitlines() if x.startswith("error:")]
    assert "stopped answering" in line and "resume" in line
    (run,) = (tmp_path / "runs").glob("served-*")
    (folder,) = (tmp_path / "runs" / "store" / "generate").glob("*/shards-2")
    answered = len(read_journal(folder))
    assert 2 <= answered < ROWS
    served.start()
    before = served.posts()
    code, output = jex("run", "--resume", str(run))
    assert code == 0, output
    assert served.posts() - before == ROWS - answered
    assert pl.read_parquet(run / "samples.parquet").height == ROWS


# --- the multiple-choice readout, on a recorded answer in vLLM's shape -------------------------------------

def vllm_echo(prompt_text: str, tokens: list[tuple[str, float | None, dict[str, float] | None]]) -> dict:
    """One choice of vLLM's `/v1/completions` answer to `echo` + `logprobs=1` (the prompt's tokens, then the one
    new token): text, and per token its text, offset, log-prob and the top log-probs (the token's own too)."""
    offsets, at = [], 0
    for text, _, _ in tokens:
        offsets.append(at)
        at += len(text)
    assert "".join(t for t, _, _ in tokens).startswith(prompt_text)
    return {"index": 0, "text": "".join(t for t, _, _ in tokens), "finish_reason": "length",
            "logprobs": {"text_offset": offsets, "tokens": [t for t, _, _ in tokens],
                         "token_logprobs": [lp for _, lp, _ in tokens], "top_logprobs": [top for _, _, top in tokens]}}


def recorded(*choices: dict) -> object:
    """The answer as the `openai` client builds it from the server's JSON (loosely, as it does: vLLM's first
    log-prob is null where OpenAI's schema says a number)."""
    from openai._models import construct_type
    from openai.types import Completion

    return construct_type(type_=Completion, value={
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{**c, "index": i} for i, c in enumerate(choices)],
        "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}})


def answer_of(completion: object):
    from jex.engine.openai_engine import EchoedTokens, ServedAnswer

    return ServedAnswer(echo=[EchoedTokens.of(c) for c in completion.choices])  # type: ignore[attr-defined]


def test_a_label_slot_readout_is_each_labels_log_prob_after_the_prompt():
    from jex.engine.openai_engine import option_texts, read_options
    from jex.engine.types import ReadoutMode, ReadoutRequest

    request = ReadoutRequest("r1", "Q?\nAnswer:", ("A", "B"))
    plan = option_texts(request, ReadoutMode.LABEL_SLOT)
    head = [("Q", None, None), ("?\n", -3.0, {"?\n": -3.0}), ("Answer", -1.0, {"Answer": -1.0}),
            (":", -0.1, {":": -0.1})]
    got = read_options("r1", plan, answer_of(recorded(
        vllm_echo("Q?\nAnswer: A", [*head, (" A", -0.5, {" A": -0.5}), (" The", -2.0, {" The": -2.0})]),
        vllm_echo("Q?\nAnswer: B", [*head, (" B", -1.5, {" A": -0.5, " B": -1.5}), ("\n", -1.0, {"\n": -1.0})]))),
        ReadoutMode.LABEL_SLOT)
    assert got.raw_logprobs == (-0.5, -1.5) and got.refusal is None
    assert math.isclose(got.label_mass, math.exp(-0.5) + math.exp(-1.5))
    assert got.logprobs is not None and math.isclose(math.exp(got.logprobs[0]), 1 / (1 + math.exp(-1.0)))


def test_a_continuation_readout_sums_the_options_tokens_and_says_which_is_greedy():
    from jex.engine.openai_engine import option_texts, read_options
    from jex.engine.types import ReadoutMode, ReadoutRequest

    request = ReadoutRequest("r2", "The sky is ", ("A", "B"), ("blue", "very green"))
    plan = option_texts(request, ReadoutMode.OPTION_CONTINUATION)
    assert plan == [("The sky is", "  blue"), ("The sky is", "  very green")]  # lm-eval's pair: the space moves
    head = [("The", None, None), (" sky", -4.0, {" sky": -4.0}), (" is", -0.2, {" is": -0.2})]
    got = read_options("r2", plan, answer_of(recorded(
        vllm_echo("The sky is  blue", [*head, ("  blue", -0.7, {"  blue": -0.7}), (".", -0.3, {".": -0.3})]),
        vllm_echo("The sky is  very green", [*head, ("  very", -2.0, {"  blue": -0.7, "  very": -2.0}),
                                             (" green", -0.4, {" green": -0.4}), (".", -0.3, {".": -0.3})]))),
        ReadoutMode.OPTION_CONTINUATION)
    assert got.raw_logprobs == (-0.7, -2.4) and got.greedy == (True, False) and got.label_mass is None


def test_an_option_whose_tokens_cross_the_end_of_the_context_is_refused_and_counted():
    from jex.engine.openai_engine import read_options
    from jex.engine.types import ReadoutMode

    merged = vllm_echo("ab", [("a", None, None), ("bc", -1.0, {"bc": -1.0})])  # the context "ab" ends inside "bc"
    got = read_options("r3", [("ab", "c")], answer_of(recorded(merged)), ReadoutMode.OPTION_CONTINUATION)
    assert got.logprobs is None and got.refusal == "continuation: option 0: the server's tokens cross the end of " \
                                                   "the context"


def test_a_multi_token_label_is_refused_for_the_label_slot_so_the_stage_reads_it_by_continuation():
    from jex.engine.openai_engine import read_options
    from jex.engine.types import ReadoutMode

    two = vllm_echo("x: AB", [("x", None, None), (":", -1.0, None), (" A", -1.0, None), ("B", -1.0, None)])
    got = read_options("r4", [("x:", " AB")], answer_of(recorded(two)), ReadoutMode.LABEL_SLOT)
    assert got.refusal == "label token: ' AB' is not a single token"


# --- naming a served model -------------------------------------------------------------------------------

def test_a_served_model_is_named_openai_name_with_its_base_url():
    from jex.engine_spec import EngineSpec

    spec = EngineSpec(model="openai:my-model@http://10.0.0.2:8000/v1/")
    assert (spec.kind, spec.model, spec.base_url, spec.endpoint()) == (
        "openai", "my-model", "http://10.0.0.2:8000/v1", "http://10.0.0.2:8000")
    assert spec.model_name() == "openai:my-model" and not spec.on_gpu()


@pytest.mark.parametrize(("fields", "words"), [
    ({"kind": "openai"}, "needs base_url"),
    ({"kind": "openai", "base_url": "http://u:secret@h:1/v1"}, "holds credentials"),
    ({"kind": "openai", "base_url": "ftp://h/v1"}, "http:// or https://"),
    ({"kind": "openai", "base_url": "http://h/v1", "render": {"chat_template": "{{ x }}"}}, "the server's"),
])
def test_a_bad_served_engine_is_refused_with_its_field(fields, words):
    from pydantic import ValidationError

    from jex.engine_spec import EngineSpec

    with pytest.raises(ValidationError, match=words):
        EngineSpec.model_validate(fields)


def test_a_campaign_file_names_a_served_model_beside_a_local_one(tmp_path):
    from jex.cli.run import spec_file_models

    (tmp_path / "c.toml").write_text('models = ["embedded", {engine = "openai", model = "m", base_url = '
                                     '"http://127.0.0.1:9/v1"}, "openai:n"]\n')
    assert spec_file_models(tmp_path / "c.toml") == ["embedded", "openai:m@http://127.0.0.1:9/v1", "openai:n"]


def test_the_key_setting_is_a_secret_no_campaign_spec_holds(monkeypatch):
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import campaign_spec

    monkeypatch.setenv("JEX_ENGINE__API_KEY", KEY)
    monkeypatch.setenv("JEX_ENGINE__KIND", "openai")
    monkeypatch.setenv("JEX_ENGINE__BASE_URL", "http://127.0.0.1:9/v1")
    settings = load_settings()
    assert settings.engine.api_key is not None and KEY not in repr(settings) and KEY not in str(settings.public_dict())
    spec = campaign_spec(settings)
    assert spec.engine.kind == "openai" and KEY not in spec.model_dump_json()


def test_a_served_model_beside_a_local_one_is_compared_shown_and_exported(first, served, tmp_path):
    """`models = [local, served table]`: each model's campaign (the served one found stored: no request), then
    their comparison; `jex show` and `jex export lm-eval|inspect` carry the served run's rows."""
    spec = first["root"] / "models.toml"
    spec.write_text(f'models = ["embedded", {{engine = "openai", model = "{served.model}", base_url = "{served.url}"}}]'
                    '\nbootstrap_draws = 200\n\n[machines]\nprovider = "inprocess"\ngolden_generation_rows = 2\n'
                    'golden_generation_tokens = 8\n')
    before = served.posts()
    code, output = jex("run", "--spec", str(spec), "--suite", str(first["suite"]), "--out",
                       str(first["root"] / "runs"), "--reason-shard-rows", "2", "--name", "served", "--quiet")
    assert code == 0, output
    assert served.posts() == before
    compare = (Path(output.splitlines()[-1]) / "compare.md").read_text()
    assert "| embedded |" in compare and f"| openai:{Path(served.model).name} |" in compare
    code, shown = jex("show", str(first["run"]), "--limit", "2")
    assert code == 0 and "arith_gen-0000" in shown and "generated" in shown
    for kind in ("lm-eval", "inspect"):
        code, out = jex("export", kind, str(first["run"]), "-o", str(tmp_path / kind))
        assert code == 0, out
    (samples,) = (tmp_path / "lm-eval").rglob("samples_arith_gen*.jsonl")
    assert len(samples.read_text().splitlines()) == ROWS * 2  # one line per row and filter


def test_jex_runs_marks_a_served_run():
    from jex.flows.history import RunRow, format_runs

    row = RunRow(flow_run="r", id="1", state="COMPLETED", start=None, model="openai:m",
                 note="served: batch invariance not proven")
    assert format_runs([row]).splitlines()[-1].endswith("served: batch invariance not proven")


def test_a_chat_rendered_prompt_goes_to_the_servers_chat_completions(served):
    """`chat_template = "model"`: the prompt travels as messages, and the server applies its own template."""
    from openai import OpenAI

    from jex.engine.factory import make_engine
    from jex.engine.openai_engine import ServedTokenizer
    from jex.engine.types import GenerateRequest
    from jex.engine_spec import EngineSpec, RenderSpec

    text = ServedTokenizer().renderer(RenderSpec(chat_template="model")).continued("What is 2 + 3?")
    engine = make_engine(EngineSpec(kind="openai", base_url=served.url, model=served.model))
    before = served.posts()
    (got,) = engine.generate([GenerateRequest("c1", text, 12)])
    direct = OpenAI(base_url=served.url, api_key="no-key").chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=12, temperature=0.0)
    assert got.text == direct.choices[0].message.content and got.text
    chats = sum(log.read_text().count('"POST /v1/chat/completions') for log in served.logs)
    assert served.posts() - before == 2 and chats >= 2


class Scripted:
    """An OpenAI-compatible stub on 127.0.0.1 whose completions answer from a script (status codes, then 200s):
    what a busy or failing server does to the client's retries."""

    def __init__(self, statuses: list[int]):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.statuses, self.posts = list(statuses), 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                return None

            def reply(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("retry-after-ms", "10")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.reply(200, {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "x",
                                                             "created": 0}]})

            def do_POST(self) -> None:  # noqa: N802
                prompt = json.loads(self.rfile.read(int(self.headers["content-length"])))["prompt"]
                stub.posts += 1
                status = stub.statuses.pop(0) if stub.statuses else 200
                if status != 200 or prompt == "too long":
                    self.reply(status if status != 200 else 400, {"error": {"message": f"status {status}"}})
                    return
                self.reply(200, {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                 "choices": [{"index": 0, "text": " 5", "finish_reason": "stop", "logprobs": None}],
                                 "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_429_and_5xx_are_retried_by_the_client_and_a_400_is_the_rows_refusal(tmp_path):
    from jex.engine.factory import make_engine
    from jex.engine.openai_engine import read_journal
    from jex.engine.types import FinishReason, GenerateRequest
    from jex.engine_spec import EngineSpec

    stub = Scripted([429, 503])
    engine = make_engine(EngineSpec(kind="openai", base_url=stub.url, model="m", max_retries=2, max_concurrency=1))
    engine.keep_answers(tmp_path)
    try:
        ok, refused = engine.generate([GenerateRequest("a", "2 + 3 =", 4), GenerateRequest("b", "too long", 4)])
    finally:
        stub.server.shutdown()
    assert (ok.text, ok.finish_reason, refused.finish_reason) == (" 5", FinishReason.STOP, FinishReason.REFUSED)
    assert stub.posts == 4 and len(read_journal(tmp_path)) == 2  # 429, 503, 200; and the 400, kept as an answer
