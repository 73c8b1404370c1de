"""OpenRLHF launch commands (batchfit/frameworks/openrlhf.py): read, planned under OpenRLHF 0.11.2's rules, emitted as flags its parser accepts."""

from __future__ import annotations

import os
import shlex
import types
from pathlib import Path

import pytest

from batchfit.budget.options import ProfileOptions
from batchfit.errors import BatchConfigError
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import emit_keys, render_flags
from batchfit.frameworks.flags import flag_spec
from batchfit.frameworks.run_profile import role_options
from batchfit.parallel.sharding import Sharding
from script_helpers import flag_words, openrlhf_release_source

WHEEL = Path(
    os.environ.get("BATCHFIT_OPENRLHF_WHEEL", "/tmp/wheels/openrlhf-0.11.2-cp311-cp311-manylinux1_x86_64.whl")
)

# A GRPO run on one node: 32 prompts × 8 samples, 4 optimizer steps of 64 samples, micro 4 on 8 GPUs.
BASE = {
    "--actor.model_name_or_path": "tiny",
    "--actor.num_nodes": 1,
    "--actor.num_gpus_per_node": 8,
    "--ref.num_gpus_per_node": 8,
    "--vllm.num_engines": 4,
    "--reward.remote_url": "http://localhost:5000/get_reward",
    "--rollout.batch_size": 32,
    "--rollout.n_samples_per_prompt": 8,
    "--rollout.micro_batch_size": 4,
    "--train.batch_size": 64,
    "--train.micro_batch_size": 4,
    "--data.max_len": 1024,
    "--ds.zero_stage": 3,
    "--algo.advantage.estimator": "group_norm",
    "--train.colocate_actor_ref": True,
}


def _script(tmp_path, name="run.sh", **changes):
    """A launch script of BASE with ``changes`` (``flag=None`` drops it; ``True`` is a switch)."""
    flags = {**BASE, **{k.replace("__", "."): v for k, v in changes.items()}}
    words = []
    for flag, value in flags.items():
        flag = flag if flag.startswith("--") else "--" + flag
        if value is True:
            words.append(flag)
        elif value is not None and value is not False:
            words.append(f"{flag} {shlex.quote(str(value))}")
    path = tmp_path / name
    path.write_text(
        "#!/bin/bash\nset -x\npython3 -m openrlhf.cli.train_ppo_ray \\\n   " + " \\\n   ".join(words) + "\n"
    )
    return path


def test_a_launch_script_reads_into_the_run_and_plans(tmp_path):
    run = read_run_config(_script(tmp_path))
    assert run.vocabulary == "openrlhf" and run.model == "tiny" and run.max_seq_len == 1024
    assert run.world_size == 8 and run.strategy == "fsdp2"
    assert not run.remove_padding  # no dynamic batches, no --ds.packing_samples: padded rows
    # algo.kl.init_coef defaults to 0.01: a reference; group_norm: no critic
    assert run.models == {"policy": "tiny", "reference": "tiny"}
    assert run.colocated == ("policy", "reference")
    assert run.resident == {"policy": ("parameters", "optimizer_state"), "reference": ("parameters",)}
    plan = run.plan()
    # 64 samples per optimizer step / 8 per prompt = 8 prompts; 32 prompts / 8 = 4 steps
    assert plan.policy.mini_batch_size == 8 and plan.optimizer_steps_per_step == 4
    # 64 samples / 8 GPUs = 8 per GPU, micro 4 -> 2 accumulation steps (DeepSpeed's gradient_acc_step)
    assert plan.policy.samples_per_mini_batch_per_gpu == 8 and plan.gradient_accumulation_steps == 2
    assert plan.micro_batching == "samples"
    assert any("ZeRO-3 (--ds.zero_stage 3) is profiled as FSDP2" in n for n in plan.notes)


def test_gae_trains_a_critic_from_the_reward_model_on_its_own_gpus(tmp_path):
    run = read_run_config(
        _script(
            tmp_path,
            **{
                "--algo.advantage.estimator": "gae",
                "--reward.remote_url": None,
                "--reward.model_name_or_path": "rm-a,rm-b",
                "--critic.num_gpus_per_node": 4,
                "--algo.kl.init_coef": 0,
                "--train.colocate_actor_ref": None,
            },
        )
    )
    # train_ppo_ray: critic path = the first reward model's
    assert run.models == {"policy": "tiny", "critic": "rm-a"} and run.batch.critic_world_size == 4
    plan = run.plan()
    assert plan.critic is not None and plan.critic.samples_per_mini_batch_per_gpu == 16  # 64 / 4 GPUs
    assert any("the reward model rm-a,rm-b runs on its own GPUs" in n for n in plan.notes)


