"""The attention kernel CUDA's ``scaled_dot_product_attention`` picks, and the estimate running the same one.

NOTE [ The estimate runs CUDA's attention kernel ]
The estimate runs a step on fake *CPU* tensors, so ``scaled_dot_product_attention`` dispatches
as on a CPU: to the CPU flash kernel, which takes float32, grouped-query heads (``enable_gqa``)
and masks, and keeps O(S) per head. CUDA chooses among its own kernels (PyTorch's
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, ``select_sdp_backend``: flash, then
memory-efficient, then math), and when none of the fused ones accepts the inputs it runs the
math path, which holds the B × H × S × S scores (and their softmax for the backward).

Measured on an H200 (torch 2.11.0+cu130, ``python benchmarks/gpu_check.py``, 2026-11-27): the
tiny preset in float32 (4 query heads, 2 key/value heads) was estimated to fit 4,558 × 2,048
tokens in 127.1 GB, and the real step ran out of memory with 21,873,486,848 B allocated:
transformers passes ``enable_gqa=True`` when there is no mask, flash takes no float32, the
memory-efficient kernel takes no grouped heads, and the math path asked for the first
layer's scores, 4,558 × 4 × 2,048² × 4 B = 305.9 GB, at once. Running CUDA's kernel, the
estimate holds 21,826,633,216 B when it asks for the same scores (0.2% below the device):
``tests/test_cuda_attention.py``. The same fall-back is reported for torch 2.11 on an RTX 5090
(facebookresearch/sapiens2 PR #3) and for masked grouped heads (Comfy-Org/ComfyUI PR #15135).

Inside the estimate (:func:`cuda_attention`), each call decides as CUDA would
(:func:`cuda_attention_kernel`); when that is the math path, the call runs the math path on
the fake CPU tensors too (``sdpa_kernel(SDPBackend.MATH)``, the same composite code on both
devices), so its scores are counted. When a fused CUDA kernel would run, the CPU's own choice
stands: its flash kernel keeps what CUDA's fused kernels keep to within 0.05% of the step
(qwen2.5-0.5b, bf16, 16 × 4,096 tokens on the H200).

The rules are CUDA's for devices of compute capability 8.0 and newer (every device preset),
where PyTorch 2.6 to 2.13 agree; where they do not, the estimate takes the larger:

- **flash**: float16 or bfloat16; no ``attn_mask``; the same head size for q, k and v, at most
  256; key/value heads equal to the query heads, or dividing them with ``enable_gqa``; no
  causal mask over queries and keys of different lengths.
- **memory-efficient**: float16, bfloat16 or float32; head sizes of q and k equal, q's and v's
  multiples of 8 (half precision) or 4 (float32); ``attn_mask`` allowed; the same number of
  heads for q, k and v (grouped heads only from PyTorch PR #191085, after 2.13: taken as not
  accepted).
- **cuDNN** (preferred on Hopper and Blackwell by newer releases) is not modelled: it takes
  only half precision, where flash or memory-efficient also runs, except masked grouped heads
  (which transformers never passes: it repeats the key/value heads when there is a mask).
- Not modelled: flash's refusal of head sizes over 192 with gradients on sm86/89 (A10, L4,
  L40), where the memory-efficient kernel then takes the call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchfit.patching import AttributePatch

Kernel = Literal["flash", "efficient", "math"]

_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def _heads_accepted(q_heads: int, kv_heads: int, enable_gqa: bool, *, grouped: bool) -> bool:
    """Whether a kernel accepts these head counts (``check_batch_size_and_num_heads_dense``)."""
    if q_heads == kv_heads:
        return True
    return grouped and enable_gqa and kv_heads > 0 and q_heads % kv_heads == 0


def cuda_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    *,
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> Kernel:
    """The kernel CUDA's ``scaled_dot_product_attention`` runs for these inputs (NOTE [ The estimate runs CUDA's attention kernel ]).

    Reads shapes and dtypes only: it works on fake, meta and CPU tensors alike. A kernel the
    process has turned off (``torch.backends.cuda.enable_flash_sdp(False)``, ``sdpa_kernel``)
    is not chosen, as on CUDA.

    Args:
        query, key, value: ``(..., heads, length, head_dim)`` tensors, as given to
            ``scaled_dot_product_attention`` (3-d tensors have one head).
        attn_mask: the mask, if any.
        is_causal, enable_gqa: as given to ``scaled_dot_product_attention``.

    Returns:
        ``"flash"``, ``"efficient"`` or ``"math"``.

    Example:
        >>> q, kv = torch.empty(1, 4, 8, 16), torch.empty(1, 2, 8, 16)
        >>> cuda_attention_kernel(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), is_causal=True, enable_gqa=True)
        'flash'
        >>> cuda_attention_kernel(q, kv, kv, is_causal=True, enable_gqa=True)
        'math'
    """
    dtype = query.dtype
    if query.dim() < 3 or key.dtype != dtype or value.dtype != dtype:
        return "math"
    q_heads = query.shape[-3] if query.dim() >= 4 else 1
    kv_heads = key.shape[-3] if key.dim() >= 4 else 1
    v_heads = value.shape[-3] if value.dim() >= 4 else 1
    q_dim, k_dim, v_dim = query.shape[-1], key.shape[-1], value.shape[-1]
    if kv_heads != v_heads or min(query.shape[-2], key.shape[-2], q_dim, v_dim) == 0:
        return "math"
    flash = (
        torch.backends.cuda.flash_sdp_enabled()
        and dtype in _HALF
        and attn_mask is None
        and q_dim == k_dim == v_dim <= _FLASH_MAX_HEAD_DIM
        and _heads_accepted(q_heads, kv_heads, enable_gqa, grouped=True)
        and not (is_causal and query.shape[-2] != key.shape[-2])
    )
    if flash:
        return "flash"
    alignment = 8 if dtype in _HALF else 4
    efficient = (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and dtype in (*_HALF, torch.float32)
        and q_dim == k_dim
        and q_dim % alignment == 0
        and v_dim % alignment == 0
        and _heads_accepted(q_heads, kv_heads, enable_gqa, grouped=False)
    )
    return "efficient" if efficient else "math"


# NOTE [ Shared and counted ] in batchfit.patching: nested and concurrent estimates share it
_PATCH = AttributePatch(lambda: F, "scaled_dot_product_attention")
# inside cuda_attention() in this context (thread): a measurement running the CPU's own kernels
# on another thread while the patch is installed keeps them
_INSIDE: contextvars.ContextVar[int] = contextvars.ContextVar("batchfit_cuda_attention", default=0)


@_PATCH.bind
def _scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` running CUDA's math path where CUDA would (NOTE [ The estimate runs CUDA's attention kernel ])."""
    if not _INSIDE.get() or query.is_nested:  # nested tensors: the CPU's own choice (not modelled)
        return _PATCH.call_below(query, key, value, *args, **kwargs)
    attn_mask = kwargs.get("attn_mask", args[0] if args else None)
    is_causal = bool(kwargs.get("is_causal", args[2] if len(args) > 2 else False))
    enable_gqa = bool(kwargs.get("enable_gqa", args[4] if len(args) > 4 else False))
    kernel = cuda_attention_kernel(query, key, value, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    if kernel != "math":
        return _PATCH.call_below(query, key, value, *args, **kwargs)
    with sdpa_kernel(SDPBackend.MATH):
        return _PATCH.call_below(query, key, value, *args, **kwargs)


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Inside, ``F.scaled_dot_product_attention`` takes the math path wherever CUDA would (NOTE [ The estimate runs CUDA's attention kernel ]).

    Shared by nested and concurrent blocks (one installation, NOTE [ Shared and counted ]);
    the function is put back on exit, also on errors. Only calls made inside the block (its
    thread or context) take CUDA's choice: a measurement running the CPU's own kernels on
    another thread meanwhile keeps them.
    """
    token = _INSIDE.set(_INSIDE.get() + 1)
    try:
        with _PATCH.active():
            yield
    finally:
        _INSIDE.reset(token)
