"""Micro-batch plans under two caps: tokens (the trunk) and response tokens (a response-only head)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BudgetError, InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.plan import two_caps
from batchfit.plan.packing import MicroBatchPlan, plan_micro_batches
from microbatch_helpers import fewest_groups, make_batch
from packing_two_caps_oracle import best_fit_packed as old_best_fit_packed


def token_cost(lengths, indices, cost):
    """The definition of a micro-batch's token cost (not the planner's code path)."""
    members = [lengths[i] for i in indices]
    return len(members) * max(members) if cost == "padded" else sum(members)


def ceil_div(a, b):
    return -(-a // b)


@st.composite
def two_cap_inputs(draw, max_size=50):
    lengths = draw(st.lists(st.integers(1, 300), max_size=max_size))
    responses = [draw(st.integers(0, length)) for length in lengths]
    budget = draw(st.integers(1, 900))
    rbudget = draw(st.integers(1, 600))
    dp_size = draw(st.integers(1, 4))
    cost = draw(st.sampled_from(["padded", "packed"]))
    balance = draw(st.booleans())
    return lengths, responses, budget, rbudget, dp_size, cost, balance


def check_two_cap_plan(plan: MicroBatchPlan, lengths, responses, budget, rbudget, dp_size, cost):
    # every index exactly once, over all ranks
    flat = sorted(i for rank in plan.ranks for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    # the same count on every rank, in both cost tables
    assert {len(r) for r in plan.ranks} == {plan.num_micro_batches}
    assert [len(c) for c in plan.costs] == [len(c) for c in plan.response_costs] == [len(r) for r in plan.ranks]
    oversize = set(plan.oversize)
    assert oversize == {i for i, (n, r) in enumerate(zip(lengths, responses)) if n > budget or r > rbudget}
    for rank, costs, rcosts in zip(plan.ranks, plan.costs, plan.response_costs):
        for mb, c, rc in zip(rank, costs, rcosts):
            if not mb:  # padding micro-batch: one pad row, no loss token
                assert (c, rc) == (1, 0)
                continue
            assert c == token_cost(lengths, mb, cost)
            assert rc == sum(responses[i] for i in mb)  # the head pays response tokens in both layouts
            if oversize & set(mb):
                assert len(mb) == 1  # an oversize sequence runs alone
            else:
                assert c <= budget and rc <= rbudget  # both caps are hard
    # the lower bound covers both dimensions, and no plan beats it
    clipped = sum(min(n, budget) for n in lengths)
    rclipped = sum(min(r, rbudget) for r in responses)
    expected = max(ceil_div(clipped, dp_size * budget), ceil_div(rclipped, dp_size * rbudget)) if lengths else 0
    assert plan.lower_bound == expected
    assert plan.num_micro_batches >= plan.lower_bound


# ---------------------------------------------------------------- invariants (hypothesis)


@settings(max_examples=150, deadline=None)
@given(two_cap_inputs())
def test_both_caps_hold_nothing_lost_or_duplicated_equal_counts(inputs):
    lengths, responses, budget, rbudget, dp_size, cost, balance = inputs
    plan = plan_micro_batches(
        lengths,
        budget,
        dp_size=dp_size,
        cost=cost,
        balance=balance,
        oversize="alone",
        response_lengths=responses,
        response_budget=rbudget,
    )
    check_two_cap_plan(plan, lengths, responses, budget, rbudget, dp_size, cost)
    again = plan_micro_batches(
        lengths,
        budget,
        dp_size=dp_size,
        cost=cost,
        balance=balance,
        oversize="alone",
        response_lengths=responses,
        response_budget=rbudget,
    )
    assert again == plan  # deterministic: every rank computes the same plan


@settings(max_examples=100, deadline=None)
@given(two_cap_inputs())
def test_without_the_second_cap_the_plan_is_the_one_cap_plan(inputs):
    lengths, responses, budget, _, dp_size, cost, balance = inputs
    kwargs = dict(dp_size=dp_size, cost=cost, balance=balance, oversize="alone")
    one = plan_micro_batches(lengths, budget, **kwargs)
    assert one.response_costs is None and one.response_budget is None
    reported = plan_micro_batches(lengths, budget, response_lengths=responses, **kwargs)
    loose = plan_micro_batches(
        lengths, budget, response_lengths=responses, response_budget=max(1, sum(responses)), **kwargs
    )
    for plan in (reported, loose):
        assert (plan.ranks, plan.costs, plan.oversize) == (one.ranks, one.costs, one.oversize)
        assert plan.response_costs == tuple(
            tuple(sum(responses[i] for i in mb) for mb in rank) for rank in one.ranks
        )
    assert reported.response_budget is None and reported.lower_bound == one.lower_bound


def brute_force_min_count(lengths, responses, budget, rbudget, cost):
    """Fewest micro-batches under both caps, by trying every set partition (tiny inputs only)."""
    return fewest_groups(
        len(lengths),
        lambda group: token_cost(lengths, group, cost) <= budget and sum(responses[i] for i in group) <= rbudget,
    )


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=7),
    st.integers(40, 120),
    st.integers(40, 80),
    st.sampled_from(["padded", "packed"]),
)
def test_small_plans_reach_the_optimum_under_both_caps(pairs, budget, rbudget, cost):
    lengths = [n for n, _ in pairs]
    responses = [min(r, n) for n, r in pairs]
    plan = plan_micro_batches(lengths, budget, cost=cost, response_lengths=responses, response_budget=rbudget)
    assert plan.num_micro_batches == brute_force_min_count(lengths, responses, budget, rbudget, cost)


# ---------------------------------------------------------------- the response cap binds


def test_the_response_cap_binds_where_the_one_cap_plan_breaks_it():
    # long prompts with short answers and short prompts with long answers
    lengths = [900, 850, 800, 300, 280, 260, 240, 220]
    responses = [50, 40, 30, 280, 260, 250, 230, 200]
    budget, rbudget = 2048, 400
    for cost in ("padded", "packed"):
        one = plan_micro_batches(lengths, budget, cost=cost, response_lengths=responses)
        assert max(c for rank in one.response_costs for c in rank) > rbudget  # the one-cap plan breaks it
        two = plan_micro_batches(lengths, budget, cost=cost, response_lengths=responses, response_budget=rbudget)
        check_two_cap_plan(two, lengths, responses, budget, rbudget, 1, cost)
        assert two.num_micro_batches > one.num_micro_batches
        assert two.num_micro_batches == brute_force_min_count(lengths, responses, budget, rbudget, cost)


def test_example_pairs_answers_with_prompts():
    plan = plan_micro_batches(
        [100, 30, 70, 40], 140, cost="packed", response_lengths=[60, 20, 50, 30], response_budget=80
    )
    assert plan.ranks == (((0, 1), (2, 3)),)
    assert plan.costs == ((130, 110),) and plan.response_costs == ((80, 80),)


def rl_rollouts(n, max_len, seed):
    """Long-tailed RL-like rollouts (as benchmarks/packing_two_caps.py): log-normal prompt and response."""
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.lognormal(np.log(900), 0.7, n).astype(np.int64), 256, max_len // 2)
    limit = max_len - prompt
    response = np.clip(rng.lognormal(np.log(700), 1.0, n).astype(np.int64), 1, None)
    response = np.where(rng.random(n) < 0.05, limit, np.minimum(response, limit))
    return prompt + response, response


@pytest.mark.parametrize("cost", ["padded", "packed"])
@pytest.mark.parametrize("dp_size", [1, 4])
def test_rl_rollouts_plan_close_to_the_lower_bound(cost, dp_size):
    lengths, responses = rl_rollouts(1024, 8192, seed=3)
    for budget, rbudget in ((16384, 8192), (16384, 9830), (32768, 13107), (32768, 19660)):
        one = plan_micro_batches(lengths, budget, dp_size=dp_size, cost=cost, response_lengths=responses)
        plan = plan_micro_batches(
            lengths, budget, dp_size=dp_size, cost=cost, response_lengths=responses, response_budget=rbudget
        )
        check_two_cap_plan(plan, lengths.tolist(), responses.tolist(), budget, rbudget, dp_size, cost)
        # padded: the one-cap count is optimal under the token cap alone, so also a bound
        bound = max(plan.lower_bound, one.num_micro_batches if cost == "padded" else 0)
        assert plan.num_micro_batches <= 1.12 * bound, (budget, rbudget, plan.num_micro_batches, bound)


# ---------------------------------------------------------------- the fast best fit (NOTE [ Least room where both fit ])


@st.composite
def best_fit_inputs(draw):
    """Sequences in any order; lengths and responses from a few values (ties) or a range, and
    budgets where either cap, or both, bind."""
    n = draw(st.integers(0, 120))
    values = st.sampled_from([1, 5, 40, 64, 100, 250]) if draw(st.booleans()) else st.integers(1, 400)
    lengths = draw(st.lists(values, min_size=n, max_size=n))
    responses = [draw(st.integers(0, length)) for length in lengths]
    order = draw(st.permutations(range(n)))
    budget = draw(st.integers(1, 1200))
    rbudget = draw(st.integers(1, 800))
    dimension = draw(st.sampled_from(["tokens", "responses", "tighter"]))
    return lengths, responses, list(order), budget, rbudget, dimension


# the first tier's time (issue 41): the old scan is compared in the first tier on fixed cases
# (test_a_sequence_that_fits_no_micro_batch_in_both_dimensions_opens_one, test_rl_rollout_plans_equal_*)
@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(best_fit_inputs())
def test_the_packed_best_fit_puts_every_sequence_where_the_old_scan_did(inputs):
    # the old scan (tests/packing_two_caps_oracle.py, verbatim): same groups, same order
    lengths, responses, order, budget, rbudget, dimension = inputs
    new = two_caps._best_fit_packed(lengths, responses, order, budget, rbudget, dimension)
    assert new == old_best_fit_packed(lengths, responses, order, budget, rbudget, dimension)


@pytest.mark.parametrize("dimension", ["tokens", "responses", "tighter"])
def test_a_sequence_that_fits_no_micro_batch_in_both_dimensions_opens_one(dimension):
    # budgets 100 and 100: six micro-batches of one (95 tokens, 5 responses) have 5 tokens and 95
    # responses left, six of one (50, 96) have 50 and 4 left; (10, 10) fits neither kind, so the
    # scan along either dimension (six candidates, no more than the other's six) reads to its end
    lengths = [95] * 6 + [50] * 6 + [10, 1]
    responses = [5] * 6 + [96] * 6 + [10, 1]
    order = list(range(14))
    groups = two_caps._best_fit_packed(lengths, responses, order, 100, 100, dimension)
    assert groups == old_best_fit_packed(lengths, responses, order, 100, 100, dimension)
    assert [12] in groups  # alone in a new micro-batch
    assert len(groups) == 13  # the last, 1 token with 1 response, joins one of the twelve


def test_the_least_still_to_place_is_exact_beyond_int64_keys():
    # rooms are shifted left past the micro-batch ids: 2**40 << 30 no longer fits an int64
    assert two_caps._least_after([2**40, 5, 2**40], [0, 1, 2], 30) == [5 << 30, 2**40 << 30, 0]
    assert two_caps._least_after([7, 5, 9], [2, 0, 1], 3) == [5 << 3, 5 << 3, 0]
    assert two_caps._least_after([], [], 1) == []


def _old_scan(*args, rests=None):
    """The old scan in the packer's place (it computes what is left to place itself)."""
    return old_best_fit_packed(*args)


