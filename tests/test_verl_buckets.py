"""verl's ``pad_to_length``: packed micro-batches padded up to a bucket of tokens, and ``--emit verl``'s lengths for it.

NOTE [ verl pads packed micro-batches to a bucket ] in :mod:`batchfit.frameworks.verl`: each packed micro-batch runs
as ``ceildiv(n, bucket) × bucket`` tokens (verl/workers/engine/fsdp/transformer_impl.py ``_get_packed_pad_size``,
verl-project/verl 1dda039b), so an emitted length times the Ulysses (or context-parallel) size is a multiple of
``lcm(bucket, factor)`` within the budget.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from batchfit.frameworks import read_run_config
from batchfit.frameworks.assumptions import EmitError
from batchfit.frameworks.verl_emit import bucketed, token_keys
from batchfit.parallel.sharding import Sharding

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "verl_grpo.yaml"
ACTOR = "actor_rollout_ref.actor."


def _config(actor: dict | None = None, **sections) -> dict:
    data = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text(encoding="utf-8")))
    data["actor_rollout_ref"]["actor"].update(actor or {})
    for name, value in sections.items():
        data["actor_rollout_ref"].setdefault(name, {}).update(value)
    return data


def _on(bucket: int | None = None) -> dict:
    fsdp = {"param_offload": False, "optimizer_offload": False, **({"pad_to_length_bucket": bucket} if bucket else {})}
    return {"pad_to_length": True, "fsdp_config": fsdp}


def test_pad_to_length_is_read_as_the_engines_bucket():
    assert read_run_config(_config(_on())).token_bucket == 1024  # FSDPEngineConfig.pad_to_length_bucket's default
    assert read_run_config(_config(_on(512))).token_bucket == 512
    assert read_run_config(EXAMPLE).token_bucket is None


def test_pad_to_length_is_no_longer_an_unmodelled_warning():
    said = read_run_config(_config(_on())).warnings
    assert not [w for w in said if "pad_to_length" in w]


def test_without_padding_removed_nothing_is_padded_to_a_bucket():
    run = read_run_config(_config(_on(), model={"use_remove_padding": False}))
    assert run.token_bucket is None


def test_a_reference_that_pads_unlike_the_actor_is_a_warning():
    run = read_run_config(_config(_on(), ref={"pad_to_length": False}))
    assert [w for w in run.warnings if w.startswith("actor_rollout_ref.ref.fsdp_config.pad_to_length=False differs")]


def test_a_bucket_verl_refuses_is_a_fault():
    faults = read_run_config(_config(_on(-4))).faults
    assert [f for f in faults if f.startswith("actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket=-4")]


@pytest.mark.parametrize(
    ("budget", "factor", "bucket", "expected"),
    [
        (10_000, 1, None, 10_000),
        (10_000, 1, 1024, 9_216),  # 10,000 // 1,024 = 9 buckets
        (10_000, 2, 1024, 4_608),  # 9 × 1,024 = 9,216 over 2 GPUs
        (10_000, 3, 1024, 3_072),  # lcm(1,024, 3) = 3,072: 3 × 3,072 = 9,216 over 3 GPUs
        (6_000, 2, 512, 2_816),  # lcm(512, 2) = 512: 11 × 512 = 5,632 over 2
    ],
)
def test_an_emitted_length_is_the_budget_rounded_down_to_the_bucket(budget, factor, bucket, expected):
    assert bucketed(budget, factor, bucket) == expected


@given(
    budget=st.integers(1, 200_000),
    factor=st.sampled_from([1, 2, 3, 4, 8]),
    bucket=st.integers(1, 4096),
)
def test_a_padded_micro_batch_within_the_length_never_exceeds_the_budget(budget, factor, bucket):
    try:
        per_gpu = bucketed(budget, factor, bucket)
    except EmitError:
        assert budget < bucket * factor // __import__("math").gcd(bucket, factor)
        return
    total = per_gpu * factor
    # verl: any packed micro-batch of n <= total tokens runs ceildiv(n, bucket) × bucket, then a multiple of factor
    for n in {1, total // 2 or 1, total}:
        padded = -(-n // bucket) * bucket
        padded = -(-padded // factor) * factor
        assert padded <= budget


def test_a_budget_below_one_bucket_or_the_longest_sequence_is_refused():
    with pytest.raises(EmitError, match=r"no multiple within the budget holds one micro-batch"):
        bucketed(1000, 1, 1024)
    with pytest.raises(EmitError, match=r"holds a sequence of 4,100 tokens; set pad_to_length_bucket"):
        bucketed(5000, 1, 1024, longest=4100)  # 4 × 1,024 = 4,096 < 4,100


def test_the_emitted_lengths_are_multiples_of_the_bucket_and_the_bucket_is_written():
    run = read_run_config(_config(_on()))
    sharding = Sharding("fsdp2", world_size=8, sequence_parallel=2)
    profile = SimpleNamespace(run=run, options={"policy": SimpleNamespace(sharding=sharding)})
    budgets = {"policy": 20_000, "policy_forward": 30_000, "reference": 30_000}
    keys = {k.path: k for k in token_keys(profile, budgets, lambda role, what: what, 4096, 8)}
    # 20,000 // 1,024 = 19 buckets = 19,456 tokens over Ulysses 2: 9,728 per GPU; 30,000 -> 29 × 1,024 / 2 = 14,848
    assert keys[ACTOR + "ppo_max_token_len_per_gpu"].value == 9_728
    assert keys["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"].value == 14_848
    assert keys[ACTOR + "fsdp_config.pad_to_length_bucket"].value == 1024
    assert "holds 19,456 tokens" in keys[ACTOR + "ppo_max_token_len_per_gpu"].comment
    assert "_get_packed_pad_size" in keys[ACTOR + "ppo_max_token_len_per_gpu"].comment
