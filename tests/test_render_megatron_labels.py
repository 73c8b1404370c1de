"""The Megatron report's gradient and optimizer-state labels name the precision-aware optimizer's dtypes."""

from __future__ import annotations

import pytest

from batchfit.cli.render_budget import _megatron_labels
from batchfit.parallel.sharding import Sharding


def test_the_default_megatron_optimizer_is_labelled_fp32():
    labels = _megatron_labels(Sharding("megatron", world_size=8, distributed_optimizer=True))
    assert labels["gradients"] == "gradients (fp32 main_grad buffer)"
    assert labels["optimizer_state"] == "optimizer state (fp32 main parameters, Adam moments)"


@pytest.mark.parametrize(
    ("dtypes", "gradients", "state"),
    [
        ({"main_grads_dtype": "bf16"}, "gradients (bf16 main_grad buffer)", "optimizer state (fp32 main parameters, fp32 Adam moments)"),
        (
            {"main_params_dtype": "fp16", "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "fp32"},
            "gradients (fp32 main_grad buffer)",
            "optimizer state (fp16 main parameters, bf16/fp32 Adam moments)",
        ),
    ],
)
def test_the_precision_aware_optimizer_is_labelled_with_its_dtypes(dtypes, gradients, state):
    sharding = Sharding("megatron", world_size=8, distributed_optimizer=True, precision_aware_optimizer=True, **dtypes)
    labels = _megatron_labels(sharding)
    assert (labels["gradients"], labels["optimizer_state"]) == (gradients, state)
