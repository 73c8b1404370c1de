"""Commands run under torchrun: whether this process is one of its ranks, joining them, agreeing on the arguments.

Shared by the commands that run on real ranks (``batchfit demo``; ``batchfit profile`` with
``--backend cpu|cuda``). NOTE [ Ranks agree or say why ] in
:mod:`batchfit.parallel.distributed`: ranks launched with different arguments would plan
differently and deadlock (or abort) in the first collective that disagrees, so right
after joining, every rank compares a fingerprint of its arguments and all fail with one
line naming the differing flag.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

from batchfit.errors import InvalidArgument

__all__ = ["check_same_flags", "launched_by_torchrun", "launched_world", "process_group", "require_torchrun"]


def launched_world() -> int:
    """Ranks torchrun launched this process among (``WORLD_SIZE``), 1 without torchrun."""
    raw = os.environ.get("WORLD_SIZE", "1")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def launched_by_torchrun() -> bool:
    """torchrun (or another launcher) set ``RANK`` and ``WORLD_SIZE`` for this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def require_torchrun(what: str, command: str) -> None:
    """Raise when ``what`` (e.g. ``"--sharding fsdp2"``) needs torchrun's ranks and this process has none.

    Raises:
        InvalidArgument: one line saying how to launch ``command`` under torchrun.
    """
    if not launched_by_torchrun():
        raise InvalidArgument(
            f"{what} runs on several ranks, but this process was not launched by torchrun (RANK is not set); "
            f"run torchrun --nproc-per-node 2 -m batchfit {command} {what}, or drop {what.split()[0]}"
        )


@contextlib.contextmanager
def process_group(device: str = "cpu") -> Iterator[int]:
    """Join torchrun's ranks for the block (gloo for ``cpu``, NCCL on ``LOCAL_RANK``'s GPU for ``cuda``); yield this rank.

    Without torchrun, or when a group is already initialised, nothing is joined (yields the
    current rank, 0 without a group); the group joined here is destroyed on exit. Its
    collectives time out after ``$BATCHFIT_TIMEOUT`` seconds (:func:`collective_timeout`).
    """
    import torch
    import torch.distributed as dist

    from batchfit.parallel.distributed import collective_timeout
    from batchfit.parallel.process_exit import note_joined

    if not launched_by_torchrun() or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=collective_timeout())
    note_joined()  # NOTE [ A collective's worker outlives the interpreter ]: batchfit's main exits without finalizing
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


def check_same_flags(args: argparse.Namespace, names: Iterable[str], command: str) -> None:
    """Raise on every rank when the ranks were launched with different values of the flags ``names``.

    One all-reduce of a fingerprint (:func:`batchfit.parallel.distributed.check_same_arguments`);
    a no-op without a process group. Flags are named as typed (``--seed``).

    Raises:
        InvalidArgument: ``every rank must pass the same arguments to batchfit <command>, but
            they differ: --seed: rank 0 has 0, rank 1 has 1``.
    """
    from batchfit.parallel.distributed import check_same_arguments

    values: dict[str, Any] = {"--" + name.replace("_", "-"): getattr(args, name, None) for name in names}
    check_same_arguments(values, what=f"batchfit {command}")
