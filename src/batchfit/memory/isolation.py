"""Probes are isolated: what one measured call changes in its registered state is undone after it.

NOTE [ Probes are isolated ]
A probe (one :meth:`batchfit.memory.Backend.measure` call) must leave the model, the
optimizer and the process as it found them, whether the step finished, was stopped at a
limit (the tracker's ``MemoryLimitExceeded``) or ran out of memory; otherwise the next
probe starts from another state than a fresh step and measures something else. Measured
(tiny preset, FSDP2 over 2 simulated ranks, ``reshard_after_forward=False``, 2 x 64
tokens): a probe stopped at 80% of its peak left every layer gathered; the next probe
started with them allocated, and with ``parameters()`` being the gathered views it
registered those instead of the sharded parameters and their gradients: 3,688,468 B
instead of 4,582,676 B (-894,208 B, on the estimate and the cpu backend alike). A
forward-only step under ``no_grad`` leaves the layers gathered even when it finishes
(FSDP2 reshards them in backward, which never comes). On a GPU the leaked layers are real
memory, so later probes would over-measure instead.

:func:`isolate` runs before the call (outside the measurement) and returns a
:class:`ProbeSnapshot`; :meth:`ProbeSnapshot.restore` runs in a ``finally`` after it,
whatever happened, before the backend releases its caches. Both run inside the backend's
``context()`` (fake tensors on the estimate backend) and after the tracker has stopped or
the cuda statistics were read, so none of it is counted. What is put back:

- FSDP2: every root reachable from the registered modules is reset to what a fresh step
  starts from: ``FSDPModule.reset_iter_state()`` (torch 2.13; the same steps by hand where
  it is missing, :func:`_reset_by_hand`) waits on pending collectives, drops the all-gather,
  reduce-scatter and all-reduce states, the post-forward order, the root's iteration state
  and the queued post-backward callback, sets every training state to idle and reshards
  every parameter group; then the partial unsharded gradients of an aborted backward, the
  post-forward shards and pending gradient-offload events are dropped too. A model found
  mid-iteration is reset the same way *before* the call, so a probe measures one step from
  the fresh state whatever the caller did before (its own forward-only pass, say).
  Gradient-accumulation state that existed before the probe (unsharded accumulated
  gradients under ``set_requires_gradient_sync(False)``, HSDP partial reductions) is put
  back afterwards.
- FSDP1 (``FullyShardedDataParallel``, :mod:`batchfit.parallel.fsdp1`): every root reachable
  from the registered modules gets what FSDP1's end-of-backward callback does (every unit
  resharded, its gathered flat buffer freed, training states idle, the pre-backward,
  prefetch and post-forward flags and order cleared, the post-backward hooks removed), and
  what only an aborted step leaves is dropped: a low-precision shard of an unshard stopped
  before its end, the sharded gradient a backward set aside to accumulate into
  (``_saved_grad_shard``; put back if it existed before the probe, as ``no_sync``
  accumulation leaves it). FSDP1 keeps the root unit gathered after forward, and a
  forward-only pass leaves it (and with ``SHARD_GRAD_OP`` every unit) gathered: measured on
  the tiny preset over 2 simulated ranks, the next forward-only probe read 262,272 B less
  (the gathered root, the bf16 copy of the embeddings, norm and head, left over unregistered)
  before the reset. A tree found gathered or mid-iteration is reset before the call too.
- Gradients: every registered trainable parameter gets back the ``.grad`` tensor it had
  (held by weak reference, so that a step that frees it is measured freeing it). When
  that tensor died during the call, a finished probe keeps what the step left in its place
  (the same allocation as before); an aborted one drops its partial gradients (``None``).
  A gradient that did not exist before is dropped.
- Optimizer state: state tensors the probe created (the lazy state of a first ``step()``)
  are dropped, tensors it replaced are put back while they are alive: optimizers must be
  initialised before probing (the probe measures a step, not the creation of the state).
- Module ``train()``/``eval()`` flags and the grad mode (``torch.is_grad_enabled``).
- The autograd graph: released with the call's frames. After an aborted probe
  :meth:`Backend.measure` runs ``gc.collect()`` for the reference cycles through its
  frames (not after every probe: a full collection took 170 ms in a process with
  transformers loaded, more than a tiny model's probe); it releases the backend's caches
  (``torch.cuda.empty_cache()`` on cuda) after an aborted probe or one whose restoration
  freed memory (the cuda backend also releases them before every call).

Values are not restored: the parameters, the gradients' contents and the optimizer's
moments may have changed (a step that trains changes them); memory is what a probe
promises to leave as it was, and copying values would cost the memory being measured.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from batchfit.patching import undo_all

# A value of the optimizer's state that is not a tensor (a step count as a Python number):
# left as the probe left it (values are not restored).
_NOT_A_TENSOR = object()


def _ref(tensor: torch.Tensor | None) -> weakref.ref | None:
    return None if tensor is None else weakref.ref(tensor)


def _deref(ref: weakref.ref | None) -> torch.Tensor | None:
    return None if ref is None else ref()


def _objects(register: Any) -> Iterator[Any]:
    """The modules, optimizers and tensors in ``register``, however nested (as ``registered_tensors`` walks it)."""
    if isinstance(register, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        yield register
    elif isinstance(register, dict):
        for value in register.values():
            yield from _objects(value)
    elif isinstance(register, (list, tuple, set)):
        for value in register:
            yield from _objects(value)


# ----------------------------------------------------------------------------- FSDP2


def _fsdp_states(modules: list[torch.nn.Module]) -> list[Any]:
    """The FSDP2 states of every ``fully_shard``-ed module inside ``modules`` (each once)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    seen: dict[int, Any] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                state = sub._get_fsdp_state()
                seen.setdefault(id(state), state)
    return list(seen.values())


