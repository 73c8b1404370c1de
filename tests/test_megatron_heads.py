"""batchfit.train.megatron_heads: the frameworks' log-prob and entropy heads on Megatron's vocab-parallel logits.

On 2 real gloo ranks at TP 2 each head's log-probs and entropy, and their gradients, equal the
plain computation on the full logits gathered over the tensor-parallel group; the estimate
backend measures each head's training step and forward pass to the byte as the real ranks do; and
verl's entropy (a clone of the fp32 logits and its softmax) raises the peak over Megatron's own
cross-entropy at a large vocabulary. Skipped where megatron-core or mbridge (or verl, for its
head) is not installed.
"""

from __future__ import annotations

import importlib.util

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

TP, BATCH, SEQ, LAYERS = 2, 2, 64, 2

#: (name, head options) of every head measured: each framework's default, and one with every option
#: that changes what the head holds (entropy with its graph, chunks smaller than the sequence)
HEADS = (
    ("verl", None),
    ("verl-entropy", {"framework": "verl", "entropy": True, "entropy_grad": True}),
    ("skyrl", None),
    ("skyrl-chunked-entropy-grad", {"framework": "skyrl", "entropy": True, "entropy_grad": True, "chunk_size": 16, "entropy_chunk_size": 16}),
    ("skyrl-unchunked", {"framework": "skyrl", "entropy": True, "entropy_chunk_size": None}),
    ("slime", None),
    ("slime-chunked-entropy-grad", {"framework": "slime", "entropy": True, "entropy_grad": True, "chunk_size": 32}),
)
IDS = [name for name, _ in HEADS]
#: SkyRL's fused LM head (hidden states and the output weight, no logits), measured beside the heads above
FUSED = (("skyrl-fused", {"framework": "skyrl", "entropy": True, "chunk_size": 16, "fused": True}),)
MEASURED = HEADS + FUSED


@pytest.fixture
def megatron():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    if importlib.util.find_spec("verl") is None:  # import verl needs ray; its head loads the file alone
        pytest.skip("verl is not installed: pip install verl")


def _head(name: str, options: dict[str, object] | None, forward_only: bool):
    from batchfit.train.megatron_heads import MegatronHead

    if options is None:
        return MegatronHead.default(name, forward_only=forward_only)
    return MegatronHead(**options)


# --- values ------------------------------------------------------------------------------------


def _values(rank: int) -> dict[str, object]:
    """Every head's outputs and logit gradients on this rank's vocabulary shard, and the plain ones on the gathered logits."""
    import warnings

    import torch

    from batchfit.models.megatron import model_parallel
    from batchfit.train.megatron_heads import head_outputs

    warnings.filterwarnings("ignore")
    vocab = 96
    generator = torch.Generator().manual_seed(3)
    full = torch.randn(BATCH, SEQ, vocab, generator=generator, dtype=torch.float64).float() * 3
    target = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    weights = torch.rand(BATCH, SEQ, generator=generator), torch.rand(BATCH, SEQ, generator=generator)
    local = vocab // TP
    shard = full[..., rank * local : (rank + 1) * local]

    plain = full.clone().requires_grad_(True)
    log_softmax = torch.log_softmax(plain, dim=-1)
    plain_log_probs = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    plain_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    out: dict[str, object] = {"plain": (plain_log_probs.detach(), plain_entropy.detach())}
    grad_lp = torch.autograd.grad((plain_log_probs * weights[0]).sum(), plain, retain_graph=True)[0]
    grad_both = torch.autograd.grad((plain_log_probs * weights[0] + plain_entropy * weights[1]).sum(), plain)[0]
    out["plain_grads"] = (grad_lp[..., rank * local : (rank + 1) * local], grad_both[..., rank * local : (rank + 1) * local])

    with model_parallel(TP, 1):
        for name, options in HEADS:
            head = _head(name.split("-")[0], options, forward_only=False)
            with torch.no_grad():
                log_probs, entropy = head_outputs(head, shard.clone(), target)
            logits = shard.clone().requires_grad_(True)
            lp, ent = head_outputs(head, logits, target)
            loss = (lp * weights[0]).sum()
            if ent is not None and ent.requires_grad:
                loss = loss + (ent * weights[1]).sum()
            loss.backward()
            out[name] = {
                "log_probs": log_probs,
                "entropy": entropy,
                "entropy_grad": ent is not None and ent.requires_grad,
                "grad": logits.grad,
            }
    return out


