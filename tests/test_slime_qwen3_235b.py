"""examples/slime_qwen3_235b.sh, slime's own Qwen3-235B-A22B script: its Megatron layout read back as written."""

from __future__ import annotations

from pathlib import Path

import pytest

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


#: Qwen3-235B-A22B's shape kept where the layout needs it (94 layers, 4 key-value heads for TP 4, experts for EP 16),
#: the rest shrunk so the estimate runs in seconds: 64 wide, 16 experts of 32, 512 tokens of vocabulary
SMALL_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 94,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 8,
    "vocab_size": 512,
    "max_position_embeddings": 40960,
    "norm_topk_prob": True,
}


@pytest.mark.slow
def test_the_scripts_layout_measures_every_stage_of_a_small_model_of_its_shape(tmp_path):
    # one measurement of the profile's own step (a full search on this layout takes minutes on 2 cores: docs/moe.md
    # has the full-size figure): the stages at their own depth, the offloaded optimizer's share on the host
    import json
    import warnings

    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    from batchfit.budget.megatron_profile import budget_step, quiet_megatron
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.memory import get_backend
    from batchfit.models import load_config, parse_dtype

    warnings.filterwarnings("ignore")
    model = tmp_path / "small-qwen3-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL_MOE), encoding="utf-8")
    script = tmp_path / "run.sh"
    script.write_text(EXAMPLE.read_text(encoding="utf-8").replace("--hf-checkpoint qwen3-235b-a22b", f"--hf-checkpoint {model}"))
    run = read_run_config(script)
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 1024}).options
    backend = get_backend("estimate", memory_limit="1GiB", reserve_bytes=0)
    with quiet_megatron():
        step = budget_step(load_config(str(model)), options.sharding, backend, parse_dtype("bf16"), options)
        measured = step.measure([1024])
    # (94 - 22) / 3 = 24 layers on the first three stages: each extrapolated to its own depth from 8- and 12-layer copies
    assert step.layers_per_stage == (24, 24, 24, 22)
    assert set(step.stage_peaks) == {0, 1, 2, 3}
    # under 1F1B the first stage holds 4 micro-batches in flight against the last's one: with 24 layers to the
    # last's 22 and a 512-token vocabulary's head it binds
    assert step.binding_stage == 0
    assert measured.host_bytes > 0 and "optimizer_state" not in measured.breakdown  # all of it offloaded (fraction 1.0)


def test_the_scripts_layout_is_emitted_back_as_slime_flags():
    import types

    from batchfit.budget.options import ProfileOptions
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.emit import emit_keys, render_flags
    from batchfit.frameworks.run_profile import role_options

    run = read_run_config(EXAMPLE)
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 8192}).options
    assert isinstance(options, ProfileOptions)
    profile = types.SimpleNamespace(
        run=run,
        budgets={"policy": types.SimpleNamespace(tokens=16_384, backend="estimate", usable_bytes=70 * 2**30, cost="packed")},
        options=role_options(run, options),
    )
    text = render_flags(emit_keys(profile, "slime", max_seq_len=8192, margin=0.85), [])
    for words in ("--decoder-last-pipeline-num-layers 22", "--expert-tensor-parallel-size 1", "--expert-model-parallel-size 16",
                  "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--pipeline-model-parallel-size 4"):
        assert words in text, words
    assert "--decoder-first-pipeline-num-layers" not in text and "--optimizer-offload-fraction" not in text  # unset / 1.0