def _roots(states: list[Any]) -> list[Any]:
    """The root states of ``states``' FSDP trees that have run (lazily initialised) at least once."""
    roots: dict[int, Any] = {}
    for state in states:
        if state._is_root:
            roots.setdefault(id(state), state)
        elif state._is_root is False:  # a sub-module's state: its tree shares the root's context
            for other in state._state_ctx.all_states:
                if other._is_root:
                    roots.setdefault(id(other), other)
    return list(roots.values())


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # pragma: no cover - torch before per-parameter meshes
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def _busy(root: Any) -> bool:
    """True when the tree of ``root`` is not in the state a fresh step starts from (something gathered or in flight)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = root._state_ctx
    if ctx.iter_forward_root is not None or ctx.post_backward_final_callback_queued:
        return True
    for state in ctx.all_states:
        if state._training_state != TrainingState.IDLE:
            return True
        for group in _param_groups(state):
            if not group.is_sharded or group._training_state != TrainingState.IDLE:
                return True
            if getattr(group, "_all_gather_result", None) is not None:
                return True
            if any(_holds_gathered_storage(param) for param in group.fsdp_params):
                return True
    return False


def _holds_gathered_storage(param: Any) -> bool:
    """A sharded parameter whose all-gather output still has storage: an unshard stopped inside its copy-out.

    FSDP2 allocates the output's storage (``alloc_storage``) before the group is marked
    unsharded, so a step stopped in between leaves a group that calls itself sharded, which
    ``_to_sharded`` then leaves alone: the next probe's all-gather reused the storage instead
    of allocating it, and measured 262,272 B low after an abort at 50% of the peak (tiny
    preset, FSDP2 over 2 ranks without reshard after forward: the root's gathered bf16
    embeddings, norm and head).
    """
    outputs = [*getattr(param, "all_gather_outputs", ()), *(getattr(param, "_unsharded_inner_tensors", None) or ())]
    return any(t.untyped_storage().size() != 0 for t in outputs)


def _reset_by_hand(root: Any) -> None:
    """``FSDPModule.reset_iter_state()`` for torch versions without it: the same steps, attribute by attribute.

    Waits for the device (instead of each pending collective's event), drops what the
    iteration holds, sets every training state to idle and reshards every group.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    handle = getattr(root, "_device_handle", None)
    if handle is not None and hasattr(handle, "synchronize"):
        handle.synchronize()
    comm = root._comm_ctx
    if hasattr(comm, "all_gather_state"):
        comm.all_gather_state = None
    if hasattr(comm, "reduce_scatter_state"):  # torch <= 2.12: one state, not a list
        comm.reduce_scatter_state = None
    for name in ("reduce_scatter_states", "post_forward_order"):
        if isinstance(getattr(comm, name, None), list):
            getattr(comm, name).clear()
    if isinstance(getattr(comm, "_last_post_reduce_events", None), dict):
        comm._last_post_reduce_events.clear()
    ctx = root._state_ctx
    ctx.iter_forward_root = None
    ctx.post_backward_final_callback_queued = False
    for state in ctx.all_states:
        if isinstance(getattr(state, "_modules_to_run_forward", None), set):
            state._modules_to_run_forward.clear()
        state._training_state = TrainingState.IDLE
        for group in _param_groups(state):
            for name in (
                "_all_gather_result",
                "_post_reduce_event",
                "_all_reduce_state",
                "_reshard_after_forward_event",
                "_partial_reduce_output",
            ):
                if hasattr(group, name):
                    setattr(group, name, None)
            if isinstance(getattr(group, "_post_forward_indices", None), list):
                group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()


def _reset(root: Any) -> None:
    """Bring the FSDP2 tree of ``root`` back to what a fresh step starts from (NOTE [ Probes are isolated ])."""
    module = root._modules[0]
    if hasattr(module, "reset_iter_state"):
        module.reset_iter_state()
    else:
        _reset_by_hand(root)
    for state in root._state_ctx.all_states:
        for group in _param_groups(state):
            for param in group.fsdp_params:
                # what reset_iter_state leaves: an aborted backward's unsharded gradients
                # (post_backward moves them out; it never ran), the post-forward shard of
                # an int reshard_after_forward (to_sharded frees only the all-gather
                # output), and a pending gradient copy to the host (CPU offload on cuda)
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                if group.is_sharded and _holds_gathered_storage(param):
                    param.free_unsharded_param()  # an unshard stopped inside its copy-out
                if hasattr(param, "unsharded_accumulated_grad"):
                    param.unsharded_accumulated_grad = None
                if getattr(param, "_sharded_post_forward_param_data", None) is not None:
                    param._sharded_post_forward_param = None
                    param._sharded_post_forward_param_data = None
                event = getattr(param, "grad_offload_event", None)
                if event is not None:
                    event.synchronize()
                    param.grad_offload_event = None


@dataclass
class _FsdpSnapshot:
    """FSDP2 state to put back after the reset: gradient accumulation that existed before the probe."""

    states: list[Any]
    # (FSDPParam, unsharded .grad, unsharded_accumulated_grad) and (param group, partial reduce output)
    param_grads: list[tuple[Any, weakref.ref | None, weakref.ref | None]] = field(default_factory=list)
    partial_reductions: list[tuple[Any, weakref.ref | None]] = field(default_factory=list)

    @classmethod
    def take(cls, states: list[Any]) -> _FsdpSnapshot:
        snap = cls(states)
        for state in states:
            for group in _param_groups(state):
                snap.partial_reductions.append((group, _ref(getattr(group, "_partial_reduce_output", None))))
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    snap.param_grads.append(
                        (
                            param,
                            _ref(None if unsharded is None else unsharded.grad),
                            _ref(getattr(param, "unsharded_accumulated_grad", None)),
                        )
                    )
        return snap

    def restore(self) -> bool:
        """Reset every root, then put back what existed before; True when something was gathered or in flight."""
        # the tensors from before that are still alive, held while the reset drops them
        partial = [(group, _deref(ref)) for group, ref in self.partial_reductions]
        grads = [(param, _deref(grad), _deref(accumulated)) for param, grad, accumulated in self.param_grads]
        busy = False
        for root in _roots(self.states):
            busy = busy or _busy(root)
            _reset(root)
        for group, output in partial:
            if output is not None:
                group._partial_reduce_output = output
        for param, grad, accumulated in grads:
            if grad is not None:
                param._unsharded_param.grad = grad
            if accumulated is not None:
                param.unsharded_accumulated_grad = accumulated
        return busy


# ----------------------------------------------------------------------------- FSDP1


def _fsdp1_roots(modules: list[torch.nn.Module]) -> list[Any]:
    """The FSDP1 roots (``FullyShardedDataParallel`` initialised as a root) inside ``modules``, each once."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return []
    roots: dict[int, Any] = {}
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FullyShardedDataParallel) and sub._is_root:
                roots.setdefault(id(sub), sub)
    return list(roots.values())


def _fsdp1_handles(root: Any) -> list[tuple[Any, Any]]:
    """``(state, handle)`` of every unit of ``root``'s tree that manages parameters."""
    return [(state, state._handle) for state in root._all_fsdp_states if state._handle is not None]


def _fsdp1_gathered(handle: Any) -> bool:
    """True when ``handle``'s flat parameter is not its shard, or a gathered or low-precision buffer holds memory."""
    from batchfit.memory.fake_fsdp1 import same_address, storage_allocated

    flat = handle.flat_param
    if not same_address(flat, flat._local_shard):
        return True
    for name in ("_full_param_padded", "_full_prec_full_param_padded", "_mp_shard"):
        buffer = getattr(flat, name, None)
        if buffer is not None and storage_allocated(buffer):
            return True
    return False


def _fsdp1_busy(root: Any) -> bool:
    """True when the FSDP1 tree of ``root`` is not in the state a fresh step starts from (something gathered or in flight)."""
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    # (defined on the root by its first forward with gradients)
    if (
        vars(root).get("_post_backward_callback_queued", False)
        or root._exec_order_data.handles_post_forward_order
    ):
        return True
    for state, handle in _fsdp1_handles(root):
        if state.training_state != TrainingState.IDLE or handle._training_state != HandleTrainingState.IDLE:
            return True
        if hasattr(handle.flat_param, "_post_backward_hook_state") or _fsdp1_gathered(handle):
            return True
    return False


def _fsdp1_reset(root: Any) -> None:
    """Bring the FSDP1 tree of ``root`` back to what a fresh step starts from (NOTE [ Probes are isolated ]).

    What FSDP1's end-of-backward callback does (``_post_backward_final_callback``: every unit
    resharded, training states idle, the per-iteration flags and the post-forward order
    cleared, the post-backward hooks removed), and what only an aborted step leaves: the
    gathered flat buffers freed (the catch-all reshard frees them when its unit does not keep
    them), the low-precision shard of an unshard stopped before its end, the sharded
    gradient a backward set aside to accumulate into (``_saved_grad_shard``).
    """
    from torch.distributed.fsdp import _runtime_utils
    from torch.distributed.fsdp._common_utils import TrainingState
    from torch.distributed.fsdp._flat_param import HandleTrainingState

    from batchfit.memory.fake_fsdp1 import storage_allocated

    order = root._exec_order_data
    order.handles_post_forward_order.clear()
    if getattr(order, "_checking_order", False):
        order.current_order_index = 0
    root._post_backward_callback_queued = False
    for state in root._all_fsdp_states:
        state.training_state = TrainingState.IDLE
    for state, handle in _fsdp1_handles(root):
        flat = handle.flat_param
        hooks = getattr(flat, "_post_backward_hook_state", None)
        if hooks is not None:
            hooks[-1].remove()
            delattr(flat, "_post_backward_hook_state")
        if hasattr(flat, "_saved_grad_shard"):
            delattr(flat, "_saved_grad_shard")
        if hasattr(flat, "_post_backward_called"):
            flat._post_backward_called = False
        handle._training_state = HandleTrainingState.IDLE
        _runtime_utils._reshard(state, handle, True)  # the shard in use, the gathered buffer freed
        low_precision = getattr(flat, "_mp_shard", None)
        if low_precision is not None and storage_allocated(low_precision):
            low_precision.untyped_storage().resize_(0)
        handle._ran_pre_backward_hook = False
        handle._needs_pre_backward_unshard = False
        handle._post_forward_index = None
        handle._prefetched = False


@dataclass
class _Fsdp1Snapshot:
    """FSDP1 state to put back after the reset.

    ``saved``: the sharded gradients set aside before the probe (``no_sync`` accumulation
    leaves ``_saved_grad_shard`` between backwards). ``grad_storages``: the storage of each flat
    parameter's gradient, as a key (no reference): FSDP1's pre-backward sets the gradient aside
    as ``grad.data``, a new tensor on the same storage, and drops ``.grad``, so after an aborted
    backward the gradient from before lives on only there (:meth:`restore` hands it back).
    """

    roots: list[Any]
    saved: list[tuple[Any, weakref.ref | None, int | None]] = field(default_factory=list)

    @classmethod
    def take(cls, roots: list[Any]) -> _Fsdp1Snapshot:
        snap = cls(roots)
        for root in roots:
            for _, handle in _fsdp1_handles(root):
                flat = handle.flat_param
                grad = flat.grad
                key = None if grad is None else grad.untyped_storage()._cdata
                snap.saved.append((flat, _ref(getattr(flat, "_saved_grad_shard", None)), key))
        return snap

    def restore(self) -> tuple[bool, dict[int, torch.Tensor]]:
        """Reset every root, then put back what existed before.

        Returns:
            True when something was gathered or in flight; and ``{id(flat parameter): tensor}``
            for the gradients from before that only a set-aside tensor still holds (the same
            storage), to give back as ``.grad``.
        """
        saved = [(flat, _deref(ref)) for flat, ref, _ in self.saved]  # held while the reset drops them
        revived: dict[int, torch.Tensor] = {}
        for flat, _, key in self.saved:
            aside = getattr(flat, "_saved_grad_shard", None)
            if key is not None and aside is not None and aside.untyped_storage()._cdata == key:
                revived[id(flat)] = aside
        busy = False
        for root in self.roots:
            busy = busy or _fsdp1_busy(root)
            _fsdp1_reset(root)
        for flat, shard in saved:
            if shard is not None:
                flat._saved_grad_shard = shard
        return busy, revived


# ----------------------------------------------------------------------------- the snapshot


@dataclass
class ProbeSnapshot:
    """What a probe may change in its registered state, taken before the call (NOTE [ Probes are isolated ]).

    Holds no strong reference to a tensor the step may free (gradients, optimizer state are
    held weakly), so taking it changes no measurement.
    """

    fsdp: _FsdpSnapshot
    fsdp1: _Fsdp1Snapshot
    grads: list[tuple[torch.Tensor, weakref.ref | None]]
    optimizers: list[tuple[torch.optim.Optimizer, dict[torch.Tensor, dict[Any, Any] | None]]]
    modes: list[tuple[torch.nn.Module, bool]]
    grad_enabled: bool

    def restore(self, *, finished: bool) -> bool:
        """Put the registered state back as it was before the call; call it once, in a ``finally``.

        Args:
            finished: the call returned normally (``False``: it was stopped at a limit, ran out
                of memory or raised); decides the fate of gradients that died during the call.

        Returns:
            True when the restoration freed or dropped something the call left behind
            (gathered FSDP parameters, iteration state, gradients or optimizer state), so
            that the backend's caches are worth releasing.
        """
        # every step runs even when one raises; the first failure is raised at the end
        # (NOTE [ Every undo step runs ] in batchfit.patching)
        changed = False
        revived: dict[int, torch.Tensor] = {}

        def fsdp() -> None:
            nonlocal changed
            changed = self.fsdp.restore() or changed

        def fsdp1() -> None:
            nonlocal changed
            gathered, found = self.fsdp1.restore()
            revived.update(found)
            changed = gathered or changed

        def grads() -> None:
            nonlocal changed
            changed = self._restore_grads(finished, revived) or changed

        def optimizers() -> None:
            nonlocal changed
            changed = self._restore_optimizers() or changed

        def modes() -> None:
            for module, training in self.modes:
                module.training = training

        # the gradients from before that are still alive, held while the FSDP resets drop what
        # holds them (FSDP1 sets a sharded gradient aside in _saved_grad_shard during backward)
        alive = [_deref(ref) for _, ref in self.grads]
        undo_all(
            (
                lambda: torch.set_grad_enabled(self.grad_enabled),
                fsdp,
                fsdp1,
                grads,
                alive.clear,
                optimizers,
                modes,
            )
        )
        return changed

    def _restore_grads(self, finished: bool, revived: dict[int, torch.Tensor]) -> bool:
        changed = False
        for param, ref in self.grads:
            now = param.grad
            if ref is None:
                grad = None
            else:
                grad = ref()
                if grad is None:
                    # FSDP1 set it aside on the same storage (_Fsdp1Snapshot), or the step
                    # freed it and made the same allocation again
                    grad = revived.get(id(param), now if finished else None)
            if grad is not now:
                param.grad = grad
                changed = changed or now is not None
        return changed

    def _restore_optimizers(self) -> bool:
        changed = False
        for optimizer, before in self.optimizers:
            state = optimizer.state
            for param in list(state):
                if before.get(param) is None:  # created by the probe
                    del state[param]
                    changed = True
            for param, entries in before.items():
                if entries is None:
                    continue
                now = state[param]
                for key in [k for k in now if k not in entries]:
                    del now[key]
                    changed = True
                for key, ref in entries.items():
                    if ref is _NOT_A_TENSOR:
                        continue
                    old = ref()
                    if old is not None and now.get(key) is not old:
                        changed = changed or key in now
                        now[key] = old
        return changed


def _optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, dict[Any, Any] | None]:
    before: dict[torch.Tensor, dict[Any, Any] | None] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            before[param] = None
    for param, entries in optimizer.state.items():
        before[param] = {
            key: weakref.ref(value) if isinstance(value, torch.Tensor) else _NOT_A_TENSOR
            for key, value in entries.items()
        }
    return before


