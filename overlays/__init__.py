"""Decision rules laid on a frozen capture (no engine, no I/O beyond reading a rule file).

A rule file is TOML with one `[[rules]]` table per rule, applied in declared order:

    [[rules]]
    id = "R-sorted"
    kind = "positional-threshold"        # or signed-logit-threshold, isotonic-shrink, abstain-below
    target = "sorted_max"
    projection_class = "positional-construction-reuse"   # or fitted-on-public-oof
    enabled = true
    label_index = 3
    tau = -2.0
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from jex.errors import InputError
from jex.overlays.rules import (
    RULE_KINDS,
    AbstainBelow,
    IsotonicShrink,
    OverlayRuleBase,
    PositionalThreshold,
    SignedLogitThreshold,
    rule_from_dict,
)

__all__ = ["RULE_KINDS", "AbstainBelow", "IsotonicShrink", "OverlayRuleBase", "PositionalThreshold",
           "SignedLogitThreshold", "load_rule_file", "rule_from_dict"]


def load_rule_file(path: str | Path) -> list[OverlayRuleBase]:
    """Every rule of a rule file, in declared order; errors name the file, the rule and the field."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InputError(f"cannot read overlay rules: {e}", file=str(path)) from None
    rules, seen = [], set()
    for i, raw in enumerate(_rule_tables(doc, path)):
        try:
            rule = rule_from_dict(raw)
        except (TypeError, ValueError) as e:
            raise InputError(f"rule {i} ({raw.get('id')!r}): {e}", file=str(path), row=i, field="kind") from None
        if rule.id in seen:
            raise InputError(f"duplicate rule id {rule.id!r}", file=str(path), row=i, field="id")
        if rule.projection_class not in ("positional-construction-reuse", "fitted-on-public-oof"):
            raise InputError(f"unknown projection_class {rule.projection_class!r}", file=str(path), row=i,
                             field="projection_class")
        seen.add(rule.id)
        rules.append(rule)
    return rules


def _rule_tables(doc: dict[str, object], path: Path) -> list[dict[str, object]]:
    """The file's `[[rules]]` tables; any other top-level key (say `[[rule]]`, a typo that would load
    no rule at all) or a `rules` that is not a list of tables is refused."""
    unknown = sorted(set(doc) - {"rules"})
    if unknown:
        raise InputError(f"unknown top-level key {unknown[0]!r}; a rule file holds only [[rules]] tables",
                         file=str(path), field=unknown[0])
    tables = doc.get("rules", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise InputError("expected [[rules]] tables (id, kind, target, ...)", file=str(path), field="rules")
    return tables
