"""Expert parallelism around transformers' grouped experts (batchfit.parallel.expert_parallel) on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from batchfit.errors import InvalidArgument
from batchfit.models.moe import received_rows
from batchfit.parallel.expert_parallel import check_expert_group, shard_experts
from multirank import run_ranks

# The experts of one layer of tests/test_moe.py's small Qwen3-MoE: 8 experts, 2 per token.
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
}
TOKENS = 96  # per rank


def _experts() -> torch.nn.Module:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model(**CONFIG)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    return experts.to(torch.bfloat16)


def _inputs(world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every rank's tokens (the same on every rank: seeded): hidden, router's choice and weights, the output's cotangent."""
    g = torch.Generator().manual_seed(1)
    n = world * TOKENS
    hidden = torch.randn(n, CONFIG["hidden_size"], generator=g).to(torch.bfloat16)
    logits = torch.randn(n, CONFIG["num_experts"], generator=g)
    weights, index = torch.topk(torch.softmax(logits, -1), CONFIG["num_experts_per_tok"], dim=-1)
    cotangent = torch.randn(n, CONFIG["hidden_size"], generator=g).to(torch.bfloat16)
    return hidden, index, weights.to(torch.bfloat16), cotangent


def _values_worker(rank: int, world: int) -> dict[str, float]:
    hidden, index, weights, cotangent = _inputs(world)
    full = _experts()
    h = hidden.clone().requires_grad_(True)
    ref = full(h, index, weights)
    (ref.float() * cotangent.float()).sum().backward()
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    ep = _experts()
    assert shard_experts(ep, world, rank) == 1
    local = ep.num_experts // world
    h_local = hidden[mine].clone().requires_grad_(True)
    out = ep(h_local, index[mine], weights[mine])
    (out.float() * cotangent[mine].float()).sum().backward()
    experts = slice(rank * local, (rank + 1) * local)

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    return {
        "shape": tuple(ep.gate_up_proj.shape),
        "output": diff(out, ref[mine]),
        "hidden_grad": diff(h_local.grad, h.grad[mine]),
        "gate_up_grad": diff(ep.gate_up_proj.grad, full.gate_up_proj.grad[experts]),
        "down_grad": diff(ep.down_proj.grad, full.down_proj.grad[experts]),
    }


@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.timeout(180)
def test_the_ep_layer_equals_the_unsharded_layer_forward_and_grads_on_2_ranks():
    got = run_ranks(_values_worker, 2, world=2)
    for rank, r in got.items():
        assert r["shape"] == (4, 64, 64), (rank, r)  # 4 of the 8 experts, gate_up [2·32, 64]
        for name in ("output", "hidden_grad", "gate_up_grad", "down_grad"):
            assert r[name] < 1e-2, (rank, name, r)  # bf16: the sums run in other orders


