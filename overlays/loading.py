"""Loading an overlay rule file for the overlay stage (the rule kinds live in `overlays/`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jex.fileio import sha256_file


def load_rules(path: str | None) -> tuple[list[Any], str | None]:
    """The enabled rules of a TOML rule file, in declared order, and the file's sha256."""
    if not path:
        return [], None
    from jex.overlays import load_rule_file

    return [r for r in load_rule_file(Path(path)) if r.enabled], sha256_file(path)