@pytest.mark.parametrize("dp_size", [1, 4])
def test_rl_rollout_plans_equal_the_old_scan_plans(dp_size, monkeypatch):
    lengths, responses = rl_rollouts(3000, 8192, seed=5)
    for budget, rbudget in ((32768, 8192), (16384, 8192), (16384, 4096 + 2048), (32768, 19660)):
        kwargs = dict(
            dp_size=dp_size, cost="packed", oversize="alone", response_lengths=responses, response_budget=rbudget
        )
        new = plan_micro_batches(lengths, budget, **kwargs)
        with monkeypatch.context() as patch:
            patch.setattr(two_caps, "_best_fit_packed", _old_scan)
            old = plan_micro_batches(lengths, budget, **kwargs)
        assert new == old and new.response_costs == old.response_costs


@pytest.mark.slow
def test_the_20k_rollout_plan_of_the_speed_bar_equals_the_old_scan_plan(monkeypatch):
    # issue 29's bar (0.2 s, docs/packing.md); the old scan took 6.8 s on it
    lengths, responses = rl_rollouts(20_000, 8192, seed=0)
    kwargs = dict(cost="packed", response_lengths=responses, response_budget=8192)
    new = plan_micro_batches(lengths, 32768, **kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(two_caps, "_best_fit_packed", _old_scan)
        old = plan_micro_batches(lengths, 32768, **kwargs)
    assert new == old


@pytest.mark.timeout(10)  # about 0.1 s quiet; the old O(m) scan took 6.8 s (limits scale with the load)
def test_20k_rl_rollouts_plan_quickly_under_both_caps():
    lengths, responses = rl_rollouts(20_000, 8192, seed=0)
    plan = plan_micro_batches(lengths, 32768, cost="packed", response_lengths=responses, response_budget=8192)
    check_two_cap_plan(plan, lengths.tolist(), responses.tolist(), 32768, 8192, 1, "packed")
    assert plan.num_micro_batches <= 1.01 * plan.lower_bound


def test_integer_arrays_take_the_whole_array_check_and_others_the_item_check():
    lengths = [10, 20, 30]
    for responses in ([1, 2, 3], np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), np.array([1, 2, 3], dtype=np.uint8)):
        plan = plan_micro_batches(lengths, 100, response_lengths=responses, response_budget=5)
        assert plan.response_lengths.dtype == np.int64 and plan.response_lengths.tolist() == [1, 2, 3]
    with pytest.raises(InvalidArgument, match=r"response_lengths must hold integers in \[0, .*response_lengths\[1\]=-1"):
        plan_micro_batches(lengths, 100, response_lengths=np.array([1, -1, 2]), response_budget=5)
    with pytest.raises(InvalidArgument, match=r"1-D integer tensor or a list of ints, but got a Tensor of shape \(3,\) and dtype torch.bool"):
        plan_micro_batches(lengths, 100, response_lengths=torch.tensor([True, False, True]), response_budget=5)
    with pytest.raises(InvalidArgument, match=r"dtype torch.bfloat16"):
        plan_micro_batches(lengths, 100, response_lengths=torch.tensor([1, 2, 3], dtype=torch.bfloat16), response_budget=5)


