"""Applying a :class:`~batchfit.parallel.sharding.Sharding` to a causal LM with PyTorch's own DDP and FSDP2.

``zero1``/``zero2``: DeepSpeed ZeRO's flat partitions on PyTorch's collectives
(:mod:`batchfit.parallel.zero`), real or simulated alike.

``fsdp2``: ``fully_shard`` on every decoder layer, then on the root, over a 1-D device mesh
of ``world_size`` ranks (the default process group), with the sharding's
``MixedPrecisionPolicy`` and ``CPUOffloadPolicy``. On the estimate backend the process group
is simulated (:func:`batchfit.parallel.distributed.simulated_world`) and the model's tensors are
fake, so this is FSDP2's real code predicting one rank's memory.

``ddp``: ``DistributedDataParallel`` on real tensors. Its C++ reducer cannot run on fake
tensors, and it allocates its gradient buckets in C++ at construction, where no tracker can
see them; see NOTE [ DDP gradient buckets ].
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.parallel.shard_state import ShardState, forget_shard_state, record_shard_state, shard_state
from batchfit.parallel.sharding import Sharding


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (the ``nn.ModuleList`` of ``config.num_hidden_layers`` blocks).

    Raises:
        InvalidArgument: the model has no such list (FSDP2 needs one unit per layer).
    """
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len(m) == depth
    ]
    if not candidates:
        raise InvalidArgument(
            f"sharding='fsdp2' wraps each decoder layer, but {type(model).__name__} has no ModuleList of config.num_hidden_layers={depth!r} layers; pass a transformers causal LM"
        )
    return candidates[0]


