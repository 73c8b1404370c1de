"""batchfit.parallel.sharding: one name per strategy, options validated once, defaults as SkyRL and verl run."""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from batchfit.parallel.sharding import Sharding, as_sharding


def test_fsdp2_defaults_to_bf16_mixed_precision_and_resharding():
    s = Sharding("fsdp2", world_size=8)
    assert (s.mixed_precision, s.reshard_after_forward, s.offload) == ("bf16", True, "none")
    assert s.shards_state and s.distributed
    assert s.describe() == "fsdp2 over 8 ranks (fp32 params, bf16 compute, fp32 reduce)"


def test_fsdp1_has_fsdp2s_options_and_names_its_sharding_strategy():
    # verl's defaults: FULL_SHARD (reshard_after_forward: true), bf16 compute over fp32 shards
    s = Sharding("fsdp1", world_size=8)
    assert (s.mixed_precision, s.reshard_after_forward, s.offload) == ("bf16", True, "none")
    assert s.shards_state and s.distributed
    assert s.describe() == "fsdp1 over 8 ranks (FULL_SHARD, fp32 params, bf16 compute, fp32 reduce)"
    s = Sharding("fsdp1", world_size=4, reshard_after_forward=False, mixed_precision="none", offload="cpu")
    assert s.describe() == "fsdp1 over 4 ranks (SHARD_GRAD_OP, no mixed precision, CPU offload)"


def test_other_strategies_default_to_no_mixed_precision():
    assert Sharding().mixed_precision == "none" and not Sharding().distributed
    assert Sharding("ddp", world_size=2).describe() == "ddp over 2 ranks (full replica + gradient buckets)"


