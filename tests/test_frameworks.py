"""SkyRL and verl configs read into batchfit's terms: the plans their frameworks compute, their rules."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchConfigError, InvalidArgument
from batchfit.frameworks import read_run_config

# verl's published PPO trainer config shape, in verl's vocabulary, with its interpolations.
VERL = """
data:
  train_batch_size: 1024
  max_prompt_length: 512
  max_response_length: 1536
actor_rollout_ref:
  model:
    path: qwen2.5-0.5b
    enable_gradient_checkpointing: true
  actor:
    strategy: fsdp2
    ppo_mini_batch_size: 256
    ppo_micro_batch_size_per_gpu: 4
    use_dynamic_bsz: false
    ppo_max_token_len_per_gpu: ${oc.select:actor_rollout_ref.actor.missing_key,16384}
    ppo_epochs: 2
    use_kl_loss: true
    ulysses_sequence_parallel_size: 1
  ref:
    log_prob_micro_batch_size_per_gpu: ${actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu}
    log_prob_max_token_len_per_gpu: ${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}
  rollout:
    n: 4
    log_prob_micro_batch_size_per_gpu: 16
critic:
  strategy: fsdp2
  ppo_micro_batch_size_per_gpu: 8
  model:
    path: qwen2.5-0.5b
algorithm:
  adv_estimator: gae
trainer:
  nnodes: 2
  n_gpus_per_node: 8
"""

SKYRL = """
trainer:
  strategy: fsdp
  train_batch_size: 512
  policy_mini_batch_size: 128
  critic_mini_batch_size: ${trainer.policy_mini_batch_size}
  micro_train_batch_size_per_gpu: 2
  micro_forward_batch_size_per_gpu: 8
  update_epochs_per_batch: 1
  placement:
    colocate_all: false
    policy_num_nodes: 1
    policy_num_gpus_per_node: 8
    critic_num_nodes: 1
    critic_num_gpus_per_node: 4
  policy:
    model:
      path: qwen2.5-0.5b
  critic:
    model:
      path: qwen2.5-0.5b
generator:
  n_samples_per_prompt: 5
  max_input_length: 512
  sampling_params:
    max_generate_length: 1024
