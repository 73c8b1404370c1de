"""The budget's probe under Ulysses sequence parallelism: the estimate equals real gloo ranks to the byte (issue 30, part 1).

Each rank runs its share of one packed micro-batch through the trainer's own step (the code of
:mod:`batchfit.models.ulysses`), FSDP2 over the whole world; the estimate runs the same code on
PyTorch's fake process group.
"""

from __future__ import annotations

import pytest

from batchfit.budget.causal_lm_probe import causal_lm_step
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.parallel.distributed import simulated_world
from batchfit.parallel.sharding import Sharding
from multirank import run_ranks

LENGTHS = [40, 31, 26]  # 97 tokens packed: padded to 100 at sp=4 (25 per rank), to 98 at sp=2


def _measure(backend, world: int, sp: int, options: dict) -> tuple[int, dict[str, int]]:
    sharding = Sharding("fsdp2", world_size=world, sequence_parallel=sp)
    model = build_causal_lm("tiny", backend=backend, sharding=sharding, seed=0, **options)
    step = causal_lm_step(model, backend=backend, cost="packed", logprobs="fused")
    step.measure(LENGTHS)  # FSDP2 allocates its all-gather buffers lazily in the first step
    # the lower of three runs: gloo's worker thread now and then frees a buffer late (tests/test_shard.py)
    m = min((step.measure(LENGTHS) for _ in range(3)), key=lambda m: m.peak_bytes)
    return m.peak_bytes, dict(m.breakdown)


def _real_rank(rank: int, sp: int, options: dict) -> tuple[int, dict[str, int]]:
    import torch.distributed as dist

    return _measure(get_backend("cpu"), dist.get_world_size(), sp, options)


def _estimate(world: int, sp: int, options: dict) -> tuple[int, dict[str, int]]:
    with simulated_world(world):
        return _measure(get_backend("estimate", round_to=1, reserve_bytes=0), world, sp, options)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "sp", "options"),
    [
        pytest.param(4, 4, {}, id="sp4"),
        pytest.param(4, 2, {"gradient_checkpointing": True}, id="dp2-sp2-checkpointing"),
        pytest.param(2, 2, {}, id="sp2"),
    ],
)
def test_estimate_equals_every_real_gloo_rank_to_the_byte(world, sp, options):
    real = run_ranks(_real_rank, sp, options, world=world, timeout=240)
    predicted = _estimate(world, sp, options)
    assert real[0] == predicted  # the simulated rank is rank 0 (the largest shard of every parameter)
    assert max(real[r][0] for r in range(world)) == predicted[0]


@pytest.mark.slow
def test_a_micro_batch_split_over_more_ranks_holds_less_on_each():
    # the same 97-token micro-batch over a world of 4: whole on each rank, split over 2, over 4
    peaks = [_estimate(4, sp, {}) for sp in (1, 2, 4)]
    assert peaks[0][0] > peaks[1][0] > peaks[2][0]
    # the state is sharded over the whole world whatever the split
    assert len({(p[1]["parameters"], p[1]["optimizer_state"]) for p in peaks}) == 1


@pytest.mark.slow
def test_a_sequence_no_world_holds_unsplit_names_the_smallest_sequence_parallel_size():
    from batchfit.budget import profile_model
    from batchfit.errors import DoesNotFitError

    # tiny at 65,536 tokens: the full head alone needs 768.75 MiB against a 365.71 MiB limit on any world
    # size; split over 2 ranks it still does not fit, over 4 it does (4 query heads: 8 cannot split them)
    with pytest.raises(DoesNotFitError, match=r"sequence parallelism 4 over 8 GPUs does") as info:
        profile_model("tiny", max_seq_len=65536, backend="estimate", memory_limit="1GiB", sharding=Sharding("fsdp2", world_size=8))
    assert info.value.sequence_parallel_hint == 4 and info.value.world_size_hint == 8
    assert "sharding=Sharding('fsdp2', world_size=8, sequence_parallel=4), cost='packed'" in str(info.value)
