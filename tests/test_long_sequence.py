"""Over-long sequences train in chunks with the unsplit gradient, or are refused by name.

NOTE [ Over-long sequences run in chunks ] in batchfit.train.long_sequence: a sequence longer
than the chunk runs in passes of at most ``chunk_tokens`` tokens, and every parameter's
gradient equals ``micro_batch_loss(...).backward()`` of the unsplit sequence (tiny Llama and
Qwen2, fp32, 1e-5), padded and packed, with and without gradient checkpointing; a model whose
cache cannot hold the past exactly, or a sharded one, gets a one-line BudgetError naming the
sequence and the smallest budget that holds it.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchError, BudgetError, InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.models.attention import use_varlen_attention
from batchfit.models.build import enable_activation_checkpointing
from batchfit.plan.packing import plan_micro_batches, split_chunks
from batchfit.train import (
    accumulate,
    micro_batch_backward,
    micro_batch_loss,
    micro_batch_outputs,
    model_logprobs,
    policy_loss,
    split_loss_backward,
    split_outputs,
)
from microbatch_helpers import tiny_config, tiny_lm
from multirank import run_ranks
from rollout_helpers import rollouts
from sharded_helpers import data_parallel

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 8


def gradients(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_gradients(split: dict, whole: dict) -> None:
    assert set(split) == set(whole) and whole
    assert max(g.abs().max().item() for g in whole.values()) > 1e-4  # a gradient that could differ
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def the_long_one(batch, layout: str, budget: int = CHUNK):
    """The micro-batch that runs the longest sequence, alone, from a plan made with oversize='split'."""
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), budget, cost=layout, oversize="split")
    longest = int(batch["attention_mask"].sum(-1).argmax())
    (mb,) = [mb for mb in iter_micro_batches(batch, plan, layout=layout) if mb.indices == (longest,)]
    return mb


def split_equals_whole(model, mb, chunk: int = CHUNK, **options) -> None:
    model.zero_grad(set_to_none=True)
    whole_loss = micro_batch_loss(model, mb, **options)
    whole_loss.backward()
    whole = gradients(model)
    split_loss = split_loss_backward(model, mb, chunk, **options)
    torch.testing.assert_close(split_loss, whole_loss.detach(), atol=1e-5, rtol=1e-5)
    assert_same_gradients(gradients(model), whole)


# ------------------------------------------------------------------ chunks and the plan


def test_chunks_hold_a_token_and_its_label_in_each_pass():
    # 16 tokens in passes of at most 8: chunks own 7, 7, 2; passes run 8, 8, 2
    assert split_chunks(16, 8) == ((0, 7), (7, 14), (14, 16))
    # 28 = 3.5 × 8: ⌈27 / 7⌉ = 4 chunks
    assert split_chunks(28, 8) == ((0, 7), (7, 14), (14, 21), (21, 28))
    assert split_chunks(8, 8) == ((0, 8),)  # fits: one chunk
    assert split_chunks(9, 8) == ((0, 7), (7, 9))


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 300), chunk=st.integers(2, 40))
def test_chunks_cover_the_sequence_once_and_no_pass_is_over_the_budget(length, chunk):
    chunks = split_chunks(length, chunk)
    assert chunks[0][0] == 0 and chunks[-1][1] == length
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    passes = [end - start + (j < len(chunks) - 1) for j, (start, end) in enumerate(chunks)]  # + the label
    assert max(passes) <= chunk and min(end - start for start, end in chunks) >= 1


def test_a_budget_of_one_token_cannot_split_and_says_so():
    with pytest.raises(
        BudgetError, match=r"^sequence 3 has 5 tokens .*chunk_tokens=1.*at least 2 \(at least 5"
    ):
        split_chunks(5, 1, index=3)
    assert split_chunks(1, 1) == ((0, 1),)


def test_split_plans_run_long_sequences_alone_and_report_the_cost():
    lengths = [16, 3, 28, 5, 2]
    split = plan_micro_batches(lengths, CHUNK, oversize="split", dp_size=2)
    alone = plan_micro_batches(lengths, CHUNK, oversize="alone", dp_size=2)
    assert split.ranks == alone.ranks and split.oversize == alone.oversize == (0, 2)
    assert split.split == ((0, 3), (2, 4))  # 16 → 3 chunks, 28 → 4
    assert split.split_extra_forwards == 5  # (3 − 1) + (4 − 1)
    assert "2 sequences split into 7 chunks (5 extra forwards)" in split.describe()
    assert len({len(r) for r in split.ranks}) == 1  # equal counts over ranks
    assert alone.split == () and "split" not in alone.describe()
    assert plan_micro_batches(lengths, 40, oversize="split").split == ()
    with pytest.raises(BudgetError, match=r"oversize='alone'.*or 'split'"):
        plan_micro_batches(lengths, CHUNK)


def test_a_sequence_over_the_response_budget_only_runs_alone_unsplit():
    plan = plan_micro_batches([6, 6, 6], 10, oversize="split", response_lengths=[5, 1, 1], response_budget=4)
    assert plan.oversize == (0,) and plan.split == ()


def test_pad_to_keeps_the_split():
    plan = plan_micro_batches([16, 3], CHUNK, oversize="split")
    assert plan.pad_to(5).split == plan.split


# ------------------------------------------------------------------ the gradient


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(("prompt", "response"), [(6, 10), (9, 19)], ids=["2x", "3.5x"])
def test_twice_and_three_and_a_half_times_the_budget_train_with_the_unsplit_gradient(
    kind, attn, prompt, response
):
    model = tiny_lm(kind, attn)
    batch = rollouts(model, [prompt, 3], [response, 2], seed=1)
    mb = the_long_one(batch, "padded")
    assert mb.batch["input_ids"].shape == (1, prompt + response)  # 16 or 28 tokens, 2× or 3.5× the chunk
    split_equals_whole(model, mb)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("head", ["fused", "full"])
def test_layouts_checkpointing_and_heads_keep_the_unsplit_gradient(layout, checkpointing, head):
    model = tiny_lm("qwen2")
    use_varlen_attention(model)  # the packed row's attention; a chunk masks causally from its offset
    batch = rollouts(model, [5, 2, 7], [4, 6, 14], seed=2)
    if checkpointing:
        enable_activation_checkpointing(model)
        model.train()
    mb = the_long_one(batch, layout)
    split_equals_whole(model, mb, head=head)
    if head == "fused":  # the response-only head (NOTE [ Response-only head ])
        model.zero_grad(set_to_none=True)
        whole_logp = model_logprobs(model, mb, only_loss_tokens=True)
        policy_loss(whole_logp, mb.batch).backward()
        whole = gradients(model)
        split_loss_backward(model, mb, CHUNK, only_loss_tokens=True)
        assert_same_gradients(gradients(model), whole)
    if checkpointing:  # the layers' own setting is back: transformers drops the cache again
        assert all("_can_checkpoint_with_cache" not in m.__dict__ for m in model.modules())


def test_the_value_loss_of_a_critic_keeps_the_unsplit_gradient():
    from transformers import LlamaForTokenClassification

    torch.manual_seed(0)
    critic = LlamaForTokenClassification(tiny_config(num_labels=1, classifier_dropout=0.0))
    use_varlen_attention(critic)
    batch = rollouts(tiny_lm(), [6, 2], [11, 3], seed=4)
    split_equals_whole(critic, the_long_one(batch, "padded"), critic=True, value_clip=0.5)
    with torch.no_grad():  # the forward-only values (NOTE [ Over-long sequences run in chunks ])
        mb = the_long_one(batch, "packed")
        whole = micro_batch_outputs(critic, mb, critic=True)
        torch.testing.assert_close(split_outputs(critic, mb, CHUNK, critic=True), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_only_outputs_in_chunks_equal_the_unsplit_ones(layout):
    model = tiny_lm("qwen2")
    use_varlen_attention(model)
    batch = rollouts(model, [5, 2, 7], [4, 6, 14], seed=9)
    with torch.no_grad():
        for mb in iter_micro_batches(
            batch,
            plan_micro_batches(batch["attention_mask"].sum(-1), CHUNK, cost=layout, oversize="split"),
            layout=layout,
        ):
            whole = micro_batch_outputs(model, mb)
            split = split_outputs(model, mb, CHUNK)  # the long one in 3 chunks, the others whole
            assert split.shape == whole.shape and whole.abs().max() > 0
            torch.testing.assert_close(split, whole, atol=1e-5, rtol=0)


def test_lora_adapters_keep_the_unsplit_gradient():
    from batchfit.models.lora import apply_lora, lora_spec, materialise_adapters, reset_adapters

    model = apply_lora(tiny_lm(), lora_spec(rank=4))
    materialise_adapters(model, "cpu")
    reset_adapters(model)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # B starts at 0: give the adapters' A a gradient too
            torch.nn.init.normal_(param, std=0.1)
    batch = rollouts(model, [5, 2], [12, 3], seed=3)
    split_equals_whole(model, the_long_one(batch, "padded"))


@settings(max_examples=5, deadline=None)
@given(
    prompt=st.integers(1, 12),
    response=st.integers(2, 20),
    chunk=st.integers(2, 9),
    layout=st.sampled_from(["padded", "packed"]),
    head=st.sampled_from(["fused", "chunked", "full"]),
    seed=st.integers(0, 2**16),
)
def test_any_length_and_chunk_keep_the_unsplit_gradient(prompt, response, chunk, layout, head, seed):
    model = tiny_lm()
    use_varlen_attention(model)
    batch = rollouts(model, [prompt], [response], seed=seed)
    mb = next(
        iter_micro_batches(
            batch,
            plan_micro_batches([prompt + response], chunk, cost=layout, oversize="split"),
            layout=layout,
        )
    )
    split_equals_whole(model, mb, chunk=chunk, head=head)


def test_a_split_plan_through_accumulate_gives_the_mini_batch_gradient():
    model = tiny_lm()
    batch = rollouts(model, [5, 2, 9, 3], [3, 4, 12, 1], seed=5)
    lengths = batch["attention_mask"].sum(-1)
    whole_plan = plan_micro_batches(lengths, 64)
    for mb in accumulate(model, iter_micro_batches(batch, whole_plan), whole_plan.num_micro_batches):
        micro_batch_loss(model, mb).backward()
    whole = gradients(model)
    plan = plan_micro_batches(lengths, CHUNK, oversize="split")
    assert plan.split == ((2, 3),)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))  # hooks run on every pass
    for mb in accumulate(model, iter_micro_batches(batch, plan), plan.num_micro_batches):
        micro_batch_backward(model, mb, chunk_tokens=plan.token_budget)
    handle.remove()
    assert_same_gradients(gradients(model), whole)
    # 21 tokens: chunks 7, 7, 7: 2 fill passes + 3 gradient passes, one pass for each other micro-batch
    assert len(calls) == 5 + plan.num_micro_batches - 1
    assert "forward" not in model.__dict__ and model.config.use_cache is True


# ------------------------------------------------------------------ refusals


def one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text
    return text


def test_a_sliding_window_model_is_refused_by_name_with_the_smallest_budget():
    from transformers import Qwen2ForCausalLM

    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    model = Qwen2ForCausalLM(config)
    batch = rollouts(tiny_lm("qwen2"), [3, 6], [2, 10], seed=6)
    mb = the_long_one(batch, "padded")
    with pytest.raises(BudgetError) as info:
        micro_batch_backward(model, mb, chunk_tokens=CHUNK)
    assert re.fullmatch(
        r"sequence 1 has 16 tokens, .*DynamicSlidingWindowLayer.*raise the token budget to at least 16, .*",
        one_line(info.value),
    )
    assert all(p.grad is None for p in model.parameters())


class NoCache(torch.nn.Module):
    """A causal LM whose forward takes no past_key_values."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)

    def forward(self, input_ids, **kwargs):  # pragma: no cover - refused before it runs
        raise AssertionError("must not run")