def test_describe_names_every_memory_option():
    s = Sharding("fsdp2", world_size=4, reshard_after_forward=False, mixed_precision="none", offload="cpu")
    assert s.describe() == "fsdp2 over 4 ranks (no mixed precision, no reshard after forward, CPU offload)"
    assert s.to_dict() == {
        "strategy": "fsdp2",
        "world_size": 4,
        "reshard_after_forward": False,
        "mixed_precision": "none",
        "offload": "cpu",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"strategy": "fsdp"}, r"sharding must be one of 'none', 'ddp', 'fsdp1', 'fsdp2', 'zero1', 'zero2', 'megatron', but got sharding='fsdp'; did you mean 'fsdp2'\?", id="unknown-strategy"),
        pytest.param({"world_size": 0}, r"world_size must be an integer >= 1, but got world_size=0", id="zero-world"),
        pytest.param({"world_size": True}, r"world_size", id="bool-world"),
        pytest.param({"strategy": "ddp", "world_size": 2, "offload": "cpu"}, r"offload='cpu' needs strategy='fsdp1' or 'fsdp2'", id="offload-without-fsdp2"),
        pytest.param({"strategy": "none", "mixed_precision": "bf16"}, r"mixed_precision='bf16' needs strategy='fsdp1' or 'fsdp2'", id="mp-without-fsdp2"),
        pytest.param({"strategy": "ddp", "reshard_after_forward": False}, r"reshard_after_forward=False needs strategy='fsdp1' or 'fsdp2'", id="reshard-without-fsdp2"),
        pytest.param({"strategy": "fsdp2", "offload": "nvme"}, r"offload must be one of 'none', 'cpu'", id="unknown-offload"),
        pytest.param({"strategy": "fsdp2", "mixed_precision": "fp16"}, r"mixed_precision must be one of 'bf16', 'none'", id="unknown-precision"),
        pytest.param({"strategy": "fsdp2", "reshard_after_forward": "no"}, r"reshard_after_forward must be True or False", id="non-bool-reshard"),
    ],
)
def test_bad_sharding_names_the_field_and_the_fix(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Sharding(**kwargs)


def test_as_sharding_accepts_none_a_name_or_a_sharding():
    assert as_sharding(None) == Sharding()
    assert as_sharding("fsdp2") == Sharding("fsdp2")
    s = Sharding("ddp", world_size=3)
    assert as_sharding(s) is s
    with pytest.raises(InvalidArgument, match="sharding must be a Sharding"):
        as_sharding(8)


def test_sequence_parallel_splits_the_world_into_data_parallel_groups():
    s = Sharding("fsdp2", world_size=8, sequence_parallel=4)
    assert s.data_parallel_size == 2 and s.to_dict()["sequence_parallel"] == 4
    assert s.describe() == "fsdp2 over 8 ranks (fp32 params, bf16 compute, fp32 reduce, Ulysses sequence parallel 4 × data parallel 2)"
    assert "sequence_parallel" not in Sharding("fsdp2", world_size=8).to_dict()  # 1: the old dict


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"strategy": "ddp", "world_size": 4, "sequence_parallel": 2}, r"sequence_parallel=2 needs strategy='fsdp1' or 'fsdp2'", id="ddp"),
        pytest.param({"strategy": "fsdp2", "world_size": 6, "sequence_parallel": 4}, r"sequence_parallel must divide world_size=6 .* but got sequence_parallel=4", id="divides"),
        pytest.param({"strategy": "fsdp2", "world_size": 4, "sequence_parallel": 0}, r"sequence_parallel must be an integer >= 1", id="zero"),
    ],
)
def test_sequence_parallel_is_refused_where_it_cannot_split(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Sharding(kwargs.pop("strategy"), **kwargs)


def test_megatron_lays_out_tensor_pipeline_and_data_parallel_ranks():
    s = Sharding("megatron", world_size=8, tensor_parallel=2, pipeline_parallel=2, megatron_sequence_parallel=True,
                 distributed_optimizer=True)
    assert (s.data_parallel_size, s.model_parallel_size, s.distributed, s.shards_state) == (2, 4, True, False)
    assert s.describe() == "megatron over 8 ranks (tensor 2 × pipeline 2 × data 2, sequence parallel, distributed optimizer)"
    ep = Sharding("megatron", world_size=8, tensor_parallel=2, expert_parallel=4)
    assert ep.describe() == "megatron over 8 ranks (tensor 2 × pipeline 1 × data 4, expert parallel 4)"
    assert "expert_tensor_parallel" not in ep.to_dict()  # Megatron's default (= tensor_parallel) is not written
    etp = Sharding("megatron", world_size=8, tensor_parallel=2, expert_parallel=8, expert_tensor_parallel=1)
    assert etp.describe().endswith("expert parallel 8, expert tensor parallel 1)")
    assert etp.to_dict()["expert_tensor_parallel"] == 1

    assert {k: s.to_dict()[k] for k in ("tensor_parallel", "pipeline_parallel", "data_parallel")} == {
        "tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 2}
    # Megatron-LM turns sequence parallelism off without tensor parallelism (arguments.py)
    assert Sharding("megatron", world_size=4, megatron_sequence_parallel=True).megatron_sequence_parallel is False
    assert "tensor_parallel" not in Sharding("fsdp2", world_size=8).to_dict()

@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"strategy": "fsdp2", "expert_tensor_parallel": 1}, "is Megatron's expert_tensor_parallel_size and needs strategy='megatron'"),
        ({"strategy": "megatron", "tensor_parallel": 2, "expert_parallel": 8, "expert_tensor_parallel": 2},
         r"expert_parallel × expert_tensor_parallel = 8 × 2 must divide a pipeline stage's 8 ranks"),
        ({"strategy": "megatron", "expert_tensor_parallel": 0}, "expert_tensor_parallel"),
    ],
)
def test_a_bad_expert_tensor_parallel_size_is_refused(fields, said):
    with pytest.raises(InvalidArgument, match=said):
        Sharding(fields.pop("strategy"), world_size=8, **fields)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "fsdp2", "tensor_parallel": 2}, "tensor_parallel=2 is Megatron's and needs strategy='megatron'"),
        ({"strategy": "zero2", "distributed_optimizer": True}, "distributed_optimizer=True is Megatron's"),
        ({"strategy": "megatron", "world_size": 6, "tensor_parallel": 4},
         r"tensor_parallel × pipeline_parallel = 4 × 1 = 4 must divide world_size=6"),
        ({"strategy": "megatron", "pipeline_parallel": 0}, "pipeline_parallel must be"),
        ({"strategy": "megatron", "distributed_optimizer": "yes"}, "distributed_optimizer must be True or False"),
    ],
    ids=["tp-under-fsdp2", "dist-opt-under-zero", "world-not-divided", "pp-zero", "not-a-bool"],
)
def test_bad_megatron_layout_names_the_field_and_the_fix(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Sharding(**kwargs)