def test_lora_flags_apply_to_the_actor_and_the_critic(tmp_path):
    run = read_run_config(_script(tmp_path, **{"--ds.lora.rank": 64, "--ds.lora.alpha": 128}))
    # ppo_actor / ppo_critic pass --ds.lora.* to both models; target_modules defaults to all-linear
    assert run.lora == {"rank": 64, "alpha": 128, "target_modules": "all-linear"}
    assert run.critic_lora is None  # group_norm: no critic
    assert read_run_config(_script(tmp_path)).lora is None  # rank 0: full fine-tuning


def test_train_batch_size_not_a_multiple_of_n_counts_samples(tmp_path):
    run = read_run_config(
        _script(
            tmp_path,
            **{
                "--train.batch_size": 32,
                "--rollout.n_samples_per_prompt": 3,
                "--rollout.batch_size": 64,
                "--rollout.micro_batch_size": 3,
            },
        )
    )
    # 64 × 3 = 192 samples, steps of 32 samples (not whole prompts of 3): counted as samples
    assert run.batch.train_batch_size == 192 and run.batch.n_samples_per_prompt == 1
    plan = run.plan()
    assert plan.optimizer_steps_per_step == 6  # 192 / 32
    assert any("not a multiple of --rollout.n_samples_per_prompt=3" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param(
            {"--rollout.n_samples_per_prompt": 1, "--train.batch_size": 16},
            r"group_norm subtracts a per-prompt baseline and OpenRLHF asserts --rollout.n_samples_per_prompt > 1",
            id="group-estimator-needs-n",
        ),
        pytest.param(
            {"--algo.advantage.estimator": "gae", "--reward.remote_url": None},
            r"gae trains a critic, initialised from --critic.model_name_or_path, else the first --reward.model_name_or_path",
            id="gae-without-critic",
        ),
        pytest.param(
            {"--train.dynamic_batch_enable": True, "--vllm.num_engines": None},
            r"which OpenRLHF allows only with vLLM \(train_ppo_ray.py asserts --vllm.num_engines > 0\)",
            id="dynamic-without-vllm",
        ),
        pytest.param(
            {"--train.batch_size": 512},
            # 32 × 8 = 256 samples < 512
            r"a rollout of .* = 256 samples is smaller than --train.batch_size=512: no optimizer step completes",
            id="rollout-smaller-than-step",
        ),
        pytest.param(
            {"--train.batch_size": 96, "--train.micro_batch_size": 2},
            # 256 % 96 = 64 left over
            r"256 samples are not a multiple of --train.batch_size=96: the last 64 accumulate into the next rollout",
            id="tail-carried-over",
        ),
        pytest.param(
            {"--train.batch_size": 96, "--train.dynamic_batch_enable": True},
            r"the last 64 are never trained",
            id="tail-dropped-dynamic",
        ),
        pytest.param(
            {"--train.micro_batch_size": 16},
            # 64 samples per step, micro 16 × 8 GPUs = 128
            r"--train.batch_size=64 is not a multiple of --train.micro_batch_size × the actor's data-parallel size = 16 × 8 = 128: DeepSpeed refuses it",
            id="deepspeed-batch-assertion",
        ),
        pytest.param(
            {"--rollout.micro_batch_size": 3},
            # 256 samples in batches of ≤ 3: 86 batches dealt ⌈86 / 8⌉ at a time
            r"the actor's 8 ranks receive unequal shares of the rollout: 256 samples in 86 experience batches",
            id="unequal-rollout-shares",
        ),
        pytest.param(
            {"--rollout.micro_batch_size": 64},
            # 256 // 64 = 4 batches < 8 ranks
            r"make 4, fewer than the 8 actor ranks \(train_ppo_ray.py asserts at least one each\)",
            id="fewer-rollout-batches-than-ranks",
        ),
        pytest.param(
            {"--ds.ring_attn_size": 3},
            r"the actor's 8 GPUs do not split into --ds.ring_attn_size × --ds.tensor_parallel_size = 3",
            id="ring-does-not-divide",
        ),
        pytest.param(
            {
                "--train.dynamic_batch_enable": True,
                "--actor.num_gpus_per_node": 6,
                "--ref.num_gpus_per_node": 6,
                "--train.max_tokens_per_gpu": 4096,
            },
            # 64 // 6 = 10 per rank, 60 per step
            r"--train.batch_size=64 does not split over the actor's 6 data-parallel ranks: OpenRLHF takes 10 per rank",
            id="dynamic-floor-per-rank",
        ),
        pytest.param(
            {"--ref.num_gpus_per_node": 4},
            r"--ref.num_nodes × --ref.num_gpus_per_node = 4 against the actor's 8 \(train_ppo_ray.py asserts they match\)",
            id="colocated-reference-gpus",
        ),
        pytest.param(
            {"--train.batch_size": 0},
            r"--train.batch_size=0 must be a positive integer",
            id="zero",
        ),
    ],
)
def test_openrlhf_rules_are_faults_in_its_own_words(tmp_path, changes, match):
    run = read_run_config(_script(tmp_path, **changes))
    with pytest.raises(BatchConfigError, match=match):
        run.plan()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param(  # an old release's flags are read (see test_an_old_flag_script_reads_…); a typo is not
            "python -m openrlhf.cli.train_ppo_ray --train.micro_batchsize 8 --pretrain_model x\n",
            r"OpenRLHF 0.11.2 has no flag --train.micro_batchsize \(did you mean --train.micro_batch_size\?\), --pretrain_model",
            id="unknown-flags",
        ),
        pytest.param(
            "python -m openrlhf.cli.train_ppo_ray --train.batch_size many\n",
            r"OpenRLHF 0.11.2 refuses the command: argument --train.batch_size: invalid int value: 'many'",
            id="bad-int",
        ),
        pytest.param(
            "python -m openrlhf.cli.train_ppo_ray --algo.advantage.estimator ppo\n",
            r"argument --algo.advantage.estimator: invalid choice: 'ppo'",
            id="bad-choice",
        ),
    ],
)
def test_what_openrlhfs_parser_refuses_is_refused_on_reading(tmp_path, text, match):
    path = tmp_path / "run.sh"
    path.write_text(text)
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(path)


