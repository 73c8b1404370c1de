"""The suite's two tiers (pyproject's ``slow`` marker): a parametrized matrix that keeps some cases in the first.

A matrix of several axes (backends × options × ways to abort) multiplies its cases; the first
tier keeps the cases named in ``first_tier`` -- chosen so that every value of every axis is
still run there -- and the second (``python -m pytest -m slow``) runs the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import pytest
from _pytest.mark.structures import ParameterSet


def _param(value: object) -> ParameterSet:
    if isinstance(value, ParameterSet):
        if value.id is None:
            raise ValueError(f"a matrix's pytest.param needs an id: {value!r}")
        return value
    if isinstance(value, str):
        return pytest.param(value, id=value)
    raise TypeError(f"a matrix's value is a str or a pytest.param with an id, got {value!r}")


def second_tier_except(first_tier: Iterable[str], *axes: Iterable[object]) -> list[ParameterSet]:
    """The product of ``axes`` as ``pytest.param`` s, each marked ``slow`` unless its id is in ``first_tier``.

    Each axis is a list of strings or of ``pytest.param`` s with ids; a case's values are its
    axes' values in order and its id their ids joined by ``-``, as stacked ``parametrize``
    decorators give (the decorator nearest the function first). A case keeps its params' marks.

    Raises:
        ValueError: an id in ``first_tier`` names no case of the product.
    """
    keep = set(first_tier)
    cases = []
    for combination in itertools.product(*[[_param(v) for v in axis] for axis in axes]):
        case_id = "-".join(p.id for p in combination)
        marks = [m for p in combination for m in p.marks]
        if case_id not in keep:
            marks.append(pytest.mark.slow)
        cases.append(pytest.param(*(v for p in combination for v in p.values), id=case_id, marks=marks))
    unknown = keep - {c.id for c in cases}
    if unknown:
        raise ValueError(f"first_tier names cases the matrix lacks: {sorted(unknown)}")
    return cases
