"""batchfit.train.trl_head: ``logprobs="trl"`` is TRL's own fused head, in values, gradients and memory (needs TRL)."""

from __future__ import annotations

import copy

import pytest
import torch

from batchfit.errors import InvalidArgument
from batchfit.memory import MemoryTracker
from batchfit.train import model_logprobs

pytestmark = pytest.mark.slow  # TRL is an optional package: the second tier


def _models(vocab: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    ours = LlamaForCausalLM(config)
    return ours, copy.deepcopy(ours)


def test_trl_head_equals_trls_patched_model_in_values_gradients_and_peak():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    ours, theirs = _models()
    add_fused_lm_head(theirs, outputs=("log_probs", "entropy"))  # what GRPOTrainer.__init__ does
    ids = torch.randint(0, 96, (4, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :-30] = -100  # _get_per_token_logps_and_entropies: only the 30 completion tokens are scored

    def trl_step():  # GRPOTrainer._get_per_token_logps_and_entropies, then a loss over both outputs
        out = theirs(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
        logp, entropy = out.log_probs[:, -30:], out.entropy[:, -30:]
        (logp.sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach()

    def our_step():
        logp, entropy = model_logprobs(ours, {"input_ids": ids, "attention_mask": mask}, head="trl", return_entropy=True)
        logp, entropy = logp[:, -30:], entropy[:, -30:]
        (logp.sum() + entropy.sum()).backward()
        return logp.detach(), entropy.detach()

    peaks, results = [], []
    for model, step in ((theirs, trl_step), (ours, our_step)):
        with MemoryTracker() as tracker:
            tracker.register(model, category="parameters")
            tracker.register(ids, mask, labels)
            results.append(step())
        peaks.append(tracker.peak_bytes)
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-6)
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
    # measured 21,849,808 (TRL) and 21,849,672 (batchfit) bytes: the labels tensor TRL is given differs by 136 bytes;
    # both hold TRL's 4 × 39 × 32768 fp32 projection buffer (20.0 MB), whatever the 96-token vocabulary
    assert peaks[1] >= 4 * 39 * 32768 * 4
    assert abs(peaks[0] - peaks[1]) <= 1024, peaks


def test_trl_head_matches_the_full_head_on_padded_rows():
    pytest.importorskip("trl")
    model, _ = _models()
    ids = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # a left-padded row
    batch = {"input_ids": ids, "attention_mask": mask}
    full = model_logprobs(model, batch, head="full", return_entropy=True)
    trl = model_logprobs(model, batch, head="trl", return_entropy=True)
    for a, b in zip(full, trl, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_trl_head_refuses_the_response_only_head():
    pytest.importorskip("trl")
    model, _ = _models()
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 2, dtype=torch.long)}
    with pytest.raises(InvalidArgument, match="head='trl' scores every position"):
        model_logprobs(model, batch, head="trl", only_loss_tokens=True)