def test_every_fault_is_listed_at_once(tmp_path):
    run = read_run_config(_script(tmp_path, **{"--train.micro_batch_size": 16, "--ref.num_gpus_per_node": 4}))
    with pytest.raises(BatchConfigError) as info:
        run.plan()
    assert len(info.value.faults) == 2
    assert "DeepSpeed refuses it" in str(info.value) and "asserts they match" in str(info.value)


def test_a_token_budget_below_the_longest_sequence_is_a_warning(tmp_path):
    run = read_run_config(
        _script(tmp_path, **{"--train.dynamic_batch_enable": True, "--train.max_tokens_per_gpu": 512})
    )
    plan = run.plan()
    assert plan.micro_batching == "tokens"
    # --rollout.max_tokens_per_gpu defaults to the train value (train_ppo_ray): both warn
    assert [w.split(" ")[0] for w in plan.warnings] == [
        "--train.max_tokens_per_gpu=512",
        "--rollout.max_tokens_per_gpu=512",
    ]
    assert "runs a longer sequence alone in a micro-batch of up to 1024 tokens" in plan.warnings[0]
    with pytest.raises(BatchConfigError, match="--strict makes it a fault"):
        run.plan(strict=True)


def test_overrides_apply_before_openrlhfs_rules(tmp_path):
    path = _script(tmp_path, **{"--train.micro_batch_size": 16})
    with pytest.raises(BatchConfigError, match="DeepSpeed refuses it"):
        read_run_config(path).plan()
    assert (
        read_run_config(path, {"micro_train_batch_size_per_gpu": "4"}).plan().gradient_accumulation_steps == 2
    )


