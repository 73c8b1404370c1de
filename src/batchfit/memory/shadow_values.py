"""Integer and bool tensors keep their real values under the estimate's fake mode, so data-dependent shapes run.

NOTE [ Integer tensors keep their values ]
A plain ``FakeTensorMode`` knows shapes, not values, so it refuses every op whose output
shape or result is read from data: ``nonzero``, ``masked_select``, ``x[bool_mask]``,
``torch.where(cond)``, ``unique``, ``repeat_interleave(repeats)``, ``.item()``,
``.tolist()``, ``if t:``. Remove-padding (flash-attn's ``unpad_input``: ``nonzero`` of the
attention mask, ``seqlens.max().item()``, ``cu_seqlens``) and masked log-prob kernels
(``logits[mask]``) are made of them. In those paths the shapes come from small integer and
bool tensors made from host data (masks, lengths, index tensors, position ids), never from
the large float tensors (hidden states, logits), whose values only decide other values.

So :class:`ShadowFakeTensorMode` keeps a real *shadow* beside every fake tensor of an
integer or bool dtype whose values can be known:

- **Where values come from.** An op whose tensor arguments all have known values (real
  integer/bool tensors, such as the host data a step copies to the device inside the
  measured call, NOTE [ Tensors made from host data are allocations ] in the tracker; or
  fakes with a shadow), and whose outputs are all integer/bool fakes of at most
  :attr:`ShadowFakeTensorMode.shadow_limit_bytes` of storage each, runs a second time on
  the shadows, for real, after the fake run decided the output shapes; each output gets
  its real result as shadow. Factories (``arange``, ``zeros(dtype=long)``) count as ops
  whose (no) arguments are known. Float tensors never have a shadow, whatever they were
  computed from: their values are never read, and a shape that depends on them raises.
- **Data-dependent ops.** An op tagged data-dependent whose arguments are all known runs on
  the shadows only (the fake run would refuse it), and so does any op the fake run refuses
  (``DynamicOutputShapeException``, ``DataDependentOutputException``) when its arguments
  are all known: its tensors come back as fresh fakes of the real result's sizes, strides
  and dtype, with the result as shadow, and a Python number for ``.item()``. When only the
  arguments that decide the shape are known, two ops are rewritten: ``index`` with a bool
  mask becomes ``index`` with the mask's ``nonzero`` columns (ATen does the same inside its
  kernel), and ``masked_select`` an output of ``mask.sum()`` elements. Otherwise
  :class:`UnknownValuesError` names the op and the argument whose values are missing,
  never a guess: a shape decided by float data (the per-expert loop of a mixture of experts
  on its router's own choice, whose tokens per expert come from the router's logits: the
  probe fixes the worst-case routing as integers instead, NOTE [ The worst case of a
  routing-dependent loop ] in :mod:`batchfit.models.moe`, and ``grouped_mm`` has no
  data-dependent shape; ``nonzero`` of sampled tokens) cannot be estimated, nor an ``out=`` form of a data-dependent op (its ``out`` would have to be
  resized). An op whose run on the shadows fails leaves its outputs unknown.
- **Writes.** An in-place op (or ``out=``) that runs on the shadows keeps them valid; any
  other write to a shadowed fake (unknown values, a collective, a non-aten op) drops the
  shadow of that tensor and of every view of it. A fake and the views made from it by ops
  that ran on the shadows share one record of validity, and a fake's version counter
  (shared with its views by autograd) must still read what the record expects: ATen bumps
  it after each write, so a write the shadows followed moves the expected version along,
  any other write leaves the record behind and marks it invalid explicitly (for writes
  made below autograd, and for tensors made under ``torch.inference_mode``, which have no
  version counter: explicit marks alone keep them right). A view that gets no values (a
  float view of an integer tensor) still shares the record, so a write through it drops
  the values of what it views.

What the tracker counts is unchanged: the outputs it sees are the same fakes, with the
sizes the real run gives them, so the estimate equals the cpu backend to the byte on these
paths (``tests/test_dynamic_shapes.py``). The ops the shadows run are not seen by the
tracker (they run below it, as the kernels' own temporaries do on the cpu backend). The
shadows are host memory the estimate spends, bounded by the limit per tensor (a
data-dependent op on known values allocates its real integer result whatever its size) and
freed with their fakes; no float tensor is ever made real. transformers' packed-sequence
check reads position ids through them (NOTE [ Fake tensors are not tracing ]).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._mode_utils import no_dispatch
from torch.utils._pytree import tree_leaves, tree_map_only

from batchfit.errors import BatchfitError
from batchfit.memory.sizes import format_bytes

#: Largest storage, in bytes, of one tensor whose values are kept (a mask or index tensor
#: of 2M int64 entries); larger integer tensors are fakes without values.
SHADOW_LIMIT_BYTES = 16 * 2**20

# the attribute of a fake tensor that holds ``(shadow or None, _Validity)``
_SHADOW = "_batchfit_shadow"
_DATA_DEPENDENT = (DynamicOutputShapeException, DataDependentOutputException)
# ops whose real result may share memory with the caller's own host tensor: copied
_LIFTS = frozenset(
    op.default
    for op in (getattr(torch.ops.aten, name, None) for name in ("lift_fresh", "lift", "lift_fresh_copy"))
    if op is not None
)


class UnknownValuesError(BatchfitError, RuntimeError):
    """An op needs values the estimate does not have: a shape or a number read from a float tensor (or one computed from one).

    Raised inside a step measured with the ``estimate`` backend (NOTE [ Integer tensors
    keep their values ] in :mod:`batchfit.memory.shadow_values`). ``op`` is the ATen op
    (``"aten.nonzero.default"``), ``argument`` the name of the argument whose values are
    missing (empty when none is: the ``out=`` form of such an op). The same step runs on
    the ``cpu`` backend, which has the values.
    """

    def __init__(self, message: str, *, op: str, argument: str):
        self.op = op
        self.argument = argument
        super().__init__(message)


_VALUE_DTYPES = frozenset(
    d
    for d in (
        getattr(torch, n, None)
        for n in ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    )
    if d is not None
)


def is_value_dtype(dtype: torch.dtype) -> bool:
    """True for the dtypes whose tensors keep their values: bool and the integer types."""
    return dtype in _VALUE_DTYPES


class _Validity:
    """What a fake and its views share: still valid, and the version their counter must read (``None``: no counter)."""

    __slots__ = ("valid", "version")

    def __init__(self, version: int | None):
        self.valid = True
        self.version = version


def _version_of(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def shadow_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The real tensor holding ``tensor``'s values, ``None`` when they are not known.

    A real integer/bool tensor is its own shadow; a fake one has a shadow while nothing
    wrote unknown values into it or into a view of it (NOTE [ Integer tensors keep their
    values ]); a float tensor never has one.
    """
    if tensor.dtype not in _VALUE_DTYPES:
        return None
    if isinstance(tensor, FakeTensor):
        record = tensor.__dict__.get(_SHADOW)
        if record is not None:
            real, validity = record
            if validity.valid and (validity.version is None or _version_of(tensor) == validity.version):
                if real is not None:
                    return real
            else:
                del tensor.__dict__[_SHADOW]  # written since: unknown for good
        return tensor.constant  # FakeTensorMode's own values of one-element lifts, or None
    return tensor if _plain_host_values(tensor) else None


