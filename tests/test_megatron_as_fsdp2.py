"""frameworks/config_options.py: a Megatron config (SkyRL, verl) is profiled as its Megatron layout, and as FSDP2 over every GPU when asked.

NOTE [ An unmodelled strategy profiled as another ]: FSDP2's budget is no bound of Megatron's, so the run profiled with
--sharding fsdp2 is data parallel over all the GPUs: its plan, its emitted micro sizes and the plan of the merged config
agree.
"""

from __future__ import annotations

import json

import pytest
import yaml

from batchfit.budget.choices import Choices
from batchfit.budget.settings import FLAGS
from batchfit.cli import main
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.frameworks import read_run_config
from batchfit.frameworks.config_options import run_profile_options
from batchfit.frameworks.skyrl_emit import skyrl_plan

CLI = Vocabulary(FLAGS)


def _skyrl_megatron(tmp_path, prompt=512, response=1024):
    """SkyRL's examples/train/megatron/run_megatron.sh (a9564572) as a file, on 8 GPUs: tp 2 × pp 2, dp 2."""
    parallel = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "context_parallel_size": 1}
    config = {
        "trainer": {
            "strategy": "megatron",
            "train_batch_size": 128,
            "policy_mini_batch_size": 64,
            "micro_train_batch_size_per_gpu": 4,
            "micro_forward_batch_size_per_gpu": 4,
            "update_epochs_per_batch": 1,
            "remove_microbatch_padding": True,
            "max_prompt_length": prompt,
            "placement": {"colocate_all": True, "policy_num_gpus_per_node": 8, "ref_num_gpus_per_node": 8},
            "policy": {"model": {"path": "tiny"}, "megatron_config": parallel},
            "ref": {"megatron_config": parallel},
            "algorithm": {"advantage_estimator": "grpo", "use_kl_loss": True},
        },
        "generator": {
            "n_samples_per_prompt": 5,
            "sampling_params": {"max_generate_length": response},
            "inference_engine": {"num_engines": 8, "tensor_parallel_size": 1, "backend": "vllm"},
        },
    }
    path = tmp_path / "skyrl_megatron.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def test_a_megatron_config_is_profiled_as_its_own_layout(tmp_path):
    path, _ = _skyrl_megatron(tmp_path)
    made = run_profile_options(read_run_config(path), Choices(), vocabulary=CLI)
    s = made.options.sharding
    assert (s.strategy, s.world_size, s.tensor_parallel, s.pipeline_parallel, s.data_parallel_size) == ("megatron", 8, 2, 2, 2)
    # SkyRL turns Megatron's SP on with TP > 1, and its distributed optimizer is on unless the kwargs turn it off
    assert s.megatron_sequence_parallel and s.distributed_optimizer
    assert not any("profiled as" in note for note in made.notes)


def test_the_plan_of_a_megatron_config_counts_megatrons_dp(tmp_path, capsys):
    path, _ = _skyrl_megatron(tmp_path)
    assert main(["plan", str(path)]) == 0
    assert "GPUs: 8 = dp 2 × model-parallel 4 (tp 2 · pp 2 · cp 1 · sp 1)" in capsys.readouterr().out


def test_megatron_profiled_as_fsdp2_plans_data_parallel_over_every_gpu(tmp_path):
    path, _ = _skyrl_megatron(tmp_path)
    run = read_run_config(path)
    assert run.batch.plan().dp_size == 2  # Megatron's: 8 GPUs / (tp 2 · pp 2)
    made = run_profile_options(run, Choices(strategy="fsdp2"), vocabulary=CLI)
    assert made.options.sharding.strategy == "fsdp2" and made.options.sharding.world_size == 8
    plan = made.run.batch.plan()
    # dp 8: a mini-batch of 64 prompts × 5 samples = 320 sequences is 320 / 8 = 40 per GPU (Megatron's dp 2: 160)
    assert plan.dp_size == 8
    assert skyrl_plan(made.run, 8).samples_per_mini_batch_per_gpu == 40
    assert made.notes[0].startswith(
        "the config's strategy=megatron (tensor 2 × pipeline 2 × context 1: dp 2 of 8 GPUs) is profiled as fsdp2 with "
        "data parallelism over all 8 GPUs"
    )
    assert "neither an upper nor a lower bound" in made.notes[0]


def test_what_the_megatron_profile_does_not_model_is_refused_in_the_configs_own_keys(tmp_path):
    path = tmp_path / "verl_megatron.yaml"
    path.write_text("actor_rollout_ref:\n  model: {path: tiny}\n  actor: {strategy: megatron}\n")
    with pytest.raises(InvalidArgument, match=r"the config's algorithm.adv_estimator='gae' trains a critic beside the Megatron actor"):
        run_profile_options(read_run_config(path), Choices(), vocabulary=CLI)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


@pytest.mark.slow
def test_the_skyrl_keys_emitted_for_a_megatron_config_pass_plan_over_every_gpu(tmp_path, capsys):
    # short sequences and a small device: the budget holds many sequences, so the micro size the emit picks
    # divides the per-GPU mini-batch of dp 8 (40), not only Megatron's (160): 80 would divide 160 and break dp 8
    path, config = _skyrl_megatron(tmp_path, prompt=16, response=16)
    flags = ["--backend", "estimate", "--memory", "256MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress"]
    assert main(["profile", "--config", str(path), *flags, "--sharding", "fsdp2", "--emit", "skyrl", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    micro = data["emit"]["trainer.micro_train_batch_size_per_gpu"]
    assert 40 % micro == 0 and micro > 4  # a divisor of dp 8's 40 per GPU, above the config's own 4
    emitted: dict = {}
    for key, value in data["emit"].items():
        node = emitted
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    assert emitted["trainer"]["strategy"] == "fsdp"
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(_merge(config, emitted)))
    assert main(["plan", str(merged)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "GPUs: 8 = dp 8" in out
