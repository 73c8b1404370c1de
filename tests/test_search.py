"""batchfit.plan.bracket: the shared bracket search (pure, on probe functions), bounded and unbounded."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import InvalidArgument
from batchfit.plan.bracket import (
    NO_CAP,
    Trial,
    blind_step,
    largest_fitting,
    max_trials,
    potential,
    unbounded_max_trials,
)

# --------------------------------------------------------------------------- bounds


def test_max_trials_is_log2_of_the_range_plus_three():
    assert max_trials(1, 512) == 12  # ceil(log2(512)) + 3 = 9 + 3
    assert max_trials(1, 513) == 13  # ceil(log2(513)) + 3 = 10 + 3
    assert max_trials(7, 7) == 3  # ceil(log2(1)) + 3 = 0 + 3


def test_unbounded_max_trials_is_twice_log2_of_the_answer_plus_three():
    assert unbounded_max_trials(0) == 3  # 2 * 0 + 3
    assert unbounded_max_trials(95) == 17  # 2 * ceil(log2(96)) + 3 = 2 * 7 + 3
    assert unbounded_max_trials(128) == 19  # 2 * ceil(log2(129)) + 3 = 2 * 8 + 3


def test_unbounded_blind_step_lowers_the_potential_by_at_least_one():
    # the induction step of NOTE [ Trial budget ] (unbounded), exhaustively on small brackets;
    # 2**62 + 1 stands for "no failure measured" (the search's cap when given none)
    for lo in range(0, 300):
        for hi in [*range(lo + 2, 1300), 2**62 + 1]:
            c, _ = blind_step(lo, hi, bounded=False)
            assert lo < c < hi
            after = max(potential(c, hi, False), potential(lo, c, False))
            assert 1 + after <= potential(lo, hi, False), (lo, hi, c)


# --------------------------------------------------------------------------- exact sequences


def test_an_exact_guess_costs_two_probes():
    # guess 95.5 -> probe 95 (fits), then 96 (does not): the answer is bracketed by measurement
    result = largest_fitting(lambda b: b <= 95, guess=lambda trials: 95.5)
    assert [t.batch_size for t in result.trials] == [95, 96]
    assert [t.chosen_by for t in result.trials] == ["model", "model"]
    assert result.batch_size == 95


def test_unbounded_blind_search_doubles_then_bisects():
    # 1,2,4,...,128 (8 probes; 128 fails), then 96 80 88 92 94 95 -> 14 probes
    result = largest_fitting(lambda b: b <= 95)
    assert [t.batch_size for t in result.trials] == [1, 2, 4, 8, 16, 32, 64, 128, 96, 80, 88, 92, 94, 95]
    assert result.trials[1].chosen_by == "double" and result.trials[-1].chosen_by == "bisect"
    assert result.max_trials == 17  # unbounded_max_trials(95)


def test_bounded_blind_search_probes_low_then_bisects():
    # low 1 first, then midpoints of (1, 513): 257 129 65 97 81 89 93 95 96 -> 10 <= 12
    result = largest_fitting(lambda b: b <= 95, low=1, high=512)
    assert [t.batch_size for t in result.trials] == [1, 257, 129, 65, 97, 81, 89, 93, 95, 96]
    assert result.trials[0].chosen_by == "min" and result.max_trials == 12


def test_an_overshooting_guess_costs_one_probe_then_the_search_gallops_from_lo():
    # guess 10**6 fails; doubling restarts from lo = 0: 1 fits, 2 fails -> 3 probes
    result = largest_fitting(lambda b: b <= 1, guess=lambda trials: 10**6)
    assert [t.batch_size for t in result.trials][:1] == [10**6]
    assert result.batch_size == 1 and len(result.trials) <= unbounded_max_trials(1) == 5


def test_search_stops_at_its_cap():
    result = largest_fitting(lambda b: True, guess=lambda trials: math.inf, cap=64)
    assert result.batch_size == 64
    assert [t.batch_size for t in result.trials] == [64]


def test_low_that_does_not_fit_returns_low_minus_one():
    result = largest_fitting(lambda b: Trial(b, 1500, False), low=4, high=9)
    assert result.batch_size == 3 and len(result.trials) == 1
    assert result.fitting_trial is None and result.peak_bytes is None


def test_a_crawling_guess_is_overruled_by_the_budget():
    # the guess always says "lo + 1 fits": without the safeguard this is a linear search
    def crawl(trials):
        fits = [t.batch_size for t in trials if t.fits]
        return max(fits, default=0) + 1.5

    result = largest_fitting(lambda b: b <= 5_000, guess=crawl)
    assert result.batch_size == 5_000
    assert len(result.trials) <= unbounded_max_trials(5_000) == 29  # 2 * 13 + 3


def test_each_trial_is_reported_as_it_is_decided():
    seen: list[Trial] = []
    result = largest_fitting(lambda n: n <= 10, low=1, high=64, on_trial=seen.append)
    assert tuple(seen) == result.trials


# --------------------------------------------------------------------------- invariants


@settings(max_examples=150, deadline=None)
@given(answer=st.integers(0, 5_000), start=st.integers(1, 10_000))
def test_any_monotone_probe_gives_the_exact_answer_unbounded(answer, start):
    result = largest_fitting(lambda b: b <= answer, start=start)
    verdict = {t.batch_size: t.fits for t in result.trials}
    assert result.batch_size == answer
    assert verdict[answer + 1] is False
    assert answer == 0 or verdict[answer] is True
    assert len(result.trials) <= unbounded_max_trials(answer) == result.max_trials


@settings(max_examples=150, deadline=None)
@given(answer=st.integers(0, 100_000), error=st.floats(-0.9, 10.0), offset=st.integers(-50, 50))
def test_a_wrong_guess_still_finds_the_exact_answer_within_the_bound(answer, error, offset):
    # the guess is off by a factor (a wrong slope) and a constant (a wrong base)
    result = largest_fitting(
        lambda b: b <= answer, guess=lambda trials: (answer + 0.5) * (1 + error) + offset
    )
    assert result.batch_size == answer
    assert len(result.trials) <= unbounded_max_trials(answer)


@settings(max_examples=150, deadline=None)
@given(
    low=st.integers(1, 50),
    span=st.integers(0, 2_000),
    threshold=st.integers(0, 2_100),
    guess=st.floats(-10, 3_000),
)
def test_any_monotone_probe_gives_the_exact_answer_bounded(low, span, threshold, guess):
    high = low + span
    result = largest_fitting(lambda b: b <= threshold, low=low, high=high, guess=lambda trials: guess)
    assert result.batch_size == max(min(threshold, high), low - 1)
    assert len(result.trials) <= max_trials(low, high) == math.ceil(math.log2(high - low + 1)) + 3


@settings(max_examples=200, deadline=None)
@given(data=st.data(), low=st.integers(1, 20), span=st.one_of(st.none(), st.integers(0, 600)))
def test_any_probe_and_any_guess_respect_the_bound_and_bracket_the_answer(data, low, span):
    # verdicts and guesses are arbitrary (not monotone): the bound and the bracket still hold
    high = None if span is None else low + span
    cap = data.draw(st.one_of(st.none(), st.integers(low, 10**6)), label="cap") if high is None else None

    def probe(b: int) -> bool:
        return data.draw(st.booleans(), label=f"fits({b})")

    def guess(trials) -> float | None:
        return data.draw(
            st.one_of(st.none(), st.just(math.nan), st.just(math.inf), st.floats(-5, 10**7)), label="guess"
        )

    result = largest_fitting(probe, low=low, high=high, cap=cap, guess=guess)
    bound = max_trials(low, high) if high is not None else unbounded_max_trials(result.batch_size)
    assert len(result.trials) <= bound == result.max_trials
    verdict = {t.batch_size: t.fits for t in result.trials}
    top = high if high is not None else (cap if cap is not None else NO_CAP)
    assert result.batch_size == low - 1 or verdict[result.batch_size]
    assert result.batch_size == top or verdict[result.batch_size + 1] is False


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"low": 0}, id="low-zero"),
        pytest.param({"low": 5, "high": 4}, id="high-below-low"),
        pytest.param({"low": True}, id="low-bool"),
        pytest.param({"high": 4.5}, id="high-float"),
        pytest.param({"high": 8, "cap": 8}, id="high-and-cap"),
        pytest.param({"low": 4, "cap": 3}, id="cap-below-low"),
        pytest.param({"low": 4, "start": 3}, id="start-below-low"),
    ],
)
def test_search_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        largest_fitting(lambda n: True, **kwargs)
