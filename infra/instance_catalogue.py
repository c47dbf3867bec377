"""The machines jex rents, priced: AWS EC2 GPU instance types with their GPUs and on-demand prices.

One file checked into the project, `instance_catalogue.toml` beside this module, is the one source of an
instance type's GPU kind, GPU count, GPU memory and on-demand USD/hour per region (with where and when
those were read). Nothing is downloaded at run time; `python -m jex.infra.refresh_instance_catalogue`
rebuilds the file from AWS (EC2's describe-instance-types and the Price List API) when a person runs it.

A machine's price (`machine_price`): the one set (a campaign's `machines.price_per_hour`, else
`JEX_INFRA__PRICE_PER_HOUR`), else its provider's: EC2's from this catalogue (an instance type or region
it does not price is refused in one line), 0 for the hosts of `local` and `ssh` and for `command` VMs,
whose price jex cannot know.
"""

from __future__ import annotations

import tomllib
from datetime import date
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, ValidationError

from jex.errors import InputError
from jex.record import Record

if TYPE_CHECKING:
    from jex.settings import InfraSettings

__all__ = ["CATALOGUE_FILE", "InstanceCatalogue", "InstanceType", "catalogue", "ec2_price", "gpus_of",
           "machine_price", "memory_preflight_gpu"]

CATALOGUE_FILE = Path(__file__).with_name("instance_catalogue.toml")
SET_A_PRICE = "set machines.price_per_hour (--spec) or JEX_INFRA__PRICE_PER_HOUR"


class InstanceType(Record):
    """One EC2 instance type: its GPUs (as EC2's describe-instance-types reports them) and its price."""

    gpu_kind: str = Field(description="The GPU as EC2 names it (GpuInfo.Gpus[].Name): H100, H200, A10G ...")
    gpus: int = Field(ge=1, description="GPUs per instance")
    gpu_memory_gib: float = Field(gt=0, description="Memory of one GPU, GiB (GpuInfo's MemoryInfo.SizeInMiB / 1024)")
    usd_per_hour: dict[str, float] = Field(description="On-demand Linux price of one instance, region -> USD/hour; "
                                                       "a region left out was not priced (or does not offer it)")


class InstanceCatalogue(Record):
    """`instance_catalogue.toml`: the instance types, and where and when their facts were read."""

    source: str = Field(description="Where the prices and GPU facts come from")
    read_on: date = Field(description="The day they were read (or entered)")
    entered_by_hand: bool = Field(description="True: typed in from AWS's published prices, not read from the API")
    note: str = ""
    instance_types: dict[str, InstanceType]

    def priced(self, instance_type: str, region: str) -> float:
        """USD/hour of one `instance_type` in `region`; an InputError naming what to do when not priced."""
        kind = self.instance_types.get(instance_type)
        if kind is None:
            raise InputError(f"EC2 instance type {instance_type!r} is not in the instance catalogue "
                             f"({CATALOGUE_FILE.name}, read {self.read_on}): {SET_A_PRICE}, or pick one of "
                             f"{', '.join(sorted(self.instance_types))}", field="JEX_INFRA__EC2_INSTANCE_TYPE")
        if region not in kind.usd_per_hour:
            raise InputError(f"EC2 instance type {instance_type} has no price for region {region} in the instance "
                             f"catalogue ({CATALOGUE_FILE.name}; priced in {', '.join(sorted(kind.usd_per_hour))}): "
                             f"{SET_A_PRICE}, or set JEX_INFRA__EC2_REGION", field="JEX_INFRA__EC2_REGION")
        return kind.usd_per_hour[region]


@cache
def catalogue(path: Path = CATALOGUE_FILE) -> InstanceCatalogue:
    """The catalogue file, validated (read once per process); a broken one is an InputError naming it."""
    try:
        return InstanceCatalogue.model_validate(tomllib.loads(path.read_text(encoding="utf-8")))
    except (OSError, tomllib.TOMLDecodeError, ValidationError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"the instance catalogue cannot be read ({first}): restore it from the project, or "
                         "rebuild it with `python -m jex.infra.refresh_instance_catalogue`", file=str(path)) from None


def ec2_price(instance_type: str, region: str) -> float:
    """USD/hour of one on-demand EC2 instance, from the catalogue (an InputError when it does not price it)."""
    return catalogue().priced(instance_type, region)


def machine_price(infra: InfraSettings, provider: str, explicit: float | None = None) -> float:
    """USD/hour of one machine of `provider` as the settings configure it: `explicit` (a campaign's own),
    else the settings' `price_per_hour`, else the catalogue's for EC2 and 0 for the other providers."""
    for price in (explicit, infra.price_per_hour):
        if price is not None:
            return price
    return ec2_price(infra.ec2_instance_type, infra.ec2_region) if provider == "ec2" else 0.0


def gpus_of(infra: InfraSettings, provider: str) -> int:
    """GPUs of one machine of `provider`: the catalogue's for the EC2 instance type, else 1."""
    kind = catalogue().instance_types.get(infra.ec2_instance_type) if provider == "ec2" else None
    return kind.gpus if kind is not None else 1


def memory_preflight_gpu(infra: InfraSettings, provider: str) -> tuple[str, dict[str, float]]:
    """The GPU kind the memory pre-flight sizes a model against (`jex/cli/preflight.py: model_fits`) and the
    kinds it may name (name -> GiB): `JEX_INFRA__GPU_KIND` when set, else the catalogue's GPU of the EC2
    instance type (its memory added to the kinds), else H200, the kind measured here (`engine/memory.py`)."""
    kind = catalogue().instance_types.get(infra.ec2_instance_type)
    if infra.gpu_kind is not None or provider != "ec2" or kind is None:
        return infra.gpu_kind or "H200", dict(infra.gpu_kinds)
    return kind.gpu_kind, {kind.gpu_kind: kind.gpu_memory_gib, **infra.gpu_kinds}
