"""Every setting `jex config show` prints is honoured: the engine, store and bootstrap settings are the
campaign's defaults (`campaign_spec`), for `jex run` and the UI form alike; the Prefect API URL reaches
the Prefect client."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jex.engine_spec import EngineSpec
from jex.settings import BOOTSTRAP_SEED, JexSettings, load_settings
from jex.tasks.campaign_spec import CampaignSpec, campaign_spec

ROOT = Path(__file__).resolve().parent.parent
NOT_DEFAULT = {"kind": "vllm", "profile": "audit-ngram", "model": "org/name@abc", "device": "cuda:1", "batch_size": 3,
               "max_num_seqs": 7, "max_num_batched_tokens": 4096, "dtype": "bfloat16", "gpu_memory_utilization": 0.5,
               "kv_cache_memory_gib": 6.0, "max_model_len": 2048, "cache_dir": "/tmp/jex-cache",
               "cudagraph_mode": "FULL_DECODE_ONLY", "base_url": "http://h:1/v1", "api_key_env": "MY_KEY",
               "max_concurrency": 3, "max_retries": 1, "request_timeout_s": 30.0, "price_input_per_mtok": 0.5,
               "price_output_per_mtok": 1.5, "tensor_parallel_size": 2}
"""A value other than the default for every plain field of the engine spec (its render is a table)."""


pytestmark = pytest.mark.usefixtures("no_user_settings")


def test_default_settings_give_the_default_campaign():
    """`jex run` with no option runs the campaign it ran before settings fed it (byte-identical outputs)."""
    assert campaign_spec(load_settings()) == CampaignSpec()


def test_the_engine_settings_are_the_one_engine_spec():
    """The engine settings are the engine spec, and one secret no spec holds: a served model's API key."""
    engine = JexSettings.model_fields["engine"].annotation
    assert isinstance(engine, type) and issubclass(engine, EngineSpec)
    assert set(engine.model_fields) - set(EngineSpec.model_fields) == {"api_key"}
    assert set(NOT_DEFAULT) == set(EngineSpec.model_fields) - {"render"}
    assert all(NOT_DEFAULT[k] != f.default for k, f in EngineSpec.model_fields.items() if k != "render")


def test_a_misspelt_engine_setting_is_refused_by_name(monkeypatch):
    from jex.errors import SettingsError

    monkeypatch.setenv("JEX_ENGINE__BATCH_SIZ", "4")
    with pytest.raises(SettingsError, match="JEX_ENGINE__BATCH_SIZ': unknown setting; did you mean "
                                            "JEX_ENGINE__BATCH_SIZE"):
        load_settings()


@pytest.mark.parametrize("field", sorted(NOT_DEFAULT))
def test_an_engine_setting_reaches_the_campaign_engine(field, monkeypatch):
    if field in ("cudagraph_mode", "tensor_parallel_size"):  # vLLM settings: the HF engine refuses them
        monkeypatch.setenv("JEX_ENGINE__KIND", "vllm")
    monkeypatch.setenv(f"JEX_ENGINE__{field.upper()}", str(NOT_DEFAULT[field]))
    gpus = {"machines": {"gpus_per_machine": 2}}  # one engine slot of tensor_parallel_size 2 spans two GPUs
    assert getattr(campaign_spec(load_settings(), gpus).engine, field) == NOT_DEFAULT[field]


def test_store_bootstrap_and_provider_settings_reach_the_spec(monkeypatch):
    for name, value in {"JEX_STORE__ROOT": "/data/runs", "JEX_BOOTSTRAP_DRAWS": "300", "JEX_BOOTSTRAP_SEED": "7",
                        "JEX_INFRA__PROVIDER": "inprocess"}.items():
        monkeypatch.setenv(name, value)
    spec = campaign_spec(load_settings())
    assert (spec.out, spec.store, spec.bootstrap_draws, spec.bootstrap_seed, spec.machines.provider) == (
        "/data/runs", "/data/runs/store", 300, 7, "inprocess")


def test_a_layer_beats_settings_and_tables_merge(monkeypatch):
    monkeypatch.setenv("JEX_ENGINE__BATCH_SIZE", "4")
    monkeypatch.setenv("JEX_ENGINE__DEVICE", "cuda")
    spec = campaign_spec(load_settings(), {"engine": {"batch_size": 2}}, {"out": "elsewhere"})
    assert (spec.engine.batch_size, spec.engine.device, spec.store) == (2, "cuda", str(Path("elsewhere/store")))


