"""The response-only head: model_logprobs(only_loss_tokens=True) runs the output head only on the loss tokens.

NOTE [ Response-only head ] in batchfit.train.model_outputs. At the loss mask's columns the
log-probs, entropy and every parameter's gradient equal the full head's (tiny Llama/Qwen2,
fp32, 1e-5), padded (prompt | response) and packed, bare, DDP and FSDP2 on 2 gloo ranks;
elsewhere they are 0; the head's peak is lower at a 4:1 prompt:response ratio.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit import BatchError, InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.batches.weights import loss_weights
from batchfit.logprobs import logprobs_from_hidden
from batchfit.models.attention import use_varlen_attention
from batchfit.plan.packing import plan_micro_batches
from batchfit.train import (
    CollectiveBytes,
    PeakTracker,
    accumulate,
    data_parallel_size,
    model_logprobs,
    policy_loss,
)
from microbatch_helpers import tiny_lm
from multirank import run_ranks
from rollout_helpers import prompt_response_rows
from sharded_helpers import data_parallel, full_gradients

pytestmark = pytest.mark.usefixtures("one_thread")


def rollouts(prompts, responses, seed: int = 0, holes: bool = True, vocab: int = 64) -> dict:
    """Prompt (left-padded) | response (right-padded) rows; a loss mask over the response, with holes (tool outputs)."""
    g = torch.Generator().manual_seed(seed)
    rows = prompt_response_rows(prompts, responses, g, keep=0.7 if holes else None, vocab=vocab)
    loss_mask, r = rows["loss_mask"], rows["loss_mask"].shape[1]
    return {
        **rows,
        "advantages": torch.randn(len(prompts), 1, generator=g) * loss_mask,
        "old_log_probs": -torch.rand(len(prompts), r, generator=g) * 4 * loss_mask,
        "weights": loss_weights(loss_mask, reduction="token_mean"),
    }


def at_loss_columns(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``values`` [rows, W] at the loss mask's columns (right-aligned; per token in a packed row), 0 elsewhere."""
    wanted = torch.nn.functional.pad(loss_mask != 0, (values.shape[1] - loss_mask.shape[1], 0))
    return torch.where(wanted, values, 0.0)


def run(model, batch, head: str, only: bool, coef: torch.Tensor):
    """Log-probs, entropy and the gradients of Σ mask · (logp + coef · entropy) over all parameters."""
    model.zero_grad(set_to_none=True)
    logp, entropy = model_logprobs(model, batch, head=head, return_entropy=True, only_loss_tokens=only)
    fields = batch.batch if hasattr(batch, "batch") else batch
    loss_mask = fields["loss_mask"]
    logp, entropy = at_loss_columns(logp, loss_mask), at_loss_columns(entropy, loss_mask)
    (logp.sum() + (coef * entropy).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


def assert_equal_to_full_head(model, batch, head: str = "fused") -> None:
    coef = torch.tensor(0.3)
    full = run(model, batch, head, False, coef)
    only = run(model, batch, head, True, coef)
    torch.testing.assert_close(only[0], full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(only[1], full[1], atol=1e-5, rtol=0)
    assert set(only[2]) == set(full[2]) == {n for n, _ in model.named_parameters()}
    for name, grad in full[2].items():
        torch.testing.assert_close(only[2][name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("head", ["fused", "chunked", "full"])
def test_padded_rows_equal_the_full_head_at_the_loss_tokens_and_are_zero_elsewhere(kind, head):
    model = tiny_lm(kind)
    batch = rollouts([5, 2, 7], [4, 6, 1])
    assert_equal_to_full_head(model, batch, head)
    logp, entropy = model_logprobs(model, batch, head=head, return_entropy=True, only_loss_tokens=True)
    outside = at_loss_columns(torch.ones_like(logp), batch["loss_mask"]) == 0
    assert (logp[outside] == 0).all() and (entropy[outside] == 0).all()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_micro_batches_padded_and_packed_equal_the_full_head(layout):
    model = tiny_lm()
    use_varlen_attention(model)
    batch = rollouts([3, 8, 1, 5], [6, 2, 5, 3], seed=3)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 40, cost=layout)
    for mb in iter_micro_batches(batch, plan, layout=layout):
        if mb.is_padding:
            continue
        assert_equal_to_full_head(model, mb)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 6)), min_size=1, max_size=3),
    layout=st.sampled_from(["padded", "packed"]),
    seed=st.integers(0, 2**16),
)
def test_any_prompt_and_response_lengths_equal_the_full_head(lengths, layout, seed):
    model = tiny_lm()
    use_varlen_attention(model)
    batch = rollouts([p for p, _ in lengths], [r for _, r in lengths], seed=seed)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 64, cost=layout)
    for mb in iter_micro_batches(batch, plan, layout=layout):
        assert_equal_to_full_head(model, mb)


