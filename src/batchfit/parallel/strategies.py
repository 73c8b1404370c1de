"""The data-parallel strategies batchfit models, one :class:`StrategySpec` each, registered by name.

Outside :mod:`batchfit.parallel` code asks a :class:`~batchfit.parallel.sharding.Sharding`'s
:attr:`~batchfit.parallel.sharding.Sharding.spec` what its strategy does (gathers layers, stays
affine in depth, shards on meta, …) and never branches on the strategy's name (STYLE.md items 7
and 11; ``tests/test_imports.py`` holds it, as :class:`~batchfit.frameworks.registry.FrameworkSpec`
does for frameworks). A framework's own strategy strings (verl's ``fsdp``, OpenRLHF's ZeRO stage)
and the table mapping them to these names are framework facts and stay in :mod:`batchfit.frameworks`.

Ulysses sequence parallelism is not a strategy but an axis of a :class:`Sharding`
(``sequence_parallel``): a strategy says whether it takes it (:attr:`StrategySpec.sequence_parallel`).

This module imports nothing that imports torch: a spec names the function that wraps a model
by its dotted path, imported on first use (:meth:`StrategySpec.wrapper`).

Adding a strategy: a module with its wrap function (the signature of :data:`Wrap`) and its
tests, and one :func:`register_strategy` call in the table at the end of this module;
:class:`Sharding` then accepts its name and validates its options from the spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.validation import closest

__all__ = ["StrategySpec", "Wrap", "get_strategy", "register_strategy", "scale_out_strategy", "strategy_names"]

#: ``(model, sharding, new_group, *, fake, device) -> (module, communication buffers)``: applies a
#: strategy to a model whose world is checked; ``new_group()`` makes the model's own process group
#: (NOTE [ A model's own process group ] in :mod:`batchfit.parallel.shard`), called only if needed.
Wrap = Callable[..., tuple[Any, tuple[Any, ...]]]


@dataclass(frozen=True)
class StrategySpec:
    """What one data-parallel strategy does to a model's memory, its build and its ranks.

    Attributes:
        name: the strategy's name, the value of ``Sharding.strategy`` (``"fsdp2"``).
        title: what it is, for messages and docs (``"PyTorch fully_shard (FSDP2)"``).
        group: the ranks it spreads over: ``"world"`` (every rank of the default process group,
            ``dp × sp``) or ``"none"`` (one device).
        partitioned: the state categories split over the group (``"parameters"``,
            ``"gradients"``, ``"optimizer_state"``); the rest is replicated.
        distributed: it talks to other ranks (needs a process group, real or simulated).
        gathers_layers: FSDP's family: parameters sharded, one layer gathered at a time; it has
            FSDP's options (``mixed_precision="bf16"``, ``offload``, ``reshard_after_forward``).
        sequence_parallel: it takes Ulysses' axis (``Sharding.sequence_parallel > 1``).
        zero_stage: DeepSpeed ZeRO's stage (1, 2), 0 for none; a stage has ZeRO's options
            (``reduce_bucket_size``, ``overlap_comm``).
        shards_on_meta: a real build shards the model on the meta device before materialising it
            (``fully_shard`` on meta, then each rank allocates its shards only).
        materialises_on_host: a real build allocates the model on the host and the wrapper moves it
            to the device unit by unit (NOTE [ FSDP1 wraps a materialised model ] in
            :mod:`batchfit.parallel.fsdp1`).
        affine_in_depth: one rank's memory is affine in the model's depth, so two shallow copies
            extrapolate it (ZeRO-2's gradient buffer is not: NOTE [ The simulated ZeRO rank ] in
            :mod:`batchfit.parallel.zero`).
        scale_out: the strategy remedies name to spread the state over more ranks; a search for
            the smallest world that fits starts from its own world (others start from one rank).
        torch_behaviours: its budget depends on what the installed torch does
            (:mod:`batchfit.parallel.behaviour`: FSDP2's root resharded after forward or kept).
        shards_rows: it shards each parameter along its first dimension (FSDP2's ``Shard(0)``), so
            a 3-D expert parameter leaves at least one expert per rank (NOTE [ One expert per rank
            at least ] in :mod:`batchfit.models.moe`).
        warmup_steps: steps a measured training step runs first on a wrapped model (DDP re-buckets
            gradients in the forward after its first backward: NOTE [ DDP gradient buckets ]).
        wrap: ``"module:function"`` of its :data:`Wrap`, or ``""`` when it leaves a model as it is.
        model_parallel: it splits each layer over a tensor-parallel group and the layers over
            pipeline stages (``Sharding.tensor_parallel``, ``Sharding.pipeline_parallel``), data
            parallel over the rest of the world.
        profile: the module that profiles a model under it in place of
            :func:`batchfit.budget.model_profile.profile_model`'s causal-LM probes (Megatron builds
            its own ``GPTModel``): its ``profile_model`` and ``resident_state_bytes`` take the
            arguments of those two functions; ``""`` for none.
    """

    name: str
    title: str
    group: str = "world"
    partitioned: tuple[str, ...] = ()
    distributed: bool = True
    gathers_layers: bool = False
    sequence_parallel: bool = False
    zero_stage: int = 0
    shards_on_meta: bool = False
    materialises_on_host: bool = False
    affine_in_depth: bool = True
    scale_out: bool = False
    torch_behaviours: bool = False
    shards_rows: bool = False
    warmup_steps: int = 0
    wrap: str = ""
    model_parallel: bool = False
    profile: str = ""

    def __post_init__(self) -> None:
        if self.group not in ("world", "none") or (self.group == "none") == self.distributed:
            raise InvalidArgument(
                f"a strategy's group must be 'world' when it is distributed and 'none' when not, but got "
                f"group={self.group!r} with distributed={self.distributed} for {self.name!r}"
            )
        if self.distributed and not (self.wrap or self.profile):
            raise InvalidArgument(
                f"a distributed strategy needs its wrap function or its own profile, but {self.name!r} has neither"
            )

    def search_start(self, world_size: int) -> int:
        """The simulated world a search for the smallest world that fits starts from: ``world_size`` under
        :attr:`scale_out` (the remedy grows this world), else one rank (the remedy switches to the scale-out strategy)."""
        return world_size if self.scale_out else 1

    def profiler(self) -> Any:
        """The module profiling a model under it (imported now), or ``None``: :attr:`profile`."""
        return importlib.import_module(self.profile) if self.profile else None

    def wrapper(self) -> Wrap | None:
        """The function applying it to a model (imported now), or ``None`` when it leaves a model as it is."""
        if not self.wrap:
            return None
        module, _, function = self.wrap.partition(":")
        return getattr(importlib.import_module(module), function)


_REGISTRY: dict[str, StrategySpec] = {}


def register_strategy(spec: StrategySpec) -> StrategySpec:
    """Add ``spec`` under its name; returns it.

    Raises:
        InvalidArgument: a strategy of that name is registered already.
    """
    if spec.name in _REGISTRY:
        raise InvalidArgument(f"strategy {spec.name!r} is registered already; give the new strategy another name")
    _REGISTRY[spec.name] = spec
    return spec


def strategy_names() -> tuple[str, ...]:
    """The registered strategies' names, in registration order."""
    return tuple(_REGISTRY)


def get_strategy(name: str) -> StrategySpec:
    """The spec registered as ``name``.

    Raises:
        InvalidArgument: no strategy has that name (the names and the closest are listed).

    Example:
        >>> get_strategy("zero2").affine_in_depth
        False
    """
    spec = _REGISTRY.get(name) if isinstance(name, str) else None
    if spec is None:
        near = closest(name, strategy_names()) if isinstance(name, str) else None
        hint = f" (did you mean {near!r}?)" if near else ""
        raise InvalidArgument(
            f"sharding must be one of {', '.join(strategy_names())}, but got sharding={name!r}{hint}"
        )
    return spec


def scale_out_strategy() -> StrategySpec:
    """The one strategy with :attr:`StrategySpec.scale_out`: the one remedies suggest to shard over more ranks."""
    (spec,) = (s for s in _REGISTRY.values() if s.scale_out)
    return spec


_SHARD = "batchfit.parallel.shard"
_FSDP = ("parameters", "gradients", "optimizer_state")

# The table, in the order Sharding's messages list the names.
register_strategy(StrategySpec("none", "one device", group="none", distributed=False))
register_strategy(
    StrategySpec("ddp", "PyTorch DistributedDataParallel", warmup_steps=2, wrap=f"{_SHARD}:wrap_ddp")
)
register_strategy(
    StrategySpec(
        "fsdp1",
        "PyTorch FullyShardedDataParallel (FSDP1)",
        partitioned=_FSDP,
        gathers_layers=True,
        sequence_parallel=True,
        materialises_on_host=True,
        wrap=f"{_SHARD}:wrap_fsdp1",
    )
)
register_strategy(
    StrategySpec(
        "fsdp2",
        "PyTorch fully_shard (FSDP2)",
        partitioned=_FSDP,
        gathers_layers=True,
        sequence_parallel=True,
        shards_on_meta=True,
        scale_out=True,
        torch_behaviours=True,
        shards_rows=True,
        wrap=f"{_SHARD}:wrap_fsdp2",
    )
)
register_strategy(
    StrategySpec(
        "zero1", "DeepSpeed ZeRO-1", partitioned=("optimizer_state",), zero_stage=1, wrap=f"{_SHARD}:wrap_zero"
    )
)
register_strategy(
    StrategySpec(
        "zero2",
        "DeepSpeed ZeRO-2",
        partitioned=("gradients", "optimizer_state"),
        zero_stage=2,
        affine_in_depth=False,
        wrap=f"{_SHARD}:wrap_zero",
    )
)
register_strategy(
    StrategySpec(
        "megatron",
        "Megatron-core (tensor × pipeline parallel, data parallel over the rest)",
        model_parallel=True,
        profile="batchfit.budget.megatron_profile",
    )
)
