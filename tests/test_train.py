"""batchfit.train: fused log-probs through the model's forward, the aligned policy loss, accumulation over ranks."""

from __future__ import annotations

import math

import pytest
import torch

from batchfit import BatchError, InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.batches.weights import loss_weights
from batchfit.models.attention import use_varlen_attention
from batchfit.plan.packing import plan_micro_batches
from batchfit.train import (
    CollectiveBytes,
    PeakTracker,
    accumulate,
    accumulated_gradient_bytes,
    data_parallel_size,
    forward_logprobs,
    model_logprobs,
    next_token_labels,
    policy_loss,
    response_columns,
)
from microbatch_helpers import tiny_lm
from multirank import run_ranks
from rollout_helpers import prompt_response_rows
from sharded_helpers import data_parallel, full_gradients

pytestmark = pytest.mark.usefixtures("one_thread")

P, R = 6, 8  # prompt and response columns


def rollouts(n: int = 6, seed: int = 0) -> dict:
    """Prompt (left-padded to P) | response (right-padded to R) rows, with response-wide fields."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, P + 1, (n,), generator=g)
    response = torch.randint(1, R + 1, (n,), generator=g)
    rows = prompt_response_rows(prompt, response, g, widths=(P, R))
    mask, loss_mask = rows["attention_mask"], rows["loss_mask"]
    return {
        "input_ids": rows["input_ids"],
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0) * mask,
        "loss_mask": loss_mask,
        "advantages": torch.randn(n, 1, generator=g) * loss_mask,
        "old_log_probs": -torch.rand(n, R, generator=g) * 4 * loss_mask,
        "weights": loss_weights(loss_mask, reduction="token_mean"),
    }


def reference_logprobs(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """log_softmax of the full logits, the log-prob of each column's token placed in that column (0 elsewhere)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["attention_mask"]
    return torch.nn.functional.pad(logp * (mask[:, 1:] * mask[:, :-1]), (1, 0))


def test_next_token_labels_stop_at_padding_and_at_packed_sequence_starts():
    padded = {"input_ids": torch.tensor([[0, 5, 6, 7]]), "attention_mask": torch.tensor([[0, 1, 1, 1]])}
    packed = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
    assert next_token_labels(padded).tolist() == [[-100, 6, 7, -100]]
    assert next_token_labels(packed).tolist() == [[6, -100, 8, 9, -100]]


def test_model_logprobs_equal_the_logits_path_at_each_tokens_column_with_the_same_gradient():
    batch = rollouts()
    model, reference = tiny_lm(), tiny_lm()
    got = model_logprobs(model, batch)
    expected = reference_logprobs(reference, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    (got * batch["attention_mask"]).sum().backward()
    (expected * batch["attention_mask"]).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_micro_batches_give_the_padded_logprobs_at_the_same_tokens():
    batch = rollouts(8)
    model = tiny_lm()
    use_varlen_attention(model)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 40, cost="packed")
    packed = torch.zeros(batch["input_ids"].shape)
    for mb in iter_micro_batches(batch, plan, layout="packed"):
        mb.write_back(packed, model_logprobs(model, mb.batch).detach())
    torch.testing.assert_close(packed, reference_logprobs(model, batch).detach(), atol=1e-5, rtol=0)


def test_padded_rows_run_without_a_mask_and_head_chunks_stop_at_the_longest_sequence(monkeypatch):
    import batchfit.train.model_outputs as module

    chunks, calls = [], []
    fused = module.logprobs_from_hidden
    monkeypatch.setattr(
        module, "logprobs_from_hidden", lambda *a, **k: chunks.append(k["chunk_size"]) or fused(*a, **k)
    )
    model = tiny_lm()
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(sorted(kwargs)), with_kwargs=True)
    batch = rollouts(4)
    model_logprobs(model, batch)  # left-padded prompts: rows move to column 0, causal attention needs no mask
    holes = dict(batch, attention_mask=batch["attention_mask"].clone())
    holes["attention_mask"][0, P] = 0  # a hole inside row 0: the mask must stay
    model_logprobs(model, holes)
    assert calls == [["input_ids", "use_cache"], ["attention_mask", "input_ids", "position_ids", "use_cache"]]
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 100, cost="packed")
    packed = next(iter_micro_batches(batch, plan, layout="packed"))
    use_varlen_attention(model)
    model_logprobs(model, packed.batch)
    # packed rows: their positions and what varlen kernels read (transformers' flash-attention kwargs)
    assert calls[2] == [
        "cu_seq_lens_k", "cu_seq_lens_q", "input_ids", "max_length_k", "max_length_q", "position_ids", "use_cache"
    ]  # fmt: skip
    # padded: the row width P + R = 14; packed: the longest packed sequence, not the row's length
    assert chunks == [P + R, P + R, packed.batch["max_length"]]
    assert packed.batch["max_length"] < packed.batch["input_ids"].shape[1]


