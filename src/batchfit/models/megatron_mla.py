"""DeepSeek-V3 under megatron-core: multi-latent attention, dense first layers, Megatron's decoder block spec, on CPU ranks.

- :func:`deepseek_v3_bridge`: mbridge's ``DeepseekV3Bridge`` for a transformers 5 config and megatron-core 0.16.1.
- :data:`DEEPSEEK_V3_SETTINGS`: what batchfit sets over that bridge's config (NOTE [ DeepSeek-V3 from a Hugging Face config ]).
- :func:`decoder_block_spec`: Megatron's ``get_gpt_decoder_block_spec`` built from its local specs, each layer's core
  attention as the caller asks (:func:`batchfit.models.megatron_attention.layer_spec`).

NOTE [ DeepSeek-V3 from a Hugging Face config ]
mbridge 0.15.1's ``DeepseekV3Bridge._build_config`` (``mbridge/models/deepseek_v3.py``, what verl and slime's
converters call) makes an ``MLATransformerConfig``: the query and key/value low-rank projections
(``q_lora_rank``, ``kv_lora_rank``), heads of ``qk_head_dim`` = ``qk_nope_head_dim`` plus a rotary part of
``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, values of ``v_head_dim``, the two low-rank RMSNorms
(``qk_layernorm=True``: MLA's ``q_layernorm`` and ``kv_layernorm``), YaRN RoPE from ``rope_scaling``
(``rope_type``, ``rotary_scaling_factor``, ``mscale``, ``mscale_all_dim``, ``beta_fast``, ``beta_slow``, the
original context), dense first layers (``moe_layer_freq``: 0 for the ``first_k_dense_replace`` first layers,
1 after; a dense layer's MLP has ``intermediate_size``), one shared expert of ``moe_intermediate_size ×
n_shared_experts``, and the sigmoid router with a float32 expert bias (``moe_router_score_function="sigmoid"``,
``moe_router_enable_expert_bias``, ``moe_router_topk_scaling_factor`` = ``routed_scaling_factor``, router
logits in float32: ``moe_router_dtype="fp32"``), no auxiliary loss ("default None for RL"). Megatron-core's
local layer spec with ``multi_latent_attention=True`` holds the same parameters as Transformer Engine's
(``MLASelfAttention``: ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``kv_layernorm``, ``linear_kv_up_proj``, ``linear_proj``); Megatron's decoder block spec
(``get_gpt_decoder_block_spec(config, use_transformer_engine=False)``) gives each layer the dense or the MoE
local spec by ``moe_layer_freq``, sliced to this pipeline stage's layers.

That bridge does not run as released against transformers 5 and megatron-core 0.16.1, in two places, and
:func:`deepseek_v3_bridge` gives it what it expects: it reads ``hf_config.rope_theta`` and tests
``"rope_scaling" in hf_config`` (transformers 5 keeps both in ``rope_parameters``, and its configs answer
``in`` with ``False``: the bridge fell back to plain RoPE), so the bridge reads a view of the config with
transformers 4's two names; and it passes ``max_position_embeddings`` (YaRN's original context) to
``MLATransformerConfig``, which 0.16.1 names ``original_max_position_embeddings``: renamed on the way in.
Over its config batchfit sets (:data:`DEEPSEEK_V3_SETTINGS`) what Megatron-Bridge
(``megatron/bridge/models/deepseek/common.py``, NVIDIA-NeMo/Megatron-Bridge 86533129) and slime's
``scripts/models/deepseek-v3.sh`` (THUDM/slime 624b824a) set and mbridge leaves out: the group-limited top-k
(``moe_router_num_groups`` = ``n_group``, ``moe_router_group_topk`` = ``topk_group``); and what a CPU run needs:
no multi-token prediction (``mtp_num_layers=None``: batchfit's presets leave the MTP layer out, as transformers
builds none), the shared expert run in line (``moe_shared_expert_overlap=False``: mbridge overlaps it with the
dispatch on a second CUDA stream; the same tensors, the shared expert's output held a little longer there),
the unfused RoPE (``apply_rope_fusion=False``, slime's ``--no-rope-fusion``), the attention backend left to the
layer spec (``attention_backend`` auto: Transformer Engine's fused attention is mbridge's choice, the spec's
core attention stands in for it, NOTE [ Fused attention for Megatron budgets ]; mbridge's ``fused`` also sets
``NVTE_FLASH_ATTN=0`` and ``NVTE_FUSED_ATTN=1`` in the process environment, which every later config of the
default backend refuses), and the fusions
:data:`batchfit.models.moe_megatron.MOE_CPU_SETTINGS` turns off. The routing is then fixed as for every
Megatron MoE (NOTE [ Megatron's mixture of experts on CPU ranks ]): the fixed top-k replaces the group-limited
choice, the sigmoid scores, the expert bias and the scaling run as Megatron runs them.

NOTE [ Shallow copies of DeepSeek-V3 ]
mbridge's ``moe_layer_freq`` is a list of the model's depth (Megatron's block spec asserts its length), so a copy of
another depth (``num_layers`` given: the depth extrapolation's shallow copies, NOTE [ Megatron stages are affine in
their depth ]) needs its own. The extrapolation gives it: its copies keep the dense first layers on their first
stage, beside that stage's MoE layers (NOTE [ Dense first layers in the shallow copies ] in
:mod:`batchfit.budget.megatron_depth`), and a given ``moe_layer_freq`` is used as given. A copy of another depth
built without one makes every layer a MoE (``moe_layer_freq=1``); the extrapolation builds those where it cannot keep
the dense layers (virtual pipeline stages, or dense layers that fill the first stage), and the first stage is then
counted with MoE layers in place of its dense ones, on the safe side (a MoE layer's expert shards, its shared expert
and the tokens it receives hold more than one dense MLP of ``intermediate_size`` split over TP).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from batchfit.patching import SharedChange

#: the model types this module maps (the Hugging Face ``model_type``)
MLA_MODEL_TYPES = frozenset({"deepseek_v3"})

#: What batchfit sets over mbridge's DeepSeek-V3 config (NOTE [ DeepSeek-V3 from a Hugging Face config ]); the
#: group-limited top-k comes from the config (:func:`deepseek_v3_settings`).
DEEPSEEK_V3_SETTINGS: dict[str, Any] = {
    "mtp_num_layers": None,  # no multi-token prediction: the presets leave the MTP layer out
    "moe_shared_expert_overlap": False,  # mbridge overlaps it on a second CUDA stream
    "apply_rope_fusion": False,  # slime's --no-rope-fusion; the fused kernel is CUDA's
    # mbridge's "fused" sets Transformer Engine's NVTE_* variables in the process (TransformerConfig.__post_init__),
    # and every later config of the default backend ("auto") then fails its check of them; the layer spec decides here
    "attention_backend": "auto",
}


def deepseek_v3_settings(hf_config: Any, num_layers: int | None = None) -> dict[str, Any]:
    """:data:`DEEPSEEK_V3_SETTINGS` with the group-limited top-k of ``hf_config`` (``n_group``, ``topk_group``; none if
    unset); for a copy of another depth than the model's (``num_layers``) every layer a MoE (NOTE [ Shallow copies of
    DeepSeek-V3 ])."""
    groups, group_topk = getattr(hf_config, "n_group", None), getattr(hf_config, "topk_group", None)
    routed = {"moe_router_num_groups": groups, "moe_router_group_topk": group_topk} if groups and group_topk else {}
    depth = {} if num_layers is None or int(num_layers) == int(hf_config.num_hidden_layers) else {"moe_layer_freq": 1}
    return {**DEEPSEEK_V3_SETTINGS, **routed, **depth}


class _Transformers4View:
    """A transformers config read through transformers 4's ``rope_theta`` and ``rope_scaling`` (NOTE [ DeepSeek-V3 from a Hugging Face config ]).

    Every other attribute is the config's own; ``name in view`` is ``hasattr``.
    """

    def __init__(self, hf_config: Any):
        rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(hf_config, "rope_theta", 10000))
        kind = rope.pop("rope_type", None)
        rope.setdefault("type", kind or "default")
        self._config = hf_config
        self.rope_theta = theta
        # mbridge reads rope_scaling only when it is YaRN's (its "factor", "mscale", ...); plain RoPE has none
        self.rope_scaling = rope if rope["type"] == "yarn" else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)

    def __contains__(self, name: str) -> bool:
        return hasattr(self, name)


def _mla_config_class() -> Any:
    from megatron.core.transformer import MLATransformerConfig

    def make(**fields: Any) -> Any:
        # mbridge 0.15.1 names YaRN's original context max_position_embeddings; megatron-core 0.16.1 renamed it
        if "max_position_embeddings" in fields:
            fields["original_max_position_embeddings"] = fields.pop("max_position_embeddings")
        if fields.get("rope_type") == "default":
            fields["rope_type"] = "rope"
        return MLATransformerConfig(**fields)

    return make


def deepseek_v3_bridge(hf_config: Any, **kwargs: Any) -> Any:
    """mbridge's ``DeepseekV3Bridge`` for ``hf_config`` (transformers 5) making megatron-core 0.16.1's ``MLATransformerConfig``.

    ``kwargs`` are the bridge's own (``dtype``, ``parallel_states``); ``set_extra_args`` and ``config`` work as
    on any mbridge bridge (NOTE [ DeepSeek-V3 from a Hugging Face config ]).
    """
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    class _DeepseekV3Bridge(DeepseekV3Bridge):
        TransformerConfigClass = staticmethod(_mla_config_class())

    return _DeepseekV3Bridge(_Transformers4View(hf_config), **kwargs)


def _mla_module() -> Any:
    from megatron.core.transformer import multi_latent_attention

    return multi_latent_attention


class _NoTransformerEngineFlagged(SharedChange):
    """``multi_latent_attention.HAVE_TE`` ``False`` while active where Transformer Engine is missing (NOTE [ DeepSeek-V3 on CPU ranks ])."""

    def __init__(self) -> None:
        super().__init__()
        self._saved: bool | None = None

    def _install(self) -> None:
        module = _mla_module()
        if module.HAVE_TE and not isinstance(module.TELinear, type):  # placeholders: the import found no TE
            self._saved, module.HAVE_TE = module.HAVE_TE, False

    def _uninstall(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            _mla_module().HAVE_TE = saved


_NO_TRANSFORMER_ENGINE = _NoTransformerEngineFlagged()


@contextlib.contextmanager
def mla_cpu_patches() -> Iterator[None]:
    """Megatron-core's multi-latent attention builds without Transformer Engine inside (NOTE [ DeepSeek-V3 on CPU ranks ])."""
    with _NO_TRANSFORMER_ENGINE.active():
        yield


def decoder_block_spec(config: Any, layer_spec_of: Any, vp_stage: int | None = None) -> Any:
    """Megatron's decoder block spec for ``config`` from local specs, each layer's spec passed through ``layer_spec_of``.

    ``get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=...)`` gives the dense
    layers megatron-core's local spec without experts and the MoE layers the one with them (``moe_layer_freq``),
    this pipeline stage's (and model chunk's) layers only; ``layer_spec_of(spec)`` returns the spec a layer is
    built with (the core attention replaced: :func:`batchfit.models.megatron_attention.with_core_attention`).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization, vp_stage=vp_stage)
    block.layer_specs = [layer_spec_of(spec) for spec in block.layer_specs]
    return block


__all__ = ["DEEPSEEK_V3_SETTINGS", "MLA_MODEL_TYPES", "decoder_block_spec", "deepseek_v3_bridge", "deepseek_v3_settings", "mla_cpu_patches"]
