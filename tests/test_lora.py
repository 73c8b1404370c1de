"""LoRA: PEFT's own adapters on the built models, trained alone, measured exactly, read from framework configs.

Figures for the tiny preset (2 layers, hidden 64, 4 heads of 16, 2 KV heads, MLP 176) with
rank 8 on every linear layer but the head, per layer (A is r × in, B is out × r):
q 64→64: 8·64 + 64·8 = 1,024; k, v 64→32: 512 + 256 = 768 each; o 64→64: 1,024;
gate, up 64→176 and down 176→64: 512 + 1,408 = 1,920 each; 9,344 per layer, 18,688 in all,
in 28 tensors (7 modules × A and B × 2 layers).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from batchfit import InvalidArgument
from batchfit.budget import ProfileOptions, profile_model
from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.cli import main
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm, load_config
from batchfit.models.lora import LoraSpec, as_lora, base_model, lora_parameters, lora_spec
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.sharding import Sharding
from batchfit.train.optim import default_optimizer
from multirank import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_ADAPTER_PARAMETERS = 18_688  # see the module docstring
TINY_ADAPTER_TENSORS = 28
RANK8 = LoraSpec(8)


def _estimate():
    return get_backend("estimate", memory_limit="80GiB", reserve_bytes=0, round_to=1)


# --- the spec -------------------------------------------------------------------------------


def test_targets_are_all_linear_or_module_names():
    assert LoraSpec(8).targets == "all-linear"
    assert LoraSpec(8, targets=" q_proj, v_proj ").targets == ("q_proj", "v_proj")
    assert LoraSpec(8, targets=["q_proj", "q_proj", "v_proj"]).targets == ("q_proj", "v_proj")
    assert LoraSpec(64, 128.0).alpha == 128 and isinstance(LoraSpec(64, 128.0).alpha, int)
    assert LoraSpec(64, 128, "q_proj,v_proj").describe() == "LoRA rank 64, alpha 128, q_proj,v_proj"
    assert LoraSpec(0).describe() == "no LoRA" and not LoraSpec(0).enabled
    assert as_lora({"rank": 16, "alpha": 32}) == LoraSpec(16, 32)
    assert as_lora(None) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"rank": -1}, r"rank must be an integer >= 0 \(0: no LoRA\), but got rank=-1", id="negative-rank"
        ),
        pytest.param({"rank": True}, r"rank must be an integer, but got rank=True", id="bool-rank"),
        pytest.param({"rank": "8"}, r"rank must be an integer, but got rank='8'", id="str-rank"),
        pytest.param({"rank": 8, "alpha": 0}, r"alpha must be in \(0, .*but got alpha=0", id="zero-alpha"),
        pytest.param({"rank": 8, "alpha": float("nan")}, r"alpha must be a finite number", id="nan-alpha"),
        pytest.param(
            {"rank": 8, "targets": ""}, r"targets must be 'all-linear' or module names .* with ''", id="empty"
        ),
        pytest.param({"rank": 8, "targets": "q_proj,"}, r"with ''", id="trailing-comma"),
        pytest.param({"rank": 8, "targets": ["q proj"]}, r"with 'q proj'", id="space"),
        pytest.param(
            {"rank": 8, "targets": 5},
            r"targets must be 'all-linear' or module names, but got targets=5",
            id="int",
        ),
        pytest.param(
            {"rank": 8, "targets": "all-linear,q_proj"},
            r"'all-linear' cannot be listed with other names",
            id="mixed",
        ),
        pytest.param({"rank": 8, "targets": []}, r"targets must name at least one module", id="no-targets"),
    ],
)
def test_bad_specs_name_the_field(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        LoraSpec(**kwargs)


def test_options_take_a_spec_or_its_fields_and_name_the_field():
    assert ProfileOptions(max_seq_len=64, lora={"rank": 8}).lora == RANK8
    with pytest.raises(
        InvalidArgument, match=r"lora.rank must be an integer >= 0 \(0: no LoRA\), but got lora.rank=-2"
    ):
        ProfileOptions(max_seq_len=64, lora={"rank": -2})
    with pytest.raises(InvalidArgument, match=r"an unknown key 'dropout' in lora="):
        ProfileOptions(max_seq_len=64, lora={"rank": 8, "dropout": 0.1})
    with pytest.raises(
        InvalidArgument, match=r"lora must be a LoraSpec, a mapping of its fields or None, but got lora=8"
    ):
        ProfileOptions(max_seq_len=64, lora=8)
    assert lora_spec(8, names={"rank": "--lora-rank"}) == RANK8
    with pytest.raises(
        InvalidArgument, match=r"--lora-rank must be an integer >= 0 \(0: no LoRA\), but got --lora-rank=-1"
    ):
        lora_spec(-1, names={"rank": "--lora-rank"})


def test_without_peft_the_lora_path_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(
        InvalidArgument, match=r"LoRA needs PEFT, which is not installed .*pip install -e '\.\[lora\]' in batchfit's checkout"
    ):
        build_causal_lm("tiny", lora=RANK8)
    assert (
        build_causal_lm("tiny", lora=LoraSpec(0)).__class__.__name__ == "LlamaForCausalLM"
    )  # rank 0: no PEFT


# --- the model ------------------------------------------------------------------------------


def test_peft_adapts_every_linear_layer_but_the_head_and_freezes_the_base():
    counts = lora_parameters(load_config("tiny"), RANK8)
    assert counts.trainable == TINY_ADAPTER_PARAMETERS
    assert counts.total == 223_552 + TINY_ADAPTER_PARAMETERS  # the tiny preset's 223,552 parameters
    model = build_causal_lm("tiny", lora=RANK8)
    assert type(model).__name__ == "PeftModelForCausalLM"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == TINY_ADAPTER_TENSORS and all(".lora_" in n for n in trainable)
    assert base_model(model).get_output_embeddings().weight.requires_grad is False  # the head is not adapted
    # q_proj and v_proj only: (1,024 + 768) per layer × 2 layers
    assert lora_parameters(load_config("tiny"), LoraSpec(8, targets="q_proj,v_proj")).trainable == 3_584
    # SkyRL's critic: a plain PeftModel, and all-linear adapts its value head score too (64→1: 512 + 8)
    assert (
        lora_parameters(load_config("tiny"), RANK8, value_head=True).trainable
        == TINY_ADAPTER_PARAMETERS + 520
    )


def test_a_target_that_matches_no_module_lists_the_linear_ones():
    with pytest.raises(
        InvalidArgument,
        match=r"targets='qproj' cannot adapt LlamaForCausalLM .* its linear modules are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
    ):
        build_causal_lm("tiny", lora=LoraSpec(8, targets="qproj"))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adapters_are_fp32_on_a_base_kept_in_its_dtype(dtype):
    for backend in (get_backend("cpu"), _estimate()):
        model = build_causal_lm("tiny", backend=backend, dtype=dtype, lora=RANK8)
        base = {p.dtype for p in model.parameters() if not p.requires_grad}
        adapters = {p.dtype for p in model.parameters() if p.requires_grad}
        assert base == {torch.float32 if dtype == "fp32" else torch.bfloat16} and adapters == {torch.float32}


def test_a_seeded_lora_model_starts_as_the_same_seed_base_model():
    # PEFT's init (B = 0) after transformers' on the base, whose weights are the plain model's
    lora = build_causal_lm("tiny", seed=3, lora=RANK8).eval()
    plain = build_causal_lm("tiny", seed=3).eval()
    adapters = dict(lora.named_parameters())
    assert not adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"].any()
    assert adapters["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].std() > 0
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lora(input_ids=ids).logits, plain(input_ids=ids).logits)
    again = build_causal_lm("tiny", seed=3, lora=RANK8)
    assert all(torch.equal(a, b) for a, b in zip(lora.parameters(), again.parameters()))


def test_the_optimizer_holds_the_adapters_only():
    model = build_causal_lm("tiny", lora=RANK8)
    step = causal_lm_step(model, backend="cpu")
    assert len(step.optimizer.state) == TINY_ADAPTER_TENSORS
    assert all(p.requires_grad for p in step.optimizer.state)
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())  # no base gradients
    breakdown = step.measure([32, 32]).breakdown
    # AdamW's two fp32 moments per adapter parameter, plus one fp32 step count per tensor:
    # 2 × 4 × 18,688 + 4 × 28 = 149,504 + 112
    assert breakdown["optimizer_state"] == 149_616
    assert breakdown["gradients"] == 4 * TINY_ADAPTER_PARAMETERS  # 74,752: fp32 adapter gradients only
    with pytest.raises(InvalidArgument, match=r"parameters must include at least one trainable parameter"):
        default_optimizer([p for p in model.parameters() if not p.requires_grad])


@pytest.mark.parametrize(
    ("build", "step"),
    [
        # the first tier's time (issue 41): bf16 base, checkpointing, forward-only and some targets stay
        pytest.param({}, {}, id="fp32", marks=pytest.mark.slow),
        pytest.param({"dtype": "bf16"}, {}, id="bf16-base-fp32-adapters"),
        pytest.param({"gradient_checkpointing": True}, {"cost": "packed"}, id="checkpointing-packed"),
        pytest.param({"value_head": True}, {}, id="critic", marks=pytest.mark.slow),
        pytest.param({}, {"forward_only": True}, id="forward-only"),
        pytest.param(
            {"lora": LoraSpec(4, targets="q_proj,down_proj")}, {"logprobs": "fused"}, id="some-targets-fused"
        ),
    ],
)
def test_estimate_equals_cpu_to_the_byte(build, step):
    build = {"lora": RANK8, **build}
    measured = []
    for backend in (get_backend("cpu"), _estimate()):
        model = build_causal_lm("tiny", backend=backend, **build)
        probe = causal_lm_step(model, backend=backend, **step)
        m = probe.measure([64, 64, 30])
        measured.append((m.peak_bytes, dict(m.breakdown)))
    assert measured[0] == measured[1]


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_lora_budgets_are_larger_than_full_fine_tuning():
    settings = {
        "max_seq_len": 512,
        "backend": "estimate",
        "memory_limit": "64MiB",
        "reserve_bytes": 0,
        "sharding": Sharding("fsdp2", world_size=2),
        "seq_lens": [512],
        "cost": "packed",
    }
    full = profile_model("tiny", **settings)
    lora = profile_model("tiny", lora=RANK8, **settings)
    assert lora.combined.tokens > full.combined.tokens
    assert full.lora is None and lora.lora.trainable == TINY_ADAPTER_PARAMETERS
    assert lora.to_dict()["lora"] == {
        "rank": 8,
        "alpha": 16,
        "targets": "all-linear",
        "trainable_parameters": TINY_ADAPTER_PARAMETERS,
        "total_parameters": 242_240,
    }
    # the adapters' fp32 gradient half shards in the allocator's 512 B blocks, per layer: q A 4×64×4 B
    # = 2 blocks + B 32×8×4 = 2, k and v 2 + 1 each, o 2 + 2, gate and up 2 + 6 (88×8×4 = 2,816 B)
    # each, down 6 + 2: 38 blocks, 76 for 2 layers = 38,912 B; AdamW twice that plus 28 step counts
    assert lora.combined.breakdown["gradients"] == 38_912
    assert lora.combined.breakdown["optimizer_state"] == 2 * 38_912 + 512 * TINY_ADAPTER_TENSORS
    assert full.combined.breakdown["gradients"] > 10 * 38_912
    # a reference is the frozen base: the same model with or without lora
    ref = profile_model("tiny", roles="reference", lora=RANK8, **settings)
    assert (
        ref.lora is None
        and ref.combined.tokens == profile_model("tiny", roles="reference", **settings).combined.tokens
    )


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shards_frozen_base_and_adapters_in_one_unit_on_simulated_ranks(world):
    backend = _estimate()
    with simulated_world(world):
        model = build_causal_lm(
            "tiny",
            backend=backend,
            lora=RANK8,
            sharding=Sharding("fsdp2", world_size=world),
            gradient_checkpointing=True,
        )
        layer = base_model(model).model.layers[0]
        assert {p.requires_grad for p in layer.parameters()} == {True, False}  # one FSDP unit, both kinds
        m = causal_lm_step(model, backend=backend).measure([64, 64])
    # each rank holds 1/world of the fp32 adapter gradients (every adapter tensor's rows split evenly)
    assert m.breakdown["gradients"] == 4 * TINY_ADAPTER_PARAMETERS // world


def _real_rank(rank: int) -> tuple:
    import torch.distributed as dist

    torch.manual_seed(rank)
    out = {}
    for name, build in (("fsdp2", {}), ("fsdp2-bf16-no-mp", {"dtype": "bf16"})):
        precision = "none" if "no-mp" in name else "bf16"
        sharding = Sharding("fsdp2", world_size=dist.get_world_size(), mixed_precision=precision)
        model = build_causal_lm("tiny", backend="cpu", sharding=sharding, lora=RANK8, seed=5, **build)
        step = causal_lm_step(model, backend=get_backend("cpu"))
        step.measure([48, 48])  # FSDP2 allocates its all-gather buffers lazily in the first step
        m = min((step.measure([48, 48]) for _ in range(3)), key=lambda m: m.peak_bytes)  # see test_shard
        out[name] = (m.peak_bytes, dict(m.breakdown))
    return out


def _estimated(world: int) -> dict:
    out = {}
    with simulated_world(world):
        for name, build in (("fsdp2", {}), ("fsdp2-bf16-no-mp", {"dtype": "bf16"})):
            precision = "none" if "no-mp" in name else "bf16"
            backend = get_backend("estimate", round_to=1, reserve_bytes=0)
            sharding = Sharding("fsdp2", world_size=world, mixed_precision=precision)
            model = build_causal_lm("tiny", backend=backend, sharding=sharding, lora=RANK8, **build)
            m = causal_lm_step(model, backend=backend).measure([48, 48])
            out[name] = (m.peak_bytes, dict(m.breakdown))
    return out


@pytest.mark.slow
def test_estimate_equals_real_fsdp2_gloo_ranks_to_the_byte():
    real = run_ranks(_real_rank, world=2, timeout=240)
    assert real[0] == _estimated(2)


# --- the command line -----------------------------------------------------------------------

# 1 GiB, not more: the tiny model's budgets stay small, and so do the estimate's probes
FAST = ["--model", "tiny", "--max-seq-len", "256", "--backend", "estimate", "--memory", "1GiB", "--no-progress"]


@pytest.mark.slow
def test_profile_names_lora_in_its_header_and_json(capsys):
    assert main(["profile", *FAST, "--world-size", "2", "--lora-rank", "8", "--lora-alpha", "32"]) == 0
    out = capsys.readouterr().out
    assert (
        "LoRA rank 8, alpha 32, all-linear: 18,688 trainable parameters of 242,240 (7.71%); the base frozen in "
        "float32 (no gradients, no optimizer state), the adapters in float32 with AdamW"
    ) in out
    assert main(["profile", *FAST, "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lora"]["targets"] == ["q_proj", "v_proj"] and data["lora"]["trainable_parameters"] == 3_584
    assert main(["profile", *FAST, "--lora-rank", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora"] is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--lora-rank", "-4"],
            "--lora-rank must be an integer >= 0 (0: no LoRA), but got --lora-rank=-4",
            id="negative",
        ),
        pytest.param(
            ["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be in (0, ", id="zero-alpha"
        ),
        pytest.param(
            ["--lora-rank", "8", "--lora-alpha", "inf"],
            "--lora-alpha must be a finite number",
            id="inf-alpha",
        ),
        pytest.param(
            ["--lora-rank", "8", "--lora-targets", "q proj"],
            "--lora-targets must be 'all-linear' or module names",
            id="bad-name",
        ),
        pytest.param(
            ["--lora-rank", "8", "--lora-targets", "qproj"],
            "--lora-targets='qproj' cannot adapt LlamaForCausalLM",
            id="no-such-module",
        ),
        pytest.param(
            ["--lora-rank", "eight"], "argument --lora-rank: invalid int value: 'eight'", id="not-int"
        ),
        pytest.param(["--lora-alpha", "32"], "--lora-alpha needs --lora-rank N", id="alpha-without-rank"),
        pytest.param(
            ["--lora-targets", "q_proj"], "--lora-targets needs --lora-rank N", id="targets-without-rank"
        ),
    ],
)
def test_bad_lora_flags_give_one_line_errors_and_exit_2(capsys, argv, message):
    assert _exit_code(["profile", *FAST, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("batchfit profile: error: ") and message in err


def _exit_code(argv: list[str]) -> int:
    """``main(argv)``, with argparse's usage errors (SystemExit) turned into their exit code."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


