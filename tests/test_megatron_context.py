"""Megatron's context parallelism: the ring attention (NOTE [ Context parallelism as Megatron runs it ]) and the probe under it.

- :func:`batchfit.models.megatron_context.ring_attention` gives causal attention's values and
  gradients on 2 and 4 gloo ranks, each holding its two load-balanced chunks;
- Megatron-core's ``GPTModel`` under ``context_parallel_size=2`` gives the loss of the whole
  sequence (the RoPE table sliced by Megatron, the ring here);
- the estimate (fake tensors, the fake process group) equals the cpu backend on every real rank to
  the byte: CP 2 on 2 ranks, TP 2 × CP 2 and CP 2 × PP 2 on 4, and a forward-only pass;
- first tier, on the estimate: CP 2 halves the activations, the budget rises, the layout is checked.
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

LAYERS, SEQ = 2, 64


def _chunks(rank: int, cp: int, seq: int):
    import torch

    c = seq // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _ring_errors(rank: int, cp: int, dtype: str) -> list[float]:
    import torch
    import torch.distributed as dist

    from batchfit.models.megatron_context import ring_attention

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    b, heads, groups, s, d = 2, 4, 2, 8 * cp, 16
    q, k, v, grad = (torch.randn(b, h, s, d, dtype=dt) for h in (heads, groups, groups, heads))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True, scale=0.3, enable_gqa=True)
    out.backward(grad)
    idx = _chunks(rank, cp, s)
    local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    got = ring_attention(*local, scale=0.3, group=dist.group.WORLD)
    got.backward(grad[:, :, idx])
    errors = [(got.float() - out[:, :, idx].float()).abs().max().item()]
    return errors + [(mine.grad.float() - ref.grad[:, :, idx].float()).abs().max().item() for mine, ref in zip(local, whole)]


@pytest.mark.slow
@pytest.mark.parametrize(("cp", "dtype", "tolerance"), [(2, "float32", 1e-5), (4, "float32", 1e-5), (2, "bfloat16", 0.05)])
def test_ring_attention_is_causal_attention_on_every_rank(cp, dtype, tolerance):
    errors = run_ranks(_ring_errors, cp, dtype, world=cp, timeout=120)
    for rank in range(cp):
        assert max(errors[rank]) < tolerance, (rank, errors[rank])  # the output and the q, k, v gradients


def _loss(rank: int, cp: int) -> float:
    """The loss of one 2 × 64-token micro-batch of a fresh tiny model, each CP rank given its chunks of it."""
    import warnings

    import torch

    from batchfit.models.megatron import build_gpt_model, megatron_cpu_patches, model_parallel
    from batchfit.models.megatron_attention import layer_spec
    from batchfit.train.megatron_step import MegatronBatch, megatron_loss, synthetic_batch

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    with model_parallel(context_parallel=cp), megatron_cpu_patches():
        model = build_gpt_model(
            "tiny", context_parallel=cp, num_layers=LAYERS, gpt_args={"transformer_layer_spec": layer_spec}
        )
        whole = synthetic_batch(model.vocab_size, 2, SEQ, attention_mask=False)
        idx = _chunks(rank, cp, SEQ)
        batch = MegatronBatch(
            input_ids=whole.input_ids[:, idx].contiguous(),
            position_ids=whole.position_ids[:, idx].contiguous(),
            labels=whole.labels[:, idx].contiguous(),
            loss_mask=whole.loss_mask[:, idx].contiguous(),
            attention_mask=None,
        )
        return megatron_loss(model, batch).item()


@pytest.mark.slow
def test_the_model_under_context_parallelism_gives_the_whole_sequences_loss(megatron):
    (whole,) = run_ranks(_loss, 1, world=1, timeout=240).values()
    halves = run_ranks(_loss, 2, world=2, timeout=240)
    # every rank holds as many tokens: the mean of the ranks' means is the whole mean
    assert sum(halves.values()) / 2 == pytest.approx(whole, rel=1e-5)
    assert halves[0] != pytest.approx(halves[1], rel=1e-6)  # each rank its own chunks


#: (tensor_parallel, context_parallel, pipeline_parallel, forward_only) of each real run
LAYOUTS = ((1, 2, 1, False), (2, 2, 1, False), (1, 2, 2, False), (1, 2, 1, True))
IDS = ["cp2-2ranks", "tp2-cp2-4ranks", "cp2-pp2-4ranks", "cp2-forward-2ranks"]


def _step(backend_name: str, tp: int, cp: int, pp: int, forward_only: bool):
    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    backend = get_backend(backend_name, round_to=1, memory_limit="4GiB", reserve_bytes=0)
    return MegatronStep(
        "tiny",
        tensor_parallel=tp,
        context_parallel=cp,
        pipeline_parallel=pp,
        sequence_parallel=tp > 1,
        backend=backend,
        dtype=torch.bfloat16,
        attention="sdpa",
        forward_only=forward_only,
        num_layers=LAYERS,
    )


def _measured(backend_name: str, tp: int, cp: int, pp: int, forward_only: bool) -> tuple[int, dict[str, int]]:
    import warnings

    warnings.filterwarnings("ignore")
    step = _step(backend_name, tp, cp, pp, forward_only)
    got = step._measure_here(2, SEQ)
    return got.peak_bytes, dict(got.breakdown)


def _real(rank: int, layout) -> tuple[int, dict[str, int]]:
    return _measured("cpu", *layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_estimate_equals_every_real_rank_to_the_byte(megatron, layout):
    from batchfit.models.megatron import simulated_rank

    tp, cp, pp, _ = layout
    world = tp * cp * pp
    real = run_ranks(_real, layout, world=world, timeout=300)
    for rank in range(world):
        with simulated_rank(world, rank):
            estimate = _measured("estimate", *layout)
        assert real[rank] == estimate, rank


def test_context_parallelism_halves_the_activations_and_raises_the_budget(megatron):
    from batchfit.budget import find_token_budget

    one, two = (_step("estimate", 1, cp, 1, False) for cp in (1, 2))
    a, b = (step.measure([256]).breakdown for step in (one, two))
    assert a["parameters"] == b["parameters"]  # every CP rank holds the whole layer
    assert 0.45 < b["activations"] / a["activations"] < 0.55
    budgets = [find_token_budget(step, max_seq_len=256, cost="padded").tokens for step in (one, two)]
    assert budgets[1] > budgets[0]


def test_a_context_parallel_row_is_padded_to_twice_the_group(megatron):
    step = _step("estimate", 2, 2, 1, False)  # sequence parallel: a multiple of 2 × cp × tp
    assert [step.local_length(n) for n in (64, 65, 8)] == [32, 36, 4]
    assert _step("estimate", 1, 1, 1, False).local_length(65) == 65


def test_context_parallelism_needs_fused_attention(megatron):
    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    with pytest.raises(InvalidArgument, match="context_parallel=2 needs attention='sdpa'"):
        MegatronStep("tiny", context_parallel=2, backend=get_backend("estimate", memory_limit="1GiB"))


def test_the_distributed_optimizer_shards_over_the_context_parallel_ranks_too(megatron):
    """Megatron's DDP and distributed optimizer run over the data- and context-parallel group (``with_context_parallel``)."""
    import torch

    from batchfit.budget.megatron_profile import megatron_step
    from batchfit.budget.options import ProfileOptions
    from batchfit.memory import get_backend
    from batchfit.models import load_config
    from batchfit.parallel.sharding import Sharding

    def optimizer_state(cp: int) -> int:
        plan = Sharding("megatron", world_size=cp, context_parallel=cp, distributed_optimizer=True)
        options = ProfileOptions(max_seq_len=64, backend="estimate", memory_limit="4GiB", sharding=plan)
        backend = get_backend("estimate", memory_limit="4GiB", reserve_bytes=0)
        step = megatron_step(load_config("tiny"), plan, backend, torch.bfloat16, options, num_layers=LAYERS)
        assert (step.data_parallel, step.context_parallel, step.distributed_optimizer) == (1, cp, cp > 1)
        return step.measure([64]).breakdown["optimizer_state"]

    one, two = optimizer_state(1), optimizer_state(2)
    assert 0.45 < two / one < 0.55  # no data parallelism, the state halved over the 2 context-parallel ranks
