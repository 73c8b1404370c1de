"""How :func:`~batchfit.parallel.shard.shard_model` sharded a model: one typed record per module, read with :func:`shard_state`.

NOTE [ The record of a sharded model ]
What a budget, an optimizer or a guard needs to know about a sharded model (the
:class:`~batchfit.parallel.sharding.Sharding` applied, the communication buffers to register
beside it, ZeRO's state) is a :class:`ShardState`, kept in a ``weakref.WeakKeyDictionary``
keyed by the module ``shard_model`` returned, not set as attributes on the module. The key is
the module object itself (``nn.Module`` hashes by identity), so it survives everything
batchfit does to a model after sharding it: FSDP2's ``fully_shard`` changes the module's class
in place (same object), a meta build's allocation swaps parameters in place (same object),
DDP and FSDP1 return a wrapper, which is the key. Nothing copies a sharded module; a copy
(``copy.deepcopy``) would have no record, as a model ``shard_model`` never saw. The entry
goes with the module; the record holds no reference back to it (``ZeroState`` keeps the
parameters, not the module), so the module is not kept alive by it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING, Any

from batchfit.parallel.sharding import Sharding

if TYPE_CHECKING:
    import torch

    from batchfit.parallel.zero import ZeroState

__all__ = ["ShardState", "forget_shard_state", "record_shard_state", "shard_state", "zero_state"]


@dataclasses.dataclass(frozen=True)
class ShardState:
    """How :func:`~batchfit.parallel.shard.shard_model` sharded one model (NOTE [ The record of a sharded model ]).

    Attributes:
        sharding: the :class:`~batchfit.parallel.sharding.Sharding` applied.
        comm_buffers: state to register beside the model, category ``communication``: DDP's
            gradient buckets (NOTE [ DDP gradient buckets ]) or ZeRO-1's reduce bucket (NOTE
            [ ZeRO's reduce bucket ]), as meta tensors of their bytes; ``()`` for the others.
        zero: the :class:`~batchfit.parallel.zero.ZeroState` of ``zero1``/``zero2`` (the
            optimizer is made from it), ``None`` for any other strategy.
    """

    sharding: Sharding
    comm_buffers: tuple[torch.Tensor, ...] = ()
    zero: ZeroState | None = None


_STATES: weakref.WeakKeyDictionary[Any, ShardState] = weakref.WeakKeyDictionary()


def shard_state(model: Any) -> ShardState | None:
    """The :class:`ShardState` :func:`~batchfit.parallel.shard.shard_model` recorded for ``model``; ``None`` for a model it never returned.

    Example:
        >>> import torch
        >>> from batchfit.parallel import Sharding, shard_model
        >>> shard_state(shard_model(torch.nn.Linear(2, 2), Sharding())).sharding.strategy
        'none'
        >>> shard_state(torch.nn.Linear(2, 2)) is None
        True
    """
    try:
        return _STATES.get(model)
    except TypeError:  # not weakly referenceable (not a module): never sharded
        return None


def zero_state(model: Any) -> ZeroState | None:
    """The :class:`~batchfit.parallel.zero.ZeroState` of ``model``'s record (``zero1``/``zero2``), ``None`` for any other model."""
    state = shard_state(model)
    return state.zero if state is not None else None


def record_shard_state(model: Any, state: ShardState) -> None:
    """Record ``state`` as how ``model`` was sharded (``shard_model`` and the strategies' wrap functions call it)."""
    _STATES[model] = state


def forget_shard_state(model: Any) -> None:
    """Drop ``model``'s record, if any (``shard_model`` does before sharding a model again)."""
    _STATES.pop(model, None)
