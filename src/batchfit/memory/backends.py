"""Choosing a backend by name (:func:`get_backend`) and the one-call :func:`measure_peak`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice

if TYPE_CHECKING:
    from batchfit.memory.base import Backend
    from batchfit.memory.measurement import MemoryMeasurement

# NOTE [ A light --help ] in batchfit.cli: the names are known without torch; the classes (which import
# it) load on first use (BACKENDS, backend_class, get_backend)
_CLASSES = {
    "cpu": "batchfit.memory.cpu:CpuBackend",
    "estimate": "batchfit.memory.estimate:EstimateBackend",
    "cuda": "batchfit.memory.cuda:CudaBackend",
}
#: The names :func:`get_backend` accepts: ``"auto"`` and one per backend.
BACKEND_NAMES = ("auto", *_CLASSES)


def _classes() -> dict[str, type[Backend]]:
    """:data:`BACKENDS`: each backend's class, imported on first use."""
    import importlib

    cached = globals().get("BACKENDS")
    if cached is None:
        cached = {}
        for name, where in _CLASSES.items():
            module, cls = where.split(":")
            cached[name] = getattr(importlib.import_module(module), cls)
        globals()["BACKENDS"] = cached
    return cached


def __getattr__(name: str) -> Any:
    if name == "BACKENDS":  # backend name → class (NOTE [ A light --help ])
        return _classes()
    raise AttributeError(f"module 'batchfit.memory.backends' has no attribute {name!r}")


def backend_name(name: str) -> str:
    """The backend ``name`` stands for: ``"auto"`` is ``"cuda"`` with a CUDA device, else ``"estimate"``.

    Raises:
        InvalidArgument: ``name`` is not one of :data:`BACKEND_NAMES` (the choices are listed).
    """
    name = check_choice("backend", name, BACKEND_NAMES)
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "estimate"
    return name


def backend_class(name: str) -> type[Backend]:
    """The class of the backend ``name`` stands for, whose capabilities say what it can do before one is made.

    NOTE [ Backends say what they can do ] in :mod:`batchfit.memory.base`: a caller holding a
    backend's name reads ``backend_class(name).host_memory`` and the like, never the name.

    Raises:
        InvalidArgument: ``name`` is not one of :data:`BACKEND_NAMES`.
    """
    return _classes()[backend_name(name)]


def get_backend(
    name: str | Backend = "auto",
    *,
    memory_limit: Any = None,
    reserve_bytes: Any = None,
    round_to: int | None = None,
) -> Backend:
    """The memory backend called ``name``, configured for a target device.

    Args:
        name: ``"auto"`` (``"cuda"`` if ``torch.cuda.is_available()``, else ``"estimate"``),
            ``"cpu"``, ``"estimate"`` or ``"cuda"``; a :class:`Backend` is returned as is
            (then the other arguments must be ``None``).
        memory_limit: device bytes (int, ``"80GiB"``, ``"80GB"``, a device preset such as
            ``"h100-80gb"``); default: unlimited (cpu, estimate), the device's memory (cuda).
        reserve_bytes: bytes of ``memory_limit`` no tracker sees; default 0 (cpu), the
            device's untracked terms (estimate: :func:`batchfit.memory.cuda_untracked.untracked_memory`),
            measured (cuda).
        round_to: storage rounding; default 1 (cpu), 512 (estimate, cuda).

    Returns:
        A :class:`Backend`; ``backend.limit_bytes = memory_limit - reserve_bytes``.

    Raises:
        InvalidArgument: unknown name (the choices are listed), bad sizes, reserve not below
            the limit, or ``"cuda"`` without a CUDA device.

    Example:
        >>> b = get_backend("estimate", memory_limit="h100-80gb")
        >>> b.name, b.reserve_bytes   # CUDA context + cuBLAS workspaces
        ('estimate', 354156544)
    """
    from batchfit.memory.base import Backend

    if isinstance(name, Backend):
        if not (memory_limit is None and reserve_bytes is None and round_to is None):
            raise InvalidArgument(
                f"memory_limit, reserve_bytes and round_to must be None when backend is a Backend instance, but got memory_limit={memory_limit!r}, reserve_bytes={reserve_bytes!r}, round_to={round_to!r}; configure the instance instead"
            )
        return name
    return _classes()[backend_name(name)](
        memory_limit=memory_limit, reserve_bytes=reserve_bytes, round_to=round_to
    )


def measure_peak(
    step: Callable[[], Any],
    *,
    backend: str | Backend = "auto",
    register: Any = (),
    categories: Any = None,
    **backend_kwargs: Any,
) -> MemoryMeasurement:
    """Measure one call of ``step()``: ``get_backend(backend, **backend_kwargs).measure(step, register)``.

    For the estimate backend, ``step``'s tensors must come from that backend's
    ``context()``: pass the ``Backend`` instance used to build them. A step built by
    :func:`batchfit.models.causal_lm_step` with its ``persistent`` state is registered for
    you when ``register`` is empty.

    Example:
        >>> import torch
        >>> x = torch.ones(256)
        >>> measure_peak(lambda: x * 2, backend="cpu", register=x).peak_bytes  # 2 * 256 * 4
        2048
    """
    chosen = get_backend(backend, **backend_kwargs)
    empty = register is None or (isinstance(register, (tuple, list)) and len(register) == 0)
    host: tuple[str, ...] = ()
    if empty and hasattr(step, "persistent"):
        register = step.persistent
        categories = getattr(step, "categories", None) if categories is None else categories
        host = tuple(getattr(step, "host_categories", ()))
    return chosen.measure(step, register=register, categories=categories, host_categories=host)
