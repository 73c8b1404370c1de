"""FSDP1's data-pointer comparisons made right for fake tensors, while the estimate backend's context is active.

NOTE [ FSDP1 compares data pointers ]
PyTorch's ``FullyShardedDataParallel`` (FSDP1, :mod:`batchfit.parallel.fsdp1`) decides some of
its steps by comparing data pointers. Under ``FakeTensorMode`` every storage's ``data_ptr()``
is 0 and a tensor's ``data_ptr()`` is its storage offset in bytes, so the comparisons give
wrong answers (torch 2.13, ``torch/distributed/fsdp``):

- ``_runtime_utils._catch_all_reshard``, run for every unit at the end of backward, takes a
  unit for resharded when ``flat_param.data_ptr() == flat_param._local_shard.data_ptr()``:
  under fake tensors always (both are 0 for the sharded and the gathered flat parameter). A
  unit gathered in backward whose post-backward hook never runs -- one whose flat parameter
  gets no gradient: a frozen unit, such as a LoRA model's root, which holds the frozen
  embeddings and head -- stays gathered under the estimate, while real tensors free it.
  Measured (tiny preset, its root's parameters frozen, FSDP1 over 2 simulated ranks, bf16
  compute): the estimate's optimizer phase held 262,272 B more than the cpu backend's (the
  root's bf16 parameters, gathered); without the probe's isolation (NOTE [ Probes are
  isolated ]) the next probe's peak was 262,272 B lower (the gathered root left over,
  unregistered).
- ``_flat_param._same_storage`` (every pair is "the same storage") and
  ``_flat_param._data_ptr_allocated`` (nothing is allocated), used by
  ``_writeback_orig_params`` with ``use_orig_params=True``: a parameter swapped by the user
  would not be written back, and an assertion would fire. batchfit wraps with verl's default
  ``use_orig_params=False``, which never calls them; they are made right all the same.

:func:`fsdp1_fake_patches` replaces the three functions in their modules (FSDP1 looks them up
there at each call) with versions that, for fake tensors, compare what the pointers stand for:
the storage (its ``StorageImpl``, ``untyped_storage()._cdata``, the key the live-storage
tracker uses too) and the byte offset into it; "allocated" is a storage of nonzero size. Real
tensors go to the original functions unchanged. The estimate backend's ``context()`` installs
them while it is active (the step, the probe's isolation and building run inside it);
outside, FSDP1 is untouched. The replacement of ``_catch_all_reshard`` repeats its body
(torch 2.13) with the fake-aware test: ``tests/test_fsdp1.py`` checks that a frozen root is
freed at the end of backward under the estimate as on real tensors.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from batchfit.patching import AttributePatch


def _local(tensor: Any) -> Any:
    """A DTensor's local tensor (FSDP1's ``_same_storage`` unwraps them the same way), else ``tensor``."""
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` share a storage (for fake tensors: the same ``StorageImpl``)."""
    a, b = _local(a), _local(b)
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def same_address(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a.data_ptr() == b.data_ptr()`` would be on real tensors: same storage, same byte offset."""
    return (
        same_storage(a, b) and a.storage_offset() * a.element_size() == b.storage_offset() * b.element_size()
    )


def storage_allocated(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s storage holds memory (what a nonzero data pointer means on real tensors)."""
    return _local(tensor).untyped_storage().nbytes() > 0


def _module(name: str) -> Any:
    """``torch.distributed.fsdp.<name>``, ``None`` on a torch without distributed."""
    try:
        return importlib.import_module(f"torch.distributed.fsdp.{name}")
    except ImportError:  # pragma: no cover - torch without distributed
        return None


# NOTE [ Shared and counted ] in batchfit.patching: looked up at the first estimate
# (importing FSDP costs time); an attribute that moved is left alone
_CATCH_ALL = AttributePatch(lambda: _module("_runtime_utils"), "_catch_all_reshard", lazy=True)
_SAME_STORAGE = AttributePatch(lambda: _module("_flat_param"), "_same_storage", lazy=True)
_ALLOCATED = AttributePatch(lambda: _module("_flat_param"), "_data_ptr_allocated", lazy=True)
_PATCHES = (_CATCH_ALL, _SAME_STORAGE, _ALLOCATED)


@_CATCH_ALL.bind
def _catch_all_reshard(state: Any) -> None:
    handle = state._handle
    if not handle or not is_fake(handle.flat_param):
        return _CATCH_ALL.call_below(state)
    from torch.distributed.fsdp import _runtime_utils

    flat_param = handle.flat_param
    # torch 2.13's body, with the data-pointer test made for fake tensors
    if same_address(flat_param, flat_param._local_shard) and not handle._skipped_use_sharded_views:
        return None
    free = _runtime_utils._should_free_in_backward(state, handle)
    _runtime_utils._reshard(state, handle, free)
    return None


@_SAME_STORAGE.bind
def _same_storage(a: Any, b: Any) -> bool:
    if is_fake(_local(a)) or is_fake(_local(b)):
        return same_storage(a, b)
    return _SAME_STORAGE.call_below(a, b)


@_ALLOCATED.bind
def _data_ptr_allocated(tensor: Any) -> bool:
    return storage_allocated(tensor) if is_fake(_local(tensor)) else _ALLOCATED.call_below(tensor)


@contextlib.contextmanager
def fsdp1_fake_patches() -> Iterator[None]:
    """Apply NOTE [ FSDP1 compares data pointers ] while inside; restore on exit (also on error).

    A no-op when torch has no FSDP1 (no ``torch.distributed``) or the functions moved.
    Nested and concurrent blocks share one installation (NOTE [ Shared and counted ] in
    :mod:`batchfit.patching`): the last to exit puts back each original still replaced
    by ours, whatever the order the blocks exit in.
    """
    with contextlib.ExitStack() as stack:
        for patch in _PATCHES:
            stack.enter_context(patch.active())
        yield
