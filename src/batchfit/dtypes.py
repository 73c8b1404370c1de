"""Floating dtypes by name, defined once: the names every option taking a dtype accepts."""

from __future__ import annotations

from typing import Any

import torch

from batchfit.errors import InvalidArgument

#: The canonical name of each supported floating dtype, in the order they are listed.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: Other spellings accepted for the dtypes above.
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(dtype: Any) -> torch.dtype:
    """A floating ``torch.dtype`` from a dtype or a name (``"bf16"``, ``"bfloat16"``, ``"torch.float32"``, ...).

    Raises:
        InvalidArgument: anything else, listing the names.

    Example:
        >>> parse_dtype("bf16") is parse_dtype("torch.bfloat16") is torch.bfloat16
        True
    """
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = DTYPE_ALIASES.get(key, key)
        if key in DTYPES:
            return DTYPES[key]
    names = ", ".join([*DTYPES, *DTYPE_ALIASES])
    raise InvalidArgument(
        f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or a name: {names}), but got dtype={dtype!r}"
    )
