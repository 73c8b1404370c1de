"""Ulysses attention for a Hugging Face causal LM whose packed rows are split over a sequence-parallel group.

:func:`use_ulysses_attention` checks that the model's attention can be split (refusing what
cannot, NOTE [ What Ulysses cannot split ]), registers :func:`ulysses_attention` with
transformers' attention interface under :data:`ULYSSES` (as :func:`use_varlen_attention`
registers batchfit's varlen attention) and marks the model with its group, so that
:func:`batchfit.train.model_logprobs` splits each packed micro-batch over the group
(:func:`batchfit.parallel.sequence_split.split_packed`) and gathers the log-probs back.
Inside attention, an all-to-all gives each rank ``heads / sp`` heads of every token of the row,
which attend within each packed sequence (:func:`batchfit.models.attention.attend_within_sequences`),
and the reverse all-to-all gives the rank back its tokens (NOTE [ Ulysses sequence parallelism ]
in :mod:`batchfit.parallel.sequence`).

NOTE [ What Ulysses cannot split ]
The all-to-all splits heads, and every layer must attend over the whole row:
- ``num_attention_heads`` must be divisible by ``sp`` (verl ``validate_ulysses_config``);
- ``num_key_value_heads`` must be divisible by ``sp``, or ``sp`` by it: then each key/value head is
  repeated ``sp / kv_heads`` times before the all-to-all, as verl's
  ``_ulysses_flash_attention_forward`` (``verl/models/transformers/monkey_patch.py``) does
  (``repeats = max(sp // kv_heads, 1)``); verl fails later on other counts (3 kv heads at
  sp = 4), batchfit refuses at once. The repeated heads are real tensors, counted in the budget;
- every layer must be full attention: a sliding-window layer (``layer_types`` ``sliding_attention``
  or ``sliding_window`` with ``use_sliding_window``) would need the window across ranks, a
  linear-attention or state-space layer (Qwen3-Next, hybrids) has no heads to scatter;
- every decoder layer must call transformers' attention interface: a model whose attention does
  not would run each rank's tokens alone (verl #7476: Ulysses silently a no-op). The model is
  checked after each forward: :func:`ulysses_attention` counts its calls and a forward hook
  refuses a forward in which not every layer called it.
Each refusal is one line naming the layer (or the head count) and the rule.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from batchfit.errors import InvalidArgument
from batchfit.models.attention import (
    ULYSSES,
    attend_within_sequences,
    register_packed_attention,
    sequence_bounds,
)
from batchfit.parallel.sequence import group_size, heads_to_seq, seq_to_heads

__all__ = ["ULYSSES", "check_ulysses", "sequence_group", "ulysses_attention", "use_ulysses_attention"]

#: The attribute the model and its attention layers carry: the sequence-parallel group.
GROUP_ATTR = "batchfit_sequence_group"



def _attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """transformers' attention modules: those with a layer index, a head size and a causal flag."""
    return [m for m in model.modules() if all(hasattr(m, a) for a in ("layer_idx", "head_dim", "is_causal"))]


def check_ulysses(config: Any, size: int, *, model_name: str = "the model") -> None:
    """Refuse a model whose attention Ulysses cannot split over ``size`` ranks (NOTE [ What Ulysses cannot split ]).

    Args:
        config: the model's transformers config (``num_attention_heads``,
            ``num_key_value_heads``, ``layer_types``, ``sliding_window``).
        size: the sequence-parallel size ``sp``.
        model_name: the model's name in messages.

    Raises:
        InvalidArgument: one line naming the layer or head count and the rule broken.
    """
    text = getattr(config, "get_text_config", lambda: config)()
    if size > 1:
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        if heads % size:
            raise InvalidArgument(
                f"sequence_parallel={size} cannot split {model_name}'s attention: num_attention_heads={heads} is not "
                f"divisible by {size} (Ulysses gives each rank heads/sp query heads); use a divisor of {heads}"
            )
        if kv % size and size % kv:
            raise InvalidArgument(
                f"sequence_parallel={size} cannot split {model_name}'s attention: num_key_value_heads={kv} is neither "
                f"divisible by {size} nor divides it (Ulysses scatters kv heads, repeating them when fewer than sp); "
                f"use a divisor or a multiple of {kv}"
            )
    for index, kind in enumerate(getattr(text, "layer_types", None) or ()):
        if kind != "full_attention":
            raise InvalidArgument(
                f"sequence parallelism cannot split layer {index} of {model_name}: layer_types[{index}]={kind!r}, "
                "and Ulysses splits only full attention (a sliding window or a linear/state-space layer would need "
                "tokens of other ranks); use sequence_parallel=1 for this model"
            )
    window = getattr(text, "sliding_window", None)
    if getattr(text, "layer_types", None) is None and window is not None and getattr(text, "use_sliding_window", True):
        raise InvalidArgument(
            f"sequence parallelism cannot split {model_name}'s attention: sliding_window={window} on every layer, "
            "and Ulysses splits only full attention; use sequence_parallel=1 for this model"
        )


