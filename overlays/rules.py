"""Overlay rule kinds: decision corrections on a frozen capture.

A rule changes emitted choices of its target catalog only (or, for `abstain-below`, the secondary
`abstain` flag a catalog may declare); probabilities are read, never written.
Each kind is registered by name, and its parameters serialise into `record()` so a report says
exactly what was applied. Frames given to `decide` hold one catalog's rows with `run_id`,
`question_id`, `choice` and `probs` (per-option probabilities, renormalised over the options); fitted
kinds also read `gold`, and only out-of-fold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar, Literal

import numpy as np
import polars as pl

from jex.numerics import logit, question_folds

ProjectionClass = Literal["positional-construction-reuse", "fitted-on-public-oof"]
RULE_KINDS: dict[str, type[OverlayRuleBase]] = {}


def _probs(frame: pl.DataFrame, index: int) -> np.ndarray:
    return np.array([ps[index] if ps is not None and index < len(ps) else np.nan for ps in frame["probs"].to_list()])


@dataclass(frozen=True)
class OverlayRuleBase:
    id: str
    target: str
    projection_class: ProjectionClass
    enabled: bool = True
    kind: ClassVar[str] = ""
    sets: ClassVar[Literal["choice", "abstain"]] = "choice"
    """The prediction column the rule writes: the choice, or the secondary `abstain` flag."""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        RULE_KINDS[cls.kind] = cls

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        """New choices for `frame`, which holds only this rule's target catalog."""
        raise NotImplementedError

    fits_out_of_fold: ClassVar[bool] = False
    """True when `decide` already fits out-of-fold on the frame it is given (no refit needed)."""

    def fit(self, frame: pl.DataFrame) -> OverlayRuleBase:
        """This rule with its threshold refitted on `frame` (target rows with `gold`); kinds with no
        fitted parameter return themselves. The overlay lab's pre-registered test refits per fold and
        scores the held-out fold."""
        return self

    def apply(self, frame: pl.DataFrame) -> pl.Series:
        """The column this rule sets (`sets`: choices, or abstain flags) for every row of `frame`: the
        target catalog's decided anew, all others as they were (`frame` holds the column)."""
        target = (frame["catalog"] == self.target).to_numpy()
        values = frame[self.sets].to_numpy().copy()
        if target.any():
            values[target] = self.decide(frame.filter(pl.Series(target))).to_numpy()
        return pl.Series(self.sets, values, dtype=pl.Int32 if self.sets == "choice" else pl.Boolean)

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}

    def sha256(self) -> str:
        """The rule's hash: its kind and parameters (not its `enabled` flag). A gate record names the rule
        by it, and a campaign applies the rule only with a passed gate record of this hash."""
        from jex.fileio import sha256_json

        return sha256_json({k: v for k, v in self.record().items() if k != "enabled"})

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

    def fit(self, frame: pl.DataFrame) -> PositionalThreshold:
        return best_tau(self, frame, _probs(frame, self.label_index))


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

    def fit(self, frame: pl.DataFrame) -> SignedLogitThreshold:
        return best_tau(self, frame, _probs(frame, self.option_index))


TAU_GRID = 41


def best_tau(rule: Any, frame: pl.DataFrame, p: np.ndarray) -> Any:
    """`rule` with the tau that maximises accuracy on `frame`: the declared tau first, then the
    logits of p at 41 quantiles; the first best wins (so a tie keeps the declared tau)."""
    z = logit(p[~np.isnan(p)])
    grid = [rule.tau] + (np.unique(np.quantile(z, np.linspace(0, 1, TAU_GRID))).tolist() if z.size else [])
    gold = frame["gold"].to_numpy()
    accs = [float((replace(rule, tau=float(t)).decide(frame).to_numpy() == gold).mean()) for t in grid]
    return replace(rule, tau=float(grid[int(np.argmax(accs))]))


def isotonic_fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: a non-decreasing step function of x fitted to y (least squares).

    Rows with the same x are pooled first into one block (their mean y, weighted by their count), so
    the fit depends only on the data, never on the order of tied rows (Barlow et al., 1972, the
    "primary approach" to ties). Returns each block's right end and value.
    """
    x, y = np.asarray(x, dtype=float).ravel(), np.asarray(y, dtype=float).ravel()
    order = np.lexsort((y, x))  # sums over a block in a fixed order: bit-identical whatever the row order
    xs, inverse, counts = np.unique(x[order], return_inverse=True, return_counts=True)
    sums = np.bincount(inverse.ravel(), weights=y[order], minlength=len(xs))
    values: list[float] = []
    weights: list[float] = []
    right: list[float] = []
    for xi, total, count in zip(xs, sums, counts, strict=True):
        values.append(float(total / count))
        weights.append(float(count))
        right.append(float(xi))
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
    fits_out_of_fold: ClassVar[bool] = True

    def calibrated(self, frame: pl.DataFrame) -> np.ndarray:
        p = _probs(frame, self.positive_index)
        y = (frame["gold"].to_numpy() == self.positive_index).astype(float)
        fold = question_folds(frame["question_id"].to_list(), self.folds)
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


@dataclass(frozen=True)
class AbstainBelow(OverlayRuleBase):
    """Set the secondary `abstain` flag (the row declines to answer) where the chosen option's
    probability is below `p_min`; the choice is kept. Only a catalog that declares
    `secondary = ["abstain"]` in suite.toml has its abstentions scored (as rows with no prediction)."""

    p_min: float = 0.5
    kind: ClassVar[str] = "abstain-below"
    sets: ClassVar[Literal["choice", "abstain"]] = "abstain"

    def decide(self, frame: pl.DataFrame) -> pl.Series:
        chosen = [ps[c] if ps is not None and c is not None and c < len(ps) else None
                  for ps, c in zip(frame["probs"].to_list(), frame["choice"].to_list(), strict=True)]
        return pl.Series("abstain", [p is not None and p < self.p_min for p in chosen], dtype=pl.Boolean)

    def describe(self) -> str:
        return f"abstain where the chosen option's probability < {self.p_min:g} (the choice is kept)"


def rule_from_dict(d: dict[str, Any]) -> OverlayRuleBase:
    d = dict(d)
    kind = d.pop("kind", None)
    if kind not in RULE_KINDS:
        raise ValueError(f"rule {d.get('id')!r}: unknown kind {kind!r}; known: {sorted(RULE_KINDS)}")
    return RULE_KINDS[kind](**d)
