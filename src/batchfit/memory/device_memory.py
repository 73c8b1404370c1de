"""The device memory a request fits in, read once where the user calls in: :func:`resolve_device_memory`.

Every command and library entry that takes a ``memory_limit`` and a ``reserve`` (``batchfit
profile``, ``batchfit autobatch``, :func:`batchfit.frameworks.profile_request.resolve_request`)
reads them here: a size text bounded before it is parsed, the estimate's default target, the rule
that a host backend needs a limit, and a reserve that leaves something. The numbers that come out
are bytes; nothing after this parses a size again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.errors import KEYWORDS, InvalidArgument, Phrase, Setting, Vocabulary
from batchfit.memory.backends import backend_class
from batchfit.memory.sizes import DEFAULT_ESTIMATE_TARGET, format_bytes, parse_memory

__all__ = ["MAX_SIZE_TEXT", "DeviceMemory", "check_reserve_fits", "check_size_text", "resolve_device_memory"]

MAX_SIZE_TEXT = 64
"""Longest ``memory_limit``/``reserve`` text read as a size: ``80GiB`` is 5 characters, a preset about 12."""


@dataclass(frozen=True)
class DeviceMemory:
    """The memory a request fits in.

    Attributes:
        memory: the device as the request names it (a size text, a preset, bytes), the estimate's
            default target, or ``None`` (a real device's own total).
        total_bytes: ``memory`` in bytes, ``None`` with it.
        reserve_bytes: the reserve in bytes, ``None`` for the backend's default.
        defaulted: ``memory`` is the estimate's default target (none was named).
    """

    memory: int | str | None
    total_bytes: int | None
    reserve_bytes: int | None
    defaulted: bool = False


def check_size_text(name: str, value: Any) -> None:
    """Refuse a size string too long to be a size (5,000 digits overflow a float), before it is parsed.

    Raises:
        InvalidArgument: naming ``name``, the start of the value and what a size looks like.
    """
    from batchfit.validation import short_repr

    if isinstance(value, str) and len(value) > MAX_SIZE_TEXT:
        raise InvalidArgument(
            f"{name} is not a memory size: got {len(value):,} characters ({short_repr(value, 20)}); pass bytes, "
            "a size such as 80GiB, or a device preset such as h100-80gb"
        )


def resolve_device_memory(
    memory: Any,
    reserve: Any,
    backend: str,
    *,
    world: int | None = 1,
    vocabulary: Vocabulary | None = None,
    purpose: str = "to fit",
) -> DeviceMemory:
    """Read ``memory`` and ``reserve`` once: bounded, defaulted, parsed, and the reserve checked against the memory.

    Args:
        memory: the device memory per rank (bytes, ``"80GiB"``, a preset), or ``None``: the
            estimate's default target (:data:`~batchfit.memory.DEFAULT_ESTIMATE_TARGET`), a
            real device's own total; a host backend (cpu) has none and needs one.
        reserve: bytes of ``memory`` no tracker sees (``0`` allowed), or ``None``: the backend's default.
        backend: the backend's name (``auto`` resolved).
        world: the ranks the model is sharded over (the default reserve holds NCCL's buffers when > 1);
            ``None``: not known yet, the caller checks the reserve (:func:`check_reserve_fits`) once it is.
        vocabulary: how messages name ``memory_limit``, ``reserve_bytes`` and ``backend``.
        purpose: what the host's missing limit was for, in the message ("to fit").

    Raises:
        InvalidArgument: a size text too long, an unparsable size, no memory on a host backend, or a
            reserve (given or default) that leaves nothing; one line each, in ``vocabulary``.
    """
    say = (KEYWORDS if vocabulary is None else vocabulary).say
    memory_name, reserve_name = say(Setting("memory_limit")), say(Setting("reserve_bytes"))
    check_size_text(memory_name, memory)
    check_size_text(reserve_name, reserve)
    kind = backend_class(backend)
    defaulted = memory is None and kind.simulated
    if defaulted:
        memory = DEFAULT_ESTIMATE_TARGET
    if isinstance(memory, str) and memory.strip().isdigit():
        memory = int(memory)  # a plain byte count from a command line
    if memory is None and kind.host_memory:
        raise InvalidArgument(
            Phrase(
                Setting("memory_limit"),
                " is required with ",
                Setting("backend", backend),
                f" (the host has no device limit {purpose}), but got no ",
                Setting("memory_limit"),
                "; pass e.g. ",
                Setting("memory_limit", "2GiB"),
                ", or use ",
                Setting("backend", "estimate"),
                " to predict a GPU",
            ).say(vocabulary)
        )
    reserve_bytes = None
    if reserve is not None:
        reserve_bytes = 0 if str(reserve).strip() in ("0", "0B", "0b") else int(parse_memory(reserve, name=reserve_name))
    total = None if memory is None else int(parse_memory(memory, name=memory_name))
    if total is not None and world is not None:
        check_reserve_fits(memory, total, reserve_bytes, backend, world, vocabulary)
    return DeviceMemory(memory=memory, total_bytes=total, reserve_bytes=reserve_bytes, defaulted=defaulted)


def check_reserve_fits(
    memory: Any, total: int, reserve: int | None, backend: str, world: int, vocabulary: Vocabulary | None = None
) -> None:
    """Refuse a memory the reserve leaves nothing of, naming a default reserve as the default it is.

    Args:
        memory: the memory as given (a size or a preset), for the message.
        total: its bytes.
        reserve: the reserve in bytes, ``None`` for the backend's default (the estimate backend:
            CUDA context, workspaces and, over more than one rank, NCCL's buffers; cpu: 0).
        backend: the backend's name.
        world: the ranks the model is sharded over (NCCL's buffers when > 1).
        vocabulary: how the message names the settings.

    Raises:
        InvalidArgument: the reserve is at least ``total``; a default reserve is said to be the
            default, with the reserve setting to change it (never a byte count the user did not pass).
    """
    from batchfit.memory.cuda_untracked import untracked_memory

    def said(name: str, value: Any = None) -> str:
        return (KEYWORDS if vocabulary is None else vocabulary).say(Setting(name, value))

    if reserve is not None:
        if reserve >= total:
            raise InvalidArgument(
                f"{said('memory_limit', memory)} leaves nothing once {said('reserve_bytes', format_bytes(reserve))} is "
                f"taken off; raise {said('memory_limit')} or lower {said('reserve_bytes')} (e.g. {said('reserve_bytes', 0)})"
            )
        return
    if not backend_class(backend).simulated:
        return  # cpu: no reserve; cuda: measured on the device
    untracked = untracked_memory(str(memory), world_size=world, total_bytes=total)
    if untracked.reserve_bytes >= total:
        ranks = f" over {world} ranks" if world > 1 else ""
        raise InvalidArgument(
            f"{said('memory_limit', memory)} ({format_bytes(total)}) leaves nothing once the default reserve of "
            f"{format_bytes(untracked.reserve_bytes)} is taken off (what no tracker sees on a GPU{ranks}: "
            f"{untracked.describe()}); raise {said('memory_limit')}, or pass {said('reserve_bytes', 'SIZE')} "
            f"(e.g. {said('reserve_bytes', 0)}) to set it yourself"
        )