@pytest.mark.slow
def test_zero_stage_2_profiles_as_zero2_and_emits_its_stage(tmp_path, capsys):
    # issue 32: OpenRLHF's default stage 2 (refused before) profiles as DeepSpeed ZeRO-2 over the actor's 8 GPUs
    from batchfit.cli import main

    path = _script(tmp_path, **{"--ds.zero_stage": None, "--ds.overlap_comm": True})
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--no-progress", "--emit", "openrlhf"]) == 0
    out = capsys.readouterr().out
    assert "zero2 over 8 ranks (DeepSpeed ZeRO-2: parameters replicated, fp32 master weights, optimizer state and gradients partitioned, overlap_comm: two reduce buckets)" in out
    assert "\n--ds.zero_stage 2 \\\n" in out and "\n--ds.overlap_comm \\\n" in out
    assert "--train.max_tokens_per_gpu " in out


def test_zero_stage_0_is_refused_by_profile_with_the_stages_that_model_it(tmp_path, capsys):
    from batchfit.cli import main

    path = _script(tmp_path, **{"--ds.zero_stage": 0})
    assert main(["profile", "--config", str(path), "--backend", "estimate", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "OpenRLHF trains with DeepSpeed ZeRO stage 0 (--ds.zero_stage 0)" in err
    assert "use --ds.zero_stage 2 (OpenRLHF's default, profiled as zero2)" in err


def _budget(tokens, backend="estimate"):
    return types.SimpleNamespace(tokens=tokens, backend=backend, usable_bytes=70 * 2**30, cost="padded")


def _profiled_as_cli(run):
    """What ``profile --config … --emit`` profiles each model of ``run`` with: FSDP2 over its GPUs, packed rows."""
    options = ProfileOptions(
        max_seq_len=run.max_seq_len,
        backend="estimate",
        sharding=Sharding("fsdp2", world_size=run.world_size),
        cost="packed",
        gradient_checkpointing=bool(run.gradient_checkpointing),
    )
    return role_options(run, options)


def _emitted(run, budgets, backend="estimate"):
    profile = types.SimpleNamespace(
        run=run,
        budgets={role: _budget(t, backend) for role, t in budgets.items()},
        options=_profiled_as_cli(run),
    )
    return render_flags(emit_keys(profile, "openrlhf", max_seq_len=run.max_seq_len, margin=0.85), ["header"])


def test_emitted_flags_are_accepted_by_openrlhfs_parser_and_plan_when_added(tmp_path):
    run = read_run_config(_script(tmp_path))
    text = _emitted(run, {"policy": 20_000, "policy_forward": 40_000, "reference": 50_000})
    words = flag_words(text)
    args = flag_spec("openrlhf").parser().parse_args(words)  # the rebuilt parser (from the shipped data)
    assert getattr(args, "train.dynamic_batch_enable") is True and getattr(args, "ds.packing_samples") is True
    # training: the policy's budget; experience passes: the smaller of the forward budgets
    assert getattr(args, "train.max_tokens_per_gpu") == 20_000
    assert getattr(args, "rollout.max_tokens_per_gpu") == 40_000
    assert (
        "# --train.max_tokens_per_gpu: actor update, set by policy: estimated budget 20,000 tokens per GPU"
        in text
    )
    merged = tmp_path / "merged.sh"
    merged.write_text(_script(tmp_path).read_text().rstrip("\n") + " \\\n   " + " ".join(words) + "\n")
    plan = read_run_config(merged).plan()
    assert plan.micro_batching == "tokens" and plan.config.max_tokens_per_micro_batch == 20_000


def test_emitted_comments_say_measured_for_a_measured_budget(tmp_path):
    run = read_run_config(_script(tmp_path))
    text = _emitted(run, {"policy": 1_000, "policy_forward": 2_000}, backend="cuda")
    assert "measured budget 1,000 tokens per GPU" in text and "estimated" not in text


def test_emitted_flags_are_accepted_by_the_real_parser_of_the_release(tmp_path):
    module, text, _ = openrlhf_release_source(WHEEL)
    parser = module.build_parser("openrlhf", text)  # train_ppo_ray.py's own parser, run from its source
    run = read_run_config(_script(tmp_path))
    args = parser.parse_args(flag_words(_emitted(run, {"policy": 20_000, "policy_forward": 40_000})))
    assert getattr(args, "train.max_tokens_per_gpu") == 20_000 and getattr(args, "train.dynamic_batch_enable")


def test_the_shipped_flags_are_the_releases(tmp_path):
    module, text, where = openrlhf_release_source(WHEEL)
    assert module.flag_data("openrlhf", text, where, "0.11.2")["flags"] == list(flag_spec("openrlhf").flags)


def test_the_documented_example_plans():
    example = Path(__file__).parents[1] / "examples" / "openrlhf_grpo.sh"
    plan = read_run_config(example).plan()  # docs/frameworks.md, "Worked example: OpenRLHF"
    assert plan.optimizer_steps_per_step == 4 and plan.gradient_accumulation_steps == 8


def test_the_divisor_near_a_size_is_the_closest_the_smaller_on_a_tie():
    from batchfit.frameworks.openrlhf import _divisor_near

    # 12: divisors 1 2 3 4 6 12; 5 is 1 from 4 and from 6 → 4; 35: 1 5 7 35, 6 → 5; a prime → 1 or itself
    assert [_divisor_near(12, 5), _divisor_near(35, 6), _divisor_near(97, 40), _divisor_near(97, 60)] == [4, 5, 1, 97]
    # the same as the closest of every integer up to n that divides it (the O(n) definition)
    for n in range(1, 400):
        every = [d for d in range(1, n + 1) if n % d == 0]
        for target in (1, 2, 3, n // 3 + 1, n // 2, n - 1, n + 5):
            assert _divisor_near(n, target) == min(every, key=lambda d: (abs(d - target), d))
    # O(√n): 10**12 + 39 is prime, so √n ≈ 10**6 trials, not 10**12
    assert _divisor_near(10**12 + 39, 10**6) == 1


# --------------------------------------------------------------------------- pre-0.11 flags (issue 40, item 4)

# BASE written with OpenRLHF's flags from before its rename (ed62d0e2), as a 0.9/0.10 example script had them.
OLD_SCRIPT = """#!/bin/bash
# a GRPO run written for OpenRLHF 0.10 (flat flags)
MODEL=tiny
python3 -m openrlhf.cli.train_ppo_ray \\
   --pretrain $MODEL --actor_num_nodes 1 --actor_num_gpus_per_node 8 --ref_num_gpus_per_node 8 \\
   --vllm_num_engines 4 --remote_rm_url http://localhost:5000/get_reward \\
   --rollout_batch_size 32 --n_samples_per_prompt 8 --micro_rollout_batch_size 4 \\
   --train_batch_size 64 --micro_train_batch_size 4 \\
   --prompt_max_len 256 --generate_max_len 768 \\
   --zero_stage 3 --bf16 --flash_attn --advantage_estimator group_norm --colocate_actor_ref \\
   --init_kl_coef 0.01 --use_kl_loss --actor_learning_rate 5e-7 --max_norm 1.0 --perf
"""


def test_an_old_flag_script_reads_as_the_same_run_as_its_new_flags(tmp_path):
    old = tmp_path / "old.sh"
    old.write_text(OLD_SCRIPT)
    run, new = read_run_config(old), read_run_config(_script(tmp_path))
    # --data.max_len = --prompt_max_len + --generate_max_len = 256 + 768 = 1024, BASE's
    assert (run.batch, run.model, run.max_seq_len, run.strategy, run.reference, run.colocated) == (
        new.batch,
        new.model,
        new.max_seq_len,
        new.strategy,
        new.reference,
        new.colocated,
    )
    assert run.max_seq_len == 1024
    assert run.plan().gradient_accumulation_steps == new.plan().gradient_accumulation_steps
    v = run.values
    assert v["ds.param_dtype"] == "bf16" and v["ds.attn_implementation"] == "flash_attention_2"
    assert v["algo.kl.use_loss"] is True and v["algo.kl.init_coef"] == 0.01
    assert v["actor.max_norm"] == 1.0 and v["critic.max_norm"] == 1.0 and v["actor.adam.lr"] == 5e-7
    notes = " ".join(run.notes)
    assert "--micro_train_batch_size → --train.micro_batch_size" in notes
    assert "--micro_rollout_batch_size → --rollout.micro_batch_size" in notes
    assert "--n_samples_per_prompt → --rollout.n_samples_per_prompt" in notes
    assert "--bf16 → --ds.param_dtype bf16" in notes and "rename them in the script" in notes
    assert "--perf (ed62d0e2" in notes  # removed, dropped with its commit


def test_an_old_flag_left_unset_whose_default_changed_is_reported(tmp_path):
    old = tmp_path / "old.sh"
    old.write_text(OLD_SCRIPT.replace("--micro_train_batch_size 4 ", ""))
    run = read_run_config(old)
    # a2978694 (2026-04-11) changed --micro_train_batch_size's default from 4 to 1; 0.11.2 reads 1
    assert run.batch.micro_train_batch_size_per_gpu == 1
    assert any(
        "leaves --micro_train_batch_size unset: OpenRLHF defaulted it to 4 before a2978694" in n for n in run.notes
    )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # the three the 0.11.2 parser's closest-match hint got wrong (it offered the global batch, the
        # prompt batch and the eval samples), and the eleven it had no hint for
        ("--micro_train_batch_size", ("--train.micro_batch_size",)),
        ("--micro_rollout_batch_size", ("--rollout.micro_batch_size",)),
        ("--n_samples_per_prompt", ("--rollout.n_samples_per_prompt",)),
        ("--pretrain", ("--actor.model_name_or_path",)),
        ("--prompt_max_len", ("--data.max_len",)),
        ("--generate_max_len", ("--rollout.max_new_tokens",)),
        ("--flash_attn", ("--ds.attn_implementation",)),
        ("--bf16", ("--ds.param_dtype",)),
        ("--init_kl_coef", ("--algo.kl.init_coef",)),
        ("--use_kl_loss", ("--algo.kl.use_loss",)),
        ("--ref_reward_offload", ("--ref.offload", "--reward.offload")),
        ("--train_max_tokens_per_gpu", ("--train.max_tokens_per_gpu",)),
        ("--ring_attn_size", ("--ds.ring_attn_size",)),
        ("--perf", ()),
    ],
)
def test_each_old_flag_maps_to_its_renamed_flag(old, new):
    from batchfit.frameworks.openrlhf_renames import new_flags

    assert new_flags(old) == new


def test_every_renamed_flag_is_a_flag_of_the_release():
    from batchfit.frameworks.openrlhf_renames import renames

    flags = flag_spec("openrlhf").by_flag
    table = renames()["renamed"]
    assert len(table) == 148  # every flag train_ppo_ray.py lost between v0.8.0 and ed62d0e2
    assert [(old, f) for old, row in table.items() for f in row["flags"] if f not in flags] == []
    assert [old for old in table if old in flags] == []  # an old name is never a 0.11.2 flag


def test_an_old_flag_with_an_unset_shell_value_is_a_fault_under_its_new_name(tmp_path):
    old = tmp_path / "old.sh"
    old.write_text(OLD_SCRIPT.replace("--micro_train_batch_size 4", "--micro_train_batch_size ${MICRO}"))
    with pytest.raises(BatchConfigError, match=r"--train.micro_batch_size \$\{MICRO\}: the file does not set"):
        read_run_config(old)


@pytest.mark.slow
def test_the_shipped_renames_are_what_openrlhfs_history_gives():
    source = Path(os.environ.get("BATCHFIT_OPENRLHF_SOURCE", "/work/.mirror/OpenRLHF+OpenRLHF/repo"))
    if not (source / "HEAD").is_file() or not WHEEL.is_file():
        pytest.skip(f"OpenRLHF's git history ({source}; BATCHFIT_OPENRLHF_SOURCE) or wheel is not on this machine")
    from batchfit.frameworks.openrlhf_renames import renames
    from script_helpers import load_script

    module = load_script(Path(__file__).parents[1] / "scripts" / "extract_openrlhf_renames.py", "extract_openrlhf_renames")
    data = module.build(str(source), str(WHEEL))
    assert data["renamed"] == renames()["renamed"] and data["changed_defaults"] == renames()["changed_defaults"]


@pytest.mark.parametrize(
    ("lengths", "max_len"),
    [
        ("--prompt_max_len 256 --generate_max_len 768", 1024),  # 256 + 768
        ("--generate_max_len 3072", 4096),  # --prompt_max_len's old default 1024 + 3072
        ("--max_len 8192 --prompt_max_len 1024 --generate_max_len 1024", 8192),  # the old --max_len won (d0e088b6^)
        ("--generate_max_len=2048", 3072),  # the --flag=value form: 1024 + 2048
    ],
)
def test_the_old_length_flags_make_the_whole_sequence_as_the_old_code_did(tmp_path, lengths, max_len):
    old = tmp_path / "old.sh"
    old.write_text(OLD_SCRIPT.replace("--prompt_max_len 256 --generate_max_len 768", lengths))
    assert read_run_config(old).max_seq_len == max_len
