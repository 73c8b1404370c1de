"""Exact loss weights: any split into micro-batches gives the whole mini-batch's gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchError, InvalidArgument
from batchfit.batches.minibatch import mini_batch_boundaries, prompt_boundaries
from batchfit.batches.weights import REDUCTIONS, loss_weights


def reference(loss, mask, reduction, prompts, max_seq_len):
    """The reduction written naively, per mini-batch, in float64."""
    if reduction == "token_mean":
        return (loss * mask).sum() / mask.sum()
    if reduction == "sequence_mean":
        keep = mask.sum(1) > 0
        return ((loss * mask).sum(1)[keep] / mask.sum(1)[keep]).mean()
    if reduction == "seq_mean_token_sum_norm":
        keep = mask.sum(1) > 0
        return ((loss * mask).sum(1)[keep] / max_seq_len).mean()
    means = [(loss[s:e] * mask[s:e]).sum() / mask[s:e].sum() for s, e in prompts if mask[s:e].sum() > 0]
    return torch.stack(means).mean()


def test_token_mean_literal_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # 3 loss tokens in the mini-batch -> 1/3 each
    assert torch.allclose(
        loss_weights(mask, reduction="token_mean"), torch.tensor([[1, 1, 0], [1, 0, 0]]) / 3
    )


def test_sequence_mean_literal_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # 2 sequences with tokens (the empty row is a pad row and is not counted): 1/(2·2), 1/(2·1)
    expected = torch.tensor([[0.25, 0.25, 0], [0.5, 0, 0], [0, 0, 0]])
    assert torch.allclose(loss_weights(mask, reduction="sequence_mean"), expected)


def test_seq_mean_token_sum_norm_uses_max_seq_len():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # 2 sequences, normaliser 10: 1 / (2 · 10)
    assert torch.allclose(loss_weights(mask, reduction="seq_mean_token_sum_norm", max_seq_len=10), mask / 20)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    counts=st.lists(st.integers(1, 4), min_size=1, max_size=12),
    width=st.integers(1, 8),
    k=st.integers(1, 4),
    reduction=st.sampled_from(REDUCTIONS),
)
def test_any_micro_batch_split_gives_the_mini_batch_gradient(data, counts, width, k, reduction):
    uids = [p for p, c in enumerate(counts) for _ in range(c)]
    n = len(uids)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    mask = (torch.rand(n, width, generator=gen) < 0.7).double()
    logits = torch.randn(n, width, generator=gen, dtype=torch.float64)
    mbs = mini_batch_boundaries(uids, k, allow_partial=True)
    prompts = prompt_boundaries(uids)
    weights = loss_weights(
        mask, reduction=reduction, mini_batch_boundaries=mbs, prompt_boundaries=prompts, max_seq_len=width
    )
    for start, end in mbs:
        if mask[start:end].sum() == 0:
            assert weights[start:end].abs().sum() == 0  # nothing to average: contributes nothing
            continue
        # reference: the reduction over the whole mini-batch at once
        x_ref = logits.clone().requires_grad_(True)
        local_prompts = [(s - start, e - start) for s, e in prompts if start <= s < end]
        ref = reference(x_ref[start:end] ** 2, mask[start:end], reduction, local_prompts, width)
        ref.backward()
        # micro-batched: random cut points inside the mini-batch, weighted losses summed
        cuts = sorted(set([*data.draw(st.lists(st.integers(start + 1, end), max_size=4)), end]))
        x = logits.clone().requires_grad_(True)
        total = 0.0
        lo = start
        for hi in cuts:
            micro = (x[lo:hi] ** 2 * weights[lo:hi]).sum()
            micro.backward()
            total += micro.item()
            lo = hi
        assert abs(total - ref.item()) < 1e-6
        assert torch.allclose(x.grad[start:end], x_ref.grad[start:end], atol=1e-6, rtol=0)


def test_weights_keep_device_and_dtype():
    w = loss_weights(torch.ones(2, 3, dtype=torch.bool), reduction="token_mean", dtype=torch.float64)
    assert w.dtype == torch.float64 and w.shape == (2, 3)


def test_pad_rows_do_not_change_weights_of_real_rows():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    padded = torch.cat([mask, torch.zeros(2, 2)])
    for reduction in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"):
        assert torch.equal(
            loss_weights(padded, reduction=reduction)[:2], loss_weights(mask, reduction=reduction)
        )


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"reduction": "mean"}, InvalidArgument, r"reduction must be one of .* but got reduction='mean'"),
        ({"reduction": "token_mena"}, InvalidArgument, r"did you mean 'token_mean'"),
        ({"reduction": "prompt_mean"}, InvalidArgument, r"needs prompt_boundaries"),
        (
            {"reduction": "token_mean", "mini_batch_boundaries": [(0, 1)]},
            BatchError,
            r"must cover all 3 rows",
        ),
        ({"reduction": "token_mean", "mini_batch_boundaries": [(0, 2), (1, 3)]}, BatchError, r"tile"),
        (
            {
                "reduction": "prompt_mean",
                "mini_batch_boundaries": [(0, 2), (2, 3)],
                "prompt_boundaries": [(0, 1), (1, 3)],
            },
            BatchError,
            r"prompt 1 \(rows 1..2\) straddles two mini-batches",
        ),
        ({"reduction": "seq_mean_token_sum_norm", "max_seq_len": 0}, InvalidArgument, r"max_seq_len"),
    ],
    ids=["unknown", "typo", "prompt-mean-needs-prompts", "short-cover", "overlap", "straddle", "bad-max-len"],
)
def test_invalid_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        loss_weights(torch.ones(3, 2), **kwargs)


def test_mask_must_be_2d():
    with pytest.raises(InvalidArgument, match=r"loss_mask must be a 2-D tensor .* but got \(3,\)"):
        loss_weights(torch.ones(3), reduction="token_mean")


def test_half_precision_masks_give_exact_float32_weights():
    # float16 counts overflow at 65,536 tokens (inf -> all-zero weights); bf16 rounds counts
    many = torch.ones(64, 1100, dtype=torch.float16)  # 70,400 loss tokens
    weights = loss_weights(many, reduction="token_mean")
    assert weights.dtype == torch.float32 and float(weights.double().sum()) == pytest.approx(1.0, abs=1e-6)
    bf16 = loss_weights(torch.ones(64, 1100, dtype=torch.bfloat16), reduction="token_mean")
    assert float(bf16.double().sum()) == pytest.approx(1.0, abs=1e-6)  # was 1.028
    assert loss_weights(many, reduction="token_mean", dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_a_non_floating_dtype_is_a_clear_error(dtype):
    with pytest.raises(InvalidArgument, match=r"dtype must be a floating torch.dtype"):
        loss_weights(torch.ones(2, 3), reduction="token_mean", dtype=dtype)


def test_empty_mini_batch_boundaries_are_an_error_not_one_mini_batch():
    with pytest.raises(BatchError, match=r"mini_batch_boundaries must tile the 2 rows, but got \[\]"):
        loss_weights(torch.ones(2, 3), reduction="token_mean", mini_batch_boundaries=[])
