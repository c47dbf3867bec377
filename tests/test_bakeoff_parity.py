"""Bake-off comparison and parity metrics on hand-made inputs, and the CPU twin of the bake-off."""

from __future__ import annotations

import json
import math

import pytest

from jex.engine.types import Readout, ReadoutMode
from jex.lab.bakeoff import read_bakeoff, run_bakeoff, verdict
from jex.lab.jobs import BakeoffJob
from jex.lab.parity import compare_readouts
from jex.tasks.capture.invariance import (
    ArmResult,
    FirstDivergence,
    RungComparison,
    compare,
    divergence_prompts,
    reference_sample,
)


def test_compare_counts_mismatches_and_first_divergence():
    rungs = {"1": {"prompts": [0, 1], "runs": [[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]]], "tok_s": 10.0,
                   "tokens": 6, "seconds": [1, 1]},
             "8": {"prompts": [0, 1], "runs": [[[1, 2, 9], [4, 7, 7]], [[1, 2, 9], [4, 7, 8]]], "tok_s": 30.0,
                   "tokens": 6, "seconds": [1, 1]}}
    got = compare(rungs)
    assert got["1"].mismatches == 0 and got["1"].run_to_run_identical
    assert got["8"].mismatches == 3 and got["8"].divergent_prompts == 2
    assert got["8"].first_divergence == FirstDivergence(prompt=1, step=1)
    assert not got["8"].run_to_run_identical


def test_a_prompt_batch_1_did_not_read_is_compared_with_the_smallest_rung_above_it():
    """Batch 1 read prompt 1 only: prompt 1 differing at batch 8 is a mismatch there; prompt 0, read first at
    batch 8, is the reference of batch 16, where it differs."""
    rungs = {"1": {"prompts": [1], "runs": [[[4, 5, 6]]], "tok_s": 1.0, "tokens": 3, "seconds": [1]},
             "8": {"prompts": [0, 1], "runs": [[[1, 2, 3], [4, 5, 0]]], "tok_s": 1.0, "tokens": 6, "seconds": [1]},
             "16": {"prompts": [0, 1], "runs": [[[1, 0, 3], [4, 5, 0]]], "tok_s": 1.0, "tokens": 6,
                    "seconds": [1]}}
    got = compare(rungs)
    assert got["1"].mismatches == 0
    assert (got["8"].mismatches, got["8"].first_divergence) == (1, FirstDivergence(prompt=1, step=2))
    assert (got["16"].mismatches, got["16"].divergent_prompts) == (2, 2)
    assert got["16"].first_divergence == FirstDivergence(prompt=0, step=1)


OLD_BAKEOFF = {  # a bakeoff.json of the version before its record: no `version`, `reference_prompts`, rung prompts
    "engine": "hf", "prompts": 2, "tokens": 4, "ladder": [1, 2], "repeats": 2, "tax": {}, "errors": {},
    "speculation": {}, "verdict": "INVARIANT at every rung and run to run",
    "arms": {"hf-bi": {"arm": "hf-bi", "wall_seconds": 3.5, "prompt_tokens": [10, 20], "provenance": {"x": 1},
                       "rungs": {"1": {"mismatches": 0, "divergent_prompts": 0, "first_divergence": None,
                                       "run_to_run_identical": True, "tok_s": 5.0, "tokens": 8,
                                       "seconds": [1.0, 1.0]}}}}}


def test_a_bakeoff_written_before_its_record_reads_and_a_renamed_key_is_refused_naming_the_file(tmp_path):
    from jex.errors import InputError
    from jex.flows.machines.audit import judge

    path = tmp_path / "bakeoff.json"
    path.write_text(json.dumps(OLD_BAKEOFF, indent=1))
    old = read_bakeoff(tmp_path)
    assert (old.version, old.reference_prompts, old.arms["hf-bi"].rungs["1"].prompts) == (1, 2, [])
    audit = judge(path, key="k", arm="hf-bi", control="hf-control", gpus=[], stack_sha256="", ladder=[1, 2])
    assert audit.passed and not audit.powered
    renamed = json.loads(path.read_text())
    rung = renamed["arms"]["hf-bi"]["rungs"]["1"]
    rung["mismatch_count"] = rung.pop("mismatches")
    path.write_text(json.dumps(renamed))
    with pytest.raises(InputError, match=r"bakeoff\.json.*BakeoffResult(.|\n)*mismatch"):
        judge(path, key="k", arm="hf-bi", control="hf-control", gpus=[], stack_sha256="", ladder=[1, 2])


def test_batch_1_reads_a_sample_spread_over_the_prompts_lengths_the_longest_among_them():
    prompts = divergence_prompts(64)  # their lengths do not grow with their index all the way
    picked = reference_sample(prompts, 8)
    ranks = sorted(sorted(range(64), key=lambda i: (len(prompts[i]), i)).index(i) for i in picked)
    assert len(picked) == 8 and ranks == [7, 15, 23, 31, 39, 47, 55, 63]
    assert max(len(prompts[i]) for i in picked) == max(map(len, prompts))  # the longest among them
    assert reference_sample(prompts[:3], 8) == reference_sample(prompts[:3], None) == [0, 1, 2]


def test_quiet_control_arm_means_underpowered():
    def arm(mismatches):
        return ArmResult(rungs={"1": RungComparison(mismatches=mismatches, divergent_prompts=0, first_divergence=None,
                                                    run_to_run_identical=True, tok_s=1.0, tokens=1, seconds=[1.0])})

    quiet = arm(0)
    assert verdict({"bi": quiet, "ctl": quiet}, ["bi"], ["ctl"]).startswith("UNDERPOWERED")
    loud = arm(5)
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
    res = run_bakeoff(BakeoffJob(arms=["hf-control", "hf-bi"], prompts=3, tokens=6, ladder=[1, 3], repeats=2,
                                 reference_prompts=1), tmp_path)
    assert res.errors == {}
    bi = res.arms["hf-bi"].rungs
    assert all(r.mismatches == 0 and r.run_to_run_identical for r in bi.values())
    assert (bi["1"].prompts, bi["3"].prompts) == (reference_sample(divergence_prompts(3), 1), [0, 1, 2])
    assert len(bi["1"].token_ids or []) == 1
    control = res.arms["hf-control"].rungs
    assert [len(r.seconds) for r in bi.values()] == [2, 2] and [len(r.seconds) for r in control.values()] == \
        [1, 1]  # a control arm's run-to-run identity decides nothing: one run of each rung
    assert "| hf-control | 3 |" in (tmp_path / "bakeoff.md").read_text() and "1 run |" in \
        (tmp_path / "bakeoff.md").read_text()
    assert {"mismatches", "first_divergence", "tok_s"} <= set(bi["3"].model_dump())
    assert res.verdict.split(":")[0] in ("UNDERPOWERED", "INVARIANT")
    assert json.loads((tmp_path / "bakeoff.json").read_text())["ladder"] == [1, 3]
    assert (tmp_path / "bakeoff.png").stat().st_size > 1000
