"""The optional parts of jex (pyproject's extras) and the one line that names the extra a missing one needs."""

from __future__ import annotations

from importlib import import_module
from importlib.util import find_spec
from types import ModuleType

from jex.errors import InputError

LOCAL_ENGINE_MODULES = ("torch", "transformers")
"""What an engine on this machine needs (the `cpu` extra: the embedded model, the HF engine)."""


def needs_extra(module: str, extra: str) -> ModuleType:
    """`module`, or one line naming the extra that installs it."""
    try:
        return import_module(module)
    except ImportError:
        raise InputError(f"{module} is not installed: pip install 'jex[{extra}]'") from None


def check_extra(module: str, extra: str, *, why: str = "") -> None:
    """One line naming the extra that installs `module` when it is not installed (without importing it)."""
    if find_spec(module.split(".")[0]) is None:
        raise InputError(f"{module} is not installed{why}: pip install 'jex[{extra}]'")
