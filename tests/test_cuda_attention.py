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


# --- q/k heads of one width, v heads of another (multi-head latent attention) ---------------

#: DeepSeek-V2-Lite's config.json (huggingface.co/deepseek-ai/DeepSeek-V2-Lite): query/key heads of
#: 128 + 64 = 192, value heads of 128, 16 heads of each
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

#: the same attention, small: q/k heads 32 + 16 = 48 wide, v heads 32, no experts
TINY_MLA = {
    **DEEPSEEK_V2_LITE,
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "first_k_dense_replace": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 256, "max_position_embeddings": 4096,
}


def _config_dir(root, name, config):
    import json

    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _one_call(dtype, heads, kv_heads, qk_dim, v_dim, length, *, backward, kernels="cuda", mask=False):
    """What one sdpa call holds beyond its inputs (and the gradient handed to its backward)."""
    backend = EstimateBackend(reserve_bytes=0, round_to=1, attention_kernels=kernels)
    with backend.context():
        q = torch.randn(2, heads, length, qk_dim, dtype=dtype, requires_grad=True)
        k = torch.randn(2, kv_heads, length, qk_dim, dtype=dtype, requires_grad=True)
        v = torch.randn(2, kv_heads, length, v_dim, dtype=dtype, requires_grad=True)
        grad = torch.randn(2, heads, length, v_dim, dtype=dtype)
        m = torch.ones(length, length, dtype=torch.bool).tril() if mask else None
    gqa = kv_heads != heads
    kernel = cuda_attention_kernel(q, k, v, m, is_causal=not mask, enable_gqa=gqa)
    kept = []

    def step():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not mask, enable_gqa=gqa)
        if backward:
            out.backward(grad)
        else:
            kept.append(out)

    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, grad)) + (m.numel() if mask else 0)
    registered = (q, k, v, grad) if m is None else (q, k, v, grad, m)
    return kernel, backend.measure(step, register=registered).peak_bytes - inputs


_GRID = [
    pytest.param(dtype, heads, kv_heads, qk_dim, v_dim, id=f"{str(dtype)[6:]}-{heads}q{kv_heads}kv-qk{qk_dim}-v{v_dim}")
    for dtype in (BF16, F16, F32)
    for heads, kv_heads in ((4, 4), (4, 2), (4, 1))
    for qk_dim, v_dim in ((64, 64), (192, 128), (64, 128), (96, 32), (20, 20))
]


@pytest.mark.parametrize("dtype, heads, kv_heads, qk_dim, v_dim", _GRID)
def test_one_attention_call_holds_what_cudas_kernel_holds(dtype, heads, kv_heads, qk_dim, v_dim):
    kernel, forward = _one_call(dtype, heads, kv_heads, qk_dim, v_dim, 64, backward=False)
    out = 2 * heads * 64 * v_dim * dtype.itemsize
    if kernel == "math":  # the composite math path on both devices: the probabilities are kept
        assert forward >= out + 2 * heads * 64 * 64 * dtype.itemsize
        return
    # a fused kernel keeps its output and a float32 log-sum-exp per query and head, nothing
    # s × s (64 queries: CUDA's memory-efficient kernel pads that to a multiple of 32, none here);
    # CUDA's memory-efficient operator adds its two int64 dropout scalars (seed, offset)
    lse = 2 * heads * 64 * 4
    scalars = 16 if qk_dim != v_dim else 0
    assert forward == out + lse + scalars
    # and forward + backward holds O(s): twice the length, twice the memory (to the byte)
    _, once = _one_call(dtype, heads, kv_heads, qk_dim, v_dim, 64, backward=True)
    _, twice = _one_call(dtype, heads, kv_heads, qk_dim, v_dim, 128, backward=True)
    assert twice == 2 * once


def test_latent_attentions_head_widths_run_the_memory_efficient_kernel():
    # DeepSeek's q/k heads 192, v heads 128: flash wants one width, memory-efficient takes both
    assert _kernel(BF16, 16, 16, 192, v_dim=128) == "efficient"
    assert _kernel(F32, 16, 16, 192, v_dim=128) == "efficient"
    assert _kernel(BF16, 16, 8, 192, v_dim=128, gqa=True) == "math"  # grouped heads: no fused kernel in 2.13
    _, forward = _one_call(BF16, 16, 16, 192, 128, 256, backward=False)
    # out 2 × 16 × 256 × 128 × 2 B = 2,097,152 + lse 2 × 16 × 256 × 4 B = 32,768 + seed and offset 16
    assert forward == 2_129_936
    _, own = _one_call(BF16, 16, 16, 192, 128, 256, backward=False, kernels="own")
    assert own >= forward + 2 * 16 * 256 * 256 * 2  # the CPU's own math path keeps the scores


def test_a_mask_reaches_the_memory_efficient_kernel_as_cuda_passes_it():
    kernel, forward = _one_call(BF16, 4, 4, 192, 128, 40, backward=False, mask=True)
    assert kernel == "efficient"
    # out 2 × 4 × 40 × 128 × 2 = 81,920; lse 2 × 4 × ceil(40 / 32) · 32 × 4 = 2,048; seed, offset 16;
    # the mask as an additive bf16 bias, its 40 keys padded to 48: 40 × 48 × 2 = 3,840
    assert forward == 81_920 + 2_048 + 16 + 3_840


