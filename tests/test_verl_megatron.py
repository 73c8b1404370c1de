"""verl 0.9.1's Megatron actor (``actor_rollout_ref.actor.strategy: megatron``) read into RunConfig, and ``--emit verl`` for it.

NOTE [ verl's Megatron engine ] and NOTE [ What a Megatron profile refuses ] in :mod:`batchfit.frameworks.verl`: the
McoreEngineConfig under ``actor.megatron`` / ``ref.megatron`` (engine/megatron.yaml's defaults, the reference's
sizes defaulting to the actor's), the plan's dp = world / (tp · pp · cp), recompute from
``override_transformer_config``, and the token lengths verl multiplies by ``context_parallel_size``.
"""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from batchfit.budget.choices import Choices
from batchfit.budget.options import ProfileOptions
from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.frameworks import config_options, read_run_config
from batchfit.frameworks.assumptions import EmitError, setting_keys
from batchfit.frameworks.run_profile import role_options
from batchfit.frameworks.verl import megatron_refusal
from batchfit.frameworks.verl_emit import token_keys
from batchfit.parallel.sharding import Sharding

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "verl_megatron.yaml"
MCORE = "actor_rollout_ref.actor.megatron."


def _config(**keys) -> dict:
    """The example's mapping with ``keys`` (``a__b`` for ``a.b``) set; ``None`` removes a key."""
    data = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text(encoding="utf-8")))
    for dotted, value in keys.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return data


def _megatron(**sizes) -> dict:
    """``actor_rollout_ref.actor.megatron`` keys of the example, replaced."""
    return {f"actor_rollout_ref__actor__megatron__{k}": v for k, v in sizes.items()}


# --- reading -------------------------------------------------------------------------------------


def test_the_example_reads_as_megatron_tp2_pp2_with_megatrons_dp():
    run = read_run_config(EXAMPLE)
    assert run.strategy == "megatron"
    b = run.batch
    assert (b.tensor_parallel, b.pipeline_parallel, b.context_parallel, b.sequence_parallel) == (2, 2, 1, 1)
    assert run.megatron_sequence_parallel is True and run.distributed_optimizer is True
    # McoreEngineConfig.dtype bfloat16 for the actor and the reference
    assert (run.dtype, run.reference_dtype) == ("bf16", "bf16")
    assert run.gradient_checkpointing is True  # override_transformer_config: full, uniform, 1 layer
    assert run.offload == "none" and run.mixed_precision is None and run.reshard_after_forward is None
    assert run.faults == () and run.warnings == ()
    # 8 GPUs / (tp 2 · pp 2 · cp 1) = dp 2; 16 prompts × 8 = 128 samples per mini-batch, 64 per dp rank
    plan = run.plan()
    assert plan.dp_size == 2 and plan.roles[0].samples_per_mini_batch_per_gpu == 64
    assert run.key_names["tensor_parallel"] == MCORE + "tensor_model_parallel_size"
    assert "sequence_parallel" not in run.key_names  # no Ulysses axis under Megatron


def test_an_actor_with_no_megatron_section_takes_verls_megatron_defaults():
    data = _config(actor_rollout_ref__actor__megatron=None, actor_rollout_ref__ref__megatron=None)
    run = read_run_config(data)
    b = run.batch
    assert (b.tensor_parallel, b.pipeline_parallel, b.context_parallel) == (1, 1, 1)  # engine/megatron.yaml
    # sequence_parallel: true by default, turned off at TP 1 (McoreEngineConfig.__post_init__)
    assert run.megatron_sequence_parallel is False
    assert run.distributed_optimizer is True  # use_distributed_optimizer: true by default
    # HFModelConfig.enable_gradient_checkpointing (true by default) is the FSDP engine's: no recompute here
    assert run.gradient_checkpointing is False


