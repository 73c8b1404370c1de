"""All-reduce helpers that are a no-op without an initialised process group.

Every helper takes an optional ``group`` (``None`` = the default group). When
``torch.distributed`` is unavailable or not initialised, each returns its input, so
single-process code calls them unconditionally. Values travel as float64/int64 tensors
on the CPU, or on the current CUDA device for the NCCL backend.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from batchfit.errors import BatchfitError, InvalidArgument
from batchfit.plan.packing import MicroBatchPlan
from batchfit.validation import check_positive_int, describe

T = TypeVar("T")

FAKE_BACKEND = "fake"

#: The environment variable that sets :func:`collective_timeout` (seconds).
TIMEOUT_ENV = "BATCHFIT_TIMEOUT"
#: :func:`collective_timeout` when :data:`TIMEOUT_ENV` is not set.
DEFAULT_TIMEOUT_SECONDS = 600.0


def collective_timeout() -> datetime.timedelta:
    """How long a rank waits for the others at most: the one setting every bound on real ranks derives from.

    ``$BATCHFIT_TIMEOUT`` seconds, else :data:`DEFAULT_TIMEOUT_SECONDS`. Pass it to
    ``init_process_group(timeout=...)`` (``batchfit`` under torchrun does); the process group
    of every model batchfit shards and the join of every search use :func:`search_timeout`,
    which is never longer than the default group's own timeout (NOTE [ One rank runs
    out ] in :mod:`batchfit.budget.guard`).

    Raises:
        InvalidArgument: ``$BATCHFIT_TIMEOUT`` is not a positive number.
    """
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_SECONDS)
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise InvalidArgument(
            f"{TIMEOUT_ENV} must be a positive number of seconds, but got {TIMEOUT_ENV}={text!r}; "
            f"set e.g. {TIMEOUT_ENV}=600 or unset it"
        )
    return datetime.timedelta(seconds=seconds)


def search_timeout() -> datetime.timedelta:
    """The bound on waiting for another rank: :func:`collective_timeout`, or the default group's own timeout if shorter."""
    bound = collective_timeout()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a store without a timeout
            own = dist.distributed_c10d._get_default_store().timeout
            if isinstance(own, datetime.timedelta) and own.total_seconds() > 0:
                bound = min(bound, own)
    return bound


def is_simulated(group: Any = None) -> bool:
    """True when ``group`` (default: the default group) is a fake process group (:func:`simulated_world`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return str(dist.get_backend(group)) == FAKE_BACKEND


def is_distributed(group: Any = None) -> bool:
    """True when other real processes share ``group``: initialised, > 1 member, not simulated."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1 and not is_simulated(group)