def test_the_ui_form_defaults_come_from_settings(monkeypatch):
    from jex.deployments.register import deployment_specs

    monkeypatch.setenv("JEX_ENGINE__BATCH_SIZE", "4")
    form = {d["name"]: d for d in deployment_specs(load_settings(), {"coverage": 0.2})}["campaign"]["parameters"]
    assert (form["spec"]["engine"]["batch_size"], form["spec"]["coverage"]) == (4, 0.2)


@pytest.mark.parametrize("variable", ["JEX_PREFECT__BUDGET_CRON", "JEX_PREFECT__CALIBRATION_CRON"])
def test_the_budget_cron_reaches_its_deployment_under_either_name(variable, monkeypatch):
    """The budget projection's schedule; JEX_PREFECT__CALIBRATION_CRON is its name from before the rename."""
    from jex.deployments.register import deployment_specs

    monkeypatch.setenv(variable, "15 4 * * *")
    assert {d["name"]: d for d in deployment_specs(load_settings())}["budget"]["cron"] == "15 4 * * *"


@pytest.fixture
def api_url():
    """The URL of something answering HTTP on 127.0.0.1 (all `connect_prefect` asks of a configured API)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()


def test_the_prefect_api_url_setting_reaches_the_prefect_client(monkeypatch, api_url):
    from jex.cli.common import connect_prefect

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"})
    monkeypatch.setenv("JEX_PREFECT__API_URL", api_url)
    connect_prefect(load_settings())
    assert os.environ["PREFECT_API_URL"] == api_url


def test_the_bootstrap_seed_is_written_once():
    """One constant in the core (jex.settings.BOOTSTRAP_SEED); every default seed refers to it."""
    from jex.tasks.scoring.bootstrap_ci import DEFAULT_SEED

    assert CampaignSpec().bootstrap_seed == DEFAULT_SEED == BOOTSTRAP_SEED
    rooms = ("jex", "engine", "tasks", "lab", "flows", "infra", "overlays", "deployments", "bench")
    hits = [str(p.relative_to(ROOT)) for room in rooms for p in (ROOT / room).rglob("*.py")
            if str(BOOTSTRAP_SEED) in p.read_text()]
    assert hits == ["jex/settings.py"]


def _connect_in_a_fresh_process(tmp_path: Path, **env: str):
    """`connect_prefect` in a new process whose Prefect has no profile, home or API of the test run's."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "JEX_"))}
    code = ("import os; from jex.cli.common import connect_prefect; from jex.settings import load_settings; "
            "connect_prefect(load_settings()); print(os.environ.get('PREFECT_API_URL', ''))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**base, "PREFECT_HOME": str(tmp_path / "prefect"),
                               "JEX_INFRA__STATE_DIR": str(tmp_path / "infra"), **env})


def test_with_no_server_configured_a_flow_says_in_one_line_that_it_uses_a_temporary_one(tmp_path):
    from jex.cli.common import TEMPORARY_API_NOTICE

    (tmp_path / "prefect").mkdir()
    (tmp_path / "prefect" / "prefect.db").touch()  # the temporary API's database as if made: nothing to migrate
    out = _connect_in_a_fresh_process(tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines() == [TEMPORARY_API_NOTICE] and out.stdout.strip() == ""


@pytest.mark.parametrize("variable", ["PREFECT_API_URL", "JEX_PREFECT__API_URL"])
def test_a_configured_server_takes_the_runs_and_no_temporary_one_is_announced(variable, tmp_path, api_url):
    out = _connect_in_a_fresh_process(tmp_path, **{variable: api_url})
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout.strip() == api_url


def test_a_new_prefect_home_gets_a_copy_of_the_migrated_database_template(tmp_path):
    """The temporary API's database is migrated once per machine and Prefect version (flows/local_api.py);
    each new PREFECT_HOME starts from a copy of it."""
    from jex.flows.local_api import migrated_template

    out = _connect_in_a_fresh_process(tmp_path)
    assert out.returncode == 0, out.stderr
    made = tmp_path / "prefect" / "prefect.db"
    assert made.read_bytes() == migrated_template().read_bytes()
    assert not list((tmp_path / "prefect").glob(".prefect.db.*"))  # no temporary copy left behind
