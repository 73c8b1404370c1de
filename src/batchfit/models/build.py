"""Building causal LMs (and value-head critics) from a spec, with real or fake tensors."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from batchfit.dtypes import parse_dtype
from batchfit.errors import InvalidArgument
from batchfit.memory import Backend, get_backend
from batchfit.models.specs import DEFAULT_PRESET, load_config, quiet_transformers_logs, spec_name
from batchfit.validation import check_choice

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

def resolve_backend(backend: Any) -> Backend | None:
    """``None`` stays ``None`` (plain CPU tensors); a name goes through :func:`get_backend`."""
    if backend is None or isinstance(backend, Backend):
        return backend
    return get_backend(backend)


def build_causal_lm(
    spec: Any = DEFAULT_PRESET,
    *,
    backend: Any = None,
    dtype: Any = torch.float32,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    value_head: bool = False,
    sharding: Any = None,
    **config_overrides: Any,
) -> torch.nn.Module:
    """A randomly initialised causal LM (or value-head critic) in training mode, sharded if asked.

    Args:
        spec: preset name, local directory with ``config.json``, hub id, or a
            ``PretrainedConfig`` (see :func:`batchfit.models.load_config`); default ``"tiny"``.
        backend: a :class:`~batchfit.memory.Backend` or its name; the model is built inside
            ``backend.context()`` on ``backend.device`` (fake tensors for ``"estimate"``,
            which allocate nothing). ``None``: ordinary CPU tensors.
        dtype: dtype the parameters are stored in (``torch.bfloat16`` or ``"bf16"``, ...); with
            ``fsdp2`` mixed precision ``"bf16"`` the compute dtype is bf16 whatever this is
            (pass fp32, the default, for fp32 master parameters as SkyRL and verl run).
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, ``"flash_attention_2"``, ...
        gradient_checkpointing: non-reentrant activation checkpointing of every decoder layer
            (``activation_checkpointing_enable`` in transformers 5.x,
            ``gradient_checkpointing_enable`` before).
        value_head: build a critic instead: the backbone plus ``Linear(hidden, 1)``
            (``AutoModelForTokenClassification`` with ``num_labels=1``, no dropout).
        sharding: a :class:`~batchfit.parallel.sharding.Sharding` (or a strategy name), applied by
            :func:`batchfit.models.shard_model` after building: ``fsdp2`` shards every
            decoder layer and the root, ``ddp`` wraps the model. Needs a process group of
            ``world_size`` ranks (on the estimate backend:
            :func:`batchfit.parallel.distributed.simulated_world`). ``None``: one device.
        **config_overrides: config attributes to override, e.g. ``num_hidden_layers=2``
            (a per-layer list such as ``layer_types`` is cut to the new depth).

    Returns:
        The model, in ``train()`` mode, with ``use_cache=False`` (for ``ddp`` on a real
        backend, its ``DistributedDataParallel`` wrapper).

    Raises:
        InvalidArgument: bad spec, dtype, attention implementation, backend name or
            sharding, or no process group of the sharding's size.

    Example:
        >>> model = build_causal_lm("tiny")
        >>> type(model).__name__, next(model.parameters()).dtype
        ('LlamaForCausalLM', torch.float32)
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from batchfit.parallel.shard import shard_model
    from batchfit.parallel.sharding import as_sharding

    torch_dtype = parse_dtype(dtype)
    check_choice("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    plan = as_sharding(sharding)
    chosen = resolve_backend(backend)
    config = load_config(spec, **config_overrides)
    _cut_layer_lists(config)
    config.use_cache = False
    if value_head:
        config.num_labels = 1
        config.classifier_dropout = 0.0
    factory = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    context = chosen.context() if chosen is not None else contextlib.nullcontext()
    device = chosen.device if chosen is not None else torch.device("cpu")
    with context, torch.device(device) if device.type != "cpu" else contextlib.nullcontext():
        model = _from_config(factory, config, spec, dtype=torch_dtype, attn_implementation=attn_implementation)
        if gradient_checkpointing:
            enable_activation_checkpointing(model)
        model = shard_model(model.train(), plan, fake=getattr(chosen, "fake_mode", None) is not None)
    return model


def _from_config(factory: Any, config: Any, spec: Any, **kwargs: Any) -> torch.nn.Module:
    """``factory.from_config`` with transformers' logs quiet and a config it rejects named.

    Raises:
        InvalidArgument: transformers cannot build a model from the config's values (an unknown
            ``rope_type``, a value of the wrong type, ...).
    """
    try:
        with quiet_transformers_logs():
            return factory.from_config(config, **kwargs)
    except (KeyError, ValueError, TypeError, AttributeError, NotImplementedError) as exc:
        reason = " ".join(str(exc).split())[:300]
        raise InvalidArgument(
            f"spec={spec_name(spec)}: transformers cannot build a model from this config "
            f"({type(exc).__name__}: {reason}); check the values in its config.json"
        ) from exc


def _cut_layer_lists(config: Any) -> None:
    """Cut per-layer lists (``layer_types``) to ``num_hidden_layers`` after a depth override."""
    depth = getattr(config, "num_hidden_layers", None)
    types = getattr(config, "layer_types", None)
    if isinstance(depth, int) and isinstance(types, list) and len(types) > depth:
        config.layer_types = types[:depth]


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing through whichever API transformers offers.

    Raises:
        InvalidArgument: the model supports neither ``activation_checkpointing_enable`` nor
            ``gradient_checkpointing_enable``.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise InvalidArgument(
            f"gradient_checkpointing=True needs a transformers model with activation_checkpointing_enable or gradient_checkpointing_enable, but got a {type(model).__name__}; pass gradient_checkpointing=False"
        )
