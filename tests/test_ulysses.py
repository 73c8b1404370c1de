"""Ulysses attention over gloo ranks: a sequence split over sp ranks trains as the unsplit sequence (issue 30, part 2)."""

from __future__ import annotations

import numpy as np
import pytest

from batchfit.models import use_varlen_attention
from multirank import run_ranks
from ulysses_helpers import build, packed_micro_batch, sequence_parallel_worker, train_step


def _unsplit(kind: str, **options) -> tuple[float, dict]:
    model = build(kind)
    mb = packed_micro_batch(model)
    use_varlen_attention(model)
    return train_step(model, mb, **options)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("sp", [2, 4])
def test_split_sequence_has_the_unsplit_loss_and_gradient(sp, kind):
    loss, grads = _unsplit(kind)
    results = run_ranks(sequence_parallel_worker, sp, kind, world=sp, timeout=120)
    for rank, (rank_loss, rank_grads, tokens) in results.items():
        assert tokens == -(-25 // sp), rank  # each rank ran its share of the 25-token row (padded to a multiple of sp)
        assert rank_loss == pytest.approx(loss, abs=1e-5), rank
        assert rank_grads.keys() == grads.keys()
        for name, grad in grads.items():
            np.testing.assert_allclose(rank_grads[name], grad, atol=1e-5, rtol=0, err_msg=f"rank {rank}: {name}")
        assert any(np.abs(g).max() > 1e-4 for g in grads.values())  # a gradient that could differ


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"only_loss_tokens": True}, id="response-only-head"),
        pytest.param({"head": "full"}, id="full-head"),
        pytest.param({"head": "verl"}, id="verl-head"),
    ],
)
def test_every_head_trains_a_split_sequence_as_the_unsplit_one(options):
    loss, grads = _unsplit("llama", **options)
    results = run_ranks(sequence_parallel_worker, 2, "llama", options, world=2, timeout=120)
    for rank, (rank_loss, rank_grads, _) in results.items():
        assert rank_loss == pytest.approx(loss, abs=1e-5), rank
        for name, grad in grads.items():
            np.testing.assert_allclose(rank_grads[name], grad, atol=1e-5, rtol=0, err_msg=f"rank {rank}: {name}")


@pytest.mark.slow
def test_a_layer_whose_attention_bypasses_the_interface_is_refused_not_run_unsplit():
    # verl #7476: Ulysses silently a no-op on some models; here layer 1's attention ignores the interface
    import torch

    from batchfit.errors import InvalidArgument
    from batchfit.models import use_ulysses_attention
    from batchfit.parallel import sequence_parallel_group, sequence_shard, simulated_world, split_packed

    with simulated_world(2):
        model = build("llama")
        use_ulysses_attention(model, sequence_parallel_group(2))
        model.model.layers[1].self_attn.forward = lambda hidden_states, *args, **kwargs: (hidden_states, None)
        row = {"input_ids": torch.arange(1, 9)[None], "position_ids": torch.arange(8)[None], "cu_seq_lens": torch.tensor([0, 8])}
        local = split_packed(row, sequence_shard(8, 2, 0))
        cu = local["cu_seq_lens"]
        with pytest.raises(InvalidArgument, match=r"Ulysses attention ran in 1 of 2 attention layers of LlamaForCausalLM"):
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)
