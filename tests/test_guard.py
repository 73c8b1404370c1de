"""batchfit.budget.guard: one rank running out of memory in the middle of a sharded step hangs no rank.

Two real gloo ranks search the token budget of an FSDP2 model on the cpu backend; rank 1 runs
out of memory (an injected ``torch.OutOfMemoryError``, the type a CUDA allocator raises) at a
chosen probe and place (NOTE [ One rank runs out ]).
"""

from __future__ import annotations

import time

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.timeout(240)


def _search_with_an_oom(rank: int, where: str, at_probe: int) -> tuple[str, float]:
    """Each rank: the search's outcome (the budget, or the error) and how long the search took."""
    from batchfit.budget import causal_lm_step, find_token_budget
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm
    from batchfit.parallel import Sharding

    torch.set_num_threads(1)
    backend = get_backend("cpu", memory_limit="16MiB")
    model = build_causal_lm("tiny", backend=backend, dtype="fp32", sharding=Sharding("fsdp2", world_size=2))
    step = causal_lm_step(model, backend=backend)
    runs = {"probes": 0}
    measure = step.measure

    def counted(lengths):
        runs["probes"] += 1
        return measure(lengths)

    step.measure = counted

    def ran_out(*args, **kwargs):
        if rank == 1 and runs["probes"] == at_probe:
            raise torch.OutOfMemoryError("CUDA out of memory (injected on rank 1)")

    layers = model.model.layers
    if where == "forward":  # between two layers' all-gathers
        layers[1].register_forward_pre_hook(ran_out)
    else:  # after the step's last collective
        step.optimizer.register_step_pre_hook(ran_out)
    started = time.perf_counter()
    try:
        budget = find_token_budget(step, max_seq_len=64, seq_lens=[64], safety_margin=0.9, progress=False)
        outcome = f"budget {budget.tokens} in {budget.probes} probes"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.perf_counter() - started


def test_a_rank_that_runs_out_inside_a_sharded_forward_stops_every_rank_with_one_error():
    got = run_ranks(_search_with_an_oom, "forward", 2, timeout=180)
    (first, _), (second, _) = got[0], got[1]  # (outcome, seconds) per rank
    assert first == second, got  # the same error on every rank
    assert first.startswith(
        "ProbeAbandoned: rank 1 ran out of memory in the middle of the probe of "
    ) and "the model's process group cannot be used again" in first
    # rank 0 gave up its all-gather when rank 1 said so: had it waited for the group's timeout
    # instead, its error would be the timeout's (a lost peer), not the same one as rank 1's
    assert "timed out" not in first and "timeout" not in first.lower(), got


def test_a_rank_that_runs_out_after_the_last_collective_only_makes_that_candidate_not_fit():
    clean = run_ranks(_search_with_an_oom, "optimizer", 0, timeout=180)  # probe 0 never comes: no fault
    faulty = run_ranks(_search_with_an_oom, "optimizer", 2, timeout=180)
    assert clean[0][0] == clean[1][0] and clean[0][0].startswith("budget ")
    assert faulty[0][0] == faulty[1][0] and faulty[0][0].startswith("budget "), faulty  # the same answer on every rank


# --------------------------------------------------------------------------- only predicted fits


def test_the_bound_on_a_probes_peak_comes_from_the_measurements_so_far():
    from batchfit.budget.find import _predicted_peak
    from batchfit.budget.probe import Probe

    one = [Probe(1, 100, 1_000, fits=True)]
    # one probe: the line through the origin, 1,000 B per 100 tokens -> 3 × 100 tokens ≤ 3,000 B
    assert _predicted_peak(one, [100, 100, 100], 100) == 3_000
    two = [*one, Probe(2, 100, 1_500, fits=True)]
    # two: the line through them, 500 B per 100 tokens -> 1,500 + 2 × 500 = 2,500 B
    assert _predicted_peak(two, [100] * 4, 100) == 2_500
    assert _predicted_peak(two, [100], 100) == 1_500  # no larger than what was measured above it
    # a shorter length: bounded by a longer length's probe of at least as many tokens
    assert _predicted_peak(two, [50, 50, 50, 50], 50) == 1_500
    assert _predicted_peak(two, [50] * 5, 50) is None  # 250 tokens: nothing measured bounds it
    aborted = [Probe(1, 100, 9_999, fits=False, exceeded=True)]
    assert _predicted_peak(aborted, [100], 100) is None  # an aborted probe's peak is no measurement


def _synthetic_search(rank: int) -> tuple[int, list[tuple[int, int]], list[bool]]:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from batchfit.budget import find_token_budget
    from test_budget import SyntheticBackend, shape_step

    backend = SyntheticBackend(long_rows, 2_000_000_000)
    budget = find_token_budget(shape_step, max_seq_len=4096, backend=backend, safety_margin=0.9, progress=False)
    return budget.tokens, backend.calls, [t.predicted for t in budget.trials]


def long_rows(b, s):
    # rows whose attention is stored whole: at s = 4096 one row is 503,316,480 B, more than the
    # 10% between the search's limit (0.9 × 2e9) and the device, so 3 rows fit (1,519,949,440 B)
    # and a fourth would take the device over (2,023,265,920 B)
    return 10_000_000 + 30 * b * s * s


def test_real_ranks_never_run_a_probe_predicted_above_the_device_and_find_the_same_budget():
    from batchfit.budget import find_token_budget
    from test_budget import SyntheticBackend, shape_step

    one = SyntheticBackend(long_rows, 2_000_000_000)
    alone = find_token_budget(shape_step, max_seq_len=4096, backend=one, safety_margin=0.9, progress=False)
    assert (4, 4096) in one.calls  # one process measures the fourth row: it stops at the device, a GPU runs out
    got = run_ranks(_synthetic_search, timeout=120)
    tokens, calls, predicted = got[0]
    assert got[0] == got[1] and tokens == alone.tokens == 3 * 4096
    assert max(long_rows(b, s) for b, s in calls) <= 2_000_000_000 and (4, 4096) not in calls
    assert any(predicted)  # the fourth row: predicted not to fit, never run


# FSDP2 on 2, 3 and 4 ranks with uneven shards at a limit between their peaks: tests/test_no_hang.py