def isolate(register: Any) -> ProbeSnapshot:
    """Prepare a probe of ``register``'s state and take what :meth:`ProbeSnapshot.restore` puts back.

    Resets the FSDP2 and FSDP1 trees of the registered modules first when they are
    mid-iteration or gathered (NOTE [ Probes are isolated ]), so the call starts from what a fresh step
    starts from. Call it outside the measurement, inside the backend's ``context()``.

    Args:
        register: what :meth:`batchfit.memory.Backend.measure` registers: modules,
            optimizers, tensors, or (nested) tuples, lists and dicts of them.

    Returns:
        The snapshot; call its :meth:`~ProbeSnapshot.restore` once the call is over.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> snapshot = isolate(lin)
        >>> lin(torch.ones(1, 2)).sum().backward()  # a probe that leaves gradients behind
        >>> snapshot.restore(finished=True), lin.weight.grad
        (True, None)
    """
    objects = list(_objects(register))
    modules = [o for o in objects if isinstance(o, torch.nn.Module)]
    states = _fsdp_states(modules)
    for root in _roots(states):
        if _busy(root):  # found mid-iteration or gathered: start from the fresh state
            _reset(root)
    fsdp = _FsdpSnapshot.take(states)
    fsdp1_roots = _fsdp1_roots(modules)
    for root in fsdp1_roots:
        if _fsdp1_busy(root):
            _fsdp1_reset(root)
    fsdp1 = _Fsdp1Snapshot.take(fsdp1_roots)
    params: dict[int, torch.Tensor] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if p.requires_grad:
                    params.setdefault(id(p), p)
        elif isinstance(obj, torch.Tensor) and obj.requires_grad and obj.is_leaf:
            params.setdefault(id(obj), obj)
    modes: dict[int, tuple[torch.nn.Module, bool]] = {}
    for module in modules:
        for sub in module.modules():
            modes.setdefault(id(sub), (sub, sub.training))
    return ProbeSnapshot(
        fsdp=fsdp,
        fsdp1=fsdp1,
        # weak references: holding the old gradients would keep them alive through a step
        # that frees them (zero_grad(set_to_none=True)) and inflate its measured peak
        grads=[(p, _ref(p.grad)) for p in params.values()],
        optimizers=[(o, _optimizer_snapshot(o)) for o in objects if isinstance(o, torch.optim.Optimizer)],
        modes=list(modes.values()),
        grad_enabled=torch.is_grad_enabled(),
    )
