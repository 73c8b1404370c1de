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

NOTE [ Packed rows must not attend across sequences ]
Nothing in a packed row itself keeps its sequences apart: transformers' ``eager``, ``sdpa``
and ``flex_attention`` split it only when they build a mask from ``position_ids``, which
they do only when no cache is made. A model whose config has ``use_cache=True`` (the
default of most) called without ``use_cache=False`` makes a cache, and the packed row then
attends causally over the whole row: measured on a tiny Llama, log-probs off by 0.19 (0.26
on a tiny Qwen2), without a warning. Varlen kernels (flash-attention, :data:`VARLEN`) read
the boundaries themselves (``cu_seq_lens_q``/``position_ids``) and stay correct.
:func:`check_packed_attention` refuses a packed call that would mix sequences (a cache
with a masked implementation, or a transformers too old to split packed rows) and warns
once where batchfit cannot tell (an implementation it does not know, a model whose mask
code does not come from ``transformers.masking_utils``). ``MicroBatch.model_inputs()``
passes ``use_cache=False``; :func:`batchfit.train.model_logprobs` runs the check on every
packed micro-batch.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchfit.errors import InvalidArgument

#: The name :func:`use_varlen_attention` registers with transformers.
VARLEN = "batchfit_varlen"
#: The name :func:`batchfit.models.ulysses.use_ulysses_attention` registers with transformers.
ULYSSES = "batchfit_ulysses"

# attention implementations that build a full mask for packed rows
_MASKED = ("sdpa", "eager", "flex_attention")

# attention implementations that read a packed row's boundaries themselves, cache or not
_VARLEN_AWARE = ("flash_attention_2", "flash_attention_3", VARLEN, ULYSSES)

_registered: set[str] = set()  # the names register_packed_attention registered
_warned = False
_warned_unchecked: set[str] = set()


def sequence_bounds(kwargs: Mapping[str, Any], length: int) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each sequence of a packed row of ``length`` tokens, from ``cu_seq_lens_q`` or ``position_ids``; ``None`` if neither tells."""
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
        bounds = sequence_bounds(kwargs, query.shape[2])
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return attend_within_sequences(query, key, value, bounds, dropout=dropout if module.training else 0.0, scaling=scaling), None


def attend_within_sequences(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[tuple[int, int]],
    *,
    dropout: float = 0.0,
    scaling: float | None = None,
) -> torch.Tensor:
    """Causal attention of one packed row within each ``(start, end)`` of ``bounds``.

    ``query`` is ``[1, heads, T, dim]``, key and value ``[1, kv_heads, T, dim]`` (grouped-query
    attention without copies); returns ``[1, T, heads, dim]``, transformers' layout.
    """
    # grouped-query attention without copies of key and value (transformers' sdpa path does the same)
    gqa = query.shape[1] != key.shape[1]
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
            q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        outputs.append(out.transpose(0, 1).flatten(1, 2)[None] if count > 1 else out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


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


def register_packed_attention(name: str, attention: Any) -> str:
    """Register ``attention`` as ``name`` with transformers' attention interface, with :func:`varlen_mask`
    (no mask for packed rows) as its mask function, once per name; return ``name``."""
    if name not in _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, varlen_mask)
        _registered.add(name)
    return name


def register_varlen_attention() -> str:
    """Register :data:`VARLEN` with transformers' attention and mask interfaces (once); return the name."""
    return register_packed_attention(VARLEN, varlen_attention)


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


def _is_packed_call(inputs: Mapping[str, Any]) -> bool:
    """A call of one row with positions (or varlen kwargs) and no attention mask: possibly several sequences."""
    if inputs.get("attention_mask") is not None:
        return False
    cu = inputs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return cu.numel() > 2  # shape only: no device sync
    positions = inputs.get("position_ids")
    return isinstance(positions, torch.Tensor) and positions.ndim == 2 and positions.shape[0] == 1


@functools.cache
def _masks_from_masking_utils(cls: type) -> bool:
    """Whether a module defining ``cls`` or one of its bases uses transformers' mask functions (which split packed rows)."""
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        if module is not None and any(getattr(v, "__module__", None) == "transformers.masking_utils" for v in vars(module).values()):
            return True
    return False