def _peak_worker(rank: int, world: int, routing: str) -> dict[str, int]:
    from batchfit.memory import get_backend
    from batchfit.models.moe import routing_fixed

    hidden, index, weights, _ = _inputs(world)
    mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
    peaks = {}
    for name in ("cpu", "estimate"):
        backend = get_backend(name, round_to=1) if name == "estimate" else get_backend(name)
        with backend.context():
            ep = _experts() if name == "cpu" else _estimate_experts()
            shard_experts(ep, world, rank, symmetric=True)
            h = hidden[mine].clone().requires_grad_(True) if name == "cpu" else torch.randn(TOKENS, CONFIG["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
            top_k_index = index[mine].clone()
            top_k_weights = weights[mine].clone() if name == "cpu" else torch.rand(TOKENS, CONFIG["num_experts_per_tok"], dtype=torch.bfloat16)

        def step(ep=ep, h=h, top_k_index=top_k_index, top_k_weights=top_k_weights):
            with routing_fixed(ep, routing):
                ep(h, top_k_index, top_k_weights).float().sum().backward()

        state = [*ep.parameters(), h, top_k_index, top_k_weights]
        peaks[name] = backend.measure(step, register=state).peak_bytes
    return peaks


def _estimate_experts() -> torch.nn.Module:
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = AutoConfig.for_model(**CONFIG)
    config._experts_implementation = "grouped_mm"
    prior = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # .to() under the fake mode fails: build in bf16
    try:
        return Qwen3MoeExperts(config)
    finally:
        torch.set_default_dtype(prior)


@pytest.mark.slow  # 2 gloo ranks
@pytest.mark.timeout(180)
@pytest.mark.parametrize("routing", ["skewed", "balanced"])
def test_the_ep_layer_estimate_equals_cpu_to_the_byte_on_2_ranks_and_rank_0_receives_the_most(routing):
    got = run_ranks(_peak_worker, 2, routing, world=2)
    for rank, peaks in got.items():
        assert peaks["estimate"] == peaks["cpu"], (rank, peaks)
    if routing == "skewed":  # NOTE [ The rank that receives the most ]: rank 0 holds experts 0 and 1
        assert got[0]["cpu"] > got[1]["cpu"], got
    else:
        assert got[0]["cpu"] == got[1]["cpu"], got


def test_the_receiving_rank_s_rows_are_integers_of_the_routing():
    # skewed: 4 spread tokens hit each of 8 experts once; the other 92 go to experts 0 and 1 (rank 0's)
    assert received_rows(TOKENS, 2, 8, 2, "skewed") == 2 * (4 + 92 * 2)
    assert received_rows(TOKENS, 2, 8, 2, "balanced") == TOKENS * 2
    assert received_rows(8192, 8, 128, 8, "skewed") == 8 * (16 + (8192 - 16) * 8)  # qwen3-30b-a3b at EP 8: 16 spread pairs reach rank 0


def test_an_ep_size_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(InvalidArgument, match=r"expert_parallel=3 must divide the 8 experts"):
        check_expert_group(8, 3, 0)
    with pytest.raises(InvalidArgument, match=r"ep_rank must be in 0 … 1"):
        check_expert_group(8, 2, 2)
    assert shard_experts(torch.nn.Linear(2, 2), 1, 0) == 0


# The whole small Qwen3-MoE of tests/test_moe.py (2 layers of 8 experts, 2 per token), FSDP2 with EP 2.
SMALL_MOE = {**CONFIG, "num_hidden_layers": 2, "max_position_embeddings": 4096, "norm_topk_prob": True}
LENGTHS = [64, 64, 40]


def _model_peaks(backend: Any, world: int, ep: int) -> tuple[int, dict[str, int], tuple[int, ...]]:
    from transformers import AutoConfig

    from batchfit.budget.causal_lm_probe import causal_lm_step
    from batchfit.models import build_causal_lm
    from batchfit.parallel.sharding import Sharding

    sharding = Sharding("fsdp2", world_size=world, expert_parallel=ep)
    model = build_causal_lm(AutoConfig.for_model(**SMALL_MOE), backend=backend, sharding=sharding, routing="skewed", experts_implementation="grouped_mm")
    step = causal_lm_step(model, backend=backend)
    step.measure(LENGTHS)  # FSDP2 allocates its all-gather buffers lazily in the first step
    m = min((step.measure(LENGTHS) for _ in range(3)), key=lambda m: m.peak_bytes)
    shapes = tuple(p.to_local().shape[0] for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    return m.peak_bytes, dict(m.breakdown), shapes


def _model_rank(rank: int, ep: int) -> tuple:
    import torch.distributed as dist

    from batchfit.memory import get_backend

    torch.manual_seed(rank)
    return _model_peaks(get_backend("cpu"), dist.get_world_size(), ep)


@pytest.mark.slow  # 4 gloo ranks and the estimate, FSDP2 steps of a small MoE
@pytest.mark.timeout(400)
def test_fsdp2_with_ep_2_over_4_ranks_estimate_equals_the_receiving_gloo_ranks_to_the_byte():
    from batchfit.memory import get_backend
    from batchfit.parallel.distributed import simulated_world

    real = run_ranks(_model_rank, 2, world=4, timeout=300)
    with simulated_world(4):
        predicted = _model_peaks(get_backend("estimate", round_to=1, reserve_bytes=0), 4, 2)
    # a (2, 2) mesh, EP fastest: ranks 0 and 2 are EP rank 0 (experts 0-3, sharded over the two of them)
    assert predicted[2] == (2, 2) and all(r[2] == (2, 2) for r in real.values())
    assert predicted[0] == real[0][0] == real[2][0] == max(r[0] for r in real.values()), (predicted, real)
    assert predicted[1] == real[0][1]


@pytest.mark.slow  # 2 gloo ranks and the estimate, FSDP2 steps of a small MoE
@pytest.mark.timeout(300)
def test_fsdp2_with_ep_2_estimate_equals_the_receiving_gloo_rank_to_the_byte():
    from batchfit.memory import get_backend
    from batchfit.parallel.distributed import simulated_world

    real = run_ranks(_model_rank, 2, world=2, timeout=240)
    with simulated_world(2):
        predicted = _model_peaks(get_backend("estimate", round_to=1, reserve_bytes=0), 2, 2)
    assert real[0][2] == predicted[2] == (4, 4)  # each rank holds 4 of the 8 experts of each layer
    assert predicted[0] == real[0][0], (predicted, real[0])  # rank 0 receives the most (worst routing)
    assert predicted[1] == real[0][1]
    assert real[0][0] > real[1][0], real


@pytest.mark.slow  # the CLI's imports and a few probes of a small MoE on the estimate
def test_the_cli_accepts_expert_parallel_2_and_states_the_receiving_rank(tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(SMALL_MOE))
    args = ["profile", "--model", str(tmp_path), "--backend", "estimate", "--memory", "1GiB", "--max-seq-len", "512", "--world-size", "2", "--no-progress", "--json"]
    assert main([*args, "--expert-parallel", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    profile = next(iter(out["profiles"].values())) if "profiles" in out else out
    assert profile["moe"]["expert_parallel"] == 2 and profile["moe"]["routing"] == "skewed"
    assert profile["sharding"]["expert_parallel"] == 2
    assert main([*args[:-1], "--expert-parallel", "2"]) == 0
    assert "budgeted for the rank that receives the most, all 2 ranks' tokens routed to its experts" in capsys.readouterr().out


# ----------------------------------------------------------------- prime-rl's trainer.model.ep
def _prime_rl(**model_keys: Any) -> dict:
    """examples/prime_rl_rl.toml with ``trainer.model`` keys set (``model`` the top-level ``model.name``)."""
    from pathlib import Path

    import tomllib

    data = tomllib.loads((Path(__file__).resolve().parent.parent / "examples" / "prime_rl_rl.toml").read_text(encoding="utf-8"))
    if "model" in model_keys:
        data["model"]["name"] = model_keys.pop("model")
    if "gpus" in model_keys:
        data["deployment"]["num_train_gpus"] = model_keys.pop("gpus")
    data.setdefault("trainer", {}).setdefault("model", {}).update(model_keys)
    return data


@pytest.mark.parametrize(
    ("keys", "ep"),
    [
        # resolve_ep (prime-rl 559b4477 parallel_dims.py): a MoE gets min(GPUs // dp_replicate, 8)
        pytest.param({"model": "qwen3-30b-a3b"}, 4, id="auto-moe-4-gpus"),  # min(4 // 1, 8) = 4
        pytest.param({"model": "qwen3-30b-a3b", "gpus": 1}, 1, id="auto-moe-1-gpu"),  # min(1, 8)
        pytest.param({"model": "qwen3-0.6b"}, 1, id="auto-dense"),  # not a MoE: 1
        pytest.param({"model": "qwen3-30b-a3b", "impl": "hf"}, 1, id="auto-hf-impl"),  # impl hf: 1
        pytest.param({"model": "qwen3-30b-a3b", "ep": 2}, 2, id="explicit"),
        pytest.param({"model": "qwen3-30b-a3b", "ep": 1}, 1, id="explicit-1"),
    ],
)
def test_prime_rls_ep_resolves_as_prime_rl_resolves_it(keys, ep):
    from batchfit.frameworks import prime_rl

    run = prime_rl.read(_prime_rl(**keys), {})
    assert run.expert_parallel == ep and not run.faults


def test_prime_rls_auto_ep_caps_at_8_gpus():
    from batchfit.frameworks import prime_rl

    data = _prime_rl(model="qwen3-30b-a3b")
    data["deployment"] = {"type": "multi_node", "gpus_per_node": 8, "num_train_nodes": 2, "num_infer_nodes": 1}
    run = prime_rl.read(data, {})
    assert run.expert_parallel == 8  # min(16 // 1, 8)
    assert any("min(16 GPUs // dp_replicate 1, 8) = 8" in note for note in run.notes)


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        pytest.param({"ep": 3}, r"ep=3 does not divide the trainer's 4 GPUs", id="not-a-divisor"),
        pytest.param({"ep": 2, "impl": "hf"}, r"EP is only supported with the custom implementation", id="hf-impl"),
        pytest.param({"ep": 0}, r"ep=0 must be a positive integer", id="zero"),
    ],
)
def test_an_ep_prime_rl_refuses_is_a_fault(keys, match):
    from batchfit.frameworks import prime_rl

    run = prime_rl.read(_prime_rl(model="qwen3-30b-a3b", **keys), {})
    assert run.expert_parallel == 1 and any(__import__("re").search(match, f) for f in run.faults), run.faults


def test_a_prime_rl_moe_config_profiles_with_its_ep():
    from batchfit.budget.choices import Choices
    from batchfit.frameworks import prime_rl
    from batchfit.frameworks.config_options import run_profile_options

    made = run_profile_options(prime_rl.read(_prime_rl(model="qwen3-30b-a3b"), {}), Choices())
    sharding = made.options.sharding
    assert (sharding.strategy, sharding.world_size, sharding.expert_parallel) == ("fsdp2", 4, 4)
    dense = run_profile_options(prime_rl.read(_prime_rl(model="qwen3-0.6b"), {}), Choices())
    assert dense.options.sharding.expert_parallel == 1


@pytest.mark.slow  # the CLI's imports and the probes of a small MoE on the estimate
def test_a_prime_rl_config_with_ep_2_profiles_the_receiving_rank(tmp_path, capsys):
    import json
    from pathlib import Path

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(SMALL_MOE))
    example = (Path(__file__).resolve().parent.parent / "examples" / "prime_rl_rl.toml").read_text(encoding="utf-8")
    text = example.replace('"qwen3-0.6b"', json.dumps(str(tmp_path))).replace("seq_len = 8192", "seq_len = 512")
    path = tmp_path / "rl.toml"
    path.write_text(text.replace("[trainer.model.ac]", "[trainer.model]\nep = 2\n\n[trainer.model.ac]"), encoding="utf-8")
    args = ["profile", "--config", str(path), "--backend", "estimate", "--memory", "1GiB", "--reserve", "0",
            "--engine-reserve", "0", "--no-progress", "--json"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    profile = next(iter(out["profiles"].values())) if "profiles" in out else out
    assert profile["sharding"]["expert_parallel"] == 2 and profile["moe"]["routing"] == "skewed"
