"""The split of a packed micro-batch over a sequence-parallel group, and the refusals of what Ulysses cannot split."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.errors import BatchError, InvalidArgument
from batchfit.logprobs import IGNORE_INDEX
from batchfit.models.ulysses import check_ulysses
from batchfit.parallel import gather_packed, sequence_shard, split_packed
from batchfit.parallel.sequence_split import IGNORE_INDEX as SPLIT_IGNORE


def _row(lengths: list[int]) -> dict:
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "input_ids": torch.arange(1, total + 1)[None],
        "position_ids": positions,
        "labels": torch.arange(100, 100 + total)[None],
        "loss_mask": torch.ones(1, total),
        "cu_seq_lens": cu,
        "max_length": max(lengths),
        "uids": ["a"] * len(lengths),
    }


def test_ignore_index_is_the_head_s():
    assert SPLIT_IGNORE == IGNORE_INDEX


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), size=st.integers(1, 8))
def test_every_rank_s_columns_put_together_are_the_padded_row(lengths, size):
    row = _row(lengths)
    total = sum(lengths)
    parts = [split_packed(row, sequence_shard(total, size, r)) for r in range(size)]
    shard = sequence_shard(total, size, 0)
    assert shard.padded % size == 0 and 0 <= shard.pad < size and shard.padded - shard.pad == total
    for key in ("input_ids", "position_ids", "labels", "loss_mask"):
        whole = torch.cat([p[key] for p in parts], dim=1)
        assert {p[key].shape[1] for p in parts} == {shard.local}
        assert torch.equal(whole[:, :total], row[key]), key  # every field cut at the same columns
    whole = {key: torch.cat([p[key] for p in parts], dim=1)[0, total:] for key in ("input_ids", "position_ids", "labels", "loss_mask")}
    # the padding is a sequence of its own: positions from 0, no label, no loss
    assert whole["position_ids"].tolist() == list(range(shard.pad))
    assert set(whole["labels"].tolist()) <= {IGNORE_INDEX} and not whole["loss_mask"].any()
    for p in parts:  # the row's boundaries stay whole, with the padding's sequence
        expected = [*row["cu_seq_lens"].tolist(), *([shard.padded] if shard.pad else [])]
        assert p["cu_seq_lens"].tolist() == expected and p["uids"] is row["uids"]
        assert p["max_length"] == max(max(lengths), shard.pad)


def test_gather_without_a_group_drops_the_padding():
    shard = sequence_shard(5, 1, 0)
    values = torch.arange(5.0)[None]
    assert torch.equal(gather_packed(values, shard, None), values)
    with pytest.raises(BatchError, match=r"this rank's 5 columns along dim 1 from a group of 1, but got shape \(1, 4\)"):
        gather_packed(values[:, :4], shard, None)


@pytest.mark.parametrize(
    "fields, match",
    [
        pytest.param({"input_ids": torch.ones(2, 4)}, r"input_ids must be \[1, T\], but got \(2, 4\)", id="rows"),
        pytest.param(
            {"input_ids": torch.ones(1, 4), "attention_mask": torch.ones(1, 4)}, r"but the micro-batch has attention_mask", id="mask"
        ),
    ],
)
def test_split_refuses_what_is_not_one_packed_row(fields, match):
    with pytest.raises(BatchError, match=match):
        split_packed(fields, sequence_shard(4, 2, 0))


def _config(**overrides):
    # the attributes check_ulysses reads, as a transformers config has them (no transformers import: sub-second)
    base = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, layer_types=None, sliding_window=None)
    return types.SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(
    "overrides, sp, match",
    [
        pytest.param({"num_attention_heads": 14, "num_key_value_heads": 2}, 4,
                     r"num_attention_heads=14 is not divisible by 4", id="q-heads"),
        pytest.param({"num_attention_heads": 12, "num_key_value_heads": 3}, 4,
                     r"num_key_value_heads=3 is neither divisible by 4 nor divides it", id="kv-heads"),
        pytest.param({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, 2,
                     r"cannot split layer 1 of the model: layer_types\[1\]='sliding_attention'", id="sliding-layer"),
        pytest.param({"layer_types": ["linear_attention", "full_attention"]}, 2,
                     r"cannot split layer 0 of the model: layer_types\[0\]='linear_attention'", id="linear-layer"),
        pytest.param({"sliding_window": 4096}, 2, r"sliding_window=4096 on every layer", id="sliding-everywhere"),
    ],
)
def test_attention_that_cannot_be_split_is_refused_in_one_line(overrides, sp, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        check_ulysses(_config(**overrides), sp)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_kv_heads_fewer_than_sp_are_repeated_not_refused(sp):
    check_ulysses(_config(), sp)  # 2 kv heads: divisible by 2, and divide 4 (verl repeats them)
