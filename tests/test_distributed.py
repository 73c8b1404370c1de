"""batchfit.parallel.distributed: simulated ranks for estimates, and helpers that treat them as one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from batchfit import InvalidArgument
from batchfit.parallel.distributed import (
    all_reduce_max,
    get_world_size,
    is_distributed,
    is_simulated,
    simulated_world,
)
from multirank import run_ranks


def test_simulated_world_is_a_fake_group_of_that_size_and_is_destroyed_on_exit():
    with simulated_world(8):
        assert dist.get_world_size() == 8 and dist.get_rank() == 0 and is_simulated()
        assert get_world_size() == 8
        # one real process: the agreement helpers do not communicate
        assert not is_distributed() and all_reduce_max(5) == 5
        with simulated_world(8):  # re-entrant for the same size
            assert dist.get_world_size() == 8
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_simulated_world_of_another_size_inside_one_is_an_error():
    with (
        simulated_world(4),
        pytest.raises(InvalidArgument, match=r"a simulated one of 4 ranks is initialised"),
        simulated_world(8),
    ):
        pass
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0])
def test_simulated_world_rejects_a_bad_size(world_size):
    with pytest.raises(InvalidArgument, match="world_size"), simulated_world(world_size):
        pass


def _simulate_inside_a_real_group(rank: int) -> str:
    try:
        with simulated_world(8):
            return "entered"
    except InvalidArgument as exc:
        return str(exc)


def test_simulating_inside_a_real_process_group_names_the_fix():
    got = run_ranks(_simulate_inside_a_real_group, world=2, timeout=120)
    for message in got.values():
        assert "a real (gloo) one of 2 ranks is initialised" in message
        assert "estimate outside torchrun" in message


# --------------------------------------------------------------------------- ranks agree or say why


def _budget_on_ranks(rank: int, case: str) -> str:
    """Run find_token_budget with a per-rank twist; return the outcome as text (never hang)."""
    import os

    import torch

    from batchfit.budget import find_token_budget
    from batchfit.memory import get_backend

    calls = []

    def step(lengths: list[int]) -> None:
        calls.append(len(lengths))
        if case == "probe-raises" and rank == 1:
            raise RuntimeError("a bug in rank 1's step")
        if case == "killed" and rank == 1 and len(calls) == 2:
            os._exit(3)
        torch.zeros(sum(lengths) * 16)

    kwargs = {"max_seq_len": 64, "safety_margin": 0.9}
    if case == "setup-fails" and rank == 1:
        kwargs["safety_margin"] = 2.0
    if case == "different-arguments":
        kwargs["max_seq_len"] = 64 >> rank
    try:
        budget = find_token_budget(step, backend=get_backend("cpu", memory_limit="1MiB"), progress=False, **kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {budget.tokens}"


def _batch_size_on_ranks(rank: int, case: str) -> str:
    import torch

    from batchfit.autobatch import find_batch_size
    from batchfit.memory import get_backend

    kwargs = {"max_batch_size": 512}
    if case == "different-arguments":
        kwargs["max_batch_size"] = 512 >> (3 * rank)
    if case == "setup-fails" and rank == 1:
        kwargs["min_batch_size"] = 0
    try:
        found = find_batch_size(
            lambda b: torch.zeros(b, 1024), backend=get_backend("cpu", memory_limit="4MiB"), progress=False, **kwargs
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"ok {found.batch_size}"


@pytest.mark.parametrize("search", [_budget_on_ranks, _batch_size_on_ranks], ids=["budget", "autobatch"])
def test_a_rank_that_fails_in_setup_makes_every_rank_raise_at_once(search):
    got = run_ranks(search, "setup-fails", timeout=60)
    assert got[1].startswith("InvalidArgument")  # its own error, unchanged
    assert got[0].startswith("BatchfitError: rank 1 raised during find_")  # not a 30-minute hang


@pytest.mark.parametrize("search", [_budget_on_ranks, _batch_size_on_ranks], ids=["budget", "autobatch"])
def test_ranks_that_pass_different_arguments_all_raise_naming_them(search):
    got = run_ranks(search, "different-arguments", world=3, timeout=90)
    name = "max_seq_len" if search is _budget_on_ranks else "max_batch_size"
    for message in got.values():
        assert message.startswith("InvalidArgument: every rank must pass the same arguments"), message
        assert f"{name}: rank 0 has " in message and "rank 2 has" in message


def test_a_probe_that_raises_on_one_rank_raises_on_every_rank():
    got = run_ranks(_budget_on_ranks, "probe-raises", timeout=60)
    assert got[1] == "RuntimeError: a bug in rank 1's step"
    assert got[0].startswith("BatchfitError: rank 1 raised during the probe of 1 sequence (64 tokens, the longest 64)")


def test_a_rank_killed_mid_search_becomes_an_error_naming_it():
    got = run_ranks(_budget_on_ranks, "killed", timeout=60, silent=(1,))
    assert got[0].startswith("BatchfitError: rank 0 lost rank 1"), got[0]


# --------------------------------------------------------------------------- one timeout setting


def test_the_collective_timeout_comes_from_one_environment_variable(monkeypatch):
    import datetime

    from batchfit.parallel.distributed import DEFAULT_TIMEOUT_SECONDS, collective_timeout, search_timeout

    monkeypatch.delenv("BATCHFIT_TIMEOUT", raising=False)
    assert collective_timeout() == datetime.timedelta(seconds=DEFAULT_TIMEOUT_SECONDS)
    monkeypatch.setenv("BATCHFIT_TIMEOUT", "2.5")
    assert collective_timeout() == search_timeout() == datetime.timedelta(seconds=2.5)  # no process group


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_bad_timeout_setting_names_the_variable_and_the_fix(monkeypatch, value):
    from batchfit.parallel.distributed import collective_timeout

    monkeypatch.setenv("BATCHFIT_TIMEOUT", value)
    with pytest.raises(InvalidArgument, match=rf"BATCHFIT_TIMEOUT must be a positive number of seconds, but got BATCHFIT_TIMEOUT='{value}'"):
        collective_timeout()


def test_without_ranks_the_store_exchange_and_the_search_guard_do_nothing():
    from batchfit.budget.guard import guarded_search
    from batchfit.parallel.distributed import gather_through_store

    assert gather_through_store("k", "text", what="a step") == {0: "text"}
    with guarded_search("find_token_budget(role=None)") as guard:
        assert guard is None
