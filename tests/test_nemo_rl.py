"""NeMo-RL's GRPO config (NVIDIA-NeMo/RL@7ea279ab): reading, its batch rules, refusals, and the keys ``--emit nemo_rl`` writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.frameworks import nemo_rl, nemo_rl_emit, read_run_config
from batchfit.frameworks.source import detect_vocabulary, flatten, framework_defaults, framework_schema
from batchfit.models import preset_info

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "nemo_rl_grpo.yaml"


def _config(tmp_path, **sections) -> Path:
    """A NeMo-RL recipe: the example's keys with ``sections`` merged in (dotted names below ``policy`` etc.)."""
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    for dotted, value in sections.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "nemo_rl.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_the_schema_holds_every_key_of_the_defaults_and_cites_the_commit():
    schema = framework_schema("nemo_rl")
    keys = set(flatten(yaml.safe_load((Path(nemo_rl.__file__).parent / "defaults" / "nemo_rl.yaml").read_text())))
    assert keys <= schema.keys
    assert schema.title == "NeMo-RL 7ea279ab"
    header = (Path(nemo_rl.__file__).parent / "defaults" / "nemo_rl.yaml").read_text().splitlines()[0]
    assert nemo_rl.COMMIT in header


def test_the_mul_resolver_gives_the_token_keys_their_defaults():
    # grpo_math_1B.yaml: train_mb_tokens = ${mul:max_total_sequence_length, train_micro_batch_size} = 512 × 4
    defaults = framework_defaults("nemo_rl")
    assert defaults["policy.sequence_packing.train_mb_tokens"] == 2048
    assert defaults["policy.dynamic_batching.logprob_mb_tokens"] == 2048  # logprob_batch_size: ${train_micro_batch_size}


def test_the_example_reads_as_its_batch_sizes():
    run = read_run_config(EXAMPLE)
    b = run.batch
    assert run.vocabulary == "nemo_rl"
    # train_global_batch_size 512 samples / 16 generations = 32 prompts per optimizer step
    assert (b.train_batch_size, b.n_samples_per_prompt, b.policy_mini_batch_size) == (64, 16, 32)
    assert (b.micro_train_batch_size_per_gpu, b.micro_forward_batch_size_per_gpu) == (4, 8)
    assert b.max_tokens_per_micro_batch == 4096 * 4  # the ${mul:...} of the base, over the recipe's own lengths
    assert (run.world_size, run.strategy, run.offload, run.dtype, run.mixed_precision) == (8, "fsdp2", "none", "fp32", "bf16")
    assert run.gradient_checkpointing is True and run.remove_padding is True and run.reference is False
    assert (run.max_seq_len, run.max_response_len, run.allocator) == (4096, 3072, "caching")
    assert {(s.role, s.key, s.value) for s in run.configured} == {
        ("policy", "policy.sequence_packing.train_mb_tokens", 16384),
        ("policy_forward", "policy.sequence_packing.logprob_mb_tokens", 32768),
    }
    assert any("reference weights swapped in" in note for note in run.notes)
    assert run.warnings == () and run.plan().warnings == ()


def test_nemo_rl_is_told_from_its_keys_and_the_others_are_not_taken():
    assert detect_vocabulary(yaml.safe_load(EXAMPLE.read_text())) == "nemo_rl"
    for name in ("skyrl_grpo.yaml", "skyrl_ppo.yaml", "verl_grpo.yaml", "grpo_4gpu.yaml"):
        assert detect_vocabulary(yaml.safe_load((EXAMPLES / name).read_text())) != "nemo_rl", name


