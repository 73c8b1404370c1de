"""batchfit.budget.megatron_probe: token budgets for Megatron layouts, estimate vs real gloo ranks (second tier).

The budget :func:`batchfit.budget.find_token_budget` finds with :class:`MegatronStep` on the
estimate backend (the simulated world, every pipeline stage simulated as itself) equals the one it
finds on the cpu backend on 2 real gloo ranks, to the token, at TP 2 and at PP 2; doubling the
tensor parallelism raises it. Skipped where megatron-core or mbridge is not installed.
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

pytestmark = pytest.mark.slow

LIMIT, MAX_SEQ_LEN, LAYERS = "24MiB", 128, 2


def _budget(backend_name: str, tp: int, pp: int, **probe: object) -> dict[str, object]:
    import warnings

    from batchfit.budget import find_token_budget
    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    backend = get_backend(backend_name, memory_limit=LIMIT, reserve_bytes=0, round_to=1)
    step = MegatronStep("tiny", tensor_parallel=tp, pipeline_parallel=pp, backend=backend, num_layers=LAYERS, **probe)
    budget = find_token_budget(step, max_seq_len=MAX_SEQ_LEN, cost="padded", progress=False)
    return {
        "tokens": budget.tokens,
        "points": [(p.seq_len, p.tokens) for p in budget.points],
        "stage_peaks": dict(step.stage_peaks),
        "binding_stage": step.binding_stage,
    }


def _real_rank(rank: int, tp: int, pp: int, probe: dict[str, object] | None = None) -> dict[str, object]:
    return _budget("cpu", tp, pp, **(probe or {}))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_estimate_budget_equals_the_real_ranks_budget_to_the_token(megatron, tp, pp):
    real = run_ranks(_real_rank, tp, pp, world=tp * pp, timeout=400)
    estimate = _budget("estimate", tp, pp)
    for rank in real:
        assert (real[rank]["tokens"], real[rank]["points"]) == (estimate["tokens"], estimate["points"]), rank
    if pp == 2:
        # the last measurement (the search's last probe) was measured on every stage; each real
        # rank measured its own, the same peaks
        assert set(estimate["stage_peaks"]) == {0, 1}


def test_a_forward_only_budget_on_the_estimate_equals_the_real_ranks_and_exceeds_training(megatron):
    # NOTE [ Forward-only Megatron probes ]: old log-probs at TP 2 with the optimizer state resident
    probe = {"forward_only": True, "optimizer": "resident"}
    real = run_ranks(_real_rank, 2, 1, probe, world=2, timeout=400)
    estimate = _budget("estimate", 2, 1, **probe)
    for rank in real:
        assert (real[rank]["tokens"], real[rank]["points"]) == (estimate["tokens"], estimate["points"]), rank
    # docs/megatron.md: 3,456 tokens where TP 2's training step fits 1,280
    assert estimate["tokens"] > _budget("estimate", 2, 1)["tokens"]


def test_doubling_tensor_parallelism_raises_the_budget(megatron):
    assert _budget("estimate", 2, 1)["tokens"] > _budget("estimate", 1, 1)["tokens"]


def test_the_binding_stage_is_measured_on_every_stage(megatron):
    from batchfit.budget.megatron_probe import MegatronStep, stage_measurements
    from batchfit.memory import get_backend

    backend = get_backend("estimate", reserve_bytes=0, round_to=1)
    step = MegatronStep("tiny", pipeline_parallel=2, backend=backend, num_layers=LAYERS)
    got = step.measure([64, 64])
    stages = stage_measurements(step, [64, 64])
    assert step.stage_peaks == {s: m.peak_bytes for s, m in stages.items()}
    assert got.peak_bytes == max(step.stage_peaks.values())
    # 1F1B at PP 2: the first stage holds 2 micro-batches in flight and binds on the tiny model;
    # the last holds the head (docs/megatron.md: 4,085,796 vs 3,832,396 B at 4 micro-batches)
    assert step.binding_stage == 0
    assert "logprob_head" in stages[1].breakdown and "logprob_head" not in stages[0].breakdown


def test_bad_layouts_are_refused(megatron):
    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    backend = get_backend("estimate", reserve_bytes=0)
    with pytest.raises(InvalidArgument, match="micro_batches=4 needs pipeline_parallel"):
        MegatronStep("tiny", micro_batches=4, backend=backend)
    step = MegatronStep("tiny", backend=get_backend("cpu"), num_layers=1)
    with pytest.raises(InvalidArgument, match="1 real ranks, but the process group has None"):
        step.measure([8])
    with pytest.raises(InvalidArgument, match="lengths must be a non-empty"):
        MegatronStep("tiny", backend=backend).measure([])