def test_the_references_sizes_default_to_the_actors_and_a_different_layout_is_a_warning():
    run = read_run_config(_config(actor_rollout_ref__ref__megatron=None))
    assert not any("differs from the actor's" in w for w in run.warnings)
    run = read_run_config(_config(actor_rollout_ref__ref__megatron={"tensor_model_parallel_size": 4}))
    assert any(
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=4 differs from the actor's "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2" in w
        for w in run.warnings
    )


def test_sequence_parallel_and_the_distributed_optimizer_are_read_as_set():
    run = read_run_config(_config(**_megatron(sequence_parallel=False, use_distributed_optimizer=False)))
    assert run.megatron_sequence_parallel is False and run.distributed_optimizer is False


@pytest.mark.parametrize(
    ("recompute", "checkpointing", "warned"),
    [
        ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}, True, None),
        ({"recompute_granularity": None}, False, None),
        ({"recompute_granularity": "selective"}, False, "the budgets are for none"),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 2}, True, "keeps less"),
    ],
    ids=["full-every-layer", "none", "selective", "full-block"],
)
def test_megatron_recompute_is_read_as_checkpointing(recompute, checkpointing, warned):
    run = read_run_config(_config(**_megatron(override_transformer_config=recompute)))
    assert run.gradient_checkpointing is checkpointing
    said = [w for w in run.warnings if "recompute_granularity" in w]
    assert (warned is None and not said) or (warned is not None and warned in said[0])


def test_the_entropy_modes_are_the_megatron_engines():
    run = read_run_config(_config(actor_rollout_ref__actor__entropy_from_logits_with_chunking=True))
    # megatron_actor.yaml: megatron.entropy_from_logits_* interpolate the actor's keys; the old-log-prob pass asks
    assert (run.entropy, run.forward_entropy, run.entropy_chunk_size) == ("none", "chunked", 2048)
    run = read_run_config(_config(actor_rollout_ref__actor__entropy_coeff=0.01))
    assert run.entropy == "full" and run.entropy_in_loss
    assert not any("entropy_coeff" in w for w in run.warnings)  # profiled, not warned about


def test_the_megatron_profile_runs_verls_head_with_the_entropy_each_pass_computes():
    from batchfit.budget.megatron_profile import megatron_head
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_config(actor_rollout_ref__actor__entropy_coeff=0.01))
    options = run_profile_options(run, {}).options
    heads = {role: megatron_head(options, role) for role in ("policy", "policy_forward", "reference")}
    assert {role: (h.framework, h.entropy) for role, h in heads.items()} == {
        "policy": ("verl", True),  # entropy_coeff != 0: the update's entropy, with its graph
        "policy_forward": ("verl", True),  # the old log-probs always compute it
        "reference": ("verl", False),
    }
    assert heads["policy"].entropy_grad
    chunked = run_profile_options(read_run_config(_config(actor_rollout_ref__actor__entropy_from_logits_with_chunking=True)), {})
    assert megatron_head(chunked.options, "policy_forward").chunk_size == 2048
    both = read_run_config(
        _config(actor_rollout_ref__actor__entropy_from_logits_with_chunking=True, actor_rollout_ref__actor__entropy_coeff=0.01)
    )
    with pytest.raises(InvalidArgument, match="verl's chunked entropy"):
        megatron_head(run_profile_options(both, {}).options, "policy")


def test_the_megatron_offload_keys_decide_what_stays_resident():
    run = read_run_config(_config(**_megatron(param_offload=True, optimizer_offload=True)))
    # the reference's param_offload defaults to the actor's (${oc.select:actor_rollout_ref.actor.megatron.param_offload})
    assert run.resident == {"policy": (), "reference": ()}
    assert run.optimizer_offload is True


OPTIM = "actor_rollout_ref__actor__optim__"


