"""Memory sizes: parse ``"80GiB"``, ``"80GB"``, device presets such as ``"h100-80gb"``, and print bytes.

Device presets give the total memory of one accelerator as reported by ``nvidia-smi``
(MiB). What the CUDA context and driver keep is not subtracted here: the estimate backend's
``reserve_bytes`` covers it (:func:`batchfit.memory.cuda_untracked.untracked_memory`).
"""

from __future__ import annotations

import re
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.validation import closest, is_int

KiB = 1024
MiB = 1024**2
GiB = 1024**3

#: The device an estimate targets when the user names none (``batchfit profile`` and
#: ``batchfit autobatch`` without a GPU and without ``--memory``; stated in their output).
DEFAULT_ESTIMATE_TARGET = "h100-80gb"

#: Total memory per device, bytes (nvidia-smi's "MiB" total).
DEVICE_MEMORY: dict[str, int] = {
    "a10g": 23028 * MiB,
    "l4": 23034 * MiB,
    "rtx-4090": 24564 * MiB,
    "a100-40gb": 40536 * MiB,
    "l40s": 46068 * MiB,
    "a100-80gb": 81920 * MiB,
    "h100-80gb": 81559 * MiB,
    "h200": 143771 * MiB,
    "b200": 183359 * MiB,
}

#: Other spellings of the presets above.
DEVICE_ALIASES: dict[str, str] = {
    "h100": "h100-80gb",
    "a100": "a100-80gb",
    "h200-141gb": "h200",
    "b200-180gb": "b200",
    "l4-24gb": "l4",
    "a10g-24gb": "a10g",
    "l40s-48gb": "l40s",
    "4090": "rtx-4090",
}

_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": 1024**4,
}

#: The largest size accepted: what an int64 byte count (torch's statistics) can hold.
MAX_BYTES = 2**63 - 1

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory(value: Any, *, name: str = "memory") -> int:
    """Bytes from an int, a size string or a device preset.

    Args:
        value: a positive int (bytes); a string ``"<number><unit>"`` with unit ``B``,
            ``KB``/``MB``/``GB``/``TB`` (powers of 1000) or ``KiB``/``MiB``/``GiB``/``TiB``
            (powers of 1024), case-insensitive, a bare number meaning bytes; or a device
            preset from :data:`DEVICE_MEMORY` / :data:`DEVICE_ALIASES` (``"h100-80gb"``,
            ``"a100-40gb"``, ``"b200"``, ``"l4"``, ...).
        name: the argument name used in error messages.

    Returns:
        The size in bytes (an int >= 1, fractions of a byte rounded down).

    Raises:
        InvalidArgument: anything else, naming ``value``, the accepted forms and the presets.

    Example:
        >>> parse_memory("80GiB"), parse_memory("1.5GB"), parse_memory("l4")
        (85899345920, 1500000000, 24152899584)
    """
    presets = ", ".join(DEVICE_MEMORY)
    fix = f"pass bytes (an int), a size such as '80GiB' or '80GB', or a device preset ({presets})"
    if is_int(value):
        if value > MAX_BYTES:
            raise InvalidArgument(f"{name} is too large: got {name}={value!r}; the largest is {MAX_BYTES} bytes (8 EiB)")
        if value < 1:
            raise InvalidArgument(
                f"{name} must be a positive number of bytes, but got {name}={value!r}; {fix}"
            )
        return int(value)
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be an int or a string, but got {name}={value!r}; {fix}")
    key = value.strip().lower()
    key = DEVICE_ALIASES.get(key, key)
    if key in DEVICE_MEMORY:
        return DEVICE_MEMORY[key]
    match = _SIZE.match(value)
    if match is not None and match.group(2).lower() in ({"", *_UNITS}):
        number = float(match.group(1))
        nbytes = int(number * _UNITS.get(match.group(2).lower(), 1))
        if nbytes > MAX_BYTES:
            raise InvalidArgument(
                f"{name} is too large: got {name}={value!r}; the largest is 8 EiB ({MAX_BYTES} bytes)"
            )
        if nbytes >= 1:
            return nbytes
    near = closest(key, [*DEVICE_MEMORY, *DEVICE_ALIASES])
    hint = f"; did you mean {near!r}?" if near else ""
    raise InvalidArgument(f"{name} is not a memory size or device preset: got {name}={value!r}; {fix}{hint}")


def parse_size(value: Any, *, name: str) -> int:
    """Bytes from a size as :func:`parse_memory` reads it, where ``0`` (``"0"``, ``"0B"``) means none.

    For amounts taken off a device (a reserve, what an engine keeps), not the device itself.

    Raises:
        InvalidArgument: as :func:`parse_memory`, or a negative number.

    Example:
        >>> parse_size("0", name="reserve"), parse_size(0, name="reserve"), parse_size("2GiB", name="reserve")
        (0, 0, 2147483648)
    """
    if (is_int(value) and value == 0) or (isinstance(value, str) and value.strip().lower() in ("0", "0b")):
        return 0
    return parse_memory(value, name=name)


def format_bytes(nbytes: int | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 1024**3) == "3.00 GiB"``; ``None`` -> ``"unlimited"``."""
    if nbytes is None:
        return "unlimited"
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"  # pragma: no cover
