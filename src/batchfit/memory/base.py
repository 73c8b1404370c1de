"""The interface every memory backend implements: :class:`Backend`, and what counts as running out of memory."""

from __future__ import annotations

import abc
import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.memory.categories import registered_tensors, trainable_parameters
from batchfit.memory.cuda_untracked import UntrackedMemory
from batchfit.memory.isolation import isolate
from batchfit.memory.measurement import MemoryMeasurement
from batchfit.memory.sizes import parse_memory
from batchfit.validation import check_positive_int, is_int

# Messages of allocation failures that surface as a plain RuntimeError: library workspaces on
# a GPU, and the host's allocator when a real run on the CPU asks for more than the host has.
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
)


class RankRanOutOfMemory(Exception):
    """Another rank ran out of memory in the middle of the same step: this rank's collective was abandoned.

    Raised inside a step on the ranks that were waiting for the one that ran out (NOTE [ One
    rank runs out ] in :mod:`batchfit.budget.guard`); :meth:`Backend.measure` counts it as
    running out of memory, so every rank reports "does not fit". ``rank`` is the one that ran out.
    """

    def __init__(self, rank: int, what: str):
        self.rank = rank
        super().__init__(f"rank {rank} ran out of memory in the middle of {what}")


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc`` is the device (or the host) running out of memory, and nothing else.

    NOTE [ What counts as OOM ]
    ``torch.OutOfMemoryError`` (the caching allocator failed), the ``RuntimeError`` that
    cuBLAS or a raw CUDA call raises when its own allocation fails, the CPU allocator's
    failure (``DefaultCPUAllocator: can't allocate memory``), and
    :class:`RankRanOutOfMemory` (another rank of the same step ran out). :meth:`Backend.measure` is the
    one place that decides it; every other exception is a bug in the step and is re-raised
    unchanged.
    """
    if isinstance(exc, (torch.OutOfMemoryError, RankRanOutOfMemory)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OOM_MESSAGES)


class Backend(abc.ABC):
    """Measures the peak bytes of one call of a step function; "does not fit" never crashes.

    Build models, optimizers and inputs inside :meth:`context` and on :attr:`device`, then
    call :meth:`measure`. Subclasses: ``cpu``, ``estimate``, ``cuda``
    (:func:`batchfit.memory.get_backend` picks one by name).

    Attributes:
        name: ``"cpu"``, ``"estimate"`` or ``"cuda"``.
        device: the ``torch.device`` on which to create tensors.
        memory_limit: bytes of the (real or simulated) device, ``None`` = unlimited.
        reserve_bytes: bytes of ``memory_limit`` no tracker sees (CUDA context, workspaces),
            subtracted from it to give :attr:`limit_bytes`.
        round_to: each storage is rounded up to a multiple of this many bytes (tracked
            backends only; the CUDA allocator rounds by itself).
        attention_kernels: whose attention kernels a step runs: ``"cuda"`` (CUDA's choice: the
            cuda backend, and by default the tracked ones, NOTE [ The estimate runs CUDA's
            attention kernel ]) or ``"own"`` (the CPU's, a tracked backend asked for it).
    """

    name: str = ""
    attention_kernels: str = "cuda"
    _stop_bytes: int | None = None  # NOTE [ Stop at the search's limit ]: set inside stopping_above
    _to_the_end: bool = False  # NOTE [ Real ranks run their probes to the end ]: set inside running_to_the_end

    def __init__(self, *, memory_limit: Any = None, reserve_bytes: Any = 0, round_to: int = 1):
        self.memory_limit = None if memory_limit is None else parse_memory(memory_limit, name="memory_limit")
        if is_int(reserve_bytes) and reserve_bytes == 0:
            self.reserve_bytes = 0
        else:
            self.reserve_bytes = parse_memory(reserve_bytes, name="reserve_bytes")
        self.round_to = check_positive_int("round_to", round_to)
        self._check_reserve()

    def _check_reserve(self) -> None:
        """Refuse a reserve that leaves nothing of the limit."""
        if self.memory_limit is not None and self.reserve_bytes >= self.memory_limit:
            raise InvalidArgument(
                f"reserve_bytes must be smaller than memory_limit={self.memory_limit}, but got reserve_bytes={self.reserve_bytes}; lower reserve_bytes or raise memory_limit"
            )

    @property
    def runs_cuda_attention(self) -> bool:
        """A step here runs the attention kernel CUDA would choose (NOTE [ The estimate runs CUDA's attention kernel ])."""
        return self.attention_kernels == "cuda"

    @property
    def device(self) -> torch.device:
        """The device on which step functions create their tensors."""
        return torch.device("cpu")

    @property
    def limit_bytes(self) -> int | None:
        """Usable bytes: ``memory_limit - reserve_bytes``; ``None`` when unlimited."""
        return None if self.memory_limit is None else self.memory_limit - self.reserve_bytes

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Create models, optimizers and inputs inside this (re-entrant; a no-op by default)."""
        yield

    #: The attributes that decide how a call is measured and may change between calls (the
    #: limits, the reserve, the contexts below): what a worker measuring beside this process
    #: is given before each call (NOTE [ Shallow copies measured side by side ] in
    #: :mod:`batchfit.budget.side_by_side`).
    CALL_SETTINGS: tuple[str, ...] = ("memory_limit", "reserve_bytes", "round_to", "attention_kernels", "_stop_bytes", "_to_the_end")

    def call_settings(self) -> dict[str, Any]:
        """The :attr:`CALL_SETTINGS` as they are now (plain data)."""
        return {name: getattr(self, name) for name in self.CALL_SETTINGS if hasattr(self, name)}

    def apply_call_settings(self, settings: dict[str, Any]) -> None:
        """Set what :meth:`call_settings` returned in another process."""
        for name, value in settings.items():
            setattr(self, name, value)

    @contextlib.contextmanager
    def stopping_above(self, stop_bytes: int | None) -> Iterator[None]:
        """Inside, a tracked call is aborted as soon as it holds more than ``stop_bytes``.

        NOTE [ Stop at the search's limit ]
        A search that only needs to know that a candidate does not fit under its own limit
        (the safety margin's, below the device's) lets the tracked backends stop the step
        there, as they stop it at the device's limit: the measurement is then
        ``exceeded`` and ``fits=False``, its peak a lower bound. cuda runs the step to the end
        (a device cannot be told to fail early). ``None`` changes nothing.
        """
        before = self._stop_bytes
        self._stop_bytes = stop_bytes
        try:
            yield
        finally:
            self._stop_bytes = before

    # NOTE [ Backends say what they can do ]
    # Code outside batchfit.memory asks a backend what it can do through the capabilities
    # below, never by its name or its type: a new backend declares its own and every caller
    # follows.

    #: Whether a step can be run past :attr:`limit_bytes` and judged afterwards (the tracked
    #: backends count bytes, no device refuses them); ``cuda`` cannot: its device runs out.
    runs_past_limit: bool = False
    #: Whether a measured step really allocates what it measures (cpu, cuda); the estimate's
    #: fake tensors hold nothing, so running one past the limit costs only its time.
    holds_memory: bool = True
    #: Whether a step runs on fake tensors (estimate): shapes without memory, and without
    #: values but for the integer ones the backend keeps (:attr:`kept_values_bytes`); models,
    #: optimizers and inputs are made inside :meth:`context`, and a sharded step runs over
    #: simulated ranks in this process, any number of them.
    simulated: bool = False
    #: The ``FakeTensorMode`` of a simulated backend's tensors, ``None`` for real ones.
    fake_mode: Any = None
    #: Whether the device is this host's memory (cpu): a real step there must fit the host,
    #: which a caller checks before building a large model.
    host_memory: bool = False
    #: Whether the estimate backend predicts this backend's peaks to the byte (the cpu
    #: backend: the same tracker on real tensors), so that a slow real search can be guided by
    #: a quick estimate (NOTE [ Estimates guide real cpu searches ] in :mod:`batchfit.budget.model_profile`).
    estimate_is_exact: bool = False
    #: Whether a sharded step of one rank runs in this process over a simulated group of one
    #: (cpu); cuda's collectives need real ranks (torchrun) even for one. A :attr:`simulated`
    #: backend simulates any number of ranks.
    simulates_one_rank: bool = False
    #: Whether a profile measures a deep model's peak on two shallow copies and extrapolates
    #: it by default (NOTE [ Peak memory is affine in depth ] in :mod:`batchfit.budget.depth`): where probes cost seconds at
    #: any size (estimate); a real backend measures the model as built unless asked.
    extrapolates_depth: bool = False
    #: Whether a failed profile may name the smallest world size that would fit: probing other
    #: world sizes costs seconds on simulated ranks (estimate).
    suggests_world_sizes: bool = False
    #: Whether the backend reads the device's own allocator (cuda): its peaks come from the
    #: device's statistics, which see only what torch's allocator holds, and the memory outside
    #: it is read from the device after a run; the other backends track every storage themselves.
    reads_device: bool = False
    #: The terms of the default reserve (what no tracker sees on the device), ``None`` when the
    #: reserve was given or the backend sees the device itself.
    untracked: UntrackedMemory | None = None

    @property
    def kept_values_bytes(self) -> int | None:
        """The largest integer tensor, in bytes, whose values a step can read; ``None``: any (real tensors).

        A simulated backend keeps the values of integer tensors made from host data up to a
        limit (NOTE [ Integer tensors keep their values ] in :mod:`batchfit.memory.shadow_values`).
        """
        return None

    def expect_world_size(self, world_size: int) -> None:
        """Prepare to measure one rank of ``world_size`` ranks (a simulated device reserves what NCCL adds); nothing by default."""
        return None

    def probing(self) -> contextlib.AbstractContextManager[None]:
        """Around a search's probes, one after another: what makes the next probe cheaper (nothing by default).

        The cpu backend keeps freed host pages in the heap between its probes (NOTE [ Probing
        reuses host pages ] in :mod:`batchfit.memory.heap`).
        """
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def running_to_the_end(self) -> Iterator[None]:
        """Inside, a tracked call is never aborted, whatever it holds: it runs to the end and is judged after.

        NOTE [ Real ranks run their probes to the end ]
        A tracked backend stops a step as soon as it holds more than its limit (NOTE [ Abort
        above the limit ]). On real ranks that is a step stopped on some ranks only: shards
        are uneven, so one rank crosses the limit at an op where another does not, and the
        ones that go on wait in a collective the stopped one never enters (three gloo ranks
        hung that way). Real ranks therefore run every probe to the end and compare the peak
        with the limit afterwards; every rank then enters every collective. ``cuda`` cannot
        be told either way: its out-of-memory errors are handled by :mod:`batchfit.budget.guard`.
        """
        before = self._to_the_end
        self._to_the_end = True
        try:
            yield
        finally:
            self._to_the_end = before

    @contextlib.contextmanager
    def capped(self) -> Iterator[None]:
        """Inside, the device itself refuses to hold more than :attr:`limit_bytes` (cuda; nothing elsewhere).

        Every rank caps at the same limit, so a step runs out where the plan says on every
        rank, not where each device happens to have room (NOTE [ One rank runs out ] in
        :mod:`batchfit.budget.guard`).
        """
        yield

    def _abort_bytes(self) -> int | None:
        """Where a tracked call is aborted: the device's limit, a lower search limit, or never (:meth:`running_to_the_end`)."""
        if self._to_the_end:
            return None
        stop, limit = self._stop_bytes, self.limit_bytes
        if stop is None:
            return limit
        return stop if limit is None else min(stop, limit)

    def measure(
        self,
        fn: Callable[[], Any],
        register: Any = (),
        categories: Sequence[str | None] | str | None = None,
        host_categories: Sequence[str] = (),
    ) -> MemoryMeasurement:
        """Run ``fn()`` once and return its peak memory; exceeding the limit is a result, not an error.

        The template every backend shares: the backend prepares the call (:meth:`_prepare`)
        and runs it inside :meth:`_running`; running out of memory is decided here (NOTE
        [ What counts as OOM ]); the backend reads its numbers (:meth:`_result`). The probe
        is isolated (NOTE [ Probes are isolated ] in :mod:`batchfit.memory.isolation`):
        whatever happened, the registered state is put back afterwards (FSDP2 modules
        resharded and their iteration state reset, gradients and optimizer state as before,
        train/eval flags), outside the measurement and inside :meth:`context`; after an
        aborted call the reference cycles of its frames are collected, and after an aborted
        call or one that left something to free the backend's caches are released
        (:meth:`_release`).

        Args:
            fn: the step, called with no arguments; its return value is dropped.
            register: state that exists before the call and stays alive during it (model,
                optimizer, input tensors, or a tuple of these), counted in the peak, and
                restored after the call. The tracked backends (cpu, estimate) need it to
                count that state; cuda sees the device itself and uses it for the breakdown.
                Optimizer state must be created before the call: state a probe creates is
                dropped after it.
            categories: the breakdown category for each registered object (see
                :func:`batchfit.memory.categories.registered_tensors`).
            host_categories: categories that live in host memory (CPU offload): the
                tracked backends report them in ``host_bytes`` and leave them out of the
                device peak; cuda ignores them (it sees only the device).

        Returns:
            A :class:`MemoryMeasurement`; ``fits=False, exceeded=True`` when the call was
            aborted at the limit or ran out of memory.

        Raises:
            Whatever ``fn`` raises other than running out of memory, unchanged (the state
            is restored all the same).
        """
        with self.context():
            snapshot = isolate(register)  # NOTE [ Probes are isolated ]
        finished = False
        try:
            start = time.perf_counter()
            # The registered pairs go to the trial state and nowhere else: a reference held
            # here would keep tensors the step frees (old gradients) alive and inflate the peak.
            state = self._prepare(
                registered_tensors(register, categories), trainable_parameters(register), host_categories
            )
            exceeded = False
            try:
                with self._running(state):
                    fn()
                finished = True
            except Exception as exc:
                if not (self._aborted(exc) or is_out_of_memory(exc)):
                    raise
                exceeded = True  # the traceback (and the tensors its frames hold) dies here
            return self._result(state, exceeded, time.perf_counter() - start)
        finally:
            # after the numbers are read: nothing below is measured
            with self.context():
                freed = snapshot.restore(finished=finished)
            if not finished:
                gc.collect()  # reference cycles through the aborted call's frames and graph
            if freed or not finished:
                self._release()

    # ----------------------------------------------------------------- hooks of measure()
    @abc.abstractmethod
    def _prepare(
        self,
        registered: list[tuple[torch.Tensor, str]],
        parameters: list[torch.nn.Parameter],
        host_categories: Sequence[str],
    ) -> Any:
        """The state of one call, made before it runs.

        Args:
            registered: ``(tensor, category)`` of the registered state; the state must let go
                of them once they are counted (:meth:`_running`).
            parameters: the registered modules' trainable parameters.
            host_categories: see :meth:`measure`.
        """

    @abc.abstractmethod
    def _running(self, state: Any) -> contextlib.AbstractContextManager[Any]:
        """Around the call: start recording on entry, stop on exit (also when the call raises)."""

    def _aborted(self, exc: Exception) -> bool:
        """True when ``exc`` is this backend's own "over the limit" signal (none by default)."""
        return False

    def _release(self) -> None:
        """Free what a call left cached once its state is restored (nothing by default)."""
        return None

    @abc.abstractmethod
    def _result(self, state: Any, exceeded: bool, seconds: float) -> MemoryMeasurement:
        """The measurement of the call that ran with ``state``."""

    def describe(self) -> dict[str, Any]:
        """The settings that qualify a measurement, for reports: name, device, bytes."""
        return {
            "backend": self.name,
            "device": str(self.device),
            "memory_limit": self.memory_limit,
            "reserve_bytes": self.reserve_bytes,
            "limit_bytes": self.limit_bytes,
            "round_to": self.round_to,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(memory_limit={self.memory_limit}, reserve_bytes={self.reserve_bytes}, "
            f"round_to={self.round_to})"
        )