def test_the_optimizer_overrides_offload_the_state_with_the_precision_aware_optimizer():
    # NOTE [ verl's Megatron optimizer ]: run_deepseek_v3_671b_megatron.sh's four overrides
    override = OPTIM + "override_optimizer_config__"
    run = read_run_config(_config(**{override + "optimizer_cpu_offload": True, override + "optimizer_offload_fraction": "1",
                                     override + "use_precision_aware_optimizer": True, override + "overlap_cpu_optimizer_d2h_h2d": True}))
    assert (run.precision_aware_optimizer, run.optimizer_cpu_offload, run.optimizer_offload_fraction) == (True, True, 1.0)
    assert run.optimizer_dtypes == {} and run.warnings == ()
    sharding = config_options.run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options.sharding
    assert (sharding.precision_aware_optimizer, sharding.optimizer_cpu_offload, sharding.optimizer_offload_fraction) == (True, True, 1.0)
    # the optim config's own keys, the dtypes verl reads under it; an override wins over them
    own = read_run_config(_config(**{OPTIM + "use_precision_aware_optimizer": True, OPTIM + "main_grads_dtype": "bf16",
                                     OPTIM + "exp_avg_dtype": "bf16", override + "exp_avg_sq_dtype": "bf16"}))
    assert own.precision_aware_optimizer is True and own.optimizer_cpu_offload is False
    assert own.optimizer_dtypes == {"main_grads_dtype": "bf16", "exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bf16"}
    sharding = config_options.run_profile_options(own, {"backend": "estimate", "max_seq_len": 4096}).options.sharding
    assert (sharding.main_grads_dtype, sharding.exp_avg_dtype, sharding.main_params_dtype) == ("bf16", "bf16", "fp32")
    assert read_run_config(EXAMPLE).precision_aware_optimizer is False  # verl's default


def test_an_offload_without_the_precision_aware_optimizer_is_profiled_on_the_gpu_with_a_warning():
    run = read_run_config(_config(**{OPTIM + "override_optimizer_config__optimizer_cpu_offload": True}))
    assert run.optimizer_cpu_offload is False and run.precision_aware_optimizer is False
    assert any("optimizer_cpu_offload=True without use_precision_aware_optimizer is not modelled" in w for w in run.warnings)


def test_fsdp_only_keys_set_under_megatron_are_warnings():
    data = _config(actor_rollout_ref__actor__ulysses_sequence_parallel_size=2)
    data["actor_rollout_ref"]["model"]["enable_activation_offload"] = True
    said = read_run_config(data).warnings
    assert any(w.startswith("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 is not read") for w in said)
    assert any(w.startswith("actor_rollout_ref.model.enable_activation_offload=True is not read") for w in said)


def test_a_megatron_key_batchfit_does_not_model_is_a_warning_citing_verls_default():
    said = read_run_config(_config(**_megatron(use_megatron_fsdp=True))).warnings
    assert any(
        w.startswith("actor_rollout_ref.actor.megatron.use_megatron_fsdp=True (the verl 0.9.1 default is False)")
        for w in said
    )


def test_virtual_pipeline_stages_are_read_into_the_layout_and_emitted():
    run = read_run_config(_config(**_megatron(virtual_pipeline_model_parallel_size=2)))
    assert run.virtual_pipeline_parallel == 2 and not [w for w in run.warnings if "virtual_pipeline" in w]
    assert read_run_config(EXAMPLE).virtual_pipeline_parallel is None  # verl's default: null
    options = config_options.run_profile_options(run, Choices()).options
    assert options.sharding.virtual_pipeline_parallel == 2
    keys = _keys(run, sharding=_megatron_sharding(virtual_pipeline_parallel=2))
    assert keys[MCORE + "virtual_pipeline_model_parallel_size"] == 2


# --- verl's rules under Megatron ---------------------------------------------------------------------