def test_a_model_without_a_kv_cache_is_refused_by_name():
    batch = {"input_ids": torch.arange(1, 11)[None], "attention_mask": torch.ones(1, 10, dtype=torch.long)}
    with pytest.raises(
        BudgetError,
        match=r"^the sequence has 10 tokens, .*NoCache.forward takes no cache \(past_key_values\) argument.*at least 10",
    ):
        split_loss_backward(NoCache(), batch, 4)


def test_short_micro_batches_and_many_rows_do_not_split():
    model = tiny_lm()
    batch = rollouts(model, [2, 3], [3, 2], seed=7)
    (mb,) = iter_micro_batches(batch, plan_micro_batches(batch["attention_mask"].sum(-1), 64))
    loss = micro_batch_backward(model, mb, chunk_tokens=4)  # two rows: the plan never makes this
    assert loss.requires_grad is False and any(p.grad is not None for p in model.parameters())
    with pytest.raises(BatchError, match="holds one sequence"):
        split_loss_backward(model, mb, 4)
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        micro_batch_backward(model, mb, chunk_tokens=0)


def test_a_row_with_holes_is_refused():
    model = tiny_lm()
    batch = {
        "input_ids": torch.arange(1, 11)[None],
        "attention_mask": torch.tensor([[1] * 4 + [0] + [1] * 5]),
    }
    with pytest.raises(BatchError, match="one span"):
        split_loss_backward(model, batch, 4)