# ---------------------------------------------------------------- errors


def test_a_response_over_the_cap_is_named_with_the_smallest_budget_that_holds_it():
    with pytest.raises(BudgetError, match=r"sequence 1 has 90 response tokens, more than response_budget=50 "
                       r"\(2 sequences are over it, largest 95\); raise response_budget to at least 95"):
        plan_micro_batches([100, 100, 100], 1000, response_lengths=[10, 90, 95], response_budget=50)
    with pytest.raises(BudgetError, match=r"sequence 0 has 100 tokens, more than token_budget=60.*at least 100"):
        plan_micro_batches([100, 10], 60, response_lengths=[5, 5], response_budget=50)


def test_oversize_alone_runs_a_response_over_the_cap_alone():
    plan = plan_micro_batches(
        [10, 20, 30, 40], 100, cost="packed", oversize="alone", response_lengths=[1, 20, 2, 3], response_budget=10
    )
    assert plan.oversize == (1,)
    assert (1,) in plan.ranks[0]
    assert all(rc <= 10 for mb, rc in zip(plan.ranks[0], plan.response_costs[0]) if mb != (1,))


@pytest.mark.parametrize(
    "response_lengths, response_budget, error, match",
    [
        ([1, 2], 10, InvalidArgument, r"one entry per sequence \(3, as lengths\).*len\(response_lengths\)=2"),
        ([1, -1, 2], 10, InvalidArgument, r"response_lengths must hold integers in \[0, .*response_lengths\[1\]=-1"),
        ([1, 2.5, 2], 10, InvalidArgument, r"response_lengths must hold integers only.*response_lengths\[1\]=2.5"),
        ([1, 2, 31], 10, InvalidArgument, r"at most lengths.*response_lengths\[2\]=31 > lengths\[2\]=30"),
        ("123", 10, InvalidArgument, r"response_lengths must be a list"),
        (None, 10, InvalidArgument, r"response_budget=10 needs response_lengths"),
        ([1, 2, 3], 0, BudgetError, r"response_budget must be a positive integer.*response_budget=0 \(int\)"),
        ([1, 2, 3], True, BudgetError, r"response_budget=True \(bool\)"),
        ([1, 2, 3], 5.0, BudgetError, r"response_budget=5.0 \(float\)"),
    ],
)
def test_bad_response_arguments_are_refused(response_lengths, response_budget, error, match):
    with pytest.raises(error, match=match):
        plan_micro_batches(
            [10, 20, 30], 100, response_lengths=response_lengths, response_budget=response_budget
        )


