"""Forward passes of plans that split over-long sequences: the unsplit outputs, or a refusal before any pass."""

from __future__ import annotations

import pytest
import torch

from batchfit import BudgetError
from batchfit.models.attention import use_varlen_attention
from batchfit.plan.packing import plan_micro_batches
from batchfit.train import forward_logprobs, forward_values
from microbatch_helpers import tiny_config, tiny_lm
from rollout_helpers import rollouts

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_split_forward_plan_gives_the_unsplit_log_probs(layout):
    torch.manual_seed(0)
    model = tiny_lm("llama")
    if layout == "packed":
        use_varlen_attention(model)
    batch = rollouts(model, [3, 6, 2], [2, 12, 4], seed=1)  # row 1: 18 tokens
    lengths = batch["attention_mask"].sum(-1)
    whole = plan_micro_batches(lengths, token_budget=64, cost="packed")
    split = plan_micro_batches(lengths, token_budget=8, cost="packed", oversize="split")
    assert [index for index, _ in split.split] == [1]
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        expected = forward_logprobs(model, batch, whole, layout=layout)
        whole_calls = len(calls)
        got = forward_logprobs(model, batch, split, layout=layout)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    (chunks,) = [n for _, n in split.split]
    assert len(calls) - whole_calls == split.num_micro_batches - 1 + chunks  # the long row ran in its chunks


def test_a_split_forward_plan_gives_the_unsplit_values():
    from transformers import LlamaForTokenClassification

    torch.manual_seed(0)
    critic = LlamaForTokenClassification(tiny_config(num_labels=1, classifier_dropout=0.0)).eval()
    batch = rollouts(tiny_lm("llama"), [3, 9], [2, 11], seed=2)
    lengths = batch["attention_mask"].sum(-1)
    with torch.no_grad():
        expected = forward_values(critic, batch, plan_micro_batches(lengths, token_budget=64, cost="packed"))
        split = plan_micro_batches(lengths, token_budget=8, cost="packed", oversize="split")
        got = forward_values(critic, batch, split)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_model_that_cannot_split_is_refused_before_any_pass():
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = rollouts(tiny_lm("qwen2"), [3, 6], [2, 10], seed=6)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), token_budget=8, cost="packed", oversize="split")
    with pytest.raises(BudgetError, match=r"^sequence 1 has 16 tokens, .*raise the token budget to at least 16"):
        forward_logprobs(model, batch, plan)
    assert calls == []  # refused before the first micro-batch: no rank is left in a collective
