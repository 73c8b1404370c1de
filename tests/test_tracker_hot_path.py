"""The tracker's per-op helpers (NOTE [ The tracker's hot path ] in batchfit.memory.tracker) read what pytree reads."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils._pytree import tree_flatten

from batchfit.memory.tracker import MemoryTracker, _has_dtensor, _storage_keys

Pair = namedtuple("Pair", "first second")


def _pytree_keys(args, kwargs):
    return {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}


def _cases():
    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4)
    view = a[1:]  # a view: the storage of ``a``
    return {
        "tensors": ((a, b), {}),
        "scalars and a kwarg": ((a, 2, 0.5, None, torch.float32), {"other": c}),
        "flat list with None": (([a, None, b],), {}),
        "nested list": (([[a], (b, [c])],), {}),
        "dict": (({"x": a, "y": [b]},), {}),
        "namedtuple": ((Pair(a, b),), {"out": Pair(c, None)}),
        "view": ((view, a), {}),
        "no tensors": ((1, "mean", torch.device("cpu")), {}),
        "kwargs None": ((a,), None),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_storage_keys_are_pytrees(name):
    args, kwargs = _cases()[name]
    assert _storage_keys(args, kwargs) == _pytree_keys(args, kwargs or {})


def test_storage_keys_of_a_view_name_its_base():
    a = torch.zeros(8)
    assert _storage_keys((a[2:],), {}) == {a.untyped_storage()._cdata}


def test_has_dtensor():
    from torch.distributed.tensor import DTensor

    class Sub(DTensor):
        pass

    assert not _has_dtensor(())
    assert not _has_dtensor((torch.Tensor,))
    assert _has_dtensor((torch.Tensor, DTensor))
    assert _has_dtensor((Sub,))
    assert not _has_dtensor((torch.Tensor,))  # answered from what was seen


def test_inplace_op_on_a_view_of_registered_state_counts_nothing():
    # the tracker's view rule reads the inputs' storages through _storage_keys
    x = torch.zeros(1024)
    with MemoryTracker() as t:
        x[:512].add_(1)
        y = torch.stack([x[:4], x[4:8]])  # a list argument: a new 32-byte output
    assert t.peak_bytes == y.untyped_storage().nbytes() == 32


def test_is_meta_of_fake_tensors_is_their_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from batchfit.memory.tracker import _is_meta

    mode = FakeTensorMode()
    with mode:
        fake_cpu, fake_meta = torch.empty(3), torch.empty(3, device="meta")
    for t in (fake_cpu, fake_meta, torch.empty(2), torch.empty(2, device="meta")):
        assert _is_meta(t) == t.is_meta
    assert not _is_meta(fake_cpu) and _is_meta(fake_meta)
