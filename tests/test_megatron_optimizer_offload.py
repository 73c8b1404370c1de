"""Megatron's optimizer CPU offload (HybridDeviceOptimizer) and precision-aware optimizer, modelled with PyTorch's
tensors (NOTE [ Megatron's optimizer offload and precision-aware optimizer ] in batchfit.train.megatron_step).

The refusals need no megatron; the measurements are slow (megatron-core on the estimate and on 2 gloo ranks).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from batchfit.parallel.sharding import Sharding

MEGATRON = {"strategy": "megatron", "world_size": 2}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distributed_optimizer": True, "optimizer_cpu_offload": True}, "optimizer_cpu_offload=True needs precision_aware_optimizer"),
        ({"precision_aware_optimizer": True}, "needs distributed_optimizer=True"),
        ({"distributed_optimizer": True, "exp_avg_dtype": "bf16"}, "exp_avg_dtype='bf16' needs precision_aware_optimizer"),
        ({"distributed_optimizer": True, "precision_aware_optimizer": True, "main_params_dtype": "bf16"}, "main_params_dtype"),
        ({"distributed_optimizer": True, "precision_aware_optimizer": True, "optimizer_cpu_offload": True,
          "optimizer_offload_fraction": 1.5}, r"optimizer_offload_fraction must be a fraction in \[0, 1\]"),
    ],
    ids=["offload-alone", "no-distributed", "dtype-alone", "bad-dtype", "bad-fraction"],
)
def test_what_megatron_refuses_of_its_optimizer_is_refused(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        Sharding(**MEGATRON, **kwargs)


def test_megatrons_optimizer_options_need_megatron():
    with pytest.raises(InvalidArgument, match="needs strategy='megatron'"):
        Sharding("fsdp2", world_size=2, precision_aware_optimizer=True)


def test_the_sharding_says_the_offload_and_serialises_it_only_when_on():
    on = Sharding(**MEGATRON, distributed_optimizer=True, precision_aware_optimizer=True, optimizer_cpu_offload=True)
    assert "optimizer offloaded to the host (1)" in on.describe() and on.to_dict()["optimizer_offload_fraction"] == 1.0
    assert "optimizer_cpu_offload" not in Sharding(**MEGATRON).to_dict()


# ---------------------------------------------------------------- megatron-core (slow) ---------------------------------


SHAPE = [64, 64]


def _measure(backend_name: str, **optimizer: object) -> tuple[int, int, dict[str, int]]:
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend
    from batchfit.train.megatron_step import OptimizerPrecision

    warnings.filterwarnings("ignore")
    if "precision" in optimizer:
        optimizer["precision"] = OptimizerPrecision(**optimizer["precision"])  # type: ignore[arg-type]
    backend = get_backend(backend_name, reserve_bytes=0, round_to=1)
    step = MegatronStep(
        "tiny", backend=backend, dtype=torch.bfloat16, num_layers=2, data_parallel=2, distributed_optimizer=True, **optimizer
    )
    m = step.measure(SHAPE)
    return m.peak_bytes, m.host_bytes, dict(m.breakdown)


def _real_rank(rank: int, optimizer: dict[str, object]) -> tuple[int, int, dict[str, int]]:
    return _measure("cpu", **optimizer)


@pytest.mark.slow
def test_the_offload_moves_the_optimizer_state_from_the_device_to_the_host(megatron):
    plain_peak, plain_host, plain = _measure("estimate")
    peak, host, offloaded = _measure("estimate", precision={}, offload_fraction=1.0)
    assert plain_host == 0 and "optimizer_state" not in offloaded
    # tiny bf16 at DP 2: this rank's 111,808 main elements; the plain optimizer keeps 12 B each (fp32 main shard and two
    # moments) plus 8 four-byte step counts = 1,341,728 B; offloaded, the host holds 16 B each (the fp32 copy, two
    # moments, the pinned fp32 gradient) = 1,788,928 B, and the device peak falls by the whole optimizer state
    assert plain["optimizer_state"] == 1_341_728
    assert host == 1_788_928
    assert peak == plain_peak - plain["optimizer_state"]
    assert offloaded["gradients"] == plain["gradients"] and offloaded["parameters"] == plain["parameters"]


@pytest.mark.slow
def test_half_an_offload_keeps_the_rest_of_the_state_on_the_device(megatron):
    _, host, half = _measure("estimate", precision={}, offload_fraction=0.5)
    # HybridDeviceOptimizer moves whole shards in order until half the elements are on the host: 65,536 of 111,808
    assert host == 65_536 * 16 and half["optimizer_state"] == (111_808 - 65_536) * 12


@pytest.mark.slow
def test_precision_aware_dtypes_lower_the_optimizer_state_by_their_bytes(megatron):
    _, _, fp32 = _measure("estimate", precision={})
    _, _, bf16 = _measure("estimate", precision={"exp_avg": "bf16", "exp_avg_sq": "bf16"})
    _, _, fp8 = _measure("estimate", precision={"exp_avg": "fp8", "exp_avg_sq": "fp8"})
    # per element: fp32 main + two fp32 moments = 12 B; bf16 moments 4 + 2 + 2 = 8 B; fp8 moments 4 + 1 + 1 = 6 B
    assert fp32["optimizer_state"] == 111_808 * 12
    assert bf16["optimizer_state"] * 12 == fp32["optimizer_state"] * 8
    assert fp8["optimizer_state"] * 12 == fp32["optimizer_state"] * 6


@pytest.mark.slow
def test_bf16_main_grads_halve_the_gradient_buffer(megatron):
    _, _, fp32 = _measure("estimate", precision={})
    _, _, bf16 = _measure("estimate", precision={"main_grads": "bf16"})
    assert bf16["gradients"] * 2 == fp32["gradients"]


@pytest.mark.slow
def test_an_offloaded_step_on_the_estimate_equals_the_real_ranks_to_the_byte(megatron):
    from multirank import run_ranks

    optimizer = {"precision": {}, "offload_fraction": 1.0}
    real = run_ranks(_real_rank, optimizer, world=2, timeout=400)
    peak, host, _ = _measure("estimate", **optimizer)
    assert (real[0][0], real[0][1]) == (peak, host)  # the estimate simulates rank 0
