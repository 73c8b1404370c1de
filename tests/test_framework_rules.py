"""The frameworks' own batch rules: batchfit faults exactly when SkyRL 0.4.0 / verl 0.9.1 refuse.

Each referee below re-states, in a few lines, what the framework's code asserts (cited per
line) on the sizes of one config; hypothesis then draws sizes and GPU counts and checks that
``read_run_config(config).plan()`` raises iff the referee refuses. The message tests read
each rule's words back: the keys, the values and the fix.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchConfigError
from batchfit.frameworks import read_run_config

# ------------------------------------------------------------------ SkyRL 0.4.0


def skyrl_refuses(c: dict) -> bool:
    """What SkyRL 0.4.0 asserts on ``c``'s sizes, at start-up and in the synchronous trainer."""
    try:
        # skyrl/train/utils/utils.py validate_batch_sizes, in its order
        assert c["train"] >= c["mini"]
        assert c["mini"] > 0
        if c["critic"]:
            assert c["train"] >= c["critic_mini"]
            assert c["critic_mini"] > 0
        assert c["micro"] > 0
        assert c["forward"] > 0
        p_dp = c["p_world"] // c["p_sp"]
        assert c["train"] % c["mini"] == 0
        per = c["mini"] * c["n"] // p_dp  # ZeroDivisionError when the world is smaller than sp
        assert per > 0
        assert per % c["micro"] == 0
        assert c["train"] * c["n"] // p_dp % per == 0
        c_dp = c["c_world"] // c["c_sp"]
        if c["critic"]:
            assert c["train"] % c["critic_mini"] == 0
            c_per = c["critic_mini"] * c["n"] // c_dp
            assert c_per > 0
            assert c_per % c["micro"] == 0
            assert c["train"] * c["n"] // c_dp % c_per == 0
        dps = [p_dp]
        if c["ref"]:
            r_dp = c["r_world"] // c["r_sp"]
            dps.append(r_dp)
        assert c["train"] * c["n"] >= math.lcm(*dps)
        # workers/worker.py: init_device_mesh((world // sp, sp)) needs world % sp == 0
        assert c["p_world"] % c["p_sp"] == 0
        assert not c["critic"] or c["c_world"] % c["c_sp"] == 0
        assert not c["ref"] or c["r_world"] % c["r_sp"] == 0
        # trainer.py _remove_tail_data over WorkerDispatch.get_lcm_dp_size (policy, critic, ref),
        # then preprocess.py compute_prompt_mini_batch_boundaries: num_prompts == train_batch_size
        lcm_all = math.lcm(*dps, *([c_dp] if c["critic"] else []))
        stride = lcm_all // math.gcd(lcm_all, c["n"])
        kept = c["train"] if stride <= 1 else c["train"] // stride * stride
        assert kept == c["train"]
    except (AssertionError, ZeroDivisionError):
        return True
    return False


def skyrl_config(c: dict) -> dict:
    """``c`` as a SkyRL config; placement apart, so that only the batch rules decide."""
    return {
        "trainer": {
            "train_batch_size": c["train"],
            "policy_mini_batch_size": c["mini"],
            "critic_mini_batch_size": c["critic_mini"],
            "micro_train_batch_size_per_gpu": c["micro"],
            "micro_forward_batch_size_per_gpu": c["forward"],
            "max_tokens_per_microbatch": c.get("tokens", -1),
            "placement": {
                "colocate_all": False,
                "colocate_policy_ref": False,
                "policy_num_nodes": 1,
                "policy_num_gpus_per_node": c["p_world"],
                "critic_num_nodes": 1,
                "critic_num_gpus_per_node": c["c_world"],
                "ref_num_nodes": 1,
                "ref_num_gpus_per_node": c["r_world"],
            },
            "policy": {"sequence_parallel_size": c["p_sp"]},
            "critic": {
                "model": {"path": "critic" if c["critic"] else None},
                "sequence_parallel_size": c["c_sp"],
            },
            "ref": {"sequence_parallel_size": c["r_sp"]},
            "algorithm": {"use_kl_loss": c["ref"], "use_kl_in_reward": False, "advantage_estimator": "grpo"},
        },
        "generator": {"n_samples_per_prompt": c["n"], "step_wise_trajectories": c.get("step_wise", False)},
    }