def test_the_minimal_batch_is_megatrons_dp_times_the_micro_size():
    # no dynamic batches: validate_config's minimal batch is megatron_dp 2 × ppo_micro_batch_size_per_gpu 4 = 8;
    # 3 prompts × 2 samples = 6 is not a multiple of 8 (the FSDP rule, % 8 GPUs, is not verl's here)
    keys = {
        "data__train_batch_size": 3,
        "actor_rollout_ref__actor__ppo_mini_batch_size": 1,
        "actor_rollout_ref__actor__use_dynamic_bsz": False,
        "actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref__rollout__n": 2,
        "actor_rollout_ref__rollout__log_prob_use_dynamic_bsz": False,
        "actor_rollout_ref__rollout__log_prob_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref__ref__log_prob_use_dynamic_bsz": False,
        "actor_rollout_ref__ref__log_prob_micro_batch_size_per_gpu": 1,
    }
    run = read_run_config(_config(**keys))
    said = [f for f in run.faults if "Megatron minimal batch" in f]
    assert said and said[0].startswith(
        "data.train_batch_size × actor_rollout_ref.rollout.n = 3 × 2 = 6 is not divisible by the Megatron minimal batch, "
        "dp 2 × actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu 4 = 8"
    )
    # 1 prompt × 6 samples with a micro size of 1: 6 % (dp 2 × 1) == 0, though 6 % 8 GPUs is not
    keys.update({"data__train_batch_size": 1, "actor_rollout_ref__rollout__n": 6, "actor_rollout_ref__actor__ppo_micro_batch_size_per_gpu": 1})
    run = read_run_config(_config(**keys))
    assert not any("minimal batch" in f or "divisible by the 8 GPUs" in f for f in run.faults)


def test_a_token_length_is_checked_times_the_context_parallel_size():
    data = _config(actor_rollout_ref__actor__ppo_max_token_len_per_gpu=1024, **_megatron(context_parallel_size=2))
    said = [f for f in read_run_config(data).faults if f.startswith("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")]
    # 1024 × cp 2 = 2048 < 1024 + 3072: prepare_micro_batches packs max_token_len_per_gpu × sp_size (= cp)
    assert said == [
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024 × context_parallel_size 2 = 2048 is below the longest "
        "sequence, data.max_prompt_length + data.max_response_length = 4096: verl 0.9.1's rearrange_micro_batches "
        "refuses it at run time (verl/utils/seqlen_balancing.py); set it to at least 2048"
    ]


def test_a_world_the_megatron_sizes_do_not_divide_is_a_fault():
    data = _config(**_megatron(tensor_model_parallel_size=3))
    with pytest.raises(BatchConfigError, match=r"model-parallel size, actor_rollout_ref\.actor\.megatron\.tensor_model_parallel_size=3"):
        read_run_config(data).plan()


# --- what profile refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        (
            {"actor_rollout_ref__model__lora": {"rank": 8, "alpha": 16}},
            "the config's actor_rollout_ref.model.lora.rank=8 trains Megatron LoRA adapters",
        ),
        (
            {"algorithm__adv_estimator": "gae"},
            "the config's algorithm.adv_estimator='gae' trains a critic beside the Megatron actor",
        ),
    ],
    ids=["lora", "critic"],  # expert parallelism is profiled: tests/test_megatron_moe.py
)
def test_what_the_megatron_profile_does_not_model_is_one_refusal_naming_key_value_and_fix(keys, said):
    run = read_run_config(_config(**keys))
    refusal = megatron_refusal(run)
    assert refusal is not None and refusal.startswith(said)
    assert "; " in refusal and "\n" not in refusal  # the fix after the reason, one line
    if "critic" not in said:
        run.plan()  # verl runs it: `batchfit plan` still answers


def test_a_modelled_megatron_run_and_an_fsdp_run_are_not_refused():
    assert megatron_refusal(read_run_config(EXAMPLE)) is None
    fsdp = _config(actor_rollout_ref__actor__strategy="fsdp2", **_megatron(context_parallel_size=2))
    assert megatron_refusal(read_run_config(fsdp)) is None


