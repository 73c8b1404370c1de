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
