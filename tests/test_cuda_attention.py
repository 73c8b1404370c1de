"""The estimate runs the attention kernel CUDA would (NOTE [ The estimate runs CUDA's attention kernel ])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from batchfit.budget import causal_lm_step
from batchfit.errors import InvalidArgument
from batchfit.memory.cpu import CpuBackend
from batchfit.memory.cuda_attention import cuda_attention, cuda_attention_kernel
from batchfit.memory.estimate import EstimateBackend
from batchfit.models import build_causal_lm

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _kernel(dtype, q_heads, kv_heads, head_dim, *, gqa=False, mask=False, causal=True, q_len=8, k_len=8, v_dim=None):
    q = torch.empty(2, q_heads, q_len, head_dim, dtype=dtype)
    k = torch.empty(2, kv_heads, k_len, head_dim, dtype=dtype)
    v = torch.empty(2, kv_heads, k_len, head_dim if v_dim is None else v_dim, dtype=dtype)
    m = torch.ones(q_len, k_len, dtype=torch.bool) if mask else None
    return cuda_attention_kernel(q, k, v, m, is_causal=causal and not mask, enable_gqa=gqa)


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        # transformers' call for a grouped-heads model without a mask: enable_gqa=True
        pytest.param((BF16, 4, 2, 64), {"gqa": True}, "flash", id="bf16-gqa"),
        pytest.param((F16, 28, 4, 128), {"gqa": True}, "flash", id="fp16-gqa"),
        pytest.param((F32, 4, 2, 16), {"gqa": True}, "math", id="fp32-gqa"),  # the H200's out-of-memory
        pytest.param((F32, 4, 4, 16), {}, "efficient", id="fp32-mha"),
        pytest.param((F32, 4, 4, 6), {}, "math", id="fp32-head-dim-not-multiple-of-4"),
        pytest.param((BF16, 4, 4, 64), {"mask": True}, "efficient", id="bf16-mask"),
        pytest.param((BF16, 4, 2, 64), {"mask": True, "gqa": True}, "math", id="bf16-mask-gqa"),
        pytest.param((BF16, 8, 4, 512), {"gqa": True}, "math", id="bf16-gqa-head-dim-512"),
        pytest.param((BF16, 8, 8, 512), {}, "efficient", id="bf16-head-dim-512"),  # transformers' repeat_kv path
        pytest.param((BF16, 4, 4, 20), {}, "flash", id="bf16-head-dim-20"),
        pytest.param((BF16, 4, 4, 20), {"mask": True}, "math", id="bf16-mask-head-dim-20"),
        pytest.param((BF16, 4, 4, 64), {"q_len": 4}, "efficient", id="bf16-causal-non-square"),
        pytest.param((BF16, 4, 4, 64), {"v_dim": 32}, "efficient", id="bf16-v-head-dim-differs"),
        pytest.param((BF16, 6, 4, 64), {"gqa": True}, "math", id="heads-not-a-multiple"),
    ],
)
def test_cuda_attention_kernel_follows_cudas_rules(args, kwargs, expected):
    assert _kernel(*args, **kwargs) == expected


def test_a_kernel_the_process_turned_off_is_not_chosen():
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert _kernel(BF16, 4, 4, 64) == "efficient"
        assert _kernel(BF16, 4, 2, 64, gqa=True) == "math"
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert _kernel(F32, 4, 4, 16) == "math"
    assert _kernel(BF16, 4, 4, 64) == "flash"  # put back


def _attention_peak(backend, dtype, kv_heads):
    with backend.context():
        q = torch.randn(3, 4, 96, 16, dtype=dtype, requires_grad=True)
        k = torch.randn(3, kv_heads, 96, 16, dtype=dtype, requires_grad=True)
        v = torch.randn(3, kv_heads, 96, 16, dtype=dtype, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4).sum().backward()

    return backend.measure(step, register=(q, k, v)).peak_bytes


@pytest.mark.parametrize("kernels", ["cuda", "own"])
@pytest.mark.parametrize("dtype, kv_heads", [(F32, 2), (F32, 4), (BF16, 2)], ids=["fp32-gqa", "fp32-mha", "bf16-gqa"])
def test_estimate_equals_cpu_under_either_kernels_and_cudas_math_path_holds_the_scores(kernels, dtype, kv_heads):
    cpu = _attention_peak(CpuBackend(attention_kernels=kernels), dtype, kv_heads)
    estimate = _attention_peak(EstimateBackend(reserve_bytes=0, round_to=1, attention_kernels=kernels), dtype, kv_heads)
    assert estimate == cpu
    own = _attention_peak(CpuBackend(attention_kernels="own"), dtype, kv_heads)
    scores = 3 * 4 * 96 * 96 * dtype.itemsize
    if kernels == "cuda" and dtype == F32 and kv_heads == 2:  # CUDA's math path: the scores and their softmax
        assert cpu >= own + 2 * scores
    else:  # a fused CUDA kernel: the CPU's own flash kernel stands for it
        assert cpu == own


def test_the_function_is_put_back_after_a_measurement():
    original = F.scaled_dot_product_attention
    _attention_peak(EstimateBackend(reserve_bytes=0), F32, 2)
    assert F.scaled_dot_product_attention is original
    with cuda_attention(), cuda_attention():
        assert F.scaled_dot_product_attention is not original
    assert F.scaled_dot_product_attention is original


def test_attention_kernels_is_checked():
    with pytest.raises(InvalidArgument, match=r"attention_kernels must be one of 'cuda', 'own', but got attention_kernels='cpu'"):
        CpuBackend(attention_kernels="cpu")


#: ``torch.cuda.max_memory_allocated`` when the H200's run of the tiny preset in float32 at
#: 4,558 × 2,048 tokens ran out of memory (torch 2.11.0+cu130, ``python benchmarks/gpu_check.py``)
H200_ALLOCATED_AT_OOM = 21_873_486_848


def test_the_estimate_asks_for_the_scores_where_the_h200_ran_out_of_memory():
    backend = EstimateBackend(memory_limit=150_109_880_320, reserve_bytes=552_402_944)
    model = build_causal_lm("tiny", backend=backend, dtype="fp32", gradient_checkpointing=True)
    step = causal_lm_step(model, backend=backend, logprobs="full", cost="padded")
    measured = step.measure([2048] * 4558)
    assert measured.exceeded and not measured.fits
    scores = 4558 * 4 * 2048 * 2048 * 4  # the first layer's scores, asked for at once
    held = measured.peak_bytes - scores
    assert abs(held - H200_ALLOCATED_AT_OOM) <= 0.01 * H200_ALLOCATED_AT_OOM, held


def test_only_the_callers_inside_take_cudas_choice():
    import threading

    seen = {}
    inside, go = threading.Event(), threading.Event()

    def elsewhere():  # another thread, not inside cuda_attention(), while the patch is installed
        inside.wait()
        seen["other"] = _attention_peak(CpuBackend(attention_kernels="own"), F32, 2)
        go.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with cuda_attention():
        inside.set()
        go.wait(timeout=60)
    thread.join(timeout=60)
    assert seen["other"] == _attention_peak(CpuBackend(attention_kernels="own"), F32, 2)


def test_a_models_cuda_attention_says_why_the_math_path_runs():
    from batchfit.models import load_config
    from batchfit.models.attention import cuda_attention_of

    fp32 = cuda_attention_of(load_config("tiny"), F32)
    assert fp32.kernel == "math" and "float32, 4 query and 2 key/value heads" in fp32.note
    assert cuda_attention_of(load_config("tiny"), BF16).to_dict() == {"kernel": "flash", "note": None}
    assert cuda_attention_of(load_config("qwen2.5-0.5b"), F32).kernel == "math"  # 14 query, 2 key/value heads
    eager = load_config("tiny")
    eager._attn_implementation = "eager"
    assert cuda_attention_of(eager, F32) is None


@pytest.mark.slow  # three whole profiles
def test_the_profile_names_cudas_math_path_and_what_runs_flash(capsys):
    import json

    from batchfit.cli import main

    flags = ["profile", "--model", "tiny", "--sharding", "none", "--max-seq-len", "256", "--memory", "1GB", "--no-progress"]
    assert main([*flags, "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "attention: CUDA runs its math path (float32, 4 query and 2 key/value heads" in out
    assert "bf16 compute runs flash (--dtype bf16, or --mixed-precision bf16 with fsdp2)" in out
    assert main([*flags, "--dtype", "bf16"]) == 0
    assert "attention:" not in capsys.readouterr().out
    assert main([*flags, "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"]["kernel"] == "math"