"""


def _run(text: str, overrides=None):
    return read_run_config(yaml.safe_load(text), overrides)


def test_verl_default_shaped_config_gives_verls_plan():
    run = _run(VERL)
    assert run.vocabulary == "verl"
    plan = run.plan()
    # verl: ppo_mini_batch_size *= n, //= dp; steps = train / mini × ppo_epochs
    assert plan.world_size == 16 and plan.dp_size == 16
    assert plan.optimizer_steps_per_step == 1024 // 256 * 2
    assert plan.samples_per_mini_batch_per_gpu == 256 * 4 // 16  # 64
    assert plan.gradient_accumulation_steps == 64 // 4  # micro-batches per optimizer step
    # verl 0.9.1's critic engine batches by tokens (trainer_base.py gives it only token budgets)
    assert plan.critic is not None and plan.critic.samples_per_mini_batch_per_gpu == 64
    assert plan.critic.gradient_accumulation_steps is None and plan.critic.micro_batch_size_per_gpu is None
    assert run.max_seq_len == 512 + 1536 and run.reference and run.critic_model == "qwen2.5-0.5b"
    assert run.gradient_checkpointing is True and run.world_size == 16
    # verl 0.9.1's defaults: padding removed, no entropy in the update, full entropy in the log-prob pass
    assert run.remove_padding is True and run.critic_remove_padding is True and run.fused_kernels is False
    assert (run.entropy, run.forward_entropy, run.entropy_chunk_size) == ("none", "full", None)
    assert run.lora is None and run.warnings == ()


def test_skyrl_config_gives_skyrls_plan_with_the_critics_own_placement():
    run = _run(SKYRL)
    assert run.vocabulary == "skyrl"
    plan = run.plan()
    assert plan.optimizer_steps_per_step == 4
    assert plan.samples_per_mini_batch_per_gpu == 128 * 5 // 8  # 80 on the policy's 8 GPUs
    assert plan.critic.samples_per_mini_batch_per_gpu == 128 * 5 // 4  # 160 on the critic's 4
    assert plan.gradient_accumulation_steps == 40
    assert run.max_seq_len == 1536 and run.reference  # SkyRL's use_kl_loss default


@settings(max_examples=30, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 8),
    steps=st.integers(1, 4),
    per_gpu_micro=st.integers(1, 4),
    accumulation=st.integers(1, 4),
    epochs=st.integers(1, 3),
)
@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_one_configuration_spelt_three_ways_gives_one_plan(dp, n, steps, per_gpu_micro, accumulation, epochs):
    # mini × n splits over dp with a whole number of micro-batches: no framework pads or floors
    per_gpu = per_gpu_micro * accumulation
    samples = per_gpu * dp
    if samples % n:
        return
    mini = samples // n
    train = mini * steps
    flat = {
        "train_batch_size": train,
        "policy_mini_batch_size": mini,
        "n_samples_per_prompt": n,
        "micro_train_batch_size_per_gpu": per_gpu_micro,
        "update_epochs_per_batch": epochs,
        "world_size": dp,
    }
    skyrl = {
        "trainer": {
            "train_batch_size": train,
            "policy_mini_batch_size": mini,
            "micro_train_batch_size_per_gpu": per_gpu_micro,
            "update_epochs_per_batch": epochs,
            "placement": {"policy_num_nodes": 1, "policy_num_gpus_per_node": dp},
            "algorithm": {"use_kl_loss": False},
        },
        "generator": {"n_samples_per_prompt": n},
    }
    verl = {
        "data": {"train_batch_size": train},
        "actor_rollout_ref": {
            "actor": {
                "ppo_mini_batch_size": mini,
                "ppo_micro_batch_size_per_gpu": per_gpu_micro,
                "ppo_epochs": epochs,
            },
            "rollout": {"n": n, "log_prob_micro_batch_size_per_gpu": 1},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": dp},
    }
    plans = [read_run_config(c).plan() for c in (flat, skyrl, verl)]
    numbers = {
        (
            p.optimizer_steps_per_step,
            p.samples_per_mini_batch_per_gpu,
            p.gradient_accumulation_steps,
            p.dp_size,
        )
        for p in plans
    }
    assert numbers == {(steps * epochs, per_gpu, accumulation, dp)}
    assert all(not p.warnings for p in plans)


# ------------------------------------------------------------------ warnings vs faults


def _skyrl(train, mini, n, gpus, **trainer):
    return {
        "trainer": {
            "train_batch_size": train,
            "policy_mini_batch_size": mini,
            "placement": {"policy_num_gpus_per_node": gpus},
            **trainer,
        },
        "generator": {"n_samples_per_prompt": n},
    }


def test_skyrl_pads_a_mini_batch_that_does_not_split_and_warns_with_the_waste():
    plan = read_run_config(_skyrl(6, 3, 1, 2)).plan()
    assert plan.warnings == (
        "each policy mini-batch of 3 samples is padded to 4 over 2 GPUs (SkyRL 0.4.0 "
        "skyrl/backends/skyrl_train/distributed/dispatch.py MeshDispatch.stage_chunks adds rows that train "
        "nothing): 25% padding rows; set trainer.policy_mini_batch_size to a multiple of 2 to avoid them",
    )
    assert plan.samples_per_mini_batch_per_gpu == 2 and plan.optimizer_steps_per_step == 2
    with pytest.raises(BatchConfigError, match=r"25% padding rows.*--strict makes it a fault"):
        read_run_config(_skyrl(6, 3, 1, 2)).plan(strict=True)
    # batchfit's own rules call the same layout a fault
    with pytest.raises(BatchConfigError, match=r"do not split evenly over dp_size=2"):
        read_run_config({"train_batch_size": 6, "policy_mini_batch_size": 3, "world_size": 2}).plan()


def test_skyrl_drops_tail_prompts_and_then_fails_so_it_is_a_fault():
    # 5 prompts × 2 samples over 4 GPUs: _remove_tail_data keeps 4 prompts, then the
    # synchronous trainer's num_prompts == train_batch_size check fails
    with pytest.raises(BatchConfigError, match=r"SkyRL keeps 4 of 5 prompts .* multiple of 2"):
        read_run_config(_skyrl(5, 5, 2, 4)).plan()


def test_skyrl_colocated_critic_must_share_the_policys_gpus():
    config = _skyrl(8, 4, 2, 4, critic={"model": {"path": "x"}}, critic_mini_batch_size=4)
    config["trainer"]["placement"].update(colocate_all=True, critic_num_gpus_per_node=2)
    with pytest.raises(BatchConfigError, match=r"colocate_all=true needs the critic on the policy's GPUs"):
        read_run_config(config).plan()
    config["trainer"]["placement"]["colocate_all"] = False
    plan = read_run_config(config).plan()
    assert plan.critic.samples_per_mini_batch_per_gpu == 4 and plan.policy.samples_per_mini_batch_per_gpu == 2


def test_skyrl_reads_step_wise_from_its_only_key_and_names_older_ones():
    # SkyRL 0.4.0 has generator.step_wise_trajectories only; trainer.step_wise_training is an older
    # release's key, which 0.4.0's config dataclasses refuse (validate_dict_keys_against_dataclass)
    config = _skyrl(8, 4, 2, 4, step_wise_training=True)
    config["generator"]["step_wise_trajectories"] = False
    run = read_run_config(config)
    assert run.batch.step_wise is False
    assert any(
        w.startswith("'trainer.step_wise_training' (set to True) is not a key of SkyRL 0.4.0")
        for w in run.warnings
    )
    config["trainer"].pop("step_wise_training")
    config["generator"]["step_wise_trajectories"] = True
    assert read_run_config(config).batch.step_wise is True


def _verl(**actor):
    return {
        "data": {"train_batch_size": 8, "max_prompt_length": 512, "max_response_length": 512},
        "actor_rollout_ref": {
            "actor": {"ppo_mini_batch_size": 4, **actor},
            "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 4},
    }


@pytest.mark.parametrize(
    ("actor", "match"),
    [
        pytest.param(
            {},
            r"\[actor\] neither actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu nor .* is set.* "
            r"verl 0.9.1 refuses the config at start-up \(ActorConfig.__post_init__\)",
            id="no-micro",
        ),
        pytest.param(
            {"ppo_micro_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1},
            r"both actor_rollout_ref.actor.ppo_micro_batch_size=4 \(deprecated\) and .*_per_gpu=1 are set",
            id="both-micro",
        ),
        pytest.param(
            {"ppo_micro_batch_size": 4},
            r"only the deprecated actor_rollout_ref.actor.ppo_micro_batch_size=4 is set: .*engine workers read "
            r"only actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            id="global-micro",
        ),
        pytest.param(
            {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 1000},
            r"ppo_max_token_len_per_gpu=1000 is below the longest sequence.* = 1024",
            id="token-len",
        ),
        pytest.param(
            {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 3},
            r"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3 does not divide",
            id="micro",
        ),
        pytest.param(
            {"ppo_mini_batch_size": 3, "ppo_micro_batch_size_per_gpu": 1},
            r"3 × 2 = 6 samples per mini-batch do not split over dp_size=4 .*train_mini_batch asserts",
            id="no-floor",
        ),
    ],
)
def test_verl_faults_mirror_verls_checks(actor, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_verl(**actor)).plan()


def test_verl_pads_a_step_that_is_not_whole_mini_batches_and_counts_the_extra_step():
    config = _verl(ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=1)
    config["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] = 1
    config["data"]["train_batch_size"] = 12
    plan = read_run_config(config).plan()
    assert plan.optimizer_steps_per_step == 2 and plan.warnings == ()
    # 14 prompts × 2 = 28 samples; the V1 trainer pads to a multiple of lcm(4 GPUs, 6 × 2) = 12: 36
    config["data"]["train_batch_size"] = 14
    plan = read_run_config(config).plan()
    assert plan.optimizer_steps_per_step == 3  # 36 / 12
    assert plan.samples_per_step_per_gpu == 9  # 36 / 4, padding rows included
    assert plan.warnings[0].startswith(
        "verl pads each step's data.train_batch_size × actor_rollout_ref.rollout.n = 14 × 2 = 28 samples with 8 "
        "rows that train nothing, to 36"
    )
    # the log-prob pass's micro size must divide each GPU's 9 samples (prepare_micro_batches)
    config["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] = 2
    with pytest.raises(BatchConfigError, match=r"log_prob_micro_batch_size_per_gpu=2 does not divide .* = 9"):
        read_run_config(config).plan()


def test_verl_stock_defaults_need_a_micro_size_or_dynamic_batching():
    with pytest.raises(BatchConfigError, match=r"\[actor\] neither .*ppo_micro_batch_size_per_gpu"):
        read_run_config({"data": {"train_batch_size": 1024}}).plan()


# ------------------------------------------------------------------ keys and vocabularies


def test_a_misspelt_batch_key_gets_the_closest_name_and_unknown_schema_keys_are_ignored():
    config = _verl(ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_sise=4, optim={"lr": 1e-6}, clip_ratio=0.2)
    with pytest.raises(
        BatchConfigError,
        match=r"unknown key 'actor_rollout_ref.actor.ppo_mini_batch_sise' \(set to 4\): verl 0.9.1's config has no "
        r"such key; did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'\? Rename it",
    ):
        read_run_config(config)
    config["actor_rollout_ref"]["actor"].pop("ppo_mini_batch_sise")
    assert read_run_config(config).plan().optimizer_steps_per_step == 2


@pytest.mark.parametrize(
    ("config", "match"),
    [
        pytest.param(
            {"trainer": {"policy_mini_batch_size": 4}, "actor_rollout_ref": {"actor": {}}},
            r"mixes vocabularies: SkyRL keys \(trainer.policy_mini_batch_size\) and verl keys \(actor_rollout_ref\)",
            id="mixed",
        ),
        pytest.param({"model": {"name": "x"}}, r"cannot tell the config's vocabulary", id="unknown"),
        pytest.param(
            {"data": {"train_batch_size": "${data.nope}"}},
            r"cannot resolve the interpolation at 'data.train_batch_size'",
            id="unresolved",
        ),
        pytest.param(
            {"train_batch_size": 4, "policy_mini_batch_size": "${oc.nope:1}"},
            r"cannot resolve the interpolation",
            id="bad-resolver",
        ),
    ],
)
def test_bad_vocabularies_and_interpolations_are_named(config, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(config)


def test_colocation_and_what_stays_resident():
    verl = _run(VERL)
    assert verl.colocated == ("policy", "reference", "critic")
    assert verl.resident["policy"] == ("parameters", "optimizer_state")
    skyrl = _run(SKYRL)
    assert skyrl.colocated == ("policy", "reference")  # colocate_policy_ref, both kept on the GPUs
    everything = yaml.safe_load(SKYRL)
    everything["trainer"]["placement"]["colocate_all"] = True
    everything["trainer"]["placement"]["critic_num_gpus_per_node"] = 8
    assert _run(yaml.safe_dump(everything)).resident == {}  # SkyRL offloads idle models


def test_skyrl_step_wise_with_gae_is_a_fault():
    config = _skyrl(8, 4, 2, 4, algorithm={"advantage_estimator": "gae"}, critic={"model": {"path": "x"}})
    config["generator"]["step_wise_trajectories"] = True
    with pytest.raises(BatchConfigError, match=r"step_wise_trajectories=true does not work with .*=gae"):
        read_run_config(config).plan()


def test_a_registered_framework_is_read_by_every_reader_without_a_table_to_edit(monkeypatch):
    # issue 29: adding a framework is one module and its registration; the readers ask the registry
    from batchfit.frameworks import registry
    from batchfit.frameworks.lora_keys import lora_keys
    from batchfit.frameworks.source import detect_vocabulary, file_vocabularies

    monkeypatch.setattr(registry, "_SPECS", dict(registry._SPECS))
    spec = registry.FrameworkSpec(
        name="toyrl",
        title="ToyRL 1.0",
        display="ToyRL",
        markers=("toy.rollout", "toy.train.batch_size"),
        lora_keys={"policy": ("toy.lora.r", "toy.lora.alpha", "toy.lora.targets")},
        read_config=lambda resolved, given: None,
    )
    registry.register_framework(spec)
    assert "toyrl" in file_vocabularies()
    assert detect_vocabulary({"toy": {"train": {"batch_size": 8}}}) == "toyrl"
    assert lora_keys("toyrl")["policy"][0] == "toy.lora.r"
    with pytest.raises(BatchConfigError, match=r"ToyRL keys \(toy.rollout\) and verl keys \(actor_rollout_ref\)"):
        detect_vocabulary({"toy": {"rollout": 1}, "actor_rollout_ref": {}})
    with pytest.raises(BatchConfigError, match=r"ToyRL's \(toy.rollout, toy.train.batch_size, ...\)"):
        detect_vocabulary({"model": {"name": "x"}})
    with pytest.raises(InvalidArgument, match="has no markers"):
        registry.FrameworkSpec(name="bad", title="Bad", read_config=lambda resolved, given: None)
    with pytest.raises(InvalidArgument, match="has no launchers"):
        registry.FrameworkSpec(name="bad", title="Bad", read_command=lambda command: None)