def test_tensors_and_arrays_are_accepted_and_pad_to_extends_response_costs():
    lengths = torch.tensor([50, 40, 30, 20, 10])
    responses = torch.tensor([40, 30, 20, 10, 5])
    plan = plan_micro_batches(lengths, 60, dp_size=2, cost="packed", response_lengths=responses, response_budget=45)
    same = plan_micro_batches(
        lengths.numpy(), 60, dp_size=2, cost="packed", response_lengths=responses.numpy(), response_budget=45
    )
    assert plan == same
    assert plan.response_lengths.tolist() == responses.tolist()
    padded = plan.pad_to(plan.num_micro_batches + 2)
    assert [c[-2:] for c in padded.response_costs] == [(0, 0), (0, 0)]
    assert padded.response_budget == 45 and padded.lower_bound == plan.lower_bound


# ---------------------------------------------------------------- running the plan


@pytest.mark.parametrize("cost, layout", [("padded", "padded"), ("packed", "packed"), ("packed", "padded")])
def test_iter_micro_batches_runs_a_two_cap_plan(cost, layout):
    batch = make_batch(num_sequences=12, seed=4)
    lengths = batch["attention_mask"].sum(-1)
    responses = batch["loss_mask"].sum(-1)
    budget, rbudget = int(3 * lengths.max()), int(responses.max() + 2)
    one = plan_micro_batches(lengths, budget, dp_size=2, cost=cost, response_lengths=responses)
    assert max(itertools.chain.from_iterable(one.response_costs)) > rbudget  # the cap binds
    plan = plan_micro_batches(
        lengths, budget, dp_size=2, cost=cost, response_lengths=responses, response_budget=rbudget
    )
    seen = []
    for rank in range(plan.dp_size):
        mbs = list(iter_micro_batches(batch, plan, rank, layout=layout))
        assert len(mbs) == plan.num_micro_batches
        for mb, rcost in zip(mbs, plan.response_costs[rank]):
            loss_tokens = int(mb.batch["loss_mask"].sum())
            assert loss_tokens == rcost <= rbudget  # what the response-only head gathers
            assert mb.cost <= budget
            if cost == layout:  # a packed plan run as padded rows pays rows × width, not its cost
                assert mb.batch["input_ids"].numel() <= mb.cost
            seen += list(mb.indices)
    assert sorted(seen) == list(range(12))


