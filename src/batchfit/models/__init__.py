"""Causal LMs to measure and train: presets shipped as data, building with real or fake tensors, attention.

- :func:`load_config` / :func:`list_presets`: a preset (``tiny``, ``qwen2.5-0.5b``, ...,
  ``llama-3.1-8b``), a local directory with ``config.json``, a hub id (config only) or a
  ``PretrainedConfig``.
- :func:`build_causal_lm`: a random-weight model (or value-head critic) in a backend's
  context (fake tensors for the estimate backend), sharded as a
  :class:`~batchfit.parallel.Sharding` says.
- :func:`use_varlen_attention`: packed rows attend per sequence without a ``T × T`` mask.
- :func:`use_ulysses_attention`: packed rows split over a sequence-parallel group (Ulysses).
- :class:`LoraSpec`: LoRA adapters (PEFT's ``get_peft_model``) for ``build_causal_lm(lora=...)``.
"""

from batchfit.models.attention import use_varlen_attention
from batchfit.models.build import (
    ATTN_IMPLEMENTATIONS,
    build_causal_lm,
    enable_activation_checkpointing,
    parse_dtype,
)
from batchfit.models.lora import LoraSpec
from batchfit.models.specs import DEFAULT_PRESET, list_presets, load_config, preset_info
from batchfit.models.ulysses import use_ulysses_attention

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DEFAULT_PRESET",
    "LoraSpec",
    "build_causal_lm",
    "enable_activation_checkpointing",
    "list_presets",
    "load_config",
    "parse_dtype",
    "preset_info",
    "use_ulysses_attention",
    "use_varlen_attention",
]
