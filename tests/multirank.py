"""Run a test function on several gloo ranks, each a process of its own, bounded by timeouts.

A rank that hangs (stuck in a collective) makes the test fail instead of stalling CI; an
exception on a rank is reported back as ``("error", repr(exc))`` instead of hanging the parent.

Every timeout in the tests derives from one setting (:func:`scaled`): it multiplies the base
seconds written in the tests (pytest-timeout's per-test limit, the queue wait here, the gloo
process-group timeout, subprocess timeouts) by :func:`timeout_scale`, read when each timeout
is set: ``BATCHFIT_TEST_TIMEOUT_SCALE`` when given, else twice the machine's load per core at
that moment, so a machine that gets busier during the run waits longer instead of failing.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
from collections.abc import Callable
from typing import Any

import pytest

#: The environment variable that scales every timeout in the tests (a positive number).
TIMEOUT_SCALE_ENV = "BATCHFIT_TEST_TIMEOUT_SCALE"

#: Seconds the ranks' process group waits for a peer in a collective, before scaling.
GROUP_TIMEOUT = 60.0


#: Every timeout is at least this many times its base: a timeout only catches hangs, so it can be
#: generous by construction; the load term covers a machine that gets busier during the run.
MIN_SCALE = 2.0


def load_per_core() -> float:
    """The machine's load per core now (1-minute average), at least 1: how much slower than unloaded it runs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / cores)


def timeout_scale() -> float:
    """The factor every timeout is multiplied by, read when the timeout is set, not once per session.

    ``BATCHFIT_TEST_TIMEOUT_SCALE`` when given (a positive number; a bad value is a usage error);
    otherwise :data:`MIN_SCALE` × the load per core at this moment, so a test started while
    another CPU-heavy job runs beside the suite waits longer (issue 28: a scale read at the start,
    x1, timed out a test once the load rose to 4-7).
    """
    raw = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    if not raw:
        return round(MIN_SCALE * load_per_core(), 1)
    try:
        scale = float(raw)
    except ValueError:
        scale = float("nan")
    if not scale > 0 or scale == float("inf"):
        raise pytest.UsageError(
            f"{TIMEOUT_SCALE_ENV}={raw!r} is not a positive number; set it to e.g. 1 (default) or 4 on a loaded machine"
        )
    return scale


def scaled(seconds: float) -> float:
    """``seconds`` (a test's timeout on an unloaded machine) times :func:`timeout_scale`."""
    return seconds * timeout_scale()


#: What the ranks' fork server imports once, so that a rank starts in a fraction of a second instead
#: of importing torch, transformers' model classes and batchfit itself (about 6 s per 2-rank run on
#: the shared 2-core machine, 0.3 s forked); a module that fails to import here is imported by the
#: rank that needs it.
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers.models.auto.modeling_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "batchfit.budget",
    "batchfit.memory",
    "batchfit.models",
    "batchfit.parallel",
    "batchfit.train",
    "multirank",
]


def context() -> Any:
    """The ranks' multiprocessing context: processes forked from a server that has imported :data:`PRELOAD`.

    The server is a fresh interpreter started once per test process (forking the test process
    itself, with its threads and state, would not be); each rank is a new process of its own, as
    with ``spawn``, and gets the caller's environment and ``sys.path`` when it starts (:func:`_entry`).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(
    worker: Callable[..., Any],
    rank: int,
    world: int,
    store_path: str,
    group_timeout: float,
    results: Any,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # the server's environment is the one of the test that started it: take the caller's
    os.environ.clear()
    os.environ.update(environ)
    import torch.distributed as dist

    # a file store: nothing listens on a port, so no other job can take it between choosing and binding
    store = dist.FileStore(store_path, world)
    timeout = datetime.timedelta(seconds=group_timeout)
    store.set_timeout(timeout)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        # Gloo's init is no barrier: a rank that connected, ran a short worker and left could close its
        # sockets while a peer was still connecting to it ("Connection closed by peer", that rank hung)
        dist.barrier()
    except BaseException as exc:  # report, do not hang the parent
        results.put((rank, ("error", f"{INIT_FAILED}{exc!r}")))
        return
    try:
        results.put((rank, worker(rank, *args)))
    except BaseException as exc:  # report, do not hang the parent
        results.put((rank, ("error", repr(exc))))
    finally:
        dist.destroy_process_group()


#: How a rank's report begins when its process group could not be set up (the others are not waited for).
INIT_FAILED = "the process group did not start: "


def run_ranks(
    worker: Callable[..., Any],
    *args: Any,
    world: int = 2,
    timeout: float = 90.0,
    silent: tuple[int, ...] = (),
) -> dict[int, Any]:
    """``{rank: worker(rank, *args)}`` from ``world`` gloo ranks (:func:`context`); fails the test on a hang or an error.

    ``worker`` must be a module-level function (it is pickled by name). Ranks in ``silent``
    are expected to exit without reporting (a rank killed on purpose); the others must report.
    ``timeout`` is the wait for each rank's result on an unloaded machine; it is :func:`scaled`,
    as is the ranks' process-group timeout (:data:`GROUP_TIMEOUT`).
    """
    ctx = context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="batchfit-ranks-") as folder:
        store_path = os.path.join(folder, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(worker, r, world, store_path, scaled(GROUP_TIMEOUT), results, args, dict(os.environ)),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        failed_to_start = False
        try:
            for _ in range(world - len(silent)):
                rank, value = results.get(timeout=scaled(timeout))
                got[rank] = value
                failed_to_start = isinstance(value, tuple) and value[:1] == ("error",) and value[1].startswith(INIT_FAILED)
                if failed_to_start:
                    break
        except queue.Empty:
            pytest.fail(
                f"a rank hung; got results from ranks {sorted(got)} of {world} in {scaled(timeout):.0f} s"
            )
        finally:
            for p in procs:
                if failed_to_start:  # the others wait for it in vain
                    p.kill()
                p.join(timeout=scaled(30))
                if p.is_alive():
                    p.kill()
    errors = {r: v for r, v in got.items() if isinstance(v, tuple) and v[:1] == ("error",)}
    assert not errors, errors
    return got
