"""A live-storage tracker: the exact peak of bytes held by tensors during a block of code.

:class:`MemoryTracker` is a ``TorchDispatchMode`` that sees every op's outputs, records each
output's untyped storage once (keyed by its ``_cdata``) and forgets it when the storage dies
(``weakref.finalize``). The running sum of live storage bytes and its maximum are the
"live-byte peak" of the block, which on the CPU matched the CPU profiler within 256 bytes
and is deterministic run to run; under ``FakeTensorMode`` it predicts the same peak with no
allocation (``tests/test_memory.py`` holds the estimate to the cpu run byte for byte).

Storages that exist before the tracker starts (parameters, buffers, inputs, optimizer
state) are invisible to it until registered with :meth:`MemoryTracker.register`.

With ``limit_bytes`` the tracker behaves like a device that runs out of memory: the op
whose output takes the live bytes above the limit raises :class:`MemoryLimitExceeded`
(see NOTE [ Abort above the limit ]).

NOTE [ Sharded tensors and storage resizes ]
FSDP2 holds parameters, gradients and optimizer state as ``DTensor`` wrappers around a
local shard, and allocates unsharded parameters by resizing an existing storage
(``UntypedStorage.resize_``), which no dispatch mode sees. The tracker therefore
(1) lets DTensor ops desugar into local ops before it looks at them (it returns
``NotImplemented`` for them, as ``torch.distributed._tools.MemTracker`` does) and counts
a wrapper by the plain tensors it wraps; (2) ignores ops run under another fake mode
than the one active when it started (DTensor's sharding propagation); (3) wraps
``UntypedStorage.resize_`` while it is active, and accounts a resize for the trackers of
the calling context only (NOTE [ Patched once, restored exactly ] in
:mod:`batchfit.patching`); (4) names the buffers of FSDP's
collectives: an all-gather's input and output are ``gathered_parameters``, a
reduce-scatter's input ``communication`` and its output (the sharded gradient)
``gradients``.

NOTE [ Inside the communication backend ]
What a process-group backend allocates while it completes a collective
(``Work.wait()``) is not counted: NCCL keeps its buffers outside PyTorch's allocator (the
estimate's reserve covers them), and gloo, which runs a CPU collective inline in
``wait()``, copies its input into temporaries a GPU run never has. Leaving them out keeps
the cpu backend on real gloo ranks equal to the estimate of a CUDA run (measured: gloo's
reduce-scatter adds one input-sized copy, 524,544 bytes for the tiny model's root).
``Work.wait`` is wrapped like ``resize_`` and marks only the trackers of the calling
context: a ``wait()`` on another thread (async checkpointing) leaves the measured thread's
allocations counted.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.utils._python_dispatch as _dispatch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_flatten

from batchfit.memory import labels
from batchfit.memory.categories import (
    ACTIVATIONS,
    COMMUNICATION,
    GATHERED_PARAMETERS,
    GRADIENTS,
    categorized_tensors,
    plain_tensors,
)
from batchfit.patching import AttributePatch, LayeredPatch, undo_all


class MemoryLimitExceeded(Exception):
    """Live bytes went above the tracker's ``limit_bytes``: the tracked block is aborted.

    Internal control flow, the simulated counterpart of ``torch.OutOfMemoryError``: raised
    from inside the dispatch mode (or :meth:`MemoryTracker.register`) and caught by the
    memory backends, which report "does not fit". ``reached`` is the live byte count at the
    abort (a lower bound of the peak the block would have had), ``limit`` the limit.
    """

    def __init__(self, reached: int, limit: int):
        self.reached = reached
        self.limit = limit
        super().__init__(f"live bytes {reached} exceeded the limit of {limit} bytes")


def _round_up(nbytes: int, multiple: int) -> int:
    return -(-nbytes // multiple) * multiple if multiple > 1 else nbytes


@functools.cache
def _collective_roles() -> dict[Any, tuple[tuple[int, str], ...]]:
    """``{op: ((argument index, category), ...)}`` for the collectives whose buffers get a name."""
    roles: dict[Any, tuple[tuple[int, str], ...]] = {}
    c10d = getattr(torch.ops, "c10d", None)
    if c10d is None:  # pragma: no cover - torch without distributed
        return roles
    for name, spec in (
        ("_allgather_base_", ((0, GATHERED_PARAMETERS), (1, GATHERED_PARAMETERS))),
        ("_reduce_scatter_base_", ((0, GRADIENTS), (1, COMMUNICATION))),
    ):
        try:
            roles[getattr(c10d, name).default] = spec
        except (AttributeError, RuntimeError):  # pragma: no cover - older torch
            continue
    return roles


@functools.cache
def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return DTensor


# Storages created inside a communication backend's Work.wait() (NOTE [ Inside the
# communication backend ]): tracked so that their frees balance, never counted.
_BACKEND_INTERNAL = "communication_backend_internal"


# NOTE [ Tensors made from host data are allocations ]
# ``torch.tensor(data)``, ``torch.as_tensor(array)`` and ``torch.from_numpy`` reach a dispatch
# mode as ``lift_fresh`` of a tensor the mode never saw made, which shares its storage: the
# rule above would take it for a view of something that existed before. It is new memory
# (on a GPU the copy to the device allocates it; the estimate backend's fake conversion
# counts it too), so the cpu backend counts it: a packed micro-batch's ``position_ids``,
# made from host lengths, are part of its bytes (measured: 4,584 B of a 573-token row).
_FROM_HOST_DATA = frozenset(
    op.default
    for op in (getattr(torch.ops.aten, name, None) for name in ("lift_fresh", "lift_fresh_copy"))
    if op is not None
)


def _fake_mode() -> Any:
    """The active ``FakeTensorMode`` or ``None``: what ``torch._guards.active_fake_mode`` returns, read in one C call.

    A fake mode is an infra mode, kept in its own slot beside the dispatch mode stack
    (``_TorchDispatchModeKey.FAKE``); the same answer on every op of the test suite's probes.
    """
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def _leaves(out: Any) -> Iterable[Any]:
    """An op's outputs as a flat sequence: a tensor, a tuple or list of them, else pytree's leaves."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) or t is None for t in out):
        return out
    return tree_flatten(out)[0]


