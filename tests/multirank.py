"""Run a test function on several gloo ranks in spawned processes, bounded by timeouts.

A rank that hangs (stuck in a collective) makes the test fail instead of stalling CI; an
exception on a rank is reported back as ``("error", repr(exc))`` instead of hanging the parent.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import socket
from collections.abc import Callable
from typing import Any

import pytest


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(worker: Callable[..., Any], rank: int, world: int, port: int, results: Any, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results.put((rank, worker(rank, *args)))
    except BaseException as exc:  # report, do not hang the parent
        results.put((rank, ("error", repr(exc))))
    finally:
        dist.destroy_process_group()


def run_ranks(
    worker: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 90.0, silent: tuple[int, ...] = ()
) -> dict[int, Any]:
    """``{rank: worker(rank, *args)}`` from ``world`` spawned gloo ranks; fails the test on a hang or an error.

    ``worker`` must be a module-level function (spawn pickles it by name). Ranks in ``silent``
    are expected to exit without reporting (a rank killed on purpose); the others must report.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(worker, r, world, port, results, args)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(world - len(silent)):
            rank, value = results.get(timeout=timeout)
            got[rank] = value
    except queue.Empty:
        pytest.fail(f"a rank hung; got results from ranks {sorted(got)} of {world}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, v in got.items() if isinstance(v, tuple) and v[:1] == ("error",)}
    assert not errors, errors
    return got
