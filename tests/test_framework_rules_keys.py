"""The frameworks' key vocabularies come from their schemas; what a config sets and batchfit reads from it.

A key in the schema that does not change memory is accepted silently; one that changes memory
in a way batchfit does not model is a warning naming it; a key in no schema that is a close
misspelling of one is a fault naming the key meant. ``RunConfig`` carries what the step
depends on (padding removal, fused kernels, entropy, LoRA), read from the keys each
framework's code reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from batchfit import BatchConfigError
from batchfit.cli import main
from batchfit.frameworks import read_run_config, skyrl, verl
from batchfit.frameworks.source import _UNREAD, flatten, framework_schema, resolve

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ROOT / "src" / "batchfit" / "frameworks" / "defaults"
WHEELS = Path(os.environ.get("BATCHFIT_WHEELS", "/tmp/wheels"))
SKYRL_WHEEL = WHEELS / "skyrl-0.4.0-py3-none-any.whl"
VERL_WHEEL = WHEELS / "verl-0.9.1-py3-none-any.whl"


def _skyrl(**trainer) -> dict:
    config = {
        "trainer": {
            "train_batch_size": 8,
            "policy_mini_batch_size": 4,
            "placement": {"colocate_all": False, "policy_num_gpus_per_node": 2},
            "algorithm": {"use_kl_loss": False},
        },
        "generator": {"n_samples_per_prompt": 2},
    }
    config["trainer"].update(trainer)
    return config


def _verl(**model) -> dict:
    return {
        "data": {"train_batch_size": 8, "max_prompt_length": 256, "max_response_length": 256},
        "actor_rollout_ref": {
            "model": {"path": "tiny", **model},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
            "rollout": {"n": 2, "log_prob_micro_batch_size_per_gpu": 2},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }


def _set(config: dict, path: str, value) -> dict:
    node = config
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


# ------------------------------------------------------------------ the schemas


# the first tier's time (issue 41): the shipped schemas are read in the first tier
# (test_the_schemas_are_the_pinned_releases_and_hold_the_keys_batchfit_reads)
@pytest.mark.slow
@pytest.mark.skipif(
    not (SKYRL_WHEEL.is_file() and VERL_WHEEL.is_file()), reason=f"the wheels are not in {WHEELS}"
)
def test_the_shipped_schemas_are_what_the_script_generates_from_the_wheels(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "gen_framework_schemas", ROOT / "scripts" / "gen_framework_schemas.py"
    )
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up
    try:
        spec.loader.exec_module(script)
    finally:
        sys.modules.pop(spec.name, None)
    assert script.main(["--skyrl", str(SKYRL_WHEEL), "--verl", str(VERL_WHEEL), "--out", str(tmp_path)]) == 0
    for name in ("skyrl.yaml", "verl.yaml", "skyrl_schema.json", "verl_schema.json"):
        assert (tmp_path / name).read_text() == (DEFAULTS / name).read_text(), name


def test_the_schemas_are_the_pinned_releases_and_hold_the_keys_batchfit_reads():
    assert framework_schema("skyrl").title == "SkyRL 0.4.0"
    assert framework_schema("verl").title == "verl 0.9.1"
    read = [*skyrl.KEYS, *skyrl.MEGATRON_KEYS, skyrl.TOKEN_KEY, skyrl.STEP_WISE_KEY, skyrl.REMOVE_PADDING_KEY]
    read += [
        "trainer.placement.ref_num_gpus_per_node",
        "trainer.logprobs_chunk_size",
        "trainer.ref.sequence_parallel_size",
    ]
    assert [k for k in read if k not in framework_schema("skyrl").keys] == []
    # the deprecated alias is no field of 0.4.0's dataclasses: SkyRL renames it before building them
    assert skyrl.REMOVE_PADDING_ALIAS not in framework_schema("skyrl").keys
    verl_read = [*verl.KEY_NAMES.values(), "critic.ppo_infer_max_token_len_per_gpu", "trainer.use_v1"]
    verl_read = [k for k in verl_read if "×" not in k]
    assert [k for k in verl_read if k not in framework_schema("verl").keys] == []


@pytest.mark.parametrize("framework", ["skyrl", "verl"])
def test_every_memory_key_batchfit_warns_about_is_in_the_frameworks_schema(framework):
    schema = framework_schema(framework)
    table = {"skyrl": skyrl.UNMODELLED, "verl": verl.UNMODELLED}[framework]
    missing = [
        key
        for key in table
        if key != skyrl.REMOVE_PADDING_ALIAS
        and (key[:-2] not in schema.keys if key.endswith(".*") else key not in schema.keys)
    ]
    assert missing == []


def test_sections_left_out_of_the_merge_change_no_other_default():
    # NOTE [ Sections no rule reads ]: resolved with and without them, every other key agrees
    full = flatten(resolve({"global_profiler": {"tool": None}}, "verl"))  # naming one keeps them all
    pruned = flatten(resolve({}, "verl"))
    assert len(pruned) < len(full)
    assert {k: v for k, v in full.items() if k in pruned} == pruned
    # and no interpolation outside them refers to them
    names = _UNREAD["verl"]
    defaults = flatten(yaml.safe_load((DEFAULTS / "verl.yaml").read_text()))
    refs = [v for k, v in defaults.items() if k in pruned and isinstance(v, str) and "${" in v]
    assert refs and not [r for r in refs if any(re.search(rf"\b{n}\b", r) for n in names)]


# ------------------------------------------------------------------ keys judged against them


@pytest.mark.parametrize(
    ("config", "key"),
    [
        pytest.param(
            _skyrl(
                placement={"colocate_all": False, "policy_num_gpus_per_node": 2, "ref_num_gpus_per_node": 2}
            ),
            "trainer.placement.ref_num_gpus_per_node",
            id="skyrl-ref-placement",
        ),
        pytest.param(_skyrl(eval_batch_size=64), "trainer.eval_batch_size", id="skyrl-eval"),
        pytest.param(
            _set(_skyrl(), "generator.inference_engine.gpu_memory_utilization", 0.6), "", id="skyrl-engine"
        ),
        pytest.param(
            _set(_skyrl(), "generator.inference_engine.engine_init_kwargs.swap_space", 4), "", id="skyrl-open"
        ),
        pytest.param(_set(_skyrl(), "environment.env_class", "aime"), "", id="skyrl-env"),
        pytest.param(_set(_verl(), "trainer.total_epochs", 3), "", id="verl-epochs"),
        pytest.param(_set(_verl(), "actor_rollout_ref.actor.optim.lr", 3e-6), "", id="verl-lr"),
        pytest.param(
            _set(_verl(), "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space", 4), "", id="verl-open"
        ),
        pytest.param(_set(_verl(), "data.my_dataset_option", 1), "", id="verl-free-section"),
        pytest.param(
            _set(_verl(), "critic.ppo_infer_max_token_len_per_gpu", 40000), "", id="verl-dataclass-field"
        ),
    ],
)
def test_keys_that_do_not_change_memory_are_accepted_silently(config, key):
    run = read_run_config(config)
    assert run.warnings == ()
    assert run.plan().warnings == ()


def test_the_issues_ref_placement_key_is_no_misspelling_and_sets_the_references_dp_size():
    config = _skyrl(
        placement={"colocate_all": False, "policy_num_gpus_per_node": 2, "ref_num_gpus_per_node": 3}
    )
    config["trainer"]["algorithm"] = {"use_kl_loss": True}
    run = read_run_config(config)
    assert run.batch.reference_world_size == 3 and run.warnings == ()
    # 8 prompts × 2 = 16 samples over lcm(policy 2, reference 3) = 6: SkyRL drops tail prompts
    with pytest.raises(BatchConfigError, match=r"policy 2, reference 3: lcm 6\): SkyRL keeps 6 of 8 prompts"):
        run.plan()


@pytest.mark.parametrize(
    ("config", "key", "meant"),
    [
        pytest.param(
            _set(_skyrl(), "trainer.placment.policy_num_gpus_per_node", 4),
            "trainer.placment.policy_num_gpus_per_node",
            "trainer.placement.policy_num_gpus_per_node",
            id="skyrl-section",
        ),
        pytest.param(
            _skyrl(max_tokens_per_micro_batch=4096),
            "trainer.max_tokens_per_micro_batch",
            "trainer.max_tokens_per_microbatch",
            id="skyrl-older-spelling",
        ),
        pytest.param(
            _set(_skyrl(), "generator.n_sample_per_prompt", 4),
            "generator.n_sample_per_prompt",
            "generator.n_samples_per_prompt",
            id="skyrl-leaf",
        ),
        pytest.param(
            _set(_verl(), "trainer.n_gpu_per_node", 4),
            "trainer.n_gpu_per_node",
            "trainer.n_gpus_per_node",
            id="verl-free",
        ),
        pytest.param(
            _set(_verl(), "actor_rollout_ref.model.lora_rnak", 8),
            "actor_rollout_ref.model.lora_rnak",
            "actor_rollout_ref.model.lora_rank",
            id="verl-model",
        ),
    ],
)
def test_a_close_misspelling_is_a_fault_naming_the_key_its_value_and_the_key_meant(config, key, meant):
    with pytest.raises(BatchConfigError) as info:
        read_run_config(config)
    assert any(
        f.startswith(f"unknown key {key!r} (set to ")
        and f.endswith(f"has no such key; did you mean {meant!r}? Rename it")
        for f in info.value.faults
    ), info.value.faults


def test_a_misspelt_key_is_listed_with_every_other_fault_of_the_config():
    config = _set(_skyrl(train_batch_size=10), "generator.n_sample_per_prompt", 4)
    with pytest.raises(BatchConfigError) as info:
        read_run_config(config)
    faults = info.value.faults
    assert faults[0].startswith("unknown key 'generator.n_sample_per_prompt'")
    assert faults[1].startswith(
        "trainer.train_batch_size=10 is not a multiple of trainer.policy_mini_batch_size=4"
    )
    assert len(faults) == 3  # and 10 × 2 // 2 = 10 samples per GPU are not a multiple of 4 × 2 // 2 = 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(
            _skyrl(my_flag=1),
            "'trainer.my_flag' (set to 1) is not a key of SkyRL 0.4.0's config: 'trainer' (TrainerConfig) has no "
            "'my_flag', and SkyRL refuses unknown keys there at start-up unless your own config class adds it; "
            "batchfit ignores it",
            id="skyrl",
        ),
        pytest.param(
            _set(_verl(), "actor_rollout_ref.actor.my_flag", 1),
            "'actor_rollout_ref.actor.my_flag' (set to 1) is not a key of verl 0.9.1's config: "
            "'actor_rollout_ref.actor' (FSDPActorConfig) has no 'my_flag', and verl refuses unknown keys there at "
            "start-up unless your own config class adds it; batchfit ignores it",
            id="verl-dataclass-section",
        ),
    ],
)
def test_an_unknown_key_where_the_framework_refuses_unknown_keys_is_a_warning(config, message):
    run = read_run_config(config)
    assert run.warnings == (message,)
    assert message in run.plan().warnings


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        pytest.param(
            _set(_skyrl(), "trainer.policy.model", "Qwen/Qwen2.5-7B"),
            r"trainer\.policy\.model='Qwen/Qwen2\.5-7B': 'trainer\.policy\.model' is a section of SkyRL 0\.4\.0's "
            r"config, not a value; set the keys below it instead \(such as trainer\.policy\.model\.path\)",
            id="value-for-section",
        ),
        pytest.param(
            _set(_verl(), "data.train_batch_size", {"prompts": 8}),
            r"data\.train_batch_size\.prompts=8: 'data\.train_batch_size' is a value in verl 0\.9\.1's config, not a "
            r"section; set data\.train_batch_size to a value",
            id="section-for-value",
        ),
    ],
)
def test_a_value_where_the_schema_has_a_section_and_back_are_faults(config, pattern):
    with pytest.raises(BatchConfigError, match=pattern):
        read_run_config(config)


def test_a_flat_field_beside_a_frameworks_sections_is_no_unknown_key():
    config = _skyrl()
    config["micro_train_batch_size_per_gpu"] = 2
    run = read_run_config(config)
    assert run.warnings == () and run.batch.micro_train_batch_size_per_gpu == 2


# ------------------------------------------------------------------ memory-affecting keys


@pytest.mark.parametrize(
    ("config", "start", "what"),
    [
        pytest.param(
            _verl(use_liger=True),
            "actor_rollout_ref.model.use_liger=True (the verl 0.9.1 default is False) changes memory in a way "
            "batchfit's budgets do not model: ",
            "Liger kernels",
            id="verl-liger",
        ),
        pytest.param(
            _verl(lora_rank=8, exclude_modules="lm_head"),
            "actor_rollout_ref.model.exclude_modules='lm_head' (the verl 0.9.1 default is None)",
            "without LoRA adapters",
            id="verl-lora-exclude",
        ),
        pytest.param(
            _set(_verl(), "actor_rollout_ref.actor.fsdp_config.model_dtype", "fp16"),
            "actor_rollout_ref.actor.fsdp_config.model_dtype='fp16': batchfit stores parameters in fp32 or bf16",
            "default dtype",
            id="verl-model-dtype-fp16",
        ),
        pytest.param(
            _set(_verl(), "actor_rollout_ref.actor.fsdp_config.mixed_precision", {"param_dtype": "fp16"}),
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32, mixed_precision.param_dtype=fp16, reduce_dtype=fp32",
            "param bf16 with reduce fp32, or none",
            id="verl-mixed-precision-fp16",
        ),
        pytest.param(
            _set(
                _set(
                    _set(_set(_verl(), "algorithm.adv_estimator", "gae"), "critic.model.path", "tiny"),
                    "critic.ppo_micro_batch_size_per_gpu",
                    2,
                ),
                "critic.fsdp.offload_policy",
                True,
            ),
            "critic.fsdp.offload_policy=True differs from the actor's actor_rollout_ref.actor.fsdp_config.offload_policy="
            "False: batchfit profiles the critic with the actor's setting",
            "set them alike",
            id="verl-critic-offload-differs",
        ),
        # issue 30: the policy's Ulysses size is modelled now (tests/test_cli_sequence_parallel.py)
        pytest.param(
            _set(_verl(), "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params", 1000),
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1000 (the verl 0.9.1 default is 0)",
            "FSDP units",
            id="verl-wrap-policy",
        ),
        pytest.param(
            _skyrl(flash_attn=False),
            "trainer.flash_attn=False (the SkyRL 0.4.0 default is True) changes memory",
            "flash-attention",
            id="skyrl-flash-attn",
        ),
        pytest.param(
            _set(_skyrl(), "trainer.policy.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap", ["Block"]),
            "trainer.policy.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=['Block'] (the SkyRL 0.4.0 "
            "default is None)",
            "FSDP units",
            id="skyrl-wrap-policy",
        ),
        pytest.param(
            _set(_skyrl(), "trainer.policy.fsdp_config.reshard_after_forward", 2),
            "trainer.policy.fsdp_config.reshard_after_forward=2 reshards to a smaller group than every GPU",
            "True or False only",
            id="skyrl-reshard-to-a-group",
        ),
        pytest.param(
            _set(_skyrl(), "trainer.policy.fsdp_config.mixed_precision", {"reduce_dtype": "bf16"}),
            "trainer.policy.fsdp_config.mixed_precision param_dtype=bf16, reduce_dtype=bf16",
            "param bf16 with reduce fp32, or none",
            id="skyrl-mixed-precision-bf16-reduce",
        ),
        pytest.param(
            _set(_skyrl(algorithm={"use_kl_loss": True}), "trainer.ref.fsdp_config.cpu_offload", True),
            "trainer.ref.fsdp_config.cpu_offload=True differs from the policy's trainer.policy.fsdp_config.cpu_offload="
            "False: batchfit profiles the reference with the policy's setting",
            "set them alike",
            id="skyrl-reference-offload-differs",
        ),
    ],
)
def test_a_memory_key_set_away_from_its_default_is_a_warning_naming_it(config, start, what):
    run = read_run_config(config)
    assert len(run.warnings) == 1 and run.warnings[0].startswith(start), run.warnings
    assert what in run.warnings[0]
    plan = run.plan(strict=True)  # --strict is about layouts the framework runs with waste, not these
    assert run.warnings[0] in plan.warnings


def test_a_memory_key_set_to_its_default_warns_of_nothing():
    assert read_run_config(_verl(use_liger=False, lora_rank=0)).warnings == ()
    assert read_run_config(_skyrl(flash_attn=True)).warnings == ()


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(_verl(lora_rank=64, use_remove_padding=False, use_fused_kernels=True), id="verl"),
        pytest.param(
            _set(
                _set(_verl(), "actor_rollout_ref.actor.fsdp_config.model_dtype", "bf16"),
                "actor_rollout_ref.actor.fsdp_config.reshard_after_forward",
                False,
            ),
            id="verl-dtype-reshard",
        ),
        pytest.param(
            _set(
                _set(_skyrl(bf16=False), "trainer.policy.fsdp_config.reshard_after_forward", False),
                "trainer.policy.fsdp_config.mixed_precision",
                {"param_dtype": "fp32", "reduce_dtype": "fp32"},
            ),
            id="skyrl-reshard-precision-reference-dtype",
        ),
        pytest.param(
            _set(
                _set(_skyrl(remove_microbatch_padding=False), "trainer.policy.model.lora.rank", 32),
                "trainer.algorithm.use_entropy_loss",
                True,
            ),
            id="skyrl",
        ),
    ],
)
def test_memory_keys_that_profile_models_from_the_run_config_warn_of_nothing(config):
    # LoRA (RunConfig.lora), padding removal (the probe's cost), fused kernels and entropy
    # (batchfit.frameworks.run_step), dtypes, mixed precision and resharding (the sharding) are read
    # into RunConfig and modelled from there
    assert read_run_config(config).warnings == ()


def test_plan_prints_the_configs_warnings(tmp_path, capsys):
    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(_verl(use_liger=True)))
    assert main(["plan", str(path)]) == 0
    assert (
        "warning: actor_rollout_ref.model.use_liger=True (the verl 0.9.1 default is False)"
        in capsys.readouterr().out
    )
    assert main(["plan", str(path), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert [w.split(" ")[0] for w in warnings] == ["actor_rollout_ref.model.use_liger=True"]


# ------------------------------------------------------------------ what RunConfig reads


def test_verl_fields_the_step_depends_on():
    run = read_run_config(
        _verl(lora_rank=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], use_fused_kernels=True)
    )
    assert run.lora == {
        "rank": 16,
        "alpha": 32,
        "target_modules": ["q_proj", "v_proj"],
        "exclude_modules": None,
    }
    assert run.fused_kernels is True and run.remove_padding is True and run.strategy == "fsdp"  # FSDP1
    assert run.critic_remove_padding is None  # no critic
    assert run.temperature == 1.0
    megatron = _set(_verl(), "actor_rollout_ref.actor.strategy", "megatron")
    megatron["actor_rollout_ref"]["model"]["lora"] = {"rank": 8, "alpha": 16}
    assert read_run_config(megatron).lora["rank"] == 8  # Megatron reads the lora block
    critic = _set(_verl(), "critic.enable", True)
    critic["critic"].update(
        ppo_micro_batch_size_per_gpu=2, model={"use_remove_padding": False, "lora_rank": 4}
    )
    run = read_run_config(critic)
    assert run.critic_remove_padding is False
    assert run.critic_lora == {
        "rank": 4,
        "alpha": 16,
        "target_modules": "all-linear",
        "exclude_modules": None,
    }


@pytest.mark.parametrize(
    ("actor", "model", "expected"),
    [
        pytest.param({}, {}, ("none", "full", None, False, False), id="default"),
        pytest.param({"calculate_entropy": True}, {}, ("full", "full", None, True, False), id="metric"),
        pytest.param({"entropy_coeff": 0.01}, {}, ("full", "full", None, True, True), id="in-loss"),
        pytest.param(
            {"calculate_entropy": True, "entropy_checkpointing": True},
            {},
            ("checkpointed", "checkpointed", None, True, False),
            id="checkpointed",
        ),
        pytest.param(
            {
                "calculate_entropy": True,
                "entropy_from_logits_with_chunking": True,
                "entropy_from_logits_chunk_size": 512,
            },
            {},
            ("chunked", "chunked", 512, True, False),
            id="chunked",
        ),
        # the padded path never chunks (prepare_model_outputs)
        pytest.param(
            {"calculate_entropy": True, "entropy_from_logits_with_chunking": True},
            {"use_remove_padding": False},
            ("full", "full", None, True, False),
            id="chunking-needs-remove-padding",
        ),
        pytest.param(
            {"entropy_from_logits_with_chunking": True},
            {},
            ("none", "chunked", 2048, False, False),
            id="forward-only",
        ),
    ],
)
def test_verl_entropy_follows_its_engines_keys(actor, model, expected):
    config = _verl(**model)
    config["actor_rollout_ref"]["actor"].update(actor)
    run = read_run_config(config)
    assert (
        run.entropy,
        run.forward_entropy,
        run.entropy_chunk_size,
        run.entropy_grad,
        run.entropy_in_loss,
    ) == expected


def test_verls_bypass_mode_skips_the_old_log_prob_pass_and_its_entropy():
    config = _set(_verl(), "algorithm.rollout_correction.bypass_mode", True)
    assert read_run_config(config).forward_entropy == "none"


def test_skyrl_fields_the_step_depends_on():
    run = read_run_config(_skyrl())
    # worker.py computes chunked entropy in the trained pass, chunks of logprobs_chunk_size tokens
    assert (run.entropy, run.entropy_chunk_size, run.entropy_grad, run.forward_entropy) == (
        "chunked",
        1024,
        False,
        "none",
    )
    assert run.remove_padding is True and run.fused_kernels is False and run.lora is None
    assert run.temperature == 1.0  # trainer.algorithm.temperature defaults to the sampling temperature
    config = _skyrl(logprobs_chunk_size=256, remove_microbatch_padding=False)
    config["trainer"]["algorithm"]["use_entropy_loss"] = True
    config["generator"]["sampling_params"] = {"temperature": 0.6}
    config["trainer"]["policy"] = {"model": {"lora": {"rank": 8, "alpha": 16, "target_modules": ["q_proj"]}}}
    run = read_run_config(config)
    assert (run.entropy_chunk_size, run.logprobs_chunk_size, run.entropy_grad, run.entropy_in_loss) == (
        256,
        256,
        True,
        True,
    )
    assert run.remove_padding is False and run.temperature == 0.6
    assert run.lora == {"rank": 8, "alpha": 16, "target_modules": ["q_proj"], "exclude_modules": None}
    # the deprecated alias, alone, is what SkyRL reads (from_cli_overrides renames it)
    assert read_run_config(_skyrl(use_sample_packing=False)).remove_padding is False


def test_skyrl_reads_the_references_and_critics_own_placement():
    config = _skyrl()
    config["trainer"]["placement"].update(
        critic_num_gpus_per_node=4, ref_num_nodes=2, ref_num_gpus_per_node=2
    )
    config["trainer"].update(
        critic={"model": {"path": "c"}, "sequence_parallel_size": 2}, critic_mini_batch_size=4
    )
    config["trainer"]["ref"] = {"sequence_parallel_size": 2}
    config["trainer"]["algorithm"] = {"use_kl_loss": True}
    config["trainer"]["critic"]["model"]["lora"] = {"rank": 4}
    run = read_run_config(config)
    assert run.critic_lora == {
        "rank": 4,
        "alpha": 16,
        "target_modules": "all-linear",
        "exclude_modules": None,
    }
    batch = run.batch
    assert (batch.critic_world_size, batch.critic_model_parallel) == (4, 2)
    assert (batch.reference_world_size, batch.reference_model_parallel) == (4, 2)
    # megatron sizes are read only under trainer.strategy=megatron (validate_batch_sizes)
    config["trainer"]["policy"] = {"megatron_config": {"tensor_model_parallel_size": 2}}
    assert read_run_config(config).batch.tensor_parallel == 1
