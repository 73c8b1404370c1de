"""budget/megatron_layout.py: a Megatron layout the model cannot be split into is refused before any build."""

from __future__ import annotations

import pytest

from batchfit.budget.megatron_layout import check_layout
from batchfit.budget.settings import FLAGS
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.models import load_config
from batchfit.parallel.sharding import Sharding


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        (3, 1, r"--tensor-parallel 3 must divide the model's 28 attention heads and 4 key-value heads .*use one of 1, 2, 4$"),
        (8, 1, r"--tensor-parallel 8 must divide the model's 28 attention heads and 4 key-value heads"),
        # or an uneven last stage: 28 - 4 × 5 = 8 layers, the other four stages 5 each
        (1, 5, r"--pipeline-parallel 5 must divide the model's 28 layers .*use one of 1, 2, 4, 7, 14, 28, or size the last "
               r"stage \(--last-pipeline-stage-layers 8, Megatron's num_layers_in_last_pipeline_stage\)$"),
    ],
    ids=["tp-3", "tp-above-kv-heads", "pp-5"],
)
def test_a_layout_the_model_cannot_be_split_into_names_the_sizes_that_fit(tp, pp, message):
    config = load_config("qwen2.5-7b")  # 28 heads, 4 key-value heads, 28 layers
    sharding = Sharding("megatron", world_size=tp * pp, tensor_parallel=tp, pipeline_parallel=pp)
    with pytest.raises(InvalidArgument, match=message):
        check_layout(config, sharding, Vocabulary(FLAGS))


def test_a_layout_that_divides_the_model_passes():
    check_layout(load_config("llama-3.1-70b"), Sharding("megatron", world_size=16, tensor_parallel=8, pipeline_parallel=2))


@pytest.mark.parametrize(
    ("virtual", "schedule"),
    [(None, "1F1B with 4 micro-batches"), (3, "interleaved 1F1B, 3 model chunks per rank with 4 micro-batches")],
)
def test_the_report_names_the_schedule_it_measured(virtual, schedule):
    from batchfit.budget.megatron_layout import MegatronLayout

    layout = MegatronLayout(
        stage_peaks={0: 3 * 2**30, 1: 2 * 2**30}, binding_stage=0, micro_batches=4, attention="sdpa", recompute=None,
        virtual_stages=virtual,
    )
    assert f"pipeline stage 0 binds (stage 0: 3.00 GiB, stage 1: 2.00 GiB; {schedule})" in layout.describe()
    assert layout.to_dict().get("virtual_stages") == virtual  # only written under the interleaved schedule
