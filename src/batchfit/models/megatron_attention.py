"""Megatron-core's layer spec with fused attention that runs here: PyTorch's ``scaled_dot_product_attention``.

NOTE [ Fused attention for Megatron budgets ]
A GPU run of Megatron trains with Transformer Engine's ``TEDotProductAttention`` (flash or cuDNN
fused attention: it keeps the output and a float32 log-sum-exp per query and head for the
backward, O(s) per head). Transformer Engine does not run on a CPU, and Megatron-core's local
layer spec (``get_gpt_layer_local_spec``) uses ``DotProductAttention``, the unfused math path: it
keeps ``[b, a/t, s, s]`` scores and their fp32 softmax for the backward, 148.7 GiB for one
sequence of 8,192 tokens of qwen2.5-0.5b at TP 1 (docs/megatron.md), so a budget probed on it is
a budget of a run nobody makes. :class:`SdpaAttention` is the local spec's core attention
replaced by PyTorch's own fused kernel, called as Transformer Engine is (``[s, b, h, d]`` in,
``[s, b, h·d]`` out, grouped key/value heads without repeating them, the causal mask as a flag):
on the estimate backend ``scaled_dot_product_attention`` runs the kernel CUDA would choose
(NOTE [ The estimate runs CUDA's attention kernel ] in :mod:`batchfit.memory.cuda_attention`:
flash for bf16 heads up to 256), which keeps what Transformer Engine's flash backend keeps; on
real CPU ranks the CPU's flash kernel, which keeps the same. Everything else in the layer is
Megatron-core's own module. Differences from Transformer Engine, each on the safe side: with more
than one row per micro-batch the output is copied from the kernel's ``[b, s, h, d]`` layout to
Megatron's ``[s, b, h·d]`` (one extra ``[s, b, h/t·d]`` per layer, saved by the output
projection; none for one row, the packed micro-batch every framework runs).

``attention="local"`` keeps Megatron's unfused path (the referees of Korthikanti et al.'s table
measure it: the table counts its scores).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from batchfit.errors import InvalidArgument

#: What :func:`layer_spec` builds a layer's core attention with.
ATTENTIONS = ("sdpa", "local")


def layer_spec(config: Any, attention: str = "sdpa", vp_stage: int | None = None) -> Any:
    """Megatron-core's local GPT layer spec for ``config`` with ``attention``'s core attention.

    A model whose layers differ (dense first layers: ``moe_layer_freq`` not 1) or with multi-latent
    attention gets Megatron's decoder block spec of the same local specs instead, this pipeline stage's
    layers (model chunk ``vp_stage``'s with virtual stages: :func:`batchfit.models.megatron_mla.decoder_block_spec`).

    Args:
        config: the model's ``TransformerConfig`` (its ``qk_layernorm``, ``normalization``, ``num_moe_experts``,
            ``moe_layer_freq`` and ``multi_latent_attention``).
        attention: ``"sdpa"`` (:class:`SdpaAttention`: NOTE [ Fused attention for Megatron
            budgets ]) or ``"local"`` (Megatron's unfused ``DotProductAttention``).
        vp_stage: the model chunk a block spec is for (``None`` without virtual stages).

    Raises:
        InvalidArgument: another ``attention``, or ``"local"`` with multi-latent attention (megatron-core
            0.16.1's ``DotProductAttention`` takes no separate key and value head sizes).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if attention not in ATTENTIONS:
        raise InvalidArgument(f"attention must be one of {', '.join(ATTENTIONS)}, but got attention={attention!r}; use 'sdpa'")
    mla = bool(getattr(config, "multi_latent_attention", False))
    if mla and attention == "local":
        raise InvalidArgument(
            "attention='local' cannot run multi-latent attention (megatron-core 0.16.1's DotProductAttention takes no "
            "k_channels/v_channels, which MLASelfAttention passes); use attention='sdpa'"
        )
    if mla or getattr(config, "moe_layer_freq", 1) != 1:
        from batchfit.models.megatron_mla import decoder_block_spec

        return decoder_block_spec(config, lambda spec: _with_core_attention(spec, attention), vp_stage=vp_stage)
    # a mixture of experts: Megatron's MoELayer with SequentialMLP experts (NOTE [ Megatron's mixture of experts on CPU ranks ])
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm, normalization=config.normalization
    )
    return _with_core_attention(spec, attention)


def _with_core_attention(spec: Any, attention: str) -> Any:
    """``spec`` (a layer's ``ModuleSpec``) with ``attention``'s core attention, a copy when it changes."""
    if attention != "sdpa":
        return spec
    spec = copy.deepcopy(spec)  # the block spec shares one spec between its layers
    spec.submodules.self_attention.submodules.core_attention = __getattr__("SdpaAttention")
    return spec


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import divide

    class SdpaAttention(MegatronModule):
        """Megatron's core attention as PyTorch's ``scaled_dot_product_attention`` (NOTE [ Fused attention for Megatron budgets ]).

        Takes what ``DotProductAttention`` takes (``[s, b, heads, d]`` query, ``[s, b, groups, d]``
        key and value; multi-latent attention's values of their own width ``k_channels``/``v_channels``) and
        returns ``[s, b, heads/t · d_v]``. Causal masks only, no packed rows, no
        attention bias; under context parallelism the ring of Transformer Engine's ``p2p`` exchange
        (:func:`batchfit.models.megatron_context.ring_attention`), without dropout.
        """

        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
            k_channels: int | None = None,
            v_channels: int | None = None,
        ):
            super().__init__(config=config)
            self.context_parallel = config.context_parallel_size
            if self.context_parallel != 1 and (cp_comm_type or "p2p") != "p2p":
                raise InvalidArgument(
                    f"cp_comm_type={cp_comm_type!r} is not modelled (the ring of Transformer Engine's default exchange is: "
                    "NOTE [ Context parallelism as Megatron runs it ]); use cp_comm_type='p2p' or leave it unset"
                )
            if attn_mask_type != AttnMaskType.causal:
                raise InvalidArgument(
                    f"SdpaAttention runs causal attention only, but the layer asks for {attn_mask_type}; use attention='local'"
                )
            from megatron.core import parallel_state

            tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
            # multi-latent attention passes its query/key and value head sizes (MLASelfAttention: k_channels, v_channels)
            head = config.kv_channels if k_channels is None else k_channels
            value_head = head if v_channels is None else v_channels
            self.hidden_size_per_partition = divide(value_head * config.num_attention_heads, tp)
            if self.context_parallel != 1 and value_head != head:
                raise InvalidArgument(
                    f"context_parallel_size={self.context_parallel} with multi-latent attention (query/key heads of {head}, "
                    f"value heads of {value_head}) is not modelled: the ring (batchfit.models.megatron_context) exchanges key "
                    "and value as one buffer of one head size; use context_parallel=1 (--context-parallel 1)"
                )
            self.softmax_scale = softmax_scale if softmax_scale is not None else head**-0.5
            if config.apply_query_key_layer_scaling:
                self.softmax_scale /= max(1, layer_number)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            if self.context_parallel != 1 and self.dropout:
                raise InvalidArgument(
                    f"attention_dropout={self.dropout} under context_parallel_size={self.context_parallel} is not modelled "
                    "(the ring runs without dropout inside attention); use attention_dropout=0"
                )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: Any = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is not None or attention_bias is not None:
                raise InvalidArgument(
                    "SdpaAttention takes no packed rows and no attention bias (Transformer Engine's); use padded rows"
                )
            s, b = query.shape[0], query.shape[1]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d], views
            if self.context_parallel != 1:
                from megatron.core import parallel_state

                from batchfit.models.megatron_context import ring_attention

                group = parallel_state.get_context_parallel_group()
                out = ring_attention(q, k, v, scale=self.softmax_scale, group=group)
                return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=self.dropout if self.training else 0.0,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SdpaAttention


def __getattr__(name: str) -> Any:
    # megatron-core is an extra: the class is made on first use
    if name == "SdpaAttention":
        cls = _sdpa_attention_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["ATTENTIONS", "layer_spec"]  # and SdpaAttention, made on first use
