"""ROLL RLVR configs (batchfit/frameworks/roll.py): read in ROLL's vocabulary, planned under its rules, emitted as its keys."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import yaml

from batchfit.budget.options import ProfileOptions
from batchfit.errors import BatchConfigError
from batchfit.frameworks import read_run_config, roll
from batchfit.frameworks.emit import emit_keys, render_yaml
from batchfit.frameworks.run_profile import role_options
from batchfit.parallel.sharding import Sharding

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "roll_rlvr_dynamic_batching.yaml"




def _config(tmp_path, **changes):
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "roll.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_the_example_reads_in_rolls_vocabulary_and_plans():
    run = read_run_config(EXAMPLE)
    b = run.batch
    # 64 prompts × 8; per_device_train_batch_size 1 × gradient_accumulation_steps 64 × dp 8 = 512 samples = 64 prompts
    assert (b.train_batch_size, b.n_samples_per_prompt, b.policy_mini_batch_size) == (64, 8, 64)
    assert (run.world_size, b.max_tokens_per_micro_batch, b.micro_forward_batch_size_per_gpu) == (8, 12288, 4)
    assert run.max_seq_len == 2048 + 4096 and run.strategy == "megatron"
    assert run.reference is True  # init_kl_coef defaults to 0.2: PPOConfig turns the reference on
    assert {s.role: s.value for s in run.configured} == {"policy": 12288, "policy_forward": 24576, "reference": 49125}
    assert any("gradient_accumulation_steps capped micro-batches" in n for n in run.plan().notes)


def test_device_mapping_is_read_as_roll_evaluates_it():
    assert roll.device_count("list(range(0,8))") == 8
    assert roll.device_count("list(range(2, 8, 2))") == 3
    assert roll.device_count("[0, 1, 2, 3]") == 4
    assert roll.device_count("__import__('os')") is None  # never evaluated


def test_the_rollout_engine_shares_the_actors_gpus_where_the_mappings_overlap(tmp_path):
    engine = read_run_config(EXAMPLE).engine  # actor_infer on GPUs 0-5, actor_train on 0-7
    assert (engine.name, engine.colocated, engine.sleeps, engine.sleep_level, engine.memory_fraction) == ("vllm", True, True, 1, 0.8)
    apart = read_run_config(_config(tmp_path, **{"actor_infer.device_mapping": "list(range(8,16))"})).engine
    assert apart.colocated is False


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"actor_train.max_tokens_per_microbatch_in_train": 4096}, "below the longest sequence, 6144 tokens", id="cap"),
        pytest.param({"rollout_batch_size": 3, "num_return_sequences_in_group": 1}, "do not split over the 8 data-parallel", id="dp"),
        pytest.param({"actor_train.training_args.gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0 must be", id="ga"),
        pytest.param({"actor_train.device_mapping": "range(8)"}, "is not a list of GPUs", id="mapping"),
    ],
)
def test_rolls_rules_are_faults_in_its_own_words(tmp_path, changes, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_config(tmp_path, **changes)).plan()


def test_dynamic_batching_under_fsdp2_warns_that_the_cap_is_not_honoured(tmp_path):
    run = read_run_config(_config(tmp_path, **{"actor_train.strategy_args.strategy_name": "fsdp2_train"}))
    assert run.strategy == "fsdp"  # fsdp2_train: fully_shard, profiled as FSDP2
    assert any("under megatron strategies only" in w for w in run.plan().warnings)


def test_megatron_train_reads_its_strategy_config_into_a_megatron_run(tmp_path):
    run = read_run_config(EXAMPLE)  # strategy_config: tp 1, pp 1, ep 1, use_distributed_optimizer, recompute full
    assert (run.strategy, run.distributed_optimizer, run.gradient_checkpointing) == ("megatron", True, True)
    assert (run.megatron_sequence_parallel, run.virtual_pipeline_parallel, run.expert_parallel) == (False, None, 1)
    assert run.optimizer_offload is True  # base_worker.py compute_log_probs loads the parameters only
    config = "actor_train.strategy_args.strategy_config."
    run = read_run_config(_config(tmp_path, **{
        config + "tensor_model_parallel_size": 2, config + "pipeline_model_parallel_size": 2,
        config + "virtual_pipeline_model_parallel_size": 2, config + "sequence_parallel": True,
        config + "use_distributed_optimizer": False, config + "recompute_granularity": None,
        "actor_train.training_args.gradient_accumulation_steps": 256,
    }))  # fmt: skip
    b = run.batch
    assert (b.tensor_parallel, b.pipeline_parallel, run.virtual_pipeline_parallel) == (2, 2, 2)
    assert (run.megatron_sequence_parallel, run.distributed_optimizer, run.gradient_checkpointing) == (True, False, False)
    # mcore_adapter model_config.py: sequence parallelism off without tensor parallelism, on with tp and ep both
    off = read_run_config(_config(tmp_path, **{config + "sequence_parallel": True}))
    assert off.megatron_sequence_parallel is False
    on = read_run_config(_config(tmp_path, **{
        config + "tensor_model_parallel_size": 2, config + "expert_model_parallel_size": 2,
        "actor_train.training_args.gradient_accumulation_steps": 128,
    }))  # fmt: skip
    assert (on.megatron_sequence_parallel, on.expert_parallel) == (True, 2)
    assert on.expert_tensor_parallel is None  # Megatron's default: the tensor-parallel size
    etp = read_run_config(_config(tmp_path, **{
        config + "tensor_model_parallel_size": 2, config + "expert_model_parallel_size": 2,
        config + "expert_tensor_parallel_size": 1, "actor_train.training_args.gradient_accumulation_steps": 128,
    }))  # fmt: skip
    assert etp.expert_tensor_parallel == 1 and not any("expert_tensor_parallel_size" in w for w in etp.warnings)
    from batchfit.frameworks.config_options import run_profile_options

    sharding = run_profile_options(etp, {"backend": "estimate", "max_seq_len": 8192}).options.sharding
    assert (sharding.tensor_parallel, sharding.expert_parallel, sharding.expert_tensor_parallel) == (2, 2, 1)


def test_megatron_dynamic_batching_no_longer_warns_that_the_cap_is_ignored():
    assert not any("under megatron strategies only" in w for w in read_run_config(EXAMPLE).plan().warnings)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"actor_train.model_args.lora_target": "all-linear"}, "lora_target='all-linear' trains LoRA", id="lora"),
        pytest.param({"adv_estimator": "gae"}, "adv_estimator='gae' trains a critic", id="critic"),
    ],
)
def test_profile_refuses_what_its_megatron_profile_does_not_model(tmp_path, capsys, changes, match):
    from batchfit.cli import main

    path = _config(tmp_path, pretrain="tiny", **changes)
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--no-progress"]) == 2
    assert match in capsys.readouterr().err


def test_unmodelled_megatron_settings_are_warned_in_rolls_keys(tmp_path):
    config = "actor_train.strategy_args.strategy_config."
    run = read_run_config(_config(tmp_path, **{config + "recompute_granularity": "selective", config + "optimizer_cpu_offload": True}))
    text = " ".join(run.warnings)
    assert "recompute_granularity='selective'" in text and "optimizer_cpu_offload=True is not modelled" in text
    assert "accumulate_allreduce_grads_in_fp32 is false" in text
    assert run.gradient_checkpointing is False  # profiled without recompute
    layout = read_run_config(_config(tmp_path, **{config + "pipeline_model_parallel_layout": "E,t*4|t*4,L"}))
    with pytest.raises(BatchConfigError, match="lays layers out unevenly"):
        layout.plan()


def _emitted(run, budgets, sharding=None):
    options = ProfileOptions(
        max_seq_len=run.max_seq_len, backend="estimate", sharding=sharding or Sharding("fsdp2", world_size=run.world_size),
        cost="packed", gradient_checkpointing=bool(run.gradient_checkpointing),
    )
    profile = types.SimpleNamespace(
        run=run,
        budgets={r: types.SimpleNamespace(tokens=t, backend="estimate", usable_bytes=70 * 2**30, cost="packed") for r, t in budgets.items()},
        options=role_options(run, options),
    )
    return render_yaml(emit_keys(profile, "roll", max_seq_len=run.max_seq_len, margin=0.85), [])


def test_emitted_caps_are_rounded_down_to_the_configs_sequence_length_round():
    run = read_run_config(EXAMPLE)
    text = _emitted(run, {"policy": 20_000, "policy_forward": 50_000, "reference": 60_000})
    out = yaml.safe_load(text)
    # sequence_length_round_in_* = 128: 20,000 // 128 × 128 = 156 × 128; 50,000 → 390 × 128; 60,000 → 468 × 128
    assert out["actor_train"]["max_tokens_per_microbatch_in_train"] == 19_968
    assert out["actor_train"]["max_tokens_per_microbatch_in_infer"] == 49_920
    assert out["reference"]["max_tokens_per_microbatch_in_infer"] == 59_904
    assert out["actor_train"]["use_dynamic_batching_in_train"] is True
    assert out["actor_train"]["model_args"]["disable_gradient_checkpointing"] is False
    assert "a hard cap on padded tokens" in text and "Megatron layout is approximated" in text


def test_a_megatron_profile_emits_megatron_trains_strategy_config():
    run = read_run_config(EXAMPLE)
    sharding = Sharding("megatron", world_size=8, tensor_parallel=2, pipeline_parallel=2, megatron_sequence_parallel=True,
                        distributed_optimizer=True)  # fmt: skip
    out = yaml.safe_load(_emitted(run, {"policy": 20_000, "policy_forward": 50_000, "reference": 60_000}, sharding))
    actor = out["actor_train"]
    assert actor["strategy_args"]["strategy_name"] == "megatron_train"
    config = actor["strategy_args"]["strategy_config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (2, 2)
    assert (config["sequence_parallel"], config["use_distributed_optimizer"], config["recompute_granularity"]) == (True, True, "full")
    assert config["accumulate_allreduce_grads_in_fp32"] is True
    assert out["reference"]["strategy_args"]["strategy_config"]["tensor_model_parallel_size"] == 2
    assert actor["max_tokens_per_microbatch_in_train"] == 19_968
    assert "disable_gradient_checkpointing" not in actor.get("model_args", {})


@pytest.mark.slow
def test_profile_emits_rolls_keys_under_megatron_for_the_example_on_the_tiny_preset(tmp_path, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    from batchfit.cli import main

    path = _config(tmp_path, pretrain="tiny")
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--engine-reserve", "0", "--no-progress",
            "--emit", "roll"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "megatron over 8 ranks" in out and "strategy_name: megatron_train" in out, out
    caps = {k: int(v) for k, v in re.findall(r"(max_tokens_per_microbatch_in_\w+): (\d+)", out)}
    assert set(caps) == {"max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer"}, out
    assert all(v % 128 == 0 and v >= 6144 for v in caps.values()), out


@pytest.mark.slow
def test_profile_emits_rolls_keys_for_the_example_on_the_tiny_preset(tmp_path, capsys):
    from batchfit.cli import main

    path = _config(tmp_path, pretrain="tiny")
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--engine-reserve", "0", "--no-progress",
            "--sharding", "fsdp2", "--emit", "roll"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    caps = {k: int(v) for k, v in re.findall(r"(max_tokens_per_microbatch_in_\w+): (\d+)", out)}
    assert set(caps) == {"max_tokens_per_microbatch_in_train", "max_tokens_per_microbatch_in_infer"}, out
    assert all(v % 128 == 0 and v >= 6144 for v in caps.values()), out
