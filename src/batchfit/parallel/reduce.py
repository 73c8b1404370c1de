"""Figures a training loop logs, reduced over the ranks; and whether the ranks hold the same parameters.

- :func:`reduce_figures`: the mean, sum, max or min over the ranks of a dict of floats (losses,
  token counts, peak bytes), in one all-reduce per kind of reduction (sum and mean share one;
  max and min share one).
- :func:`parameter_agreement`: a checksum of the model's parameters (gathered in full under
  FSDP2) compared over the ranks with one all-reduce; what a data-parallel run should end
  with, since ranks that drifted apart train silently wrong.

Both work without a process group (or a simulated one): they return this process' own
figures. Collectives run on the group's device: the current CUDA device for NCCL, the CPU
for gloo (:mod:`batchfit.parallel.distributed`). Every rank of the group must call them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from batchfit.errors import InvalidArgument
from batchfit.parallel.distributed import _reduce, get_world_size, is_distributed
from batchfit.validation import check_choice, short_repr

__all__ = ["REDUCTIONS", "ChecksumAgreement", "parameter_agreement", "parameter_checksum", "reduce_figures"]

REDUCTIONS = ("mean", "sum", "max", "min")


def reduce_figures(
    figures: Mapping[str, float], op: str | Mapping[str, str] = "mean", *, group: Any = None
) -> dict[str, float]:
    """``figures`` reduced over the ranks of ``group``: each rank passes the same keys.

    Args:
        figures: name -> this rank's number (int, float, 0-d tensor).
        op: one of :data:`REDUCTIONS` for every figure, or a mapping name -> reduction
            (names it leaves out are averaged).
        group: the process group (``None`` = the default group).

    Returns:
        name -> the reduced value (float), in ``figures``' order. Without a process group,
        or in a simulated one, the figures themselves (as floats).

    Raises:
        InvalidArgument: a figure that is not a finite-or-infinite real number, an unknown
            reduction, or an ``op`` mapping naming a figure not given.

    Example:
        >>> reduce_figures({"loss": 0.5, "peak_bytes": 1024}, {"peak_bytes": "max"})
        {'loss': 0.5, 'peak_bytes': 1024.0}
    """
    values: dict[str, float] = {}
    for name, value in figures.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise InvalidArgument(f"figures must be numbers, but got figures[{name!r}]={short_repr(value)}")
        values[name] = float(value)
    if isinstance(op, str):
        ops = dict.fromkeys(values, check_choice("op", op, REDUCTIONS))
    else:
        unknown = sorted(set(op) - set(values))
        if unknown:
            raise InvalidArgument(f"op names {unknown[0]!r}, which is not one of the figures {sorted(values)}")
        ops = {name: check_choice(f"op[{name!r}]", op.get(name, "mean"), REDUCTIONS) for name in values}
    if not is_distributed(group):
        return values
    world = get_world_size(group)
    summed = [k for k in values if ops[k] in ("mean", "sum")]
    extreme = [k for k in values if ops[k] in ("max", "min")]
    out = dict(values)
    if summed:  # one SUM all-reduce for sums and means
        for k, v in zip(summed, _reduce([values[k] for k in summed], dist.ReduceOp.SUM, group, torch.float64)):
            out[k] = v / world if ops[k] == "mean" else v
    if extreme:  # one MAX all-reduce: min(x) = -max(-x)
        signs = [1.0 if ops[k] == "max" else -1.0 for k in extreme]
        reduced = _reduce([s * values[k] for s, k in zip(signs, extreme)], dist.ReduceOp.MAX, group, torch.float64)
        for s, k, v in zip(signs, extreme, reduced):
            out[k] = s * v
    return out


def parameter_checksum(model: torch.nn.Module) -> float:
    """``Σ p + Σ p²`` over every parameter of ``model`` in float64 (FSDP2's gathered in full: a collective).

    Deterministic: the same parameters give the same float bit for bit, so ranks compare it
    exactly. Under FSDP2 every rank of the mesh must call it (``full_tensor`` all-gathers).
    """
    total = torch.zeros((), dtype=torch.float64)
    for p in dict.fromkeys(model.parameters()):  # tied weights once
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        t = full.detach().to("cpu", torch.float64)
        total += t.sum() + (t * t).sum()
    return float(total)


@dataclass(frozen=True)
class ChecksumAgreement:
    """This rank's parameter checksum and the range over the ranks.

    Attributes:
        checksum: this rank's :func:`parameter_checksum`.
        low, high: the smallest and largest checksum of any rank.
        world_size: ranks compared (1 without a process group).
    """

    checksum: float
    low: float
    high: float
    world_size: int

    @property
    def equal(self) -> bool:
        """Every rank holds the same parameters (checksums equal bit for bit)."""
        return self.low == self.high

    def __str__(self) -> str:
        if self.equal:
            where = "(one rank)" if self.world_size == 1 else f"on all {self.world_size} ranks"
            return f"ranks agree: parameter checksum {self.checksum:.6e} {where}"
        return (
            f"ranks differ: parameter checksums range from {self.low:.9e} to {self.high:.9e} over "
            f"{self.world_size} ranks (this rank: {self.checksum:.9e})"
        )


def parameter_agreement(model: torch.nn.Module, *, group: Any = None) -> ChecksumAgreement:
    """Compare :func:`parameter_checksum` over the ranks of ``group`` with one all-reduce (max of ``c`` and ``-c``).

    Every rank gets the same answer. Without a process group: one rank, equal.

    Example:
        >>> parameter_agreement(torch.nn.Linear(2, 1)).equal
        True
    """
    c = parameter_checksum(model)
    if not is_distributed(group):
        return ChecksumAgreement(c, c, c, 1)
    high, neg_low = _reduce([c, -c], dist.ReduceOp.MAX, group, torch.float64)
    return ChecksumAgreement(c, -neg_low, high, get_world_size(group))