@pytest.fixture(scope="module")
def values():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    return run_ranks(_values, world=TP, timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("name", IDS)
def test_log_probs_and_entropy_equal_the_gathered_logits(megatron, values, name):
    import torch

    for rank in range(TP):
        got, (log_probs, entropy) = values[rank][name], values[rank]["plain"]
        torch.testing.assert_close(got["log_probs"], log_probs, rtol=1e-5, atol=1e-5)
        if got["entropy"] is not None:
            torch.testing.assert_close(got["entropy"], entropy, rtol=1e-5, atol=1e-5)
        # the gradient of the shard: of the log-probs, and of the entropy where it has a graph
        expected = values[rank]["plain_grads"][1 if got["entropy_grad"] else 0]
        torch.testing.assert_close(got["grad"], expected, rtol=1e-5, atol=1e-5)


def _fused_values(rank: int) -> dict[str, object]:
    """SkyRL's fused head on this rank's vocabulary shard of the output weight, and the plain head on ``hidden @ Wᵀ``."""
    import warnings

    import torch

    from batchfit.models.megatron import model_parallel
    from batchfit.train.megatron_heads import MegatronHead, fused_head_outputs

    warnings.filterwarnings("ignore")
    vocab, width = 96, 12
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(BATCH, SEQ, width, generator=generator)
    weight = torch.randn(vocab, width, generator=generator)
    target = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    scale = torch.rand(BATCH, SEQ, generator=generator)
    local = vocab // TP
    plain_hidden, plain_weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_softmax = torch.log_softmax(plain_hidden @ plain_weight.t(), dim=-1)
    plain_log_probs = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    plain_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    (plain_log_probs * scale).sum().backward()
    ours_hidden = hidden.clone().requires_grad_(True)
    ours_weight = weight[rank * local : (rank + 1) * local].clone().requires_grad_(True)
    with model_parallel(TP, 1):
        head = MegatronHead("skyrl", entropy=True, chunk_size=16, fused=True)
        log_probs, entropy = fused_head_outputs(head, ours_hidden, ours_weight, target)
        (log_probs * scale).sum().backward()
    return {
        "plain": (plain_log_probs.detach(), plain_entropy.detach(), plain_hidden.grad,
                  plain_weight.grad[rank * local : (rank + 1) * local]),
        "fused": (log_probs.detach(), entropy, ours_hidden.grad, ours_weight.grad),
    }  # fmt: skip


@pytest.mark.slow
def test_skyrls_fused_head_equals_the_head_on_the_projected_logits(megatron):
    import torch

    got = run_ranks(_fused_values, world=TP, timeout=240)
    for rank in range(TP):
        (lp, ent, _, grad_w), (plain_lp, plain_ent, _, plain_grad_w) = got[rank]["fused"], got[rank]["plain"]
        torch.testing.assert_close(lp, plain_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, plain_ent, rtol=1e-5, atol=1e-5)  # the metric, without graph
        torch.testing.assert_close(grad_w, plain_grad_w, rtol=1e-5, atol=1e-5)  # this rank's rows of W
    # each rank's hidden gradient is its vocabulary shard's part; the sequence-parallel gather's backward sums them
    summed = got[0]["fused"][2] + got[1]["fused"][2]
    torch.testing.assert_close(summed, got[0]["plain"][2], rtol=1e-5, atol=1e-5)


def test_the_fused_head_is_skyrls_and_keeps_no_entropy_graph():
    from batchfit.train.megatron_heads import MegatronHead

    with pytest.raises(InvalidArgument, match="fused=True is SkyRL's fused_lm_head_logprob, but got framework='verl'"):
        MegatronHead("verl", fused=True)
    with pytest.raises(InvalidArgument, match="raises NotImplementedError for use_entropy_loss"):
        MegatronHead("skyrl", entropy=True, entropy_grad=True, fused=True)
    assert MegatronHead("skyrl", fused=True).describe()["fused"] is True
    assert "fused" not in MegatronHead("skyrl").describe()


# --- estimate = cpu ----------------------------------------------------------------------------


def _measure(backend_name: str, name: str, options: dict[str, object] | None, forward_only: bool) -> tuple[int, dict]:
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    backend = get_backend(backend_name, reserve_bytes=0, round_to=1)
    head = _head(name.split("-")[0], options, forward_only)
    step = MegatronStep(
        "tiny", tensor_parallel=TP, backend=backend, num_layers=LAYERS, dtype=torch.bfloat16,
        forward_only=forward_only, head=head,
    )  # fmt: skip
    got = step.measure([SEQ] * BATCH)
    return got.peak_bytes, got.breakdown


def _real_rank(rank: int) -> list[tuple[int, dict]]:
    return [_measure("cpu", name, options, fo) for fo in (False, True) for name, options in MEASURED]


@pytest.fixture(scope="module")
def real_measurements():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    return run_ranks(_real_rank, world=TP, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("forward_only", [False, True], ids=["train", "forward"])
@pytest.mark.parametrize("name", [name for name, _ in MEASURED])
def test_estimate_equals_every_real_rank_to_the_byte(megatron, real_measurements, name, forward_only):
    index = [(fo, n) for fo in (False, True) for n, _ in MEASURED].index((forward_only, name))
    options = dict(MEASURED)[name]
    estimate = _measure("estimate", name, options, forward_only)
    if name.startswith("skyrl"):
        # NOTE [ SkyRL's fused LM head ]: every target in rank 0's shard, the rank whose backward selects the most
        assert real_measurements[0][index] == estimate
        assert real_measurements[1][index][0] <= estimate[0]
        return
    for rank in range(TP):
        assert real_measurements[rank][index] == estimate, rank


# --- the entropy's share -----------------------------------------------------------------------


def test_verl_entropy_raises_the_peak_over_megatron_cross_entropy_at_a_large_vocab(megatron):
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    vocab, rows, seq = 65536, 1, 256

    def peak(forward_only: bool, head: object) -> int:
        backend = get_backend("estimate", reserve_bytes=0, round_to=1)
        step = MegatronStep(
            "tiny", tensor_parallel=TP, backend=backend, num_layers=1, dtype=torch.bfloat16, forward_only=forward_only,
            head=head, gpt_args={"vocab_size": vocab},
        )  # fmt: skip
        return step.measure([seq] * rows).peak_bytes

    logits_fp32 = rows * seq * (vocab // TP) * 4  # 1 × 256 × 32,768 × 4 B = 33,554,432 B: one fp32 copy of the shard
    # verl's old log-probs (entropy on) against Megatron's own: a clone of the fp32 logits and the entropy's softmax more
    extra = peak(True, "verl") - peak(True, None)
    assert extra >= logits_fp32, extra
    # verl's update with entropy_coeff != 0 against Megatron's own training step
    from batchfit.train.megatron_heads import MegatronHead

    extra = peak(False, MegatronHead("verl", entropy=True, entropy_grad=True)) - peak(False, None)
    assert extra >= logits_fp32, extra


@pytest.mark.slow
def test_skyrls_fused_head_holds_no_logits_at_a_large_vocab(megatron):
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend
    from batchfit.train.megatron_heads import MegatronHead

    warnings.filterwarnings("ignore")
    vocab, rows, seq, chunk = 65536, 1, 256, 32

    def peak(head: object) -> int:
        backend = get_backend("estimate", reserve_bytes=0, round_to=1)
        step = MegatronStep(
            "tiny", tensor_parallel=TP, backend=backend, num_layers=1, dtype=torch.bfloat16, head=head,
            gpt_args={"vocab_size": vocab},
        )  # fmt: skip
        return step.measure([seq] * rows).peak_bytes

    logits_fp32 = rows * seq * (vocab // TP) * 4  # one fp32 copy of the [1, 256, 32,768] shard: 33,554,432 B
    chunked = peak(MegatronHead("skyrl", entropy=True, chunk_size=chunk, entropy_chunk_size=chunk))
    fused = peak(MegatronHead("skyrl", entropy=True, chunk_size=chunk, fused=True))
    # SkyRL's chunked head still builds the bf16 logits and their fp32 copy; the fused one only chunks of them
    assert chunked - fused >= logits_fp32, (chunked, fused)


# --- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"framework": "nemo"}, "framework"),
        ({"framework": "skyrl", "chunk_size": 0}, "chunk_size must be an integer >= 1"),
        ({"framework": "skyrl", "entropy_chunk_size": -1}, "entropy_chunk_size must be an integer >= 0"),
        ({"framework": "megatron", "entropy": True}, "head 'megatron' is Megatron's own cross-entropy"),
        ({"framework": "verl", "entropy": True}, "verl differentiates its entropy"),
    ],
    ids=["unknown-framework", "zero-chunk", "negative-entropy-chunk", "megatron-entropy", "verl-entropy-without-graph"],
)
def test_bad_heads_are_refused(options, match):
    from batchfit.train.megatron_heads import MegatronHead

    with pytest.raises(InvalidArgument, match=match):
        MegatronHead(**options)


def test_each_framework_default_follows_its_config():
    from batchfit.train.megatron_heads import MegatronHead, as_megatron_head

    # verl: entropy in the old-log-prob pass only (calculate_entropy=True there, entropy_coeff 0 in the update)
    assert as_megatron_head("verl", forward_only=True) == MegatronHead("verl", entropy=True, entropy_grad=True)
    assert as_megatron_head("verl") == MegatronHead("verl")
    # SkyRL: logprobs_chunk_size 1024, vocab_entropy_chunk_size 0 (auto); the update's entropy is a metric
    assert as_megatron_head("skyrl") == MegatronHead("skyrl", entropy=True, chunk_size=1024, entropy_chunk_size=0)
    assert as_megatron_head("skyrl", forward_only=True).entropy is False
    # slime: log_probs_chunk_size -1 (none), with_entropy=True in the update, use_rollout_entropy off
    assert as_megatron_head("slime") == MegatronHead("slime", entropy=True)
    assert as_megatron_head(None).is_default


def test_skyrl_entropy_chunks_are_sized_to_its_memory_budget():
    import torch

    from batchfit.train.megatron_heads import _skyrl_resolve_vocab_entropy_chunk_size

    logits = torch.empty(1, 32768, 75968, device="meta")  # qwen3's 151,936 / TP 2, fp32
    # 512 MiB // (75,968 × 4 B × 4) = 536,870,912 // 1,215,488 = 441 → the power of two below: 256
    assert _skyrl_resolve_vocab_entropy_chunk_size(logits, 0, 512) == 256
    assert _skyrl_resolve_vocab_entropy_chunk_size(logits, 4096, 512) == 4096
    assert _skyrl_resolve_vocab_entropy_chunk_size(logits, 65536, 512) is None  # not smaller than the sequence
    assert _skyrl_resolve_vocab_entropy_chunk_size(logits, None, 512) is None