def test_a_global_batch_that_is_not_whole_prompts_is_counted_in_samples(tmp_path):
    run = read_run_config(_config(tmp_path, policy__train_global_batch_size=24))  # 24 % 16 != 0
    b = run.batch
    assert (b.train_batch_size, b.n_samples_per_prompt, b.policy_mini_batch_size) == (1024, 1, 24)
    assert any("not a multiple of grpo.num_generations_per_prompt=16" in note for note in run.notes)


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        pytest.param({"policy__megatron_cfg": {"enabled": True}}, "not both", id="two-backends"),
        pytest.param({"policy__dtensor_cfg": {"enabled": False}}, "needs a training backend", id="no-backend"),
        pytest.param({"policy__dynamic_batching": {"enabled": True}}, "exclusive of Sequence", id="pack-and-dynamic"),
        pytest.param(
            {"policy__dtensor_cfg": {"context_parallel_size": 2}}, "refuses context parallelism with sequence packing", id="cp-pack"
        ),
        # 4096 tokens in bins of 4000: the packer raises for the longest sequence
        pytest.param(
            {"policy__sequence_packing": {"enabled": True, "train_mb_tokens": 4000}},
            r"train_mb_tokens=4000 is a hard cap .* exceeds the bin",
            id="bin-below-longest",
        ),
        # make_sequence_length_divisible_by 64: 4096 stays 4096, but 4100 rounds up to 4160 > 4100
        pytest.param(
            {"policy__max_total_sequence_length": 4100, "policy__make_sequence_length_divisible_by": 64,
             "policy__sequence_packing": {"enabled": True, "train_mb_tokens": 4100, "logprob_mb_tokens": 8192}},
            "rounded up to make_sequence_length_divisible_by=64, 4160",
            id="rounded-above-bin",
        ),
        pytest.param(
            {"policy__sequence_packing": {"enabled": False},
             "policy__dynamic_batching": {"enabled": True, "train_mb_tokens": 16384, "logprob_mb_tokens": 2048}},
            r"dynamic_batching.logprob_mb_tokens=2048 is a hard cap .* dynamic batching asserts",
            id="dynamic-below-longest",
        ),
        # 1,024 samples over 8 ranks = 128 each; 48 does not divide 128
        pytest.param(
            {"policy__sequence_packing": {"enabled": False}, "policy__logprob_batch_size": 48},
            "logprob_batch_size=48 does not divide each data-parallel rank's 128 samples",
            id="logprob-micro",
        ),
        pytest.param({"policy__train_micro_batch_sise": 4}, "did you mean 'policy.train_micro_batch_size'", id="misspelt"),
    ],
)
def test_what_nemo_rl_refuses_is_a_fault_in_its_own_keys(tmp_path, sections, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_config(tmp_path, **sections)).plan()


def test_the_exact_splits_name_nemo_rls_keys(tmp_path):
    # 1,024 samples are not a multiple of 384 (24 prompts × 16): shard_by_batch_size asserts it
    with pytest.raises(BatchConfigError, match=r"train_global_batch_size / grpo\.num_generations_per_prompt"):
        read_run_config(_config(tmp_path, policy__train_global_batch_size=384)).plan()


def test_generation_on_gpus_of_its_own_leaves_the_policy_the_rest(tmp_path):
    gen = {"colocated": {"enabled": False, "resources": {"gpus_per_node": 2, "num_nodes": None}}, "max_new_tokens": 3072}
    run = read_run_config(_config(tmp_path, policy__generation=gen, grpo__num_prompts_per_step=48))
    assert run.world_size == 6 and run.engine is not None and not run.engine.colocated  # 8 - 2 on one node
    gen["colocated"]["resources"]["gpus_per_node"] = None
    with pytest.raises(BatchConfigError, match=r"colocated\.resources\.gpus_per_node=None"):
        read_run_config(_config(tmp_path, policy__generation=gen)).plan()


def test_the_allocator_is_read_from_the_workers_env_vars(tmp_path):
    env = {"activation_checkpointing": True, "env_vars": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
    assert read_run_config(_config(tmp_path, policy__dtensor_cfg=env)).allocator == "expandable_segments"


@pytest.mark.parametrize(
    ("defaults", "warned"), [("../../grpo_math_1B.yaml", False), ("../../grpo_math_8B.yaml", True)]
)
def test_a_parent_other_than_the_base_is_warned_about(tmp_path, defaults, warned):
    run = read_run_config(_config(tmp_path, defaults=defaults))
    assert any("load_config_with_inheritance" in w for w in run.warnings) is warned


def test_an_unmodelled_key_is_a_warning(tmp_path):
    run = read_run_config(_config(tmp_path, policy__logprob_chunk_size=2048))
    assert any(w.startswith("policy.logprob_chunk_size=2048") for w in run.warnings)


@pytest.mark.parametrize(
    ("sections", "match"),
    [
        pytest.param(
            {"policy__megatron_cfg": {"enabled": True, "peft": {"enabled": True}}, "policy__dtensor_cfg": {"enabled": False}},
            r"policy.megatron_cfg.peft.enabled=True trains Megatron-Bridge LoRA adapters",
            id="megatron-lora",
        ),
        pytest.param(
            {"policy__dtensor_cfg": {"tensor_parallel_size": 2}},
            r"policy.dtensor_cfg.tensor_parallel_size=2 splits each layer's weights .* pass --sharding fsdp2",
            id="dtensor-tp",
        ),
        pytest.param(
            {"policy__dtensor_cfg": {"context_parallel_size": 2}, "policy__sequence_packing": {"enabled": False},
             "policy__dynamic_batching": {"enabled": True}},
            r"policy.dtensor_cfg.context_parallel_size=2 splits each sequence with ring attention",
            id="context-parallel",
        ),
    ],
)
def test_what_profile_does_not_model_is_refused_naming_the_approximation(tmp_path, sections, match):
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_config(tmp_path, **sections))
    with pytest.raises(InvalidArgument, match=match):
        run_profile_options(run, {})