def batchfit_refuses(config: dict) -> bool:
    try:
        read_run_config(config).plan()
    except BatchConfigError:
        return True
    return False


sizes = st.integers(0, 24)
gpus = st.integers(1, 8)
sp_sizes = st.sampled_from([1, 1, 2, 3, 4])


@pytest.mark.slow  # the first tier's time (issue 29): SkyRL's own cases and the rule tests stay fast
@settings(max_examples=300, deadline=None)
@given(
    train=st.integers(1, 48),
    mini=sizes,
    critic_mini=sizes,
    micro=st.integers(0, 6),
    forward=st.integers(0, 3),
    n=st.integers(1, 8),
    p_world=gpus,
    p_sp=sp_sizes,
    critic=st.booleans(),
    c_world=gpus,
    c_sp=sp_sizes,
    ref=st.booleans(),
    r_world=gpus,
    r_sp=sp_sizes,
    tokens=st.sampled_from([-1, 4096]),
    step_wise=st.booleans(),
)
def test_batchfit_faults_a_skyrl_config_iff_skyrl_refuses_it(**c):
    assert batchfit_refuses(skyrl_config(c)) == skyrl_refuses(c)


def _skyrl_case(**changes) -> dict:
    """SkyRL's own validate_batch_sizes test's base case (tests/cpu/test_trainer.py), with changes."""
    c = dict(
        train=128, mini=16, critic_mini=8, micro=2, forward=4, n=2, p_world=4, p_sp=1, c_world=4, c_sp=1,
        critic=False, ref=False, r_world=1, r_sp=1,
    )  # fmt: skip
    c.update(changes)
    return c


# SkyRL 0.4.0's own cases (test_validate_batch_sizes, test_validate_batch_sizes_lcm_dp_requirement):
# (changes to the base case, SkyRL refuses). The referee must agree with SkyRL's verdict, and batchfit too.
SKYRL_CASES = [
    pytest.param({}, False, id="valid"),
    pytest.param({"train": 8, "mini": 16}, True, id="train-below-mini"),
    pytest.param(
        {"train": 4, "critic_mini": 8, "critic": True, "mini": 4}, True, id="train-below-critic-mini"
    ),
    pytest.param({"mini": 0}, True, id="mini-zero"),
    pytest.param({"critic_mini": 0, "critic": True}, True, id="critic-mini-zero"),
    pytest.param({"micro": 0}, True, id="micro-zero"),
    pytest.param({"forward": 0}, True, id="forward-zero"),
    pytest.param({"train": 100, "mini": 16}, True, id="train-not-multiple"),
    pytest.param(
        {"train": 100, "mini": 5, "critic_mini": 16, "critic": True}, True, id="critic-not-multiple"
    ),
    pytest.param({"mini": 8, "n": 1, "p_world": 1, "micro": 3}, True, id="micro-does-not-divide"),
    pytest.param(
        {"train": 144, "mini": 12, "critic_mini": 8, "n": 1, "c_world": 1, "micro": 3, "critic": True},
        True,
        id="critic-micro",
    ),
    pytest.param({"p_sp": 2, "c_sp": 2, "p_world": 8, "c_world": 8}, False, id="sequence-parallel"),
    pytest.param({"train": 100, "mini": 5, "critic_mini": 16}, False, id="no-critic-model"),
    pytest.param({"critic_mini": 0}, False, id="no-critic-model-zero-mini"),
    pytest.param({"train": 10, "mini": 5, "p_world": 2, "micro": 1, "n": 1}, True, id="train-per-gpu"),
    pytest.param(
        {
            "train": 10,
            "mini": 10,
            "p_world": 1,
            "critic_mini": 5,
            "c_world": 2,
            "micro": 1,
            "n": 1,
            "critic": True,
        },
        True,
        id="critic-train-per-gpu",
    ),
    pytest.param(
        {"train": 5, "mini": 5, "micro": 1, "forward": 1, "n": 1, "p_world": 2, "r_world": 3, "ref": True},
        True,
        id="lcm-with-reference",
    ),
    pytest.param(
        {"train": 6, "mini": 6, "micro": 1, "forward": 1, "n": 1, "p_world": 2, "r_world": 3, "ref": True},
        False,
        id="lcm-met",
    ),
    pytest.param(
        {"train": 2, "mini": 2, "micro": 1, "forward": 1, "n": 1, "p_world": 2}, False, id="lcm-no-reference"
    ),
]