_ASKS_THE_FRAMEWORK = "strategy_refusal(run)" in inspect.getsource(config_options.sharding_strategy).split(
    "MODEL_PARALLEL_STRATEGIES"
)[-1].split("return strategy")[0]


@pytest.mark.skipif(
    not _ASKS_THE_FRAMEWORK,
    reason="until config_options.sharding_strategy's Megatron branch asks the framework's refusal "
    "(/work/notes/helpers/frameworks-megatron.patch)",
)
def test_profile_refuses_an_unmodelled_megatron_setting_before_any_probe():
    run = read_run_config(_config(actor_rollout_ref__model__lora={"rank": 8, "alpha": 16}))
    with pytest.raises(InvalidArgument, match=r"lora.rank=8 trains Megatron LoRA adapters"):
        config_options.run_profile_options(run, Choices())


# --- --emit verl ---------------------------------------------------------------------------------------------


def _megatron_sharding(**fields) -> Sharding:
    values = {"tensor_parallel": 2, "pipeline_parallel": 2, "megatron_sequence_parallel": True, "distributed_optimizer": True}
    return Sharding("megatron", world_size=8, **{**values, **fields})


def _keys(run, **options) -> dict:
    values = {"max_seq_len": 512, "sharding": _megatron_sharding(), "cost": "packed", "dtype": "bf16", "gradient_checkpointing": True}
    keys = setting_keys(run, role_options(run, ProfileOptions(**{**values, **options})), "verl")
    return {k.path: k.value for k in keys if k.path}


def test_the_emitted_keys_are_megatrons_and_no_fsdp_key():
    keys = _keys(read_run_config(EXAMPLE))
    assert keys["actor_rollout_ref.actor.strategy"] == "megatron"
    expected = {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "context_parallel_size": 1,
        "sequence_parallel": True,
        "use_distributed_optimizer": True,
        "dtype": "bfloat16",
        "override_transformer_config.recompute_granularity": "full",
        "override_transformer_config.recompute_method": "uniform",
        "override_transformer_config.recompute_num_layers": 1,
    }
    assert {k: keys[MCORE + k] for k in expected} == expected
    assert keys["actor_rollout_ref.ref.megatron.tensor_model_parallel_size"] == 2
    assert (keys["trainer.nnodes"], keys["trainer.n_gpus_per_node"]) == (1, 8)
    assert not [k for k in keys if "fsdp" in k or "ulysses" in k or k.endswith("enable_gradient_checkpointing")]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"dtype": "fp32"}, "--emit verl cannot carry --dtype fp32 with --sharding megatron"),
        ({"activation_offload": True}, "--activation-offload"),
    ],
    ids=["fp32", "activation-offload"],
)
def test_what_verls_megatron_engine_cannot_run_is_refused(change, said):
    with pytest.raises(EmitError, match=said):
        _keys(read_run_config(EXAMPLE), **change)


