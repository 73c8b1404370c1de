"""Which category each pre-existing tensor belongs to, for registering state with a backend.

A step's persistent state (model, optimizer, inputs) exists before the measurement starts,
so a tracker cannot see it being created; it is registered by object instead. Default
categories: a module's parameters are ``"parameters"``, their existing ``.grad`` are
``"gradients"``, its buffers ``"buffers"``; an optimizer's state tensors are
``"optimizer_state"``; bare tensors (and containers of them) are ``"inputs"``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from batchfit.errors import InvalidArgument

PARAMETERS = "parameters"
GRADIENTS = "gradients"
BUFFERS = "buffers"
OPTIMIZER_STATE = "optimizer_state"
INPUTS = "inputs"
ACTIVATIONS = "activations"
#: Parameters unsharded by FSDP (all-gather inputs and outputs, unsharded parameter storage).
GATHERED_PARAMETERS = "gathered_parameters"
#: Gradient communication buffers: FSDP's reduce-scatter input, DDP's gradient buckets.
COMMUNICATION = "communication"
#: What the log-prob (or value) head creates: logits, their fp32 copy, log-softmax, their gradients.
LOGPROB_HEAD = "logprob_head"
#: Temporaries of ``optimizer.step()`` (foreach AdamW's intermediate lists).
OPTIMIZER_STEP = "optimizer_step"
#: Host copies of saved activations made by activation offload (NOTE [ Activation offload as
#: verl runs it ] in :mod:`batchfit.train.activation_offload`): host memory on every backend.
OFFLOADED_ACTIVATIONS = "offloaded_activations"

#: What a step holds whatever its micro-batch: the state it keeps, the parameters FSDP gathers,
#: the gradient communication buffers and the optimizer step's temporaries (the rest grows with
#: the tokens: inputs, activations, the head's tensors).
STATE_CATEGORIES = frozenset(
    {PARAMETERS, GRADIENTS, BUFFERS, OPTIMIZER_STATE, GATHERED_PARAMETERS, COMMUNICATION, OPTIMIZER_STEP}
)


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``tensor``'s memory: itself, or a wrapper subclass' inner tensors.

    A ``DTensor`` (FSDP2's sharded parameters, gradients and optimizer state) is a wrapper
    whose own storage is not memory; what a rank holds is its local shard. Wrapper
    subclasses are flattened with the subclass protocol (``__tensor_flatten__``), so any
    traceable wrapper (DTensor and others) is counted by the tensors it wraps.
    """
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for attr in attrs:
            inner = getattr(tensor, attr)
            if isinstance(inner, torch.Tensor):  # the protocol may list opaque objects (a mesh)
                yield from plain_tensors(inner)
    else:
        yield tensor


def categorized_tensors(obj: Any, category: str | None = None) -> Iterator[tuple[torch.Tensor, str]]:
    """Yield ``(tensor, category)`` for every plain tensor held by ``obj``.

    Wrapper subclasses (``DTensor``) are replaced by the tensors they wrap
    (:func:`plain_tensors`): a sharded parameter counts as its local shard.

    Args:
        obj: a tensor, ``nn.Module``, ``torch.optim.Optimizer``, mapping or iterable of these
            (``None`` yields nothing; other objects are ignored).
        category: force this category for everything ``obj`` holds; ``None`` = the defaults
            in the module docstring.
    """
    for tensor, cat in _categorized(obj, category):
        for plain in plain_tensors(tensor):
            yield plain, cat


def _categorized(obj: Any, category: str | None) -> Iterator[tuple[torch.Tensor, str]]:
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj, category or INPUTS
        if obj.grad is not None:
            yield obj.grad, category or GRADIENTS
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p, category or PARAMETERS
            if p.grad is not None:
                yield p.grad, category or GRADIENTS
        for b in obj.buffers():
            yield b, category or BUFFERS
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for t, _ in _categorized(state, category):
                yield t, category or OPTIMIZER_STATE
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _categorized(v, category)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _categorized(v, category)


def registered_tensors(
    register: Any, categories: Sequence[str | None] | str | None = None
) -> list[tuple[torch.Tensor, str]]:
    """``(tensor, category)`` pairs for ``register``, one entry per object in it.

    Args:
        register: one object or a tuple/list of objects (see :func:`categorized_tensors`).
        categories: ``None`` (defaults), one category for everything, or one entry per
            object of ``register`` (``None`` entries keep the defaults).

    Raises:
        InvalidArgument: ``categories`` is a sequence whose length differs from ``register``'s.
    """
    objects = list(register) if isinstance(register, (list, tuple)) else [register]
    if categories is None or isinstance(categories, str):
        cats: list[str | None] = [categories] * len(objects)
    else:
        cats = list(categories)
        if len(cats) != len(objects):
            raise InvalidArgument(
                f"categories must have one entry per registered object ({len(objects)}), but got categories={categories!r}; pass None to use the default categories"
            )
    return [pair for obj, cat in zip(objects, cats) for pair in categorized_tensors(obj, cat)]


def trainable_parameters(register: Any) -> list[torch.nn.Parameter]:
    """The parameters requiring grad of every module in ``register`` (each once)."""
    objects = list(register) if isinstance(register, (list, tuple)) else [register]
    seen: dict[int, torch.nn.Parameter] = {}
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if p.requires_grad:
                    seen.setdefault(id(p), p)
    return list(seen.values())


def storage_bytes(pairs: list[tuple[torch.Tensor, str]], round_to: int = 1) -> dict[str, int]:
    """Bytes per category of the distinct storages in ``pairs`` (a shared storage counts once), each rounded up to ``round_to``."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t, cat in pairs:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in seen:
            continue
        seen.add(key)
        out[cat] = out.get(cat, 0) + -(-int(storage.nbytes()) // round_to) * round_to
    return out
