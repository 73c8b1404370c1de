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


# NOTE [ Untrusted input files ]: bounded before parsing, each a BatchConfigError naming the file
@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bomb.yaml", "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"l{i}: &l{i} [{', '.join(['*a' if i == 0 else f'*l{i - 1}'] * 10)}]\n" for i in range(6)
        ), r"holds more than 10,000 values \(YAML aliases expanded\)"),
        ("loop.yaml", "a: &a {b: *a}\n", r"recursive alias \*a"),
        ("deep.json", '{"a": ' + "[" * 40 + "]" * 40 + "}", r"nests mappings or lists more than 32 deep"),
        ("int.json", '{"train_batch_size": ' + "1" * 70 + "}", r"integer of 70 digits"),
        ("int.yaml", "train_batch_size: " + "1" * 70 + "\n", r"integer of 70 digits at line 1"),
    ],
)
def test_a_hostile_file_is_refused_before_it_is_built(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(BatchConfigError, match=message):
        load_config(path)


def test_a_file_over_4_mib_is_refused_unread(tmp_path):
    path = tmp_path / "huge.yaml"
    with open(path, "wb") as f:
        f.truncate(4 * 2**20 + 1)  # sparse: 4 MiB + 1 byte of nothing
    with pytest.raises(BatchConfigError, match=r"'.*huge.yaml' is larger than 4 MiB \(4.0 MiB\)"):
        load_config(path)


def test_a_count_of_more_digits_than_any_count_is_refused_by_name():
    with pytest.raises(BatchConfigError, match=r"train_batch_size='9999.*must be an integer >= 1"):
        config_from_mapping({"policy_mini_batch_size": 2}, {"train_batch_size": "9" * 5000}).plan()