# --- framework configs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("vocabulary", "role", "flat", "expected"),
    [
        pytest.param(
            "verl",
            "policy",
            {
                "actor_rollout_ref.model.lora_rank": 64,
                "actor_rollout_ref.model.lora_alpha": 128,
                "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
            },
            LoraSpec(64, 128, ("q_proj", "v_proj")),
            id="verl-policy",
        ),
        pytest.param(
            "verl",
            "policy",
            {"actor_rollout_ref.model.lora_rank": "32"},  # a command-line override; verl's defaults
            LoraSpec(32, 16, "all-linear"),
            id="verl-defaults",
        ),
        pytest.param(
            "verl",
            "critic",
            {"critic.model.lora_rank": 8, "critic.model.target_modules": "all-linear"},
            LoraSpec(8),
            id="verl-critic",
        ),
        pytest.param(
            "skyrl",
            "policy",
            {"trainer.policy.model.lora.rank": 16, "trainer.policy.model.lora.alpha": "32"},
            LoraSpec(16, 32),
            id="skyrl-policy",
        ),
        pytest.param(
            "skyrl",
            "critic",
            {"trainer.critic.model.lora.rank": 4, "trainer.critic.model.lora.target_modules": ["down_proj"]},
            LoraSpec(4, 16, ("down_proj",)),
            id="skyrl-critic",
        ),
        pytest.param(
            "flat",
            "policy",
            {"lora_rank": 8, "lora_targets": "q_proj,k_proj"},
            LoraSpec(8, 16, "q_proj,k_proj"),
            id="flat",
        ),
        pytest.param("verl", "policy", {"actor_rollout_ref.model.lora_rank": 0}, None, id="rank-0"),
        pytest.param("verl", "policy", {}, None, id="unset"),
        # verl's model.lora block is Megatron's: the FSDP engine reads lora_rank only
        pytest.param("verl", "policy", {"actor_rollout_ref.model.lora.rank": 64}, None, id="megatron-block"),
        pytest.param("skyrl", "policy", {"trainer.critic.model.lora.rank": 8}, None, id="critic-only"),
    ],
)
def test_read_lora_reads_each_vocabulary(vocabulary, role, flat, expected):
    from batchfit.frameworks.lora_keys import read_lora

    assert read_lora(flat, vocabulary, role=role) == expected


