"""batchfit.distributed: simulated ranks for estimates, and helpers that treat them as one process."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from batchfit import InvalidArgument
from batchfit.distributed import all_reduce_max, get_world_size, is_distributed, is_simulated, simulated_world
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
