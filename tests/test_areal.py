"""AReaL configs (batchfit/frameworks/areal.py): read in AReaL's vocabulary, planned under its rules, emitted as its keys."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import yaml

from batchfit.budget.options import ProfileOptions
from batchfit.errors import BatchConfigError
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import emit_keys, render_yaml
from batchfit.frameworks.run_profile import role_options
from batchfit.parallel.sharding import Sharding

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "areal_gsm8k_grpo.yaml"





def _config(tmp_path, **changes):
    """The example with ``changes`` (dotted keys) applied, written to a file."""
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "areal.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_the_example_reads_in_areals_vocabulary_and_plans():
    run = read_run_config(EXAMPLE)
    assert run.vocabulary == "areal"
    b = run.batch
    # 256 prompts × 4 samples; ppo_n_minibatches 1 → one mini-batch of all 256 prompts; fsdp:d4p1t1 → 4 GPUs
    assert (b.train_batch_size, b.n_samples_per_prompt, b.policy_mini_batch_size) == (256, 4, 256)
    assert (run.world_size, b.max_tokens_per_micro_batch, b.sequence_parallel) == (4, 10240, 1)
    assert run.max_seq_len == 1024 + 1024  # train_dataset.max_length + gconfig.max_new_tokens
    assert run.strategy == "fsdp" and run.dtype == "bf16" and run.mixed_precision == "bf16"
    assert run.reference is False  # kl_ctl: 0.0 → rl_trainer creates no reference engine
    assert run.model == "Qwen/Qwen2.5-1.5B-Instruct" and run.critic_model is None
    plan = run.plan()
    assert any("ppo_n_minibatches=1 mini-batches balanced by tokens" in n for n in plan.notes)
    assert not any("optimizer" in w for w in plan.warnings)  # adam is AdamW, what batchfit profiles


def test_ppo_n_minibatches_is_a_count_of_mini_batches(tmp_path):
    run = read_run_config(_config(tmp_path, **{"actor.ppo_n_minibatches": 4}))
    # 256 prompts / 4 mini-batches = 64 prompts per optimizer step
    assert run.batch.policy_mini_batch_size == 64
    assert run.plan().optimizer_steps_per_step == 4


def test_an_override_of_the_mini_batch_changes_the_count_the_rules_check(tmp_path):
    # 256 prompts / 128 per mini-batch = 2 mini-batches of the 1024 / 4 = 256 sequences per rank
    run = read_run_config(_config(tmp_path), {"policy_mini_batch_size": 128})
    assert any("into actor.ppo_n_minibatches=2 mini-batches" in n for n in run.plan().notes)


def test_a_count_that_does_not_divide_a_ranks_share_is_unequal_mini_batches(tmp_path):
    # 10 prompts × 4 samples = 40 sequences / dp 4 = 10 per rank; 10 / 4 mini-batches = 2 or 3 sequences each
    run = read_run_config(_config(tmp_path, **{"actor.ppo_n_minibatches": 4, "train_dataset.batch_size": 10}))
    assert (run.batch.train_batch_size, run.batch.n_samples_per_prompt, run.batch.policy_mini_batch_size) == (40, 1, 40)
    plan = run.plan()
    assert any("AReaL runs unequal mini-batches (2 or 3 sequences per rank" in w for w in plan.warnings), plan.warnings
    # 12 prompts × 4 = 48 / dp 4 = 12 per rank / 4 = 3 each: equal, counted in prompts (12 / 4 = 3 per step)
    run = read_run_config(_config(tmp_path, **{"actor.ppo_n_minibatches": 4, "train_dataset.batch_size": 12}))
    assert run.batch.policy_mini_batch_size == 3 and run.plan().optimizer_steps_per_step == 4


def test_a_reference_runs_only_with_a_kl_term_and_shares_the_actors_gpus(tmp_path):
    run = read_run_config(_config(tmp_path, **{"actor.kl_ctl": 0.1}))
    assert run.reference is True and run.reference_dtype == "bf16"
    assert run.colocated == ("policy", "reference")  # ref.scheduling_strategy: colocation with the actor
    assert [s.role for s in run.configured] == ["policy", "policy_forward", "reference"]


def test_the_ulysses_dimension_is_sequence_parallelism(tmp_path):
    run = read_run_config(_config(tmp_path, **{"actor.backend": "fsdp:d2c2"}))
    assert (run.world_size, run.batch.sequence_parallel) == (4, 2)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"train_dataset.batch_size": 3, "gconfig.n_samples": 1}, "do not split evenly over the 4 data-parallel", id="dp-split"),
        pytest.param({"train_dataset.batch_size": 4, "gconfig.n_samples": 1, "actor.ppo_n_minibatches": 2}, "fewer than actor.ppo_n_minibatches=2", id="minibatches"),
        pytest.param({"actor.mb_spec.max_tokens_per_mb": 1000}, "below the longest sequence.*2048 tokens", id="cap-below-longest"),
        pytest.param({"actor.mb_spec.n_mbs": 512}, "at least 512 sequences per micro-batch split", id="n_mbs"),
        # 256 prompts × 4 samples / 4 ranks = 256 sequences a split: max(n_mbs 1, divisor 512) × granularity 1 = 512
        pytest.param({"actor.mb_spec.n_mbs_divisor": 512}, "at least 512 sequences per micro-batch split", id="n_mbs_divisor"),
        # max(n_mbs 4, divisor 1) × granularity 128 = 512 > 256
        pytest.param({"actor.mb_spec.n_mbs": 4, "actor.mb_spec.granularity": 128}, "at least 512 sequences", id="granularity-least"),
        pytest.param({"actor.mb_spec.granularity": 3}, r"granularity=3 does not divide the 256 sequences of a split", id="granularity"),
        pytest.param({"actor.backend": "d4"}, "needs a backend prefix", id="backend"),
        pytest.param({"actor.ppo_n_minibatches": 0}, "actor.ppo_n_minibatches=0 must be a positive integer", id="zero"),
    ],
)
def test_areals_rules_are_faults_in_its_own_words(tmp_path, changes, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_config(tmp_path, **changes)).plan()


def test_no_token_cap_is_a_warning_and_an_odd_cap_a_note(tmp_path):
    plan = read_run_config(_config(tmp_path, **{"actor.mb_spec.max_tokens_per_mb": None})).plan()
    assert any("max_tokens_per_mb is not set" in w and "n_mbs=1" in w for w in plan.warnings)
    plan = read_run_config(_config(tmp_path, **{"actor.mb_spec.max_tokens_per_mb": 10000})).plan()
    assert any("can run 10240 tokens" in n for n in plan.notes)  # ⌈10000 / 256⌉ × 256 = 40 × 256


def test_a_misspelt_key_names_the_one_meant(tmp_path):
    path = _config(tmp_path, **{"actor.mb_spec.max_token_per_mb": 4096})
    with pytest.raises(BatchConfigError, match=r"did you mean 'actor\.mb_spec\.max_tokens_per_mb'"):
        read_run_config(path)


MEGATRON_EXAMPLE = EXAMPLE.with_name("areal_gsm8k_grpo_megatron.yaml")


def test_the_megatron_backend_reads_into_a_megatron_run(tmp_path):
    run = read_run_config(MEGATRON_EXAMPLE)  # gsm8k_grpo_megatron.yaml: megatron:d4p1t1
    assert (run.strategy, run.dtype, run.distributed_optimizer, run.megatron_sequence_parallel) == ("megatron", "bf16", True, False)
    assert run.mixed_precision is None and run.warnings == ()  # AReaL's Megatron defaults are batchfit's
    path = _config(tmp_path, **{"actor.backend": "megatron:d1t2p2", "actor.gradient_checkpointing": True,
                                "actor.megatron.virtual_pipeline_parallel_size": 2, "actor.megatron.ddp.grad_reduce_in_fp32": False})  # fmt: skip
    run = read_run_config(path)
    assert (run.batch.tensor_parallel, run.batch.pipeline_parallel, run.virtual_pipeline_parallel) == (2, 2, 2)
    assert run.megatron_sequence_parallel is True and run.gradient_checkpointing is True  # t > 1: SP; full, uniform, 1
    assert any("grad_reduce_in_fp32=False is not modelled" in w for w in run.warnings)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"actor.use_lora": True}, "actor.use_lora=True trains Megatron LoRA", id="lora"),
        pytest.param({"critic": {"path": "tiny"}}, "critic (a section) trains a critic", id="critic"),
    ],
)
def test_profile_refuses_what_its_megatron_profile_does_not_model(tmp_path, capsys, changes, match):
    from batchfit.cli import main

    path = _config(tmp_path, **{"actor.backend": "megatron:d4", "actor.path": "tiny", **changes})
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--no-progress"]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["fsdp:d2t2"])
def test_profile_refuses_what_it_does_not_model_and_names_the_approximation(tmp_path, capsys, backend):
    from batchfit.cli import main

    path = _config(tmp_path, **{"actor.backend": backend, "actor.path": "tiny"})
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "which batchfit does not model; pass --sharding fsdp2" in err, err


def _emitted(run, budgets, sharding=None):
    options = ProfileOptions(
        max_seq_len=run.max_seq_len,
        backend="estimate",
        sharding=sharding or Sharding("fsdp2", world_size=run.world_size),
        cost="packed",
        gradient_checkpointing=bool(run.gradient_checkpointing),
    )
    profile = types.SimpleNamespace(
        run=run,
        budgets={r: types.SimpleNamespace(tokens=t, backend="estimate", usable_bytes=70 * 2**30, cost="packed") for r, t in budgets.items()},
        options=role_options(run, options),
    )
    return render_yaml(emit_keys(profile, "areal", max_seq_len=run.max_seq_len, margin=0.85), [])


def test_emitted_caps_are_each_engines_smallest_budget_in_pages_of_256(tmp_path):
    run = read_run_config(_config(tmp_path, **{"actor.kl_ctl": 0.1}))
    text = _emitted(run, {"policy": 12_345, "policy_forward": 30_000, "reference": 40_000})
    out = yaml.safe_load(text)
    assert out["actor"]["mb_spec"] == {"max_tokens_per_mb": 12_288, "n_mbs": 1}  # 12,345 // 256 × 256 = 48 × 256
    assert out["ref"]["mb_spec"]["max_tokens_per_mb"] == 39_936  # 40,000 // 256 × 256 = 156 × 256
    assert out["actor"]["backend"] == "fsdp:d4" and out["actor"]["dtype"] == "bfloat16"
    assert "a hard cap (seqpack.ffd_allocate" in text and "set by policy: estimated budget 12,345 tokens" in text
    # merged over the config, AReaL's rules pass
    merged = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    merged["actor"]["kl_ctl"] = 0.1
    for section, keys in out.items():
        merged.setdefault(section, {}).update({k: v for k, v in keys.items() if not isinstance(v, dict)})
        for k, v in keys.items():
            if isinstance(v, dict):
                merged[section].setdefault(k, {}).update(v)
    path = tmp_path / "merged.yaml"
    path.write_text(yaml.safe_dump(merged), encoding="utf-8")
    assert read_run_config(path).plan().config.max_tokens_per_micro_batch == 12_288


def test_a_megatron_profile_emits_the_megatron_engines_keys():
    run = read_run_config(MEGATRON_EXAMPLE)
    sharding = Sharding("megatron", world_size=4, tensor_parallel=2, megatron_sequence_parallel=True, distributed_optimizer=True)
    out = yaml.safe_load(_emitted(run, {"policy": 12_345, "policy_forward": 30_000}, sharding))
    actor = out["actor"]
    assert actor["backend"] == "megatron:d2t2" and actor["mb_spec"]["max_tokens_per_mb"] == 12_288
    assert actor["megatron"]["ddp"] == {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True}
    assert actor["megatron"]["use_precision_aware_optimizer"] is False


def test_a_budget_below_the_longest_sequence_says_areal_raises(tmp_path):
    run = read_run_config(EXAMPLE)
    text = _emitted(run, {"policy": 1_000, "policy_forward": 3_000})
    assert re.search(r"max_tokens_per_mb: 768 .*below the longest sequence \(2,048 tokens\): AReaL raises", text), text


@pytest.mark.slow
def test_profile_emits_areals_keys_for_the_example_on_the_tiny_preset(tmp_path, capsys):
    from batchfit.cli import main

    path = _config(tmp_path, **{"actor.path": "tiny"})
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--engine-reserve", "0", "--no-progress", "--emit", "areal"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    caps = [int(v) for v in re.findall(r"max_tokens_per_mb: (\d+)", out)]
    assert len(caps) == 1 and caps[0] % 256 == 0 and caps[0] >= 2048, out
    assert "backend: fsdp:d4" in out and "old log-probs: yours actor.mb_spec.max_tokens_per_mb=10,240" in out


@pytest.mark.slow
def test_the_megatron_example_profiles_under_megatron_and_emits_areals_keys(tmp_path, capsys):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    from batchfit.cli import main

    argv = ["profile", "--config", str(MEGATRON_EXAMPLE), "--model", "tiny", "--backend", "estimate", "--engine-reserve", "0",
            "--no-progress", "--emit", "areal"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    caps = [int(v) for v in re.findall(r"max_tokens_per_mb: (\d+)", out)]
    assert len(caps) == 1 and caps[0] % 256 == 0 and caps[0] >= 2048, out
    assert "megatron over 4 ranks" in out and "backend: megatron:d4" in out, out


def test_adam_bf16_under_megatron_is_read_as_the_precision_aware_optimizer_with_bf16_moments(tmp_path):
    import yaml as _yaml

    from batchfit.frameworks.config_options import run_profile_options

    data = _yaml.safe_load(MEGATRON_EXAMPLE.read_text(encoding="utf-8"))
    data.setdefault("actor", {}).setdefault("optimizer", {})["type"] = "adam_bf16"
    path = tmp_path / "areal_adam_bf16.yaml"
    path.write_text(_yaml.safe_dump(data), encoding="utf-8")
    run = read_run_config(path)
    assert not any("precision-aware" in w and "not model" in w for w in run.warnings)
    s = run_profile_options(run, {"backend": "estimate", "max_seq_len": 1024}).options.sharding
    assert (s.precision_aware_optimizer, s.exp_avg_dtype, s.exp_avg_sq_dtype) == (True, "bf16", "bf16")
