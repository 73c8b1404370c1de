"""GLM-4.5 (``glm4_moe``) under megatron-core: mbridge's ``GLM4MoEBridge`` made to run on CPU ranks.

- :data:`GLM_MODEL_TYPES`: the model types this module maps.
- :func:`glm4_moe_settings`: what batchfit sets over that bridge's config (NOTE [ GLM-4.5 from a Hugging Face config ]).
- :func:`rotary_percent`: Megatron's ``rotary_percent`` of a transformers config (its partial rotary factor).

NOTE [ GLM-4.5 from a Hugging Face config ]
mbridge 0.15.1's ``GLM4MoEBridge._build_config`` (``mbridge/models/glm4moe.py``, what verl's converter calls) runs
as released on a transformers 5 config (it reads ``first_k_dense_replace``, ``num_hidden_layers``,
``moe_intermediate_size``, ``routed_scaling_factor``, ``num_experts_per_tok``, ``n_routed_experts`` and
``use_qk_norm``, all still there) and makes: dense first layers (``moe_layer_freq``: 0 for the
``first_k_dense_replace`` first layers, 1 after, a list of the model's depth, as DeepSeek-V3's; a dense layer's MLP
has ``intermediate_size``), routed experts of ``moe_intermediate_size``, a shared expert of
``moe_intermediate_size`` (``moe_shared_expert_intermediate_size``), the sigmoid router with a float32 expert bias
(``moe_router_score_function="sigmoid"``, ``moe_router_enable_expert_bias``: HF's ``e_score_correction_bias``, not
updated, ``moe_router_bias_update_rate=0``; ``moe_router_topk_scaling_factor`` = ``routed_scaling_factor``, logits
in float32), the q/k RMSNorm when ``use_qk_norm`` (``qk_layernorm``), the qkv bias (``add_qkv_bias=True``: GLM-4.5's
``attention_bias``, the output projection without one) and no other linear bias. Its ``seq_aux_loss`` balancing is
kept: with megatron-core's default ``moe_aux_loss_coeff`` 0 the router computes no loss (``_apply_seq_aux_loss``
returns at once), as the "none" of mbridge's other bridges.

Over it batchfit sets (:func:`glm4_moe_settings`) the shared expert of ``n_shared_experts × moe_intermediate_size``
(mbridge's ignores the count, 1 in every GLM-4.5 release: the same width), the shared expert run in line
(``moe_shared_expert_overlap=False``: mbridge overlaps it with the dispatch on a second CUDA stream, as for
DeepSeek-V3), the unfused RoPE (``apply_rope_fusion=False``: the fused kernel is CUDA's), no multi-token prediction
(``mtp_num_layers=None``: the presets leave GLM-4.5's ``num_nextn_predict_layers`` layer out, as transformers builds
none), and the fusions :data:`batchfit.models.moe_megatron.MOE_CPU_SETTINGS` turns off (Apex's persistent norm,
the ``torch.compile``'d bias fusions, the grouped GEMM: ``SequentialMLP``). The q/k norm and the qkv bias need no
Transformer Engine: megatron-core's local spec builds them (``get_gpt_layer_local_spec(qk_layernorm=...)``, the
``ColumnParallelLinear`` qkv with its bias), the dense first layers through Megatron's decoder block spec of those
local specs (:func:`batchfit.models.megatron_mla.decoder_block_spec`). The partial rotary embedding (GLM-4.5's
``partial_rotary_factor`` 0.5, in transformers 5's ``rope_parameters``) is ``GPTModel``'s ``rotary_percent``, which
mbridge's ``_get_gptmodel_args`` reads from ``hf_config.partial_rotary_factor`` (gone in transformers 5) and batchfit
does not call (:func:`batchfit.models.megatron.gpt_model_args` reads :func:`rotary_percent`). The routing is then
fixed as for every Megatron MoE (NOTE [ Megatron's mixture of experts on CPU ranks ]): the sigmoid scores, the expert
bias and the scaling run as Megatron runs them.

A copy of another depth (the depth extrapolation's shallow copies) needs a ``moe_layer_freq`` of its own length, as
DeepSeek-V3's (NOTE [ Shallow copies of DeepSeek-V3 ]): the extrapolation gives one that keeps the dense first layer on
the first stage (NOTE [ Dense first layers in the shallow copies ] in :mod:`batchfit.budget.megatron_depth`); a copy
built without one has every layer a MoE.
"""

from __future__ import annotations

from typing import Any

#: the model types this module maps (the Hugging Face ``model_type``)
GLM_MODEL_TYPES = frozenset({"glm4_moe"})

#: What batchfit sets over mbridge's GLM-4.5 config (NOTE [ GLM-4.5 from a Hugging Face config ]); the shared expert's
#: width comes from the config (:func:`glm4_moe_settings`).
GLM4_MOE_SETTINGS: dict[str, Any] = {
    "moe_shared_expert_overlap": False,  # mbridge overlaps it on a second CUDA stream
    "apply_rope_fusion": False,  # the fused kernel is CUDA's
    "mtp_num_layers": None,  # no multi-token prediction: the presets leave the MTP layer out
}


def glm4_moe_settings(hf_config: Any, num_layers: int | None = None) -> dict[str, Any]:
    """:data:`GLM4_MOE_SETTINGS` with the shared expert of ``n_shared_experts × moe_intermediate_size`` (none if
    ``n_shared_experts`` is 0); for a copy of another depth than the model's (``num_layers``) every layer a MoE, unless the caller gives its ``moe_layer_freq``
    (NOTE [ GLM-4.5 from a Hugging Face config ])."""
    shared = int(getattr(hf_config, "n_shared_experts", 1) or 0) * int(hf_config.moe_intermediate_size)
    depth = {} if num_layers is None or int(num_layers) == int(hf_config.num_hidden_layers) else {"moe_layer_freq": 1}
    return {**GLM4_MOE_SETTINGS, "moe_shared_expert_intermediate_size": shared or None, **depth}


def rotary_percent(hf_config: Any) -> float:
    """The share of each head that RoPE rotates: transformers 5's ``rope_parameters["partial_rotary_factor"]`` (or 4.x's
    ``partial_rotary_factor``), 1.0 when unset (Megatron's ``rotary_percent``)."""
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    factor = rope.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    return 1.0 if factor is None else float(factor)


__all__ = ["GLM4_MOE_SETTINGS", "GLM_MODEL_TYPES", "glm4_moe_settings", "rotary_percent"]