def _ddp_split_rank(rank: int) -> float:
    """Rank ``rank`` of 2 under DDP, then FSDP2: a plan splitting one sequence on one rank gives the mini-batch's gradient."""
    reference = tiny_lm()
    batch = rollouts(reference, [5, 2, 9, 3, 1, 2], [3, 4, 12, 1, 3, 2], seed=8)
    lengths = batch["attention_mask"].sum(-1)
    whole_plan = plan_micro_batches(lengths, 64)
    for mb in iter_micro_batches(batch, whole_plan):
        micro_batch_loss(reference, mb).backward()
    whole = gradients(reference)
    model = data_parallel(tiny_lm(), "ddp")
    plan = plan_micro_batches(lengths, CHUNK, oversize="split", dp_size=2)
    assert plan.split == ((2, 3),) and plan.num_micro_batches >= 2  # synced and unsynced micro-batches
    # the split micro-batch (the largest, planned first) runs last: the one whose backward all-reduces
    micro = list(iter_micro_batches(batch, plan, rank))[::-1]
    long_one = [mb for mb in micro if mb.indices == (2,)]
    for mb in long_one:  # without the plan the ranks cannot agree on the passes: refused before any
        with pytest.raises(BudgetError) as info:
            micro_batch_backward(model, mb, chunk_tokens=CHUNK)
        assert re.fullmatch(
            r"sequence 2 has 21 tokens, .*DistributedDataParallel and no plan was given.*plan=plan\); "
            r"raise the token budget to at least 21, .*",
            one_line(info.value),
        )
    for mb in accumulate(model, micro, plan.num_micro_batches):
        micro_batch_backward(model, mb, plan=plan, scale=2)  # DDP averages: × dp sums
    split = {n.removeprefix("module."): g for n, g in gradients(model).items()}
    assert_same_gradients(split, whole)
    # FSDP2: the same passes on every rank (all-gathers in every forward, reduce-scatters in every backward)
    from torch.distributed.tensor import DTensor

    sharded = data_parallel(tiny_lm(), "fsdp2")
    for mb in accumulate(sharded, micro, plan.num_micro_batches):
        micro_batch_backward(sharded, mb, plan=plan, scale=2)
    full = {
        n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        for n, p in sharded.named_parameters()
    }
    assert_same_gradients(full, whole)
    return max((split[n] - g).abs().max().item() for n, g in whole.items())


def test_ddp_and_fsdp2_ranks_run_the_split_passes_in_lockstep_with_the_mini_batch_gradient():
    errors = run_ranks(_ddp_split_rank, world=2, timeout=90)
    assert sorted(errors) == [0, 1] and max(errors.values()) < 1e-5
