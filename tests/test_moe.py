"""Mixtures of experts: presets, the experts implementation, fixed routing, the report's header (batchfit.models.moe)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from batchfit.budget import profile_model
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.errors import InvalidArgument
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm, list_presets, load_config, preset_info
from batchfit.models.moe import (
    EXPERTS_IMPLEMENTATIONS,
    check_expert_parallel,
    default_experts_implementation,
    experts_modules,
    fixed_routing,
    moe_fields,
    moe_summary,
    routing_fixed,
    shared_experts,
)

# A small Qwen3-MoE: 2 layers of 8 experts, 2 per token.
SMALL_MOE = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "norm_topk_prob": True,
}
LENGTHS = [256, 256, 200]


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model(**SMALL_MOE)


def _peak(backend_name: str, implementation: str, routing: str | None) -> int:
    backend = (
        get_backend("estimate", memory_limit="1GiB", reserve_bytes=0, round_to=1)
        if backend_name == "estimate"
        else get_backend(backend_name)
    )
    torch.manual_seed(0)
    model = build_causal_lm(_config(), backend=backend, dtype="bf16", experts_implementation=implementation, routing=routing)
    assert model.config._experts_implementation == implementation
    return causal_lm_step(model, backend=backend).measure(LENGTHS).peak_bytes


def test_moe_presets_name_their_experts():
    # values of the hub's config.json files: experts per layer, per token
    expected = {
        "qwen3-30b-a3b": (128, 8),
        "qwen3-235b-a22b": (128, 8),
        "deepseek-v3": (256, 8),
        "glm-4.5-air": (128, 8),
        "gpt-oss-20b": (32, 4),
    }
    assert set(expected) <= set(list_presets())
    for name, fields in expected.items():
        assert moe_fields(SimpleNamespace(**preset_info(name)["config"])) == fields
    assert moe_fields(SimpleNamespace(**preset_info("qwen3-8b")["config"])) is None


@pytest.mark.slow  # builds the 30B preset on meta (seconds)
def test_summary_counts_total_and_active_parameters():
    s = moe_summary(load_config("qwen3-30b-a3b"))
    # Qwen's card: 30.5B parameters, 3.3B activated; 48 MoE layers
    assert round(s.total_parameters / 1e9, 1) == 30.5 and round(s.active_parameters / 1e9, 1) == 3.4
    assert (s.moe_layers, s.experts, s.experts_per_token) == (48, 128, 8)
    assert s.implementation == default_experts_implementation() == "grouped_mm" and s.routing == "any"
    assert "30.5B parameters, 3.35B active" in s.describe()


# A small DeepSeek-V2 (V2-Lite's shape, scaled down): 3 layers, the first dense; 8 routed + 2 shared experts, 2 per token.
SMALL_DEEPSEEK = {
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "vocab_size": 512,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
}


def test_the_moe_line_names_deepseek_s_shared_experts_and_dense_layers():
    from transformers import AutoConfig

    summary = moe_summary(AutoConfig.for_model(**SMALL_DEEPSEEK))  # built on meta
    assert (summary.experts, summary.shared_experts, summary.moe_layers, summary.dense_layers) == (8, 2, 2, 1)
    assert "2 MoE layers (1 dense layer first) of 8 routed + 2 shared experts, 2 per token;" in summary.describe()
    assert "8 routed + 2 shared experts, 2 per token" in summary.short()
    assert summary.to_dict()["shared_experts"] == 2
    # Qwen3-MoE has none; Qwen2-MoE's one gated shared expert is told by its intermediate size
    assert shared_experts(_config()) == 0
    assert shared_experts(SimpleNamespace(shared_expert_intermediate_size=5632)) == 1
    assert "8 experts, 2 per token" in moe_summary(_config()).short()


def test_fewer_experts_than_fsdp2_ranks_is_said_one_expert_per_rank():
    summary = moe_summary(_config())  # 8 experts
    note = summary.expert_shard_note(16)
    # ceil(8 / 16) = 1 expert row per rank, padded: ranks 8..15 hold padding only
    assert note.startswith("FSDP2 shards each layer's expert parameters along their 8 experts: over 16 ranks each rank")
    assert "(8 of the 16 ranks hold padding only)" in note and "are 1/8 of them, not 1/16" in note
    assert summary.expert_shard_note(8) is None and summary.expert_shard_note(4) is None


def test_an_fsdp2_expert_shard_never_holds_less_than_one_expert():
    # the fact the note states, on PyTorch's own fully_shard over a simulated group of 16
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from batchfit.parallel import simulated_world

    with simulated_world(16):
        module = torch.nn.Module()
        module.experts = torch.nn.Parameter(torch.zeros(8, 32, 16))  # [experts, 2·I, H]
        fully_shard(module, mesh=init_device_mesh("cpu", (16,)))
        shard = module._get_fsdp_state()._fsdp_param_group.fsdp_params[0]._sharded_param_data
    # one expert's 32 × 16 = 512 elements per rank, not 8 × 512 / 16 = 256
    assert shard.numel() == 512


def test_fixed_routing_is_integers_of_the_asked_shape():
    skewed = fixed_routing(7, 2, 8, "skewed", "cpu")
    # ceil(8 / 2) = 4 tokens hit every expert once, the other 3 go to experts 0 and 1
    assert skewed.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [0, 1], [0, 1]]
    balanced = fixed_routing(8, 2, 8, "balanced", "cpu")
    assert torch.bincount(balanced.flatten(), minlength=8).tolist() == [2] * 8  # 8 tokens × 2 / 8 experts


@pytest.mark.slow  # a real forward of the small MoE
def test_routing_fixed_replaces_the_routers_choice_and_is_undone():
    model = build_causal_lm(_config(), dtype="bf16", experts_implementation="eager")
    seen = []
    ids = torch.randint(0, 512, (1, 16))
    with routing_fixed(model, "skewed") as hooked:
        handles = [m.register_forward_pre_hook(lambda m, a: seen.append(a[1].clone())) for m in experts_modules(model)]
        model(input_ids=ids)
    fixed = [[0, 1], [2, 3], [4, 5], [6, 7]] + [[0, 1]] * 12
    assert hooked == 2 and len(seen) == 2 and all(t.tolist() == fixed for t in seen)
    seen.clear()
    model(input_ids=ids)
    assert len(seen) == 2 and any(t.tolist() != fixed for t in seen)  # the router's own choice again
    for h in handles:
        h.remove()


@pytest.mark.slow  # six real cpu steps (seconds each)
def test_grouped_mm_estimate_equals_cpu_and_no_routing_changes_its_peak():
    estimate = _peak("estimate", "grouped_mm", None)
    # balanced, random (the router's own choice on random weights) and maximally skewed routing
    peaks = {routing: _peak("cpu", "grouped_mm", routing) for routing in ("balanced", None, "skewed")}
    assert set(peaks.values()) == {estimate}, peaks


@pytest.mark.slow  # real cpu steps of the per-expert loop
def test_eager_loop_runs_on_the_estimate_with_integer_routing_and_its_budget_covers_the_worst_case():
    from batchfit.memory.shadow_values import UnknownValuesError

    with pytest.raises(UnknownValuesError, match=r"aten.nonzero"):  # the router's float choice: nonzero cannot run
        _peak("estimate", "eager", None)
    worst = _peak("estimate", "eager", "skewed")
    assert worst == _peak("cpu", "eager", "skewed")  # to the byte
    # the budget, found on the estimate with the worst case, covers the real worst case and any routing
    profile = profile_model(
        _config(), max_seq_len=256, backend="estimate", memory_limit="48MiB", reserve_bytes=0, experts_implementation="eager",
        seq_lens=[256], compare_routing=True,
    )
    assert profile.moe.routing == "skewed" and profile.moe.balanced_tokens is not None
    rows = profile.combined.tokens // 256
    limit = profile.combined.limit_bytes
    backend = get_backend("cpu")
    for routing in ("skewed", "balanced", None):
        torch.manual_seed(1)
        model = build_causal_lm(_config(), backend=backend, dtype="bf16", experts_implementation="eager", routing=routing)
        peak = causal_lm_step(model, backend=backend, optimizer="adamw").measure([256] * rows).peak_bytes
        assert peak <= limit, (routing, peak, limit)
        # the estimate's peak at the budget (its allocations rounded to 512 B blocks) covers the real one
        assert peak <= profile.combined.binding_point.peak_bytes


@pytest.mark.slow  # a profile (seconds)
def test_the_profile_header_names_moe():
    profile = profile_model(_config(), max_seq_len=128, backend="estimate", memory_limit="64MiB", reserve_bytes=0, seq_lens=[128])
    moe = profile.to_dict()["moe"]
    assert moe["experts"] == 8 and moe["experts_per_token"] == 2 and moe["moe_layers"] == 2
    assert moe["experts_implementation"] == "grouped_mm" and moe["routing"] == "any"
    assert profile_model("tiny", max_seq_len=128, backend="estimate", memory_limit="64MiB", reserve_bytes=0, seq_lens=[128]).moe is None


@pytest.mark.parametrize(
    ("call", "match"),
    [
        pytest.param(lambda: check_expert_parallel("--expert-parallel", 0), r"--expert-parallel 0: the expert-parallel size must be a positive integer", id="ep"),
        pytest.param(
            lambda: build_causal_lm(_config(), experts_implementation="megablocks"),
            r"experts_implementation must be one of 'grouped_mm', 'batched_mm', 'eager'",
            id="implementation",
        ),
        pytest.param(lambda: build_causal_lm(_config(), routing="random"), r"routing must be one of", id="routing"),
    ],
)
def test_bad_moe_settings_are_refused(call, match):
    with pytest.raises(InvalidArgument, match=match):
        call()
    check_expert_parallel("--expert-parallel", 1)  # 1 is no expert parallelism
    check_expert_parallel("--expert-parallel", 8)  # checked against the world and the experts where they are known
    assert EXPERTS_IMPLEMENTATIONS == ("grouped_mm", "batched_mm", "eager")


@pytest.mark.slow  # a verl run's five passes on the estimate (tens of seconds)
def test_a_verl_config_whose_model_is_moe_profiles_every_pass_with_it(tmp_path, capsys):
    import json

    import yaml

    from batchfit.cli import main

    model_dir = tmp_path / "small-moe"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMALL_MOE))
    config = {
        "data": {"train_batch_size": 16, "max_prompt_length": 32, "max_response_length": 96},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir), "enable_gradient_checkpointing": True},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 8, "use_kl_loss": True},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(config))
    fast = ["--backend", "estimate", "--memory", "128MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress"]
    args = ["profile", "--config", str(path), *fast, "--experts-implementation", "eager", "--compare-routing", "--emit", "verl"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    roles = {role for p in data["profiles"].values() for role in p["budgets"]}
    assert roles == {"policy", "policy_forward", "reference"}
    for profile in data["profiles"].values():  # every pass measured the per-expert loop on the worst case
        assert profile["moe"]["experts_implementation"] == "eager" and profile["moe"]["routing"] == "skewed"
        assert profile["moe"]["balanced_tokens"] is not None  # the balanced budget beside the worst case's


@pytest.mark.slow  # the CLI's imports
def test_the_cli_refuses_expert_parallelism_on_a_dense_model_in_one_line(capsys):
    from batchfit.cli import main

    assert main(["profile", "--model", "tiny", "--backend", "estimate", "--memory", "1GiB", "--expert-parallel", "2", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "expert_parallel=2 needs a mixture of experts" in err


@pytest.mark.slow  # two real cpu steps
def test_the_router_logits_and_aux_loss_are_counted_as_the_model_allocates_them():
    # output_router_logits=True: the model keeps every layer's router logits and computes the
    # load-balancing loss in its forward; the estimate counts them as the cpu run allocates them
    peaks = []
    for name in ("cpu", "estimate"):
        backend = get_backend(name) if name == "cpu" else get_backend("estimate", memory_limit="1GiB", reserve_bytes=0, round_to=1)
        config = _config()
        config.output_router_logits = True
        model = build_causal_lm(config, backend=backend, dtype="bf16")
        peaks.append(causal_lm_step(model, backend=backend).measure(LENGTHS).peak_bytes)
        if name == "cpu":  # the model's own code computes them in this build
            out = model(input_ids=torch.randint(0, 512, (1, 16)))
            assert out.aux_loss is not None and len(out.router_logits) == 2
    assert peaks[0] == peaks[1]


@pytest.mark.slow  # the 30B preset's first probes on the estimate (seconds)
def test_qwen3_30b_a3b_answers_at_8k_on_8_h100_naming_the_moe(capsys):
    from batchfit.cli import main

    # fsdp2 × 8, fp32 master weights: the sharded state alone is 30,532,122,624 × 16 B / 8 = 56.9 GiB per rank
    assert main(["profile", "--model", "qwen3-30b-a3b", "--max-seq-len", "8192", "--world-size", "8", "--no-progress"]) == 1  # does not fit
    err = capsys.readouterr().err
    assert "mixture of experts (30.5B parameters, 3.35B active, 128 experts, 8 per token, experts grouped_mm)" in err
    assert "parameters 14.22 GiB" in err and "--offload cpu" in err and "--world-size 16" in err
