"""The glue every RL loop writes, as library calls: rollouts → rows, group advantages, cross-rank figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.batches.layout import field_roles
from batchfit.batches.rollouts import collate_rollouts
from batchfit.errors import BatchError, InvalidArgument
from batchfit.parallel.reduce import (
    ChecksumAgreement,
    parameter_agreement,
    parameter_checksum,
    reduce_figures,
)
from batchfit.train.advantages import group_advantages
from multirank import run_ranks

# --------------------------------------------------------------------------- collate_rollouts


def test_rollouts_become_left_padded_prompts_and_right_padded_responses():
    b = collate_rollouts(
        [[5, 6, 7], [8]],
        [[9], [10, 11, 12]],
        pad_id=1,
        rewards=[1.0, 0.0],
        uids=["a", "a"],
        advantages=[0.5, -0.5],
        old_log_probs=[[-0.1], [-0.2, -0.3, -0.4]],
    )
    # P = 3 (longest prompt), R = 3 (longest response): 6 columns
    assert b["input_ids"].tolist() == [[5, 6, 7, 9, 1, 1], [1, 1, 8, 10, 11, 12]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0], [0, 0, 0, 1, 2, 3]]
    # response-width fields: column j is sequence column 3 + j
    assert b["loss_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert b["advantages"].tolist() == [[0.5, 0, 0], [-0.5, -0.5, -0.5]]
    assert torch.allclose(b["old_log_probs"], torch.tensor([[-0.1, 0, 0], [-0.2, -0.3, -0.4]]))
    assert b["rewards"].tolist() == [1.0, 0.0] and b["uid"] == ["a", "a"]
    roles = field_roles(b)  # the layout module reads them as the trainer will
    assert set(roles.response) == {"loss_mask", "advantages", "old_log_probs"} and roles.response_width == 3


def test_fixed_widths_keep_shapes_and_tensors_are_accepted():
    b = collate_rollouts([torch.tensor([3, 4])], [np.array([5])], prompt_width=4, response_width=2)
    assert b["input_ids"].tolist() == [[0, 0, 3, 4, 5, 0]] and b["loss_mask"].shape == (1, 2)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6)), min_size=1, max_size=6), st.integers(0, 3))
def test_every_row_holds_its_prompt_then_its_response_and_nothing_else(shape, pad_id):
    rng = np.random.default_rng(len(shape))
    prompts = [rng.integers(4, 100, p) for p, _ in shape]
    responses = [rng.integers(4, 100, r) for _, r in shape]
    values = [rng.random(r) for _, r in shape]
    b = collate_rollouts(prompts, responses, pad_id=pad_id, old_log_probs=values)
    P, R = max(p for p, _ in shape), max(r for _, r in shape)
    assert b["input_ids"].shape == (len(shape), P + R) and b["loss_mask"].shape == (len(shape), R)
    for i, (p, r) in enumerate(shape):
        valid = b["attention_mask"][i].bool()
        assert b["input_ids"][i][valid].tolist() == [*prompts[i].tolist(), *responses[i].tolist()]
        assert (b["input_ids"][i][~valid] == pad_id).all()
        assert b["position_ids"][i][valid].tolist() == list(range(p + r))
        assert valid[P:].tolist() == b["loss_mask"][i].bool().tolist()  # right-aligned with the sequence
        assert torch.allclose(b["old_log_probs"][i][:r], torch.tensor(values[i], dtype=torch.float32))
        assert (b["old_log_probs"][i][r:] == 0).all()


def test_a_two_dimensional_per_token_field_is_one_row_per_rollout():
    b = collate_rollouts([[1], [2]], [[3, 4], [5, 6]], old_log_probs=torch.tensor([[0.1, 0.2], [0.3, 0.4]]))
    assert torch.allclose(b["old_log_probs"], torch.tensor([[0.1, 0.2], [0.3, 0.4]]))
    with pytest.raises(BatchError, match=r"old_log_probs\[1\] must hold one value per response token \(1\), but got 2"):
        collate_rollouts([[1], [2]], [[3, 4], [5]], old_log_probs=torch.tensor([[0.1, 0.2], [0.3, 0.0]]))


@pytest.mark.parametrize(
    ("prompts", "responses", "kwargs", "match"),
    [
        pytest.param([[1]], [[2], [3]], {}, r"must pair up, but got 1 prompts and 2 responses", id="counts"),
        pytest.param([], [], {}, r"at least one rollout", id="empty"),
        pytest.param([[1]], [[]], {}, r"responses\[0\] is empty", id="empty-response"),
        pytest.param([[1.5]], [[2]], {}, r"prompts\[0\] must be a 1-D sequence of token ids", id="float-ids"),
        pytest.param("abc", [[2]], {}, r"prompts must be a list of token-id sequences", id="string"),
        pytest.param([[1, 2, 3]], [[2]], {"prompt_width": 2}, r"prompts\[0\] has 3 tokens, more than prompt_width=2; .*left-truncate", id="prompt-wide"),
        pytest.param([[1]], [[2, 3]], {"response_width": 1}, r"responses\[0\] has 2 tokens, more than response_width=1", id="response-wide"),
        pytest.param([[1]], [[2, 3]], {"old_log_probs": [[0.1]]}, r"old_log_probs\[0\] must hold one value per response token \(2\), but got 1", id="per-token-length"),
        pytest.param([[1]], [[2]], {"advantages": [0.1, 0.2]}, r"advantages must hold one entry per rollout \(1\), but got 2", id="per-token-count"),
        pytest.param([[1]], [[2]], {"rewards": [math.nan]}, r"rewards must hold finite numbers, but got rewards\[0\]=nan", id="nan-reward"),
        pytest.param([[1]], [[2]], {"uids": [1, 2]}, r"uids must hold one prompt id per rollout \(1\), but got 2", id="uids"),
        pytest.param([[1]], [[2]], {"pad_id": -1}, r"pad_id must be an integer >= 0", id="pad"),
        pytest.param([[1]], [[2]], {"loss_mask": [1.0]}, r"'loss_mask' is a field collate_rollouts builds itself", id="own-field"),
    ],
)
def test_bad_rollouts_name_the_field_and_the_fix(prompts, responses, kwargs, match):
    with pytest.raises(BatchError if "pad_id" not in kwargs else InvalidArgument, match=match):
        collate_rollouts(prompts, responses, **kwargs)


# --------------------------------------------------------------------------- advantages

groups_of_rewards = st.lists(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=6), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(groups_of_rewards, st.sampled_from(["grpo", "rloo"]), st.booleans())
def test_every_group_sums_to_zero_and_no_advantage_is_nan(groups, estimator, normalize):
    rewards = [r for g in groups for r in g]
    uids = [i for i, g in enumerate(groups) for _ in g]
    adv = group_advantages(rewards, uids=uids, estimator=estimator, normalize=normalize)
    assert adv.shape == (len(rewards),) and torch.isfinite(adv).all()
    ids = torch.tensor(uids)
    for i, g in enumerate(groups):
        part = adv[ids == i].double()
        scale = 1.0 if normalize else max(1.0, max(abs(r) for r in g))
        assert abs(float(part.sum())) <= 1e-4 * scale * len(g)
        if len(g) == 1 or len(set(g)) == 1:  # no baseline, or nothing to prefer: exactly 0
            assert part.abs().max() == 0


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.floats(-10, 10, allow_nan=False))
def test_n_per_prompt_equals_uids_and_constant_rewards_give_zero(n, prompts, value):
    rewards = torch.full((n * prompts,), value)
    by_n = group_advantages(rewards, n=n)
    by_uid = group_advantages(rewards, uids=[i // n for i in range(n * prompts)])
    assert torch.equal(by_n, by_uid) and by_n.abs().max() == 0


def test_literal_advantages():
    # group [1, 0]: mean 0.5, std 0.5 -> (±0.5) / (0.5 + 1e-6)
    assert group_advantages([1.0, 0.0], n=2).tolist() == pytest.approx([0.999998, -0.999998], abs=1e-6)
    # rloo [1, 0, 3]: 1 - (0 + 3)/2 = -0.5; 0 - 4/2 = -2; 3 - 1/2 = 2.5
    assert group_advantages([1, 0, 3], n=3, estimator="rloo", normalize=False).tolist() == [-0.5, -2.0, 2.5]
    # uids in any order: groups {a: 1, 3}, {b: 2}
    assert group_advantages([1.0, 2.0, 3.0], uids=["a", "b", "a"], normalize=False).tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"rewards": [1.0, 2.0]}, r"pass either uids .* or n .*, but got neither", id="no-groups"),
        pytest.param({"rewards": [1.0], "n": 1, "uids": [0]}, r"but got both", id="both"),
        pytest.param({"rewards": [1.0, 2.0, 3.0], "n": 2}, r"n must divide the number of rollouts, but got n=2 for 3", id="n"),
        pytest.param({"rewards": [[1.0]], "n": 1}, r"rewards must be 1-D", id="2d"),
        pytest.param({"rewards": [1.0, math.inf], "n": 2}, r"rewards must be finite, but got rewards\[1\]=inf", id="inf"),
        pytest.param({"rewards": [1.0], "n": 1, "estimator": "ppo"}, r"estimator must be one of 'grpo', 'rloo'", id="estimator"),
        pytest.param({"rewards": [1.0], "n": 1, "epsilon": 0}, r"epsilon must be in \(0, inf\]", id="epsilon"),
        pytest.param({"rewards": [1.0, 2.0], "uids": [0]}, r"uids must hold one prompt id per reward \(2\), but got 1", id="uids"),
    ],
)
def test_bad_advantage_arguments(kwargs, match):
    with pytest.raises(InvalidArgument, match=match):
        group_advantages(**kwargs)


# --------------------------------------------------------------------------- cross-rank figures


def test_one_process_reduces_to_its_own_figures():
    assert reduce_figures({"loss": 1, "peak": torch.tensor(3.0)}, {"peak": "max"}) == {"loss": 1.0, "peak": 3.0}
    agreement = parameter_agreement(torch.nn.Linear(2, 1))
    assert agreement.equal and agreement.world_size == 1
    assert str(agreement) == f"ranks agree: parameter checksum {agreement.checksum:.6e} (one rank)"


@pytest.mark.parametrize(
    ("figures", "op", "match"),
    [
        pytest.param({"loss": "x"}, "mean", r"figures must be numbers, but got figures\['loss'\]='x'", id="string"),
        pytest.param({"loss": 1.0}, "median", r"op must be one of 'mean', 'sum', 'max', 'min'", id="op"),
        pytest.param({"loss": 1.0}, {"peak": "max"}, r"op names 'peak', which is not one of the figures", id="op-key"),
    ],
)
def test_bad_figures(figures, op, match):
    with pytest.raises(InvalidArgument, match=match):
        reduce_figures(figures, op)


def test_checksum_is_sum_plus_sum_of_squares():
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
        model.bias.fill_(3.0)
    # (1 - 2 + 3) + (1 + 4 + 9) = 16
    assert parameter_checksum(model) == 16.0


def test_a_differing_rank_is_reported_as_such():
    text = str(ChecksumAgreement(checksum=2.0, low=1.0, high=2.0, world_size=2))
    assert text.startswith("ranks differ: parameter checksums range from 1.000000000e+00 to 2.000000000e+00 over 2 ranks")


def _reduce_rank(rank: int) -> dict:
    figures = reduce_figures(
        {"loss": float(rank + 1), "tokens": 10.0 * (rank + 1), "peak": 100.0 * (rank + 1), "low": float(rank + 5)},
        {"tokens": "sum", "peak": "max", "low": "min"},
    )
    torch.manual_seed(0)
    same = torch.nn.Linear(3, 2)
    differ = torch.nn.Linear(3, 2)
    if rank == 1:
        with torch.no_grad():
            differ.bias.add_(1.0)
    return {"figures": figures, "same": parameter_agreement(same), "differ": parameter_agreement(differ)}


def test_two_ranks_reduce_figures_and_compare_parameters():
    ranks = run_ranks(_reduce_rank, timeout=60)
    for got in ranks.values():
        # loss mean (1 + 2)/2; tokens 10 + 20; peak max(100, 200); low min(5, 6)
        assert got["figures"] == {"loss": 1.5, "tokens": 30.0, "peak": 200.0, "low": 5.0}
        assert got["same"].equal and got["same"].world_size == 2
        assert not got["differ"].equal and str(got["differ"]).startswith("ranks differ")
    assert ranks[0]["differ"].high - ranks[0]["differ"].low > 1.0  # the bias moved by 1 on rank 1
