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
(:func:`cuda_attention_kernel`) and holds what that kernel holds:

- **math**: the call runs the math path on the fake CPU tensors too
  (``sdpa_kernel(SDPBackend.MATH)``, the same composite code on both devices), so its scores
  are counted.
- **a fused kernel the CPU also has** (q, k and v of one head size: the CPU's flash kernel,
  ``sdp_utils_cpp.cpp`` ``check_head_dim_size_cpp``): the CPU's own choice stands; its flash
  kernel keeps what CUDA's fused kernels keep (the output and a float32 log-sum-exp per query
  and head) to within 0.05% of the step (qwen2.5-0.5b, bf16, 16 × 4,096 tokens on the H200).
- **the memory-efficient kernel on shapes no CPU kernel fuses** (q/k heads wider or narrower
  than v heads: DeepSeek's multi-head latent attention, 192 and 128): the CPU would take its
  math path and hold the scores, so the fake tensors run CUDA's own operator instead,
  ``aten._scaled_dot_product_efficient_attention``, as CUDA's ``scaled_dot_product_attention``
  calls it (a boolean mask turned into an additive one in the query's dtype, its last dimension
  padded to 16); autograd takes its backward from ``derivatives.yaml`` and PyTorch's meta
  functions give both passes CUDA's shapes and layouts (the output in CUDA's b × s × h × d
  layout, the log-sum-exp padded to 32 queries). Not modelled: the float32 workspace the CUDA
  backward allocates inside the kernel for wide heads (a transient within the step's margin).
  Real CPU tensors (the cpu backend) have no such operator: they run the CPU's flash kernel on
  the narrower of q/k and v zero-padded to the wider head size (the same values: zero columns
  add nothing to q·k and give zero output columns), which holds O(s) too, slightly above CUDA.

The rules are CUDA's for devices of compute capability 8.0 and newer (every device preset),
where PyTorch 2.6 to 2.13 agree; where they do not, the estimate takes the larger:

- **flash**: float16 or bfloat16; no ``attn_mask``; the same head size for q, k and v, at most
  256; key/value heads equal to the query heads, or dividing them with ``enable_gqa``; no
  causal mask over queries and keys of different lengths.
- **memory-efficient**: float16, bfloat16 or float32; head sizes of q and k equal, q's and v's
  multiples of 8 (half precision) or 4 (float32), v's free to differ from q's; the last
  dimension of q, k and v contiguous and their storage offsets multiples of that alignment
  (``check_data_ptr_alignment_mem_efficient``); ``attn_mask`` allowed; the same number of
  heads for q, k and v (grouped heads only from PyTorch PR #191085, after 2.13: taken as not
  accepted).
- flash also wants the last dimension contiguous (``check_last_dim_stride_equals_1_dense``).
- **cuDNN** (preferred on Hopper and Blackwell by newer releases with cuDNN after 9.15,
  ``check_prefer_cudnn_attention``) is not modelled: it takes only half precision, where flash
  or memory-efficient also runs (q/k heads of 192 with v heads of 128 included: cuDNN takes
  them on sm90/sm10x, ``check_cudnn_tensor_shapes``, and holds O(s) as the memory-efficient
  kernel does), except masked grouped heads (which transformers never passes: it repeats the
  key/value heads when there is a mask).
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
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchfit.patching import AttributePatch

Kernel = Literal["flash", "efficient", "math"]

_HALF = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
#: ``pad_bias<mem_eff_alignment>`` in PyTorch's ``attention.cpp``: the mask's last dimension
_BIAS_ALIGNMENT = 16


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
    tensors = (query, key, value)
    flash = (
        torch.backends.cuda.flash_sdp_enabled()
        and dtype in _HALF
        and attn_mask is None
        and q_dim == k_dim == v_dim <= _FLASH_MAX_HEAD_DIM
        and _heads_accepted(q_heads, kv_heads, enable_gqa, grouped=True)
        and not (is_causal and query.shape[-2] != key.shape[-2])
        and all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in tensors)
    )
    if flash:
        return "flash"
    alignment = 8 if dtype in _HALF else 4  # minimum_gemm_alignment on sm80 and newer
    efficient = (
        torch.backends.cuda.mem_efficient_sdp_enabled()
        and dtype in (*_HALF, torch.float32)
        and q_dim == k_dim
        and q_dim % alignment == 0
        and v_dim % alignment == 0
        and all(t.stride(-1) == 1 and t.storage_offset() % alignment == 0 for t in tensors)
        and _heads_accepted(q_heads, kv_heads, enable_gqa, grouped=False)
    )
    return "efficient" if efficient else "math"