def test_policy_loss_is_the_clipped_surrogate_on_the_response_columns():
    logp = torch.tensor([[9.0, 0.0, math.log(2.0), math.log(0.5)]])  # column 0 is prompt: never read
    batch = {
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0]]),
        "weights": torch.tensor([[0.5, 0.25, 0.25]]),
        "advantages": torch.tensor([[1.0, 1.0, -1.0]]),
        "old_log_probs": torch.zeros(1, 3),
    }
    # ratios 1, 2, 0.5; clip 0.2: A=+1, r=2 -> max(-2, -1.2) = -1.2; A=-1, r=0.5 -> max(0.5, 0.8) = 0.8
    # 0.5·(-1) + 0.25·(-1.2) + 0.25·0.8 = -0.6, × scale 2 = -1.2
    torch.testing.assert_close(policy_loss(logp, batch, scale=2.0), torch.tensor(-1.2))


def test_policy_loss_ignores_tokens_outside_the_loss_mask_whatever_they_hold():
    logp = torch.tensor([[0.0, 50.0, -50.0]])
    batch = {
        "loss_mask": torch.tensor([[1.0, 0.0, 0.0]]),
        "weights": torch.tensor([[1.0, 0.0, 0.0]]),
        "advantages": torch.tensor([[2.0, 1.0, 1.0]]),
        "old_log_probs": torch.tensor([[0.0, -1e4, 1e4]]),  # exp would overflow if read
    }
    loss = policy_loss(logp.requires_grad_(), batch)
    assert loss.item() == -2.0  # ratio 1 on the one masked-in token: −A · 1
    loss.backward()
    assert torch.isfinite(logp.grad).all()


def test_accumulated_gradients_are_every_trainable_parameter_in_its_dtype():
    model = tiny_lm()
    # embeddings and head 2 · 64 · 32 = 4096; per layer q, o 2 · 32 · 32 + k, v 2 · 32 · 16 + MLP 3 · 32 · 64
    # + two norms 2 · 32 = 9280, two layers 18560; final norm 32: 22688 fp32 values
    assert accumulated_gradient_bytes(model) == 22688 * 4
    model.lm_head.weight.requires_grad_(False)  # a frozen head keeps no gradient
    assert accumulated_gradient_bytes(model) == (22688 - 2048) * 4


def test_response_columns_are_the_sequences_last_columns():
    assert response_columns(torch.arange(5).view(1, 5), 3).tolist() == [[2, 3, 4]]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        pytest.param(
            lambda: policy_loss(torch.zeros(1, 4), {"loss_mask": torch.ones(1, 2)}),
            BatchError,
            "needs a tensor field 'weights'",
            id="missing-weights",
        ),
        pytest.param(
            lambda: policy_loss(
                torch.zeros(1, 4),
                {
                    "loss_mask": torch.ones(1, 2),
                    "weights": torch.ones(1, 3),
                    "advantages": torch.ones(1, 2),
                    "old_log_probs": torch.ones(1, 2),
                },
            ),
            BatchError,
            r"weights must have the shape of the loss mask \(1, 2\)",
            id="misshapen-weights",
        ),
        pytest.param(
            lambda: policy_loss(torch.zeros(1, 4), rollouts(1), clip_ratio=-0.1),
            InvalidArgument,
            r"clip_ratio must be in \[0, inf\]",
            id="negative-clip",
        ),
        pytest.param(
            lambda: response_columns(torch.zeros(1, 2), 3),
            BatchError,
            "must not be wider than the sequence",
            id="response-wider-than-sequence",
        ),
        pytest.param(
            lambda: next_token_labels({"attention_mask": torch.ones(1, 2)}),
            BatchError,
            "needs a 'input_ids' field",
            id="no-input-ids",
        ),
        pytest.param(
            lambda: list(accumulate(torch.nn.Linear(1, 1), [1, 2, 3], count=2)),
            BatchError,
            "more micro-batches than count=2",
            id="more-than-count",
        ),
        pytest.param(
            lambda: list(accumulate(torch.nn.Linear(1, 1), [1], count=2)),
            BatchError,
            "got 1 micro-batches but count=2",
            id="fewer-than-count",
        ),
        pytest.param(
            lambda: forward_logprobs(
                tiny_lm(), rollouts(4), plan_micro_batches([P + R] * 4, 2 * (P + R), dp_size=2)
            ),
            InvalidArgument,
            "plan.dp_size=2 needs a process group of 2 ranks",
            id="dp-plan-without-ranks",
        ),
        pytest.param(
            lambda: forward_logprobs(
                tiny_lm(), rollouts(2), plan_micro_batches([P + R] * 2, 2 * (P + R)), out=torch.zeros(2, 3)
            ),
            InvalidArgument,
            r"out must be a float tensor of input_ids' shape \(2, 14\)",
            id="misshapen-out",
        ),
    ],
)
def test_invalid_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_models_that_transform_their_logits_are_refused():
    model = tiny_lm()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(InvalidArgument, match=r"final_logit_softcapping=30\.0"):
        model_logprobs(model, rollouts(1))


