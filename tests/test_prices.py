"""Prices from the machine: the instance catalogue is the one source of an EC2 type's GPUs and price, the
image is looked up by name, a local machine costs nothing unless priced, and a campaign whose projected
machine-hours cost more than its budget is refused before any machine starts. A served model's tokens and their
cost are in the same cost ledger, once per campaign and served engine.

EC2 calls go to moto's server (`s3_server`). moto does not implement the AWS Price List API (`pricing`):
the refresh script's price half is fed a recorded `get_products` answer, shaped as AWS documents it,
through botocore's Stubber, which checks the request against the API's own model.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import date

import boto3
import pytest
from typer.testing import CliRunner

from jex.errors import InputError
from jex.infra.cost_ledger import BudgetExceeded, CostLedger, ServedLedgerEntry
from jex.infra.instance_catalogue import catalogue, machine_price
from jex.infra.machine import MachineSession, Policy, priced
from jex.infra.providers import EC2Provider, LocalProvider
from jex.settings import InfraSettings

REQUIRED_FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "g5", "g6", "g6e")
P5_ON_DEMAND = {  # one PriceList entry of `pricing.get_products` (FormatVersion aws_v1), trimmed
    "product": {"productFamily": "Compute Instance", "sku": "7W6KGXWCCTB4BNSV",
                "attributes": {"instanceType": "p5.48xlarge", "regionCode": "us-east-1", "operatingSystem": "Linux",
                               "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used", "gpu": "8",
                               "location": "US East (N. Virginia)", "servicecode": "AmazonEC2"}},
    "serviceCode": "AmazonEC2",
    "terms": {"OnDemand": {"7W6KGXWCCTB4BNSV.JRTCKXETXF": {
        "offerTermCode": "JRTCKXETXF", "sku": "7W6KGXWCCTB4BNSV", "effectiveDate": "2025-06-01T00:00:00Z",
        "termAttributes": {}, "priceDimensions": {"7W6KGXWCCTB4BNSV.JRTCKXETXF.6YS6EN2CT7": {
            "unit": "Hrs", "endRange": "Inf", "beginRange": "0", "appliesTo": [],
            "rateCode": "7W6KGXWCCTB4BNSV.JRTCKXETXF.6YS6EN2CT7",
            "description": "$55.04 per On Demand Linux p5.48xlarge Instance Hour",
            "pricePerUnit": {"USD": "55.0400000000"}}}}},
        "Reserved": {"7W6KGXWCCTB4BNSV.4NA7Y494T4": {"priceDimensions": {"x": {
            "unit": "Quantity", "pricePerUnit": {"USD": "250000"}, "description": "Upfront Fee"}}}}},
    "version": "20251201000000", "publicationDate": "2025-12-01T00:00:00Z"}


def ec2_client(endpoint: str = "http://127.0.0.1:9"):
    """An EC2 client of us-east-1 (a test that makes no call points it nowhere)."""
    return boto3.client("ec2", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                        aws_secret_access_key="test")


def test_the_catalogue_holds_each_gpu_family_with_its_gpus_its_prices_and_where_they_come_from():
    doc = catalogue()
    assert doc.source and doc.read_on and doc.entered_by_hand  # typed in, until the refresh script runs
    families = {name.split(".")[0] for name in doc.instance_types}
    assert set(REQUIRED_FAMILIES) <= families
    assert {"us-east-1", "us-west-2", "eu-west-1"} <= {r for t in doc.instance_types.values() for r in t.usd_per_hour}
    p5 = doc.instance_types["p5.48xlarge"]
    assert (p5.gpu_kind, p5.gpus, p5.gpu_memory_gib) == ("H100", 8, 80.0) and p5.usd_per_hour["us-east-1"] > 20


def test_an_ec2_machine_is_billed_at_its_catalogue_price_unless_one_is_set():
    provider = EC2Provider(ec2_client(), instance_type="p5.48xlarge")
    listed = catalogue().instance_types["p5.48xlarge"].usd_per_hour["us-east-1"]
    assert priced(Policy(), provider).price_per_hour == listed
    assert priced(Policy(price_per_hour=12.5), provider).price_per_hour == 12.5
    assert priced(Policy(budget_usd=listed), provider).machine_ttl_s() == 3600  # the TTL buys one hour, not 16
    assert machine_price(InfraSettings(), "ec2") == listed


def test_the_memory_preflight_sizes_a_model_against_the_gpu_of_the_instance_type():
    from jex.infra.instance_catalogue import memory_preflight_gpu

    assert memory_preflight_gpu(InfraSettings(ec2_instance_type="g6e.xlarge"), "ec2") == ("L40S", {"L40S": 44.7})
    assert memory_preflight_gpu(InfraSettings(gpu_kind="H200"), "ec2") == ("H200", {})  # set: it wins
    assert memory_preflight_gpu(InfraSettings(), "local") == ("H200", {})  # the kind measured here


def test_an_unknown_instance_type_without_a_price_is_refused_in_one_line_before_any_machine():
    provider = EC2Provider(ec2_client(), instance_type="p9.huge")  # the endpoint answers nothing: no call is made
    with pytest.raises(InputError) as e:
        MachineSession(provider, campaign="c1", ledger=CostLedger("/nonexistent/ledger.json"))
    assert "'p9.huge' is not in the instance catalogue" in str(e.value) and "\n" not in str(e.value)
    assert "JEX_INFRA__PRICE_PER_HOUR" in str(e.value)
    assert priced(Policy(price_per_hour=3.0), provider).price_per_hour == 3.0  # a price of its own: accepted


def test_a_local_machine_costs_nothing_unless_priced_and_the_ledger_shows_each_machines_price(tmp_path, monkeypatch):
    from jex.cli import app

    assert priced(Policy(), LocalProvider(tmp_path / "machines")).price_per_hour == 0.0
    assert machine_price(InfraSettings(), "local") == 0.0
    assert machine_price(InfraSettings(price_per_hour=2), "local") == 2
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.open("m-local", "c1", "local", 0.0, created_at=0.0)
    ledger.open("m-p5", "c1", "ec2", 55.04, created_at=0.0)
    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "state"))
    out = CliRunner().invoke(app, ["infra", "ledger"]).output
    assert "local" in out and "at $0/h" in out and "at $55.04/h" in out


def journal_entry(campaign: str = "c1", *, requests: int = 10, cost_usd: float | None = 0.25) -> ServedLedgerEntry:
    """An answer journal's usage recorded by `campaign`: 10 requests, 4,000 + 1,000 tokens, at $50 / $50 per
    million (every call: the same journal)."""
    price = None if cost_usd is None else 50.0
    return ServedLedgerEntry(served_id="journal-0123456789abcdef", campaign=campaign, journal="/store/generate/k",
                             endpoint="http://127.0.0.1:8000", model="smollm2", requests=requests,
                             prompt_tokens=400 * requests, completion_tokens=100 * requests,
                             price_input_per_mtok=price, price_output_per_mtok=price, cost_usd=cost_usd,
                             recorded_at=time.time())


def test_a_served_models_tokens_and_cost_are_in_the_ledger_beside_the_machines(tmp_path, monkeypatch):
    from jex.cli import app

    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.open("m-p5", "c1", "ec2", 36.0, created_at=1.0)
    ledger.close("m-p5", "done", at=101.0)  # $1
    ledger.record_served(journal_entry())
    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "state"))
    out = CliRunner().invoke(app, ["infra", "ledger", "--campaign", "c1"]).output
    (line,) = [x for x in out.splitlines() if x.startswith("journal-")]
    assert "10 requests, 4000 prompt + 1000 completion tokens" in line and "$   0.2500" in line
    assert "total $1.2500 over 100 machine-seconds and 5000 served tokens" in out
    assert ledger.total("c1") == pytest.approx(1.25) and [e.cost_usd for e in ledger.usage("c1").served] == [0.25]


def test_recording_a_served_models_usage_again_replaces_it_and_never_adds_it(tmp_path):
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_served(journal_entry())
    written = ledger.path.read_bytes()
    ledger.record_served(journal_entry())  # a resumed campaign that sent no request: the same cumulative usage
    assert ledger.path.read_bytes() == written and ledger.total("c1") == pytest.approx(0.25)
    ledger.record_served(journal_entry(requests=12, cost_usd=0.30))  # two requests more: the new total
    assert [e.requests for e in ledger.served("c1")] == [12] and ledger.total("c1") == pytest.approx(0.30)


def test_a_stored_journal_read_by_another_campaign_stays_charged_to_the_one_that_sent_it(tmp_path):
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_served(journal_entry("c1"))
    ledger.record_served(journal_entry("c2"))  # another campaign on the same stored stage: it sent nothing
    ledger.record_served(journal_entry("c2", requests=12, cost_usd=0.30))  # or resumed it: the journal grew
    assert ledger.total("c2") == 0.0 and ledger.total(None) == ledger.total("c1") == pytest.approx(0.30)


def test_a_served_models_recorded_usage_never_goes_down(tmp_path):
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_served(journal_entry(requests=12, cost_usd=0.30))
    ledger.record_served(journal_entry(requests=10, cost_usd=0.25))  # a retried stage's folder carried fewer answers
    assert [e.requests for e in ledger.served("c1")] == [12] and ledger.total("c1") == pytest.approx(0.30)


def test_an_unpriced_served_model_records_its_tokens_and_no_cost(tmp_path, monkeypatch):
    from jex.cli import app

    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_served(journal_entry(cost_usd=None))
    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "state"))
    out = CliRunner().invoke(app, ["infra", "ledger"]).output
    assert "4000 prompt + 1000 completion tokens no price set" in out and "total $0.0000" in out
    assert ledger.total("c1") == 0.0 and ledger.served()[0].cost_usd is None


def test_the_budget_guard_counts_a_served_models_cost(tmp_path):
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_served(journal_entry(cost_usd=0.25))
    ledger.guard("c1", 0.30)
    with pytest.raises(BudgetExceeded, match=r"campaign c1: \$0.2500 spent of a \$0.2000 budget"):
        ledger.guard("c1", 0.20)
    ledger.guard("c2", 0.20)  # another campaign's budget is its own


def test_a_ledger_of_machines_alone_is_written_and_read_as_before(tmp_path):
    path = tmp_path / "state" / "ledger.json"
    path.parent.mkdir()
    entry = {"machine_id": "m0", "campaign": "c1", "provider": "local", "price_per_hour": 0.0, "created_at": 0.0,
             "deleted_at": None, "end_reason": None, "host": None}
    path.write_text(json.dumps({"machines": {"m0": entry}}))  # written before served models were recorded
    ledger = CostLedger(path)
    assert ledger.served() == [] and ledger.usage("c1").served == []
    ledger.close("m0", "done", at=10.0)
    assert set(json.loads(path.read_text())) == {"machines"}


def test_jex_runs_lists_the_prices_a_campaigns_machines_were_billed_at():
    from jex.flows.history import RunRow, format_runs

    row = RunRow(flow_run="brisk-otter", id="1", state="Completed", start=None, cost_usd=1.5,
                 prices_per_hour=[0.0, 55.04])
    head, _, line = format_runs([row]).splitlines()
    assert "$/hour" in head and line.split()[6:8] == ["1.5000", "0/55.04"]  # after the cost


def test_with_no_image_id_the_newest_image_named_like_the_pattern_is_used(s3_server):
    ec2 = ec2_client(s3_server)
    name = f"jex-test-dlami-{uuid.uuid4().hex[:6]}"
    ec2.register_image(Name=f"{name} 20250101")
    newest = ec2.register_image(Name=f"{name} 20260101")["ImageId"]
    provider = EC2Provider(ec2, instance_type="g6.xlarge", image_name=f"{name} *", image_owner="self")
    machine = provider.create("camp-image")
    (instance,) = ec2.describe_instances(InstanceIds=[machine.id])["Reservations"][0]["Instances"]
    assert instance["ImageId"] == newest
    provider.delete(machine.id)
    nothing = EC2Provider(ec2, instance_type="g6.xlarge", image_name=f"{name}-none *", image_owner="self")
    with pytest.raises(InputError, match="no EC2 image named like .* set JEX_INFRA__EC2_IMAGE_ID"):
        nothing.create("camp-image")


def test_the_refresh_script_rebuilds_the_catalogue_from_ec2_and_the_price_list(s3_server, tmp_path):
    from botocore.stub import Stubber

    from jex.infra.refresh_instance_catalogue import price_filters, refresh, write_catalogue

    pricing = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="test",
                           aws_secret_access_key="test")
    with Stubber(pricing) as stub:  # p5.4xlarge left unpriced in the recorded answer: left out
        stub.add_response("get_products", {"FormatVersion": "aws_v1", "PriceList": [json.dumps(P5_ON_DEMAND)]},
                          {"ServiceCode": "AmazonEC2", "FormatVersion": "aws_v1",
                           "Filters": price_filters("us-east-1", ["p5.48xlarge", "p5.4xlarge"])})
        doc = refresh({"us-east-1": ec2_client(s3_server)}, pricing, families=("p5",), regions=("us-east-1",),
                      today=date(2026, 12, 7))
    assert {k: v.model_dump() for k, v in doc.instance_types.items()} == {"p5.48xlarge": {
        "gpu_kind": "H100", "gpus": 8, "gpu_memory_gib": 80.0, "usd_per_hour": {"us-east-1": 55.04}}}
    assert not doc.entered_by_hand and "Price List API" in doc.source
    write_catalogue(tmp_path / "catalogue.toml", doc)
    assert catalogue(tmp_path / "catalogue.toml") == doc  # read back through its record


def test_a_campaign_whose_projected_machine_hours_cost_more_than_its_budget_is_refused_before_any_machine(tmp_path):
    """The budget projection measured 2 s per row over 18,000 rows (10 machine-hours): at $10 an hour that is
    $100, over a $50 budget, so its first machine is refused; at $4 an hour it would start."""
    from jex.flows.budget import BudgetRun, Measured, Projection, projected_spend
    from jex.tasks.campaign_spec import BudgetSpec, CampaignSpec

    campaign = CampaignSpec(coverage=0.5, out=str(tmp_path / "runs"))
    measured = Measured(sample_rows=90, gated=45, fast_s_per_row=1.0, reason_s_per_row=2.0, fix_rate=None, fixed=0,
                        flipped=0)
    doc = BudgetRun(spec=BudgetSpec(campaign=campaign), measured=measured, projection_rows=18_000,
                    projection=Projection(table=[], recommended_coverage=None))
    projected = projected_spend(doc, source=tmp_path / "budget.json")
    assert projected.machine_hours == pytest.approx(10.0) and projected.campaign == campaign.run_dir().name
    ledger = CostLedger(tmp_path / "state" / "ledger.json")
    ledger.record_projection(projected)
    provider = LocalProvider(tmp_path / "machines")
    session = MachineSession(provider, campaign=projected.campaign, ledger=ledger,
                             policy=Policy(budget_usd=50.0, price_per_hour=10.0))
    with pytest.raises(BudgetExceeded, match=r"10.0 machine-hours .* \$100.00 at \$10/hour, over its \$50 budget"):
        session.start()
    assert provider.list_machines() == [] and ledger.entries() == []
    ledger.guard(projected.campaign, 50.0, price_per_hour=4.0)  # $40: within the budget


def test_the_budget_projection_prices_a_gpu_hour_from_the_catalogue():
    from jex.flows.budget import gpu_hour_price
    from jex.tasks.campaign_spec import BudgetSpec, CampaignSpec, MachinesSpec

    infra = InfraSettings(ec2_instance_type="g6e.12xlarge", ec2_region="us-west-2")
    on_ec2 = BudgetSpec(campaign=CampaignSpec(machines=MachinesSpec(provider="ec2")))
    kind = catalogue().instance_types["g6e.12xlarge"]
    assert gpu_hour_price(on_ec2, infra) == pytest.approx(kind.usd_per_hour["us-west-2"] / kind.gpus)
    assert gpu_hour_price(BudgetSpec(), infra) == 0.0  # the local default: a host you have
    assert gpu_hour_price(on_ec2.model_copy(update={"price_per_gpu_hour": 1.5}), infra) == 1.5