def test_framework_head_runs_on_the_loss_tokens_only():
    model = tiny_lm()
    batch = rollouts([4, 2], [3, 5], holes=False)
    full = model_logprobs(model, batch, head="verl")
    only = model_logprobs(model, batch, head="verl", only_loss_tokens=True)
    torch.testing.assert_close(only, at_loss_columns(full, batch["loss_mask"]), atol=1e-5, rtol=0)


def test_bf16_response_only_equals_the_bf16_full_head():
    model = tiny_lm().to(torch.bfloat16)
    batch = rollouts([6, 3], [4, 5], seed=5)
    coef = torch.tensor(0.3)
    full = run(model, batch, "fused", False, coef)
    only = run(model, batch, "fused", True, coef)
    # the same bf16 rows through the same fp32-accumulated head: the tolerances of test_logprobs' bf16 tests
    torch.testing.assert_close(only[0], full[0], atol=0.05, rtol=0.02)
    torch.testing.assert_close(only[1], full[1], atol=0.05, rtol=0.02)
    for name, grad in full[2].items():
        scale = grad.float().abs().max().item()
        torch.testing.assert_close(only[2][name].float(), grad.float(), atol=0.03 * scale, rtol=0.03, msg=name)


def test_logprobs_from_hidden_positions_equal_the_full_reduction_there():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[0, 3] = -100
    positions = torch.rand(2, 9, generator=g) < 0.4
    full = logprobs_from_hidden(hidden, weight, labels, chunk_size=4, return_entropy=True)
    only = logprobs_from_hidden(hidden, weight, labels, chunk_size=4, return_entropy=True, positions=positions)
    for a, b in zip(full, only):
        torch.testing.assert_close(b, torch.where(positions, a, 0.0), atol=1e-12, rtol=0)
    grads_full = torch.autograd.grad(sum((x * positions).sum() for x in full), (hidden, weight))
    grads_only = torch.autograd.grad(sum(x.sum() for x in only), (hidden, weight))
    for a, b in zip(grads_full, grads_only):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
    nothing = logprobs_from_hidden(hidden, weight, labels, positions=torch.zeros(2, 9))
    assert (nothing == 0).all()


def test_bad_loss_masks_and_fake_tensors_are_refused():
    model = tiny_lm()
    batch = rollouts([3], [2])
    with pytest.raises(BatchError, match="loss_mask"):
        model_logprobs(model, {k: v for k, v in batch.items() if k != "loss_mask"}, only_loss_tokens=True)
    with pytest.raises(BatchError, match="loss_mask must be"):
        model_logprobs(model, {**batch, "loss_mask": torch.ones(1, 9)}, only_loss_tokens=True)
    with pytest.raises(InvalidArgument, match="positions must have"):
        logprobs_from_hidden(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), positions=torch.ones(4))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(InvalidArgument, match="fake"):
        logprobs_from_hidden(
            torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.long), positions=torch.ones(3)
        )


