"""No rank hangs a search on real ranks (NOTE [ One rank runs out ] in batchfit.budget.guard).

Spawned gloo ranks (tests/multirank.py, a hang fails the test): FSDP2 profiles with uneven
shards at a limit that one rank's step crosses where another's does not, a rank that skips
the search, a rank interrupted mid-search, and ranks that build different models.
"""

from __future__ import annotations

import os

import pytest
import torch

from multirank import run_ranks

pytestmark = pytest.mark.timeout(300)

#: The join timeout the ranks of these tests use ($BATCHFIT_TIMEOUT): a rank that skips a search is noticed after it.
JOIN_SECONDS = "8"


def _config(**changes):
    """The tiny preset with a vocabulary of 1001 rows: FSDP2's shards of it differ on 2, 3 and 4 ranks."""
    from batchfit.models import load_config

    config = load_config("tiny")
    for key, value in {"vocab_size": 1001, **changes}.items():
        setattr(config, key, value)
    return config


def _own_peaks():
    """Record this rank's own peak of every measured step (the search only keeps the agreed maximum)."""
    from batchfit.budget.step import TrainingStep

    own: list[tuple[int, int]] = []
    measure = TrainingStep.measure

    def recording(self, lengths):
        m = measure(self, lengths)
        own.append((sum(lengths), int(m.peak_bytes)))
        return m

    TrainingStep.measure = recording
    return own


def _uneven_profile(world: int) -> tuple[int, list[tuple[int, int]], int]:
    """Profile FSDP2 over ``world`` ranks at a limit between the ranks' own peaks of 5 rows: (tokens, own peaks, limit)."""
    from batchfit.budget import causal_lm_step, profile_model
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm
    from batchfit.parallel import Sharding
    from batchfit.parallel.distributed import all_reduce_max, all_reduce_min

    sharding = Sharding("fsdp2", world_size=world)
    # the limit: halfway between the smallest and the largest rank's peak of 5 rows of 64
    be = get_backend("cpu")
    step = causal_lm_step(build_causal_lm(_config(), backend=be, dtype="fp32", sharding=sharding), backend=be)
    five = step.measure([64] * 5).peak_bytes
    low, high = all_reduce_min(five), all_reduce_max(five)
    del step
    limit = (low + high) // 2
    own = _own_peaks()
    # the device twice the limit: no probe is predicted above it, so 5 rows are measured (the "+ 1" of 4)
    profile = profile_model(
        _config(), max_seq_len=64, seq_lens=[64], backend="cpu", memory_limit=2 * limit, safety_margin=0.5,
        dtype="fp32", sharding=sharding, progress=False,
    )
    return profile.combined.tokens, own, limit


def _outcome(fn) -> str:
    try:
        return f"ok {fn()}"
    except BaseException as exc:  # an interrupt too: what the rank ends with
        return f"{type(exc).__name__}: {exc}"


def _interrupted_fsdp2_search(rank: int, world: int) -> int:
    """An FSDP2 budget search in which the last rank raises SystemExit between two layers of its third probe."""
    from batchfit.budget import causal_lm_step, find_token_budget
    from batchfit.memory import get_backend
    from batchfit.models import build_causal_lm
    from batchfit.parallel import Sharding

    be = get_backend("cpu", memory_limit="16MiB")
    model = build_causal_lm(_config(), backend=be, dtype="fp32", sharding=Sharding("fsdp2", world_size=world))
    step = causal_lm_step(model, backend=be)
    runs = {"probes": 0}
    measure = step.measure

    def counted(lengths):
        runs["probes"] += 1
        return measure(lengths)

    def leave(*args):
        if rank == world - 1 and runs["probes"] == 3:
            raise SystemExit(5)

    step.measure = counted
    model.model.layers[1].register_forward_pre_hook(leave)
    return find_token_budget(step, max_seq_len=64, seq_lens=[64], progress=False).tokens


def _plain_search(rank: int, world: int, case: str) -> int:
    """A budget search of a plain step; the last rank is interrupted as ``case`` says."""
    from batchfit.budget import find_token_budget
    from batchfit.memory import get_backend

    odd = rank == world - 1
    calls = []

    def step(lengths: list[int]) -> None:
        calls.append(len(lengths))
        if odd and case == "interrupt-in-a-probe" and len(calls) == 2:
            raise KeyboardInterrupt
        torch.zeros(sum(lengths) * 16)

    def progress(event):
        if odd and case == "exit-between-probes" and event.probes == 2:
            raise SystemExit(4)

    budget = find_token_budget(
        step, max_seq_len=64, safety_margin=0.9, backend=get_backend("cpu", memory_limit="1MiB"), progress=progress
    )
    return budget.tokens


