"""SkyRL 0.4.0's Megatron strategy (``trainer.strategy: megatron``) read into RunConfig, and ``--emit skyrl`` for it.

NOTE [ SkyRL's Megatron worker ] and NOTE [ What a SkyRL Megatron profile refuses ] in :mod:`batchfit.frameworks.skyrl`:
``megatron_config``'s sizes, Megatron's sequence parallelism on exactly when TP is, the distributed optimizer always,
bf16 parameters with ``trainer.bf16``, recompute from ``trainer.gradient_checkpointing`` and
``transformer_config_kwargs``, and one token key, ``trainer.max_tokens_per_microbatch``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from batchfit.budget.options import ProfileOptions
from batchfit.frameworks import read_run_config
from batchfit.frameworks.assumptions import EmitError, setting_keys
from batchfit.frameworks.run_profile import role_options
from batchfit.frameworks.skyrl import megatron_refusal
from batchfit.frameworks.skyrl_emit import token_keys
from batchfit.parallel.sharding import Sharding

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "skyrl_megatron.yaml"
MCORE = "trainer.policy.megatron_config."


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
    return {f"trainer__policy__megatron_config__{k}": v for k, v in sizes.items()}


# --- reading -------------------------------------------------------------------------------------


def test_the_example_reads_as_megatron_tp2_pp2_with_megatrons_dp():
    run = read_run_config(EXAMPLE)
    assert run.strategy == "megatron"
    b = run.batch
    assert (b.tensor_parallel, b.pipeline_parallel, b.context_parallel, b.sequence_parallel) == (2, 2, 1, 1)
    # megatron_worker.py: provider.sequence_parallel = tensor_model_parallel_size > 1; optimizer.py: always distributed
    assert run.megatron_sequence_parallel is True and run.distributed_optimizer is True
    assert (run.dtype, run.reference_dtype) == ("bf16", "bf16")  # trainer.bf16: true
    assert run.gradient_checkpointing is True  # SkyRL's default kwargs: full, uniform, 1 layer
    assert run.offload == "none" and run.mixed_precision is None and run.reshard_after_forward is None
    assert run.faults == () and run.warnings == ()
    # validate_batch_sizes: dp = 8 / (pp 2 · cp 1 · tp 2) = 2; 16 prompts × 8 = 128 samples, 64 per dp rank
    plan = run.plan()
    assert plan.dp_size == 2 and plan.roles[0].samples_per_mini_batch_per_gpu == 64
    assert run.batch.max_tokens_per_micro_batch == 8192


def test_megatron_sequence_parallel_follows_tensor_parallelism():
    run = read_run_config(_config(**_megatron(tensor_model_parallel_size=1, pipeline_model_parallel_size=4)))
    assert run.megatron_sequence_parallel is False and run.batch.plan().dp_size == 2


def test_the_distributed_optimizer_is_off_only_when_the_optimizer_kwargs_say_so():
    run = read_run_config(_config(**_megatron(optimizer_config_kwargs={"use_distributed_optimizer": False})))
    assert run.distributed_optimizer is False


def test_parameters_are_fp32_without_trainer_bf16():
    run = read_run_config(_config(trainer__bf16=False))
    assert (run.dtype, run.reference_dtype) == ("fp32", "fp32")


@pytest.mark.parametrize(
    ("checkpointing", "kwargs", "expected", "warned"),
    [
        (False, {}, False, None),
        (True, {"recompute_granularity": "selective"}, False, "the budgets are for none"),
        (True, {"recompute_method": "block", "recompute_num_layers": 4}, True, "keeps less"),
    ],
    ids=["off", "selective", "block"],
)
def test_recompute_is_read_from_gradient_checkpointing_and_the_transformer_kwargs(checkpointing, kwargs, expected, warned):
    data = _config(trainer__gradient_checkpointing=checkpointing)
    if kwargs:
        data["trainer"]["policy"]["megatron_config"]["transformer_config_kwargs"] = kwargs
    run = read_run_config(data)
    assert run.gradient_checkpointing is expected
    said = [w for w in run.warnings if "recompute_granularity" in w]
    assert (warned is None and not said) or (warned is not None and warned in said[0])


def test_a_reference_laid_out_unlike_the_policy_is_a_warning():
    data = _config(trainer__ref__megatron_config__pipeline_model_parallel_size=1)
    said = read_run_config(data).warnings
    assert any(
        w.startswith(
            "trainer.ref.megatron_config.pipeline_model_parallel_size=1 differs from the policy's "
            "trainer.policy.megatron_config.pipeline_model_parallel_size=2"
        )
        for w in said
    )


def test_skyrls_own_megatron_refusals_are_faults():
    data = _config(trainer__policy__sequence_parallel_size=2)
    data["generator"]["inference_engine"]["backend"] = "sglang"
    faults = read_run_config(data).faults
    assert any(f.startswith("trainer.policy.sequence_parallel_size=2 with trainer.strategy=megatron") for f in faults)
    assert any(f.startswith("generator.inference_engine.backend='sglang' with trainer.strategy=megatron") for f in faults)


def test_an_entropy_loss_is_modelled_not_warned():
    # the Megatron profile runs SkyRL's head with the entropy's graph (megatron_profile.megatron_head: entropy_grad)
    run = read_run_config(_config(trainer__algorithm__use_entropy_loss=True))
    assert run.entropy_grad is True and run.entropy_in_loss is True
    assert not [w for w in run.warnings if "use_entropy_loss" in w]


def test_the_fused_lm_head_is_profiled_in_every_pass_and_emitted():
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

    run = read_run_config(_config(trainer__fused_lm_head_logprob=True, trainer__logprobs_chunk_size=2048))
    assert not [w for w in run.warnings if "fused_lm_head_logprob" in w]  # modelled, not warned
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options
    heads = options.logprobs
    # NOTE [ SkyRL's fused LM head ]: every pass from the hidden states, the update's entropy a metric
    assert isinstance(heads, MegatronHeads)
    assert heads.update == MegatronHead("skyrl", entropy=True, chunk_size=2048, fused=True)
    assert heads.old_log_probs == heads.reference == MegatronHead("skyrl", chunk_size=2048, fused=True)
    keys = {k.path: k.value for k in setting_keys(run, role_options(run, options), "skyrl") if k.path}
    assert keys["trainer.fused_lm_head_logprob"] is True and keys["trainer.logprobs_chunk_size"] == 2048


@pytest.mark.parametrize(("chunk", "expected"), [(None, 1024), (4096, 4096)])
def test_the_log_probs_are_profiled_in_the_configs_chunks(chunk, expected):
    from batchfit.budget.megatron_profile import megatron_head
    from batchfit.frameworks.config_options import run_profile_options

    keys = {} if chunk is None else {"trainer__logprobs_chunk_size": chunk}
    options = run_profile_options(read_run_config(_config(**keys)), {"backend": "estimate", "max_seq_len": 4096}).options
    # ChunkedDistributedLogprob over trainer.logprobs_chunk_size tokens (SkyRL #1610's 1,024 by default)
    assert megatron_head(options, "policy").chunk_size == megatron_head(options, "policy_forward").chunk_size == expected


def test_the_fused_lm_head_without_chunks_is_one_chunk():
    from batchfit.frameworks.config_options import run_profile_options

    data = _config(trainer__fused_lm_head_logprob=True)
    data["trainer"]["logprobs_chunk_size"] = None  # SkyRL's eff_chunk: the whole sequence
    options = run_profile_options(read_run_config(data), {"backend": "estimate", "max_seq_len": 4096}).options
    assert options.logprobs.update.chunk_size is None and options.logprobs.update.fused


def test_the_fused_lm_head_with_an_entropy_loss_is_refused_as_skyrl_refuses_it():
    from batchfit.errors import InvalidArgument
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_config(trainer__fused_lm_head_logprob=True, trainer__algorithm__use_entropy_loss=True))
    with pytest.raises(InvalidArgument, match="SkyRL raises NotImplementedError"):
        run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096})


# --- what profile refuses ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        (
            {"trainer__policy__model__lora": {"rank": 16}},
            "the config's trainer.policy.model.lora.rank=16 trains Megatron LoRA adapters",
        ),
    ],
    ids=["lora"],  # expert parallelism is profiled: tests/test_megatron_moe.py
)
def test_what_the_megatron_profile_does_not_model_is_one_refusal_naming_key_value_and_fix(keys, said):
    run = read_run_config(_config(**keys))
    refusal = megatron_refusal(run)
    assert refusal is not None and refusal.startswith(said) and "; " in refusal
    run.plan()  # SkyRL runs it: `batchfit plan` still answers


def test_context_parallelism_is_profiled_not_refused():
    data = _config(**_megatron(context_parallel_size=2))
    data["trainer"]["ref"]["megatron_config"]["context_parallel_size"] = 2  # needs remove_microbatch_padding (on)
    run = read_run_config(data)
    assert megatron_refusal(run) is None
    assert run.batch.context_parallel == 2
    from batchfit.frameworks.config_options import run_profile_options

    assert run_profile_options(run, {}).options.sharding.context_parallel == 2


def test_a_modelled_megatron_run_and_an_fsdp_run_are_not_refused():
    assert megatron_refusal(read_run_config(EXAMPLE)) is None
    assert megatron_refusal(read_run_config(_config(trainer__strategy="fsdp", **_megatron(context_parallel_size=2)))) is None


# --- --emit skyrl ---------------------------------------------------------------------------------------------


def _megatron_sharding(**fields) -> Sharding:
    values = {"tensor_parallel": 2, "pipeline_parallel": 2, "megatron_sequence_parallel": True, "distributed_optimizer": True}
    return Sharding("megatron", world_size=8, **{**values, **fields})


def _keys(run, sharding=None, **options) -> dict:
    values = {"max_seq_len": 512, "sharding": sharding or _megatron_sharding(), "cost": "packed", "dtype": "bf16",
              "gradient_checkpointing": True}
    keys = setting_keys(run, role_options(run, ProfileOptions(**{**values, **options})), "skyrl")
    return {k.path: k.value for k in keys if k.path}


def test_the_emitted_keys_are_megatrons_and_no_fsdp_key():
    keys = _keys(read_run_config(EXAMPLE))
    assert keys["trainer.strategy"] == "megatron"
    for prefix in (MCORE, "trainer.ref.megatron_config."):
        assert (keys[prefix + "tensor_model_parallel_size"], keys[prefix + "pipeline_model_parallel_size"]) == (2, 2)
        assert keys[prefix + "context_parallel_size"] == 1
    assert keys[MCORE + "optimizer_config_kwargs.use_distributed_optimizer"] is True
    assert keys["trainer.bf16"] is True and keys["trainer.gradient_checkpointing"] is True
    assert keys[MCORE + "transformer_config_kwargs.recompute_granularity"] == "full"
    assert not [k for k in keys if "fsdp" in k or "sequence_parallel_size" in k]


@pytest.mark.parametrize(
    ("sharding", "said"),
    [
        (_megatron_sharding(megatron_sequence_parallel=False), "SkyRL turns Megatron's sequence parallelism on exactly when"),
        (_megatron_sharding(distributed_optimizer=False), "without the distributed optimizer"),
    ],
    ids=["no-sequence-parallel-at-tp2", "no-distributed-optimizer"],
)
def test_a_layout_skyrl_cannot_run_is_refused(sharding, said):
    with pytest.raises(EmitError, match=said):
        _keys(read_run_config(EXAMPLE), sharding)


def test_the_micro_sizes_come_from_the_profiled_megatron_dp():
    # an FSDP config profiled as Megatron tp 2 × pp 2: SkyRL's validate_batch_sizes divides by the emitted sizes (dp 2)
    run = read_run_config(_config(trainer__strategy="fsdp"))
    assert run.batch.plan().dp_size == 8
    profile = SimpleNamespace(run=run, options={"policy": SimpleNamespace(sharding=_megatron_sharding())})
    budgets = {"policy": 64 * 512, "policy_forward": 64 * 512, "reference": 64 * 512}
    keys = {k.path: k.value for k in token_keys(profile, budgets, lambda role, what: what, 512, 8)}
    assert keys["trainer.max_tokens_per_microbatch"] == 64 * 512
    # 16 prompts × 8 samples / dp 2 = 64 per GPU; 64 sequences of 512 tokens fit, and 64 divides 64 (dp 8 would give 16)
    assert keys["trainer.micro_train_batch_size_per_gpu"] == 64


@pytest.mark.slow
def test_profile_emits_skyrl_megatron_keys_for_the_example(capsys):
    from batchfit.cli import main

    # a tiny model on an 8 GiB device (on 80 GB its budget runs to millions of tokens, past the estimate's integer values)
    flags = ["--model", "tiny", "--max-seq-len", "512", "--backend", "estimate", "--memory", "8GiB", "--no-progress", "--json"]
    assert main(["profile", "--config", str(EXAMPLE), "--emit", "skyrl", *flags]) == 0
    emit = json.loads(capsys.readouterr().out)["emit"]
    assert emit["trainer.strategy"] == "megatron"
    assert emit[MCORE + "tensor_model_parallel_size"] == 2 and emit[MCORE + "pipeline_model_parallel_size"] == 2
    assert emit["trainer.max_tokens_per_microbatch"] >= 512
    assert 64 % emit["trainer.micro_train_batch_size_per_gpu"] == 0  # divides dp 2's 64 samples per GPU
    assert not [k for k in emit if "fsdp_config" in k or "sequence_parallel_size" in k]


# --- the entropy's chunks sized from memory (NOTE [ SkyRL's entropy chunks sized from memory ]) -------------------


@pytest.mark.parametrize(
    ("memory_mb", "vocab_shard", "seq_len", "expected"),
    [
        (512, 75_968, 8192, 256),  # 536,870,912 // (75,968 × 4 B × 4 = 1,215,488) = 441 -> 256
        (512, 75_968, 256, None),  # min(256, 441) = 256: the whole sequence, one chunk
        (512, 75_968, 200, 128),  # min(200, 441) = 200 -> 128 < 200: chunks of 128 and 72
        (1, 151_936, 4096, 1),  # 1,048,576 // 2,430,976 = 0 -> max(1, 0) = 1
        (4096, 151_936, 32768, 1024),  # 4,294,967,296 // 2,430,976 = 1,766 -> 1,024
    ],
)
def test_entropy_chunks_are_the_largest_power_of_two_under_the_memory(memory_mb, vocab_shard, seq_len, expected):
    from batchfit.frameworks.skyrl import entropy_chunk_tokens

    assert entropy_chunk_tokens(memory_mb, vocab_shard, seq_len) == expected


@pytest.mark.parametrize(
    ("keys", "size", "memory"),
    [({"trainer__vocab_entropy_chunk_memory_mb": 2048}, 0, 2048), ({"trainer__vocab_entropy_chunk_size": 4096}, 4096, 512),
     ({"trainer__vocab_entropy_chunk_size": None}, None, 512)],
    ids=["memory", "tokens", "no-chunks"],
)
def test_entropy_chunks_set_away_from_skyrls_defaults_are_profiled_and_emitted(keys, size, memory):
    from batchfit.budget.megatron_profile import megatron_head
    from batchfit.frameworks.config_options import run_profile_options

    data = _config(**keys)
    if "trainer__vocab_entropy_chunk_size" in keys and keys["trainer__vocab_entropy_chunk_size"] is None:
        data["trainer"]["vocab_entropy_chunk_size"] = None
    run = read_run_config(data)
    assert not [w for w in run.warnings if "vocab_entropy_chunk" in w]  # modelled, not warned
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options
    head = megatron_head(options, "policy")
    assert (head.entropy_chunk_size, head.entropy_chunk_memory_mb) == (size, memory)
    keys = {k.path: k.value for k in setting_keys(run, role_options(run, options), "skyrl") if k.path}
    assert keys["trainer.vocab_entropy_chunk_size"] == size
    assert keys.get("trainer.vocab_entropy_chunk_memory_mb") == (memory if size == 0 else None)


def test_entropy_chunk_keys_under_the_fused_head_are_no_warning():
    # megatron_model_wrapper.py: the fused head's entropy (_fused_vocab_parallel_entropy_from_hidden) chunks by
    # logprobs_chunk_size; vocab_entropy_chunk_* are not read
    data = _config(trainer__fused_lm_head_logprob=True, trainer__vocab_entropy_chunk_memory_mb=2048)
    assert not [w for w in read_run_config(data).warnings if "vocab_entropy_chunk" in w]


def test_entropy_chunks_at_skyrls_defaults_are_no_warning():
    said = read_run_config(_config(trainer__vocab_entropy_chunk_size=0, trainer__vocab_entropy_chunk_memory_mb=512)).warnings
    assert not [w for w in said if "vocab_entropy_chunk" in w]


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ({"trainer__vocab_entropy_chunk_memory_mb": 0}, r"trainer\.vocab_entropy_chunk_memory_mb=0: SkyRL's TrainerConfig refuses"),
        ({"trainer__vocab_entropy_chunk_size": -1}, r"trainer\.vocab_entropy_chunk_size=-1: SkyRL's TrainerConfig refuses"),
        ({"trainer__vocab_entropy_chunk_size": True}, r"trainer\.vocab_entropy_chunk_size=True: SkyRL's TrainerConfig"),
    ],
    ids=["memory-0", "size-negative", "size-bool"],
)
def test_entropy_chunk_values_skyrl_refuses_are_faults(keys, said):
    import re

    faults = read_run_config(_config(**keys)).faults
    assert [f for f in faults if re.match(said, f)], faults


def test_the_emitted_keys_write_skyrls_entropy_chunk_defaults():
    keys = _keys(read_run_config(_config(trainer__vocab_entropy_chunk_memory_mb=2048)))
    assert keys["trainer.vocab_entropy_chunk_size"] == 0
    assert keys["trainer.vocab_entropy_chunk_memory_mb"] == 512


def test_the_providers_uneven_stages_and_megatrons_optimizer_offload_are_read():
    from batchfit.frameworks.config_options import run_profile_options

    data = _config(
        trainer__policy__megatron_config__transformer_config_kwargs__num_layers_in_last_pipeline_stage=10,
        trainer__policy__megatron_config__optimizer_config_kwargs__optimizer_cpu_offload=True,
        trainer__policy__megatron_config__optimizer_config_kwargs__optimizer_offload_fraction=1.0,
        trainer__policy__megatron_config__optimizer_config_kwargs__use_precision_aware_optimizer=True,
        trainer__policy__megatron_config__optimizer_config_kwargs__exp_avg_dtype="bfloat16",
    )
    run = read_run_config(data)
    assert not any("optimizer_cpu_offload" in w or "precision_aware" in w for w in run.warnings)
    s = run_profile_options(run, {"backend": "estimate", "max_seq_len": 1024}).options.sharding
    assert (s.last_pipeline_stage_layers, s.optimizer_cpu_offload, s.optimizer_offload_fraction) == (10, True, 1.0)
    assert (s.precision_aware_optimizer, s.exp_avg_dtype) == (True, "bf16")