def test_the_token_lengths_are_the_budgets_per_gpu_of_a_tensor_pipeline_group():
    profile = SimpleNamespace(options={"policy": SimpleNamespace(sharding=_megatron_sharding())})
    budgets = {"policy": 6000, "policy_forward": 6000, "reference": 6000}
    keys = {k.path: k for k in token_keys(profile, budgets, lambda role, what: what, 512, 8)}
    # context parallelism 1: verl's per-GPU length × megatron.context_parallel_size is the budget itself
    assert keys["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].value == 6000
    assert keys["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"].value == 6000
    assert keys["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"].value == 6000
    assert keys["actor_rollout_ref.actor.use_dynamic_bsz"].value is True
    assert "megatron.context_parallel_size=1" in keys["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].comment
    assert not [k for k in keys if "critic" in k or "ulysses" in k]


@pytest.mark.slow
def test_profile_emits_verl_megatron_keys_for_the_example(capsys):
    from batchfit.cli import main

    # a tiny model on an 8 GiB device (on 80 GB its budget runs to millions of tokens, past the estimate's integer values)
    flags = ["--model", "tiny", "--max-seq-len", "512", "--backend", "estimate", "--memory", "8GiB", "--no-progress", "--json"]
    assert main(["profile", "--config", str(EXAMPLE), "--emit", "verl", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    emit = data["emit"]
    assert emit["actor_rollout_ref.actor.strategy"] == "megatron"
    assert emit["actor_rollout_ref.actor.use_dynamic_bsz"] is True
    assert emit[MCORE + "tensor_model_parallel_size"] == 2 and emit[MCORE + "pipeline_model_parallel_size"] == 2
    length = emit["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    # NOTE [ A Megatron profile's roles ]: the forward-only passes have their own budgets; the reference's (no entropy)
    # at least the update's, the old log-probs' below the reference's (verl computes their entropy on a clone)
    reference = emit["actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"]
    assert length >= 512 and reference >= length
    assert 512 <= emit["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] < reference
    assert not [k for k in emit if "fsdp_config" in k or "ulysses" in k]


# --- dynamic context parallelism (NOTE [ What a Megatron profile refuses ]) and pad_to_length ---------------------


def test_dynamic_context_parallelism_is_one_refusal_naming_the_scheduler_and_its_cap():
    run = read_run_config(_config(**_megatron(dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=8192)))
    refusal = megatron_refusal(run)
    assert refusal is not None and refusal.startswith(
        "the config's actor_rollout_ref.actor.megatron.dynamic_context_parallel=True (max_seqlen_per_dp_cp_rank=8192) "
        "lets Megatron-Core's DefaultDynamicCPScheduler"
    )
    assert "ceil(length / max_seqlen_per_dp_cp_rank)" in refusal and "; set it to false and a fixed" in refusal
    assert not [w for w in run.warnings if "dynamic_context_parallel" in w]  # refused, not also warned
    run.plan()  # verl runs it: `batchfit plan` still answers


def test_megatron_pad_to_length_is_read_for_the_actor_and_the_reference():
    run = read_run_config(_config(**_megatron(pad_to_length=True)))
    assert run.token_bucket == 512  # McoreEngineConfig.pad_to_length_bucket
    assert not [w for w in run.warnings if "pad_to_length" in w]  # the reference's interpolates the actor's
    assert read_run_config(_config(**_megatron(pad_to_length=True, pad_to_length_bucket=2048))).token_bucket == 2048


def test_megatron_lengths_are_multiples_of_lcm_of_the_bucket_and_the_context_parallel_size():
    run = read_run_config(_config(**_megatron(pad_to_length=True, context_parallel_size=2)))
    profile = SimpleNamespace(run=run, options={"policy": SimpleNamespace(sharding=_megatron_sharding(context_parallel=2))})
    budgets = {"policy": 6000, "policy_forward": 6000, "reference": 6000}
    keys = {k.path: k for k in token_keys(profile, budgets, lambda role, what: what, 512, 8)}
    # lcm(512, 2) = 512: 6,000 // 512 = 11 × 512 = 5,632 tokens a micro-batch, over cp 2: 2,816 per GPU
    assert keys["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].value == 2816
    assert "a micro-batch of 5,632 tokens split over 2 GPUs" in keys["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"].comment
    assert keys[MCORE + "pad_to_length_bucket"].value == 512


def test_dynamic_context_parallelism_without_its_cap_or_with_pad_to_length_is_a_fault():
    faults = read_run_config(_config(**_megatron(dynamic_context_parallel=True))).faults
    assert [f for f in faults if f.startswith(
        "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True with max_seqlen_per_dp_cp_rank=None: verl refuses"
    )]
    faults = read_run_config(
        _config(**_megatron(dynamic_context_parallel=True, max_seqlen_per_dp_cp_rank=4096, pad_to_length=True))
    ).faults
    assert [f for f in faults if "dynamic_context_parallel does not support pad_to_length" in f]
    assert not [f for f in faults if "max_seqlen_per_dp_cp_rank=4096" in f]
