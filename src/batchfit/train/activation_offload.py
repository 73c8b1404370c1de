"""Activation offload: the tensors each decoder layer saves for backward wait in host memory.

NOTE [ Activation offload as verl runs it ]
verl's ``enable_activation_offload`` (``actor_rollout_ref.model`` and ``critic.model``) calls
``enable_activation_offloading(module, strategy, enable_gradient_checkpointing)`` in
``verl/utils/activation_offload.py`` (read at volcengine/verl b178a3c, 2026-01; called from
``fsdp_workers.py`` and ``engine/fsdp/transformer_impl.py``). What it does, and what
:func:`activation_offload` does the same way:

- **Which tensors.** The FSDP units that are not an embedding (the decoder layers) each get
  their ``forward`` wrapped (``ActivationHandler.wrap_module_forward_method``); while a layer
  runs in training mode, PyTorch's saved-tensor hooks
  (``torch._C._autograd._push_saved_tensors_default_hooks``, what
  ``torch.autograd.graph.saved_tensors_hooks`` and ``save_on_cpu`` use) receive every
  tensor the layer saves for backward, except those sharing storage with one of the layer's
  parameters (``FSDPParameterFilter``: the unsharded weights FSDP gathers are not copied).
  The embedding, final norm, the log-prob head and the loss are not hooked: what they save
  stays on the device. With fewer than 3 such layers verl offloads nothing (it logs a warning).
- **When.** Layer ``i``'s saved tensors are group ``i`` (``AsyncDoubleBufferGroupOffloadHandler``
  with ``num_offload_group = layers - 1``): the last layer's group is never offloaded. At the end
  of layer ``i``'s forward (``GroupCommitFunction`` on its output) group ``i`` is copied to
  host memory (pinned, one copy per distinct tensor of the group, ``numel × element size``
  bytes) and group ``i - 1``'s device tensors are let go: the device holds at most two layers'
  saved tensors while the forward runs (double buffering). In backward, when layer ``i``'s
  output gradient arrives, group ``i - 1`` is copied back to the device (prefetch) and its
  host copies are dropped.
- **With gradient checkpointing.** verl turns transformers' checkpointing off and runs each
  layer under ``torch.utils.checkpoint.checkpoint(use_reentrant=True)`` inside the hooks:
  what a layer saves is then the checkpoint's tensor inputs (the hidden states entering the
  layer, and the tensor keyword arguments), offloaded the same way; the recomputation in
  backward runs the layer's own forward without the hooks, on the device.

batchfit runs this on every backend with synchronous copies (verl's side streams change when
a copy runs, not which tensors are alive: the device buffers of a group are released at the
same commit). The host copies are made inside the region
:data:`~batchfit.memory.categories.OFFLOADED_ACTIVATIONS`, which the probe declares a host
category: the tracked backends count them as host bytes, not device bytes, also on the cpu
backend, where host and device are one memory (the rule: a tensor the offload hooks create
to hold a saved activation is host memory; everything else is the device's). The copy back
is a new device tensor (``to(device, copy=True)``; on a GPU ``to`` copies anyway). The cuda
backend reads the device's allocator, which never sees the host copies;
:attr:`ActivationOffload.host_peak_bytes` is the most host bytes the copies held.

Not as verl: verl's handler leaves ``FakeTensor`` s in place (``torch_stray_tensor``, for
``torch.compile`` tracing); the estimate backend runs on fake tensors and offloads them, as
the GPU run it predicts does. verl keys a group's distinct tensors by data pointer and
offset (``_get_unique_tensor_key``); fake tensors have no data pointer, so the key here is
the storage itself and the offset.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from batchfit.memory import labels
from batchfit.memory.categories import OFFLOADED_ACTIVATIONS
from batchfit.parallel.shard import decoder_layers, unwrap

__all__ = ["MIN_LAYERS", "ActivationOffload", "activation_offload"]

#: verl offloads nothing below this many layers (``enable_activation_offloading``).
MIN_LAYERS = 3


def _key(tensor: torch.Tensor) -> tuple[int, int, torch.dtype]:
    # verl: (data_ptr + storage_offset, dtype); the storage stands for the pointer (fake tensors have none)
    return (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.dtype)


class ActivationOffload:
    """verl's ``AsyncDoubleBufferGroupOffloadHandler`` with synchronous copies (NOTE [ Activation offload as verl runs it ]).

    One instance serves one forward and its backward. Attributes:

    Attributes:
        num_layers: the decoder layers hooked.
        host_bytes: bytes of host copies held now.
        host_peak_bytes: the most bytes the host copies held at once.
        offloaded_bytes: bytes copied to the host in the forward (every group's distinct tensors).
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.num_offload_group = num_layers - 1
        self.current_group = 0
        self._count_in_group = 0
        self._state: dict[Any, Any] = {}
        self._buf: dict[Any, torch.Tensor | None] = {}
        self._offloaded_groups = 0
        self._mapping: dict[int, dict[Any, Any]] = {}
        self._parameters: set[int] = set()
        self.host_bytes = 0
        self.host_peak_bytes = 0
        self.offloaded_bytes = 0
        # verl's layer_window_map: group i's device buffers are let go at the commit of layer window[i]
        self._window: dict[int, int] = {}
        constant = 0
        for i in range(self.num_offload_group):
            self._window[i] = (num_layers // self.num_offload_group) * (i + 1) - 1
            if i < num_layers % self.num_offload_group:
                self._window[i] += i + 1
                constant = i + 1
            else:
                self._window[i] += constant

    # ------------------------------------------------------------ saved-tensor hooks
    def set_parameters(self, module: torch.nn.Module) -> None:
        """The storages of ``module``'s parameters now (FSDP: unsharded), which are never offloaded."""
        self._parameters = {p.untyped_storage()._cdata for p in module.parameters()}

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook (verl ``tensor_push``): tag the tensor into the current layer's group."""
        if tensor.untyped_storage()._cdata in self._parameters:
            return tensor
        tag = (self.current_group, self._count_in_group)
        self._count_in_group += 1
        self._state[tag] = tensor
        if self.current_group < self.num_offload_group:
            self._buf[tag] = tensor
        return tag

    def unpack(self, tag: Any) -> torch.Tensor:
        """Saved-tensor unpack hook (verl ``tensor_pop``): the tensor, copied back by its group's reload."""
        if isinstance(tag, torch.Tensor):
            return tag
        tensor = self._state.pop(tag)
        self._buf.pop(tag, None)
        return tensor

    # ------------------------------------------------------------ group commits
    def commit_forward(self) -> None:
        """The end of a layer's forward (verl ``synchronize_on_group_commit_forward``)."""
        group = self.current_group
        if group == 0:
            self._offload(0)
        if self._offloaded_groups < self.num_offload_group and self._window[self._offloaded_groups] == group:
            for tag in self._buf:
                if tag[0] == self._offloaded_groups:
                    self._buf[tag] = None  # the device copy of the group offloaded one layer ago goes
            if self._offloaded_groups < self.num_offload_group - 1:
                self._offload(self._offloaded_groups + 1)
            self._offloaded_groups += 1
        self.current_group += 1
        self._count_in_group = 0

    def commit_backward(self) -> None:
        """A layer's output gradient arrived (verl ``on_group_commit_backward``): prefetch the group below."""
        self.current_group -= 1
        if self._offloaded_groups > 0 and self._window[self._offloaded_groups - 1] == self.current_group:
            self._reload(self._offloaded_groups - 1)
            self._offloaded_groups -= 1 if self._offloaded_groups > 1 else 0
        if self.current_group == 0:
            self._offloaded_groups = 0

    def _offload(self, group: int) -> None:
        """verl ``bulk_offload_group``: one host copy per distinct tensor of ``group`` (NOTE [ One copy per buffer ])."""
        distinct: dict[Any, torch.Tensor] = {}
        for tag, state in self._state.items():
            if tag[0] != group or not isinstance(state, torch.Tensor):
                continue
            key = _key(state)
            first = distinct.get(key)
            if not _dense(state) or (first is not None and (not _dense(first) or first.numel() != state.numel())):
                key = (*key, tuple(state.shape), state.stride())
                first = distinct.get(key)
            if first is None:
                distinct[key] = state
            self._state[tag] = (key, state.shape, state.stride())
        copies: dict[Any, Any] = {}
        with labels.region(OFFLOADED_ACTIVATIONS):
            for key, tensor in distinct.items():
                # the device tensor's layout (preserve_format): its other views are rebuilt from the copy
                pin = tensor.device.type != "cpu"  # verl pins; pinning needs an accelerator
                host = torch.empty_like(tensor, device="cpu", pin_memory=pin)
                host.copy_(tensor, non_blocking=True)
                nbytes = host.numel() * host.element_size()
                self.host_bytes += nbytes
                self.offloaded_bytes += nbytes
                copies[key] = (tensor.device, host)
        self.host_peak_bytes = max(self.host_peak_bytes, self.host_bytes)
        self._mapping[group] = copies

    def _reload(self, group: int) -> None:
        """verl ``bulk_reload_group``: the group's tensors back on their device, the host copies dropped."""
        copies = self._mapping.pop(group)
        back: dict[Any, torch.Tensor] = {}
        with torch.no_grad():
            for key, (device, host) in copies.items():
                back[key] = host.to(device, copy=True, non_blocking=host.is_pinned())
                self.host_bytes -= host.numel() * host.element_size()
        del copies
        for tag, state in self._state.items():
            if tag[0] == group and isinstance(state, tuple):
                key, shape, stride = state
                tensor = back[key]
                self._state[tag] = (
                    tensor if tensor.shape == shape and tensor.stride() == stride else tensor.as_strided(shape, stride)
                )


# NOTE [ One copy per buffer ]
# verl copies the tensors of a group that start at the same address once (``_get_unique_tensor_key``)
# and rebuilds the others with ``view(shape)`` of a contiguous copy. Two saved views of one buffer
# in different layouts (CPU and flash attention return ``[B, H, S, D]`` transposed from a
# ``[B, S, H, D]`` buffer, which ``o_proj`` reads as ``[B·S, H·D]``) would then come back with
# the elements of one in the order of the other. Here the copy keeps the device tensor's layout
# (``empty_like``) and a view covering the same elements is rebuilt with its own strides
# (``as_strided``): the same bytes as verl, and the right values; a view of other elements (a
# slice) gets its own copy. Measured: the tiny model without checkpointing gets the gradients of
# the unoffloaded step exactly (tests/test_activation_offload.py).


def _dense(tensor: torch.Tensor) -> bool:
    return bool(torch._prims_common.is_non_overlapping_and_dense_or_false(tensor))


class _GroupCommit(torch.autograd.Function):
    """verl's ``GroupCommitFunction``: the identity, marking a layer's end in forward and backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, handler: ActivationOffload) -> torch.Tensor:
        handler.commit_forward()
        ctx.handler = handler
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.handler.commit_backward()
        return grad, None


def _checkpointed(forward: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """verl ``ActivationHandler._ckpt_forward``: reentrant checkpoint, keyword arguments passed flat."""
    keys = tuple(kwargs)
    flat = (*args, *kwargs.values())

    def run(*inputs: Any) -> Any:
        n = len(inputs) - len(keys)
        return forward(*inputs[:n], **dict(zip(keys, inputs[n:])))

    return torch.utils.checkpoint.checkpoint(run, *flat, use_reentrant=True)


def _wrap(layer: torch.nn.Module, forward: Any, handler: ActivationOffload, checkpoint: bool) -> Any:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not layer.training:
            return forward(*args, **kwargs)
        handler.set_parameters(layer)
        with torch.autograd.graph.saved_tensors_hooks(handler.pack, handler.unpack):
            out = _checkpointed(forward, args, kwargs) if checkpoint else forward(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            first = _GroupCommit.apply(first, handler)
        return (first, *out[1:]) if isinstance(out, tuple) else first

    return wrapped


def _checkpointing(layer: torch.nn.Module) -> bool:
    return bool(getattr(layer, "gradient_checkpointing", False))


@contextlib.contextmanager
def activation_offload(model: torch.nn.Module) -> Iterator[ActivationOffload | None]:
    """Inside, ``model``'s decoder layers offload what they save for backward to host memory, as verl does.

    Run one training forward and its backward inside (NOTE [ Activation offload as verl runs
    it ]). A model whose layers are checkpointed (transformers' activation checkpointing) is
    checkpointed as verl does it with offload: reentrant, per layer, its inputs offloaded;
    transformers' own checkpointing is off inside and back on after. Everything is restored on
    exit, also when the block raises (NOTE [ A step leaves no hooks ] in
    :mod:`batchfit.budget.causal_lm_probe`).

    Args:
        model: a transformers causal LM (or value model), bare, DDP, PEFT or FSDP-wrapped.

    Yields:
        The :class:`ActivationOffload` handler (its host byte counts), or ``None`` when the
        model has fewer than :data:`MIN_LAYERS` decoder layers: verl offloads nothing then,
        and nor does this (a ``UserWarning`` says so).

    Raises:
        InvalidArgument: the model has no list of decoder layers.

    Example:
        >>> from batchfit.models import build_causal_lm
        >>> net = build_causal_lm("tiny", num_hidden_layers=4)
        >>> ids = torch.randint(0, 1024, (1, 32))
        >>> with activation_offload(net) as off:
        ...     net(input_ids=ids).logits.sum().backward()
        >>> off.offloaded_bytes > 0 and off.host_bytes == 0
        True
    """
    layers = list(decoder_layers(unwrap(model)))
    if len(layers) < MIN_LAYERS:
        warnings.warn(
            f"activation offload needs at least {MIN_LAYERS} decoder layers (verl's enable_activation_offloading "
            f"offloads nothing below that), but the model has {len(layers)}; nothing is offloaded",
            stacklevel=3,
        )
        yield None
        return
    handler = ActivationOffload(len(layers))
    checkpoint = any(_checkpointing(layer) for layer in layers)
    saved: list[tuple[torch.nn.Module, bool, Any, bool]] = []
    try:
        for layer in layers:
            own = layer.__dict__.get("forward")
            saved.append((layer, "forward" in layer.__dict__, own, _checkpointing(layer)))
            if checkpoint:
                layer.gradient_checkpointing = False  # verl: gradient_checkpointing_disable()
            layer.forward = _wrap(layer, layer.forward, handler, checkpoint)
        yield handler
    finally:
        for layer, had, own, flag in reversed(saved):
            if had:
                layer.forward = own
            else:
                del layer.forward
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = flag