MEGATRON_EXAMPLE = EXAMPLES / "nemo_rl_grpo_megatron.yaml"


def _megatron_config(tmp_path, **megatron_cfg) -> Path:
    data = yaml.safe_load(MEGATRON_EXAMPLE.read_text(encoding="utf-8"))
    data["policy"]["megatron_cfg"] = _merge(data["policy"]["megatron_cfg"], megatron_cfg)
    path = tmp_path / "nemo_rl_megatron.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_megatron_cfg_reads_into_a_megatron_run(tmp_path):
    run = read_run_config(MEGATRON_EXAMPLE)  # grpo_math_1B_megatron.yaml: tp 1, distributed optimizer, bf16
    assert (run.strategy, run.dtype, run.distributed_optimizer, run.gradient_checkpointing) == ("megatron", "bf16", True, False)
    # grpo_math_1B.yaml's defaults: the precision-aware optimizer read (modelled), a bf16 gradient buffer warned
    assert run.precision_aware_optimizer is True and not any("use_precision_aware_optimizer" in w for w in run.warnings)
    assert any("grad_reduce_in_fp32=False is not modelled" for w in run.warnings)
    run = read_run_config(_megatron_config(
        tmp_path, tensor_model_parallel_size=2, sequence_parallel=True, activation_checkpointing=True,
        optimizer={"use_distributed_optimizer": False},
    ))  # fmt: skip
    assert (run.batch.tensor_parallel, run.megatron_sequence_parallel, run.gradient_checkpointing) == (2, True, True)
    assert run.distributed_optimizer is False
    selective = read_run_config(_megatron_config(tmp_path, activation_checkpointing=True, recompute_granularity="selective"))
    assert selective.gradient_checkpointing is False and any("recompute_granularity='selective'" in w for w in selective.warnings)


def test_a_megatron_profile_emits_megatron_cfg():
    from batchfit.parallel.sharding import Sharding

    run = read_run_config(MEGATRON_EXAMPLE)
    sharding = Sharding("megatron", world_size=4, tensor_parallel=2, megatron_sequence_parallel=True, distributed_optimizer=True)
    a = _assumptions()
    a = type(a)(**{**a.__dict__, "sharding": sharding, "dtypes": {"policy": "bf16"}})
    keys = {k.path: k.value for k in nemo_rl_emit.assumption_keys(run, a, True) if k.path}
    mg = "policy.megatron_cfg."
    assert keys[mg + "enabled"] is True and keys["policy.dtensor_cfg.enabled"] is False
    assert (keys[mg + "tensor_model_parallel_size"], keys[mg + "sequence_parallel"], keys["policy.precision"]) == (2, True, "bfloat16")
    assert keys[mg + "optimizer.use_precision_aware_optimizer"] is False  # as profiled: the sharding has it off
    assert keys[mg + "distributed_data_parallel_config.grad_reduce_in_fp32"] is True
    assert (keys[mg + "activation_checkpointing"], keys[mg + "recompute_granularity"]) == (True, "full")


def test_the_token_keys_pack_and_take_each_pass_s_budget():
    budgets = {"policy": 30_000, "policy_forward": 40_000, "reference": 35_000}
    keys = nemo_rl_emit.token_keys(None, budgets, lambda role, what: f"{what} [{role}]", 4096, 8)
    by_path = {k.path: k for k in keys if k.path}
    assert by_path["policy.sequence_packing.enabled"].value is True
    assert by_path["policy.dynamic_batching.enabled"].value is False
    assert by_path["policy.sequence_packing.train_mb_tokens"].value == 30_000
    # the log-prob key bounds the previous- and the reference-policy passes: the smaller, 35,000
    forward = by_path["policy.sequence_packing.logprob_mb_tokens"]
    assert forward.value == 35_000 and forward.comment.endswith("[reference]") and "hard cap per GPU" in forward.comment
    short = nemo_rl_emit.token_keys(None, {"policy": 3000, "policy_forward": 9000}, lambda r, w: w, 4096, 8)
    assert [k.comment for k in short if not k.path and "below the longest sequence" in k.comment]


def _assumptions(**sharding):
    from batchfit.frameworks.assumptions import Assumptions

    s = {"strategy": "fsdp2", "distributed": True, "world_size": 8, "sequence_parallel": 1, "reshard_after_forward": True,
         "mixed_precision": "bf16", "offload": "none", **sharding}  # fmt: skip
    return Assumptions(
        roles=("policy", "policy_forward"),
        sharding=types.SimpleNamespace(**s),
        dtypes={"policy": "fp32"},
        gradient_checkpointing=True,
        cost="packed",
        head="full",
        lora={},
        response_only=False,
    )


