"""NOTE [ Dense first layers in the shallow copies ]: a DeepSeek-V3 or GLM-4.5 whose first layers are dense, extrapolated from
shallow copies that keep them on the first stage, gives every stage's peak of the full build to the byte.

Skipped where megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit.parallel.sharding import Sharding
from test_megatron_glm import TINY_GLM4_MOE
from test_megatron_mla import TINY_DEEPSEEK_V3

SHAPE = [64]


def _steps(layers: int, dense: int, sharding: Sharding, model: dict = TINY_DEEPSEEK_V3):
    import warnings

    from transformers import AutoConfig

    from batchfit.budget.megatron_profile import budget_step, quiet_megatron
    from batchfit.budget.options import ProfileOptions
    from batchfit.memory import get_backend
    from batchfit.models import parse_dtype

    warnings.filterwarnings("ignore")
    config = AutoConfig.for_model(**{**model, "num_hidden_layers": layers, "first_k_dense_replace": dense})
    out = {}
    for extrapolated in (True, False):
        backend = get_backend("estimate", reserve_bytes=0, round_to=1)
        options = ProfileOptions(max_seq_len=64, backend="estimate", sharding=sharding, depth_extrapolation=extrapolated)
        with quiet_megatron():
            step = budget_step(config, sharding, backend, parse_dtype("bf16"), options)
            step.measure(SHAPE)
        out[extrapolated] = step
    return out[True], out[False]


@pytest.mark.slow  # four builds of a tiny DeepSeek-V3 over two simulated stages, and two more of one
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("model", "layers", "dense", "pipeline_parallel", "per_stage"),
    [(TINY_DEEPSEEK_V3, 10, 2, 2, (3, 5)), (TINY_DEEPSEEK_V3, 6, 2, 1, (4,)), (TINY_GLM4_MOE, 10, 1, 2, (4, 5))],
    ids=["deepseek-v3-pp2", "deepseek-v3-pp1", "glm-4.5-pp2"],
)
def test_copies_that_keep_the_dense_layers_extrapolate_every_stage_to_the_full_builds_peak(
    megatron, model, layers, dense, pipeline_parallel, per_stage
):
    from batchfit.budget.megatron_depth import DepthExtrapolatedMegatronStep

    sharding = Sharding("megatron", world_size=pipeline_parallel, pipeline_parallel=pipeline_parallel)
    deep, full = _steps(layers, dense, sharding, model)
    assert isinstance(deep, DepthExtrapolatedMegatronStep) and not isinstance(full, DepthExtrapolatedMegatronStep)
    assert deep.layers_per_stage == per_stage  # the first stage read at its MoE layers, beside its dense ones
    assert deep.stage_peaks == full.stage_peaks


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_copy_keeps_the_dense_layers_on_its_first_stage(megatron):
    from batchfit.budget.megatron_depth import dense_first_copy, dense_first_layers
    from batchfit.models.megatron import transformer_config

    fields = dense_first_copy(2, 4, 2)
    assert fields == {"num_layers": 6, "moe_layer_freq": [0, 0, 1, 1, 1, 1], "num_layers_in_first_pipeline_stage": 4}
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{**TINY_DEEPSEEK_V3, "num_hidden_layers": 10, "first_k_dense_replace": 2})
    config = transformer_config(hf, pipeline_parallel=2, **fields)
    assert (config.num_layers, config.moe_layer_freq, config.num_layers_in_first_pipeline_stage) == (6, [0, 0, 1, 1, 1, 1], 4)
    even, virtual = Sharding("megatron", world_size=2, pipeline_parallel=2), Sharding("megatron", world_size=2, pipeline_parallel=2, virtual_pipeline_parallel=2)
    assert dense_first_layers(_hf(dense=2), even, (5, 5)) == 2
    assert dense_first_layers(_hf(dense=0), even, (5, 5)) == 0
    assert dense_first_layers(_hf(dense=5), even, (5, 5)) == 0  # no MoE layer left on the first stage: every copy's layer a MoE
    assert dense_first_layers(_hf(dense=2), virtual, (5, 5)) == 0


def _hf(dense: int):
    from types import SimpleNamespace

    return SimpleNamespace(first_k_dense_replace=dense)