def _cpu_fuses(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the CPU's flash kernel takes these head sizes (``sdp_utils_cpp.cpp``: q, k and v all alike)."""
    return query.shape[-1] == key.shape[-1] == value.shape[-1]


def _efficient_bias(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask as CUDA's ``scaled_dot_product_attention`` hands it to the memory-efficient kernel.

    ``convert_boolean_attn_mask`` (a boolean mask becomes 0 where kept and -inf elsewhere, in the
    query's dtype) and ``preprocess_mask`` (the last dimension padded to a multiple of 16, the
    padded storage kept, the view sliced back) in PyTorch's ``attention.cpp``.
    """
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), torch.zeros((), dtype=dtype))
    last = attn_mask.shape[-1]
    if last % _BIAS_ALIGNMENT:
        attn_mask = F.pad(attn_mask, (0, _BIAS_ALIGNMENT - last % _BIAS_ALIGNMENT))[..., :last]
    return attn_mask


def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """CUDA's memory-efficient kernel where the CPU has no fused one (NOTE [ The estimate runs CUDA's attention kernel ])."""
    if is_fake(query):
        compute_log_sumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        bias = _efficient_bias(attn_mask, query.dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, compute_log_sumexp, dropout_p, is_causal, scale=scale
        )[0]
    # real CPU tensors: the CPU's flash kernel on zero-padded head sizes, the same values
    if scale is None:
        scale = query.shape[-1] ** -0.5
    q_dim, v_dim = query.shape[-1], value.shape[-1]
    if v_dim < q_dim:
        value = F.pad(value, (0, q_dim - v_dim))
    else:
        query, key = F.pad(query, (0, v_dim - q_dim)), F.pad(key, (0, v_dim - q_dim))
    out = _PATCH.call_below(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    return out[..., :v_dim]


# NOTE [ Shared and counted ] in batchfit.patching: nested and concurrent estimates share it
_PATCH = AttributePatch(lambda: F, "scaled_dot_product_attention")
# inside cuda_attention() in this context (thread): a measurement running the CPU's own kernels
# on another thread while the patch is installed keeps them
_INSIDE: contextvars.ContextVar[int] = contextvars.ContextVar("batchfit_cuda_attention", default=0)


@_PATCH.bind
def _scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``scaled_dot_product_attention`` holding what CUDA's kernel holds (NOTE [ The estimate runs CUDA's attention kernel ])."""
    if not _INSIDE.get() or query.is_nested:  # nested tensors: the CPU's own choice (not modelled)
        return _PATCH.call_below(query, key, value, *args, **kwargs)
    attn_mask = kwargs.get("attn_mask", args[0] if args else None)
    is_causal = bool(kwargs.get("is_causal", args[2] if len(args) > 2 else False))
    enable_gqa = bool(kwargs.get("enable_gqa", args[4] if len(args) > 4 else False))
    kernel = cuda_attention_kernel(query, key, value, attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
    if kernel != "math" and _cpu_fuses(query, key, value):
        return _PATCH.call_below(query, key, value, *args, **kwargs)
    if kernel == "efficient":  # flash takes only one head size, which the CPU fuses too
        dropout_p = float(kwargs.get("dropout_p", args[1] if len(args) > 1 else 0.0))
        scale = kwargs.get("scale", args[3] if len(args) > 3 else None)
        return _efficient_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)
    with sdpa_kernel(SDPBackend.MATH):
        return _PATCH.call_below(query, key, value, *args, **kwargs)


@contextlib.contextmanager
def cuda_attention() -> Iterator[None]:
    """Inside, ``F.scaled_dot_product_attention`` holds what CUDA's kernel would (NOTE [ The estimate runs CUDA's attention kernel ]).

    The math path wherever CUDA takes it; CUDA's memory-efficient operator on fake tensors
    whose head sizes no CPU kernel fuses; the CPU's own fused kernel elsewhere.

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
