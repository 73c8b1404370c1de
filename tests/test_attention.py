"""batchfit.models.attention: per-sequence attention on packed rows, equal to the masked path, without a T × T mask."""

from __future__ import annotations

import warnings

import pytest
import torch

from batchfit import InvalidArgument
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.memory import get_backend
from batchfit.models import attention as attention_module
from batchfit.models.attention import VARLEN, use_varlen_attention
from batchfit.plan.packing import plan_micro_batches
from batchfit.train import model_logprobs
from microbatch_helpers import tiny_lm


def _model(kind: str) -> torch.nn.Module:
    return tiny_lm(kind, "sdpa").train()


def _packed(lengths: list[int]):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (1, sum(lengths)), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, positions


def _forward_backward(model, **inputs):
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    (logits.float() ** 2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_varlen_attention_equals_the_masked_packed_path_forward_and_backward(kind):
    model = _model(kind)
    ids, positions = _packed([7, 3, 12, 1, 5])
    expected_logits, expected_grads = _forward_backward(model, input_ids=ids, position_ids=positions)
    assert use_varlen_attention(model) == VARLEN
    logits, grads = _forward_backward(model, input_ids=ids, position_ids=positions)
    assert torch.allclose(logits, expected_logits, atol=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-5), name


def test_cu_seq_lens_give_the_same_boundaries_as_position_ids():
    model = _model("llama")
    use_varlen_attention(model)
    ids, positions = _packed([4, 9, 2])
    cu = torch.tensor([0, 4, 13, 15], dtype=torch.int32)
    with torch.no_grad():
        by_positions = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        by_cu = model(
            input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False
        ).logits
    assert torch.allclose(by_positions, by_cu, atol=1e-6)


def test_padded_batches_keep_the_masked_path():
    model = _model("llama")
    ids = torch.randint(1, 64, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        use_varlen_attention(model)
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(got[mask == 1], expected[mask == 1], atol=1e-6)


def test_packed_rows_through_varlen_attention_need_less_memory_than_a_full_mask(one_thread):
    # 8 sequences of 96 tokens packed: sdpa's path holds a 768 × 768 mask and attends over the
    # whole row per head; varlen attends over 96 tokens at a time
    model = _model("llama")
    ids, positions = _packed([96] * 8)
    backend = get_backend("cpu")

    def step():
        model(input_ids=ids, position_ids=positions, use_cache=False).logits.float().mean().backward()
        model.zero_grad(set_to_none=True)

    masked = backend.measure(step, register=model).peak_bytes
    use_varlen_attention(model)
    varlen = backend.measure(step, register=model).peak_bytes
    assert varlen < 0.8 * masked


def test_packed_micro_batches_warn_once_about_a_masked_attention(monkeypatch):
    monkeypatch.setattr(attention_module, "_warned", False)
    batch = {"input_ids": torch.ones(3, 4, dtype=torch.long), "attention_mask": torch.ones(3, 4, dtype=torch.long)}
    plan = plan_micro_batches([4, 4, 4], 8, cost="packed")
    model = _model("llama")

    def run() -> None:
        for mb in iter_micro_batches(batch, plan, layout="packed"):
            model_logprobs(model, mb.batch)

    with pytest.warns(UserWarning, match=r"attn_implementation='sdpa' build a T × T mask.*use_varlen_attention"):
        run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run()  # once only
        use_varlen_attention(model)
        monkeypatch.setattr(attention_module, "_warned", False)
        run()  # varlen: no warning


def test_use_varlen_attention_needs_a_transformers_model():
    with pytest.raises(InvalidArgument, match="needs a transformers model"):
        use_varlen_attention(torch.nn.Linear(2, 2))