# what an op's argument can be that pytree would take for a leaf holding no tensor
_LEAVES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _storage_keys(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> set[int]:
    """The storages of the tensors in an op's ``args`` and ``kwargs`` (tensors, and tensors in lists of them).

    The arguments of an ATen op are tensors, scalars and flat lists of either; those are
    read directly, anything else through pytree, as all of them were before (NOTE [ The
    tracker's hot path ]).
    """
    keys: set[int] = set()
    for values in (args, () if kwargs is None else kwargs.values()):
        for a in values:
            if isinstance(a, torch.Tensor):
                keys.add(a.untyped_storage()._cdata)
            elif isinstance(a, (list, tuple)) and all(isinstance(t, torch.Tensor) or t is None for t in a):
                keys.update(t.untyped_storage()._cdata for t in a if t is not None)
            elif not isinstance(a, _LEAVES):
                keys.update(t.untyped_storage()._cdata for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor))
    return keys


# NOTE [ A fake tensor's device is read in Python ]
# ``Tensor.is_meta`` of a ``FakeTensor`` asks its custom device policy, which dispatches
# ``prim.device`` through every mode on the stack (this tracker's first), 4 to 40 µs an
# output and, with one per output, a fifth of a probe of the main job (torch 2.13). What
# that dispatch returns (``FakeTensorMode``'s ``prim.device`` handler: ``meta`` inside a
# kernel invocation, else the fake device) is what ``FakeTensor.device`` returns without
# dispatching, so a fake output is read through that property; any other tensor keeps
# ``is_meta``.
def _is_meta(t: torch.Tensor) -> bool:
    """``t.is_meta``, read without a dispatch for a ``FakeTensor`` (NOTE above)."""
    if isinstance(t, FakeTensor):
        return t.device.type == "meta"
    return t.is_meta


#: ``{tensor type: is it a DTensor}``, filled as types are seen (NOTE [ The tracker's hot path ]).
_IS_DTENSOR: dict[type, bool] = {}


