"""DeepSpeed ZeRO-1/2's partitioning of one parameter group, as arithmetic on element counts (no tensors, no ranks).

NOTE [ DeepSpeed's flat partitions ]
``DeepSpeedZeroOptimizer.__init__`` (deepspeed 0.19.8, ``deepspeed/runtime/zero/stage_1_and_2.py``)
flattens each optimizer parameter group's trainable parameters, in order, into one 16-bit
buffer padded at its end to a multiple of ``nccl_start_alignment_factor × dp`` elements
(``nccl_start_alignment_factor = 2``, "4-byte alignment/sizeof(fp16)";
``runtime/utils.align_dense_tensors``), points every parameter's ``.data`` into it, and cuts it
into ``dp`` equal partitions (``get_data_parallel_partitions``: ``numel // dp`` each, exact
because of the alignment). Rank ``r`` keeps an fp32 copy of partition ``r`` (the master
weights the optimizer steps, with Adam's two fp32 moments of the same size). ZeRO-2 keeps
gradients only for the parameters that start in the rank's partition, or straddle its start
(``get_partition_info``), each whole, in one 16-bit buffer ``grads_in_partition``
(``copy_grads_in_partition``); ZeRO-1 keeps every parameter's gradient. Both fill a
``reduce_bucket_size``-element 16-bit bucket during backward (``setup_buckets``,
``contiguous_gradients``, its default), two with ``overlap_comm``.
``parameter_alignment`` (off by default) and ``round_robin_gradients`` (off) are not reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchfit.errors import InvalidArgument
from batchfit.validation import check_positive_int

#: ``DeepSpeedZeroOptimizer.nccl_start_alignment_factor`` (4-byte alignment / sizeof(fp16)).
NCCL_START_ALIGNMENT_FACTOR = 2
#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements); OpenRLHF's ``"auto"`` keeps it.
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000


@dataclass(frozen=True)
class ZeroLayout:
    """One parameter group's flat buffer and its partitions over ``world_size`` ranks.

    Attributes:
        numels: the trainable parameters' element counts, in the group's order.
        world_size: data-parallel ranks.
        aligned_numel: the flat buffer's elements (``sum(numels)`` padded to ``2 × world_size``).
        partition_size: each rank's partition (``aligned_numel // world_size``).
    """

    numels: tuple[int, ...]
    world_size: int
    aligned_numel: int
    partition_size: int

    @property
    def numel(self) -> int:
        """The parameters' elements, padding excluded."""
        return sum(self.numels)

    def padding(self, rank: int) -> int:
        """Padding elements inside ``rank``'s partition (DeepSpeed's ``groups_padding``)."""
        start = rank * self.partition_size
        if self.numel <= start:
            return self.partition_size
        return max(0, start + self.partition_size - self.numel)

    def params_in_partition(self, rank: int) -> list[int]:
        """Indices of the parameters whose gradient ``rank`` keeps under ZeRO-2 (DeepSpeed's ``get_partition_info``).

        Those starting inside ``[rank × partition_size, (rank + 1) × partition_size)``, and the one
        straddling its start.
        """
        start, end = rank * self.partition_size, (rank + 1) * self.partition_size
        out, offset = [], 0
        for i, n in enumerate(self.numels):
            if start <= offset < end or offset < start < offset + n:
                out.append(i)
            offset += n
        return out

    def gradient_partition_numel(self, rank: int) -> int:
        """Elements of ZeRO-2's ``grads_in_partition`` on ``rank``: the whole of each parameter it keeps."""
        return sum(self.numels[i] for i in self.params_in_partition(rank))


def zero_layout(numels: Sequence[int], world_size: int) -> ZeroLayout:
    """DeepSpeed's flat buffer and partition sizes for a group of parameters of ``numels`` elements.

    NOTE [ DeepSpeed's flat partitions ] gives the rules and where they come from.

    >>> layout = zero_layout([33 * 65, 65, 65 * 7, 7], world_size=2)   # 2,672 elements
    >>> layout.aligned_numel, layout.partition_size, layout.padding(1)
    (2672, 1336, 0)
    >>> zero_layout([5], world_size=4).aligned_numel, zero_layout([5], world_size=4).padding(3)
    (8, 2)

    Raises:
        InvalidArgument: a bad ``world_size``, no parameters, or a negative count.
    """
    world_size = check_positive_int("world_size", world_size)
    counts = tuple(int(n) for n in numels)
    if not counts or any(n < 0 for n in counts):
        raise InvalidArgument(
            f"numels must list at least one parameter's element count, none negative, but got numels={list(counts)!r}; "
            "pass the trainable parameters' numel()"
        )
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    aligned = math.ceil(sum(counts) / alignment) * alignment
    return ZeroLayout(counts, world_size, aligned, aligned // world_size)