@pytest.mark.parametrize(
    ("vocabulary", "flat", "match"),
    [
        pytest.param(
            "verl",
            {"actor_rollout_ref.model.lora_rank": -8},
            r"actor_rollout_ref.model.lora_rank must be an integer >= 0 \(0: no LoRA\), but got actor_rollout_ref.model.lora_rank=-8",
            id="negative",
        ),
        pytest.param(
            "skyrl",
            {"trainer.policy.model.lora.rank": 8, "trainer.policy.model.lora.alpha": 0},
            r"trainer.policy.model.lora.alpha must be in \(0, ",
            id="alpha",
        ),
        pytest.param(
            "skyrl",
            {"trainer.policy.model.lora.rank": 8, "trainer.policy.model.lora.alpha": "high"},
            r"trainer.policy.model.lora.alpha must be a finite number, but got trainer.policy.model.lora.alpha='high'",
            id="alpha-text",
        ),
        pytest.param(
            "verl",
            {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.target_modules": ".*proj"},
            r"actor_rollout_ref.model.target_modules='.\*proj': PEFT reads a string other than 'all-linear' as a regular expression",
            id="regex-targets",
        ),
        pytest.param(
            "verl",
            {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.target_modules": ["q proj"]},
            r"actor_rollout_ref.model.target_modules must be 'all-linear' or module names",
            id="bad-name",
        ),
        pytest.param("openrlhf", {}, r"vocabulary must be one of", id="vocabulary"),
    ],
)
def test_read_lora_names_the_key_of_a_bad_value(vocabulary, flat, match):
    from batchfit.frameworks.lora_keys import read_lora

    with pytest.raises(InvalidArgument, match=match):
        read_lora(flat, vocabulary)


def test_a_readers_lora_mapping_is_a_spec():
    from batchfit.frameworks.lora_keys import as_lora_spec

    given = {"rank": 64, "alpha": None, "target_modules": None, "exclude_modules": ["o_proj"]}
    assert as_lora_spec(given) == LoraSpec(64)
    assert as_lora_spec({"rank": "0"}) is None and as_lora_spec(LoraSpec(0)) is None
    with pytest.raises(
        InvalidArgument, match=r"run.lora must be a LoraSpec or a mapping with 'rank', but got run.lora=64"
    ):
        as_lora_spec(64, "run.lora")


def _verl_lora_config(tmp_path, **model) -> dict:
    directory = tmp_path / "tiny-model"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(load_config("tiny").to_dict())))
    return {
        "data": {"train_batch_size": 16, "max_prompt_length": 64, "max_response_length": 192},
        "actor_rollout_ref": {
            "model": {"path": str(directory), "enable_gradient_checkpointing": True, **model},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 8, "use_kl_loss": True},
            "rollout": {"n": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }


@pytest.mark.slow
def test_a_verl_config_with_lora_rank_gets_a_larger_policy_budget_and_no_reference_model(tmp_path):
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.lora_keys import read_lora
    from batchfit.frameworks.run_profile import profile_run
    from batchfit.frameworks.source import flatten

    options = ProfileOptions(
        max_seq_len=256,
        backend="estimate",
        memory_limit="48MiB",
        reserve_bytes=0,
        engine_reserve=0,  # the engine's term is tests/test_engine.py's
        sharding=Sharding("fsdp2", world_size=2),
        gradient_checkpointing=True,
        cost="packed",
        seq_lens=[256],  # one length: the comparison, not the curve
    )
    run = read_run_config(_verl_lora_config(tmp_path))
    full = profile_run(run, options.replace(lora=LoraSpec(0)))  # rank 0: full fine-tuning
    config = _verl_lora_config(tmp_path, lora_rank=8, lora_alpha=16)
    spec = read_lora(flatten(config), "verl")
    assert spec == RANK8
    lora = profile_run(run, options.replace(lora=spec))
    assert lora.budgets["policy"].tokens > full.budgets["policy"].tokens
    assert lora.profiles["policy"].lora.trainable == TINY_ADAPTER_PARAMETERS
    assert lora.to_dict()["profiles"]["policy"]["lora"]["rank"] == 8
    # verl's ref_in_actor: the reference log-probs come from the LoRA actor, adapters disabled
    assert "reference" in full.profiles and "reference" not in lora.profiles
    assert any("ref_in_actor" in note for note in lora.to_dict()["notes"]) and not full.notes


def _generated_verl(model_dir, lora_rank: int) -> dict:
    """verl 0.9.1's generated ppo_trainer config (strategy fsdp: FSDP1) on ``model_dir``, with ``lora_rank``."""
    from pathlib import Path

    import yaml

    import batchfit.frameworks

    text = (Path(batchfit.frameworks.__file__).parent / "defaults" / "verl.yaml").read_text()
    config = yaml.safe_load(text)
    config["actor_rollout_ref"]["model"]["path"] = str(model_dir)
    config["actor_rollout_ref"]["model"]["lora_rank"] = lora_rank
    config["critic"]["model"]["path"] = str(model_dir)
    return config


@pytest.mark.slow
def test_verls_generated_fsdp1_config_with_lora_rank_64_gets_a_larger_policy_budget(tmp_path):
    # NOTE [ LoRA under FSDP1 ] in batchfit.parallel.fsdp1: on main this config was refused
    # ("sharding='fsdp1' with LoRA adapters is not modelled"); a Qwen2.5-0.5B-shaped directory
    # (rank 64 is 1/14 of its width: the adapters' activations cost less than the state they save)
    from batchfit.budget.choices import Choices
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.frameworks.run_profile import profile_run

    directory = tmp_path / "qwen"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(dict(load_config("qwen2.5-0.5b").to_dict())))
    chosen = Choices(backend="estimate", memory_limit="h100-80gb")
    results = {}
    for rank in (0, 64):
        made = run_profile_options(read_run_config(_generated_verl(directory, rank)), chosen)
        assert made.options.sharding.strategy == "fsdp1"  # verl's strategy: fsdp
        options = made.options.replace(seq_lens=[made.options.max_seq_len])  # one length: the comparison
        results[rank] = profile_run(made.run, options)
    full, lora = results[0], results[64]
    assert lora.profiles["policy"].lora.spec == LoraSpec(64)
    assert full.profiles["policy"].lora is None
    assert lora.budgets["policy"].tokens > full.budgets["policy"].tokens
