"""The shared argument checks: one wording, bool rejected where an int is meant."""

from __future__ import annotations

import numpy as np
import pytest

from batchfit import InvalidArgument
from batchfit.validation import check_choice, check_int, check_number, check_positive_int


def test_numpy_integers_are_integers():
    assert check_positive_int("n", np.int64(3)) == 3


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: check_positive_int("n", True), r"n must be an integer, but got n=True \(bool\)"),
        (lambda: check_positive_int("n", 0), r"n must be an integer >= 1, but got n=0"),
        (lambda: check_int("n", "3"), r"n must be an integer, but got n='3'"),
        (lambda: check_number("f", 1.5, low=0, high=1), r"f must be in \[0, 1\], but got f=1.5"),
        (lambda: check_number("f", 0, low=0, low_open=True), r"f must be in \(0, inf\], but got f=0"),
        (lambda: check_number("f", 0.5, high=0, high_open=True), r"f must be in \[-inf, 0\), but got f=0.5"),
        (lambda: check_number("f", float("nan")), r"f must be a finite number"),
        (lambda: check_choice("cost", "paded", ["padded", "packed"]), r"did you mean 'padded'\?"),
    ],
    ids=["bool", "zero", "str", "above", "open-low-unbounded-high", "open-high-unbounded-low", "nan", "typo"],
)
def test_checks_name_argument_value_and_rule(call, pattern):
    with pytest.raises(InvalidArgument, match=pattern):
        call()


def test_every_top_level_name_resolves():
    import batchfit

    for name in batchfit.__all__:
        assert getattr(batchfit, name) is not None


def test_values_in_messages_are_cut_to_sixty_characters():
    from batchfit.validation import short_repr

    assert short_repr("x" * 10) == "'xxxxxxxxxx'"
    assert len(short_repr("x" * 10**6)) == 60 and short_repr("x" * 10**6).endswith("...")
    with pytest.raises(InvalidArgument) as info:
        check_int("n", "abc" * 10**5)
    assert len(str(info.value)) < 150


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        ("12", r"indices must be a list, tuple or 1-D integer tensor of ints, but got indices='12' \(str\)"),
        ([1, True], r"indices\[1\]=True \(bool\)"),
        ([1.0], r"indices\[0\]=1.0 \(float\)"),
        ([[1]], r"indices\[0\]=\[1\] \(list\)"),
        (np.array([[1, 2]]), r"shape \(1, 2\)"),
        (np.array([1.5]), r"dtype float64"),
        ([2**70], r"indices must hold integers in \[0, 9\]"),
    ],
    ids=["str", "bool", "float", "nested", "2-d", "float-array", "huge"],
)
def test_int_sequences_refuse_junk_by_position(value, pattern):
    from batchfit.validation import check_int_sequence

    with pytest.raises(InvalidArgument, match=pattern):
        check_int_sequence("indices", value, minimum=0, maximum=9)


def test_int_sequences_accept_ints_of_every_kind():
    import torch

    from batchfit.validation import check_int_sequence

    assert check_int_sequence("i", (np.int32(1), 2)) == [1, 2]
    assert check_int_sequence("i", torch.tensor([3, 4])) == [3, 4]
    assert check_int_sequence("i", np.zeros(0)) == []


@pytest.mark.parametrize(
    ("value", "pattern"),
    [
        (None, r"ranges must be a list of \(start, end\) row ranges"),
        ("ab", r"ranges must be a list of \(start, end\) row ranges"),
        ([(0, 1, 2)], r"ranges\[0\]=\(0, 1, 2\)"),
        ([(0.0, 1)], r"ranges\[0\]=\(0.0, 1\)"),
        ([(True, 1)], r"ranges\[0\]=\(True, 1\)"),
    ],
)
def test_ranges_are_integer_pairs(value, pattern):
    from batchfit.validation import check_ranges

    with pytest.raises(InvalidArgument, match=pattern):
        check_ranges("ranges", value)


def test_bools_counts_and_choices_refuse_lookalikes():
    from batchfit.validation import MAX_COUNT, check_bool, check_count

    assert check_bool("b", np.bool_(True)) is True
    with pytest.raises(InvalidArgument, match=r"b must be True or False, but got b=1 \(int\)"):
        check_bool("b", 1)
    with pytest.raises(InvalidArgument, match=r"must be an integer <= 4,611,686,018,427,387,904"):
        check_count("n", MAX_COUNT + 1)
    with pytest.raises(InvalidArgument, match=r"cost must be one of 'padded', 'packed', but got cost=array"):
        check_choice("cost", np.array(["padded", "packed"]), ["padded", "packed"])