def _transformers_splits_packed_rows() -> bool:
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers before masking_utils
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def check_packed_attention(model: torch.nn.Module, inputs: Mapping[str, Any]) -> None:
    """Refuse a call of ``model`` on a packed row that would attend across its sequences (NOTE [ Packed rows must not attend across sequences ]).

    ``inputs`` are the keyword arguments the model is about to get (``mb.model_inputs()``).
    Calls with an attention mask, or of more than one row, are not packed and pass. A
    packed call passes when the model's attention implementation reads the row's
    boundaries itself (flash-attention, :data:`VARLEN`), or when it is ``eager``, ``sdpa``
    or ``flex_attention`` without a cache (``use_cache=False``, or the config's
    ``use_cache`` false, and no ``past_key_values``) in a transformers that splits packed
    rows. An implementation batchfit does not know, or a model whose mask code is not
    transformers' ``masking_utils``, passes with a warning (once per implementation).

    Args:
        model: the model (unwrapped, DDP or FSDP2: its ``config`` is read).
        inputs: the call's keyword arguments.

    Raises:
        InvalidArgument: the call would make a cache with ``eager``/``sdpa``/``flex_attention``
            (pass ``use_cache=False``), or the installed transformers does not split packed
            rows for them (call :func:`use_varlen_attention` first).
    """
    if not _is_packed_call(inputs):
        return
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    if config is None:
        return
    name = str(getattr(config, "_attn_implementation", None))
    if name in _VARLEN_AWARE or "flash" in name:
        return
    if name not in _MASKED:
        _warn_unchecked(name, f"attn_implementation={name!r} is not one batchfit knows")
        return
    use_cache = inputs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", False)
    # the cache argument: ``cache`` from transformers 5.24, ``past_key_values`` before
    given = next((key for key in ("cache", "past_key_values") if inputs.get(key) is not None), None)
    if use_cache or given:
        raise InvalidArgument(
            f"a packed row run with attn_implementation={name!r} and a cache (use_cache={use_cache!r}"
            f"{f', {given} given' if given else ''}) attends across its sequences: "
            "transformers splits packed rows only when no cache is made; pass use_cache=False "
            "(model(**mb.model_inputs()) does) or call batchfit.models.attention.use_varlen_attention(model) first"
        )
    if not _transformers_splits_packed_rows():
        raise InvalidArgument(
            f"the installed transformers does not split packed rows for attn_implementation={name!r}: "
            "each sequence would attend to the ones before it in the row; call "
            "batchfit.models.attention.use_varlen_attention(model) first, or use layout='padded'"
        )
    if not _masks_from_masking_utils(type(inner)):
        _warn_unchecked(name, f"{type(inner).__name__} does not build its masks with transformers.masking_utils")


def _warn_unchecked(name: str, why: str) -> None:
    if name in _warned_unchecked:
        return
    _warned_unchecked.add(name)
    warnings.warn(
        f"batchfit cannot tell whether packed rows attend within each sequence: {why}; "
        "call batchfit.models.attention.use_varlen_attention(model), or compare model_logprobs of a packed "
        "micro-batch with its sequences run alone",
        stacklevel=3,
    )



@dataclass(frozen=True)
class CudaAttention:
    """The kernel CUDA runs for a model's sdpa attention, and the report's line when it is the math path.

    Attributes:
        kernel: ``"flash"``, ``"efficient"`` or ``"math"``.
        note: one line saying why the math path runs, what it holds and what runs flash;
            ``None`` for a fused kernel.
    """

    kernel: str
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values."""
        return {"kernel": self.kernel, "note": self.note}


def attention_head_dims(config: Any) -> tuple[int, int]:
    """The head sizes of ``config``'s queries/keys and of its values, as its attention passes them to sdpa.

    Multi-head latent attention (DeepSeek-V2/V3 and the configs built like them) gives query and
    key heads of ``qk_nope_head_dim + qk_rope_head_dim`` (``qk_head_dim``) and value heads of
    ``v_head_dim``; its ``head_dim`` is the rotary part alone. Other configs: ``head_dim``, or
    ``hidden_size / num_attention_heads``, for both.

    Example:
        >>> from batchfit.models import load_config
        >>> attention_head_dims(load_config("deepseek-v3")), attention_head_dims(load_config("qwen2.5-0.5b"))
        ((192, 128), (64, 64))
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    v_dim = getattr(config, "v_head_dim", None)
    if not v_dim:
        return head_dim, head_dim
    nope, rope = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    qk_dim = getattr(config, "qk_head_dim", None) or (nope + rope if nope and rope else head_dim)
    return qk_dim, v_dim


def cuda_attention_of(config: Any, compute_dtype: torch.dtype) -> CudaAttention | None:
    """The kernel CUDA runs for ``config``'s sdpa attention in ``compute_dtype``.

    As transformers calls it on rows without a padding mask (``enable_gqa`` when the key/value
    heads are fewer, NOTE [ The estimate runs CUDA's attention kernel ] in
    :mod:`batchfit.memory.cuda_attention`). ``None`` when the model's attention is not sdpa or
    its heads are not in the config.

    Example:
        >>> from batchfit.models import load_config
        >>> cuda_attention_of(load_config("tiny"), torch.bfloat16).kernel, cuda_attention_of(load_config("tiny"), torch.float32).kernel
        ('flash', 'math')
    """
    from batchfit.memory.cuda_attention import cuda_attention_kernel

    name = getattr(config, "_attn_implementation", None)
    heads = getattr(config, "num_attention_heads", None)
    if name not in (None, "sdpa") or not heads:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    qk_dim, v_dim = attention_head_dims(config)
    q = torch.empty(1, heads, 1, qk_dim, dtype=compute_dtype, device="meta")
    k = torch.empty(1, kv_heads, 1, qk_dim, dtype=compute_dtype, device="meta")
    v = torch.empty(1, kv_heads, 1, v_dim, dtype=compute_dtype, device="meta")
    kernel = cuda_attention_kernel(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    if kernel != "math":
        return CudaAttention(kernel)
    dtype = str(compute_dtype).removeprefix("torch.")
    why = (
        "flash takes only bf16/fp16 and the memory-efficient kernel only equal heads"
        if compute_dtype == torch.float32 and kv_heads != heads
        else "no fused kernel takes these inputs"
    )
    note = (
        f"attention: CUDA runs its math path ({dtype}, {heads} query and {kv_heads} key/value heads: {why}), "
        f"which holds each layer's b × {heads} × s² scores; bf16 compute runs flash "
        f"(--dtype bf16, or --mixed-precision bf16 with fsdp2)"
    )
    return CudaAttention(kernel, note)
