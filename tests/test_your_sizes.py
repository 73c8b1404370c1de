"""The sizes a config sets by hand beside batchfit's budgets (batchfit/frameworks/your_sizes.py; issue 40, item 9)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import yaml

import batchfit.frameworks.run_profile as framework_profile
from batchfit.cli import main
from batchfit.errors import BatchConfigError
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import yours_keys
from batchfit.frameworks.your_sizes import YourSize, compare, describe
from recorder_helpers import use_recorder

EXAMPLES = Path(__file__).parents[1] / "examples"

# verl's DAPO recipe shape: 2k prompt + 20k response, Ulysses 2, 16 GPUs, the token length set by hand to
# (2048 + 20480) / sp = 11,264 per GPU
DAPO = {
    "data": {"train_batch_size": 512, "max_prompt_length": 2048, "max_response_length": 20480},
    "actor_rollout_ref": {
        "model": {"path": "tiny", "use_remove_padding": True, "enable_gradient_checkpointing": True},
        "actor": {
            "strategy": "fsdp2",
            "ppo_mini_batch_size": 32,
            "use_dynamic_bsz": True,
            "ppo_max_token_len_per_gpu": 11264,
            "ulysses_sequence_parallel_size": 2,
            "use_kl_loss": False,
        },
        "rollout": {"n": 16, "log_prob_max_token_len_per_gpu": 11264},
    },
    "algorithm": {"adv_estimator": "grpo"},
    "trainer": {"nnodes": 2, "n_gpus_per_node": 8},
}


def _dapo(tmp_path):
    path = tmp_path / "dapo.yaml"
    path.write_text(yaml.safe_dump(DAPO))
    return path


def _profile(run, budgets, *, sp=1, longest=None):
    """A RunProfile's shape: the run, each pass's budget (tokens per micro-batch of a group), the policy's options."""
    options = types.SimpleNamespace(sharding=types.SimpleNamespace(sequence_parallel=sp, context_parallel=1), max_seq_len=longest)
    return types.SimpleNamespace(
        run=run, budgets={r: types.SimpleNamespace(tokens=t) for r, t in budgets.items()}, options={"policy": options}
    )


