"""All-reduce helpers that are a no-op without an initialised process group.

Every helper takes an optional ``group`` (``None`` = the default group). When
``torch.distributed`` is unavailable or not initialised, each returns its input, so
single-process code calls them unconditionally. Values travel as float64/int64 tensors
on the CPU, or on the current CUDA device for the NCCL backend.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_distributed(group: Any = None) -> bool:
    """True when a process group is initialised (and ``group``, if given, has > 1 member)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    return dist.get_world_size(group) > 1


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
    dist.all_reduce(t, op=op, group=group)
    return t.cpu().tolist()


def all_reduce_max(value: int, group: Any = None) -> int:
    """The largest ``value`` over the ranks of ``group``."""
    return int(_reduce([value], dist.ReduceOp.MAX, group, torch.int64)[0]) if is_distributed(group) else value


def all_reduce_min(value: int, group: Any = None) -> int:
    """The smallest ``value`` over the ranks of ``group``."""
    return int(_reduce([value], dist.ReduceOp.MIN, group, torch.int64)[0]) if is_distributed(group) else value


def all_reduce_sum(value: int, group: Any = None) -> int:
    """The sum of ``value`` over the ranks of ``group``."""
    return int(_reduce([value], dist.ReduceOp.SUM, group, torch.int64)[0]) if is_distributed(group) else value


def all_reduce_any(flag: bool, group: Any = None) -> bool:
    """True if ``flag`` is true on any rank of ``group``."""
    return all_reduce_max(int(bool(flag)), group) > 0


def all_reduce_all(flag: bool, group: Any = None) -> bool:
    """True if ``flag`` is true on every rank of ``group``."""
    return all_reduce_min(int(bool(flag)), group) > 0


def all_reduce_max_list(values: list[int], group: Any = None) -> list[int]:
    """Element-wise maximum of an integer list over the ranks (same length on every rank)."""
    return [int(v) for v in _reduce(list(values), dist.ReduceOp.MAX, group, torch.int64)]
