"""The ``estimate`` backend: the live-storage tracker under ``FakeTensorMode``, no allocation."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from batchfit.memory.cuda_untracked import UntrackedMemory, untracked_memory
from batchfit.memory.fake_fsdp1 import fsdp1_fake_patches
from batchfit.memory.fake_patches import transformers_fake_patches
from batchfit.memory.observed_fake import ObservedFakeTensorMode, ObservingTracker
from batchfit.memory.tracked_backend import TrackedBackend

#: Default storage rounding: the CUDA caching allocator hands out multiples of 512 bytes.
DEFAULT_ROUND_TO = 512

# NOTE [ Deep copies of fake tensors ]
# ``copy.deepcopy`` of a module built under the fake mode (``nn.TransformerEncoder`` clones its
# layers that way) copies each fake tensor's ``__dict__``, whose ``fake_mode`` is the mode
# itself: without help the copy gets a duplicate of the whole ``FakeTensorMode`` (converters,
# caches and all), its tensors belong to a mode that is never entered, and the process was seen
# to abort in the garbage collector ("corrupted double-linked list") after two such models were
# built and trained in one estimate. The backend's mode therefore deep-copies to itself. On the
# way, torch reads ``data_ptr()`` of each fake tensor and warns "Accessing the data pointer of
# FakeTensor is deprecated"; the pointer only selects ``clone()`` as the way to copy, which is
# right for fake tensors, so that one warning is ignored inside the estimate context (every
# other warning is shown as usual).
_DATA_PTR_WARNING = r"Accessing the data pointer of FakeTensor"


# NOTE [ Fake tensors need no threads ]
# The estimate computes nothing on its fake tensors; what it runs for real is small host work
# (synthetic rollouts, row layouts, the integer tensors it keeps). On a shared 2-core machine
# PyTorch's intra-op pool made that work slow: with another job running, each parallel op waited
# for a descheduled thread (``torch.isfinite`` on 23 × 4,095 floats: 30 ms with 2 threads, 0.3 ms
# with 1), and `batchfit profile --config examples/verl_grpo.yaml --emit verl` spent 36.5 s of CPU
# with 2 threads, 32.5 s with 1, the same output. The search runs with one thread and gives
# the caller's setting back.


# NOTE [ torch's fake dispatch cache is bounded ]
# torch keeps one FakeTensor dispatch cache for the whole process (``FakeTensorMode.cache``, a
# class attribute every mode shares) and never empties it: every op at a new shape adds its
# entries, so a long search over many token counts grows it without end (about 550 entries,
# 0.85 MiB, a probe of a tiny Qwen3-MoE: the part of a 235B search's host-memory climb that is
# not its models). Entries memoize output metadata only, so emptying the cache changes no
# measurement (the same peaks to the byte at 12 token counts, emptied before every probe or
# never); emptying it before every probe cost 57% more time, so it is emptied only before a
# trial that finds it past :data:`FAKE_CACHE_ENTRIES` (the main job's search leaves about 3,000).
FAKE_CACHE_ENTRIES = 50_000


def bound_fake_cache(entries: int | None = None) -> bool:
    """Empty torch's process-wide fake dispatch cache when it holds more than ``entries`` (default
    :data:`FAKE_CACHE_ENTRIES`; NOTE [ torch's fake dispatch cache is bounded ]); whether it was emptied."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if len(FakeTensorMode.cache) <= (FAKE_CACHE_ENTRIES if entries is None else entries):
        return False
    FakeTensorMode.cache_clear()
    return True


class EstimateBackend(TrackedBackend):
    """Predict a CUDA step's peak by running it on fake CPU tensors: shapes only, no memory.

    The model, optimizer and inputs must be created inside :meth:`context` (one
    ``FakeTensorMode`` per backend, kept for its lifetime; fake tensors of different
    backends do not mix). The peak equals the real CPU run's to the byte with
    ``round_to=1`` and takes seconds even for 0.5B-parameter models at long sequences.

    What it models of a CUDA device: ``round_to`` (default 512 B, the caching allocator's
    block) and ``reserve_bytes`` (subtracted from ``memory_limit``; by default what no
    tracker sees on the named device, term by term: :func:`batchfit.memory.cuda_untracked.untracked_memory`).
    and the attention kernel CUDA would run: the math path where no fused kernel takes the
    inputs (NOTE [ The estimate runs CUDA's attention kernel ]). Not modelled: fragmentation
    and kernels whose CUDA version allocates differently from the CPU one -- the budget
    search's safety margin covers these (NOTE [ The margin's evidence ]).
    Fake *cuda* tensors are never used: they abort a CPU-only build.

    Args:
        memory_limit: target device size (bytes, ``"80GiB"``, ``"h100-80gb"``), or ``None``.
        reserve_bytes: bytes of ``memory_limit`` not available to tensors (default: the
            untracked memory of one rank of the device; :meth:`expect_world_size` adds NCCL's).
        round_to: storage rounding in bytes (default 512; 1 reproduces the cpu backend).
        attention_kernels: ``"cuda"`` (default): attention runs the kernel CUDA would choose;
            ``"own"``: the CPU's (NOTE [ The estimate runs CUDA's attention kernel ]).

    Attributes:
        untracked: the terms of the default reserve, ``None`` when ``reserve_bytes`` was given.
    """

    name = "estimate"
    holds_memory = False
    simulated = True
    CALL_SETTINGS = (*TrackedBackend.CALL_SETTINGS, "untracked", "_device", "_default_reserve")
    extrapolates_depth = True
    suggests_world_sizes = True

    def __init__(
        self,
        *,
        memory_limit: Any = None,
        reserve_bytes: Any = None,
        round_to: int | None = None,
        attention_kernels: str = "cuda",
    ):
        self._device = memory_limit if isinstance(memory_limit, str) else None
        super().__init__(
            memory_limit=memory_limit,
            reserve_bytes=0 if reserve_bytes is None else reserve_bytes,
            round_to=DEFAULT_ROUND_TO if round_to is None else round_to,
        )
        self._set_attention_kernels(attention_kernels)
        self.untracked: UntrackedMemory | None = None
        self._default_reserve = reserve_bytes is None
        self.expect_world_size(1)
        # NOTE [ Integer tensors keep their values ]: masks, lengths and indices made from host
        # data keep real values, so remove-padding and masked log-probs run (floats stay fake)
        # NOTE [ The estimate's tracker is fed by its fake mode ] in batchfit.memory.observed_fake
        self.fake_mode: ObservedFakeTensorMode = ObservedFakeTensorMode(allow_non_fake_inputs=True)
        fake_mode = self.fake_mode
        fake_mode.__deepcopy__ = lambda memo: fake_mode  # NOTE [ Deep copies of fake tensors ]
        self._depth = 0

    def _tracker(self, host_categories: Sequence[str]) -> ObservingTracker:
        """The trial's tracker is fed by this backend's fake mode (NOTE [ The estimate's tracker is fed by its fake mode ]);
        torch's fake dispatch cache is bounded first (NOTE [ torch's fake dispatch cache is bounded ])."""
        bound_fake_cache()
        return ObservingTracker(
            self.fake_mode, round_to=self.round_to, limit_bytes=self._abort_bytes(), host_categories=host_categories
        )

    @property
    def kept_values_bytes(self) -> int | None:
        """The largest integer tensor whose values the fake mode keeps (NOTE [ Integer tensors keep their values ])."""
        return self.fake_mode.shadow_limit_bytes

    def expect_world_size(self, world_size: int) -> None:
        """Reserve what no tracker sees on one rank of ``world_size`` (NCCL's buffers when > 1).

        Only a default reserve changes; one the user gave is kept.

        Raises:
            InvalidArgument: ``world_size`` is not a positive integer, or the reserve would
                leave nothing of ``memory_limit``.
        """
        if not self._default_reserve:
            return
        self.untracked = untracked_memory(self._device, world_size=world_size, total_bytes=self.memory_limit)
        self.reserve_bytes = self.untracked.reserve_bytes
        self._check_reserve()

    @contextlib.contextmanager
    def probing(self) -> Iterator[None]:
        """Around a search's probes: one intra-op thread (NOTE [ Fake tensors need no threads ])."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Enter this backend's ``FakeTensorMode`` and the transformers and FSDP1 patches (re-entrant).

        See NOTE [ Fake tensors are not tracing ] in :mod:`batchfit.memory.fake_patches`, NOTE
        [ FSDP1 compares data pointers ] in :mod:`batchfit.memory.fake_fsdp1` and NOTE [ Deep
        copies of fake tensors ].
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        with self.fake_mode, transformers_fake_patches(), fsdp1_fake_patches(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_DATA_PTR_WARNING, category=UserWarning)
            self._depth = 1
            try:
                yield
            finally:
                self._depth = 0
