"""``batchfit.budget.bounds``: what measured probes prove about a candidate's peak (NOTE [ The shape of a step's peak ])."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from batchfit.budget.bounds import (
    Shape,
    contains,
    peak_lower_bound,
    peak_upper_bound,
    rows_to_cover,
    state_bytes,
)
from batchfit.budget.probe import Probe


def probe(rows: int, seq_len: int, peak: int, tokens: int | None = None, **kwargs) -> Probe:
    return Probe(rows, seq_len, peak, fits=True, tokens=tokens, **kwargs)


def test_a_shape_contains_the_shapes_it_holds_longest_to_longest():
    assert contains(Shape(512, 2, 0), Shape(512, 1, 511))  # 512 + 511 inside 512 + 512
    assert not contains(Shape(512, 1, 511), Shape(512, 2, 0))
    assert contains(Shape(512, 2, 0), Shape(256, 2, 0))
    assert not contains(Shape(256, 3, 0), Shape(512, 1, 0))  # a longer sequence is not held by shorter ones
    assert contains(Shape(8, 3, 5), Shape(8, 3, 5)) and contains(Shape(8, 3, 5), Shape(8, 0, 0))


def test_rows_to_cover_cuts_the_candidate_out_of_longer_rows():
    assert rows_to_cover(Shape(256, 5, 100), 512) == 3  # 256+256 | 256+256 | 256+100
    assert rows_to_cover(Shape(256, 4, 100), 512) == 3  # two full rows, the 100 needs a third
    assert rows_to_cover(Shape(200, 4, 100), 512) == 2  # 200+200 leaves 112 in each row: the 100 fits
    assert rows_to_cover(Shape(512, 3, 0), 512) == 3 and rows_to_cover(Shape(512, 3, 7), 512) == 4
    assert rows_to_cover(Shape(1024, 1, 0), 512) is None


def test_the_lower_bound_never_comes_from_a_larger_probe():
    # issue 28: one forward probe of 60,928 tokens measured over the limit was put on every smaller candidate
    trials = [probe(1, 512, 84_840_356), probe(2, 512, 85_643_176), probe(119, 512, 839_781_748)]
    # 17 rows: the secant of 1 and 2 rows extended (convexity): 85,643,176 + 15 × 802,820 = 97,685,476
    assert peak_lower_bound(trials, 512, 17 * 512) == 97_685_476
    assert peak_lower_bound(trials, 512, 120 * 512) >= 839_781_748  # contains the measured 119 rows
    # the chord between 2 and 119 rows bounds 17 from above:
    # 85,643,176 + 754,138,572 × 15 / 117 = 85,643,176 + 96,684,432.3 -> 182,327,609 (rounded up)
    assert peak_upper_bound(trials, 512, 17 * 512) == 182_327_609


def test_the_upper_bound_scales_only_what_grows_past_the_state():
    state = {"parameters": 10_000, "optimizer_state": 20_000, "buffers": 0, "activations": 70_000}
    trials = [probe(1, 512, 100_000, breakdown=state)]
    assert state_bytes(trials) == 30_000
    # 2 rows: the state once, what one row adds twice: 30,000 + 2 × 70,000 = 170,000 (not 2 × 100,000)
    assert peak_upper_bound(trials, 512, 1024) == 170_000
    assert peak_upper_bound(trials, 512, 512) == 100_000  # measured
    assert peak_upper_bound(trials, 256, 512) == 100_000  # two halves of the measured row
    assert peak_upper_bound(trials, 1024, 1024) is None  # a longer sequence: nothing measured holds it
    assert peak_lower_bound(trials, 512, 1024) == 100_000  # contains the measured row; no secant yet


def test_predicted_and_aborted_probes():
    aborted = [probe(2, 512, 9_999, exceeded=True)]
    assert peak_lower_bound(aborted, 512, 1536) == 9_999  # an abort's peak is a lower bound of its own
    assert peak_upper_bound(aborted, 512, 512) is None  # but no measurement to bound anything by
    predicted = [probe(2, 512, 9_999, exceeded=True, predicted=True)]
    assert peak_lower_bound(predicted, 512, 1536) == 0  # never measured: proves nothing


@given(
    state=st.integers(0, 10**6),
    pieces=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**5)), min_size=1, max_size=5),
    measured=st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True),
    candidate=st.integers(1, 60),
)
def test_bounds_hold_for_any_step_of_that_shape(state, pieces, measured, candidate):
    # NOTE [ The shape of a step's peak ]: at each point of the step the state and c + a·rows (c, a >= 0)
    def peak(rows: int) -> int:
        return state + max(c + a * rows for c, a in pieces)

    breakdown = {"parameters": state}
    trials = [probe(b, 64, peak(b), breakdown=breakdown) for b in measured]
    true = peak(candidate)
    assert peak_lower_bound(trials, 64, candidate * 64) <= true
    high = peak_upper_bound(trials, 64, candidate * 64)
    assert high is None or high >= true
