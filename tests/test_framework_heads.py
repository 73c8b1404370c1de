"""The heads verl and SkyRL run: flash-attention's cross-entropy allocations, their entropy, estimate = cpu."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.budget import causal_lm_step
from batchfit.errors import InvalidArgument
from batchfit.logprobs.kernel_ce import kernel_logprobs
from batchfit.memory import get_backend
from batchfit.memory.estimate import EstimateBackend
from batchfit.memory.tracker import MemoryTracker
from batchfit.models import build_causal_lm
from batchfit.train.framework_heads import FrameworkHead, framework_logprobs
from tiers import second_tier_except


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(labels == -100, 0.0)


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 3),
    tokens=st.integers(1, 300),
    vocab=st.integers(2, 40),
    inplace=st.booleans(),
    seed=st.integers(0, 99),
)
def test_kernel_logprobs_and_their_gradient_are_log_softmax_s(rows, tokens, vocab, inplace, seed):
    gen = torch.Generator().manual_seed(seed)
    leaf = torch.randn(rows, tokens, vocab, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = (
        torch.randint(-1, vocab, (rows, tokens), generator=gen)
        .masked_fill_(torch.rand(rows, tokens, generator=gen) < 0.2, -100)
        .clamp_(min=-100)
    )
    labels[labels == -1] = 0
    weights = torch.randn(rows, tokens, dtype=torch.float64, generator=gen)
    out = kernel_logprobs(leaf * 1.0, labels, inplace_backward=inplace)
    ref = _reference(leaf, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((out * weights).sum(), leaf)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), leaf)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("inplace", [True, False])
def test_the_kernel_allocates_its_outputs_and_a_gradient_only_when_not_in_place(inplace):
    head = torch.nn.Linear(8, 1000, bias=False, dtype=torch.bfloat16)  # its gradient: 16,000 bytes
    hidden = torch.randn(64, 8, dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (64,))
    with MemoryTracker(round_to=1) as tracker:
        out = kernel_logprobs(head(hidden), labels, inplace_backward=inplace)  # logits: 128,000 bytes
        after_forward = tracker.current_bytes
        out.sum().backward()
    logits_bytes = 64 * 1000 * 2
    # after the forward: the logits, the log-sum-exp saved for backward and the negated log-probs
    # (the losses and z-losses are freed once negated, as verl's -output[0] frees them)
    assert after_forward == logits_bytes + 2 * 64 * 4
    # backward: a second logits-sized tensor only without the in-place gradient
    assert tracker.peak_bytes - after_forward < logits_bytes * (0.5 if inplace else 2)
    assert (tracker.peak_bytes - after_forward >= logits_bytes) is not inplace


def test_labels_of_another_shape_are_refused():
    with pytest.raises(
        ValueError, match=r"labels must have the logits' shape without the vocabulary, \(2, 3\)"
    ):
        kernel_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("entropy", ["full", "chunked", "checkpointed"])
def test_verl_entropy_is_the_entropy_of_the_logits(entropy):
    logits = torch.randn(2, 9, 17, dtype=torch.float64)
    labels = torch.randint(0, 17, (2, 9))
    head = FrameworkHead("verl", entropy=entropy, entropy_chunk_size=4)
    _, got = framework_logprobs(head, logits.clone().requires_grad_(), labels)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(got.double(), -(logp.exp() * logp).sum(-1), atol=1e-5, rtol=0)


def test_skyrl_divides_the_logits_in_place_and_verl_does_not():
    logits = torch.full((1, 3, 4), 2.0)
    labels = torch.zeros(1, 3, dtype=torch.long)
    with torch.no_grad():
        framework_logprobs(FrameworkHead("verl", temperature=2.0), logits, labels)
        assert torch.all(logits == 2.0)
        framework_logprobs(FrameworkHead("skyrl", temperature=2.0), logits, labels)
    assert torch.all(logits == 1.0)


def test_a_bad_head_is_named():
    with pytest.raises(
        InvalidArgument, match=r"entropy must be one of 'none', 'full', 'chunked', 'checkpointed'"
    ):
        FrameworkHead("verl", entropy="fast")
    with pytest.raises(InvalidArgument, match=r"framework must be one of 'verl', 'skyrl'"):
        FrameworkHead("openrlhf")
    with pytest.raises(InvalidArgument, match=r"entropy_chunk_size must be a positive integer, but got 0"):
        FrameworkHead("skyrl", entropy_chunk_size=0)


HEADS = {
    "verl": FrameworkHead.default("verl"),
    "verl-entropy-full": FrameworkHead("verl", entropy="full", forward_entropy="full"),
    "verl-entropy-loss": FrameworkHead(
        "verl", entropy="chunked", entropy_in_loss=True, entropy_chunk_size=256
    ),
    "verl-entropy-checkpointed": FrameworkHead(
        "verl", entropy="checkpointed", forward_entropy="checkpointed"
    ),
    "skyrl": FrameworkHead.default("skyrl"),
    "skyrl-entropy-loss": FrameworkHead(
        "skyrl", entropy="chunked", entropy_grad=True, entropy_in_loss=True, entropy_chunk_size=256
    ),
}


# the first tier runs every head once, training and forward-only, padded and packed
@pytest.mark.parametrize(
    ("name", "forward_only", "cost"),
    second_tier_except(
        [
            "verl-train-padded",
            "verl-entropy-full-forward-only-packed",
            "verl-entropy-loss-train-packed",
            "verl-entropy-checkpointed-forward-only-padded",
            "skyrl-train-packed",
            "skyrl-entropy-loss-train-padded",
        ],
        list(HEADS),
        [pytest.param(False, id="train"), pytest.param(True, id="forward-only")],
        ["padded", "packed"],
    ),
)
def test_every_framework_head_estimate_equals_cpu(name, forward_only, cost):
    lengths = [300, 300, 120]
    measured = []
    for backend in (
        get_backend("cpu"),
        get_backend("estimate", memory_limit="80GiB", reserve_bytes=0, round_to=1),
    ):
        model = build_causal_lm("tiny", backend=backend)
        step = causal_lm_step(
            model, backend=backend, logprobs=HEADS[name], forward_only=forward_only, cost=cost
        )
        measured.append(step.measure(lengths).peak_bytes)
    assert measured[0] == measured[1]


def _train_peak(head) -> int:
    # the CPU's own attention kernel: under CUDA's (the math path for float32 with grouped heads)
    # the tiny model's attention scores, not its head, bound the peak at 600 tokens
    backend = EstimateBackend(memory_limit="80GiB", reserve_bytes=0, round_to=1, attention_kernels="own")
    step = causal_lm_step(
        build_causal_lm("tiny", backend=backend), backend=backend, logprobs=head, cost="packed"
    )
    return step.measure([600, 600]).peak_bytes


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_the_kernel_head_holds_less_than_a_log_softmax_and_entropy_costs_memory():
    peaks = {name: _train_peak(head) for name, head in (("full", "full"), *HEADS.items())}
    # the logits and a kernel's [n] outputs, its gradient in place: less than a log-softmax and its gradient
    assert peaks["verl"] < peaks["full"]
    assert peaks["verl"] < peaks["verl-entropy-full"]
    # a checkpointed entropy keeps less than the full one's graph
    assert peaks["verl-entropy-checkpointed"] < peaks["verl-entropy-full"]
    assert peaks["skyrl"] < peaks["skyrl-entropy-loss"]