@pytest.mark.parametrize(("changes", "refused"), SKYRL_CASES)
def test_skyrls_own_cases_come_out_as_skyrl_decides_them(changes, refused):
    c = _skyrl_case(**changes)
    assert skyrl_refuses(c) == refused  # the referee agrees with SkyRL's own test
    assert batchfit_refuses(skyrl_config(c)) == refused


def test_the_issues_skyrl_example_is_a_fault_not_a_padding_warning():
    # 10 prompts, mini-batch 5, one sample, 2 GPUs: 5 // 2 = 2 per GPU, 10 // 2 = 5 per GPU, 5 % 2 != 0
    c = _skyrl_case(train=10, mini=5, n=1, p_world=2, micro=1)
    with pytest.raises(BatchConfigError) as info:
        read_run_config(skyrl_config(c)).plan()
    assert info.value.faults == [
        "the policy's samples per GPU per step, trainer.train_batch_size × generator.n_samples_per_prompt // "
        "dp_size = 10 × 1 // 2 = 5, are not a multiple of its samples per GPU per mini-batch, "
        "trainer.policy_mini_batch_size × generator.n_samples_per_prompt // dp_size = 5 × 1 // 2 = 2 (SkyRL 0.4.0 "
        "skyrl/train/utils/utils.py validate_batch_sizes floors both and asserts it): set "
        "trainer.policy_mini_batch_size to 2 or 10 (divides trainer.train_batch_size=10, and its floored per-GPU "
        "count divides the step's, 5)"
    ]


# ------------------------------------------------------------------ verl 0.9.1 (V1 trainer)