@st.composite
def binding_responses(draw):
    """Packed inputs whose responses mostly outweigh the tokens (long responses, a token budget
    several times the response budget), many sequences or few."""
    n = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    responses = [length - draw(st.integers(0, length // 4)) for length in lengths]
    rbudget = draw(st.integers(max(responses), 1200))
    budget = draw(st.integers(1, 8 * rbudget))
    return lengths, responses, budget, rbudget


@pytest.mark.parametrize("packer_limit", [None, 0])
@settings(max_examples=120, deadline=None)
@given(binding_responses())
def test_when_one_cap_cannot_hold_the_responses_its_plan_breaks_them(packer_limit, inputs):
    # NOTE [ When one cap cannot hold the other ]: the shortcut is a proof, so the one-cap plan it
    # skips has a micro-batch of several sequences over the response budget, for either packer
    # (best fit; largest-first/smallest-fill, used above BEST_FIT_MAX_DISTINCT distinct lengths)
    lengths, responses, budget, rbudget = inputs
    if not two_caps._one_cap_cannot_hold(np.asarray(lengths), np.asarray(responses), budget, rbudget):
        return
    with pytest.MonkeyPatch.context() as patch:
        if packer_limit is not None:
            patch.setattr("batchfit.plan.single_cap.BEST_FIT_MAX_DISTINCT", packer_limit)
        one = plan_micro_batches(lengths, budget, cost="packed", oversize="alone")
    assert any(len(mb) > 1 and sum(responses[i] for i in mb) > rbudget for rank in one.ranks for mb in rank)


def test_the_shortcut_is_taken_on_rollouts_whose_responses_bind():
    # 40 sequences of 100 tokens, all response: 4,000 responses over at most 2·4,000/1,000 + 1 = 9
    # one-cap micro-batches of at most 300 responses each (2,700 < 4,000)
    assert two_caps._one_cap_cannot_hold(np.full(40, 100), np.full(40, 100), 1000, 300)
    assert not two_caps._one_cap_cannot_hold(np.full(40, 100), np.full(40, 100), 1000, 500)
    # a sequence over the response cap runs alone and may hold any number: no proof
    assert not two_caps._one_cap_cannot_hold(np.full(40, 100), np.r_[np.full(39, 100), 301], 1000, 300)
