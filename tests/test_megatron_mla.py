"""DeepSeek-V3 under megatron-core (batchfit.models.megatron_mla): multi-latent attention, dense first layers, shared expert.

The parameters of a tiny DeepSeek-V3 built by Megatron's decoder block spec equal transformers' model of the same
config; the estimate of its first step equals each real gloo rank's peak to the byte under TP 2 + SP and EP 2,
the worst rank under the skewed routing simulated (as tests/test_megatron_moe.py). Skipped where megatron-core or
mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from megatron_moe_referee import IDS, RUNS, hf_config, measure, real_rank
from multirank import run_ranks

# DeepSeek-V3's shape scaled down: 3 layers (the first dense), 8 routed experts in 4 groups (2 chosen), 2 per token,
# 1 shared expert; MLA with q/kv low ranks 32/16, query/key heads of 8 + 8 rotary, values 16 (one head size: the
# CPU's flash kernel and CUDA's flash keep the same; DeepSeek-V3's 192/128 run CUDA's memory-efficient kernel in the
# estimate, which the CPU has not: NOTE [ The estimate runs CUDA's attention kernel ]); YaRN RoPE as the hub's config
TINY_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}


def _config():
    return hf_config(TINY_DEEPSEEK_V3)


def _measure(backend_name: str, run: dict) -> dict[str, object]:
    return measure(TINY_DEEPSEEK_V3, backend_name, run)


@pytest.fixture(scope="module")
def real_runs():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(real_rank, TINY_DEEPSEEK_V3, RUNS, world=2, timeout=400)


@pytest.mark.slow  # 2 gloo ranks, then the estimate
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_deepseek_v3_estimate_equals_the_receiving_gloo_rank_to_the_byte(megatron, real_runs, run):
    real = real_runs[0][RUNS.index(run)]  # rank 0: EP rank 0, which receives the most under the skewed routing
    estimate = _measure("estimate", run)
    assert (real["peak"], real["breakdown"]) == (estimate["peak"], estimate["breakdown"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_receiving_rank_holds_more_than_the_other(megatron, real_runs):
    rank0, rank1 = (real_runs[rank][1]["peak"] for rank in (0, 1))
    assert rank0 > rank1  # EP rank 0 receives both ranks' pairs for experts 0 and 1


@pytest.mark.slow  # builds two small models, a few seconds
def test_the_megatron_model_holds_the_parameters_of_transformers_model(megatron):
    from transformers import AutoModelForCausalLM

    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world

    with simulated_world(1), model_parallel(1, 1), megatron_cpu_patches():
        model = build_gpt_model(_config(), initialise=False)
        ours = sum(p.numel() for p in model.parameters())
        layers = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(_config()).parameters())
    # embedding + head 2 × 512·64 = 65,536; per layer MLA 64·32 + 32 + 32·64 + 64·24 + 16 + 16·96 + 64·64 = 11,312
    # and 2 norms of 64: 11,440 × 3 = 34,320; the dense MLP 64·256 + 128·64 = 24,576; each MoE layer a router 8·64
    # and 8 + 1 shared experts of 64·64 + 32·64: 512 + 9 × 6,144 = 55,808, twice; the final norm 64:
    # 65,536 + 34,320 + 24,576 + 111,616 + 64 = 236,112
    assert ours == theirs == 236_112
    assert layers == ["MLP", "MoELayer", "MoELayer"]  # first_k_dense_replace = 1


@pytest.mark.slow
def test_the_deepseek_v3_config_maps_as_the_bridges_do(megatron):
    from batchfit.models.megatron import transformer_config

    config = transformer_config("deepseek-v3")
    got = {
        key: getattr(config, key)
        for key in (
            "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
            "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "moe_shared_expert_intermediate_size",
            "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
            "moe_router_topk_scaling_factor", "moe_router_dtype", "mtp_num_layers", "num_moe_experts", "moe_router_topk",
        )
    }
    assert got == {
        "multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
        "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rope_type": "yarn", "rotary_scaling_factor": 40,
        "original_max_position_embeddings": 4096, "moe_shared_expert_intermediate_size": 2048,
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True, "moe_router_num_groups": 8,
        "moe_router_group_topk": 4, "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32",
        "mtp_num_layers": None, "num_moe_experts": 256, "moe_router_topk": 8,
    }
    assert config.moe_layer_freq == [0, 0, 0] + [1] * 58


@pytest.mark.slow
def test_deepseek_v3_on_the_meta_device_holds_671b_parameters(megatron):
    import torch

    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world

    with torch.device("meta"), simulated_world(1), model_parallel(1, 1), megatron_cpu_patches():
        model = build_gpt_model("deepseek-v3", initialise=False, dtype=torch.bfloat16)
        count = sum(p.numel() for p in model.parameters())
    assert count == 671_026_404_352  # transformers' DeepseekV3ForCausalLM of the preset on meta: the same (measured)


@pytest.mark.slow  # needs megatron
def test_local_attention_with_mla_is_refused(megatron):
    from batchfit.models.megatron import transformer_config
    from batchfit.models.megatron_attention import layer_spec

    with pytest.raises(InvalidArgument, match=r"attention='local' cannot run multi-latent attention"):
        layer_spec(transformer_config(_config()), attention="local")


def test_mbridge_reads_deepseek_v3_through_transformers_4_names():  # first tier: plain Python, no megatron
    from batchfit.models import load_config
    from batchfit.models.megatron_mla import _Transformers4View, deepseek_v3_settings

    view = _Transformers4View(load_config("deepseek-v3"))
    assert view.rope_theta == 10000 and "rope_scaling" in view  # transformers 5 keeps both in rope_parameters
    assert (view.rope_scaling["type"], view.rope_scaling["factor"], view.rope_scaling["original_max_position_embeddings"]) == ("yarn", 40, 4096)
    assert view.kv_lora_rank == 512 and "kv_lora_rank" in view and "no_such_field" not in view
    settings = deepseek_v3_settings(view)
    assert (settings["moe_router_num_groups"], settings["moe_router_group_topk"], settings["mtp_num_layers"]) == (8, 4, None)


@pytest.mark.slow
def test_a_copy_of_another_depth_has_every_layer_a_moe(megatron):
    from batchfit.models.megatron import transformer_config

    assert transformer_config(_config()).moe_layer_freq == [0, 1, 1]  # first_k_dense_replace = 1
    assert transformer_config(_config(), num_layers=3).moe_layer_freq == [0, 1, 1]  # its own depth: as the model
    assert transformer_config(_config(), num_layers=4).moe_layer_freq == 1  # NOTE [ Shallow copies of DeepSeek-V3 ]
    assert transformer_config(_config(), num_layers=4, moe_layer_freq=[0, 0, 1, 1]).moe_layer_freq == [0, 0, 1, 1]


@pytest.mark.slow
def test_context_parallelism_with_value_heads_of_their_own_width_is_refused(megatron):
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world

    config = _config()
    config.v_head_dim = 24  # query/key heads 8 + 8, values 24: DeepSeek-V3's 192 and 128 alike
    refused = r"context_parallel_size=2 with multi-latent attention \(query/key heads of 16, value heads of 24\)"
    with simulated_world(2), model_parallel(1, 1, context_parallel=2), megatron_cpu_patches(), pytest.raises(InvalidArgument, match=refused):
        build_gpt_model(config, context_parallel=2, initialise=False)


@pytest.mark.slow  # the CLI's Megatron profile of the tiny DeepSeek-V3, two pipeline stages simulated (~30 s)
@pytest.mark.timeout(600)
def test_the_cli_profiles_a_deepseek_v3_under_megatron_with_its_dense_layer_on_the_first_stage(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY_DEEPSEEK_V3))
    code = main(["profile", "--model", str(tmp_path), "--max-seq-len", "256", "--sharding", "megatron", "--world-size", "4",
                 "--tensor-parallel", "2", "--megatron-sequence-parallel", "--expert-parallel", "2", "--expert-tensor-parallel", "1",
                 "--pipeline-parallel", "2", "--last-pipeline-stage-layers", "2", "--distributed-optimizer", "--memory", "1GiB",
                 "--no-progress"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 MoE layers (1 dense layer first) of 8 routed + 1 shared experts, 2 per token" in out
    assert "stage 0 (1 layers): " in out and "stage 1 (2 layers): " in out


@pytest.mark.slow
def test_each_pipeline_stage_builds_its_own_layers_of_the_block_spec(megatron):
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel, simulated_rank

    layers = {}
    for rank in (0, 1):
        with simulated_rank(2, rank), model_parallel(1, 2), megatron_cpu_patches():
            model = build_gpt_model(_config(), pipeline_parallel=2, initialise=False, num_layers_in_last_pipeline_stage=2)
            layers[rank] = [type(layer.mlp).__name__ for layer in model.decoder.layers]
    # Megatron's decoder block spec sliced to each stage: the dense first layer on stage 0, the two MoE layers on stage 1
    assert layers == {0: ["MLP"], 1: ["MoELayer", "MoELayer"]}
