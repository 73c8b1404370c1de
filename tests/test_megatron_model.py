"""batchfit.models.megatron: Megatron-core's GPTModel from every preset's Hugging Face config (second tier).

The referee is transformers' own model of the same config, built on the meta device: Megatron's
model (TP = 1, PP = 1, on meta) must hold exactly as many parameters (NOTE [ Megatron from a
Hugging Face config ]). Each test runs on gloo ranks of its own (Megatron's parallel state is
process-wide); skipped where megatron-core or mbridge is not installed (``pip install -e '.[megatron]'``).
"""

from __future__ import annotations

import pytest

from batchfit import InvalidArgument
from multirank import run_ranks

pytestmark = pytest.mark.slow

#: The presets that are a mixture of experts not mapped to Megatron (refused by name: NOTE [ gpt-oss under Megatron ]).
MOE_PRESETS = {"gpt-oss-20b"}
#: The mixtures of experts mapped (batchfit.models.megatron.MOE_MODEL_TYPES): transformers' count too.
MAPPED_MOE_PRESETS = {"qwen3-235b-a22b", "qwen3-30b-a3b", "deepseek-v3", "glm-4.5-air"}


def _count_every_preset(rank: int) -> dict[str, object]:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM

    from batchfit.models import list_presets, load_config
    from batchfit.models.megatron import build_gpt_model, model_parallel

    warnings.filterwarnings("ignore")
    counts: dict[str, object] = {}
    with model_parallel(1, 1):
        for name in list_presets():
            try:
                with torch.device("meta"):
                    model = build_gpt_model(name, initialise=False)
            except InvalidArgument as exc:
                counts[name] = str(exc)
                continue
            with torch.device("meta"):
                reference = AutoModelForCausalLM.from_config(load_config(name))
            counts[name] = (
                sum(p.numel() for p in model.parameters()),
                sum(p.numel() for p in reference.parameters()),  # a tied embedding counts once
            )
    return counts


def test_every_dense_preset_has_transformers_parameter_count(megatron):
    counts = run_ranks(_count_every_preset, world=1, timeout=240)[0]
    dense = {name: c for name, c in counts.items() if name not in MOE_PRESETS | MAPPED_MOE_PRESETS}
    assert len(dense) == 12, sorted(dense)
    mismatched = {name: c for name, c in dense.items() if not (isinstance(c, tuple) and c[0] == c[1])}
    assert not mismatched, mismatched
    # literal anchors: the presets' own descriptions (Qwen2.5-0.5B 494M with its tied embedding, Llama-3.1-8B 8.03B)
    assert dense["qwen2.5-0.5b"][0] == 494_032_768
    assert dense["llama-3.1-8b"][0] == 8_030_261_248
    for name in MOE_PRESETS:
        assert "mixture of experts" in counts[name], (name, counts[name])
    for name in MAPPED_MOE_PRESETS:  # Megatron's MoELayer (router, SequentialMLP experts) holds transformers' parameters
        assert isinstance(counts[name], tuple) and counts[name][0] == counts[name][1], (name, counts[name])
    assert counts["qwen3-30b-a3b"][0] == 30_532_122_624
    assert counts["deepseek-v3"][0] == 671_026_404_352  # multi-latent attention, 3 dense layers, no MTP layer


def _tied_and_biased(rank: int) -> dict[str, object]:
    import warnings

    import torch

    from batchfit.models.megatron import build_gpt_model, gpt_model_args, model_parallel

    warnings.filterwarnings("ignore")
    with model_parallel(1, 1), torch.device("meta"):
        qwen2 = build_gpt_model("qwen2.5-0.5b", initialise=False)
        qwen3 = build_gpt_model("qwen3-0.6b", initialise=False)
        llama = build_gpt_model("llama-3.1-8b", initialise=False)
    names = {key: {n for n, _ in m.named_parameters()} for key, m in (("qwen2", qwen2), ("qwen3", qwen3), ("llama", llama))}
    return {
        "qwen2_output_layer": any(n.startswith("output_layer") for n in names["qwen2"]),
        "llama_output_layer": any(n.startswith("output_layer") for n in names["llama"]),
        "qwen2_qkv_bias": "decoder.layers.0.self_attention.linear_qkv.bias" in names["qwen2"],
        "llama_qkv_bias": "decoder.layers.0.self_attention.linear_qkv.bias" in names["llama"],
        "qwen3_q_norm": "decoder.layers.0.self_attention.q_layernorm.weight" in names["qwen3"],
        "llama_rope": {k: v for k, v in gpt_model_args("llama-3.1-8b").items() if k.startswith("ro")},
    }


def test_tied_embeddings_qkv_bias_qk_norm_and_rope_follow_the_config(megatron):
    got = run_ranks(_tied_and_biased, world=1, timeout=120)[0]
    assert got["qwen2_output_layer"] is False  # tie_word_embeddings: the head is the embedding
    assert got["llama_output_layer"] is True
    assert (got["qwen2_qkv_bias"], got["llama_qkv_bias"]) == (True, False)  # Qwen2's qkv bias
    assert got["qwen3_q_norm"] is True  # Qwen3's q/k RMSNorm
    assert got["llama_rope"] == {"rotary_base": 500000.0, "rope_scaling": True, "rope_scaling_factor": 8.0}


def test_refusals_name_the_fix(megatron):
    from batchfit.models.megatron import transformer_config

    with pytest.raises(InvalidArgument, match="sequence_parallel=True needs tensor_parallel > 1"):
        transformer_config("tiny", sequence_parallel=True)
    with pytest.raises(InvalidArgument, match="model_type='gpt_oss' is a mixture of experts not mapped to Megatron: its attention sinks"):
        transformer_config("gpt-oss-20b")


def test_the_cpu_patches_are_undone_on_exit(megatron):
    import torch
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.utils import GlobalMemoryBuffer

    from batchfit.models.megatron import megatron_cpu_patches

    def state():
        return (
            GlobalMemoryBuffer.__dict__["get_tensor"],
            CudaRNGStatesTracker.__dict__["fork"],
            WrappedTorchNorm.__dict__["__new__"],
            torch.cuda.current_device,
            torch.cuda.synchronize,
        )

    before = state()
    with megatron_cpu_patches(), megatron_cpu_patches():  # nested users share one installation
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.empty(1, device="cuda").device.type == "cpu"  # the function mode
        inside = state()
    assert all(a is not b for a, b in zip(before, inside))
    assert all(a is b for a, b in zip(before, state()))