@contextlib.contextmanager
def simulated_world(world_size: int) -> Iterator[None]:
    """Simulate ``world_size`` ranks in this process (it is rank 0) with PyTorch's fake process group.

    Inside, the default process group has ``world_size`` members and every collective
    returns at once without communicating (``torch.testing._internal.distributed.fake_pg``),
    so FSDP2 and DTensor run their real code on one process: with the estimate backend's
    fake tensors this predicts one rank's memory. The all-reduce helpers of this module treat
    a simulated group as a single process. Re-entrant for the same ``world_size``; the
    group is destroyed on exit.

    Raises:
        InvalidArgument: a bad ``world_size``, or a real process group (or a simulated one
            of another size) is already initialised.

    Example:
        >>> with simulated_world(8):
        ...     dist.get_world_size()
        8
    """
    world_size = check_positive_int("world_size", world_size)
    if dist.is_initialized():
        if is_simulated() and dist.get_world_size() == world_size:
            yield
            return
        kind = "simulated" if is_simulated() else f"real ({dist.get_backend()})"
        raise InvalidArgument(
            f"simulating world_size={world_size} ranks needs no process group, but a {kind} one of "
            f"{dist.get_world_size()} ranks is initialised; estimate outside torchrun, or profile on the real "
            "ranks with backend='cpu' or 'cuda' and world_size equal to the group's size"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def get_rank(group: Any = None) -> int:
    """This process' rank in ``group``, 0 without a process group."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """Members of ``group``, 1 without a process group."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reduce(values: list[float], op: Any, group: Any, dtype: torch.dtype) -> list[float]:
    if not is_distributed(group):
        return values
    t = torch.tensor(values, dtype=dtype, device=_device(group))
    try:
        dist.all_reduce(t, op=op, group=group)
    except (RuntimeError, dist.DistError) as exc:  # DistBackendError / gloo's "Connection closed by peer"
        raise _lost_peer(group, exc) from exc
    return t.cpu().tolist()


def _lost_peer(group: Any, exc: BaseException) -> BatchfitError:
    me, world = get_rank(group), get_world_size(group)
    others = [r for r in range(world) if r != me]
    which = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
    first = " ".join(str(exc).split())[:200]
    return BatchfitError(
        f"rank {me} lost {which}: a collective failed ({first}); that rank exited, was killed or timed out"
    )


# NOTE [ Ranks agree or say why ]
# Ranks that run a search together must take every decision together: a rank that fails
# alone and stops (or waits) leaves the others blocked in the next collective until the
# process-group timeout. So every step that can fail on one rank only -- argument checks,
# backend construction, model building, each probe -- ends in one all-reduce carrying
# "rank r failed" (agree / agreed_max): the failing rank re-raises its own error, every
# other rank raises a BatchfitError naming it. Arguments that must match are compared once,
# by fingerprint (check_same_arguments). A collective that fails because a peer is gone
# becomes a BatchfitError naming the lost rank (_lost_peer).


def agreed_max(values: list[int], error: BaseException | None, *, group: Any = None, what: str) -> list[int]:
    """One all-reduce (max) of ``values`` that also agrees on errors (NOTE [ Ranks agree or say why ]).

    Args:
        values: this rank's integers (same length on every rank).
        error: this rank's exception from the step just run, or ``None``.
        what: the step, for messages (``"the probe at batch_size=8"``).

    Returns:
        The element-wise maximum over the ranks.

    Raises:
        this rank's ``error`` unchanged; else :class:`BatchfitError` when another rank failed
        (naming the highest-numbered failing rank), or when a peer is lost.
    """
    me = get_rank(group) + 1
    interrupted = error is not None and not isinstance(error, Exception)  # KeyboardInterrupt, SystemExit
    try:
        failed, stopped, *out = all_reduce_max_list(
            [me if error is not None else 0, me if interrupted else 0, *values], group
        )
    except BaseException:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise mark_agreed(error)
    if failed:
        how = "was interrupted (KeyboardInterrupt or SystemExit)" if stopped == failed else "raised"
        raise mark_agreed(BatchfitError(
            f"rank {failed - 1} {how} during {what}; rank {get_rank(group)} stops too (see rank {failed - 1}'s error)"
        ))
    return out


def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as raised on every rank after an agreement, and return it.

    A search that ends with it announces nothing to the other ranks (NOTE [ One rank runs
    out ] in :mod:`batchfit.budget.guard`): they raise theirs from the same agreement.
    """
    with contextlib.suppress(AttributeError, TypeError):
        exc.__batchfit_agreed__ = True  # type: ignore[attr-defined]
    return exc


def is_agreed(exc: BaseException) -> bool:
    """``exc`` was marked by :func:`mark_agreed`."""
    return bool(getattr(exc, "__batchfit_agreed__", False))


def agree(fn: Callable[[], T], *, group: Any = None, what: str) -> T:
    """Run ``fn()`` on every rank; if it raises on any rank, raise on every rank instead of hanging.

    Raises:
        this rank's exception unchanged, or :class:`BatchfitError` naming the rank that failed.
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except BaseException as exc:  # an interrupt too: agreed on, then re-raised on its own rank
        error = exc
    agreed_max([], error, group=group, what=what)
    return result


def check_same_arguments(arguments: Mapping[str, Any], *, group: Any = None, what: str) -> None:
    """Raise on every rank when ranks pass different ``arguments`` (compared by ``repr``).

    One all-reduce of a fingerprint; only when it differs, an ``all_gather_object`` finds the
    arguments and ranks to name.

    Raises:
        InvalidArgument: naming each differing argument and every rank's value.
    """
    if not is_distributed(group):
        return
    text = {k: repr(v) for k, v in arguments.items()}
    fingerprint = zlib.crc32(repr(sorted(text.items())).encode())
    high, low = all_reduce_max_list([fingerprint, -fingerprint], group)
    if high == -low:
        return
    gathered: list[Any] = [None] * get_world_size(group)
    try:
        dist.all_gather_object(gathered, text, group=group)
    except (RuntimeError, dist.DistError) as exc:
        raise _lost_peer(group, exc) from exc
    differing = [k for k in text if len({g.get(k) for g in gathered}) > 1]
    detail = "; ".join(
        f"{k}: " + ", ".join(f"rank {r} has {g.get(k)}" for r, g in enumerate(gathered)) for k in differing
    )
    raise mark_agreed(InvalidArgument(f"every rank must pass the same arguments to {what}, but they differ: {detail}"))


def gather_through_store(key: str, text: str, *, what: str, ranks: Sequence[int] | None = None) -> dict[int, str]:
    """Every rank's ``text`` under ``key``, exchanged through the default group's store, without a collective.

    Each rank sets ``batchfit/<key>/<rank>`` and waits, at most :func:`search_timeout`, for
    every other rank's. No collective is entered, so a rank that never comes (it failed
    earlier, skipped this step, or is in another one) cannot pair with another collective:
    the others stop waiting after the timeout and name it (NOTE [ One rank runs out ] in
    :mod:`batchfit.budget.guard`). ``key`` must name the step and its occurrence the same way
    on every rank; ``ranks`` (global ranks, default all) take part. Without real ranks:
    ``{0: text}``.

    Raises:
        BatchfitError: naming the ranks that did not arrive within the timeout and ``what``.
    """
    import time

    if not is_distributed():
        return {get_rank(): text}
    store = dist.distributed_c10d._get_default_store()
    me = get_rank()
    ranks = range(get_world_size()) if ranks is None else sorted(ranks)
    store.set(f"batchfit/{key}/{me}", text)
    timeout = search_timeout()
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        missing = [r for r in ranks if not store.check([f"batchfit/{key}/{r}"])]
        if not missing:
            return {r: store.get(f"batchfit/{key}/{r}").decode() for r in ranks}
        if time.monotonic() > deadline:
            who = f"rank {missing[0]}" if len(missing) == 1 else "ranks " + ", ".join(map(str, missing))
            raise mark_agreed(BatchfitError(
                f"rank {me} waited {timeout.total_seconds():g} s for {who} to reach {what}, in vain: every rank must "
                "take the same steps in the same order (one that skipped it, failed before it, crashed or hangs holds "
                f"up the others); the wait is the process group's timeout, at most ${TIMEOUT_ENV} seconds"
            ))
        time.sleep(0.05)


def differences(gathered: Mapping[int, Mapping[str, str]]) -> str:
    """``"name: rank 0 has a, rank 1 has b; …"`` for every entry that differs between the ranks' mappings."""
    names = list(dict.fromkeys(k for g in gathered.values() for k in g))
    differing = [k for k in names if len({g.get(k) for g in gathered.values()}) > 1]
    return "; ".join(
        f"{k}: " + ", ".join(f"rank {r} has {g.get(k)}" for r, g in sorted(gathered.items())) for k in differing
    )


def all_reduce_max(value: int, group: Any = None) -> int:
    """The largest ``value`` over the ranks of ``group``."""
    return int(_reduce([value], dist.ReduceOp.MAX, group, torch.int64)[0]) if is_distributed(group) else value


def all_reduce_min(value: int, group: Any = None) -> int:
    """The smallest ``value`` over the ranks of ``group``."""
    return int(_reduce([value], dist.ReduceOp.MIN, group, torch.int64)[0]) if is_distributed(group) else value


def all_reduce_max_list(values: list[int], group: Any = None) -> list[int]:
    """Element-wise maximum of an integer list over the ranks (same length on every rank)."""
    return [int(v) for v in _reduce(list(values), dist.ReduceOp.MAX, group, torch.int64)]



def sync_micro_batch_count(plan: MicroBatchPlan, group: Any = None) -> MicroBatchPlan:
    """Pad ``plan`` to the largest micro-batch count over the ranks of ``group``.

    For callers that plan per rank (each rank its own data): FSDP and DDP ranks must run
    the same number of forward/backward passes or they deadlock (SkyRL #1060). One MAX
    all-reduce of the count; the ranks short of it get padding micro-batches. A plan made
    with ``dp_size > 1`` over the whole mini-batch is already equal on every rank and needs
    no call. Every rank of ``group`` must call this (it is a collective).

    Args:
        plan: this rank's plan.
        group: a ``torch.distributed`` process group; ``None`` = the default group.

    Returns:
        ``plan`` itself without an initialised process group (or when nothing is missing),
        else ``plan.pad_to(max count)``.

    Raises:
        InvalidArgument: ``plan`` is not a :class:`MicroBatchPlan` or ``group`` not a process group.
    """
    if not isinstance(plan, MicroBatchPlan):
        raise InvalidArgument(
            f"plan must be a MicroBatchPlan (from batchfit.plan_micro_batches), but got plan={describe(plan)}"
        )
    if group is not None and not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise InvalidArgument(
            f"group must be None (the default group) or a torch.distributed process group, but got group={describe(group)}"
        )
    return plan.pad_to(all_reduce_max(plan.num_micro_batches, group))
