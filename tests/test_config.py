"""Batch plans: typical configurations judged in prompt units, every fault named with a fix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchConfig, BatchConfigError


def test_grpo_1024x5_on_4_gpus_makes_4_optimizer_steps():
    for micro, accumulation in [(1, 320), (2, 160), (8, 40)]:
        plan = BatchConfig(
            train_batch_size=1024,
            n_samples_per_prompt=5,
            policy_mini_batch_size=256,
            micro_train_batch_size_per_gpu=micro,
            world_size=4,
        ).plan()
        # 1024 / 256 = 4 mini-batches; 256 × 5 / 4 = 320 samples per GPU per mini-batch
        assert plan.optimizer_steps_per_step == 4
        assert plan.samples_per_mini_batch == 1280
        assert plan.samples_per_mini_batch_per_gpu == 320
        assert plan.gradient_accumulation_steps == accumulation  # 320 / micro
        assert plan.samples_per_step == 5120
        assert plan.dp_size == 4


def test_512x8_on_8_gpus_makes_2_optimizer_steps():
    plan = BatchConfig(
        train_batch_size=512, n_samples_per_prompt=8, policy_mini_batch_size=256, world_size=8
    ).plan()
    assert plan.optimizer_steps_per_step == 2  # 512 / 256
    assert plan.samples_per_mini_batch_per_gpu == 256  # 256 × 8 / 8


def test_update_epochs_multiply_optimizer_steps():
    plan = BatchConfig(train_batch_size=64, policy_mini_batch_size=16, update_epochs_per_batch=3).plan()
    assert plan.optimizer_steps_per_step == 12  # 64 / 16 × 3
    assert plan.mini_batches_per_epoch == 4


def test_mini_batch_larger_than_train_batch_is_a_fault():
    with pytest.raises(
        BatchConfigError, match=r"policy_mini_batch_size=256 exceeds train_batch_size=100"
    ) as info:
        BatchConfig(train_batch_size=100, policy_mini_batch_size=256).plan()
    assert "50 or 100" in info.value.faults[0]  # nearest divisors of 100 to 256


def test_per_gpu_size_that_is_not_whole_is_a_fault():
    # 16 × 5 = 80 samples over 6 GPUs = 13.33 per GPU
    with pytest.raises(
        BatchConfigError, match=r"16 × 5 = 80 samples .* dp_size=6 \(80/6 = 13.33 per GPU\)"
    ) as info:
        BatchConfig(
            train_batch_size=96, n_samples_per_prompt=5, policy_mini_batch_size=16, world_size=6
        ).plan()
    # mini must be a multiple of 6 / gcd(5, 6) = 6 and divide 96: 12 and 24 are nearest to 16
    assert "12 or 24" in info.value.faults[0]


def test_micro_size_must_divide_per_gpu_samples():
    with pytest.raises(
        BatchConfigError, match=r"micro_train_batch_size_per_gpu=3 does not divide .* = 320"
    ) as info:
        BatchConfig(
            train_batch_size=1024,
            n_samples_per_prompt=5,
            policy_mini_batch_size=256,
            micro_train_batch_size_per_gpu=3,
            world_size=4,
        ).plan()
    assert "2 or 4" in info.value.faults[0]  # divisors of 320 nearest to 3


def test_token_budget_lifts_micro_size_divisibility():
    plan = BatchConfig(
        train_batch_size=1024,
        n_samples_per_prompt=5,
        policy_mini_batch_size=256,
        micro_train_batch_size_per_gpu=3,
        max_tokens_per_micro_batch=16384,
        world_size=4,
    ).plan()
    assert plan.micro_batching == "tokens"
    assert plan.gradient_accumulation_steps is None
    assert "16384" in str(plan)


def test_every_fault_is_reported_at_once():
    with pytest.raises(BatchConfigError) as info:
        BatchConfig(
            train_batch_size=96,
            n_samples_per_prompt=5,
            policy_mini_batch_size=16,
            critic_mini_batch_size=200,
            world_size=6,
            tensor_parallel=4,
        ).plan()
    faults = info.value.faults
    assert len(faults) == 2  # world 6 vs tp 4, and critic 200 > 96 (policy's dp check needs dp)
    assert any("world_size=6 is not a multiple" in f and "4 or 8" in f for f in faults)
    assert any("critic_mini_batch_size=200 exceeds train_batch_size=96" in f for f in faults)


def test_policy_and_critic_share_one_rule_set():
    kwargs = dict(train_batch_size=96, n_samples_per_prompt=5, world_size=6)
    with pytest.raises(BatchConfigError) as policy:
        BatchConfig(policy_mini_batch_size=16, **kwargs).plan()
    with pytest.raises(BatchConfigError) as critic:
        BatchConfig(policy_mini_batch_size=24, critic_mini_batch_size=16, **kwargs).plan()
    assert critic.value.faults == [f.replace("policy_", "critic_") for f in policy.value.faults]


def test_critic_plan_is_reported_when_set():
    plan = BatchConfig(train_batch_size=64, policy_mini_batch_size=16, critic_mini_batch_size=32).plan()
    assert plan.critic is not None and plan.critic.optimizer_steps_per_step == 2  # 64 / 32
    assert "critic: mini-batch of 32 prompts" in str(plan)


def test_nodes_times_gpus_gives_world_size():
    plan = BatchConfig(train_batch_size=64, policy_mini_batch_size=16, num_nodes=2, gpus_per_node=8).plan()
    assert plan.world_size == 16 and plan.dp_size == 16


def test_world_size_disagreeing_with_nodes_is_a_fault():
    with pytest.raises(
        BatchConfigError, match=r"world_size=8 disagrees with num_nodes × gpus_per_node = 2 × 8 = 16"
    ):
        BatchConfig(
            train_batch_size=64, policy_mini_batch_size=16, world_size=8, num_nodes=2, gpus_per_node=8
        ).plan()


def test_model_parallel_sizes_reduce_dp_size():
    plan = BatchConfig(
        train_batch_size=64, policy_mini_batch_size=16, world_size=16, tensor_parallel=2, sequence_parallel=2
    ).plan()
    assert plan.dp_size == 4  # 16 / (2 · 2)


def test_step_wise_skips_sample_divisibility_and_keeps_step_count():
    plan = BatchConfig(
        train_batch_size=96,
        n_samples_per_prompt=5,
        policy_mini_batch_size=16,
        micro_train_batch_size_per_gpu=7,
        world_size=6,
        step_wise=True,
    ).plan()
    assert plan.optimizer_steps_per_step == 6  # 96 / 16
    assert plan.samples_per_mini_batch is None
    assert plan.samples_per_step is None
    assert any("step-wise" in n for n in plan.notes)
    assert "varies (step-wise)" in str(plan)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"train_batch_size": 0}, r"train_batch_size=0 must be an integer >= 1"),
        ({"train_batch_size": True}, r"train_batch_size=True must be an integer"),
        ({"policy_mini_batch_size": 2.5}, r"policy_mini_batch_size=2.5 must be an integer"),
        ({"world_size": -1}, r"world_size=-1 must be an integer >= 1 or None"),
        ({"step_wise": "yes"}, r"step_wise='yes' must be true or false"),
        ({"num_nodes": 2}, r"num_nodes=2 is set without gpus_per_node"),
    ],
    ids=["zero", "bool", "float", "negative-optional", "step-wise-str", "nodes-without-gpus"],
)
def test_invalid_fields_are_named(changes, pattern):
    config = BatchConfig(train_batch_size=8, policy_mini_batch_size=4).replace(**changes)
    with pytest.raises(BatchConfigError, match=pattern):
        config.plan()


def test_batch_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        BatchConfig(train_batch_size=8, policy_mini_batch_size=16).plan()


def test_plan_to_dict_is_json_ready():
    import json

    plan = BatchConfig(train_batch_size=8, policy_mini_batch_size=4, critic_mini_batch_size=8).plan()
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["policy"]["optimizer_steps_per_step"] == 2
    assert data["critic"]["optimizer_steps_per_step"] == 1
    assert data["config"]["train_batch_size"] == 8


small = st.integers(min_value=-2, max_value=300)
maybe = st.one_of(st.none(), small)


@settings(max_examples=400, deadline=None)
@given(
    train=small,
    mini=small,
    critic=maybe,
    n=small,
    micro=small,
    tokens=maybe,
    epochs=small,
    world=maybe,
    nodes=maybe,
    gpn=maybe,
    tp=st.integers(1, 8),
    sp=st.integers(1, 4),
    step_wise=st.booleans(),
    junk=st.sampled_from([None, "x", 1.5, True]),
)
def test_plan_returns_consistent_numbers_or_raises_batch_config_error(
    train, mini, critic, n, micro, tokens, epochs, world, nodes, gpn, tp, sp, step_wise, junk
):
    config = BatchConfig(
        train_batch_size=train if junk is None else junk,
        policy_mini_batch_size=mini,
        critic_mini_batch_size=critic,
        n_samples_per_prompt=n,
        micro_train_batch_size_per_gpu=micro,
        max_tokens_per_micro_batch=tokens,
        update_epochs_per_batch=epochs,
        world_size=world,
        num_nodes=nodes,
        gpus_per_node=gpn,
        tensor_parallel=tp,
        sequence_parallel=sp,
        step_wise=step_wise,
    )
    try:
        plan = config.plan()
    except BatchConfigError as exc:
        assert exc.faults and all(isinstance(f, str) and f for f in exc.faults)
        return
    assert plan.dp_size * plan.model_parallel_size == plan.world_size
    for role in plan.roles:
        assert role.mini_batches_per_epoch * role.mini_batch_size == config.train_batch_size
        assert role.optimizer_steps_per_step == role.mini_batches_per_epoch * config.update_epochs_per_batch
        if not step_wise:
            assert role.samples_per_mini_batch == role.mini_batch_size * config.n_samples_per_prompt
            assert role.samples_per_mini_batch_per_gpu * plan.dp_size == role.samples_per_mini_batch
            if tokens is None:
                assert role.gradient_accumulation_steps * micro == role.samples_per_mini_batch_per_gpu
    if not step_wise:
        assert plan.samples_per_step == config.train_batch_size * config.n_samples_per_prompt


def test_an_invalid_field_does_not_hide_faults_between_the_valid_ones():
    with pytest.raises(BatchConfigError) as info:
        BatchConfig(train_batch_size=100, policy_mini_batch_size=30, micro_train_batch_size_per_gpu=0).plan()
    faults = info.value.faults
    assert any(f.startswith("micro_train_batch_size_per_gpu=0 must be") for f in faults)
    assert any("train_batch_size=100 is not a multiple of policy_mini_batch_size=30" in f for f in faults)


@pytest.mark.timeout(10)
def test_huge_sizes_are_answered_at_once():
    # work counted, not timed: trial division to √n (10⁸ steps, 11 s and a hang) ran ~2·10⁸
    # Python lines; bounded at DIVISOR_SEARCH_LIMIT it runs ~4·10⁵ for both plans
    import sys

    from batchfit.plan.arith import DIVISOR_SEARCH_LIMIT

    class TooMuchWork(Exception):
        pass

    lines, cap = [0], 10 * DIVISOR_SEARCH_LIMIT

    def count(frame, event, arg):
        if event == "line":
            lines[0] += 1
            if lines[0] > cap:
                raise TooMuchWork(f"more than {cap:,} Python lines")
        return count

    sys.settrace(count)
    try:
        with pytest.raises(BatchConfigError, match=r"train_batch_size=10000000000000061 is not a multiple"):
            BatchConfig(train_batch_size=10**16 + 61, policy_mini_batch_size=3).plan()
        with pytest.raises(BatchConfigError):
            BatchConfig(train_batch_size=2**63, policy_mini_batch_size=3).plan()
    finally:
        sys.settrace(None)
    assert 0 < lines[0] <= cap


def test_numpy_integers_give_an_exact_json_ready_plan():
    import json

    import numpy as np

    plan = BatchConfig(
        train_batch_size=np.int64(8),
        policy_mini_batch_size=np.int32(4),
        n_samples_per_prompt=np.int64(2**40),  # 8 × 2**40 trajectories: exact Python ints
        micro_train_batch_size_per_gpu=2,
    ).plan()
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["trajectories_per_step"] == 8 * 2**40 and type(plan.config.train_batch_size) is int


@pytest.mark.parametrize(
    ("framework", "pattern"),
    [
        # 10 prompts, mini-batch 5, 2 GPUs: 5 samples do not split in two
        ("batchfit", r"5 × 1 = 5 samples per mini-batch do not split evenly over dp_size=2"),
        # SkyRL floors 5 // 2 = 2 and 10 // 2 = 5 per GPU, and asserts 5 % 2 == 0
        ("skyrl", r"= 10 × 1 // 2 = 5, are not a multiple of .* = 5 × 1 // 2 = 2 .*validate_batch_sizes"),
        # verl 0.9.1 asserts mini_batch_size % dp_size == 0 when it updates
        ("verl", r"5 samples per mini-batch do not split over dp_size=2 .*train_mini_batch asserts"),
    ],
)
def test_each_framework_refuses_a_mini_batch_that_does_not_split_in_its_own_words(framework, pattern):
    config = BatchConfig(train_batch_size=10, policy_mini_batch_size=5, world_size=2, framework=framework)
    with pytest.raises(BatchConfigError, match=pattern):
        config.plan()


def test_a_reference_with_its_own_dp_size_joins_skyrls_lcm_rules():
    config = BatchConfig(train_batch_size=4, policy_mini_batch_size=4, world_size=2, framework="skyrl")
    assert config.plan().optimizer_steps_per_step == 1
    with pytest.raises(BatchConfigError) as info:
        config.replace(reference_world_size=3).plan()
    # validate_batch_sizes: 4 samples < lcm(2, 3) = 6; _remove_tail_data: stride 6 keeps 0 of 4 prompts
    assert [f.split(":")[0] for f in info.value.faults] == [
        "train_batch_size × n_samples_per_prompt = 4 × 1 = 4 samples are fewer than the least common multiple of "
        "the data-parallel sizes (policy 2, reference 3",
        "train_batch_size × n_samples_per_prompt = 4 × 1 samples do not split over the models' data-parallel sizes "
        "(policy 2, reference 3",
    ]


def test_the_critics_own_model_parallel_size_sets_its_dp_size():
    plan = BatchConfig(
        train_batch_size=8,
        policy_mini_batch_size=4,
        critic_mini_batch_size=4,
        n_samples_per_prompt=2,
        world_size=4,
        critic_world_size=4,
        critic_model_parallel=2,
    ).plan()
    assert plan.policy.samples_per_mini_batch_per_gpu == 2  # 4 × 2 / 4
    assert plan.critic.samples_per_mini_batch_per_gpu == 4  # 4 × 2 / (4 / 2)


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"reference_world_size": 0}, r"reference_world_size=0 must be an integer >= 1 or None"),
        ({"critic_model_parallel": True}, r"critic_model_parallel=True must be an integer >= 1 or None"),
        (
            {"critic_mini_batch_size": 4, "critic_world_size": 3, "critic_model_parallel": 2},
            r"critic_world_size=3 is not a multiple of critic_model_parallel = 2 .*set critic_world_size to a "
            r"multiple of 2 \(2 or 4\)",
        ),
    ],
    ids=["reference-zero", "critic-mp-bool", "critic-mp-does-not-divide"],
)
def test_the_other_models_placement_fields_are_checked(changes, pattern):
    with pytest.raises(BatchConfigError, match=pattern):
        BatchConfig(train_batch_size=8, policy_mini_batch_size=4).replace(**changes).plan()
