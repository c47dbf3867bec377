"""Bake-off comparison and parity metrics on hand-made inputs, and the CPU twin of the bake-off."""

from __future__ import annotations

import json
import math

import pytest

from jex.engine.types import Readout, ReadoutMode
from jex.lab.bakeoff import compare, divergence_prompts, run_bakeoff, verdict
from jex.lab.jobs import BakeoffJob
from jex.lab.parity import compare_readouts


def test_compare_counts_mismatches_and_first_divergence():
    rungs = {"1": {"runs": [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]], "tok_s": 10.0, "tokens": 6,
                   "seconds": [1, 1]},
             "8": {"runs": [[[1, 2, 9], [4, 7, 7]], [[1, 2, 9], [4, 7, 8]]], "tok_s": 30.0, "tokens": 6,
                   "seconds": [1, 1]}}
    got = compare(rungs)
    assert got["1"]["mismatches"] == 0 and got["1"]["run_to_run_identical"]
    assert got["8"]["mismatches"] == 3 and got["8"]["divergent_prompts"] == 2
    assert got["8"]["first_divergence"] == {"prompt": 1, "step": 1}
    assert not got["8"]["run_to_run_identical"]


def test_quiet_control_arm_means_underpowered():
    quiet = {"rungs": {"1": {"mismatches": 0, "run_to_run_identical": True}}}
    assert verdict({"bi": quiet, "ctl": quiet}, ["bi"], ["ctl"]).startswith("UNDERPOWERED")
    loud = {"rungs": {"1": {"mismatches": 5, "run_to_run_identical": True}}}
    assert verdict({"bi": quiet, "ctl": loud}, ["bi"], ["ctl"]).startswith("INVARIANT")
    assert verdict({"bi": loud, "ctl": loud}, ["bi"], ["ctl"]).startswith("NOT INVARIANT")


def test_divergence_prompts_are_deterministic_and_varied():
    a, b = divergence_prompts(16), divergence_prompts(16)
    wide = divergence_prompts(64)
    assert a == b and wide[:16] == a
    assert max(map(len, wide)) > 20 * min(map(len, wide))  # tens to thousands of tokens


def _readout(rid, probs):
    lp = tuple(math.log(p) for p in probs)
    return Readout(rid, lp, lp, 1.0, ReadoutMode.LABEL_SLOT)


def test_readout_parity_metrics_by_hand():
    a = [_readout("r1", [0.6, 0.4]), _readout("r2", [0.51, 0.49]), _readout("r3", [0.9, 0.1])]
    b = [_readout("r1", [0.6, 0.4]), _readout("r2", [0.49, 0.51]), _readout("r3", [0.8, 0.2])]
    got = compare_readouts(a, b, {"r1": 0, "r2": 1, "r3": 0})
    assert (got["common"], got["agree"], got["flips"]) == (3, 2, 1)
    assert got["max_abs_dp"] == pytest.approx(0.1)
    assert got["mean_abs_dp"] == pytest.approx((0 + 0 + 0.02 + 0.02 + 0.1 + 0.1) / 6)
    flip = got["flip_rows"][0]
    assert flip["run_id"] == "r2" and flip["gold"] == 1 and flip["margin_a"] == pytest.approx(
        math.log(0.51 / 0.49) * 2, abs=1e-9)


@pytest.mark.slow
def test_cpu_bakeoff_twin_runs_each_arm_in_its_own_process(tmp_path):
    res = run_bakeoff(BakeoffJob(arms=["hf-control", "hf-bi"], prompts=3, tokens=6, ladder=[1, 3], repeats=2),
                      tmp_path)
    assert res["errors"] == {}
    bi = res["arms"]["hf-bi"]["rungs"]
    assert all(r["mismatches"] == 0 and r["run_to_run_identical"] for r in bi.values())
    assert {"mismatches", "first_divergence", "tok_s"} <= set(bi["3"])
    assert res["verdict"].split(":")[0] in ("UNDERPOWERED", "INVARIANT")
    assert json.loads((tmp_path / "bakeoff.json").read_text())["ladder"] == [1, 3]
    assert (tmp_path / "bakeoff.png").stat().st_size > 1000