def _check_world(sharding: Sharding) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument(
            f"sharding={sharding.strategy!r} over world_size={sharding.world_size} needs a process group: launch with torchrun --nproc-per-node {sharding.world_size} (backend cpu or cuda), or estimate inside batchfit.parallel.distributed.simulated_world({sharding.world_size})"
        )
    if dist.get_world_size() != sharding.world_size:
        raise InvalidArgument(
            f"world_size must equal the process group's size {dist.get_world_size()}, but got world_size={sharding.world_size}; pass world_size={dist.get_world_size()} (or launch {sharding.world_size} ranks)"
        )


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of DDP's gradient buckets for ``model``: one slot per trainable parameter element.

    NOTE [ DDP gradient buckets ]
    ``DistributedDataParallel`` (``gradient_as_bucket_view=False``, its default) copies
    every gradient into flat bucket tensors of the gradient's dtype and all-reduces them
    there; the buckets (``bucket_cap_mb`` each, the first 1 MiB) together hold every
    trainable parameter once and live as long as the wrapper. They are allocated by the C++
    reducer when DDP is constructed, before any measurement, so the tracked backends count
    them as registered state of this size (category ``communication``); the estimate
    backend cannot build the reducer on fake tensors and counts the same bytes. The cuda
    backend sees them on the device.
    """
    return sum(
        p.numel() * p.element_size() for p in dict.fromkeys(model.parameters()) if p.requires_grad
    )


# NOTE [ A model's own process group ]
# On real ranks every model shard_model wraps gets a process group of its own (the same ranks
# as the default group, a new communicator). The default group then carries only what all
# ranks agree on (the budget search's verdicts, old log-probs gathered over ranks), and when
# one rank runs out of memory in the middle of a step, the collective the others abandon is
# left on the model's group alone: the default group stays usable to say so on every rank
# (NOTE [ One rank runs out ] in batchfit.budget.guard). Simulated ranks keep PyTorch's fake
# default group.
_MODEL_GROUPS: list[Any] = []


def model_groups() -> list[Any]:
    """The process groups :func:`shard_model` made for models on real ranks, oldest first (NOTE [ A model's own process group ])."""
    return list(_MODEL_GROUPS)


def _model_group() -> Any:
    """A new process group over every rank for one model, on real ranks; ``None`` for simulated ones.

    Its timeout is :func:`~batchfit.parallel.distributed.search_timeout` (NOTE [ One rank runs
    out ] in :mod:`batchfit.budget.guard`).
    """
    import torch.distributed as dist

    from batchfit.parallel.distributed import is_distributed, search_timeout

    if not is_distributed():
        return None
    group = dist.new_group(backend=dist.get_backend(), timeout=search_timeout())
    _MODEL_GROUPS.append(group)
    return group


def shard_model(
    model: torch.nn.Module, sharding: Sharding, *, fake: bool = False, device: torch.device | str | None = None
) -> torch.nn.Module:
    """Spread ``model`` over the ranks of the default process group as ``sharding`` says.

    Args:
        model: a transformers causal LM or value-head model, built in the dtype its
            parameters are stored in (fp32 for ``mixed_precision="bf16"``), on the device
            to train on (fake tensors for the estimate backend: call inside its context).
        sharding: the strategy and its options; ``world_size`` must equal the process
            group's size (a simulated one on the estimate backend).
        fake: the model's tensors are fake (estimate backend): DDP is then not wrapped,
            its buckets are counted (NOTE [ DDP gradient buckets ]).
        device: the device the model will live on when it is still on ``meta`` (NOTE [ Models are
            built on the meta device ] in :mod:`batchfit.models.build`): FSDP2's mesh is made for
            it; default the parameters' own device.

    Returns:
        ``none``: ``model``. ``zero1``/``zero2``: ``model``, its trainable parameters now views
        into one flat buffer. ``fsdp2``: ``model`` itself, now an ``FSDPModule`` whose
        parameters are ``DTensor`` shards. ``ddp``: a ``DistributedDataParallel`` wrapper
        (``model`` on fake tensors). On real ranks its collectives run on a process group of
        its own (NOTE [ A model's own process group ]). How it was sharded is recorded for the
        result, read with :func:`~batchfit.parallel.shard_state.shard_state` (a
        :class:`~batchfit.parallel.shard_state.ShardState`: the sharding, the communication
        buffers to register, ZeRO's state; NOTE [ The record of a sharded model ]) or
        :func:`sharding_of`; nothing is set on the module.

    Raises:
        InvalidArgument: no process group or one of another size, a model without decoder
            layers (``fsdp2``).
    """
    comm: tuple[torch.Tensor, ...] = ()
    out = model
    wrap = sharding.spec.wrapper()  # batchfit.parallel.strategies: what the strategy wraps a model with
    if sharding.distributed:
        check_same_model(model, sharding)  # before the first collective of the model
    forget_shard_state(model)  # a model sharded again keeps no earlier record
    if wrap is not None:
        _check_world(sharding)
        out, comm = wrap(model, sharding, _model_group, fake=fake, device=device)
    if shard_state(out) is None:  # a wrap with state of its own (ZeRO's) records it whole
        record_shard_state(out, ShardState(sharding, comm))
    return out


def sharding_of(model: torch.nn.Module) -> Sharding:
    """The :class:`Sharding` :func:`shard_model` applied to ``model``; ``Sharding()`` (none) for a model it never saw."""
    state = shard_state(model)
    return state.sharding if state is not None else Sharding()


# The strategies' wrap functions (batchfit.parallel.strategies.Wrap), named by their specs.


def wrap_fsdp2(model: torch.nn.Module, sharding: Sharding, new_group: Any, *, fake: bool, device: Any) -> Any:
    """``fully_shard`` on every decoder layer, then on the root; no communication buffers of its own."""
    _fully_shard(model, sharding, new_group(), device)
    return model, ()


def wrap_ddp(model: torch.nn.Module, sharding: Sharding, new_group: Any, *, fake: bool, device: Any) -> Any:
    """``DistributedDataParallel`` on real tensors, ``model`` itself on fake ones; its buckets as a meta tensor."""
    comm = (torch.empty(ddp_bucket_bytes(model), dtype=torch.uint8, device="meta"),)
    return (model if fake else _wrap_ddp(model, new_group())), comm


def wrap_zero(model: torch.nn.Module, sharding: Sharding, new_group: Any, *, fake: bool, device: Any) -> Any:
    """DeepSpeed ZeRO-1/2's flat partitions (:mod:`batchfit.parallel.zero`), the state in ``model``'s :class:`ShardState`."""
    from batchfit.parallel.zero import ZeroState

    zero = ZeroState(model, sharding, new_group())
    # NOTE [ ZeRO's reduce bucket ]
    comm = (torch.empty(zero.registered_bucket_bytes, dtype=torch.uint8, device="meta"),) if zero.stage == 1 else ()
    record_shard_state(model, ShardState(sharding, comm, zero))
    return model, comm


def wrap_fsdp1(model: torch.nn.Module, sharding: Sharding, new_group: Any, *, fake: bool, device: Any) -> Any:
    """``FullyShardedDataParallel`` as verl wraps it (:mod:`batchfit.parallel.fsdp1`)."""
    from batchfit.parallel.fsdp1 import wrap_fsdp1 as wrap

    return wrap(model, sharding, decoder_layers(model), new_group(), device), ()


#: Config entries that name where a model came from, not what it is.
_PROVENANCE = frozenset({"_name_or_path", "name_or_path", "transformers_version", "_commit_hash"})


class _Text(str):
    """A string shown bare in a message (``repr`` without quotes)."""

    def __repr__(self) -> str:
        return str(self)


def model_identity(model: torch.nn.Module) -> dict[str, Any]:
    """What makes ``model`` the same model on every rank: its config's entries and its parameters' shapes and dtypes.

    ``{"config.<key>": value, …, "parameters": "N tensors, M elements (dtypes), digest D"}``;
    entries naming where the model came from (its path, the transformers version) are left out.
    """
    import zlib

    inner = unwrap(model)
    config = getattr(inner, "config", None)
    entries = config.to_dict() if hasattr(config, "to_dict") else {}
    out: dict[str, Any] = {f"config.{k}": v for k, v in sorted(entries.items()) if k not in _PROVENANCE}
    shapes = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for name, p in model.named_parameters()]
    elements = sum(math.prod(shape) for _, shape, _ in shapes)
    dtypes = ", ".join(sorted({d for _, _, d in shapes}))
    digest = zlib.crc32(repr(shapes).encode())
    out["parameters"] = _Text(f"{len(shapes)} tensors, {elements:,} elements ({dtypes}), digest {digest:08x}")
    return out


_shardings = itertools.count()  # shard_model's calls, counted alike on every rank


def check_same_model(model: torch.nn.Module, sharding: Sharding) -> None:
    """Raise on every rank when the ranks are about to shard different models (a no-op without real ranks).

    Sharded ranks that hold different models enter collectives of different sizes, which
    ends in a crash (``collective mismatch``, SIGABRT) or a hang. Before the model's first
    collective, each rank's :func:`model_identity` is exchanged through the store
    (:func:`~batchfit.parallel.distributed.gather_through_store`: no collective, so a rank that
    failed before it cannot pair with it) and compared.

    Raises:
        InvalidArgument: one line naming each entry that differs and every rank's value.
        BatchfitError: a rank did not come within the process group's timeout.
    """
    import json

    from batchfit.parallel.distributed import differences, gather_through_store, is_distributed, mark_agreed

    if not is_distributed():
        return
    mine = {k: repr(v) for k, v in model_identity(model).items()}
    gathered = gather_through_store(
        f"shard_model/{next(_shardings)}", json.dumps(mine), what=f"shard_model (sharding={sharding.strategy!r})"
    )
    every = {r: json.loads(text) for r, text in gathered.items()}
    if any(g != mine for g in every.values()):
        raise mark_agreed(InvalidArgument(
            f"every rank must build the same model to shard it (sharding={sharding.strategy!r}), but they differ: "
            f"{differences(every)}"
        ))


def _fully_shard(model: torch.nn.Module, sharding: Sharding, group: Any, device: Any = None) -> None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    where = torch.device(device) if device is not None else next(model.parameters()).device
    device_type = "cuda" if where.type == "cuda" else "cpu"
    with unset_fake_temporarily():  # the mesh holds real rank ids, even when estimating
        if group is None:
            mesh = init_device_mesh(device_type, (sharding.world_size,))
        else:
            mesh = DeviceMesh.from_group(group, device_type)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": sharding.reshard_after_forward}
    if sharding.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if sharding.offload == "cpu":
        # pinned host memory needs a CUDA device
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    if sharding.expert_parallel > 1:  # NOTE [ Expert parallelism the torchtitan way ]: experts first, on their own mesh
        from batchfit.parallel.expert_parallel import fully_shard_experts

        fully_shard_experts(model, sharding.expert_parallel, device_type, kwargs)
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _wrap_ddp(model: torch.nn.Module, group: Any) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    param = next(model.parameters())
    device_ids = [param.device.index] if param.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=group)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a DDP wrapper and/or a PEFT (LoRA) wrapper (``model`` itself otherwise).

    The model returned holds the same parameters (a PEFT model's adapter layers included);
    run the forward through ``model`` itself, whose FSDP2 root or DDP hooks it needs.
    """
    from torch.nn.parallel import DistributedDataParallel

    from batchfit.parallel.fsdp1 import is_fsdp1

    inner = model.module if isinstance(model, DistributedDataParallel) or is_fsdp1(model) else model
    if hasattr(inner, "peft_config") and callable(getattr(inner, "get_base_model", None)):  # a PeftModel
        return inner.get_base_model()
    return inner


def is_fsdp(model: torch.nn.Module) -> bool:
    """True when ``model`` was wrapped by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