def sequence_group(model: torch.nn.Module) -> Any:
    """The sequence-parallel group :func:`use_ulysses_attention` gave ``model`` (its inner model too); ``None`` if none."""
    return getattr(model, GROUP_ATTR, None)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Ulysses attention; transformers' attention-function signature (NOTE [ Ulysses sequence parallelism ]).

    ``query`` is this rank's ``[1, heads, T/sp, dim]`` (key and value ``kv_heads``); the row's
    boundaries come from ``cu_seq_lens_q`` (the whole row's, as
    :func:`~batchfit.parallel.sequence_split.split_packed` leaves it) or, without it, from the
    whole row's ``position_ids`` gathered over the group. Returns ``([1, T/sp, heads, dim], None)``.

    Raises:
        InvalidArgument: the module was not prepared by :func:`use_ulysses_attention`, the call
            has an attention mask or several rows (only packed rows are split), a sliding window,
            or no sequence boundaries.
    """
    if not hasattr(module, GROUP_ATTR):
        raise InvalidArgument(
            f"{type(module).__name__} runs attn_implementation={ULYSSES!r} without a sequence-parallel group; "
            "call batchfit.models.use_ulysses_attention(model, group) first"
        )
    group = getattr(module, GROUP_ATTR)
    module.batchfit_ulysses_calls = getattr(module, "batchfit_ulysses_calls", 0) + 1
    if kwargs.get("sliding_window") is not None:
        raise InvalidArgument(
            f"sequence parallelism cannot split layer {getattr(module, 'layer_idx', '?')}: it attends in a sliding "
            f"window of {kwargs['sliding_window']} tokens, and Ulysses splits only full attention; use sequence_parallel=1"
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise InvalidArgument(
            f"Ulysses attention splits one packed row without an attention mask, but got {query.shape[0]} rows"
            f"{' and an attention mask' if attention_mask is not None else ''}; "
            "run micro-batches made with iter_micro_batches(layout='packed')"
        )
    size = group_size(group)
    kv = key.shape[1]
    if size > 1 and kv % size:  # NOTE [ What Ulysses cannot split ]: verl's repeat of kv heads
        key = key.repeat_interleave(size // kv, dim=1)
        value = value.repeat_interleave(size // kv, dim=1)
    query, key, value = (seq_to_heads(t, group) for t in (query, key, value))
    length = query.shape[2]
    bounds_from = kwargs
    if kwargs.get("cu_seq_lens_q") is None and isinstance(kwargs.get("position_ids"), torch.Tensor) and size > 1:
        positions = kwargs["position_ids"].contiguous()
        parts = [torch.empty_like(positions) for _ in range(size)]
        dist.all_gather(parts, positions, group=group)
        bounds_from = {"position_ids": torch.cat(parts, dim=-1)}
    bounds = sequence_bounds(bounds_from, length)
    if bounds is None or bounds[-1][1] != length:
        raise InvalidArgument(
            f"Ulysses attention needs the packed row's sequence boundaries over its {length} tokens (cu_seq_lens_q of "
            "the whole row, or position_ids restarting at 0 per sequence); split the micro-batch with "
            "batchfit.parallel.split_packed"
        )
    out = attend_within_sequences(
        query, key, value, bounds, dropout=dropout if module.training else 0.0, scaling=scaling
    )
    return heads_to_seq(out, group), None


def register_ulysses_attention() -> str:
    """Register :data:`ULYSSES` with transformers' attention and mask interfaces (once); return the name."""
    return register_packed_attention(ULYSSES, ulysses_attention)


def _check_every_layer(model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
    def before(*_: Any, **__: Any) -> None:
        for layer in layers:
            layer.batchfit_ulysses_calls = 0

    def after(*_: Any, **__: Any) -> None:
        ran = sum(1 for layer in layers if getattr(layer, "batchfit_ulysses_calls", 0))
        if ran != len(layers) and group_size(getattr(model, GROUP_ATTR, None)) > 1:
            raise InvalidArgument(
                f"Ulysses attention ran in {ran} of {len(layers)} attention layers of {type(model).__name__}: the "
                "others do not call transformers' attention interface and would attend only to this rank's tokens; "
                "use sequence_parallel=1 for this model"
            )

    model.register_forward_pre_hook(before)
    model.register_forward_hook(after)


def use_ulysses_attention(model: torch.nn.Module, group: Any) -> str:
    """Make ``model`` split each packed row over ``group`` with Ulysses attention; return the implementation's name.

    Call it on every rank of the group, before sharding or after. Afterwards
    :func:`batchfit.train.model_logprobs` (and everything built on it: ``micro_batch_loss``,
    the budget's probe) gives each rank its columns of a packed micro-batch and returns the
    whole row's log-probs on every rank; scale the loss by the world size (``dp × sp``) under
    FSDP2/DDP (NOTE [ Ulysses sequence parallelism ]). Padded micro-batches are refused.

    Args:
        model: a transformers causal LM (unwrapped, or the FSDP2 module itself).
        group: the sequence-parallel group
            (:func:`batchfit.parallel.sequence_parallel_group`); ``None`` or a group of one
            rank runs like :data:`~batchfit.models.attention.VARLEN` (nothing split).

    Raises:
        InvalidArgument: not a transformers model, or one whose attention cannot be split
            over the group (NOTE [ What Ulysses cannot split ]).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise InvalidArgument(
            f"use_ulysses_attention needs a transformers model (with a config), but got a {type(model).__name__}"
        )
    size = group_size(group)
    check_ulysses(config, size, model_name=type(model).__name__.removeprefix("FSDP"))  # FSDP2's class prefix
    layers = _attention_layers(model)
    depth = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    if size > 1 and (not layers or (depth is not None and len(layers) != depth)):
        raise InvalidArgument(
            f"sequence parallelism found {len(layers)} attention layers in {type(model).__name__} for "
            f"num_hidden_layers={depth}: Ulysses must reach every layer's attention; use sequence_parallel=1 for this model"
        )
    name = register_ulysses_attention()
    for layer in layers:
        setattr(layer, GROUP_ATTR, group)
    already = hasattr(model, GROUP_ATTR)
    setattr(model, GROUP_ATTR, group)
    if not already:
        _check_every_layer(model, layers)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        config._attn_implementation = name
    return name
