"""Per-sample batches: sizes, row selection and concatenation keep fields together."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchfit import BatchError
from batchfit.batches.batch import batch_size, concat_batches, slice_batch, take_rows


def batch():
    return {"x": torch.arange(10).reshape(5, 2), "y": np.arange(5), "uid": list("abcde"), "meta": "m"}


def test_batch_size_ignores_metadata():
    assert batch_size(batch()) == 5


def test_batch_without_per_sample_fields_is_rejected():
    with pytest.raises(BatchError, match=r"no per-sample field"):
        batch_size({"meta": 1})


def test_take_rows_keeps_order_and_types():
    rows = take_rows(batch(), [4, 0])
    assert rows["uid"] == ["e", "a"]
    assert rows["y"].tolist() == [4, 0]
    assert rows["x"].tolist() == [[8, 9], [0, 1]]
    assert "meta" not in rows


def test_take_rows_out_of_range():
    with pytest.raises(BatchError, match=r"indices must be in \[0, 5\), but got \[5\]"):
        take_rows(batch(), [0, 5])


def test_slice_bounds_are_checked():
    with pytest.raises(BatchError, match=r"0 <= start <= end <= 5"):
        slice_batch(batch(), 3, 6)


def test_concat_inverts_slicing():
    b = batch()
    parts = [slice_batch(b, 0, 2), slice_batch(b, 2, 5)]
    joined = concat_batches(parts)
    assert torch.equal(joined["x"], b["x"]) and joined["uid"] == b["uid"]
    assert joined["y"].tolist() == b["y"].tolist()
