"""Small numerics every room uses, written once: log-odds, the tie-broken choice, question folds and
per-name random generators. Pure functions; the results are pinned by stored predictions and scores,
so each keeps the exact arithmetic of the copies it replaced."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from typing import overload

import numpy as np

LOGIT_CLIP = (1e-300, 1 - 1e-16)
"""Probabilities are clipped to this range before the log-odds, so 0 and 1 give finite values."""


@overload
def logit(p: float) -> float: ...
@overload
def logit(p: np.ndarray) -> np.ndarray: ...
def logit(p: float | np.ndarray) -> float | np.ndarray:
    """log(p / (1 - p)) with p clipped to `LOGIT_CLIP`.

    A Python float goes through `math` (libm), an array through numpy. The two can differ in the last
    bit (numpy's SIMD log), and stored outputs use each (gate margins: numpy; parity and reference
    margins: math), so both paths stay."""
    lo, hi = LOGIT_CLIP
    if isinstance(p, float):
        p = min(max(p, lo), hi)
        return math.log(p) - math.log1p(-p)
    p = np.clip(p, lo, hi)
    return np.log(p) - np.log1p(-p)


@overload
def argmax(values: None) -> None: ...
@overload
def argmax(values: Sequence[float]) -> int: ...
def argmax(values: Sequence[float] | None) -> int | None:
    """Index of the highest value, ties to the lowest index (numpy's rule); None stays None (a refused
    readout has no choice)."""
    if values is None:
        return None
    return max(range(len(values)), key=lambda i: (values[i], -i))


def length_normalised_choice(loglikelihoods: Sequence[float], options: Sequence[str]) -> int:
    """lm-eval's `acc_norm` prediction (0.4.13 `ConfigurableTask.process_results`): argmax of each option's
    log-likelihood divided by its length in characters (`len(choice)`, the delimiter left out), ties to
    the first."""
    return argmax([float(ll) / float(len(o)) for ll, o in zip(loglikelihoods, options, strict=True)])


def byte_normalised_choice(loglikelihoods: Sequence[float], options: Sequence[str]) -> int:
    """lm-eval's `acc_bytes` prediction: argmax of each option's log-likelihood divided by its length in
    UTF-8 bytes, ties to the first."""
    return argmax([float(ll) / float(len(o.encode("utf-8"))) for ll, o in zip(loglikelihoods, options, strict=True)])


def choice_softmax(loglikelihoods: Sequence[float]) -> list[float]:
    """lm-eval's `prob_norm` (0.4.13 `utils.softmax`, the `brier_score` forecast): exp of each option's
    log-likelihood less the largest, over their sum, in numpy float64 (lm-eval's bits)."""
    ll = np.array(loglikelihoods, dtype=np.float64)
    e = np.exp(ll - np.max(ll))
    return [float(x) for x in e / e.sum()]


def true_mass(loglikelihoods: Sequence[float], true_options: Sequence[int]) -> float:
    """The probability mass of the true options as lm-eval's TruthfulQA mc2 computes it (0.4.13
    `truthfulqa/utils.py: process_results_mc2`): exp of each option's log-likelihood, normalised by
    their sum, summed over the true options, in numpy float64 so the bits are lm-eval's. Where every
    exponential underflows (each log-likelihood below about -745, where lm-eval's own formula gives NaN),
    the same mass from the max-shifted softmax."""
    ll = np.array(loglikelihoods, dtype=np.float64)
    mask = np.zeros(len(ll), dtype=bool)
    mask[list(true_options)] = True
    with np.errstate(invalid="ignore", divide="ignore"):
        probs = np.exp(ll)
        mass = np.sum((probs / np.sum(probs))[mask])
    if not np.isfinite(mass):
        shifted = np.exp(ll - ll.max())
        mass = np.sum((shifted / np.sum(shifted))[mask])
    return float(mass)


def question_folds(question_ids: Iterable[str], folds: int) -> np.ndarray:
    """Fold of each row, crc32(question_id) % folds: rows of one question always share a fold, and the
    assignment does not depend on row order or on the run."""
    return np.array([zlib.crc32(q.encode()) % folds for q in question_ids])


def named_rng(seed: int, name: str) -> np.random.Generator:
    """A generator seeded by (seed, crc32(name)): each catalog or arm draws its own stream, so adding
    one leaves the others' draws unchanged."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def margin(logprobs: Sequence[float] | None) -> float | None:
    """Top-1 minus top-2 log-odds of a readout (natural log)."""
    if logprobs is None or len(logprobs) < 2:
        return None
    top = sorted(logprobs, reverse=True)
    p1, p2 = math.exp(top[0]), math.exp(top[1])
    return logit(p1) - logit(p2)
