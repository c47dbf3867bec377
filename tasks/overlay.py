"""The overlay stage's interface: decision rules laid on a frozen capture.

An overlay changes emitted choices only; probabilities and the capture are never rewritten. The rule
kinds, their gate and the ladder live in `overlays/`; this stage applies an ordered list of rules
(none by default) and records which stage decided each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import polars as pl


class OverlayRule(Protocol):
    id: str
    target: str

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        """New choices for the rows of `frame` (its target catalog's rows only)."""
        ...

    def record(self) -> dict[str, Any]:
        ...


def apply_overlays(frame: pl.DataFrame, rules: Sequence[OverlayRule]) -> tuple[pl.DataFrame, list[dict[str, Any]]]:
    """`frame`: run_id, catalog, choice, stage, calibrated_logprobs. Returns the new frame and a record."""
    applied = []
    for rule in rules:
        target = frame["catalog"] == rule.target
        new = rule.decide(frame.filter(target))
        old = frame.filter(target)["choice"]
        changed = int((new != old).fill_null(True).sum())
        choices = frame["choice"].to_list()
        stages = frame["stage"].to_list()
        idx = [i for i, t in enumerate(target.to_list()) if t]
        for j, i in enumerate(idx):
            if new[j] != choices[i]:
                choices[i], stages[i] = new[j], f"overlay:{rule.id}"
        frame = frame.with_columns(pl.Series("choice", choices, dtype=pl.Int32), pl.Series("stage", stages))
        applied.append({**rule.record(), "changed": changed})
    return frame, applied