def _has_dtensor(types: Iterable[type]) -> bool:
    """Any of an op's tensor ``types`` is a ``DTensor`` (or a subclass)."""
    for t in types:
        known = _IS_DTENSOR.get(t)
        if known is None:
            dtensor = _dtensor_type()
            known = _IS_DTENSOR[t] = dtensor is not None and issubclass(t, dtensor)
        if known:
            return True
    return False


def _work_type() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return getattr(dist, "Work", None) if dist.is_available() else None


# NOTE [ Patched once, restored exactly ] in batchfit.patching: installed while any
# tracker is active, acting for the trackers of the calling context only.
_RESIZE = AttributePatch(lambda: torch.UntypedStorage, "resize_")
#: ``torch.distributed.Work.wait``, patched once for every use (NOTE [ Shared and counted ] in
#: :mod:`batchfit.patching`): the tracker's layer (NOTE [ Inside the communication
#: backend ]) is the outermost, a guarded search's polling wait
#: (:mod:`batchfit.budget.guard`) runs inside it.
WORK_WAIT = LayeredPatch(_work_type, "wait")



def _fsdp_param_type() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPParam


#: FSDP2's ``FSDPParam.init_all_gather_outputs``: NOTE [ FSDP2's first all-gather outputs ].
_FIRST_GATHER = AttributePatch(_fsdp_param_type, "init_all_gather_outputs", lazy=True)
_PATCHES = (_RESIZE, WORK_WAIT, _FIRST_GATHER)


@_RESIZE.bind
def _tracked_resize(storage: Any, size: int) -> Any:
    out = _RESIZE.call_below(storage, size)
    for mine in labels._in_context():
        if mine.owner is not None:
            mine.owner._resized(storage)
    return out


@_FIRST_GATHER.bind
def _first_gather_outputs(fsdp_param: Any, *args: Any, **kwargs: Any) -> Any:
    """NOTE [ FSDP2's first all-gather outputs ]
    A parameter's first all-gather makes its output buffers with ``torch.empty``
    (``FSDPParam.init_all_gather_outputs``); every later one grows the same buffers from nothing
    by ``resize_``, which the tracker counts as ``gathered_parameters``. Made under that region,
    the first ones are counted so too, so a copy's first step has the same breakdown as its later
    ones (before, its forward counted the gathered layers as activations: the tiny model's
    first forward 355,328 B against 711,168 B of gathered parameters at the embeddings); the
    peaks were already equal.
    """
    with labels.region(GATHERED_PARAMETERS):
        return _FIRST_GATHER.call_below(fsdp_param, *args, **kwargs)


@WORK_WAIT.layer
def _untracked_wait(call: Callable[..., Any], work: Any, *args: Any, **kwargs: Any) -> Any:
    context = labels._in_context()
    if not context:
        return call(work, *args, **kwargs)
    before = [mine.region for mine in context]
    for mine in context:
        mine.region = _BACKEND_INTERNAL
    try:
        return call(work, *args, **kwargs)
    finally:
        for mine, region in zip(context, before):
            mine.region = region


