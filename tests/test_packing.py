"""Token-budget micro-batch plans (the pure algorithm of batchfit.plan.packing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BudgetError, InvalidArgument
from batchfit.plan import single_cap
from batchfit.plan.packing import MicroBatchPlan, plan_micro_batches
from microbatch_helpers import fewest_groups


def micro_batch_cost(lengths, indices, cost):
    """The definition of a micro-batch's cost (not the planner's code path)."""
    members = [lengths[i] for i in indices]
    return len(members) * max(members) if cost == "padded" else sum(members)


def brute_force_min_count(lengths, budget, cost):
    """Fewest micro-batches under the cap, by trying every set partition (tiny inputs only)."""
    return fewest_groups(len(lengths), lambda group: micro_batch_cost(lengths, group, cost) <= budget)


# ---------------------------------------------------------------- invariants (hypothesis)

plan_inputs = st.tuples(
    st.lists(st.integers(1, 300), max_size=60),
    st.integers(1, 600),
    st.integers(1, 5),
    st.sampled_from(["padded", "packed"]),
    st.booleans(),
)


def check_plan_invariants(plan: MicroBatchPlan, lengths, budget, dp_size, cost):
    assert plan.dp_size == dp_size
    # every index exactly once
    flat = sorted(i for rank in plan.ranks for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    # equal counts per rank
    assert {len(rank) for rank in plan.ranks} == {plan.num_micro_batches}
    assert [len(c) for c in plan.costs] == [plan.num_micro_batches] * dp_size
    oversize = set(plan.oversize)
    for rank, costs in zip(plan.ranks, plan.costs):
        for mb, c in zip(rank, costs):
            if not mb:  # padding micro-batch: one pad row, one token
                assert c == 1
                continue
            assert c == micro_batch_cost(lengths, mb, cost)
            if oversize & set(mb):
                assert len(mb) == 1  # an oversize sequence runs alone
            else:
                assert c <= budget  # the hard cap
    assert plan.num_padding_micro_batches == sum(1 for r in plan.ranks for mb in r if not mb)
    assert plan.num_micro_batches >= plan.lower_bound


@settings(max_examples=150, deadline=None)
@given(plan_inputs)
def test_plan_keeps_every_index_once_under_the_cap_with_equal_counts(inputs):
    lengths, budget, dp_size, cost, balance = inputs
    plan = plan_micro_batches(lengths, budget, dp_size=dp_size, cost=cost, balance=balance, oversize="alone")
    check_plan_invariants(plan, lengths, budget, dp_size, cost)
    assert set(plan.oversize) == {i for i, n in enumerate(lengths) if n > budget}


@settings(max_examples=60, deadline=None)
@given(plan_inputs)
def test_plan_is_deterministic_and_independent_of_input_type(inputs):
    lengths, budget, dp_size, cost, balance = inputs
    kwargs = dict(dp_size=dp_size, cost=cost, balance=balance, oversize="alone")
    plan = plan_micro_batches(lengths, budget, **kwargs)
    assert plan_micro_batches(list(lengths), budget, **kwargs) == plan
    assert plan_micro_batches(np.asarray(lengths, dtype=np.int32), budget, **kwargs) == plan
    assert plan_micro_batches(torch.tensor(lengths, dtype=torch.long), budget, **kwargs) == plan


def test_many_distinct_lengths_use_the_vectorised_packer_with_the_same_guarantees():
    # above BEST_FIT_MAX_DISTINCT distinct lengths: largest first, then the shortest that fit
    plan = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="packed")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(single_cap, "BEST_FIT_MAX_DISTINCT", 0)
        fast = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="packed")
    assert fast.ranks == (((0, 1), (2, 3)),)  # 100 + 30 = 130, then 70 + 40 = 110
    assert fast.num_micro_batches == plan.num_micro_batches == 2


@settings(max_examples=100, deadline=None)
@given(plan_inputs)
def test_vectorised_packed_plan_keeps_every_index_once_under_the_cap(inputs):
    lengths, budget, dp_size, _, balance = inputs
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(single_cap, "BEST_FIT_MAX_DISTINCT", 0)
        plan = plan_micro_batches(
            lengths, budget, dp_size=dp_size, cost="packed", balance=balance, oversize="alone"
        )
    check_plan_invariants(plan, lengths, budget, dp_size, "packed")


def best_fit_decreasing_costs(lengths, budget):
    """Per-sequence best-fit decreasing, by its definition: sorted micro-batch costs."""
    loads = []
    for length in sorted(lengths, reverse=True):
        fits = [k for k, load in enumerate(loads) if load + length <= budget]
        if fits:
            loads[max(fits, key=lambda k: loads[k])] += length  # the least room that holds it
        else:
            loads.append(length)  # a new micro-batch (an oversize sequence stays alone)
    return sorted(loads)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.lists(st.integers(1, 300), max_size=80),
        st.lists(st.sampled_from([1, 7, 30, 64, 100, 129, 250]), max_size=120),  # many repeats
    ),
    st.integers(1, 600),
)
def test_best_fit_by_distinct_length_equals_per_sequence_best_fit(lengths, budget):
    # NOTE [ Best fit by distinct length ]: same count and same multiset of costs (without the
    # small-plan search, which may improve on best fit)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(single_cap, "SMALL_PLAN_MAX_SEQUENCES", 0)
        plan = plan_micro_batches(lengths, budget, cost="packed", oversize="alone")
    assert sorted(plan.costs[0]) == best_fit_decreasing_costs(lengths, budget)
    searched = plan_micro_batches(lengths, budget, cost="packed", oversize="alone")
    assert searched.num_micro_batches <= plan.num_micro_batches


@pytest.mark.parametrize("budget_over_longest", [2, 4])
def test_large_long_tailed_packed_plan_is_within_one_percent_of_the_lower_bound(budget_over_longest):
    # the benchmark's long tail (RL rollouts: prompt + log-normal response, 5% at the max length)
    rng = np.random.default_rng(0)
    lengths = 256 + rng.lognormal(np.log(600), 0.9, 50_000).astype(np.int64)
    lengths[rng.random(50_000) < 0.05] = 4096
    lengths = np.clip(lengths, 1, 4096)
    budget = budget_over_longest * 4096
    for dp_size in (1, 8):
        plan = plan_micro_batches(lengths, budget, dp_size=dp_size, cost="packed")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(single_cap, "BEST_FIT_MAX_DISTINCT", 0)
            vectorised = plan_micro_batches(lengths, budget, dp_size=dp_size, cost="packed")
        assert plan.num_micro_batches <= 1.01 * plan.lower_bound
        assert plan.num_micro_batches <= vectorised.num_micro_batches
        assert max(c for rank in plan.costs for c in rank) <= budget


@settings(max_examples=100, deadline=None)
@given(plan_inputs)
def test_restore_order_inverts_the_plan_permutation(inputs):
    lengths, budget, dp_size, cost, balance = inputs
    plan = plan_micro_batches(lengths, budget, dp_size=dp_size, cost=cost, balance=balance, oversize="alone")
    in_plan_order = [f"out{i}" for i in plan.order()]
    assert plan.restore_order(in_plan_order) == [f"out{i}" for i in range(len(lengths))]
    tensor = torch.as_tensor(plan.order(), dtype=torch.long)
    assert plan.restore_order(tensor).tolist() == list(range(len(lengths)))
    for r in range(dp_size):
        own = plan.order(r)
        assert plan.restore_order(own * 10, rank=r).tolist() == sorted(int(i) * 10 for i in own)


# derandomized: best-fit decreasing has no "+1" guarantee in general (11/9·OPT + 4), only on
# these small inputs (3000 random cases checked), so the examples are fixed to keep it stable
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.integers(40, 120))
def test_padded_count_is_optimal_and_packed_within_one(lengths, budget):
    padded = plan_micro_batches(lengths, budget, cost="padded")
    packed = plan_micro_batches(lengths, budget, cost="packed")
    assert padded.num_micro_batches == brute_force_min_count(lengths, budget, "padded")
    assert packed.num_micro_batches <= brute_force_min_count(lengths, budget, "packed") + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=7), st.integers(40, 120), st.integers(2, 3))
def test_padded_count_per_rank_is_optimal_with_data_parallel(lengths, budget, dp_size):
    # any dp plan with m per rank is a one-rank plan with dp·m micro-batches, so m >= ⌈M*/dp⌉
    plan = plan_micro_batches(lengths, budget, cost="padded", dp_size=dp_size)
    optimum = brute_force_min_count(lengths, budget, "padded")
    assert plan.num_micro_batches == -(-optimum // dp_size)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=80), st.integers(2, 4))
def test_rank_costs_differ_by_at_most_the_budget(lengths, dp_size):
    budget = 2 * max(lengths)
    plan = plan_micro_batches(lengths, budget, dp_size=dp_size, cost="packed")
    assert max(plan.rank_costs) - min(plan.rank_costs) <= budget


# ---------------------------------------------------------------- literal examples


def test_packed_plan_puts_each_sequence_where_it_fits_best():
    plan = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="packed")
    # 100 leaves 40, 70 opens a second (room 70), 40 fits the room of 40 exactly, 30 joins 70
    assert plan.ranks == (((0, 3), (2, 1)),)
    assert plan.costs == ((140, 100),)
    assert plan.lower_bound == 2  # ⌈240 / 140⌉
    assert plan.utilization == pytest.approx(240 / 280)  # (140 + 100) / (2 × 140)
    assert plan.padding_tokens == 0


def test_padded_plan_takes_runs_of_sorted_lengths():
    plan = plan_micro_batches([100, 30, 70, 40], token_budget=140, cost="padded")
    # sorted 100, 70, 40, 30: 140 // 100 = 1 → {100}; 140 // 70 = 2 → {70, 40} cost 140; {30}
    assert plan.ranks == (((2, 3), (0,), (1,)),)  # largest cost first
    assert plan.costs == ((140, 100, 30),)
    assert plan.padding_tokens == 30  # {70, 40} costs 2 × 70 = 140 for 110 tokens
    assert plan.lower_bound == 2  # ⌈240 / 140⌉; the padded optimum is 3
    assert plan.utilization == pytest.approx(270 / 420)  # 270 / (3 × 140)


def test_short_ranks_get_padding_micro_batches_that_cost_one_token():
    # 3 sequences, 4 ranks: one rank has nothing and runs one padding micro-batch
    plan = plan_micro_batches([10, 10, 10], token_budget=10, dp_size=4)
    assert plan.num_micro_batches == 1
    assert plan.num_padding_micro_batches == 1
    empty = [r for r in range(4) if plan.is_padding(r, 0)]
    assert len(empty) == 1 and plan.costs[empty[0]] == (1,)
    assert plan.utilization == pytest.approx(31 / 40)  # (3 × 10 + 1) / (4 ranks × 1 × 10)


def test_data_parallel_lower_bound_spans_ranks():
    plan = plan_micro_batches([50] * 10, token_budget=100, dp_size=2, cost="packed")
    assert plan.lower_bound == 3  # ⌈500 / (2 × 100)⌉
    assert plan.num_micro_batches == 3  # 5 sequences per rank, two per micro-batch
    assert plan.rank_costs == (250, 250)
    assert plan.imbalance == pytest.approx(1.0)


def test_balance_aligns_micro_batch_costs_across_ranks():
    plan = plan_micro_batches([90, 80, 20, 10, 60, 50], token_budget=100, dp_size=2, cost="packed")
    for costs in plan.costs:
        assert list(costs) == sorted(costs, reverse=True)


def test_unbalanced_plan_deals_packing_order_round_robin():
    plan = plan_micro_batches([60, 60, 60, 60], token_budget=100, dp_size=2, cost="packed", balance=False)
    # packing order 0, 1, 2, 3 (one each) dealt 0 → rank 0, 1 → rank 1, 2 → rank 0, 3 → rank 1
    assert plan.ranks == (((0,), (2,)), ((1,), (3,)))


def test_empty_lengths_give_an_empty_plan():
    plan = plan_micro_batches([], token_budget=10, dp_size=2)
    assert plan.ranks == ((), ())
    assert plan.num_micro_batches == 0 and plan.lower_bound == 0 and plan.utilization == 1.0
    assert plan.restore_order([]) == []


def test_pad_to_appends_padding_micro_batches_to_every_rank():
    plan = plan_micro_batches([5, 5], token_budget=10).pad_to(3)
    assert plan.ranks == (((0, 1), (), ()),)
    assert plan.costs == ((10, 1, 1),)
    assert plan.num_padding_micro_batches == 2


def test_pad_to_cannot_shrink_a_plan():
    plan = plan_micro_batches([5, 5, 5], token_budget=5)
    with pytest.raises(InvalidArgument, match=r"num_micro_batches must be >= the plan's count 3"):
        plan.pad_to(2)


# ---------------------------------------------------------------- oversize sequences


def test_oversize_sequence_error_names_index_length_and_budget():
    with pytest.raises(BudgetError, match=r"sequence 1 has 300 tokens, more than token_budget=256") as info:
        plan_micro_batches([10, 300, 20], token_budget=256)
    assert "oversize='alone'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_oversize_error_counts_every_offender():
    with pytest.raises(BudgetError, match=r"\(2 sequences are over the budget, longest 400\)"):
        plan_micro_batches([300, 10, 400], token_budget=256)


@pytest.mark.parametrize("cost", ["padded", "packed"])
def test_oversize_alone_runs_the_sequence_alone_and_reports_it(cost):
    plan = plan_micro_batches([10, 300, 20], token_budget=256, cost=cost, oversize="alone")
    assert plan.oversize == (1,)
    assert (1,) in plan.ranks[0]
    assert plan.costs[0][plan.ranks[0].index((1,))] == 300
    # lower bound clips the oversize sequence to one full budget: ⌈(10 + 256 + 20) / 256⌉ = 2
    assert plan.lower_bound == 2


# ---------------------------------------------------------------- invalid arguments

INVALID = [
    pytest.param(dict(lengths=[[1, 2]]), InvalidArgument, r"lengths must be 1-D", id="lengths-2d"),
    pytest.param(dict(lengths=[1.5, 2.0]), InvalidArgument, r"lengths must be integers", id="lengths-float"),
    pytest.param(dict(lengths=[True]), InvalidArgument, r"lengths must be integers", id="lengths-bool"),
    pytest.param(dict(lengths=[3, 0]), InvalidArgument, r"lengths\[1\]=0", id="lengths-zero"),
    pytest.param(dict(token_budget=0), BudgetError, r"token_budget=0", id="budget-zero"),
    pytest.param(dict(token_budget=2.5), BudgetError, r"token_budget=2.5", id="budget-float"),
    pytest.param(dict(token_budget=True), BudgetError, r"token_budget=True", id="budget-bool"),
    pytest.param(dict(dp_size=0), InvalidArgument, r"dp_size=0", id="dp-zero"),
    pytest.param(dict(cost="pad"), InvalidArgument, r"cost=.pad.; did you mean .padded.", id="cost-typo"),
    pytest.param(dict(oversize="skip"), InvalidArgument, r"oversize must be one of", id="oversize-unknown"),
    pytest.param(dict(balance=1), InvalidArgument, r"balance must be True or False", id="balance-int"),
]


@pytest.mark.parametrize(("overrides", "error", "match"), INVALID)
def test_invalid_arguments_are_rejected_with_their_value(overrides, error, match):
    kwargs = dict(lengths=[3, 4], token_budget=8) | overrides
    lengths = kwargs.pop("lengths")
    budget = kwargs.pop("token_budget")
    with pytest.raises(error, match=match):
        plan_micro_batches(lengths, budget, **kwargs)


@pytest.mark.parametrize(
    ("outputs", "rank", "match"),
    [
        pytest.param([1], None, r"one entry per sequence of all ranks in plan order \(2\)", id="too-short"),
        pytest.param([1, 2], 1, r"rank must be an integer in \[0, 1\), but got rank=1", id="bad-rank"),
        pytest.param({1, 2}, None, r"outputs must be a list, tuple, numpy array or tensor", id="set"),
    ],
)
def test_restore_order_rejects_mismatched_outputs(outputs, rank, match):
    plan = plan_micro_batches([3, 4], token_budget=8)
    with pytest.raises(InvalidArgument, match=match):
        plan.restore_order(outputs, rank=rank)


# --------------------------------------------------------------------------- small plans are optimal


def _optimum(lengths: list[int], budget: int) -> int:
    """The fewest micro-batches of at most ``budget`` tokens: exhaustive search, every assignment."""
    items = sorted(lengths, reverse=True)
    best = len(items)

    def place(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(items):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + items[i] <= budget:
                loads[b] += items[i]
                place(i + 1, loads)
                loads[b] -= items[i]
        place(i + 1, [*loads, items[i]])

    place(0, [])
    return best


def test_small_packed_plans_use_the_optimal_count():
    # 400 random small instances (4..12 sequences of 20-50% of the budget, where best fit alone
    # misses the optimum in 39 of them): the count equals the exhaustive optimum in at least 99%
    # and never exceeds it by more than one
    rng = np.random.default_rng(7)
    misses = 0
    for _ in range(400):
        n = int(rng.integers(4, 13))
        budget = 100
        lengths = rng.integers(20, 51, size=n).tolist()
        count = plan_micro_batches(lengths, budget, cost="packed").num_micro_batches
        optimum = _optimum(lengths, budget)
        assert optimum <= count <= optimum + 1, (lengths, budget)
        misses += count > optimum
    assert misses <= 4  # 99% of 400


def test_the_search_finds_the_plan_best_fit_decreasing_misses():
    # 20 tokens, budget 10: best fit puts 5+4 (room 1, nothing fits), 4+3+2 (room 1), 2 -> 3
    # micro-batches; the search finds 5+3+2 and 4+4+2, both exactly full
    lengths, budget = [4, 2, 5, 2, 3, 4], 10
    groups, _ = single_cap._pack_best_fit(np.array(sorted(lengths, reverse=True)), np.arange(6), budget)
    plan = plan_micro_batches(lengths, budget, cost="packed")
    assert len(groups) == 3
    assert plan.ranks == (((2, 4, 1), (0, 5, 3)),) and plan.costs == ((10, 10),)


def test_plan_totals_are_exact_beyond_int64():
    # numpy's int64 sums wrap around: lower_bound was -1 and padding_tokens 2**64 here.
    lengths = [2**40, 2**40, 5] * 3
    plan = plan_micro_batches(lengths, token_budget=2**62, cost="padded")
    assert plan.lower_bound == 1
    assert plan.rank_lower_bounds == (1,)
    assert plan.padding_tokens == 9 * 2**40 - sum(lengths)
    many = plan_micro_batches(np.full(10_000, 2**40), token_budget=2**62, cost="packed")
    assert many.lower_bound == 1 and many.padding_tokens == 0


def test_a_length_beyond_the_maximum_is_named_not_read_negative():
    lengths = np.array([2**63 + 5, 3], dtype=np.uint64)
    with pytest.raises(InvalidArgument, match=r"lengths\[0\]=9,223,372,036,854,775,813"):
        plan_micro_batches(lengths, token_budget=10)
