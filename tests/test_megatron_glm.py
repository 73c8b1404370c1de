"""GLM-4.5 under megatron-core (batchfit.models.megatron_glm): mbridge's bridge, dense first layers, shared expert, expert bias.

The parameters of a tiny GLM-4.5 built by Megatron's decoder block spec equal transformers' model of the same config;
the estimate of its first step equals each real gloo rank's peak to the byte under TP 2 + SP and EP 2, and under EP 2
over data parallelism 2, the worst rank under the skewed routing simulated (as tests/test_megatron_mla.py). Skipped
where megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from megatron_moe_referee import IDS, RUNS, hf_config, measure, real_rank
from multirank import run_ranks

# GLM-4.5's shape scaled down: 3 layers (the first dense), 8 routed experts, 2 per token, 1 shared expert, the sigmoid
# router with its expert bias, q/k norm (GLM-4.5's; the Air's is off), the qkv bias, half of each head rotated
TINY_GLM4_MOE = {
    "model_type": "glm4_moe",
    "architectures": ["Glm4MoeForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": True,
}


def _config():
    return hf_config(TINY_GLM4_MOE)


def _measure(backend_name: str, run: dict) -> dict[str, object]:
    return measure(TINY_GLM4_MOE, backend_name, run)


@pytest.fixture(scope="module")
def real_runs():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(real_rank, TINY_GLM4_MOE, RUNS, world=2, timeout=400)


@pytest.mark.slow  # 2 gloo ranks, then the estimate
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_glm4_moe_estimate_equals_the_receiving_gloo_rank_to_the_byte(megatron, real_runs, run):
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
        rotated = model.rotary_pos_emb.inv_freq.numel()
        biases = {name.split(".", 3)[-1] for name, _ in model.named_buffers() if "router" in name}
    theirs = sum(p.numel() for p in AutoModelForCausalLM.from_config(_config()).parameters())
    # embedding + head 2 × 512·64 = 65,536; per layer the qkv 64·128 + its bias 128, the output 64·64, q/k norms 16 + 16
    # and 2 norms of 64: 12,576 × 3 = 37,728; the dense MLP 64·256 + 128·64 = 24,576; each MoE layer a router 8·64 and
    # 8 + 1 shared experts of 64·64 + 32·64: 512 + 9 × 6,144 = 55,808, twice; the final norm 64:
    # 65,536 + 37,728 + 24,576 + 111,616 + 64 = 239,520
    assert ours == theirs == 239_520
    assert layers == ["MLP", "MoELayer", "MoELayer"]  # first_k_dense_replace = 1
    assert rotated == 4  # half of a head of 16 rotated: 8 dimensions, 4 frequencies
    assert biases == {"mlp.router.expert_bias", "mlp.router.local_tokens_per_expert"}  # HF's e_score_correction_bias


@pytest.mark.slow  # imports megatron-core
def test_the_glm_4_5_air_config_maps_as_mbridge_does(megatron):
    from batchfit.models.megatron import gpt_model_args, transformer_config

    config = transformer_config("glm-4.5-air")
    got = {
        key: getattr(config, key)
        for key in (
            "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_dtype",
            "qk_layernorm", "add_qkv_bias", "add_bias_linear", "kv_channels", "num_query_groups", "mtp_num_layers",
            "moe_shared_expert_overlap", "moe_grouped_gemm", "moe_aux_loss_coeff",
        )
    }  # fmt: skip
    assert got == {
        "num_moe_experts": 128, "moe_router_topk": 8, "moe_ffn_hidden_size": 1408, "ffn_hidden_size": 10944,
        "moe_shared_expert_intermediate_size": 1408, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": 1.0, "moe_router_dtype": "fp32",
        "qk_layernorm": False, "add_qkv_bias": True, "add_bias_linear": False, "kv_channels": 128, "num_query_groups": 8,
        "mtp_num_layers": None, "moe_shared_expert_overlap": False, "moe_grouped_gemm": False, "moe_aux_loss_coeff": 0.0,
    }  # fmt: skip
    assert config.moe_layer_freq == [0] + [1] * 45
    assert gpt_model_args("glm-4.5-air")["rotary_percent"] == 0.5  # rope_parameters' partial_rotary_factor


@pytest.mark.slow
def test_glm_4_5_air_on_the_meta_device_holds_107b_parameters(megatron):
    import torch

    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world

    with torch.device("meta"), simulated_world(1), model_parallel(1, 1), megatron_cpu_patches():
        model = build_gpt_model("glm-4.5-air", initialise=False, dtype=torch.bfloat16)
        count = sum(p.numel() for p in model.parameters())
    assert count == 106_852_245_504  # transformers' Glm4MoeForCausalLM of the preset on meta: the same (measured)


@pytest.mark.slow
def test_a_copy_of_another_depth_has_every_layer_a_moe(megatron):
    from batchfit.models.megatron import transformer_config

    assert transformer_config(_config()).moe_layer_freq == [0, 1, 1]  # first_k_dense_replace = 1
    assert transformer_config(_config(), num_layers=3).moe_layer_freq == [0, 1, 1]  # its own depth: as the model
    assert transformer_config(_config(), num_layers=4).moe_layer_freq == 1  # NOTE [ Shallow copies of DeepSeek-V3 ]
    assert transformer_config(_config(), num_layers=6, moe_layer_freq=[0] * 2 + [1] * 4).moe_layer_freq == [0, 0, 1, 1, 1, 1]


def test_the_shared_expert_and_partial_rope_come_from_the_config():  # first tier: plain Python, no megatron
    from batchfit.models import load_config
    from batchfit.models.megatron_glm import glm4_moe_settings, rotary_percent

    air = load_config("glm-4.5-air")
    assert rotary_percent(air) == 0.5 and rotary_percent(load_config("tiny")) == 1.0
    settings = glm4_moe_settings(air)
    assert settings["moe_shared_expert_intermediate_size"] == 1408 and "moe_layer_freq" not in settings  # 1 × 1,408
    assert glm4_moe_settings(air, num_layers=6)["moe_layer_freq"] == 1
    assert glm4_moe_settings(air, num_layers=46) == settings


@pytest.mark.slow  # the CLI's Megatron profile of the tiny GLM-4.5, two pipeline stages simulated
@pytest.mark.timeout(600)
def test_the_cli_profiles_a_glm4_moe_under_megatron_with_its_dense_layer_on_the_first_stage(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(TINY_GLM4_MOE))
    code = main(["profile", "--model", str(tmp_path), "--max-seq-len", "256", "--sharding", "megatron", "--world-size", "4",
                 "--expert-parallel", "2", "--pipeline-parallel", "2", "--last-pipeline-stage-layers", "2",
                 "--distributed-optimizer", "--memory", "1GiB", "--no-progress"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "2 MoE layers (1 dense layer first) of 8 routed + 1 shared experts, 2 per token" in out
    assert "stage 0 (1 layers): " in out and "stage 1 (2 layers): " in out


# ----------------------------------------------------------------- gpt-oss: refused, saying why (NOTE [ gpt-oss under Megatron ])
def test_gpt_oss_is_refused_naming_the_attention_sinks_and_the_fix(megatron):
    from batchfit import InvalidArgument
    from batchfit.models.megatron import transformer_config

    refused = (
        r"model_type='gpt_oss' is a mixture of experts not mapped to Megatron: its attention sinks \(megatron-core 0\.16\.1's "
        r"softmax_type='learnable'\) run fused only in Transformer Engine's attention.*; profile it with --sharding fsdp2$"
    )
    with pytest.raises(InvalidArgument, match=refused):
        transformer_config("gpt-oss-20b", expert_parallel=2)


@pytest.mark.slow  # the CLI's imports and megatron-core
@pytest.mark.timeout(300)
def test_the_cli_refuses_gpt_oss_under_megatron_in_one_line(megatron, capsys):
    from batchfit.cli import main

    args = ["profile", "--model", "gpt-oss-20b", "--sharding", "megatron", "--world-size", "8", "--expert-parallel", "8",
            "--backend", "estimate", "--max-seq-len", "1024", "--no-progress"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "attention sinks" in err and "mbridge 0.15.1 has no gpt-oss bridge" in err and err.endswith("--sharding fsdp2")
    assert "\n" not in err and "Traceback" not in err