@pytest.mark.parametrize(
    "offset, expected",
    [
        pytest.param(128, "efficient", id="deepseeks-value-split-of-kv"),  # 128 elements × 2 B: aligned
        pytest.param(4, "math", id="storage-offset-not-aligned"),  # 8 B: sm80 wants 16
    ],
)
def test_the_memory_efficient_kernel_wants_aligned_storage(offset, expected):
    q = torch.empty(1, 4, 8, 192, dtype=BF16)
    kv = torch.empty(1, 4, 8, 128 + offset, dtype=BF16)
    v = kv[..., offset:]  # a view, as DeepSeek splits its value heads off the key/value projection
    assert cuda_attention_kernel(q, q, v, is_causal=True) == expected
    assert cuda_attention_kernel(q, q.transpose(-1, -2).contiguous().transpose(-1, -2), v, is_causal=True) == "math"


def test_the_cpu_backend_runs_latent_attention_fused_with_the_same_values():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 96, 48, requires_grad=True), torch.randn(2, 4, 96, 48, requires_grad=True)
    v = torch.randn(2, 4, 96, 32, requires_grad=True)
    with cuda_attention():
        fused = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        fused.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel(SDPBackend.MATH):
        math = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        math.sum().backward()
    assert fused.shape == math.shape == (2, 4, 96, 32)
    torch.testing.assert_close(fused, math)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)
    # v heads 64 wider than q/k heads 48: the queries and keys are the ones padded
    v = torch.randn(2, 4, 96, 64)
    with cuda_attention():
        wide = F.scaled_dot_product_attention(q.detach(), k.detach(), v, is_causal=True)
    torch.testing.assert_close(wide, F.scaled_dot_product_attention(q.detach(), k.detach(), v, is_causal=True))
    cpu = _one_call_cpu(F32, 4, 32)
    assert cpu < _one_call_cpu(F32, 4, 32, kernels="own")  # no scores held


def _one_call_cpu(dtype, heads, v_dim, kernels="cuda"):
    backend = CpuBackend(attention_kernels=kernels)
    q = torch.randn(2, heads, 256, 48, dtype=dtype, requires_grad=True)
    k = torch.randn(2, heads, 256, 48, dtype=dtype, requires_grad=True)
    v = torch.randn(2, heads, 256, v_dim, dtype=dtype, requires_grad=True)
    return backend.measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), register=(q, k, v)).peak_bytes


def test_a_models_latent_attention_is_read_with_both_head_widths(tmp_path):
    from batchfit.models import load_config
    from batchfit.models.attention import attention_head_dims, cuda_attention_of

    lite = load_config(str(_config_dir(tmp_path, "deepseek-v2-lite", DEEPSEEK_V2_LITE)))
    assert lite.head_dim == 64  # transformers' DeepseekV2Config: the rotary part alone
    assert attention_head_dims(lite) == (192, 128)
    assert cuda_attention_of(lite, BF16).to_dict() == {"kernel": "efficient", "note": None}
    assert attention_head_dims(load_config("deepseek-v3")) == (192, 128)


def _mla_peaks(tmp_path, v_dim, lengths):
    from batchfit.models import load_config

    config = load_config(str(_config_dir(tmp_path, f"mla-v{v_dim}", {**TINY_MLA, "v_head_dim": v_dim})))
    backend = EstimateBackend(reserve_bytes=0, round_to=1)
    model = build_causal_lm(config, backend=backend, dtype="bf16", gradient_checkpointing=True)
    step = causal_lm_step(model, backend=backend, logprobs="fused")
    return [step.measure([s]).peak_bytes for s in lengths]


@pytest.mark.slow  # builds and steps a DeepSeek-V2 model three times (seconds); the grid above keeps the first tier
def test_a_latent_attention_model_is_estimated_without_the_scores(tmp_path):
    # sdpa's scores would add 4 heads × s² × 2 B per layer: 2 MiB at 512, 8 MiB at 1,024
    p256, p512, p1024 = _mla_peaks(tmp_path, 32, (256, 512, 1024))
    assert p1024 - p512 == 2 * (p512 - p256)  # linear in s: nothing s × s held


@pytest.mark.slow  # two whole profiles of a 15.7B-parameter MoE (minutes)
def test_deepseek_v2_lite_gets_the_budget_of_its_value_heads_widened(tmp_path, capsys):
    import json

    from batchfit.cli import main

    budgets = {}
    for v_dim in (128, 192):
        directory = _config_dir(tmp_path, f"lite-v{v_dim}", {**DEEPSEEK_V2_LITE, "v_head_dim": v_dim})
        assert main(["profile", "--model", str(directory), "--logprobs", "fused", "--no-progress", "--json"]) == 0
        budgets[v_dim] = json.loads(capsys.readouterr().out)["budgets"]["policy"]["tokens"]
    # CUDA runs its memory-efficient kernel for both (flash wants one width): neither holds the
    # scores; on main the 128-wide value heads took the CPU's math path, 16,384 against 73,728
    assert budgets[128] >= 0.9 * budgets[192]
