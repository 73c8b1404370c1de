"""A framework config's budget is probed with the step that framework runs: its head, its layout."""

from __future__ import annotations

import json

import pytest
import yaml

from batchfit.cli import main
from batchfit.frameworks import read_run_config
from batchfit.frameworks.run_step import framework_step
from batchfit.train.framework_heads import FrameworkHead


def _verl(**actor) -> dict:
    model = actor.pop("model", {})
    return {
        "data": {"train_batch_size": 16, "max_prompt_length": 256, "max_response_length": 256},
        "algorithm": {"adv_estimator": "grpo"},
        "actor_rollout_ref": {
            "model": {"path": "tiny", **model},
            "actor": {
                "ppo_mini_batch_size": 8,
                "use_dynamic_bsz": True,
                "ppo_max_token_len_per_gpu": 4096,
                "strategy": "fsdp2",
                **actor,
            },
            "rollout": {"n": 2, "log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 4096},
        },
        "trainer": {"n_gpus_per_node": 2, "nnodes": 1},
    }


def _skyrl(**trainer) -> dict:
    algorithm = trainer.pop("algorithm", {})
    return {
        "trainer": {
            "train_batch_size": 8,
            "policy_mini_batch_size": 4,
            "placement": {"policy_num_gpus_per_node": 2},
            "policy": {"model": {"path": "tiny"}},
            "algorithm": {"advantage_estimator": "grpo", **algorithm},
            **trainer,
        },
        "generator": {
            "n_samples_per_prompt": 2,
            "max_input_length": 256,
            "sampling_params": {"max_generate_length": 256},
        },
    }


def test_verls_default_step_is_its_head_on_packed_rows_with_entropy_only_in_the_log_prob_pass():
    step = framework_step(read_run_config(_verl()))
    assert step is not None and step.cost == "packed"
    head = step.head
    assert isinstance(head, FrameworkHead) and head.framework == "verl"
    assert (head.entropy, head.forward_entropy, head.temperature) == ("none", "full", 1.0)
    assert "verl's head" in step.notes[0] and "packed rows" in step.notes[0]
    assert any("use_torch_compile" in note for note in step.notes)


def test_verl_without_remove_padding_runs_padded_rows():
    step = framework_step(read_run_config(_verl(model={"use_remove_padding": False})))
    assert step is not None and step.cost == "padded" and "padded rows" in step.notes[0]


def test_verls_entropy_coefficient_puts_the_chunked_entropy_in_the_loss():
    config = _verl(entropy_coeff=0.01, fsdp_config={"entropy_from_logits_with_chunking": True})
    head = framework_step(read_run_config(config)).head
    assert (head.entropy, head.entropy_in_loss, head.entropy_grad) == ("chunked", True, True)


def test_verls_fused_kernels_are_measured_with_batchfits_fused_head():
    step = framework_step(read_run_config(_verl(model={"use_fused_kernels": True})))
    assert step.head == "fused" and "fused kernels" in step.notes[0]


def test_skyrls_step_is_its_sequence_chunked_entropy_without_gradients_unless_it_is_a_loss():
    head = framework_step(read_run_config(_skyrl())).head
    assert (head.framework, head.entropy, head.entropy_grad, head.entropy_chunk_size) == (
        "skyrl",
        "chunked",
        False,
        1024,
    )
    assert head.forward_entropy == "none"
    head = framework_step(
        read_run_config(_skyrl(algorithm={"use_entropy_loss": True}, logprobs_chunk_size=256))
    ).head
    assert (head.entropy_grad, head.entropy_in_loss, head.entropy_chunk_size) == (True, True, 256)


def test_a_flat_config_has_no_framework_step():
    assert framework_step(read_run_config({"train_batch_size": 8, "policy_mini_batch_size": 4})) is None


def _profile_json(tmp_path, capsys, config: dict, *flags: str) -> dict:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    small = ["--memory", "96MiB", "--reserve", "0", "--engine-reserve", "0", "--max-seq-len", "256", "--cost", "padded"]
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--json", *small, *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_profile_config_measures_the_frameworks_head_and_a_flag_overrides_it(tmp_path, capsys):
    data = _profile_json(tmp_path, capsys, _verl(use_kl_loss=True))
    policy, reference = data["profiles"]["policy"], data["profiles"]["reference"]
    assert policy["logprobs"]["framework"] == policy["logprobs"]["head"] == "verl"
    assert policy["logprobs"]["forward_entropy"] == "full"
    assert reference["logprobs"]["forward_entropy"] == "none"  # verl's reference pass computes no entropy
    assert any("verl's head" in note for note in data["notes"])
    overridden = _profile_json(tmp_path, capsys, _verl(use_kl_loss=True), "--logprobs", "full")
    assert overridden["profiles"]["policy"]["logprobs"] == {"head": "full"}  # one type: NOTE [ The --json schema ]
    # the kernel's head holds less than an fp32 log-softmax of the logits: a larger policy budget
    update = data["profiles"]["policy"]["budgets"]["policy"]
    assert update["tokens"] > overridden["profiles"]["policy"]["budgets"]["policy"]["tokens"]


def test_verls_fsdp_strategy_is_profiled_as_fsdp1_and_skyrls_as_fsdp2():
    from batchfit.frameworks.config_options import sharding_strategy as _strategy

    assert _strategy(read_run_config(_verl(strategy="fsdp"))) == "fsdp1"  # FullyShardedDataParallel
    assert _strategy(read_run_config(_verl())) == "fsdp2"
    assert _strategy(read_run_config(_skyrl(strategy="fsdp"))) == "fsdp2"  # SkyRL's fsdp is fully_shard


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key written twice in one mapping (safe_load keeps the last)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        assert len(keys) == len(set(keys)), f"duplicate keys in {keys}"
        return super().construct_mapping(node, deep=deep)


@pytest.mark.slow
def test_emit_verl_turns_padding_removal_on_even_when_the_config_keeps_padding(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_verl(model={"use_remove_padding": False})))
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--memory", "96MiB", "--reserve", "0", "--engine-reserve", "0"]
    assert main([*argv, "--max-seq-len", "256", "--emit", "verl"]) == 0
    text = capsys.readouterr().out
    emitted = yaml.load(text, Loader=_UniqueKeyLoader)  # one mapping per section
    ref = emitted["actor_rollout_ref"]
    assert ref["model"]["use_remove_padding"] is True and ref["actor"]["ppo_max_token_len_per_gpu"] > 0
    assert "the config keeps each micro-batch's padding" in text and "packed rows" in text
    assert main([*argv, "--emit", "verl", "--cost", "padded"]) == 2
    err = capsys.readouterr().err
    assert "bound packed rows only" in err and "drop --cost padded" in err