def verl_refuses(c: dict) -> bool:
    """What verl 0.9.1 asserts on ``c``'s sizes, at start-up and in its V1 trainer's first step."""
    world, dp, dynamic = c["world"], c["world"] // c["sp"], c["dynamic"]
    try:
        if not dynamic:
            # verl/utils/config.py validate_config: real_train_batch_size % n_gpus (FSDP)
            assert c["train"] * c["n"] % world == 0
            # ActorConfig.__post_init__ / validate; check_mutually_exclusive for the rollout
            assert c["micro"] is not None
            assert c["train"] >= c["mini"]
            assert c["forward"] is not None
        if c["critic"] and not dynamic:  # critic.use_dynamic_bsz follows the actor's by default
            assert c["critic_micro"] is not None  # CriticConfig.__post_init__
            assert c["train"] >= c["critic_mini"]  # CriticConfig.validate
        # engine/fsdp/transformer_impl.py: init_device_mesh((world // sp, sp))
        assert world % c["sp"] == 0
        c_dp = world // c["c_sp"] if c["critic"] else None
        assert not c["critic"] or world % c["c_sp"] == 0
        # trainer_base.py: pad the step to a multiple of lcm(dp, mini × n, critic mini × n)
        minis = [c["mini"] * c["n"]] + ([c["critic_mini"] * c["n"]] if c["critic"] else [])
        multiple = math.lcm(dp, *minis)
        padded = -(-c["train"] * c["n"] // multiple) * multiple
        # engine_workers.py train_mini_batch: mini_batch_size % dp == 0
        assert c["mini"] * c["n"] % dp == 0
        assert not c["critic"] or c["critic_mini"] * c["n"] % c_dp == 0
        if not dynamic:
            # engine/utils.py prepare_micro_batches: the micro size divides each GPU's batch
            assert c["mini"] * c["n"] // dp % c["micro"] == 0  # the actor's update
            assert padded // dp % c["forward"] == 0  # the old-log-prob pass
    except AssertionError:
        return True
    return False


def verl_config(c: dict) -> dict:
    actor = {
        "ppo_mini_batch_size": c["mini"],
        "use_dynamic_bsz": c["dynamic"],
        "ppo_max_token_len_per_gpu": 4096,
    }
    actor["fsdp_config"] = {"ulysses_sequence_parallel_size": c["sp"]}
    if c["micro"] is not None:
        actor["ppo_micro_batch_size_per_gpu"] = c["micro"]
    rollout = {"n": c["n"], "log_prob_max_token_len_per_gpu": 4096}
    if c["forward"] is not None:
        rollout["log_prob_micro_batch_size_per_gpu"] = c["forward"]
    critic = {
        "enable": c["critic"],
        "ppo_mini_batch_size": c["critic_mini"],
        "fsdp": {"ulysses_sequence_parallel_size": c["c_sp"]},
    }
    if c["critic_micro"] is not None:
        critic["ppo_micro_batch_size_per_gpu"] = c["critic_micro"]
    return {
        "data": {"train_batch_size": c["train"], "max_prompt_length": 512, "max_response_length": 512},
        "actor_rollout_ref": {"actor": actor, "rollout": rollout},
        "critic": critic,
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": c["world"]},
    }


maybe_micro = st.one_of(st.none(), st.integers(1, 6))


@settings(max_examples=200, deadline=None)
@given(
    train=st.integers(1, 40),
    mini=st.integers(1, 24),
    n=st.integers(1, 6),
    micro=maybe_micro,
    forward=maybe_micro,
    world=gpus,
    sp=st.sampled_from([1, 1, 2, 3]),
    dynamic=st.booleans(),
    critic=st.booleans(),
    critic_mini=st.integers(1, 24),
    critic_micro=maybe_micro,
    c_sp=st.sampled_from([1, 1, 2]),
)
@pytest.mark.slow
def test_batchfit_faults_a_verl_config_iff_verl_refuses_it(**c):
    assert batchfit_refuses(verl_config(c)) == verl_refuses(c)


# ------------------------------------------------------------------ each rule's words


def _sky(**changes) -> dict:
    base = dict(
        train=128, mini=16, critic_mini=8, micro=2, forward=4, n=2, p_world=4, p_sp=1, c_world=4, c_sp=1,
        critic=False, ref=False, r_world=1, r_sp=1,
    )  # fmt: skip
    base.update(changes)
    return skyrl_config(base)


def _with(config: dict, path: str, value) -> dict:
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


VBS = r"\(SkyRL 0\.4\.0 skyrl/train/utils/utils\.py validate_batch_sizes"
SKYRL_MESSAGES = [
    pytest.param(
        _sky(train=8, mini=16),
        r"trainer\.policy_mini_batch_size=16 exceeds trainer\.train_batch_size=8 \(both count prompts\).*"
        + VBS
        + r" asserts it\); set trainer\.policy_mini_batch_size to at most 8 \(a divisor such as 4 or 8\) or "
        r"trainer\.train_batch_size to at least 16",
        id="exceeds",
    ),
    pytest.param(
        _sky(train=100),
        r"trainer\.train_batch_size=100 is not a multiple of trainer\.policy_mini_batch_size=16 \(prompts\) "
        + VBS
        + r" asserts it\).*set trainer\.policy_mini_batch_size to 10 or 20 or trainer\.train_batch_size to 96 or 112",
        id="not-multiple",
    ),
    pytest.param(
        _sky(train=4, mini=1, n=1, micro=1),
        r"trainer\.policy_mini_batch_size × generator\.n_samples_per_prompt = 1 × 1 = 1 samples per mini-batch are "
        r"fewer than the policy's dp_size=4: .*validate_batch_sizes asserts at least one sample per GPU \(1 × 1 // 4 = "
        r"0\); set trainer\.policy_mini_batch_size to at least 4",
        id="one-per-gpu",
    ),
    pytest.param(
        _sky(mini=8, n=1, p_world=1, micro=3),
        r"trainer\.micro_train_batch_size_per_gpu=3 does not divide the policy's samples per GPU per mini-batch = "
        r"trainer\.policy_mini_batch_size × generator\.n_samples_per_prompt // dp_size = 8 × 1 // 1 = 8 "
        + VBS
        + r" floors it and asserts\): set trainer\.micro_train_batch_size_per_gpu to 2 or 4",
        id="micro",
    ),
    pytest.param(
        _sky(train=10, mini=10, p_world=1, critic_mini=5, c_world=2, micro=1, n=1, critic=True),
        r"the critic's samples per GPU per step, .* = 10 × 1 // 2 = 5, are not a multiple of its samples per GPU per "
        r"mini-batch, trainer\.critic_mini_batch_size × generator\.n_samples_per_prompt // dp_size = 5 × 1 // 2 = 2 .*"
        r"set trainer\.critic_mini_batch_size to 2 or 10",
        id="critic-train-per-gpu",
    ),
    pytest.param(
        _sky(train=5, mini=5, micro=1, forward=1, n=1, p_world=2, r_world=3, ref=True),
        r"trainer\.train_batch_size × generator\.n_samples_per_prompt = 5 × 1 = 5 samples are fewer than the least "
        r"common multiple of the data-parallel sizes \(policy 2, reference 3: 6\) "
        + VBS
        + r" asserts at least that many\); set trainer\.train_batch_size to at least 6",
        id="lcm",
    ),
    pytest.param(
        _sky(train=5, mini=5, micro=1, forward=1, n=2, p_world=4),
        r"5 × 2 samples do not split over the models' data-parallel sizes \(policy 4: lcm 4\): SkyRL keeps 4 of 5 "
        r"prompts and then fails \(SkyRL 0\.4\.0 skyrl/train/trainer\.py _remove_tail_data.*asserts that no prompt "
        r"was dropped\); set trainer\.train_batch_size to a multiple of 2 \(4 or 6\)",
        id="tail",
    ),
    pytest.param(
        _sky(p_world=6, p_sp=4),
        r"trainer\.placement\.policy_num_nodes × policy_num_gpus_per_node=6 is not a multiple of the model-parallel "
        r"size, trainer\.policy\.sequence_parallel_size=4 \(dp_size would be 1\.5; SkyRL 0\.4\.0 .*worker\.py builds "
        r"the \(dp, sp\) device mesh and fails\): set .* to 4 or 8",
        id="mesh",
    ),
    pytest.param(
        _sky(critic=True, c_world=3, c_sp=2),
        r"trainer\.placement\.critic_num_nodes × critic_num_gpus_per_node=3 is not a multiple of "
        r"trainer\.critic\.sequence_parallel_size = 2 .*set trainer\.placement\.critic_num_nodes × "
        r"critic_num_gpus_per_node to a multiple of 2 \(2 or 4\)",
        id="critic-mesh",
    ),
    pytest.param(
        _with(_sky(ref=True), "trainer.algorithm.use_kl_in_reward", True),
        r"trainer\.algorithm\.use_kl_loss=true and use_kl_in_reward=true are both set \(SkyRL 0\.4\.0 validate_cfg "
        r"asserts they are mutually exclusive\): keep one",
        id="kl-both",
    ),
    pytest.param(
        _with(
            _with(_sky(), "trainer.algorithm.use_kl_loss", False),
            "trainer.algorithm.advantage_estimator",
            "gae",
        ),
        r"trainer\.algorithm\.advantage_estimator=gae needs a critic, but trainer\.critic\.model\.path is not set "
        r"\(SkyRL 0\.4\.0 validate_cfg asserts it\): set trainer\.critic\.model\.path, or use grpo",
        id="gae-without-critic",
    ),
    pytest.param(
        _with(
            _with(_sky(critic=True), "trainer.algorithm.advantage_estimator", "gae"),
            "generator.step_wise_trajectories",
            True,
        ),
        r"generator\.step_wise_trajectories=true does not work with trainer\.algorithm\.advantage_estimator=gae "
        r"\(SkyRL 0\.4\.0 validate_cfg refuses it.*use grpo or rloo, or set generator\.step_wise_trajectories=false",
        id="step-wise-gae",
    ),
    pytest.param(
        _with(_sky(critic=True), "trainer.strategy", "megatron"),
        r"trainer\.strategy=megatron trains no critic, but trainer\.critic\.model\.path='critic' is set .*"
        r"validate_megatron_cfg.*remove the critic path, or use trainer\.strategy=fsdp",
        id="megatron-critic",
    ),
    pytest.param(
        _with(_sky(), "trainer.logprobs_chunk_size", None),
        r"trainer\.logprobs_chunk_size=None \(no chunking\) needs trainer\.strategy=megatron \(SkyRL 0\.4\.0 "
        r"TrainerConfig\.__post_init__ raises\): set a positive chunk size such as 1024",
        id="chunk-none",
    ),
    pytest.param(
        _with(_sky(), "trainer.fused_lm_head_logprob", True),
        r"trainer\.fused_lm_head_logprob=true needs trainer\.strategy=megatron .*: set it to false, or train with "
        r"megatron",
        id="fused-lm-head",
    ),
    pytest.param(
        _with(_with(_sky(), "trainer.use_sample_packing", False), "trainer.remove_microbatch_padding", True),
        r"both trainer\.use_sample_packing=False \(deprecated\) and trainer\.remove_microbatch_padding=True are set "
        r"\(SkyRL 0\.4\.0 SkyRLTrainConfig\.from_cli_overrides refuses both\): keep only "
        r"trainer\.remove_microbatch_padding",
        id="sample-packing-alias",
    ),
    pytest.param(
        _with(
            _with(_sky(critic=True), "trainer.placement.colocate_all", True),
            "trainer.placement.critic_num_gpus_per_node",
            2,
        ),
        r"trainer\.placement\.colocate_all=true needs the critic on the policy's GPUs, but the critic has "
        r"critic_num_nodes × critic_num_gpus_per_node = 2 and the policy 4 .*build_models asserts.*: set "
        r"trainer\.placement\.critic_num_nodes/critic_num_gpus_per_node to the policy's, or colocate_all=false",
        id="colocated-critic",
    ),
]


@pytest.mark.parametrize(("config", "pattern"), SKYRL_MESSAGES)
def test_each_skyrl_rule_names_its_keys_values_code_and_fix(config, pattern):
    with pytest.raises(BatchConfigError, match=pattern):
        read_run_config(config).plan()


def _verl(**changes) -> dict:
    c = dict(
        train=16, mini=8, n=2, micro=2, forward=2, world=4, sp=1, dynamic=False, critic=False, critic_mini=8,
        critic_micro=2, c_sp=1,
    )  # fmt: skip
    c.update(changes)
    return verl_config(c)


VERL_MESSAGES = [
    pytest.param(
        _verl(train=4),
        r"actor_rollout_ref\.actor\.ppo_mini_batch_size=8 exceeds data\.train_batch_size=4 \(both count prompts\).*"
        r"\(verl 0\.9\.1 verl/workers/config/actor\.py ActorConfig\.validate refuses it\); set "
        r"actor_rollout_ref\.actor\.ppo_mini_batch_size to at most 4",
        id="exceeds",
    ),
    pytest.param(
        _verl(train=3, mini=3, n=1, world=4, micro=1, forward=1),
        r"data\.train_batch_size × actor_rollout_ref\.rollout\.n = 3 × 1 = 3 is not divisible by the 4 GPUs \(verl "
        r"0\.9\.1 verl/utils/config\.py validate_config: real_train_batch_size.*\); set data\.train_batch_size to a "
        r"multiple of 4",
        id="real-train-batch",
    ),
    pytest.param(
        _verl(mini=3, micro=1, train=12),
        r"actor_rollout_ref\.actor\.ppo_mini_batch_size × actor_rollout_ref\.rollout\.n = 3 × 2 = 6 samples per "
        r"mini-batch do not split over dp_size=4 .*TrainingWorker\.train_mini_batch asserts mini_batch_size % dp_size "
        r"== 0 at the first update; set actor_rollout_ref\.actor\.ppo_mini_batch_size to a multiple of 2 \(2 or 4\)",
        id="mini-over-dp",
    ),
    pytest.param(
        _verl(micro=3),
        r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=3 does not divide the policy's samples per GPU per "
        r"mini-batch = actor_rollout_ref\.actor\.ppo_mini_batch_size × actor_rollout_ref\.rollout\.n / dp_size = "
        r"8 × 2 / 4 = 4 \(verl 0\.9\.1 verl/workers/engine/utils\.py prepare_micro_batches asserts it divides\): set "
        r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu to 2 or 4",
        id="micro",
    ),
    pytest.param(
        _verl(forward=3),
        r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu=3 does not divide each GPU's share of a "
        r"step, 32 samples / dp_size 4 = 8 \(.*prepare_micro_batches asserts it in the log-prob pass\); set "
        r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu to 2 or 4",
        id="forward-micro",
    ),
    pytest.param(
        _verl(forward=None),
        r"\[rollout\] neither actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu nor "
        r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size is set, and actor_rollout_ref\.actor\.use_dynamic_bsz "
        r"is false: verl 0\.9\.1 refuses the config at start-up \(validate_config \(check_mutually_exclusive\)\); set "
        r"actor_rollout_ref\.rollout\.log_prob_micro_batch_size_per_gpu",
        id="rollout-neither",
    ),
    pytest.param(
        _with(_verl(dynamic=True), "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", False),
        r"actor_rollout_ref\.actor\.use_dynamic_bsz=True but actor_rollout_ref\.rollout\.log_prob_use_dynamic_bsz="
        r"False: verl 0\.9\.1 asserts they are equal \(verl/workers/engine_workers\.py init_model\); set both to the "
        r"same",
        id="dynamic-mismatch",
    ),
    pytest.param(
        _with(_verl(sp=2), "actor_rollout_ref.model.use_remove_padding", False),
        r"actor_rollout_ref\.actor\.fsdp_config\.ulysses_sequence_parallel_size=2 needs "
        r"actor_rollout_ref\.model\.use_remove_padding=true, but it is False: verl 0\.9\.1 refuses it at start-up "
        r"\(.*FSDPEngine\.__init__\); set actor_rollout_ref\.model\.use_remove_padding=true or the sequence-parallel "
        r"size to 1",
        id="sequence-parallel-padded",
    ),
    pytest.param(
        _with(_verl(dynamic=True, sp=2), "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 400),
        r"actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu=400 × sequence-parallel size 2 = 800 is below the "
        r"longest sequence, data\.max_prompt_length \+ data\.max_response_length = 1024: verl 0\.9\.1's "
        r"rearrange_micro_batches refuses it at run time .*; set it to at least 512",
        id="token-length",
    ),
    pytest.param(
        _with(_verl(critic=True), "critic.ppo_infer_max_token_len_per_gpu", 1000),
        r"critic\.ppo_infer_max_token_len_per_gpu=1000 is below the longest sequence.* = 1024.*set it to at least 1024",
        id="critic-token-length",
    ),
    pytest.param(
        _verl(critic=True, critic_micro=None),
        r"\[critic\] neither critic\.ppo_micro_batch_size_per_gpu nor critic\.ppo_micro_batch_size is set, and "
        r"critic\.use_dynamic_bsz is false: verl 0\.9\.1 refuses the config at start-up \(CriticConfig\.__post_init__\); "
        r"set critic\.ppo_micro_batch_size_per_gpu, or critic\.use_dynamic_bsz=true",
        id="critic-neither",
    ),
    pytest.param(
        _with(_verl(), "actor_rollout_ref.actor.ppo_micro_batch_size", 8),
        r"\[actor\] both actor_rollout_ref\.actor\.ppo_micro_batch_size=8 \(deprecated\) and "
        r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=2 are set: verl 0\.9\.1 refuses the config at "
        r"start-up \(ActorConfig\.__post_init__\); remove actor_rollout_ref\.actor\.ppo_micro_batch_size",
        id="actor-both",
    ),
    pytest.param(
        _with(
            _with(_verl(), "actor_rollout_ref.model.lora_rank", 1024),
            "actor_rollout_ref.rollout.name",
            "vllm",
        ),
        r"actor_rollout_ref\.model\.lora_rank=1024 exceeds vLLM's largest LoRA rank, 512: verl 0\.9\.1 refuses it at "
        r"start-up \(validate_config, get_vllm_max_lora_rank\); set lora_rank to at most 512",
        id="lora-rank",
    ),
    pytest.param(
        _verl(critic=True, c_sp=3),
        r"trainer\.nnodes × trainer\.n_gpus_per_node=4 is not a multiple of critic\.fsdp\.ulysses_sequence_parallel_size "
        r"= 3 .*verl 0\.9\.1 .*device mesh and fails\): set .* to a multiple of 3",
        id="critic-mesh",
    ),
]


@pytest.mark.parametrize(("config", "pattern"), VERL_MESSAGES)
def test_each_verl_rule_names_its_keys_values_code_and_fix(config, pattern):
    with pytest.raises(BatchConfigError, match=pattern):
        read_run_config(config).plan()


def test_waste_the_frameworks_run_is_a_warning_naming_the_code_and_fix():
    skyrl = read_run_config(_sky(train=6, mini=3, n=1, p_world=2, micro=1)).plan()
    assert skyrl.warnings == (
        "each policy mini-batch of 3 samples is padded to 4 over 2 GPUs (SkyRL 0.4.0 "
        "skyrl/backends/skyrl_train/distributed/dispatch.py MeshDispatch.stage_chunks adds rows that train "
        "nothing): 25% padding rows; set trainer.policy_mini_batch_size to a multiple of 2 to avoid them",
    )
    # verl: 14 × 2 = 28 samples padded to 36 = 3 × lcm(4 GPUs, 6 × 2): 8 rows, 22%
    verl = read_run_config(_verl(train=14, mini=6, micro=1, forward=1)).plan()
    assert verl.warnings == (
        "verl pads each step's data.train_batch_size × actor_rollout_ref.rollout.n = 14 × 2 = 28 samples with 8 rows "
        "that train nothing, to 36, a multiple of lcm(dp_size, samples per mini-batch) = 12 (verl 0.9.1 "
        "verl/trainer/ppo/v1/trainer_base.py _balance_batch: upsample_batch_to_divisible_size to a multiple of "
        "_get_required_batch_multiple): 22% of each step's work is padding; set data.train_batch_size to a "
        "multiple of 6 (12 or 18) to avoid it",
    )
    assert verl.optimizer_steps_per_step == 3


def test_a_verl_mini_batch_larger_than_the_step_is_padded_with_dynamic_batch_sizes():
    # ActorConfig.validate checks train >= mini only without use_dynamic_bsz; the V1 trainer pads
    # 4 × 2 = 8 samples up to lcm(4, 8 × 2) = 16: one mini-batch, half of it padding
    plan = read_run_config(_verl(train=4, mini=8, dynamic=True)).plan()
    assert plan.optimizer_steps_per_step == 1
    assert "with 8 rows that train nothing, to 16" in plan.warnings[0]
    with pytest.raises(BatchConfigError, match=r"ppo_mini_batch_size=8 exceeds data\.train_batch_size=4"):
        read_run_config(_verl(train=4, mini=8)).plan()
