"""What no tracker sees on a CUDA device, term by term, each with its source: :func:`untracked_memory`.

A tracker (and ``torch.cuda.max_memory_allocated``) counts tensors. A GPU also holds memory
that is no tensor; the estimate backend takes it off the device's memory as its reserve, and
the safety margin covers the rest:

- **CUDA context** (the driver's per-process state and the kernels loaded): 287,047,680 B
  measured with lazy module loading, which PyTorch sets when the user has not
  (``CUDA_MODULE_LOADING=LAZY``, PyTorch PR #86509, where 666,632,192 B was measured eager).
- **cuBLAS and cuBLASLt workspaces**: PyTorch gives each handle and stream a cuBLASLt
  workspace of 32 MiB on compute capability 9 and newer (Hopper, Blackwell), 4 MiB on Ampere
  with at least 24 GB, 1 MiB below (PyTorch PR #120925, after cuBLAS's own recommendation),
  and a cuBLAS workspace of the same size (``CUBLAS_WORKSPACE_CONFIG``): two per stream that
  runs matmuls, one stream here.
- **NCCL**: a communicator holds buffers for each channel and peer outside PyTorch's
  allocator, ``NCCL_BUFFSIZE`` (4 MiB by default, NCCL's documentation) per channel and
  direction; with ``channels`` channels in each direction a communicator holds
  ``2 × channels × 4 MiB``. NCCL picks the channel count at run time (up to 32 on NVLink
  systems): :data:`NCCL_CHANNELS` = 16 is an assumption, not a measurement, until
  ``batchfit profile --confirm --calibration`` measures the device. A sharded run has two
  communicators (the model's own group and the default group, NOTE [ A model's own process
  group ]); one rank has none.
- **The caching allocator**: what it reserves beyond what tensors hold (block rounding,
  segments that cannot serve a request of another size, memory kept for the next step) is
  not a fixed amount: it is covered by the safety margin (NOTE [ The margin's evidence ]).
  It depends on the allocator's configuration: with ``expandable_segments:True``
  (``PYTORCH_CUDA_ALLOC_CONF``) a segment grows in place instead of a new one being
  reserved, so ``reserved − allocated`` stays near the rounding; without it, blocks split
  for one size rarely serve another. The default margin is for the default allocator (no
  expandable segments); ``--confirm --calibration`` measures ``reserved − allocated`` under
  whatever configuration the process runs with, and its margin is the one to use then.

NOTE [ The margin's evidence ]
SkyRL PR #1610 measured its log-prob kernels on a B200 (183,359 MiB); the estimate backend
reproduces its measured rows (``python benchmarks/skyrl_b200.py``). The rows at 131,072
tokens and a 128K vocabulary ran out of memory there while their tensors peak at
156–158 GiB, 87.3–88.4% of the device; the largest row that ran peaked at 68% of it. A
margin of 0.9 of the memory left by the reserve would have called those rows "fits". The
default safety margin is therefore :data:`DEFAULT_SAFETY_MARGIN` = 0.85, below the smallest
fraction seen to run out, until ``--confirm --calibration`` replaces it with what the user's
own device reserves beyond what it allocates.

On an H200 (torch 2.11.0+cu130, ``python benchmarks/gpu_check.py``, docs/budget.md) qwen2.5-0.5b
at its budget, 16 × 4,096 tokens, allocated 126.80 GB (the estimate: 0.05% less) and the
caching allocator reserved 149.15 GB of the 149.56 GB the device allowed: 17.6% above what
tensors held, and 0.3% to spare under the default margin. The memory outside the allocator
after that step was 804,061,184 B against the 354,156,544 B of this module's terms for one
Hopper rank (context + workspaces): lazily loaded kernels of a whole training step, which
the margin covers as well. The calibration of that run gives a margin of 0.83.

NOTE [ The allocator's share ]
What the caching allocator holds beyond the tensors (``reserved − allocated``) depends on one
setting of the training processes, ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF``, and a
budget names the one it assumes (:data:`ALLOCATORS`); the safety margin it needs follows
(:data:`ALLOCATOR_MARGINS`), unless a margin is given or calibrated:

- ``caching`` (the default segments): each ``cudaMalloc`` segment is kept whole; a block freed
  inside it serves only requests that fit it, and a segment is given back only when every block
  in it is free. Over a run whose shapes change every step the holes grow: SkyRL saw out-of-memory
  errors from step 2 on with 15.50 GiB reserved but unallocated beside 124.24 GiB allocated (PR
  #1470, which turned expandable segments on by default), and one step of qwen2.5-0.5b on an
  H200 reserved 17.6% above its tensors. The margin is what
  :func:`batchfit.memory.calibration.calibrated_limits` derives from that overhead with its slack
  for what one step cannot show: 0.98 / 1.176 = 0.833 → **0.83**, until ``benchmarks/gpu_soak.py``
  measures a whole run.
- ``expandable_segments`` (``expandable_segments:True``): a segment is a range of virtual
  addresses mapped in pages; when a request finds no free block, the allocator unmaps the pages
  of the free blocks and maps what the request needs at the segment's end, so a hole never
  keeps memory from a request, and ``reserved − allocated`` is page rounding (2 MiB pages). The
  margin is the default **0.85**: the estimate missed 0.05% of an H200's step and the kernels a
  step loads lazily held 0.3% of the device (above), far inside it.

An engine's own allocator can rule them out: vLLM before 0.20.1 asserted that
``expandable_segments:True`` is not set beside its sleep mode's ``CuMemAllocator`` (NeMo-RL
#2319 met it on vLLM 0.17.1); since vLLM PR #40812 it switches them off around its own pool only
(``device_allocator/cumem.py`` in the 0.24.0 wheel). Every framework release batchfit reads pins
a later vLLM (verl 0.9.1: 0.24.0, SkyRL 0.4.0: 0.30.0, OpenRLHF 0.11.2: 0.29.0, TRL 1.16.0:
0.22–0.31), so none rules them out; with an older vLLM in the trainer's process, budget with
``allocator="caching"`` (``--allocator caching``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchfit.memory.sizes import MiB, format_bytes
from batchfit.plan.placement import ALLOCATOR_CONF, ALLOCATORS, DEFAULT_ALLOCATOR
from batchfit.validation import check_positive_int

#: The CUDA context with lazy module loading (PyTorch PR #86509, measured: 287,047,680 B).
CONTEXT_BYTES = 287_047_680
#: NCCL's buffer per channel and direction (``NCCL_BUFFSIZE``'s default).
NCCL_BUFFSIZE = 4 * MiB
#: Channels per communicator assumed (NCCL chooses at run time; up to 32 on NVLink systems).
NCCL_CHANNELS = 16
#: The safety margin each allocator setting needs when nothing calibrated it (NOTE [ The allocator's share ]).
ALLOCATOR_MARGINS = {"expandable_segments": 0.85, "caching": 0.83}
#: The safety margin when nothing calibrated it (NOTE [ The margin's evidence ]): the default allocator's.
DEFAULT_SAFETY_MARGIN = ALLOCATOR_MARGINS[DEFAULT_ALLOCATOR]

# compute capability of each device preset (the workspace size depends on it)
_CAPABILITY = {
    "h100": 9,
    "h200": 9,
    "h20": 9,
    "b200": 10,
    "b100": 10,
    "gb200": 10,
    "a100": 8,
    "a10": 8,
    "l4": 8,
    "l40": 8,
}


@dataclass(frozen=True)
class UntrackedMemory:
    """What no tracker sees on one rank's device, term by term (module docstring).

    Attributes:
        context_bytes: the CUDA context.
        workspace_bytes: cuBLAS and cuBLASLt workspaces.
        nccl_bytes: NCCL's buffers (0 for one rank).
    """

    context_bytes: int
    workspace_bytes: int
    nccl_bytes: int

    @property
    def reserve_bytes(self) -> int:
        """Their sum: what the estimate takes off the device's memory."""
        return self.context_bytes + self.workspace_bytes + self.nccl_bytes

    def describe(self) -> str:
        """``CUDA context 273.75 MiB + cuBLAS workspaces 64.00 MiB + NCCL 256.00 MiB``."""
        return (
            f"CUDA context {format_bytes(self.context_bytes)} + cuBLAS workspaces {format_bytes(self.workspace_bytes)} + "
            f"NCCL {format_bytes(self.nccl_bytes)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The terms and their sum as plain values."""
        return {**asdict(self), "reserve_bytes": self.reserve_bytes}


def workspace_bytes(capability: int, total_bytes: int | None = None) -> int:
    """cuBLAS + cuBLASLt workspace of one stream for a device of this compute capability (PyTorch PR #120925).

    Example:
        >>> workspace_bytes(9) // MiB, workspace_bytes(8, 80 * 2**30) // MiB, workspace_bytes(7) // MiB
        (64, 8, 2)
    """
    if capability >= 9:
        each = 32 * MiB
    elif capability == 8 and (total_bytes or 0) >= 24 * 2**30:
        each = 4 * MiB
    else:
        each = 1 * MiB
    return 2 * each


def untracked_memory(
    device: str | None = None, *, world_size: int = 1, total_bytes: int | None = None
) -> UntrackedMemory:
    """What no tracker sees on one rank of ``world_size`` for a device preset (``"h100-80gb"``) or an unknown one.

    An unknown device is taken for the newest kind (the largest workspaces).

    Raises:
        InvalidArgument: ``world_size`` is not a positive integer.
    """
    world_size = check_positive_int("world_size", world_size)
    name = (device or "").lower()
    capability = next((c for prefix, c in _CAPABILITY.items() if name.startswith(prefix)), 9)
    communicators = 2 if world_size > 1 else 0
    return UntrackedMemory(
        context_bytes=CONTEXT_BYTES,
        workspace_bytes=workspace_bytes(capability, total_bytes),
        nccl_bytes=communicators * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE,
    )


__all__ = [
    "ALLOCATORS",
    "ALLOCATOR_CONF",
    "ALLOCATOR_MARGINS",
    "CONTEXT_BYTES",
    "DEFAULT_ALLOCATOR",
    "DEFAULT_SAFETY_MARGIN",
    "NCCL_BUFFSIZE",
    "NCCL_CHANNELS",
    "UntrackedMemory",
    "untracked_memory",
    "workspace_bytes",
]
