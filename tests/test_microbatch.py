"""Running micro-batch plans: trimming, padding micro-batches, order restore, exact gradients, 2 ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from batchfit import BatchError, InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches, trim_padding
from batchfit.batches.minibatch import PAD
from batchfit.parallel.distributed import sync_micro_batch_count
from batchfit.plan.packing import plan_micro_batches
from microbatch_helpers import (
    ddp_worker,
    grads,
    make_batch,
    relative_error,
    tiny_model,
    weighted_loss,
    whole_batch_grads,
)
from multirank import context, scaled

# ---------------------------------------------------------------- trimming


def test_trim_right_padding_keeps_columns_up_to_the_longest_member():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
        "uid": ["a", "b"],
    }
    out = trim_padding(batch)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert out["attention_mask"].shape == (2, 3)
    assert out["uid"] == ["a", "b"]


def test_trim_left_padding_keeps_the_right_columns():
    batch = {
        "input_ids": np.array([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]]),
        "attention_mask": np.array([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]),
        "rewards": np.array([1.0, 2.0]),  # 1-D: not a column field
        "hidden": torch.zeros(2, 4, 3),  # second dimension is not the mask width: untouched
    }
    out = trim_padding(batch)
    assert out["input_ids"].tolist() == [[0, 5, 6], [7, 8, 9]]
    assert out["rewards"].tolist() == [1.0, 2.0]
    assert out["hidden"].shape == (2, 4, 3)


def test_trim_without_attention_mask_or_valid_token_changes_nothing():
    ids = torch.ones(2, 4)
    assert trim_padding({"input_ids": ids})["input_ids"] is ids
    mask = torch.zeros(2, 4)
    assert trim_padding({"attention_mask": mask})["attention_mask"] is mask


# ---------------------------------------------------------------- iteration


def test_every_rank_steps_the_same_number_of_times_with_padding_micro_batches():
    batch = make_batch(num_sequences=3)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 16, dp_size=4, cost="packed")
    per_rank = [list(iter_micro_batches(batch, plan, rank)) for rank in range(4)]
    assert {len(mbs) for mbs in per_rank} == {plan.num_micro_batches}
    pads = [mb for mbs in per_rank for mb in mbs if mb.is_padding]
    assert len(pads) == plan.num_padding_micro_batches >= 1  # 3 sequences, 4 ranks
    for mb in pads:
        # NOTE [ Pad rows cost one token ]: one row, one valid token, no loss
        assert mb.batch["attention_mask"].shape == (1, 1)
        assert mb.batch["loss_mask"].sum() == 0 and mb.batch["weights"].sum() == 0
        assert mb.cost == 1


def test_micro_batches_hold_the_planned_rows_trimmed_to_their_longest():
    batch = make_batch(num_sequences=8)
    lengths = batch["attention_mask"].sum(-1)
    plan = plan_micro_batches(lengths, 24, cost="padded")
    for mb in iter_micro_batches(batch, plan):
        longest = int(lengths[list(mb.indices)].max())
        assert mb.batch["input_ids"].shape == (len(mb.indices), longest)
        assert mb.batch["input_ids"].shape[0] * longest <= 24  # the hard cap, on real tensors
        assert torch.equal(mb.batch["input_ids"], batch["input_ids"][list(mb.indices), :longest])


def test_list_fields_follow_their_rows_and_pad_rows_get_the_pad_marker():
    batch = {"attention_mask": torch.ones(3, 2, dtype=torch.long), "uid": ["a", "b", "c"]}
    plan = plan_micro_batches([2, 2, 2], 4, dp_size=2)
    seen = []
    for rank in range(2):
        for mb in iter_micro_batches(batch, plan, rank):
            seen += mb.batch["uid"]
            assert mb.batch["uid"] == ([PAD] if mb.is_padding else ["abc"[i] for i in mb.indices])
    assert sorted(u for u in seen if u is not PAD) == ["a", "b", "c"]


def test_outputs_of_micro_batches_restore_to_input_order():
    batch = make_batch(num_sequences=8)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 20, dp_size=2, cost="packed")
    outputs = []  # one output per real sequence: its token sum, rank-major plan order
    for rank in range(2):
        for mb in iter_micro_batches(batch, plan, rank):
            if not mb.is_padding:
                outputs.append(mb.batch["input_ids"].sum(-1))
    restored = plan.restore_order(torch.cat(outputs))
    assert torch.equal(restored, batch["input_ids"].sum(-1))


@pytest.mark.parametrize(
    ("rows", "rank", "error", "match"),
    [
        pytest.param(5, 0, BatchError, r"batch has 5 rows but the plan was made for 4 sequences", id="rows"),
        pytest.param(
            4, 2, InvalidArgument, r"rank must be an integer in \[0, 2\), but got rank=2", id="rank"
        ),
        pytest.param(4, True, InvalidArgument, r"rank=True", id="rank-bool"),
    ],
)
def test_iter_micro_batches_rejects_mismatched_batch_or_rank(rows, rank, error, match):
    plan = plan_micro_batches([3, 3, 3, 3], 6, dp_size=2)
    batch = {"attention_mask": torch.ones(rows, 3)}
    with pytest.raises(error, match=match):
        next(iter_micro_batches(batch, plan, rank))


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        pytest.param([3, 3, 9, 3], r"lengths\[2\]=9 but row 2 .* 3 valid tokens .* \(the tensors are 3 wide\)", id="wider"),
        pytest.param([3, 2, 3, 2], r"lengths\[1\]=2 but row 1 .* 3 valid tokens .* \(2 rows differ\)", id="other-batch"),
    ],
)
def test_a_plan_for_other_lengths_is_refused(lengths, match):
    plan = plan_micro_batches(lengths, 9)
    batch = {"attention_mask": torch.ones(4, 3), "input_ids": torch.ones(4, 3, dtype=torch.long)}
    for layout in ("padded", "packed"):
        with pytest.raises(BatchError, match=match):
            next(iter_micro_batches(batch, plan, layout=layout))


def test_sync_micro_batch_count_is_a_no_op_without_a_process_group():
    plan = plan_micro_batches([5, 5, 5], 10)
    assert sync_micro_batch_count(plan) is plan


# ---------------------------------------------------------------- exact gradients

# The model runs in float64, but transformers computes the rotary cos/sin in float32, whose
# vectorised kernel rounds the last ulp differently for different widths (trimmed or not):
# ~1e-7 relative. Averaging micro-batch means instead is off by ~0.8 (the control test).
TOLERANCE = 1e-6  # on ‖got − expected‖ / ‖expected‖, per parameter


@pytest.mark.parametrize("cost", ["padded", "packed"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_micro_batched_gradient_equals_whole_mini_batch_gradient(cost, reduction):
    batch = make_batch(num_sequences=8, reduction=reduction)
    expected = whole_batch_grads(batch)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 24, cost=cost)
    assert plan.num_micro_batches >= 3  # several micro-batches of different sizes
    model = tiny_model()
    for mb in iter_micro_batches(batch, plan):
        weighted_loss(model, mb.batch).backward()
    assert relative_error(grads(model), expected) < TOLERANCE


def test_per_micro_batch_means_would_bias_the_gradient():
    # the control: averaging micro-batch token means (SkyRL #1060) differs from the mini-batch mean
    batch = make_batch(num_sequences=8)
    expected = whole_batch_grads(batch)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 24, cost="packed")
    model = tiny_model()
    for mb in iter_micro_batches(batch, plan):
        local = dict(mb.batch, weights=mb.batch["loss_mask"] / mb.batch["loss_mask"].sum())
        (weighted_loss(model, local) / plan.num_micro_batches).backward()
    assert relative_error(grads(model), expected) > 1e-3


# ---------------------------------------------------------------- two ranks (gloo, DDP)


@pytest.mark.timeout(180)
def test_two_rank_ddp_gradient_equals_whole_mini_batch_gradient(tmp_path):
    budget, costs = 24, ("padded", "packed")
    context()  # the ranks fork from the server that has imported torch (tests/multirank.py)
    ctx = mp.start_processes(
        ddp_worker,
        args=(2, str(tmp_path / "init"), str(tmp_path), costs, budget),
        nprocs=2,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + scaled(150)
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                pytest.fail(
                    "2-rank gloo run did not finish in 150 s (a rank is probably stuck in a collective)"
                )
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    batch = make_batch()
    expected = whole_batch_grads(batch)
    for cost in costs:
        plan = plan_micro_batches(batch["attention_mask"].sum(-1), budget, dp_size=2, cost=cost)
        assert plan.num_micro_batches >= 2
        for result in results:
            assert result[cost]["steps"] == plan.num_micro_batches
            assert relative_error(result[cost]["grads"], expected) < TOLERANCE
    # rank 0 planned 2 micro-batches, rank 1 planned 4: both run 4 after the MAX all-reduce
    assert [r["synced"] for r in results] == [4, 4]
    assert [r["padding"] for r in results] == [2, 0]
