"""Temperature scaling, fitted out-of-fold by question, which never changes a choice.

For each fold k (questions hashed into `folds` groups), T_k minimises the negative log-likelihood of
the gold option under softmax(log p / T) on the other folds (Guo et al., 2017, "On Calibration of
Modern Neural Networks"); rows of fold k are then scaled by T_k. Dividing log-probs by T > 0 keeps
their order, so the argmax is unchanged; the stage asserts it anyway (a tie made by rounding is
counted, not a change: `choice_reversals`).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from jex.numerics import argmax, question_folds
from jex.tasks.documents import CalibrationDoc, FoldTemperature, Reliability, ReliabilityBin

LOG_T_RANGE = (math.log(0.05), math.log(20.0))


def _padded(logprobs: list[list[float]]) -> np.ndarray:
    width = max(map(len, logprobs))
    out = np.full((len(logprobs), width), -np.inf)
    for i, lp in enumerate(logprobs):
        out[i, : len(lp)] = lp
    return out


def _log_softmax(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=1, keepdims=True))


def nll(lp: np.ndarray, gold: np.ndarray, temperature: float) -> float:
    scaled = _log_softmax(lp / temperature)
    return float(-scaled[np.arange(len(gold)), gold].mean())


def fit_temperature(lp: np.ndarray, gold: np.ndarray, iters: int = 60) -> float:
    """Golden-section search of log T on LOG_T_RANGE (the NLL is unimodal in T)."""
    lo, hi = LOG_T_RANGE
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = nll(lp, gold, math.exp(a)), nll(lp, gold, math.exp(b))
    for _ in range(iters):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = nll(lp, gold, math.exp(a))
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = nll(lp, gold, math.exp(b))
    return math.exp((lo + hi) / 2)


def reliability(probs: np.ndarray, gold: np.ndarray, bins: int = 10) -> Reliability:
    conf = probs.max(axis=1)
    correct = probs.argmax(axis=1) == gold
    edges = np.linspace(0, 1, bins + 1)
    which = np.clip(np.digitize(conf, edges) - 1, 0, bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        m = which == b
        if m.any():
            table.append(ReliabilityBin(bin=b, n=int(m.sum()), confidence=float(conf[m].mean()),
                                        accuracy=float(correct[m].mean())))
            ece += m.mean() * abs(conf[m].mean() - correct[m].mean())
    return Reliability(ece=float(ece), bins=table)


def choice_reversals(before: list[list[float]], after: list[list[float]]) -> tuple[int, int]:
    """(rows whose chosen option is no longer a highest one after scaling, rows where scaling tied
    it with another). Dividing by T > 0 and subtracting one constant never reverses an order but, in
    floating point, may round two neighbouring values to one (about 1 row in 150,000 here): such a
    tie is not a changed choice, and the stages keep the choice made before calibration."""
    reversed_, tied = 0, 0
    for x, y in zip(before, after, strict=True):
        pick = argmax(x)
        top = max(y)
        if y[pick] < top:
            reversed_ += 1
        elif sum(v == top for v in y) > sum(v == x[pick] for v in x):
            tied += 1
    return reversed_, tied


def calibrate(frame: pl.DataFrame, *, folds: int = 5) -> tuple[pl.DataFrame, CalibrationDoc]:
    """`frame`: run_id, question_id, gold, folded_logprobs (non-null). Adds `calibrated_logprobs`. No row (a
    suite of generative catalogs alone): nothing is fitted, and the document says so (no NLL, no reliability)."""
    lp_list = frame["folded_logprobs"].to_list()
    if not lp_list:
        return frame.with_columns(pl.lit(None, dtype=pl.List(pl.Float64)).alias("calibrated_logprobs")), \
            CalibrationDoc(folds=[], nll_before=None, nll_after=None, reliability_before=None,
                           reliability_after=None, argmax_changed=0, rounding_ties=0)
    lp = _padded(lp_list)
    gold = frame["gold"].to_numpy()
    fold_of = question_folds(frame["question_id"].to_list(), folds)
    out = np.empty_like(lp)
    temps = []
    for k in range(folds):
        test = fold_of == k
        if not test.any():
            continue
        train = ~test
        t = fit_temperature(lp[train], gold[train]) if train.sum() >= 2 else 1.0
        temps.append(FoldTemperature(fold=k, temperature=t, rows=int(test.sum())))
        out[test] = _log_softmax(lp[test] / t)
    before, after = np.exp(_log_softmax(lp)), np.exp(out)
    cal_list = [list(out[i, : len(x)]) for i, x in enumerate(lp_list)]
    changed, ties = choice_reversals(lp_list, cal_list)
    if changed:
        raise AssertionError(f"temperature scaling changed {changed} choices; it must be argmax-invariant")
    report = CalibrationDoc(folds=temps, nll_before=nll(lp, gold, 1.0),
                            nll_after=float(-out[np.arange(len(gold)), gold].mean()),
                            reliability_before=reliability(before, gold), reliability_after=reliability(after, gold),
                            argmax_changed=changed, rounding_ties=ties)
    return frame.with_columns(pl.Series("calibrated_logprobs", cal_list, dtype=pl.List(pl.Float64))), report
