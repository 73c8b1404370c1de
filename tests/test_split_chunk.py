"""A split pass holds the whole sequence's KV: its chunk is measured to fit, and the plan carries it to the passes."""

from __future__ import annotations

import pytest
import torch

from batchfit.budget import causal_lm_step, find_token_budget, split_chunk_tokens, split_peak
from batchfit.errors import BudgetError, InvalidArgument
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.plan import plan_micro_batches
from batchfit.train import micro_batch_backward

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def probe():
    backend = get_backend("cpu", memory_limit="48MiB", reserve_bytes=0)
    model = build_causal_lm("tiny", backend=backend, dtype="fp32", vocab_size=2048)
    step = causal_lm_step(model, backend=backend, logprobs="fused", cost="padded")
    return step, find_token_budget(step, max_seq_len=256, cost="padded", seq_lens=[256])


@pytest.mark.slow
def test_a_chunk_of_the_full_budget_runs_over_it_and_the_measured_chunk_fits(probe):
    step, budget = probe
    longest = 2 * budget.tokens
    assert split_peak(step, longest, budget.tokens) > budget.limit_bytes  # the sequence's KV beside the chunk
    chunk = split_chunk_tokens(step, longest, budget.limit_bytes, most=budget.tokens)
    assert 2 <= chunk < budget.tokens
    assert split_peak(step, longest, chunk) <= budget.limit_bytes < split_peak(step, longest, chunk + 1)


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_a_sequence_whose_kv_alone_is_over_the_limit_is_refused_in_one_line(probe):
    step, budget = probe
    with pytest.raises(BudgetError, match=r"^a sequence of 64 tokens cannot run in chunks within 1,048,576 bytes: even passes of 2") as info:
        split_chunk_tokens(step, 64, 2**20, most=4)  # the model's state alone is over 1 MiB
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidArgument, match="most must be at least 2"):
        split_chunk_tokens(step, 100, budget.limit_bytes, most=1)


def test_the_plan_carries_the_split_chunk_to_the_passes():
    lengths = [40, 7, 9]
    plan = plan_micro_batches(lengths, token_budget=16, cost="packed", oversize="split", split_tokens=8)
    assert plan.split_tokens == 8 and plan.split == ((0, 6),)  # passes of 8 tokens, one label each: ⌈39 / 7⌉
    assert plan_micro_batches(lengths, token_budget=16, cost="packed", oversize="split").split == ((0, 3),)
    with pytest.raises(InvalidArgument, match=r"split_tokens=8 is read only when sequences are split"):
        plan_micro_batches(lengths, token_budget=16, cost="packed", split_tokens=8)
    with pytest.raises(InvalidArgument, match=r"split_tokens must be"):
        plan_micro_batches(lengths, token_budget=16, cost="packed", oversize="split", split_tokens=17)

    from batchfit.batches.microbatch import iter_micro_batches
    from microbatch_helpers import tiny_lm
    from rollout_helpers import rollouts

    model = tiny_lm("llama")
    batch = rollouts(model, [3, 10, 2], [2, 30, 5], seed=3)  # row 1: 40 tokens
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), token_budget=16, cost="packed", oversize="split", split_tokens=8)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    (chunks,) = [n for _, n in plan.split]
    for mb in iter_micro_batches(batch, plan, 0):
        before = len(calls)
        micro_batch_backward(model, mb, plan=plan)
        ran = len(calls) - before
        # a split sequence: a fill pass per chunk but the last, then a pass per chunk; a short one runs once
        assert ran == (2 * chunks - 1 if 1 in mb.indices else 1)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