def test_a_verl_token_length_set_by_hand_is_put_beside_batchfits(tmp_path):
    run = read_run_config(_dapo(tmp_path))
    assert [(s.role, s.key, s.value, s.unit) for s in run.configured] == [
        ("policy", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 11264, "tokens"),
        ("policy_forward", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", 11264, "tokens"),
    ]
    # batchfit's budget: 186,650 tokens per micro-batch of the sp-2 group = 93,325 per GPU; 93,325 / 11,264 = 8.29
    [update, _] = compare(_profile(run, {"policy": 186_650, "policy_forward": 400_000}, sp=2, longest=22_528))
    assert (update.batchfit, round(update.ratio, 1)) == (93_325, 8.3)
    # yours: 11,264 × 2 = 22,528 tokens = 1 sequence of 22,528; batchfit's 186,650 // 22,528 = 8 sequences.
    # 32 prompts × 16 samples / dp 8 (16 GPUs / sp 2) = 64 sequences per GPU per optimizer step: 64 → 8 micro-batches
    assert update.sequences == (1, 8) and update.micro_batches == (64, 8)
    text = describe(update)
    assert "yours actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11,264 per GPU, batchfit 93,325: 8.3×" in text
    assert "micro-batches per GPU per optimizer step: 64 → 8" in text


def test_a_micro_size_set_by_hand_is_compared_in_sequences():
    run = read_run_config(EXAMPLES / "verl_grpo.yaml")  # ppo_micro_batch_size_per_gpu 4, log-prob micro 8
    assert [(s.role, s.key.rsplit(".", 1)[1], s.value, s.unit) for s in run.configured] == [
        ("policy", "ppo_micro_batch_size_per_gpu", 4, "sequences"),
        ("policy_forward", "log_prob_micro_batch_size_per_gpu", 8, "sequences"),
        ("reference", "log_prob_micro_batch_size_per_gpu", 8, "sequences"),
    ]
    # 40,960 tokens of 4,096-token sequences = 10 per micro-batch (yours 4: 2.5×); 64 prompts × 8 / 8 GPUs = 64 per
    # GPU per optimizer step: ⌈64 / 4⌉ = 16 → ⌈64 / 10⌉ = 7 micro-batches
    [update] = [c for c in compare(_profile(run, {"policy": 40_960}, longest=4096)) if c.size.role == "policy"]
    assert (update.batchfit, update.ratio, update.micro_batches) == (10, 2.5, (16, 7))


@pytest.mark.parametrize(
    ("example", "expected"),
    [
        # OpenRLHF: --train.micro_batch_size 4 (docs' example, no dynamic batches), --rollout.micro_batch_size 8
        ("openrlhf_grpo.sh", {"policy": ("--train.micro_batch_size", "sequences"), "policy_forward": ("--rollout.micro_batch_size", "sequences")}),
        # SkyRL's one token key bounds every pass, counted before the sequence-parallel split
        ("skyrl_grpo.yaml", None),
        ("slime_grpo.sh", None),
    ],
)
def test_every_frameworks_reader_records_what_its_config_sets(example, expected):
    run = read_run_config(EXAMPLES / example)
    sizes = {s.role: (s.key, s.unit) for s in run.configured}
    assert "policy" in sizes and "policy_forward" in sizes
    if expected is not None:
        assert {r: sizes[r] for r in expected} == expected
    if example.startswith("skyrl"):
        assert all(not s.per_gpu for s in run.configured)


def test_the_comparisons_are_emitted_comments_and_a_json_list(tmp_path):
    from batchfit.frameworks.run_profile import RunProfile

    run = read_run_config(_dapo(tmp_path))
    fake = _profile(run, {"policy": 186_650, "policy_forward": 400_000}, sp=2, longest=22_528)
    [update, forward] = yours_keys(fake)
    assert update.path == "" and update.comment.startswith("actor update: yours actor_rollout_ref.actor.ppo_max")
    assert forward.comment.startswith("old log-probs: yours actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    policy = types.SimpleNamespace(budgets=fake.budgets, to_dict=dict)
    data = RunProfile(run=run, profiles={"policy": policy}, options=fake.options).to_dict()
    assert [(c["pass"], c["yours"], c["batchfit"]) for c in data["yours"]] == [
        ("policy", 11264, 93_325),
        ("policy_forward", 11264, 200_000),  # 400,000 // 2
    ]


def test_a_micro_size_above_the_budget_is_called_so():
    run = read_run_config(EXAMPLES / "verl_grpo.yaml")  # ppo_micro_batch_size_per_gpu 4
    # 12,288 tokens hold 3 sequences of 4,096: yours 4 is above it
    [update] = [c for c in compare(_profile(run, {"policy": 12_288}, longest=4096)) if c.size.role == "policy"]
    assert "0.8× (yours is above the budget: expect out-of-memory" in describe(update)


@pytest.mark.slow
def test_the_cli_emits_the_comparisons_in_comments_and_json(tmp_path, capsys, monkeypatch):
    recorder = use_recorder(monkeypatch)  # budgets without a probe

    def profile_model(*args, **kwargs):  # the recorder's profile, with a JSON form for --json
        profile = recorder.profile_model(*args, **kwargs)
        profile.to_dict = lambda: {"budgets": {r: b.tokens for r, b in profile.budgets.items()}}
        return profile

    monkeypatch.setattr(framework_profile, "profile_model", profile_model)
    flags = ["--backend", "estimate", "--memory", "64MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress"]
    assert main(["profile", "--config", str(_dapo(tmp_path)), *flags, "--emit", "verl", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [update] = [c for c in data["yours"] if c["pass"] == "policy"]
    assert update["key"] == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" and update["yours"] == 11264
    assert update["batchfit"] == data["emit"]["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"]
    assert update["micro_batches_per_optimizer_step_per_gpu"]["yours"] == 64
    assert any(n.startswith("actor update: yours actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11,264") for n in data["emit_notes"])
    assert main(["profile", "--config", str(_dapo(tmp_path)), *flags, "--emit", "verl"]) == 0
    assert "# actor update: yours actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11,264 per GPU" in capsys.readouterr().out


def test_nothing_is_compared_for_a_config_that_sets_no_size():
    run = types.SimpleNamespace(configured=(), max_seq_len=1024)
    assert compare(_profile(run, {"policy": 1000}, longest=1024)) == [] and yours_keys(_profile(run, {"policy": 1})) == []


def test_a_pass_without_a_budget_is_left_out():
    # verl's LoRA reference runs on the actor: no reference budget, no comparison for it
    def refused():
        raise BatchConfigError(["no plan"])

    run = types.SimpleNamespace(configured=(YourSize("reference", "k", 8, "sequences"),), max_seq_len=1024, plan=refused)
    assert compare(_profile(run, {"policy": 4096}, longest=1024)) == []
