"""Rebuild the instance catalogue (`instance_catalogue.toml`) from AWS; run by a person, never at run time.

    python -m jex.infra.refresh_instance_catalogue [--families p5,g6e] [--regions us-east-1,eu-west-1] [-o FILE]

The GPU facts of every size of each family come from EC2's `describe_instance_types` (GpuInfo), the on-demand
Linux price of each in each region from the AWS Price List API (`pricing` client, `get_products`, ServiceCode
AmazonEC2: shared tenancy, no pre-installed software, capacity status Used). Needs AWS credentials that may
call both (the usual boto3 chain: environment, profile, instance role).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import date
from pathlib import Path
from typing import Any

from jex.fileio import write_toml
from jex.infra.instance_catalogue import CATALOGUE_FILE, InstanceCatalogue, InstanceType

FAMILIES = ("p4d", "p4de", "p5", "p5e", "p5en", "p6-b200", "g5", "g6", "g6e")
REGIONS = ("us-east-1", "us-west-2", "eu-west-1")
PRICE_LIST_REGION = "us-east-1"
"""One of the regions that serve the Price List API (its prices cover every region)."""
SOURCE = ("AWS Price List API (pricing.get_products, ServiceCode AmazonEC2, on-demand Linux, shared tenancy) and "
          "EC2 describe-instance-types (GpuInfo)")
HEADER = ("The AWS EC2 GPU instance types jex rents: GPUs and on-demand USD/hour per region (read by\n"
          "infra/instance_catalogue.py at run time, never downloaded then). Rebuilt by a person with\n"
          "`python -m jex.infra.refresh_instance_catalogue`.")


def gpu_facts(ec2: Any, families: Sequence[str]) -> dict[str, tuple[str, int, float]]:
    """instance type -> (GPU kind, GPUs, GiB per GPU) of every size of `families` that has GPUs."""
    pages = ec2.get_paginator("describe_instance_types").paginate(
        Filters=[{"Name": "instance-type", "Values": [f"{family}.*" for family in families]}])
    out = {}
    for page in pages:
        for it in page["InstanceTypes"]:
            gpus = (it.get("GpuInfo") or {}).get("Gpus") or []
            if gpus:
                out[it["InstanceType"]] = (gpus[0]["Name"], sum(g["Count"] for g in gpus),
                                           round(gpus[0]["MemoryInfo"]["SizeInMiB"] / 1024, 2))
    return out


def price_filters(region: str, instance_types: Iterable[str]) -> list[dict[str, str]]:
    """The Price List filters of one region's on-demand Linux prices of `instance_types`."""
    terms = {"regionCode": region, "operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
             "capacitystatus": "Used", "licenseModel": "No License required"}
    return [*({"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in terms.items()),
            {"Type": "ANY_OF", "Field": "instanceType", "Value": ",".join(sorted(instance_types))}]


def on_demand_price(price_list_item: str | dict[str, Any]) -> tuple[str, str, float] | None:
    """(instance type, region, USD/hour) of one `get_products` PriceList entry (a JSON document, format
    aws_v1, as text or parsed); None when it holds no hourly on-demand USD price."""
    doc = json.loads(price_list_item) if isinstance(price_list_item, str) else price_list_item
    attributes = doc["product"]["attributes"]
    for term in doc.get("terms", {}).get("OnDemand", {}).values():
        for dimension in term["priceDimensions"].values():
            usd = dimension.get("pricePerUnit", {}).get("USD")
            if dimension.get("unit") == "Hrs" and usd is not None and float(usd) > 0:
                return attributes["instanceType"], attributes["regionCode"], float(usd)
    return None


def prices(pricing: Any, instance_types: Iterable[str], regions: Sequence[str]) -> dict[str, dict[str, float]]:
    """instance type -> region -> on-demand USD/hour, as the Price List API answers."""
    types = sorted(instance_types)
    out: dict[str, dict[str, float]] = {}
    for region in regions:
        pages = pricing.get_paginator("get_products").paginate(
            ServiceCode="AmazonEC2", FormatVersion="aws_v1", Filters=price_filters(region, types))
        for page in pages:
            for item in page["PriceList"]:
                if (found := on_demand_price(item)) is not None:
                    instance_type, where, usd = found
                    out.setdefault(instance_type, {})[where] = usd
    return out


def refresh(ec2: Mapping[str, Any], pricing: Any, *, families: Sequence[str] = FAMILIES,
            regions: Sequence[str] = REGIONS, today: date | None = None) -> InstanceCatalogue:
    """The catalogue as AWS describes and prices it today, from an EC2 client per region (each lists the
    types its region offers) and a Price List client; a type priced in no region is left out."""
    facts = {name: gpus for client in ec2.values() for name, gpus in gpu_facts(client, families).items()}
    priced = prices(pricing, facts, regions)
    types = {name: InstanceType(gpu_kind=kind, gpus=n, gpu_memory_gib=gib,
                                usd_per_hour=dict(sorted(priced[name].items())))
             for name, (kind, n, gib) in sorted(facts.items()) if priced.get(name)}
    return InstanceCatalogue(source=SOURCE, read_on=today or date.today(), entered_by_hand=False,
                             note=f"regions read: {', '.join(regions)}", instance_types=types)


def write_catalogue(path: Path, doc: InstanceCatalogue) -> None:
    """The catalogue as TOML (read back by `jex.infra.instance_catalogue.catalogue`)."""
    write_toml(path, doc.model_dump(), comment=HEADER)


def main(argv: Sequence[str] | None = None) -> None:
    import boto3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="instance families, comma-separated")
    parser.add_argument("--regions", default=",".join(REGIONS), help="regions, comma-separated")
    parser.add_argument("-o", "--out", type=Path, default=CATALOGUE_FILE, help="the catalogue file to write")
    args = parser.parse_args(argv)
    regions = args.regions.split(",")
    doc = refresh({region: boto3.client("ec2", region_name=region) for region in regions},
                  boto3.client("pricing", region_name=PRICE_LIST_REGION), families=args.families.split(","),
                  regions=regions)
    write_catalogue(args.out, doc)
    print(f"{len(doc.instance_types)} instance types priced in {', '.join(regions)}: {args.out}")


if __name__ == "__main__":
    main()