def test_the_assumed_settings_are_dtensor_keys():
    run = read_run_config(EXAMPLE)
    keys = {k.path: k.value for k in nemo_rl_emit.assumption_keys(run, _assumptions(), True) if k.path}
    assert keys["policy.dtensor_cfg.enabled"] is True and keys["policy.megatron_cfg.enabled"] is False
    assert (keys["cluster.num_nodes"], keys["cluster.gpus_per_node"], keys["policy.precision"]) == (1, 8, "bfloat16")
    assert keys["policy.dtensor_cfg.activation_checkpointing"] is True and keys["policy.dtensor_cfg.cpu_offload"] is False


@pytest.mark.parametrize(
    ("sharding", "match"),
    [
        ({"sequence_parallel": 2}, "--emit nemo_rl cannot carry --sequence-parallel 2"),
        ({"strategy": "fsdp1"}, "--emit nemo_rl cannot carry --sharding fsdp1"),
        ({"reshard_after_forward": False}, "--no-reshard-after-forward"),
        ({"mixed_precision": "fp16"}, "--mixed-precision fp16"),
    ],
)
def test_what_the_dtensor_path_cannot_express_is_refused(sharding, match):
    from batchfit.frameworks.assumptions import EmitError

    with pytest.raises(EmitError, match=match):
        nemo_rl_emit.assumption_keys(read_run_config(EXAMPLE), _assumptions(**sharding), True)


_CLI = """
import sys
from batchfit.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_tiny_recipe_profiles_and_emits_nemo_rls_token_keys_and_the_merge_plans(tmp_path):
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(preset_info("tiny")["config"])))
    path = _config(
        tmp_path,
        policy__model_name=str(model),
        policy__max_total_sequence_length=512,
        policy__generation={"max_new_tokens": 448},
        grpo__num_prompts_per_step=8,
        grpo__num_generations_per_prompt=4,
        policy__train_global_batch_size=16,
        cluster__gpus_per_node=2,
    )
    # the spec registered before the CLI (and --emit's targets) are imported: a process of its own
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--memory", "1GiB", "--reserve", "0",
            "--engine-reserve", "0", "--no-progress", "--emit", "nemo_rl"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _CLI, *argv], capture_output=True, text=True, timeout=600, env={**os.environ}, check=False
    )
    assert done.returncode == 0, done.stderr
    emitted = yaml.safe_load(done.stdout)
    packing = emitted["policy"]["sequence_packing"]
    assert packing["enabled"] is True and emitted["policy"]["dynamic_batching"]["enabled"] is False
    assert packing["train_mb_tokens"] >= 512 and packing["logprob_mb_tokens"] >= packing["train_mb_tokens"]
    assert "hard cap per GPU" in done.stdout and "estimated budget" in done.stdout
    assert emitted["cluster"] == {"num_nodes": 1, "gpus_per_node": 2}
    # merged over the recipe, the emitted keys plan
    data = yaml.safe_load(path.read_text())
    for section, values in emitted.items():
        data[section] = _merge(data.get(section, {}), values)
    merged = tmp_path / "merged.yaml"
    merged.write_text(yaml.safe_dump(data))
    run = read_run_config(merged)
    assert run.batch.max_tokens_per_micro_batch == packing["train_mb_tokens"]
    run.plan()


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.slow
def test_the_megatron_example_profiles_under_megatron_and_emits_nemo_rls_token_keys(tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    argv = ["profile", "--config", str(MEGATRON_EXAMPLE), "--model", "tiny", "--backend", "estimate",
            "--engine-reserve", "0", "--no-progress", "--emit", "nemo_rl"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", _CLI, *argv], capture_output=True, text=True, timeout=600, env={**os.environ}, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "megatron over 1 rank" in done.stdout
    emitted = yaml.safe_load(done.stdout)
    packing = emitted["policy"]["sequence_packing"]
    assert packing["train_mb_tokens"] >= 512 and packing["logprob_mb_tokens"] >= packing["train_mb_tokens"]
    assert emitted["policy"]["megatron_cfg"]["enabled"] is True


def test_megatron_cfgs_uneven_stages_offload_and_optimizer_dtypes_are_read(tmp_path):
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_megatron_config(
        tmp_path, pipeline_model_parallel_size=2, num_layers_in_last_pipeline_stage=10,
        optimizer={"optimizer_cpu_offload": True, "optimizer_offload_fraction": 1.0, "exp_avg_dtype": "bf16"},
    ))  # fmt: skip
    assert not any("num_layers_in_last_pipeline_stage" in w or "optimizer_cpu_offload" in w for w in run.warnings)
    s = run_profile_options(run, {"backend": "estimate", "max_seq_len": 1024, "world_size": 2}).options.sharding
    assert (s.pipeline_parallel, s.last_pipeline_stage_layers, s.optimizer_cpu_offload) == (2, 10, True)
    assert (s.precision_aware_optimizer, s.exp_avg_dtype, s.optimizer_offload_fraction) == (True, "bf16", 1.0)