def test_response_only_head_peaks_lower_at_four_to_one():
    """Peak bytes of one micro-batch's log-probs and backward, cpu tracker, prompt:response 4:1, vocab-heavy head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    batch = rollouts([128] * 4, [32] * 4, holes=False, vocab=8192)
    peaks = {}
    for head in ("full", "fused"):
        for only in (False, True):
            model.zero_grad(set_to_none=True)
            with PeakTracker(model, host=batch) as tracker:
                logp = model_logprobs(model, batch, head=head, only_loss_tokens=only, chunk_size=1024)
                policy_loss(logp, batch).backward()
                peaks[head, only] = tracker.take()
    for head in ("full", "fused"):
        print(f"head={head}: full {peaks[head, False]:,} B, response-only {peaks[head, True]:,} B "
              f"({peaks[head, True] / peaks[head, False]:.2f}x)")
        assert peaks[head, True] < peaks[head, False]


def _rank(rank: int) -> dict:
    """Each rank: its micro-batches under DDP and FSDP2, full head then response-only; gradients and collectives."""
    torch.set_num_threads(1)
    batch = rollouts([5, 2, 7, 3, 6, 1], [4, 6, 1, 5, 2, 3], seed=7)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), 24, dp_size=2)
    out = {}
    for strategy in ("ddp", "fsdp2"):
        model = data_parallel(tiny_lm(), strategy)
        for only in (False, True):
            model.zero_grad(set_to_none=True)
            with CollectiveBytes() as counter:
                for mb in accumulate(model, iter_micro_batches(batch, plan, rank), plan.num_micro_batches):
                    logp = model_logprobs(model, mb, only_loss_tokens=only)
                    policy_loss(logp, mb.batch, scale=data_parallel_size(model)).backward()
                calls = counter.take()[0]
            out[strategy, only] = {"grads": full_gradients(model), "calls": dict(calls)}
    return out


def test_ddp_and_fsdp2_gradients_equal_the_full_heads_with_the_same_collectives():
    batch = rollouts([5, 2, 7, 3, 6, 1], [4, 6, 1, 5, 2, 3], seed=7)
    model = tiny_lm()
    policy_loss(model_logprobs(model, batch), batch).backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    results = run_ranks(_rank, timeout=150)
    for got in results.values():
        for strategy in ("ddp", "fsdp2"):
            full, only = got[strategy, False], got[strategy, True]
            # the head's weight is gathered and its gradient reduced as for the full head
            assert only["calls"] == full["calls"], (strategy, only["calls"], full["calls"])
            for name, grad in expected.items():
                torch.testing.assert_close(
                    torch.from_numpy(only["grads"][name]), torch.from_numpy(full["grads"][name]),
                    atol=1e-5, rtol=1e-5, msg=f"{strategy} {name}",
                )
                torch.testing.assert_close(
                    torch.from_numpy(only["grads"][name]), grad, atol=1e-5, rtol=1e-4, msg=f"{strategy} {name}"
                )
    assert np.isfinite(results[0]["fsdp2", True]["grads"]["lm_head.weight"]).all()


def test_response_only_step_estimates_to_the_byte_of_the_cpu_backend():
    """An integer loss mask keeps its values on the estimate backend: the same gather runs, the same bytes."""
    from batchfit.memory import get_backend

    host = rollouts([7, 3, 5], [2, 4, 3], holes=True)
    host["loss_mask"] = (host["loss_mask"] != 0).long()

    def measure(name: str):
        backend = get_backend(name, round_to=1, reserve_bytes=0)
        with backend.context():
            torch.manual_seed(0)
            model = tiny_lm()

        def step():
            batch = {k: v.to(backend.device, copy=True) for k, v in host.items()}
            logp = model_logprobs(model, batch, only_loss_tokens=True)
            (logp * batch["weights"].new_ones(())).sum().backward()

        return backend.measure(step, register=model)

    cpu, est = measure("cpu"), measure("estimate")
    assert est.peak_bytes == cpu.peak_bytes
    assert est.breakdown == cpu.breakdown
