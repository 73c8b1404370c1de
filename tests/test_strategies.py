"""The strategy registry (batchfit.parallel.strategies): one spec per strategy, and Sharding validating from it."""

from __future__ import annotations

import pytest
import torch

from batchfit.errors import InvalidArgument
from batchfit.parallel import Sharding, shard_model, shard_state, sharding_of, simulated_world
from batchfit.parallel import strategies as registry
from batchfit.parallel.strategies import (
    StrategySpec,
    get_strategy,
    register_strategy,
    scale_out_strategy,
    strategy_names,
)


def test_every_strategy_is_registered_once_in_the_order_messages_list_them():
    assert strategy_names() == ("none", "ddp", "fsdp1", "fsdp2", "zero1", "zero2", "megatron")
    assert all(get_strategy(n).name == n for n in strategy_names())


def test_registering_a_name_twice_is_refused():
    with pytest.raises(InvalidArgument, match="strategy 'ddp' is registered already"):
        register_strategy(StrategySpec("ddp", "another DDP", wrap="batchfit.parallel.shard:wrap_ddp"))
    assert get_strategy("ddp").title == "PyTorch DistributedDataParallel"  # the first one kept


def test_an_unknown_name_is_refused_with_the_names_and_the_closest():
    with pytest.raises(InvalidArgument, match=r"one of none, ddp, fsdp1, fsdp2, zero1, zero2, megatron, but got sharding='fsdp3' \(did you mean 'fsdp2'\?\)"):
        get_strategy("fsdp3")
    with pytest.raises(InvalidArgument, match=r"but got sharding=3$"):
        get_strategy(3)  # type: ignore[arg-type]


def _accepts(**kwargs) -> bool:
    try:
        Sharding(**kwargs)
    except InvalidArgument:
        return False
    return True


@pytest.mark.parametrize("name", ["none", "ddp", "fsdp1", "fsdp2", "zero1", "zero2"])
def test_the_spec_agrees_with_shardings_validation(name):
    spec = get_strategy(name)
    world = 4 if spec.distributed else 1
    assert Sharding(name, world_size=world).spec is spec
    # FSDP's options exactly where the strategy gathers layers
    assert _accepts(strategy=name, world_size=world, mixed_precision="bf16") is spec.gathers_layers
    assert _accepts(strategy=name, world_size=world, offload="cpu") is spec.gathers_layers
    assert _accepts(strategy=name, world_size=world, reshard_after_forward=False) is spec.gathers_layers
    assert _accepts(strategy=name, world_size=4, sequence_parallel=2) is spec.sequence_parallel
    # ZeRO's options exactly where it has a stage
    assert _accepts(strategy=name, world_size=world, overlap_comm=True) is (spec.zero_stage > 0)
    assert Sharding(name, world_size=world).distributed is spec.distributed
    assert Sharding(name, world_size=world).partitioned == spec.partitioned


def test_the_specs_say_what_each_strategy_does():
    # literal facts, one per question the budget, the build and the emitters ask
    assert [n for n in strategy_names() if not get_strategy(n).affine_in_depth] == ["zero2"]  # its gradient buffer
    assert [n for n in strategy_names() if get_strategy(n).gathers_layers] == ["fsdp1", "fsdp2"]
    assert [n for n in strategy_names() if get_strategy(n).shards_on_meta] == ["fsdp2"]
    assert [n for n in strategy_names() if get_strategy(n).materialises_on_host] == ["fsdp1"]
    assert [(n, get_strategy(n).zero_stage) for n in ("zero1", "zero2", "fsdp2")] == [("zero1", 1), ("zero2", 2), ("fsdp2", 0)]
    assert [n for n in strategy_names() if get_strategy(n).warmup_steps] == ["ddp"]
    assert scale_out_strategy().name == "fsdp2"
    # the smallest-world search grows fsdp2's own world; from any other strategy it starts at one rank
    assert [get_strategy(n).search_start(8) for n in strategy_names()] == [1, 1, 1, 8, 1, 1, 1]
    assert [n for n in strategy_names() if not get_strategy(n).distributed] == ["none"]
    # Megatron splits layers over tensor and pipeline ranks and brings its own probe (its own GPTModel)
    assert [n for n in strategy_names() if get_strategy(n).model_parallel] == ["megatron"]
    assert [n for n in strategy_names() if get_strategy(n).profile] == ["megatron"]


def test_each_distributed_strategy_names_a_wrap_function_or_its_own_profile_and_none_leaves_a_model_alone():
    assert get_strategy("none").wrapper() is None
    for name in strategy_names()[1:]:
        spec = get_strategy(name)
        if spec.profile:
            assert spec.wrapper() is None and callable(spec.profiler().profile_model), name
        else:
            assert callable(spec.wrapper()), name


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distributed": True, "wrap": ""}, "needs its wrap function or its own profile"),
        ({"group": "none", "wrap": "m:f"}, "group must be 'world' when it is distributed"),
        ({"group": "ranks", "wrap": "m:f"}, "group='ranks'"),
        ({"distributed": False}, "group='world' with distributed=False"),
    ],
    ids=["no-wrap", "none-group-distributed", "unknown-group", "world-group-local"],
)
def test_a_malformed_spec_is_refused(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        StrategySpec("toy", "a toy", **kwargs)


def test_a_registered_strategy_is_one_sharding_accepts():
    toy = StrategySpec("toy", "a toy", sequence_parallel=True, wrap="batchfit.parallel.shard:wrap_ddp")
    with pytest.raises(InvalidArgument, match="sharding must be one of"):
        Sharding("toy")
    register_strategy(toy)
    try:
        s = Sharding("toy", world_size=4, sequence_parallel=2)  # the spec's axis, no FSDP options
        assert (s.spec, s.mixed_precision, s.distributed) == (toy, "none", True)
    finally:
        del registry._REGISTRY["toy"]
    assert "toy" not in strategy_names()


def test_sharding_of_reads_what_shard_model_applied():
    model = torch.nn.Linear(2, 2)
    assert sharding_of(model) == Sharding()  # a model shard_model never saw
    ddp = Sharding("ddp", world_size=2)
    with simulated_world(2):
        out = shard_model(torch.nn.Linear(2, 2), ddp, fake=True)  # DDP's buckets counted, no reducer on fake ranks
    assert sharding_of(out) is ddp
    assert [t.numel() for t in shard_state(out).comm_buffers] == [24]  # (2·2 + 2) fp32 elements × 4 bytes
