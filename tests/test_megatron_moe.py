"""Megatron-core's mixture of experts on CPU ranks (batchfit.models.moe_megatron): a tiny Qwen3-MoE under expert parallelism.

The cpu backend on real gloo ranks is the referee of the estimate backend, as in
tests/test_megatron_step.py: the first step of a fresh model with EP 2 on 2 ranks, to the byte,
the receiving rank (EP rank 0, NOTE [ The Megatron probe's worst rank ]) simulated. Skipped where
megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

# tests/test_expert_parallel.py's small Qwen3-MoE: 8 experts of 32, 2 per token, 2 layers
CONFIG = {
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
ROWS, SEQ = 1, 64


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model(**CONFIG)


def _step(backend_name: str, ep: int, data_parallel: int, routing: str = "skewed", **kwargs):
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    return MegatronStep(
        _config(),
        data_parallel=data_parallel,
        expert_parallel=ep,
        routing=routing,
        backend=get_backend(backend_name, round_to=1),
        dtype=torch.bfloat16,
        attention="sdpa",
        **kwargs,
    )


def _measure(backend_name: str, ep: int, data_parallel: int, routing: str = "skewed") -> dict[str, object]:
    got = _step(backend_name, ep, data_parallel, routing).measure([SEQ] * ROWS)
    return {"peak": got.peak_bytes, "breakdown": dict(got.breakdown)}


def _real_rank(rank: int, runs: tuple[tuple[int, int, str], ...]) -> list[dict[str, object]]:
    return [_measure("cpu", *run) for run in runs]


#: (expert_parallel, data_parallel, routing) of each 2-rank run
RUNS = ((2, 2, "skewed"), (2, 2, "balanced"), (1, 2, "skewed"))
IDS = ["ep2-skewed", "ep2-balanced", "ep1"]


@pytest.fixture(scope="module")
def real_runs():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(_real_rank, RUNS, world=2, timeout=400)


@pytest.mark.slow  # 2 gloo ranks, then the estimate
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", RUNS, ids=IDS)
def test_ep_estimate_equals_the_receiving_gloo_rank_to_the_byte(megatron, real_runs, run):
    real = real_runs[0][RUNS.index(run)]  # rank 0: EP rank 0, which receives the most under the skewed routing
    estimate = _measure("estimate", *run)
    assert (real["peak"], real["breakdown"]) == (estimate["peak"], estimate["breakdown"])


def _real_rank_4(rank: int) -> dict[str, object]:
    got = _step("cpu", 2, 2, tensor_parallel=2, sequence_parallel=True).measure([SEQ] * ROWS)
    return {"peak": got.peak_bytes, "breakdown": dict(got.breakdown)}


@pytest.mark.slow  # 4 gloo ranks, then the estimate
@pytest.mark.timeout(900)
def test_tp2_sp_ep2_estimate_equals_the_receiving_gloo_rank_to_the_byte(megatron):
    # tensor 2 (sequence parallel) × data 2, experts over EP 2 with Megatron's default expert TP (= tensor_parallel)
    real = run_ranks(_real_rank_4, world=4, timeout=600)
    estimate = _step("estimate", 2, 2, tensor_parallel=2, sequence_parallel=True).measure([SEQ] * ROWS)
    assert (real[0]["peak"], real[0]["breakdown"]) == (estimate.peak_bytes, dict(estimate.breakdown))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_receiving_rank_holds_more_than_the_other_under_the_worst_routing(megatron, real_runs):
    skewed, balanced = (real_runs[rank][0] for rank in (0, 1)), None
    rank0, rank1 = skewed
    assert rank0["peak"] > rank1["peak"]  # EP rank 0 receives both ranks' pairs for experts 0 and 1
    balanced = [real_runs[rank][1]["peak"] for rank in (0, 1)]
    assert rank0["peak"] > max(balanced)


@pytest.mark.slow  # the estimate alone, a few seconds
def test_ep_2_halves_the_expert_parameters_per_rank(megatron):
    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.parallel.distributed import simulated_world

    counts = {}
    for ep in (1, 2):
        with simulated_world(2), model_parallel(1, 1, expert_parallel=ep), megatron_cpu_patches():
            model = build_gpt_model(_config(), expert_parallel=ep, initialise=False)
            counts[ep] = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # 2 layers × 8 experts × (64·2·32 fc1 + 32·64 fc2) = 2 × 8 × 6,144 = 98,304; EP 2 keeps 4 experts a layer
    assert counts == {1: 98_304, 2: 49_152}


def test_expert_parallelism_on_a_dense_model_is_refused(megatron):
    from batchfit.models.megatron import transformer_config

    with pytest.raises(InvalidArgument, match=r"expert_parallel=2, expert_tensor_parallel=1 need a mixture of experts"):
        transformer_config("tiny", expert_parallel=2)


def test_an_expert_group_that_does_not_divide_a_stage_is_refused():  # first tier: no megatron needed
    with pytest.raises(InvalidArgument, match=r"expert_parallel × expert_tensor_parallel = 4 × 1 must divide"):
        _step("estimate", 4, 2)
    with pytest.raises(InvalidArgument, match=r"routing"):
        _step("estimate", 2, 2, routing="random")


def test_the_fixed_top_k_gathers_the_scores_at_the_fixed_routing():  # first tier: Megatron's replay hook, plain torch
    import torch

    from batchfit.models.moe import fixed_routing
    from batchfit.models.moe_megatron import FixedTopK

    scores = torch.randn(10, 8, requires_grad=True)
    probs, index = FixedTopK("skewed", 8).get_replay_topk(scores, 2)
    assert torch.equal(index, fixed_routing(10, 2, 8, "skewed", "cpu"))
    # skewed: the first ceil(8 / 2) = 4 tokens hit every expert once, the other 6 experts 0 and 1
    assert index[:4].flatten().tolist() == list(range(8)) and index[4:].tolist() == [[0, 1]] * 6
    assert torch.equal(probs, scores.gather(1, index))
    probs.sum().backward()
    assert scores.grad.sum() == 20  # the router's gradient flows through every chosen score


def test_a_name_megatron_leaves_undefined_is_defined_while_active_and_removed_after():
    import types

    from batchfit.models.moe_megatron import _UnsetNameDefined

    owner = types.SimpleNamespace(kept="theirs", empty=None)
    missing, empty, kept = (_UnsetNameDefined(lambda: owner, name, "ours") for name in ("te_general_gemm", "empty", "kept"))
    with missing.active(), empty.active(), kept.active():
        assert (owner.te_general_gemm, owner.empty, owner.kept) == ("ours", "ours", "theirs")
    assert not hasattr(owner, "te_general_gemm") and owner.empty is None and owner.kept == "theirs"


def test_the_mapping_is_mbridges_with_sequential_experts(megatron):
    from batchfit.models.megatron import transformer_config

    config = transformer_config(_config(), expert_parallel=2)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 32)
    assert (config.moe_token_dispatcher_type, config.moe_grouped_gemm, config.expert_model_parallel_size) == ("alltoall", False, 2)
    assert config.moe_router_load_balancing_type == "none"  # mbridge's "default None for RL"


def test_megatron_sharding_takes_expert_parallelism_that_divides_a_stage():  # first tier
    from batchfit.parallel import Sharding

    assert Sharding("megatron", world_size=8, pipeline_parallel=2, expert_parallel=4).expert_parallel == 4
    with pytest.raises(InvalidArgument, match=r"expert_parallel=8 must divide a pipeline stage's 4 ranks"):
        Sharding("megatron", world_size=8, pipeline_parallel=2, expert_parallel=8)
    with pytest.raises(InvalidArgument, match=r"needs strategy='fsdp2' .* or 'megatron'"):
        Sharding("fsdp1", world_size=8, expert_parallel=2)


@pytest.mark.slow  # the CLI's imports and a few estimate probes of the small MoE under Megatron
@pytest.mark.timeout(600)
def test_the_cli_profiles_megatron_with_expert_parallelism(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["profile", "--model", str(tmp_path), "--sharding", "megatron", "--world-size", "2", "--backend", "estimate",
            "--memory", "1GiB", "--max-seq-len", "256", "--no-progress", "--json"]  # fmt: skip
    tokens = {}
    for ep in (1, 2):
        assert main([*args, "--expert-parallel", str(ep)]) == 0
        out = json.loads(capsys.readouterr().out)
        profile = next(iter(out["profiles"].values())) if "profiles" in out else out
        assert profile["sharding"].get("expert_parallel", 1) == ep
        tokens[ep] = profile["budgets"]["policy"]["tokens"]
    # EP 2 holds half the experts (less state) but receives both ranks' pairs for experts 0 and 1 (more activations)
    assert tokens[1] != tokens[2]


def test_a_megatron_profile_states_the_experts_and_the_receiving_rank():  # first tier: no build
    from batchfit.budget.megatron_profile import megatron_moe_summary
    from batchfit.parallel import Sharding

    moe = megatron_moe_summary(_config(), Sharding("megatron", world_size=2, expert_parallel=2))
    said = moe.describe()
    # Megatron-core's SequentialMLP, not transformers' experts; every router fixed to the worst case
    assert "experts SequentialMLP (Megatron-core's default: TEGroupedMLP), routing fixed as the worst case" in said
    assert "expert parallel 2: 4 experts per rank; budgeted for the rank that receives the most" in said
    assert moe.to_dict()["experts_implementation"] == "SequentialMLP" and "runs_in" not in moe.to_dict()
    assert megatron_moe_summary(_dense(), Sharding("megatron", world_size=2)) is None


def _dense():
    from batchfit.models import load_config

    return load_config("tiny")


# ----------------------------------------------------------------- the frameworks' Megatron EP keys
def test_verls_megatron_expert_parallel_size_is_profiled_and_emitted():  # first tier: reading and emitting only
    import copy
    from pathlib import Path

    import yaml

    from batchfit.budget.choices import Choices
    from batchfit.budget.options import ProfileOptions
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.assumptions import setting_keys
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.run_profile import role_options
    from batchfit.frameworks.verl import megatron_refusal
    from batchfit.parallel import Sharding

    data = copy.deepcopy(yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "verl_megatron.yaml").read_text()))
    data["actor_rollout_ref"]["actor"]["megatron"]["expert_model_parallel_size"] = 2
    run = read_run_config(data)
    assert run.expert_parallel == 2 and megatron_refusal(run) is None
    sharding = run_profile_options(run, Choices()).options.sharding
    # the example's 8 GPUs as tensor 2 × pipeline 2 × data 2: EP 2 within a stage's 4 ranks
    assert (sharding.strategy, sharding.tensor_parallel, sharding.pipeline_parallel, sharding.expert_parallel) == ("megatron", 2, 2, 2)
    values = {"max_seq_len": 512, "cost": "packed", "dtype": "bf16", "gradient_checkpointing": True}
    options = ProfileOptions(sharding=sharding, **values)
    keys = {k.path: k for k in setting_keys(run, role_options(run, options), "verl") if k.path}
    key = keys["actor_rollout_ref.actor.megatron.expert_model_parallel_size"]
    assert key.value == 2 and "the rank receiving the most tokens" in key.comment
    dense = ProfileOptions(sharding=Sharding("megatron", world_size=8, tensor_parallel=2, pipeline_parallel=2), **values)
    assert {k.path: k.value for k in setting_keys(run, role_options(run, dense), "verl")}["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == 1


def test_skyrls_megatron_expert_parallel_size_is_profiled_and_emitted():  # first tier: reading and emitting only
    import copy
    from pathlib import Path

    import yaml

    from batchfit.budget.choices import Choices
    from batchfit.budget.options import ProfileOptions
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.assumptions import setting_keys
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.run_profile import role_options
    from batchfit.frameworks.skyrl import megatron_refusal

    data = copy.deepcopy(yaml.safe_load((Path(__file__).resolve().parent.parent / "examples" / "skyrl_megatron.yaml").read_text()))
    for role in ("policy", "ref"):
        data["trainer"][role]["megatron_config"]["expert_model_parallel_size"] = 2
    run = read_run_config(data)
    assert run.expert_parallel == 2 and megatron_refusal(run) is None
    sharding = run_profile_options(run, Choices()).options.sharding
    assert (sharding.strategy, sharding.expert_parallel) == ("megatron", 2)
    options = ProfileOptions(sharding=sharding, max_seq_len=512, cost="packed", dtype="bf16", gradient_checkpointing=True)
    keys = {k.path: k for k in setting_keys(run, role_options(run, options), "skyrl") if k.path}
    key = keys["trainer.policy.megatron_config.expert_model_parallel_size"]
    assert key.value == 2 and "the rank receiving the most tokens" in key.comment
    assert keys["trainer.ref.megatron_config.expert_model_parallel_size"].value == 2


def test_slimes_expert_model_parallel_size_is_profiled_and_emitted(tmp_path):  # first tier: reading and emitting only
    from pathlib import Path

    from batchfit.budget.choices import Choices
    from batchfit.budget.options import ProfileOptions
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.assumptions import setting_keys
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.run_profile import role_options
    from batchfit.frameworks.run_step import megatron_heads

    script = (Path(__file__).resolve().parent.parent / "examples" / "slime_megatron.sh").read_text()
    path = tmp_path / "run.sh"
    path.write_text(script.replace("--context-parallel-size 1", "--context-parallel-size 1\n   --expert-model-parallel-size 2"))
    run = read_run_config(path)
    assert run.expert_parallel == 2
    sharding = run_profile_options(run, Choices()).options.sharding
    assert (sharding.strategy, sharding.expert_parallel) == ("megatron", 2)
    # slime's own head (--emit slime refuses another: run_step.megatron_heads)
    options = ProfileOptions(sharding=sharding, max_seq_len=512, cost="packed", dtype="bf16", gradient_checkpointing=True,
                             logprobs=megatron_heads(run))  # fmt: skip
    keys = {k.path: k for k in setting_keys(run, role_options(run, options), "slime") if k.path}
    key = keys["--expert-model-parallel-size"]
    assert key.value == 2 and "the rank receiving the most tokens" in key.comment


@pytest.mark.parametrize(
    ("sizes", "label"),
    [
        ({"world_size": 16, "expert_parallel": 8}, " (dense 1/16, experts 1/2 shard)"),  # experts over 16 / 8 ranks
        ({"world_size": 8, "tensor_parallel": 2, "context_parallel": 2}, " (1/4 shard)"),  # data 2 × context 2
        ({"world_size": 2, "tensor_parallel": 2}, ""),  # no data-parallel rank to shard over
    ],
)
def test_the_distributed_optimizers_shard_is_named_as_megatron_lays_it_out(sizes, label):
    from batchfit.cli.render_budget import _distributed_optimizer_shard
    from batchfit.parallel import Sharding

    assert _distributed_optimizer_shard(Sharding("megatron", distributed_optimizer=True, **sizes)) == label


@pytest.mark.slow  # two searches of the small MoE under Megatron
@pytest.mark.timeout(600)
def test_compare_routing_sets_the_balanced_budget_beside_the_worst_case(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["profile", "--model", str(tmp_path), "--sharding", "megatron", "--world-size", "2", "--expert-parallel", "2",
            "--backend", "estimate", "--memory", "1GiB", "--max-seq-len", "256", "--no-progress", "--json",
            "--compare-routing"]  # fmt: skip
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    profile = next(iter(out["profiles"].values())) if "profiles" in out else out
    moe, worst = profile["moe"], profile["budgets"]["policy"]["tokens"]
    # every router balanced: EP rank 0 receives its own share, not both ranks' pairs
    assert moe["routing"] == "skewed" and moe["balanced_tokens"] > worst


@pytest.mark.slow  # two searches of the small MoE under Megatron on a simulated world of 4
@pytest.mark.timeout(600)
def test_expert_tensor_parallelism_splits_the_experts_as_megatron_does(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["profile", "--model", str(tmp_path), "--sharding", "megatron", "--world-size", "4", "--tensor-parallel", "2",
            "--megatron-sequence-parallel", "--expert-parallel", "2", "--backend", "estimate", "--memory", "1GiB",
            "--max-seq-len", "256", "--no-progress", "--json"]  # fmt: skip  (Megatron's MoE needs SP with TP)
    tokens = {}
    for etp in (None, 1):
        assert main(args + ([] if etp is None else ["--expert-tensor-parallel", str(etp)])) == 0
        out = json.loads(capsys.readouterr().out)
        profile = next(iter(out["profiles"].values())) if "profiles" in out else out
        assert profile["sharding"].get("expert_tensor_parallel") == etp
        tokens[etp] = profile["budgets"]["policy"]["tokens"]
    # expert TP 1 keeps each of the rank's experts whole (Megatron's default splits them over TP 2)
    assert tokens[1] != tokens[None]


@pytest.mark.slow  # imports megatron-core
def test_a_mixture_of_experts_under_tensor_parallelism_without_sequence_parallelism_is_refused(megatron, tmp_path, capsys):
    import json

    from batchfit.cli import main

    # megatron-core's MoELayer raises a ValueError mid-step; batchfit refuses in one line, naming the fix
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    args = ["profile", "--model", str(tmp_path), "--sharding", "megatron", "--world-size", "4", "--tensor-parallel", "2",
            "--expert-parallel", "2", "--backend", "estimate", "--memory", "1GiB", "--max-seq-len", "256", "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "needs Megatron's sequence parallelism" in err and "--megatron-sequence-parallel" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("framework", ["verl", "skyrl"])
def test_the_frameworks_expert_tensor_parallel_size_is_profiled_and_emitted(framework):  # first tier: no build
    import copy
    from pathlib import Path

    import yaml

    from batchfit.budget.choices import Choices
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.assumptions import setting_keys
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.run_profile import role_options

    example = Path(__file__).resolve().parent.parent / "examples" / f"{framework}_megatron.yaml"
    data = copy.deepcopy(yaml.safe_load(example.read_text()))
    if framework == "verl":
        node, key = data["actor_rollout_ref"]["actor"]["megatron"], "actor_rollout_ref.actor.megatron."
    else:
        node, key = data["trainer"]["policy"]["megatron_config"], "trainer.policy.megatron_config."
    node.update(expert_model_parallel_size=4, expert_tensor_parallel_size=1)  # what MoE configs set beside EP
    run = read_run_config(data)
    assert (run.expert_parallel, run.expert_tensor_parallel) == (4, 1)
    assert not [w for w in run.warnings if "expert_tensor_parallel_size" in w]  # profiled, no longer warned
    options = run_profile_options(run, Choices()).options
    assert options.sharding.expert_tensor_parallel == 1
    keys = {k.path: k.value for k in setting_keys(run, role_options(run, options), framework) if k.path}
    assert keys[key + "expert_tensor_parallel_size"] == 1 and keys[key + "expert_model_parallel_size"] == 4
    node.pop("expert_tensor_parallel_size")  # null: Megatron's default, nothing written
    run = read_run_config(data)
    assert run.expert_tensor_parallel is None
    keys = {k.path for k in setting_keys(run, role_options(run, run_profile_options(run, Choices()).options), framework)}
    assert key + "expert_tensor_parallel_size" not in keys


#: router settings the frameworks set that change what the router keeps (slime's --moe-aux-loss-coeff with
#: --moe-router-load-balancing-type, --moe-router-dtype, --moe-z-loss-coeff: Megatron-LM's flags of these fields)
ROUTER_SETTINGS = (
    {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3},
    {"moe_router_dtype": "fp32"},
    {"moe_z_loss_coeff": 1e-3},
)


def _router_rank(rank: int) -> list[tuple[int, int]]:
    return _router_twice("cpu")


def _router_twice(backend_name: str) -> list[tuple[int, int]]:
    # every setting twice in one process: a step starts without the router's globals the one before made
    # (NOTE [ Megatron's MoE globals start fresh in every step ]: the aux loss's second step was 8 B lower)
    return [_router_measure(backend_name, settings) for settings in ROUTER_SETTINGS * 2]


def _router_measure(backend_name: str, settings: dict) -> tuple[int, int]:
    got = _step(backend_name, 2, 2, **settings).measure([SEQ] * ROWS)
    return got.peak_bytes, dict(got.breakdown)["activations"]


@pytest.mark.slow  # 2 gloo ranks, then the estimate
@pytest.mark.timeout(900)
def test_router_losses_and_fp32_logits_estimate_equals_the_gloo_rank_and_cost_memory(megatron):
    passes = run_ranks(_router_rank, world=2, timeout=400)[0]
    estimate = _router_twice("estimate")
    assert estimate[3:] == estimate[:3]  # the second pass equals the first: NOTE [ Megatron's MoE globals start fresh in every step ]
    # the real rank's lower of its two passes, as tests/test_megatron_step.py takes it: one loaded fresh-clone CI run
    # saw a first pass 46,272 B above (2026-12-03, not reproduced in 25 tries since, loaded or not); a late gloo
    # release is the likely cause. Both passes were equal in every run since the globals start fresh.
    real = [min(first, second) for first, second in zip(passes[:3], passes[3:])]
    assert real == estimate[:3]
    # against mbridge's Qwen3-MoE (no auxiliary loss, router in bf16), 3,412,268 B at EP 2 skewed (RUNS[0]):
    # the auxiliary loss keeps its fp32 scores, fp32 logits their copy, the z-loss its logsumexp
    assert [peak - 3_412_268 for peak, _ in real] == [4_240, 7_136, 268]


@pytest.mark.slow  # builds the tiny Qwen3-MoE twice under the estimate
def test_a_probe_leaves_no_model_alive(megatron):
    import gc

    from megatron.core.distributed import DistributedDataParallel

    def alive() -> int:
        gc.collect()
        return sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())

    # NOTE [ A MoE dispatcher keeps its step's graph ]: each probe's model stayed alive (one more DDP a probe)
    step, before = _step("estimate", 2, 2), alive()
    for _ in range(2):
        step.measure([SEQ] * ROWS)
    assert alive() == before
