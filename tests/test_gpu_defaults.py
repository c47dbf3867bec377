"""GPU-sized work by default: a vLLM engine on a GPU gets whole shards (its scheduler batches them), shards
sized from the work, and settings that would starve the GPU are named before the run; CPU defaults stay."""

from __future__ import annotations

import pytest

from jex.engine_spec import HF_BATCH, VLLM_MAX_NUM_SEQS, EngineSpec
from jex.tasks.campaign_spec import CampaignSpec, MachinesSpec
from jex.tasks.inputs import FAST_SHARD_ROWS, GPU_SHARD_MAX_ROWS, REASON_SHARD_ROWS
from jex.tasks.records import BundleSummary, GateSummary

GPU = EngineSpec(kind="vllm", device="cuda", model="m")


def bundle(rows: int) -> BundleSummary:
    return BundleSummary(key="k", sha256="ab" * 32, bundle="b.tar.gz", rows=rows)


def test_the_audited_vllm_engine_hands_vllm_a_whole_shard_per_call_unless_asked():
    assert GPU.requests_per_call() == 0 and GPU.scheduler_seqs() == VLLM_MAX_NUM_SEQS
    assert EngineSpec(kind="vllm", batch_size=8, max_num_seqs=32).requests_per_call() == 8
    assert EngineSpec(kind="vllm", batch_size=8, max_num_seqs=32).scheduler_seqs() == 32


@pytest.mark.parametrize("kind", ["hf", "hf-batched", "vllm-control"])
def test_other_engines_keep_their_batch_of_eight(kind):
    assert EngineSpec(kind=kind).requests_per_call() == HF_BATCH == 8


def test_cpu_shards_keep_their_sizes():
    spec = CampaignSpec()
    assert spec.fast_pass_inputs(bundle(10_000)).shard_rows == FAST_SHARD_ROWS == 32
    gate = GateSummary(key="k", sha256="12" * 32, gated="g.parquet", rows=1_000)
    assert spec.reason_inputs(bundle(10_000), gate).shard_rows == REASON_SHARD_ROWS == 64


@pytest.mark.parametrize(("rows", "workers", "engines_per_gpu", "expected"), [
    (10_000, 1, 1, 1_250),  # 8 shards per engine
    (10_000, 2, 1, 625),
    (10_000, 1, 2, 625),
    (100, 1, 1, FAST_SHARD_ROWS),  # never below the CPU size
    (1_000_000, 1, 1, GPU_SHARD_MAX_ROWS),  # a checkpoint every few seconds
])
def test_gpu_shards_are_cut_from_the_work_and_the_engines(rows, workers, engines_per_gpu, expected):
    spec = CampaignSpec(engine=GPU, machines=MachinesSpec(workers=workers, engines_per_gpu=engines_per_gpu))
    assert spec.fast_pass_inputs(bundle(rows)).shard_rows == expected


@pytest.mark.parametrize(("rows", "workers", "max_num_seqs", "expected"), [
    (1_300, 1, None, VLLM_MAX_NUM_SEQS),  # not 163: a shard fills the scheduler's decode slots
    (1_300, 1, 1_024, 1_024),
    (1_300, 4, None, 325),  # but each engine gets its share
    (100_000, 1, None, GPU_SHARD_MAX_ROWS),  # as any stage's: a checkpoint every few seconds
])
def test_a_generating_stages_gpu_shards_fill_the_scheduler(rows, workers, max_num_seqs, expected):
    engine = GPU.model_copy(update={"max_num_seqs": max_num_seqs})
    spec = CampaignSpec(engine=engine, machines=MachinesSpec(workers=workers))
    gate = GateSummary(key="k", sha256="12" * 32, gated="g.parquet", rows=rows)
    generative = bundle(10).model_copy(update={"generate_rows": rows})
    assert spec.reason_inputs(bundle(rows), gate).shard_rows == expected
    assert spec.generate_inputs(generative).shard_rows == expected


def test_a_shard_size_given_is_kept_on_a_gpu():
    assert CampaignSpec(engine=GPU, fast_shard_rows=16).fast_pass_inputs(bundle(10_000)).shard_rows == 16


def test_settings_that_starve_the_gpu_are_each_named():
    spec = CampaignSpec(engine=GPU.model_copy(update={"batch_size": 8, "max_num_seqs": 32}), fast_shard_rows=32)
    warnings = spec.gpu_warnings()
    assert [w.split(" =")[0] for w in warnings] == ["engine.batch_size", "engine.max_num_seqs", "fast_shard_rows"]
    assert "--batch-size" in warnings[0] and "--max-num-seqs" in warnings[1]


def test_gpu_sized_defaults_and_cpu_runs_warn_of_nothing():
    assert CampaignSpec(engine=GPU).gpu_warnings() == []
    assert CampaignSpec(engine=EngineSpec(batch_size=1), fast_shard_rows=4).gpu_warnings() == []


TP2 = GPU.model_copy(update={"tensor_parallel_size": 2})


@pytest.mark.parametrize(("engine", "slots", "devices"), [(GPU, 2, ["0", "1"]), (TP2, 1, ["0,1"])])
def test_two_gpus_carry_one_slot_per_gpu_or_one_over_both_at_tensor_parallel_two(engine, slots, devices):
    options = MachinesSpec(provider="local", gpus_per_machine=2).host_options("/w", engine)
    assert (options.slots, options.devices) == (slots, devices)


def test_engines_per_gpu_share_a_tensor_parallel_group():
    machines = MachinesSpec(provider="local", gpus_per_machine=4, engines_per_gpu=2)
    assert machines.slot_devices(TP2) == ["0,1", "0,1", "2,3", "2,3"]


def test_gpu_shards_are_cut_per_engine_slot_not_per_gpu():
    machines = MachinesSpec(provider="local", gpus_per_machine=2)
    rows = {e.tensor_parallel_size: CampaignSpec(engine=e, machines=machines).fast_pass_inputs(bundle(10_000))
            .shard_rows for e in (GPU, TP2)}
    assert rows == {1: 625, 2: 1_250}  # 8 shards per engine: two engines, or one over both GPUs


@pytest.mark.parametrize(("engine", "machines", "words"), [
    (TP2, {"provider": "local", "gpus_per_machine": 3}, "gpus_per_machine 3 is not a multiple of "
                                                         "engine.tensor_parallel_size 2"),
    (TP2, {"provider": "local", "gpus_per_machine": 2, "audit": "off"}, "machines.audit is 'off'"),
])
def test_tensor_parallel_needs_whole_gpu_groups_and_an_audit(engine, machines, words):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=words) as e:
        CampaignSpec(engine=engine, machines=MachinesSpec(**machines))
    assert "engine.tensor_parallel_size 2" in str(e.value)


def test_the_control_engine_opts_out_of_the_audit_at_tensor_parallel_two():
    control = TP2.model_copy(update={"kind": "vllm-control"})
    CampaignSpec(engine=control, machines=MachinesSpec(provider="local", gpus_per_machine=2, audit="off"))