def _different_models(rank: int, world: int) -> None:
    from batchfit.budget import profile_model
    from batchfit.parallel import Sharding

    profile_model(
        _config(num_hidden_layers=2 + rank), max_seq_len=32, seq_lens=[32], backend="cpu", memory_limit="64MiB",
        dtype="fp32", sharding=Sharding("fsdp2", world_size=world), progress=False,
    )


def _ranks(rank: int, world: int, cases: tuple[str, ...]) -> dict[str, object]:
    """Each rank: the uneven profile, then ``cases`` in order, each case's outcome as text (the ranks never hang)."""
    import time

    os.environ["BATCHFIT_TIMEOUT"] = JOIN_SECONDS
    torch.set_num_threads(1)
    out: dict[str, object] = {"uneven": _uneven_profile(world)}
    for case in cases:
        if case == "different-models":
            out[case] = _outcome(lambda: _different_models(rank, world))
        elif case == "exit-in-fsdp2-step":
            out[case] = _outcome(lambda: _interrupted_fsdp2_search(rank, world))
        elif case == "skip" and rank == world - 1:
            time.sleep(2 * float(JOIN_SECONDS))  # alive, never joins
            out[case] = "skipped"
        else:
            out[case] = _outcome(lambda case=case: _plain_search(rank, world, case))
    return out


# the cases that leave the default group usable come first; "skip" makes the last rank's searches lag: last
CASES = {
    2: ("different-models",),
    3: ("exit-in-fsdp2-step", "interrupt-in-a-probe", "exit-between-probes", "skip"),
    4: (),
}


@pytest.fixture(scope="module", params=sorted(CASES), ids=lambda w: f"{w}-ranks")
def ranks(request) -> tuple[int, dict[int, dict[str, object]]]:
    world = request.param
    return world, run_ranks(_ranks, world, CASES[world], world=world, timeout=240)


def test_fsdp2_ranks_with_uneven_shards_end_with_the_same_budget_when_the_limit_falls_between_their_peaks(ranks):
    _, got = ranks
    tokens = {r: v["uneven"][0] for r, v in got.items()}
    assert len(set(tokens.values())) == 1 and tokens[0] == 4 * 64, got  # 4 rows fit on every rank, 5 on none
    limit = got[0]["uneven"][2]
    five = {r: dict(v["uneven"][1])[5 * 64] for r, v in got.items()}
    # the premise: a step stopped at the limit would have stopped mid-step on some ranks only
    assert min(five.values()) <= limit < max(five.values()), (five, limit)


def _case(ranks, case):
    world, got = ranks
    if case not in CASES[world]:
        pytest.skip(f"{case} runs on {[w for w, c in CASES.items() if case in c]} ranks")
    return world, {r: v[case] for r, v in got.items()}


def test_ranks_that_build_different_models_fail_with_one_line_naming_the_difference(ranks):
    _, got = _case(ranks, "different-models")
    for message in got.values():
        assert message.startswith("InvalidArgument: every rank must build the same model to shard it"), got
        assert "config.num_hidden_layers: rank 0 has 2, rank 1 has 3" in message and "\n" not in message
        assert "parameters: rank 0 has 21 tensors" in message and "rank 1 has 30 tensors" in message


def test_an_exit_in_the_middle_of_a_sharded_step_ends_the_others_with_a_batchfit_error(ranks):
    world, got = _case(ranks, "exit-in-fsdp2-step")
    assert got[world - 1] == "SystemExit: 5", got  # its own, re-raised once the others were told
    for rank in range(world - 1):
        assert got[rank].startswith(f"BatchfitError: rank {world - 1} was interrupted (KeyboardInterrupt or SystemExit) during the probe of "), got


def test_an_interrupt_in_a_probe_ends_the_others_with_a_batchfit_error(ranks):
    world, got = _case(ranks, "interrupt-in-a-probe")
    assert got[world - 1] == "KeyboardInterrupt: ", got
    for rank in range(world - 1):
        assert got[rank].startswith(f"BatchfitError: rank {world - 1} was interrupted"), got


def test_an_exit_between_probes_ends_the_others_with_a_batchfit_error(ranks):
    world, got = _case(ranks, "exit-between-probes")
    assert got[world - 1] == "SystemExit: 4", got
    for rank in range(world - 1):
        assert got[rank].startswith(f"RankLeftSearch: rank {world - 1} left find_token_budget(role=None) alone (SystemExit: 4)"), got


def test_a_rank_that_skips_a_search_is_named_on_every_other_rank(ranks):
    world, got = _case(ranks, "skip")
    assert got[world - 1] == "skipped"
    for rank in range(world - 1):
        assert got[rank].startswith(f"BatchfitError: rank {rank} waited 8 s for rank {world - 1} to start search "), got
