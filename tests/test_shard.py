"""batchfit.parallel.shard: PyTorch's FSDP2 and DDP applied for real, and the estimate equal to real ranks.

The central check: the per-rank peak the estimate backend predicts on a simulated process
group equals, to the byte, what each of 2 (and 4) real gloo ranks running FSDP2 (or DDP)
on the CPU measures, for every memory option.
"""

from __future__ import annotations

import pytest
import torch

from batchfit import InvalidArgument
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.shard import ddp_bucket_bytes, decoder_layers, is_fsdp, shard_model, sharding_of
from batchfit.parallel.sharding import Sharding
from multirank import run_ranks

# (name, sharding options, build options, step options): every option that changes memory
CASES = [
    ("fsdp2", {}, {}, {}),
    ("fsdp2-no-reshard", {"reshard_after_forward": False}, {}, {}),
    ("fsdp2-pure-bf16", {"mixed_precision": "none"}, {"dtype": "bf16"}, {}),
    ("fsdp2-offload", {"offload": "cpu"}, {}, {}),
    ("fsdp2-checkpointing", {}, {"gradient_checkpointing": True}, {}),
    ("fsdp2-fused", {}, {}, {"logprobs": "fused"}),
    ("fsdp2-reference", {}, {}, {"forward_only": True}),
    ("fsdp2-critic", {}, {"value_head": True}, {}),
    ("ddp", {"strategy": "ddp"}, {"dtype": "bf16"}, {}),
]
FOUR_RANK_CASES = ["fsdp2", "fsdp2-checkpointing"]
BATCH, SEQ = 2, 48


def _measure_cases(backend, world: int, names: list[str]) -> dict[str, tuple[int, dict[str, int], int]]:
    out = {}
    for name, shard_opts, build_opts, step_opts in CASES:
        if name not in names:
            continue
        opts = {"strategy": "fsdp2", **shard_opts}
        sharding = Sharding(opts.pop("strategy"), world_size=world, **opts)
        model = build_causal_lm("tiny", backend=backend, sharding=sharding, **build_opts)
        step = causal_lm_step(model, backend=backend, **step_opts)
        step.measure([SEQ] * BATCH)  # FSDP2 allocates its all-gather buffers lazily in the first step
        # gloo's worker thread now and then frees an all-gather output after the main thread has
        # moved on (about 1 run in 40): that run holds one layer's gathered parameters more at its
        # peak. The lower of three runs is the step's own peak (the estimate's are all equal).
        m = min((step.measure([SEQ] * BATCH) for _ in range(3)), key=lambda m: m.peak_bytes)
        out[name] = (m.peak_bytes, dict(m.breakdown), m.host_bytes)
    return out


def _real_rank(rank: int, names: list[str]) -> dict:
    import torch.distributed as dist

    torch.manual_seed(rank)
    return _measure_cases(get_backend("cpu"), dist.get_world_size(), names)


def _estimate(world: int, names: list[str]) -> dict:
    with simulated_world(world):
        return _measure_cases(get_backend("estimate", round_to=1, reserve_bytes=0), world, names)


@pytest.mark.parametrize(
    ("world", "names"),
    [
        pytest.param(2, [c[0] for c in CASES], id="2-ranks-every-option", marks=pytest.mark.slow),
        pytest.param(4, FOUR_RANK_CASES, id="4-ranks", marks=pytest.mark.slow),
    ],
)
def test_estimate_equals_the_largest_real_gloo_rank_to_the_byte(world, names):
    real = run_ranks(_real_rank, names, world=world, timeout=240)
    predicted = _estimate(world, names)
    for name in names:
        # the simulated rank is rank 0, which holds the largest shard of every parameter
        assert real[0][name] == predicted[name], name
        assert max(real[r][name][0] for r in range(world)) == predicted[name][0], name
    if "fsdp2-critic" in names:
        # uneven shards: the value head has one output row, held by rank 0 alone
        assert real[0]["fsdp2-critic"][0] > real[world - 1]["fsdp2-critic"][0]


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_sharded_state_is_one_nth_and_ddp_adds_buckets_to_a_replica():
    # tiny: 223,552 parameters (fp32 894,208 bytes), 64 = 16 × 4 ranks... each tensor splits evenly
    be = get_backend("estimate", round_to=1, reserve_bytes=0)
    none = _measure_one(be, Sharding(), dtype="fp32")
    with simulated_world(4):
        fsdp = _measure_one(be, Sharding("fsdp2", world_size=4, mixed_precision="none"), dtype="fp32")
        ddp = _measure_one(be, Sharding("ddp", world_size=4), dtype="fp32")
    assert none.breakdown["parameters"] == 894_208  # 223,552 × 4 bytes
    assert fsdp.breakdown["parameters"] == 894_208 // 4
    assert fsdp.breakdown["optimizer_state"] < none.breakdown["optimizer_state"] / 3.9
    assert ddp.breakdown["communication"] == 894_208  # one bucket slot per fp32 parameter
    assert ddp.peak_bytes >= none.peak_bytes + 894_208
    assert fsdp.peak_bytes < none.peak_bytes


def _measure_one(backend, sharding: Sharding, **build_opts):
    step = causal_lm_step(build_causal_lm("tiny", backend=backend, sharding=sharding, **build_opts), backend=backend)
    step.measure([SEQ] * BATCH)
    return step.measure([SEQ] * BATCH)


def test_fsdp2_wraps_every_layer_and_the_root_with_its_policies():
    from torch.distributed.fsdp import FSDPModule

    be = get_backend("estimate")
    with simulated_world(2):
        model = build_causal_lm("tiny", backend=be, sharding=Sharding("fsdp2", world_size=2, offload="cpu"))
        assert is_fsdp(model)
        assert all(isinstance(layer, FSDPModule) for layer in decoder_layers(model))
        param = next(model.parameters())
        assert type(param).__name__ == "DTensor" and param.dtype == torch.float32  # fp32 master shards
        assert sharding_of(model).offload == "cpu"


def test_ddp_bucket_bytes_count_each_trainable_parameter_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    model[1].weight.requires_grad_(False)
    assert ddp_bucket_bytes(model) == (4 * 3 + 3) * 4  # the frozen layer has no bucket slot


@pytest.mark.parametrize(
    ("sharding", "setup", "message"),
    [
        pytest.param(Sharding("fsdp2", world_size=2), None, r"needs a process group: launch with torchrun", id="no-group"),
        pytest.param(Sharding("fsdp2", world_size=3), 2, r"world_size must equal the process group's size 2", id="other-size"),
    ],
)
def test_sharding_needs_a_group_of_its_size(sharding, setup, message):
    model = build_causal_lm("tiny")
    if setup is None:
        with pytest.raises(InvalidArgument, match=message):
            shard_model(model, sharding)
        return
    with simulated_world(setup), pytest.raises(InvalidArgument, match=message):
        shard_model(model, sharding)


def test_a_model_without_a_layer_list_cannot_be_fsdp_sharded():
    with simulated_world(2), pytest.raises(InvalidArgument, match=r"no ModuleList of config\.num_hidden_layers"):
        shard_model(torch.nn.Linear(2, 2), Sharding("fsdp2", world_size=2))
