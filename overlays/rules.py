"""Overlay rule kinds: decision corrections on a frozen capture.

A rule changes emitted choices of its target catalog only; probabilities are read, never written.
Each kind is registered by name, and its parameters serialise into `record()` so a report says
exactly what was applied. Frames given to `decide` hold one catalog's rows with `run_id`,
`question_id`, `choice` and `probs` (per-option probabilities, renormalised over the options); fitted
kinds also read `gold`, and only out-of-fold.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import polars as pl

ProjectionClass = Literal["positional-construction-reuse", "fitted-on-public-oof"]
RULE_KINDS: dict[str, type[OverlayRuleBase]] = {}


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1 - 1e-16)
    return np.log(p) - np.log1p(-p)


def _probs(frame: pl.DataFrame, index: int) -> np.ndarray:
    return np.array([ps[index] if ps is not None and index < len(ps) else np.nan for ps in frame["probs"].to_list()])


@dataclass(frozen=True)
class OverlayRuleBase:
    id: str
    target: str
    projection_class: ProjectionClass
    enabled: bool = True
    kind: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        RULE_KINDS[cls.kind] = cls

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        """New choices for `frame`, which holds only this rule's target catalog."""
        raise NotImplementedError

    def apply(self, frame: pl.DataFrame) -> pl.Series:
        """Choices for every row of `frame`: the target catalog's decided anew, all others as they were."""
        target = (frame["catalog"] == self.target).to_numpy()
        choices = frame["choice"].to_numpy().copy()
        if target.any():
            choices[target] = self.decide(frame.filter(pl.Series(target))).to_numpy()
        return pl.Series("choice", choices, dtype=pl.Int32)

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class PositionalThreshold(OverlayRuleBase):
    """Emit the option at `label_index` when logit(p[label]) >= tau; otherwise keep the choice."""

    label_index: int = 0
    tau: float = 0.0
    kind: ClassVar[str] = "positional-threshold"

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        fire = logit(_probs(frame, self.label_index)) >= self.tau  # NaN (no readout) never fires
        return pl.Series("choice", np.where(fire, self.label_index, frame["choice"].to_numpy()), dtype=pl.Int32)

    def describe(self) -> str:
        return f"emit option {self.label_index} if logit(p[{self.label_index}]) >= {self.tau:g}"


@dataclass(frozen=True)
class SignedLogitThreshold(OverlayRuleBase):
    """On one option (by index): `above` emits it when logit(p) >= tau; `below` emits the best other
    option when logit(p) < tau (e.g. 'Entailment at tau = -8')."""

    option_index: int = 0
    tau: float = 0.0
    direction: Literal["above", "below"] = "above"
    kind: ClassVar[str] = "signed-logit-threshold"

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        z = logit(_probs(frame, self.option_index))
        choices = frame["choice"].to_numpy().copy()
        if self.direction == "above":
            choices = np.where(z >= self.tau, self.option_index, choices)
        else:
            for i, ps in enumerate(frame["probs"].to_list()):
                if ps is not None and z[i] < self.tau:
                    others = [k for k in range(len(ps)) if k != self.option_index]
                    choices[i] = max(others, key=lambda k: (ps[k], -k))
        return pl.Series("choice", choices, dtype=pl.Int32)

    def describe(self) -> str:
        verb = "emit it" if self.direction == "above" else "emit the best other option"
        cmp = ">=" if self.direction == "above" else "<"
        return f"option {self.option_index}: {verb} if logit(p) {cmp} {self.tau:g}"


def isotonic_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: a non-decreasing step function of x fitted to y (least squares)."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order].astype(float)
    values, weights, right = [], [], []
    for xi, yi in zip(xs, ys, strict=True):
        values.append(yi)
        weights.append(1.0)
        right.append(xi)
        while len(values) > 1 and values[-2] > values[-1]:
            w = weights[-2] + weights[-1]
            v = (values[-2] * weights[-2] + values[-1] * weights[-1]) / w
            values[-2:], weights[-2:], right[-2:] = [v], [w], [right[-1]]
    return np.array(right), np.array(values)


def isotonic_apply(fit: tuple[np.ndarray, np.ndarray], x: np.ndarray) -> np.ndarray:
    right, values = fit
    idx = np.clip(np.searchsorted(right, x, side="left"), 0, len(values) - 1)
    return values[idx]


@dataclass(frozen=True)
class IsotonicShrink(OverlayRuleBase):
    """Binary decision on option `positive_index`: q = shrink * iso(p) + (1 - shrink) * p, with iso
    fitted out-of-fold (folds by question); emit the positive option when q >= 0.5, else the other."""

    positive_index: int = 0
    shrink: float = 0.75
    folds: int = 10
    kind: ClassVar[str] = "isotonic-shrink"

    def calibrated(self, frame: pl.DataFrame) -> np.ndarray:
        p = _probs(frame, self.positive_index)
        y = (frame["gold"].to_numpy() == self.positive_index).astype(float)
        fold = np.array([zlib.crc32(q.encode()) % self.folds for q in frame["question_id"].to_list()])
        q = p.copy()
        for k in range(self.folds):
            test, train = fold == k, (fold != k) & ~np.isnan(p)
            if test.any() and train.sum() >= 2:
                q[test] = self.shrink * isotonic_apply(isotonic_fit(p[train], y[train]), p[test]) + \
                    (1 - self.shrink) * p[test]
        return q

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        q = self.calibrated(frame)
        other = 1 - self.positive_index
        choices = np.where(np.isnan(q), frame["choice"].to_numpy(), np.where(q >= 0.5, self.positive_index, other))
        return pl.Series("choice", choices, dtype=pl.Int32)

    def describe(self) -> str:
        return (f"isotonic-shrink on option {self.positive_index} (lambda = {self.shrink:g}, {self.folds} folds, "
                "out-of-fold), threshold 0.5")


def rule_from_dict(d: dict[str, Any]) -> OverlayRuleBase:
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in RULE_KINDS:
        raise ValueError(f"rule {d.get('id')!r}: unknown kind {kind!r}; known: {sorted(RULE_KINDS)}")
    return RULE_KINDS[kind](**d)
