"""Collectives on user-visible tensors, run on a device the process group's backend supports.

NOTE [ Collectives run on the group's device ]
A tensor the user gives (e.g. a host ``out`` tensor for log-probs, recommended to keep
device memory free) can live where the group's backend cannot reduce it: NCCL only
reduces CUDA tensors, so ``dist.all_reduce`` of a CPU tensor over an NCCL-only group
fails. :func:`all_reduce_` copies such a tensor to the device the backend runs on
(:func:`collective_device`: for NCCL the current CUDA device), reduces the copy and
copies the result back into the tensor. A tensor already on a supported device is
reduced in place, without a copy.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_reduce_", "backend_device_types", "collective_device"]

# device types each single backend reduces; None: unknown backend, trusted with any device
_BACKEND_DEVICES: dict[str, frozenset[str]] = {
    "nccl": frozenset({"cuda"}),
    "gloo": frozenset({"cpu", "cuda"}),
    "mpi": frozenset({"cpu"}),
    "ucc": frozenset({"cpu", "cuda"}),
    "xccl": frozenset({"xpu"}),
    "hccl": frozenset({"npu"}),
}


def backend_device_types(backend: str) -> frozenset[str] | None:
    """Device types a process group with ``backend`` (``dist.get_backend(group)``) reduces; ``None`` when unknown.

    ``backend`` is one name (``"nccl"``, ``"gloo"``, ...) or a per-device list as PyTorch
    reports groups made with ``backend="cpu:gloo,cuda:nccl"``.

    Example:
        >>> sorted(backend_device_types("cpu:gloo,cuda:nccl"))
        ['cpu', 'cuda']
        >>> sorted(backend_device_types("nccl"))
        ['cuda']
    """
    name = str(backend).strip().lower()
    if ":" in name:
        return frozenset(part.split(":", 1)[0].strip() for part in name.split(",") if ":" in part)
    return _BACKEND_DEVICES.get(name)


def _current(device_type: str) -> torch.device:
    """The current device of an accelerator type (index 0 when its runtime is not available)."""
    module = getattr(torch, device_type, None)
    available = getattr(module, "is_available", None)
    if module is not None and callable(available) and available():
        return torch.device(device_type, module.current_device())
    return torch.device(device_type, 0)


def collective_device(backend: str, device: torch.device | str) -> torch.device:
    """Where a collective over a ``backend`` group runs a tensor that lives on ``device``.

    ``device`` itself when the backend reduces tensors of its type (or the backend is
    unknown to batchfit, e.g. PyTorch's fake group), else the backend's own device: for
    NCCL ``cuda:<torch.cuda.current_device()>`` (NOTE [ Collectives run on the group's device ]).

    Example:
        >>> collective_device("gloo", torch.device("cpu"))
        device(type='cpu')
        >>> collective_device("nccl", torch.device("cpu")).type
        'cuda'
    """
    device = torch.device(device)
    types = backend_device_types(backend)
    if types is None or device.type in types:
        return device
    for preferred in ("cuda", "xpu", "npu", "cpu"):
        if preferred in types:
            return _current(preferred) if preferred != "cpu" else torch.device("cpu")
    return device  # pragma: no cover - every known backend lists a type above


def all_reduce_(tensor: torch.Tensor, op: Any = None, group: Any = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group``, on a device its backend supports; return ``tensor``.

    The reduction runs on :func:`collective_device` of the group's backend and the tensor's
    device; when that is another device (a host tensor over NCCL), or the tensor is not
    contiguous, a copy is reduced and copied back. Every rank of ``group`` must call it.

    Args:
        tensor: the tensor to reduce (any device, any layout).
        op: a ``torch.distributed.ReduceOp`` (default ``SUM``).
        group: the process group (``None`` = the default group).
    """
    import torch.distributed as dist

    op = dist.ReduceOp.SUM if op is None else op
    device = collective_device(dist.get_backend(group), tensor.device)
    if device == tensor.device and tensor.is_contiguous():
        dist.all_reduce(tensor, op=op, group=group)
        return tensor
    work = tensor.to(device=device, copy=True, memory_format=torch.contiguous_format)
    dist.all_reduce(work, op=op, group=group)
    tensor.copy_(work)
    return tensor