def _remove_mode(mode: TorchDispatchMode, exc: tuple[Any, ...]) -> None:
    """Take ``mode`` off the dispatch-mode stack, also when modes entered after it are still on it.

    NOTE [ Trackers exit out of order ]
    ``TorchDispatchMode.__exit__`` pops the top of the stack and puts back the process-wide
    "inside a dispatch mode" flags saved at its entry. A tracker exited before a mode
    entered after it (two trackers entered by hand and exited in entry order) would pop the
    other mode instead and leave itself active, and the last exit would leave the flags set
    with an empty stack (measured on torch 2.13: ``_is_in_torch_dispatch_mode`` stayed
    ``True``). Here the modes above are lifted off, ``mode`` exits, and they are pushed back
    with the flags each saved recomputed as if ``mode`` had never been entered.
    """
    stack = _get_current_dispatch_mode_stack()
    index = max((i for i, m in enumerate(stack) if m is mode), default=None)
    if index is None:
        for name in (
            "old_dispatch_mode_flags",
            "old_non_infra_dispatch_mode_flags",
            "old_without_ignore_compile_internals_dispatch_mode_flags",
        ):
            flags = getattr(mode, name, None)
            if flags:
                flags.pop()
        raise RuntimeError(
            f"{type(mode).__name__} is no longer on the dispatch-mode stack at its exit: other code popped it; exit dispatch modes in reverse order of entry"
        )
    if index == len(stack) - 1:
        TorchDispatchMode.__exit__(mode, *exc)
        return
    above = stack[index + 1 :]
    for _ in above:
        torch._C._pop_torch_dispatch_stack(None)
    try:
        TorchDispatchMode.__exit__(mode, *exc)
    finally:
        for other in above:
            torch._C._push_on_torch_dispatch_stack(other)
        # each mode above saved the flags in force when it entered: recompute them without ``mode``
        active, non_infra, uncompiled = (
            _dispatch._is_in_torch_dispatch_mode,
            _dispatch._is_in_non_infra_torch_dispatch_mode,
            _dispatch._is_in_any_mode_without_ignore_compile_internals,
        )
        for other in above:
            saved = (
                getattr(other, "old_dispatch_mode_flags", None),
                getattr(other, "old_non_infra_dispatch_mode_flags", None),
                getattr(other, "old_without_ignore_compile_internals_dispatch_mode_flags", None),
            )
            for flags, value in zip(saved, (active, non_infra, uncompiled)):
                if flags:
                    flags[-1] = value
            active = True
            non_infra = non_infra or not other.is_infra_mode()
            uncompiled = uncompiled or not other.ignore_compile_internals()
        _dispatch._is_in_torch_dispatch_mode = active
        _dispatch._is_in_non_infra_torch_dispatch_mode = non_infra
        _dispatch._is_in_any_mode_without_ignore_compile_internals = uncompiled
        _dispatch.set_is_in_mode_without_ignore_compile_internals(uncompiled)