def _validity(tensor: Any) -> _Validity | None:
    record = tensor.__dict__.get(_SHADOW) if isinstance(tensor, FakeTensor) else None
    return None if record is None else record[1]


def _plain_host_values(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_meta


def _argument(func: OpOverload, index: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    arg = func._schema.arguments[index]
    return kwargs.get(arg.name) if (arg.kwarg_only or index >= len(args)) else args[index]


@functools.cache
def _roles(func: OpOverload) -> tuple[tuple[int, ...], int | None]:
    """``(arguments func writes to, the argument its outputs view or None)``, from its schema.

    A list return (``unbind``, ``split``) carries its alias set on the elements, not on the
    list, so any aliasing return points at the first aliased argument that is not written.
    """
    schema = func._schema
    written = tuple(
        i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
    )
    viewed = None
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        viewed = next(
            (
                i
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and not a.alias_info.is_write
            ),
            None,
        )
    return written, viewed


@functools.cache
def _data_dependent(func: OpOverload) -> bool:
    """Tagged as data-dependent: its output shape (or a Python value) is read from its inputs' data."""
    return torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags


def _written(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (its schema's mutable arguments)."""
    return [
        t
        for i in _roles(func)[0]
        for t in tree_leaves(_argument(func, i, args, kwargs))
        if isinstance(t, torch.Tensor)
    ]


def _viewed(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The argument a view op's outputs alias (``self`` of ``select``, ``expand``, ``unbind``), else ``None``."""
    index = _roles(func)[1]
    return None if index is None else _argument(func, index, args, kwargs)


class ShadowFakeTensorMode(FakeTensorMode):
    """A ``FakeTensorMode`` whose integer and bool tensors keep their real values.

    Used by the ``estimate`` backend. Data-dependent ops (``nonzero``, ``masked_select``,
    boolean indexing, ``unique``, ``repeat_interleave``, ``.item()``, ``.tolist()``) run
    when the values that decide them are integer/bool values the step made from host
    data; float tensors stay fake. See NOTE [ Integer tensors keep their values ].

    Attributes:
        shadow_limit_bytes: the largest storage of one tensor whose values are kept
            (:data:`SHADOW_LIMIT_BYTES`); larger integer tensors are plain fakes.

    Raises:
        UnknownValuesError: from the op whose shape or result depends on values that are
            not known (float data, or integer data computed from it).

    Example:
        >>> mode = ShadowFakeTensorMode(allow_non_fake_inputs=True)
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> with mode:
        ...     hidden = torch.randn(2, 3, 1024)  # fake: no memory
        ...     rows = hidden[mask.to("cpu", copy=True).bool()]
        ...     n = int(mask.to("cpu", copy=True).sum())
        >>> tuple(rows.shape), n
        ((3, 1024), 3)
    """

    shadow_limit_bytes: int = SHADOW_LIMIT_BYTES

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._inside = False  # inside the fake run of an op: its sub-ops are not followed

    # ----------------------------------------------------------------- dispatch
    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self._inside or not isinstance(func, OpOverload) or func._namespace == "prim":
            return super().dispatch(func, types, args, kwargs)
        known = self._known(args) and self._known(kwargs.values())
        if known and _data_dependent(func) and self._runs_for_real(func):
            return self._run_for_real(func, args, kwargs)
        self._inside = True
        try:
            out = super().dispatch(func, types, args, kwargs)
        except _DATA_DEPENDENT as exc:
            self._inside = False
            return self._refused(func, types, args, kwargs, known, exc)
        finally:
            self._inside = False
        if out is not NotImplemented and (known or _roles(func)[0]):
            self._follow(func, args, kwargs, known, out)
        return out

    def _known(self, objs: Any) -> bool:
        """Every tensor in ``objs`` (arguments, lists of them) has known values."""
        for a in objs:
            if isinstance(a, torch.Tensor):
                if (isinstance(a, FakeTensor) and a.fake_mode is not self) or shadow_of(a) is None:
                    return False
            elif isinstance(a, (list, tuple)) and not self._known(a):
                return False
        return True

    @staticmethod
    def _real(args: Any, kwargs: Any) -> tuple[Any, Any]:
        """The arguments with every tensor replaced by its shadow (all known)."""
        return tree_map_only(torch.Tensor, shadow_of, (args, kwargs))

    # ----------------------------------------------------------------- ops the fake run decided
    def _follow(self, func: OpOverload, args: Any, kwargs: Any, known: bool, out: Any) -> None:
        """After the fake run: give the outputs their shadows, or drop the shadows the op wrote over."""
        written = _written(func, args, kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if (
            known
            and func._namespace == "aten"
            and (outputs or written)
            and all(isinstance(t, FakeTensor) for t in written)  # never write to the caller's host tensors
            and all(self._keepable(t) for t in outputs)
        ):
            real_args, real_kwargs = self._real(args, kwargs)
            try:
                with no_dispatch():
                    real_out = func(*real_args, **real_kwargs)
            except (RuntimeError, IndexError, ValueError):
                real_out = None  # the values cannot follow: unknown from here (never a guess)
            if real_out is not None:
                for t in written:
                    validity = _validity(t)
                    if validity is not None and validity.version is not None:
                        validity.version += 1  # ATen bumps the fake's counter once we return
                if func in _LIFTS:
                    real_out = tree_map_only(torch.Tensor, torch.clone, real_out)
                viewed = _viewed(func, args, kwargs)
                shared = _validity(viewed) if isinstance(viewed, torch.Tensor) else None
                reals = [t for t in tree_leaves(real_out) if isinstance(t, torch.Tensor)]
                for fake, real in zip(outputs, reals):
                    self._attach(fake, real, shared)
                return
        viewed = _viewed(func, args, kwargs)
        shared = _validity(viewed) if isinstance(viewed, torch.Tensor) else None
        if shared is not None:
            # a view without values (another dtype, or its values did not follow): it still
            # shares the validity, so a write through it drops the values of what it views
            for fake in outputs:
                if isinstance(fake, FakeTensor) and _SHADOW not in fake.__dict__:
                    fake.__dict__[_SHADOW] = (None, shared)
        for t in written:
            validity = _validity(t)
            if validity is not None:
                validity.valid = False  # an unmirrored write: this tensor and its views are unknown now

    def _keepable(self, t: torch.Tensor) -> bool:
        return (
            isinstance(t, FakeTensor)
            and t.fake_mode is self
            and is_value_dtype(t.dtype)
            and t.device.type != "meta"
            and t.untyped_storage().nbytes() <= self.shadow_limit_bytes
        )

    def _attach(self, fake: torch.Tensor, real: torch.Tensor, shared: _Validity | None = None) -> None:
        """Give ``fake`` the shadow ``real``; a view shares the validity of what it views."""
        if not isinstance(fake, FakeTensor) or real.shape != fake.shape or real.dtype != fake.dtype:
            return
        record = fake.__dict__.get(_SHADOW)
        if record is not None and record[0] is real:
            return  # an in-place op's output is its input: already attached
        # A view's version counter becomes its base's only once this op returns (autograd's
        # as_view, above the dispatch modes): it shares the validity of what it views as is.
        if shared is None:
            shared = _Validity(_version_of(fake))
        fake.__dict__[_SHADOW] = (real, shared)

    # ----------------------------------------------------------------- ops the fake run refuses
    @staticmethod
    def _runs_for_real(func: OpOverload) -> bool:
        """An aten op that returns new tensors (an ``out=`` form would have to resize its ``out``)."""
        return func._namespace == "aten" and not _roles(func)[0]

    def _run_for_real(self, func: OpOverload, args: Any, kwargs: Any) -> Any:
        """Run a data-dependent op on known values; its tensors come back as fresh fakes with shadows."""
        real_args, real_kwargs = self._real(args, kwargs)
        with no_dispatch():
            real_out = func(*real_args, **real_kwargs)
        return tree_map_only(torch.Tensor, self._fresh_fake_of, real_out)

    def _fresh_fake_of(self, real: torch.Tensor) -> torch.Tensor:
        fake = self._fresh(tuple(real.shape), real.stride(), real.dtype, real.device)
        if self._keepable(fake):
            self._attach(fake, real)
        return fake

    def _fresh(
        self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A new fake (as an op output: its own storage, sized as the real kernel sizes it)."""
        inside, self._inside = self._inside, True
        try:
            with self:
                return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        finally:
            self._inside = inside

    def _refused(
        self,
        func: OpOverload,
        types: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        known: bool,
        exc: Exception,
    ) -> Any:
        """The fake run refused ``func``: run it on the shadows, rewrite it, or name what is missing."""
        if known and self._runs_for_real(func):
            return self._run_for_real(func, args, kwargs)
        if func is torch.ops.aten.index.Tensor:
            out = self._index_by_known_masks(types, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is torch.ops.aten.masked_select.default:
            out = self._masked_select_by_known_mask(args, kwargs)
            if out is not NotImplemented:
                return out
        raise self._unknown(func, args, kwargs, exc) from exc

    def _index_by_known_masks(self, types: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``x[mask]`` with a known mask: index with the mask's ``nonzero`` columns instead."""
        self_t = args[0] if args else kwargs.get("self")
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if indices is None:
            return NotImplemented
        rewritten: list[Any] = []
        for index in indices:
            if isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8):
                mask = shadow_of(index)
                if mask is None:
                    return NotImplemented
                with no_dispatch():
                    columns = mask.nonzero().unbind(1)
                rewritten.extend(self._fresh_fake_of(c.contiguous()) for c in columns)
            else:
                rewritten.append(index)
        return self.dispatch(torch.ops.aten.index.Tensor, types, (self_t, rewritten), {})

    def _masked_select_by_known_mask(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``masked_select(x, mask)`` with a known mask: ``mask.sum()`` elements of ``x``'s dtype."""
        self_t = args[0] if args else kwargs["self"]
        mask_t = args[1] if len(args) > 1 else kwargs["mask"]
        mask = shadow_of(mask_t)
        if mask is None:
            return NotImplemented
        shape = torch.broadcast_shapes(self_t.shape, mask_t.shape)
        with no_dispatch():
            count = int(mask.expand(shape).sum())
        return self._fresh((count,), (1,), self_t.dtype, self_t.device)

    def _unknown(
        self, func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], exc: Exception
    ) -> UnknownValuesError:
        # the argument to name: an integer/bool one first (a mask or indices decide shapes), else any
        unknown = [
            (arg.name, t)
            for i, arg in enumerate(func._schema.arguments)
            for t in tree_leaves(_argument(func, i, args, kwargs))
            if isinstance(t, torch.Tensor) and shadow_of(t) is None
        ]
        unknown.sort(key=lambda pair: not is_value_dtype(pair[1].dtype))  # stable: schema order kept
        what = (
            "a Python number read from a tensor"
            if isinstance(exc, DataDependentOutputException)
            else "an output shape"
        )
        if _roles(func)[0]:
            why = "data, and its out= form cannot follow it; call it without out="
        elif not unknown:
            why = "values the estimate does not have"
        else:
            name, t = unknown[0]
            size = t.untyped_storage().nbytes()
            if not is_value_dtype(t.dtype):
                why = f"the values of {name}, a {t.dtype} tensor of shape {tuple(t.shape)}: float values are never kept"
            elif size > self.shadow_limit_bytes:
                why = f"the values of {name}, a {t.dtype} tensor of {format_bytes(size)}: integer values are kept up to {format_bytes(self.shadow_limit_bytes)} per tensor"
            else:
                why = f"the values of {name}, a {t.dtype} tensor of shape {tuple(t.shape)} computed from values the estimate does not have (float data, a collective, or a write of such values)"
        return UnknownValuesError(
            f"the estimate backend cannot run {func}: {what} depends on {why}; only integer and bool tensors made from host data (masks, lengths, indices, position ids) and what is computed from them alone keep their values (NOTE [ Integer tensors keep their values ]); derive the shape from such tensors, or measure this step with backend='cpu'",
            op=str(func),
            argument=unknown[0][0] if unknown else "",
        )