def test_forward_logprobs_of_one_process_cover_every_row():
    batch = rollouts(8)
    model = tiny_lm()
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 3 * (P + R))
    got = forward_logprobs(model, batch, plan)
    torch.testing.assert_close(got, reference_logprobs(model, batch).detach(), atol=1e-5, rtol=0)
    assert not got.requires_grad


def test_forward_logprobs_write_into_a_given_tensor():
    batch = rollouts(4)
    out = torch.full(batch["input_ids"].shape, 7.0, dtype=torch.float64)
    got = forward_logprobs(
        tiny_lm(), batch, plan_micro_batches(batch["attention_mask"].sum(-1), 4 * (P + R)), out=out
    )
    assert got is out
    assert (out[batch["attention_mask"] == 0] == 0).all()  # zeroed first


def test_peak_tracker_never_counts_host_tensors_or_views_of_them():
    x = torch.ones(1024)  # 4 KiB, alive before the block
    # a view of a tensor made before the block is no allocation, registered as host or not
    # (NOTE [ Views of what existed before are not allocations ])
    for host in ((), x):
        with PeakTracker(host=host) as t:
            view = x.detach()  # shares x's storage
            y = x * 2  # 4 KiB
            assert t.take() == 4096
        del view, y


def _rank(rank: int, strategy: str) -> dict:
    """Each rank: its share of a 2-rank plan, accumulated; collectives per micro-batch; all rows' forward log-probs."""
    torch.set_num_threads(1)
    model = data_parallel(tiny_lm(), strategy)
    batch = rollouts(10)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 2 * (P + R), dp_size=2)
    comm = []
    with CollectiveBytes() as counter:
        for mb in accumulate(model, iter_micro_batches(batch, plan, rank), plan.num_micro_batches):
            policy_loss(model_logprobs(model, mb.batch), mb.batch, scale=data_parallel_size(model)).backward()
            comm.append(counter.take()[1])
    grads = full_gradients(model)
    logp = forward_logprobs(model, batch, plan, rank)
    return {
        "grads": grads,
        "comm": comm,
        "dp": data_parallel_size(model),
        "forward": logp.numpy(),
        "gradient_bytes": accumulated_gradient_bytes(model),  # FSDP2: unsharded, as kept without sync
    }


def test_two_ranks_accumulate_and_give_the_single_process_gradient_ddp_syncing_once_fsdp2_every_time():
    batch = rollouts(10)
    model = tiny_lm()
    policy_loss(model_logprobs(model, batch), batch).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    logp = reference_logprobs(model, batch).detach()
    for strategy, sync in (("ddp", "all_reduce"), ("fsdp2", "reduce_scatter")):
        results = run_ranks(_rank, strategy, timeout=120)
        for got in results.values():
            assert got["dp"] == 2
            assert got["gradient_bytes"] == accumulated_gradient_bytes(model)
            *accumulating, last = got["comm"]
            assert accumulating, "the plan must have more than one micro-batch per rank"
            # NOTE [ Accumulate, then sync once ]: DDP defers its all-reduce to the last micro-batch;
            # FSDP2 reduce-scatters into the sharded gradient every time (no unsharded gradients kept)
            deferred = strategy == "ddp"
            assert all((calls[sync] == 0) == deferred for calls in accumulating), (strategy, got["comm"])
            assert last[sync] > 0
            for name, grad in expected.items():
                torch.testing.assert_close(
                    torch.from_numpy(got["grads"][name]), grad, atol=1e-6, rtol=1e-4, msg=f"{strategy} {name}"
                )
            torch.testing.assert_close(torch.from_numpy(got["forward"]), logp, atol=1e-5, rtol=0)
