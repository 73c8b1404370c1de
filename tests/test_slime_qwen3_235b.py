"""examples/slime_qwen3_235b.sh, slime's own Qwen3-235B-A22B script: its Megatron layout read back as written."""

from __future__ import annotations

from pathlib import Path

from batchfit.frameworks import read_run_config

EXAMPLE = Path(__file__).parents[1] / "examples" / "slime_qwen3_235b.sh"


def test_slimes_qwen3_235b_layout_is_read_as_its_script_writes_it():
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(EXAMPLE)
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 8192}).options
    s = options.sharding
    assert (s.strategy, s.world_size, s.tensor_parallel, s.pipeline_parallel, s.context_parallel) == ("megatron", 64, 4, 4, 2)
    assert (s.expert_parallel, s.expert_tensor_parallel, s.last_pipeline_stage_layers) == (16, 1, 22)
    assert s.first_pipeline_stage_layers is None and s.megatron_sequence_parallel and s.distributed_optimizer
    assert s.data_parallel_size == 2  # 64 / (4 × 4 × 2)
    assert run.plan().config.max_tokens_per_micro_batch == 16384
