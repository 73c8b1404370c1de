"""Varlen attention for packed rows where no flash-attention kernel runs (CPU, GPUs without it).

NOTE [ Packed rows need varlen attention ]
A packed micro-batch (``iter_micro_batches(layout="packed")``) is one row of several
sequences with ``position_ids`` restarting at 0. Hugging Face models then attend within
each sequence, but with ``sdpa`` or ``eager`` they do it by building a block-diagonal
``T × T`` mask: memory grows with ``T²`` instead of ``Σ lᵢ²`` and the packed row runs much
slower than the padded rows it replaces. Flash-attention's varlen kernel needs no mask; on
the CPU, and on GPUs without flash-attn, :func:`varlen_attention` does the same job: it is
registered with transformers' attention-function interface under :data:`VARLEN`, its mask
function builds nothing, and it runs causal ``scaled_dot_product_attention`` on each
sequence's slice of the row (sequence boundaries from ``cu_seq_lens_q`` when the caller
passes it, else from ``position_ids``). Batches that are not packed (an attention mask is
given) go to the ordinary ``sdpa`` path.
"""

from __future__ import annotations

import importlib.util
import itertools
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from batchfit.errors import InvalidArgument

#: The name :func:`use_varlen_attention` registers with transformers.
VARLEN = "batchfit_varlen"

# attention implementations that build a full mask for packed rows
_MASKED = ("sdpa", "eager", "flex_attention")

_registered = False
_warned = False


def _sequence_bounds(kwargs: dict[str, Any], length: int) -> list[tuple[int, int]] | None:
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        edges = [int(x) for x in cu.tolist()]
        return list(itertools.pairwise(edges))
    positions = kwargs.get("position_ids")
    if positions is None or positions.ndim != 2 or positions.shape[0] != 1 or positions.shape[1] != length:
        return None
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        return None
    ends = [*starts[1:], length]
    return list(zip(starts, ends))


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence; transformers' attention-function signature.

    ``query`` is ``[1, heads, T, dim]`` (key/value may have fewer heads: grouped-query
    attention); returns ``([1, T, heads, dim], None)``. Anything but one packed row without
    an attention mask goes to transformers' ``sdpa`` implementation unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = None
    if attention_mask is None and query.shape[0] == 1:
        bounds = _sequence_bounds(kwargs, query.shape[2])
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # grouped-query attention without copies of key and value (transformers' sdpa path does the same)
    gqa = query.shape[1] != key.shape[1]
    p = dropout if module.training else 0.0
    outputs = []
    for start, count, length in _equal_runs(bounds):
        # NOTE [ Sequences of one length attend as one batch ]: a run of ``count`` adjacent
        # sequences of one length is ``count`` rows of one sdpa call (views, no copies), the
        # same attention as one call per sequence in one call instead of ``count``
        stop = start + count * length
        q, k, v = (
            t[0, :, start:stop].unflatten(1, (count, length)).transpose(0, 1) for t in (query, key, value)
        )
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        outputs.append(out.transpose(0, 1).flatten(1, 2)[None] if count > 1 else out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _equal_runs(bounds: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(start, count, length)`` of each run of adjacent sequences of one length."""
    runs: list[list[int]] = []
    for start, end in bounds:
        length = end - start
        if runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == start:
            runs[-1][1] += 1
        else:
            runs.append([start, 1, length])
    return [(start, count, length) for start, count, length in runs]


def varlen_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """Mask function for :data:`VARLEN`: none for packed rows, ``sdpa``'s otherwise."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_varlen_attention() -> str:
    """Register :data:`VARLEN` with transformers' attention and mask interfaces (once); return the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(VARLEN, varlen_attention)
        AttentionMaskInterface.register(VARLEN, varlen_mask)
        _registered = True
    return VARLEN


def use_varlen_attention(model: torch.nn.Module) -> str:
    """Make ``model`` attend per sequence on packed rows without a ``T × T`` mask; return the implementation.

    Flash-attention 2 when the model is on a CUDA device and ``flash_attn`` is installed (its
    varlen kernel), else :data:`VARLEN` (NOTE [ Packed rows need varlen attention ]). Padded
    batches keep working: with an attention mask both fall back to masked attention.

    Raises:
        InvalidArgument: ``model`` is not a transformers model (no ``config``).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidArgument(
            f"use_varlen_attention needs a transformers model (with a config), but got a {type(model).__name__}"
        )
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.device.type == "cuda"
    name = (
        "flash_attention_2"
        if on_cuda and importlib.util.find_spec("flash_attn")
        else register_varlen_attention()
    )
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        config._attn_implementation = name
    return name


def warn_if_masked(model: torch.nn.Module | None) -> None:
    """Warn once when packed rows are about to run through an attention that builds a full mask."""
    global _warned
    if model is None or _warned:
        return
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name in _MASKED:
        _warned = True
        warnings.warn(
            f"packed micro-batches through attn_implementation={name!r} build a T × T mask (memory grows with T², "
            "and it runs slower than padded rows); call batchfit.models.attention.use_varlen_attention(model) first",
            stacklevel=4,
        )
