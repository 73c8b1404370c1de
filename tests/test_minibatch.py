"""Prompt-aligned mini-batches and data-parallel padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchError, InvalidArgument
from batchfit.batches.minibatch import (
    PAD,
    mini_batch_boundaries,
    pad_for_data_parallel,
    prompt_boundaries,
    slice_batch,
    split_for_data_parallel,
)


def uids_from_counts(counts):
    return [p for p, c in enumerate(counts) for _ in range(c)]


def test_prompt_boundaries_of_empty_input_is_empty():
    assert prompt_boundaries([]) == []
    assert mini_batch_boundaries([], 4) == []


def test_prompt_boundaries_accept_tensors_and_arrays():
    expected = [(0, 2), (2, 3)]
    assert prompt_boundaries(torch.tensor([7, 7, 3])) == expected
    assert prompt_boundaries(np.array([7, 7, 3])) == expected


def test_reappearing_uid_names_uid_and_index():
    with pytest.raises(BatchError, match=r"uid='a' reappears at index 3 after its run ended at index 2"):
        prompt_boundaries(["a", "a", "b", "a"])


def test_step_wise_mini_batches_span_whole_prompts():
    # prompts with 1..5 sequences (turns); 2 prompts per mini-batch
    counts = [3, 1, 5, 2, 4, 1]
    bounds = mini_batch_boundaries(uids_from_counts(counts), 2)
    assert bounds == [(0, 4), (4, 11), (11, 16)]  # 3+1, 5+2, 4+1


def test_partial_last_mini_batch_needs_allow_partial():
    uids = uids_from_counts([2, 2, 2])
    with pytest.raises(
        BatchError, match=r"3 prompts do not split into mini-batches of prompts_per_mini_batch=2"
    ):
        mini_batch_boundaries(uids, 2)
    assert mini_batch_boundaries(uids, 2, allow_partial=True) == [(0, 4), (4, 6)]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_bad_prompts_per_mini_batch(bad):
    with pytest.raises(InvalidArgument, match="prompts_per_mini_batch"):
        mini_batch_boundaries([0, 1], bad)


@settings(max_examples=100, deadline=None)
@given(prompts=st.integers(1, 40), n=st.integers(1, 6), k=st.integers(1, 10))
def test_uniform_samples_equal_fixed_size_slicing(prompts, n, k):
    prompts = prompts - prompts % k or k
    uids = uids_from_counts([n] * prompts)
    fixed = [(s, s + k * n) for s in range(0, prompts * n, k * n)]
    assert mini_batch_boundaries(uids, k) == fixed


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(1, 5), min_size=1, max_size=60), k=st.integers(1, 8))
def test_mini_batch_count_does_not_depend_on_turns(counts, k):
    counts = (counts * k)[: max(1, len(counts) // k) * k]  # a whole number of mini-batches
    bounds = mini_batch_boundaries(uids_from_counts(counts), k)
    # optimizer steps = prompts / k, whatever the turns per prompt
    assert len(bounds) == len(counts) // k
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(counts)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


def make_batch(size, width=6):
    lengths = [(i % width) + 1 for i in range(size)]
    return {
        "input_ids": torch.arange(size * width).reshape(size, width),
        "attention_mask": torch.tensor([[1] * n + [0] * (width - n) for n in lengths]),
        "loss_mask": torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths]),
        "rewards": np.arange(size, dtype=np.float32),
        "uid": [f"p{i}" for i in range(size)],
        "global_step": 7,  # metadata
    }


@pytest.mark.parametrize("dp", range(1, 9))
def test_padding_makes_every_size_a_multiple_of_dp(dp):
    for size in range(1, 3 * dp + 1):
        padded, n_pad = pad_for_data_parallel(make_batch(size), dp)
        total = size + n_pad
        assert total % dp == 0 and 0 <= n_pad < dp  # the fewest rows
        assert total >= dp or size == 0  # also when the mini-batch is smaller than dp
        for key in ("input_ids", "attention_mask", "loss_mask", "rewards", "uid"):
            assert len(padded[key]) == total
        assert padded["loss_mask"][size:].sum() == 0  # pad rows carry no loss
        assert (padded["attention_mask"][size:].sum(dim=1) == 1).all()  # one valid token each
        assert padded["input_ids"][size:].sum() == 0
        assert all(u is PAD for u in padded["uid"][size:])
        assert torch.equal(padded["input_ids"][:size], make_batch(size)["input_ids"])  # real rows untouched
        shards = split_for_data_parallel(padded, dp)
        assert len(shards) == dp and len({len(s["uid"]) for s in shards}) == 1


def test_left_padded_batch_gets_pad_token_on_the_right():
    batch = {"attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]), "loss_mask": torch.ones(2, 3)}
    padded, n_pad = pad_for_data_parallel(batch, 4)
    assert n_pad == 2
    assert padded["attention_mask"][2:].tolist() == [[0, 0, 1], [0, 0, 1]]


def test_pad_values_override_defaults():
    batch = {"input_ids": torch.ones(3, 2, dtype=torch.long), "uid": ["a", "b", "c"]}
    padded, _ = pad_for_data_parallel(batch, 2, pad_values={"input_ids": 99, "uid": "pad-uid"})
    assert padded["input_ids"][3].tolist() == [99, 99]
    assert padded["uid"][3] == "pad-uid"


def test_fields_of_different_lengths_are_rejected():
    with pytest.raises(BatchError, match=r"same number of samples, but got a=3, b=2"):
        pad_for_data_parallel({"a": torch.zeros(3), "b": [1, 2]}, 2)


def test_split_requires_a_multiple():
    with pytest.raises(
        BatchError, match=r"batch of 5 samples does not split over dp_size=2.*adds 1 pad rows"
    ):
        split_for_data_parallel(make_batch(5), 2)


def test_slices_take_only_their_rows_and_drop_metadata():
    batch = make_batch(6)
    part = slice_batch(batch, 2, 4)
    assert part["uid"] == ["p2", "p3"]
    assert part["rewards"].tolist() == [2.0, 3.0]
    assert torch.equal(part["input_ids"], batch["input_ids"][2:4])
    assert "global_step" not in part  # metadata of the whole batch does not leak into a slice


def test_split_shards_tile_the_batch():
    batch = make_batch(8)
    shards = split_for_data_parallel(batch, 4)
    assert [s["uid"] for s in shards] == [["p0", "p1"], ["p2", "p3"], ["p4", "p5"], ["p6", "p7"]]


@pytest.mark.parametrize(
    ("uids", "match"),
    [
        pytest.param(torch.zeros(2, 3), r"uids must be one-dimensional .* shape \(2, 3\)", id="2-d-tensor"),
        pytest.param(None, r"uids must be a sequence of prompt ids .* uids=None", id="none"),
        pytest.param([[1], [2]], r"uids must be hashable prompt ids .* uids\[0\]=\[1\]", id="unhashable"),
        pytest.param([float("nan")], r"uids must not be NaN", id="nan"),
        pytest.param([torch.tensor(float("nan"))], r"uids must not be NaN", id="nan-tensor-element"),
        pytest.param([np.array([1, 2])], r"uids\[0\] is an array of shape \(2,\)", id="array-element"),
    ],
)
def test_bad_uids_are_named(uids, match):
    with pytest.raises(InvalidArgument, match=match):
        mini_batch_boundaries(uids, prompts_per_mini_batch=1)


def test_a_bare_tensor_is_not_a_batch():
    with pytest.raises(BatchError, match=r"batch must be a mapping of per-sample fields .* got a Tensor"):
        pad_for_data_parallel(torch.zeros(3, 4), 2)


def test_tensor_element_uids_are_compared_by_value():
    # Tensors hash by identity: a reappearing prompt must still be caught, equal ones merged.
    t = torch.tensor([7, 7, 8, 7])
    assert prompt_boundaries([t[0], t[1], t[2]]) == [(0, 2), (2, 3)]
    assert prompt_boundaries([np.int64(7), 7, torch.tensor(7)]) == [(0, 3)]
    with pytest.raises(BatchError, match=r"uid=7 reappears at index 3"):
        prompt_boundaries(list(t))
