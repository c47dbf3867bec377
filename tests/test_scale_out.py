"""Scale-out: engine stages spread over two engines give the bytes one process gives.

The engines are two machines of the local provider, or two engine processes on one machine
(`engines_per_gpu=2`), running the HF engine in batch-invariant mode, with the full lifecycle
(bootstrap, golden replay, detached shards, verified collection, teardown). Each engine process
serves every job of its machine: two engines, two engine starts, whatever the number of jobs.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from jex.fileio import sha256_file

SUITE = {"rows": 18, "seed": 4}
FAST_SHARD_ROWS, COVERAGE, REASON_TOKENS, REASON_SHARD_ROWS = 4, 0.5, 4, 3


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[], tuple]:
    """The stages in this process (no machine) on the same suite: the digests both layouts must give, computed
    by the first test that asks (after its fleet, as each test did before) and kept for the other layout."""
    from jex.engine_spec import EngineSpec
    from jex.sample_suite import write_sample_suite
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.store import LocalStore

    digests: list[tuple] = []

    def compute() -> tuple:
        if not digests:
            root = tmp_path_factory.mktemp("one-process")
            suite = write_sample_suite(root / "suite", **SUITE)
            engine, store = EngineSpec(), LocalStore(root / "store-one")
            bundle = bundle_stage(store, suite=suite)
            fast = fast_pass_stage(store, bundle=bundle, engine=engine, shard_rows=FAST_SHARD_ROWS)
            gate = gate_stage(store, bundle=bundle, fast=fast, coverage=COVERAGE)
            reasoned = reason_stage(store, bundle=bundle, gate=gate, engine=engine, max_tokens=REASON_TOKENS,
                                    shard_rows=REASON_SHARD_ROWS)
            digests.append((fast.sha256, sha256_file(fast.capture), reasoned.sha256))
        return digests[0]

    return compute


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"workers": 2}, {"workers": 1, "engines_per_gpu": 2}],
                         ids=["two-machines", "two-engines-on-one-machine"])
def test_merged_capture_of_two_engines_is_byte_identical_to_one_process(tmp_path, monkeypatch, layout, one_process,
                                                                        prefect_harness):
    import sys

    from jex.engine_spec import EngineSpec
    from jex.flows.machines.fleet import GpuFleet
    from jex.sample_suite import write_sample_suite
    from jex.settings import load_settings
    from jex.tasks.campaign_spec import MachinesSpec
    from jex.tasks.capture.stages import bundle_stage, fast_pass_stage, reason_stage
    from jex.tasks.decision_stages import gate_stage
    from jex.tasks.inputs import EngineJob, FastPassInputs, ReasonInputs
    from jex.tasks.store import LocalStore

    monkeypatch.setenv("JEX_INFRA__STATE_DIR", str(tmp_path / "infra"))
    monkeypatch.setenv("JEX_INFRA__POLL_S", "0.3")
    monkeypatch.setenv("JEX_INFRA__WORKER_PYTHON", sys.executable)
    suite = write_sample_suite(tmp_path / "suite", **SUITE)
    engine = EngineSpec()
    store = LocalStore(tmp_path / "store-fleet")
    bundle = bundle_stage(store, suite=suite)
    spec = MachinesSpec(provider="local", golden_rows=4, **layout)
    with GpuFleet(spec, campaign="scale-2", store=str(store.root), settings=load_settings(),
                  echo=lambda s: None) as fleet:
        job = fleet.run_stage(EngineJob(inputs=FastPassInputs(bundle=bundle, engine=engine,
                                                              shard_rows=FAST_SHARD_ROWS), store=str(store.root)))
        fast = fast_pass_stage(store, job.inputs)
        gate = gate_stage(store, bundle=bundle, fast=fast, coverage=COVERAGE)
        job = fleet.run_stage(EngineJob(inputs=ReasonInputs(bundle=bundle, gate=gate, engine=engine,
                                                            max_tokens=REASON_TOKENS, shard_rows=REASON_SHARD_ROWS),
                                        store=str(store.root)))
        reasoned = reason_stage(store, job.inputs)
    report = fleet.report()
    assert len(report.machines) == layout["workers"] and fleet.provider.list_machines() == []
    assert report.engine_starts == 2, "one start per engine process, not per job (golden, fast pass, reason)"
    per_job = [json.loads(line)["computed_shards"] for m in report.machines for j in m.jobs
               if j.job == "fast_pass" for line in j.log_tail.splitlines() if line.startswith('{"stage"')]
    assert sorted(set(sum(per_job, []))) == [0, 1, 2, 3, 4]
    if layout["workers"] == 2:  # two machines split the shards 3 + 2; two engines of one machine claim them
        assert sorted(sum(per_job, [])) == [0, 1, 2, 3, 4], "every shard computed exactly once"
    assert fast.computed_shards == [] and reasoned.computed_shards == []  # merged here, computed there
    fleet_digests = (fast.sha256, sha256_file(fast.capture), reasoned.sha256)
    assert fleet_digests == one_process()
