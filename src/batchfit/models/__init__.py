"""Causal LMs to measure: presets shipped as data, building with real or fake tensors, step functions.

- :func:`load_config` / :func:`list_presets`: a preset (``tiny``, ``qwen2.5-0.5b``, ...,
  ``llama-3.1-8b``), a local directory with ``config.json``, or a hub id (config only).
- :func:`build_causal_lm`: a random-weight model (or value-head critic) in a backend's
  context: fake tensors for the estimate backend.
- :func:`causal_lm_step`: a :class:`TrainingStep` (policy log-prob loss or critic MSE,
  backward, optimizer step with its state initialised beforehand).
- :func:`shard_model`: PyTorch's FSDP2 (``fully_shard`` per layer and root) or DDP, as a
  :class:`~batchfit.sharding.Sharding` says (``build_causal_lm(sharding=...)`` calls it).
- :func:`build_depth_steps` / :class:`DepthExtrapolatedStep`: a deep model's step measured
  from two shallow copies (NOTE [ Peak memory is affine in depth ]).
"""

from batchfit.models.build import (
    ATTN_IMPLEMENTATIONS,
    build_causal_lm,
    enable_activation_checkpointing,
    parse_dtype,
)
from batchfit.models.depth import DepthExtrapolatedStep, build_depth_steps
from batchfit.models.shard import shard_model
from batchfit.models.specs import DEFAULT_PRESET, list_presets, load_config, preset_info
from batchfit.models.step import (
    OPTIMIZERS,
    TrainingStep,
    causal_lm_step,
    initialize_optimizer_state,
    token_logprobs,
)

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "DEFAULT_PRESET",
    "OPTIMIZERS",
    "DepthExtrapolatedStep",
    "TrainingStep",
    "build_causal_lm",
    "build_depth_steps",
    "causal_lm_step",
    "enable_activation_checkpointing",
    "initialize_optimizer_state",
    "list_presets",
    "load_config",
    "parse_dtype",
    "preset_info",
    "shard_model",
    "token_logprobs",
]
