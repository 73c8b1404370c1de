"""Loading batch configs from flat keys, SkyRL nesting, YAML and JSON."""

from __future__ import annotations

import json

import pytest

from batchfit import BatchConfigError
from batchfit.frameworks.config_io import config_from_mapping, load_config


def test_flat_keys_build_the_config():
    config = config_from_mapping({"train_batch_size": 64, "policy_mini_batch_size": 16, "world_size": 4})
    assert config.plan().dp_size == 4


def test_unknown_flat_key_names_the_closest_field():
    with pytest.raises(
        BatchConfigError, match=r"unknown key 'train_batch_sise'; did you mean 'train_batch_size'"
    ):
        config_from_mapping({"train_batch_sise": 64, "policy_mini_batch_size": 16})


def test_missing_required_key_is_a_fault():
    with pytest.raises(BatchConfigError, match=r"policy_mini_batch_size is required"):
        config_from_mapping({"train_batch_size": 64})


def test_skyrl_nested_config_is_read(tmp_path):
    path = tmp_path / "skyrl.yaml"
    path.write_text(
        """
trainer:
  strategy: fsdp2
  train_batch_size: 1024
  policy_mini_batch_size: 256
  critic_mini_batch_size: ${trainer.policy_mini_batch_size}
  micro_train_batch_size_per_gpu: 2
  placement:
    policy_num_nodes: 1
    policy_num_gpus_per_node: 4
  critic:
    model:
      path: null
  policy:
    optimizer_config: {lr: 1.0e-6}
generator:
  n_samples_per_prompt: 5
  sampling_params: {temperature: 1.0}
"""
    )
    plan = load_config(path).plan()
    assert plan.world_size == 4
    assert plan.optimizer_steps_per_step == 4  # 1024 / 256
    assert plan.samples_per_mini_batch_per_gpu == 320  # 256 × 5 / 4
    assert plan.critic is None  # critic.model.path is null: no critic


def test_skyrl_critic_reference_is_resolved():
    config = config_from_mapping(
        {
            "trainer": {
                "train_batch_size": 64,
                "policy_mini_batch_size": 16,
                "critic_mini_batch_size": "${trainer.policy_mini_batch_size}",
                "critic": {"model": {"path": "some/model"}},
            }
        }
    )
    assert config.critic_mini_batch_size == 16


def test_overrides_win_and_strings_are_coerced(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"train_batch_size": 64, "policy_mini_batch_size": 16}))
    config = load_config(path, {"world_size": "8", "step_wise": "true", "critic_mini_batch_size": "none"})
    assert config.world_size == 8 and config.step_wise is True and config.critic_mini_batch_size is None


def test_missing_file_is_a_fault(tmp_path):
    with pytest.raises(BatchConfigError, match=r"does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_unparsable_file_is_a_fault(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train_batch_size: [1, 2\n")
    with pytest.raises(BatchConfigError, match=r"could not be parsed"):
        load_config(path)