class MemoryTracker(TorchDispatchMode):
    """Track live tensor-storage bytes and their peak inside ``with MemoryTracker() as t:``.

    Args:
        round_to: round each storage up to a multiple of this many bytes (512 models the CUDA
            caching allocator's block size; 1 = exact bytes).
        limit_bytes: if given, raise :class:`MemoryLimitExceeded` as soon as the live bytes
            exceed it (``None`` = no limit).
        host_categories: categories held in host memory (CPU offload): tracked, reported in
            :attr:`host_bytes`, but not counted in the device bytes, the peak or the limit.

    Attributes:
        current_bytes: device bytes held now by tracked storages.
        peak_bytes: the largest ``current_bytes`` seen since the start or the last
            :meth:`reset_peak`.
        peak_breakdown: device bytes per category at the moment of the peak (registered
            categories such as ``"parameters"``; op outputs count as ``"activations"``
            unless a region is set, see :mod:`batchfit.memory.labels`).
        host_bytes: bytes in ``host_categories`` at the moment of the peak.
        phase_peaks: the peak of each phase (:func:`batchfit.memory.labels.phase`).
        phase_breakdowns: the breakdown at each phase's peak.

    Example:
        >>> x = torch.randn(1024)
        >>> with MemoryTracker() as t:
        ...     t.register(x, category="inputs")
        ...     y = x * 2
        >>> t.peak_bytes
        8192
    """

    def __init__(
        self,
        *,
        round_to: int = 1,
        limit_bytes: int | None = None,
        host_categories: Iterable[str] = (),
    ):
        super().__init__()
        self.round_to = int(round_to)
        self.limit_bytes = None if limit_bytes is None else int(limit_bytes)
        self.host_categories = frozenset(host_categories)
        self._live: dict[int, tuple[int, str]] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._by_category: dict[str, int] = {}
        self.current_bytes = 0
        self.host_current = 0
        self.peak_bytes = 0
        self.peak_breakdown: dict[str, int] = {}
        self.host_bytes = 0
        self.phase_peaks: dict[str, int] = {}
        self.phase_breakdowns: dict[str, dict[str, int]] = {}
        self._entry_fake_mode: Any = None
        # NOTE [ Phases and regions ] in batchfit.memory.labels
        self._labels = labels._Labels()
        self._depth = 0

    # ----------------------------------------------------------------- bookkeeping
    def _add(self, storage: Any, category: str, *, resized: bool = False) -> None:
        key = storage._cdata
        nbytes = _round_up(int(storage.nbytes()), self.round_to)
        old = self._live.get(key)
        if old is not None:
            if old[0] == nbytes:
                return
            # resized in place (resize_/set_): account the difference only, keep the
            # category unless the storage grows from nothing by resize_ (FSDP unsharding)
            self._change(-old[0], old[1])
            if not (resized and old[0] == 0):
                category = old[1]
        else:
            self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self._live[key] = (nbytes, category)
        self._change(nbytes, category)

    def _resized(self, storage: Any) -> None:
        """``storage.resize_`` ran: account its new size (a storage grown from nothing is unsharded parameters)."""
        if storage._cdata in self._live or storage.nbytes() > 0:
            self._add(storage, GATHERED_PARAMETERS, resized=True)

    def _snapshot(self) -> dict[str, int]:
        return {
            k: v
            for k, v in self._by_category.items()
            if v and k not in self.host_categories and k != _BACKEND_INTERNAL
        }

    def _change(self, delta: int, category: str) -> None:
        self._by_category[category] = self._by_category.get(category, 0) + delta
        if category in self.host_categories:
            self.host_current += delta
            return
        if category == _BACKEND_INTERNAL:
            return
        self.current_bytes += delta
        if delta <= 0:
            return
        phase = self._labels.key()
        if self.current_bytes > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = self.current_bytes
            self.phase_breakdowns[phase] = self._snapshot()
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_breakdown = self.phase_breakdowns[phase]
            self.host_bytes = self.host_current
            # NOTE [ Abort above the limit ]
            # Raising here, right after the op whose output crossed the limit, stops the
            # block the way a real allocation failure would, so a probe far above the limit
            # costs little. Only growth can cross it (frees never raise, so weakref
            # finalizers stay silent), and the bookkeeping is complete before the raise.
            if self.limit_bytes is not None and self.current_bytes > self.limit_bytes:
                raise MemoryLimitExceeded(self.current_bytes, self.limit_bytes)

    def _free(self, key: int) -> None:
        self._finalizers.pop(key, None)
        entry = self._live.pop(key, None)
        if entry is not None:
            self._change(-entry[0], entry[1])

    # ----------------------------------------------------------------- public API
    def register(self, *objects: Any, category: str = "inputs") -> None:
        """Count storages that already exist (created before the tracker or outside it).

        Accepts tensors, ``nn.Module`` (parameters, buffers and existing gradients), a
        ``torch.optim.Optimizer`` (its state tensors), and mappings or iterables of these.
        A storage already tracked is not counted twice.
        """
        for obj in objects:
            for t, _ in categorized_tensors(obj, category):
                self._add(t.untyped_storage(), category)

    def register_tensor(self, tensor: torch.Tensor, category: str) -> None:
        """Count the storage of ``tensor`` alone (not its ``.grad``) under ``category``.

        A storage already tracked keeps its first category; a wrapper subclass (``DTensor``)
        counts as the tensors it wraps.
        """
        for plain in plain_tensors(tensor):
            self._add(plain.untyped_storage(), category)

    def recategorize(self, tensor: torch.Tensor, category: str) -> None:
        """Move a tracked storage's bytes to ``category`` (the total is unchanged).

        Used for storages whose role is known only after they were created, such as a
        gradient produced by a backward op and then accumulated into ``param.grad``.
        Untracked storages are ignored.
        """
        for plain in plain_tensors(tensor):
            key = plain.untyped_storage()._cdata
            entry = self._live.get(key)
            if entry is None or entry[1] == category:
                continue
            nbytes, old = entry
            self._change(-nbytes, old)
            self._live[key] = (nbytes, category)
            self._change(nbytes, category)

    def reset_peak(self) -> None:
        """Start a new peak measurement from the bytes held now."""
        self.peak_bytes = self.current_bytes
        self.peak_breakdown = self._snapshot()
        self.host_bytes = self.host_current
        self.phase_peaks = {}
        self.phase_breakdowns = {}

    def __enter__(self) -> MemoryTracker:
        # NOTE [ Every undo step runs ] in batchfit.patching: a failure at any step
        # undoes the steps before it, in reverse order, and propagates
        undo: list[Callable[[], object]] = []
        try:
            if self._depth == 0:
                self._entry_fake_mode = _fake_mode()
                self._labels.owner = self
                undo.append(self._detach)
            labels._push(self._labels)
            undo.append(functools.partial(labels._pop, self._labels))
            for patch in _PATCHES:
                patch.acquire()
                undo.append(patch.release)
            self._enter_dispatch()
        except BaseException as exc:
            undo_all(reversed(undo), exc)
            raise
        self._depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        """Undo one entry in reverse order, every step even when one raises (the first failure is raised).

        Trackers may exit out of the order they entered (see :func:`_remove_mode`); an exit
        without an entry is refused (``RuntimeError``).
        """
        if self._depth == 0:
            raise RuntimeError(
                "MemoryTracker.__exit__ called on a tracker that is not active: call __exit__ once per __enter__ (or use a with-block)"
            )
        self._depth -= 1
        steps: list[Callable[[], object]] = [functools.partial(self._exit_dispatch, exc)]
        steps += [patch.release for patch in reversed(_PATCHES)]
        steps.append(functools.partial(labels._pop, self._labels))
        if self._depth == 0:
            steps.append(self._detach)
        undo_all(steps)

    def _enter_dispatch(self) -> None:
        """Start seeing ops: push this tracker on the dispatch-mode stack (a subclass may be fed otherwise)."""
        TorchDispatchMode.__enter__(self)

    def _exit_dispatch(self, exc: tuple[Any, ...]) -> None:
        """Stop seeing ops (one entry): take this tracker off the dispatch-mode stack (NOTE [ Trackers exit out of order ])."""
        _remove_mode(self, exc)

    def _detach(self) -> None:
        """After the last exit: no owner for the labels, and no finalizer calling into this tracker."""
        self._labels.owner = None
        # Detach the finalizers: a storage outliving the block must not keep this
        # tracker alive (nor call into it) after the measurement.
        for fin in self._finalizers.values():
            fin.detach()
        self._finalizers.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # NOTE [ The tracker's hot path ]: this runs for every op of a probe (7,000 per step of
        # qwen2.5-7b at two depths), so it reads the fake mode with one C call and walks plain
        # outputs without pytree; both were a fifth of the main job's time
        if _has_dtensor(types):
            # let DTensor desugar into local ops, which come back here (NOTE above)
            return NotImplemented
        _RESIZE.ensure()  # NOTE [ Patched once, restored exactly ]: the limit
        WORK_WAIT.ensure()
        out = func(*args, **(kwargs or {}))
        if _fake_mode() is not self._entry_fake_mode:
            return out  # DTensor's sharding propagation, not memory
        self._observe(func, args, kwargs, out)
        return out

    def _observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Count what op ``func`` returned (``out``, from ``args`` and ``kwargs``): its new storages and collective buffers."""
        category = self._labels.region or ACTIVATIONS
        inputs = None
        for t in _leaves(out):
            if isinstance(t, torch.Tensor) and not _is_meta(t):  # meta tensors hold no memory
                storage = t.untyped_storage()
                if storage._cdata not in self._live and func not in _FROM_HOST_DATA:
                    # NOTE [ Views of what existed before are not allocations ]: a view (detach,
                    # slice, in-place op) of a tensor made before the block shares its storage;
                    # counting it would charge the whole pre-existing tensor to the block
                    if inputs is None:
                        inputs = _storage_keys(args, kwargs)
                    if storage._cdata in inputs:
                        continue
                self._add(storage, category)
        roles = _collective_roles().get(func)
        if roles:
            for index, role in roles:
                if index < len(args) and isinstance(args[index], torch.Tensor):
                    self.recategorize(args[index], role)
