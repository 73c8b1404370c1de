"""Building causal LMs (and value-head critics) from a spec, with real or fake tensors.

Real models are built on the meta device and materialised after sharding, each rank holding
only its shard (NOTE [ Models are built on the meta device ]); their initial weights come from
a seed, the same on every rank, for every sharding and world size (NOTE [ Initial weights from
a seed ]). The estimate backend builds fake tensors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchfit.dtypes import parse_dtype
from batchfit.errors import InvalidArgument
from batchfit.memory import Backend, get_backend
from batchfit.models.moe import (
    ROUTINGS,
    check_experts_implementation,
    fix_routing,
    set_experts_implementation,
)
from batchfit.models.specs import DEFAULT_PRESET, load_config, quiet_transformers_logs, spec_name
from batchfit.validation import check_choice, check_int

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

#: Elements per block of a seeded random fill (NOTE [ Initial weights from a seed ]): 16,384
#: (64 KiB in fp32), at least one row of the parameter.
SEED_BLOCK_ELEMENTS = 1 << 14

# NOTE [ Models are built on the meta device ]
# Every build on a real backend (cpu, cuda, or none) goes meta -> shard -> allocate ->
# initialise, PyTorch's and torchtitan's pattern: construct under ``torch.device("meta")``
# (transformers skips its init there), enable checkpointing, and for ``fsdp2`` call
# ``shard_model`` (``fully_shard`` per layer and root turns the meta parameters into meta
# DTensor shards; its mesh's device type is the backend's device, which meta parameters
# cannot tell it). Then allocate (``to_empty``, keeping tied parameters tied; with
# ``offload="cpu"`` the parameters on the host and the buffers on the device, as torchtitan
# does), run transformers' ``init_weights()`` with seeded fills (NOTE [ Initial weights from
# a seed ]; buffers: NOTE [ Buffers after a meta build ]), and for ``ddp`` wrap the replica
# last (DDP's broadcast of rank 0's state finds it equal already).
# Under ``fsdp2`` the most a rank holds while building is its shard of the parameters, the
# unsharded buffers and one block of a random fill: a 70B model over 8 ranks asks ~35 GB per
# rank, not the ~280 GB of the whole model in fp32. ``ddp`` and ``none`` hold the replica they
# train anyway; they take the same path so that one seed gives the same weights whatever the
# sharding (two FSDP2 ranks train to the same parameters as one process). The estimate backend,
# and any build inside an active FakeTensorMode (AutoBatch builds its tasks inside the
# backend's context), keep the ordinary build: fake tensors allocate nothing, have no values.
# Meta tensors hold no memory: the live-storage tracker skips them, so a measured build counts
# what it allocates after the meta phase. Embedding padding rows: transformers zeroes
# ``weight[padding_idx]``, which on a DTensor sharded by rows all-gathers the whole table into
# a copy and zeroes the copy; the row is zeroed in the rank's own shard instead.
# The model that comes out has the structure, dtypes, devices and ``train()`` mode of the
# ordinary build (``from_config`` on the device, then ``shard_model``). With LoRA, PEFT wraps the
# meta model before sharding (its adapters on meta too), the allocation covers the adapters, and
# PEFT's own init follows transformers' (NOTE [ LoRA as the frameworks build it ] in
# batchfit.models.lora); the estimate backend gives the adapters fake tensors of PEFT's dtype.


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
    seed: int | None = None,
    lora: Any = None,
    experts_implementation: str | None = None,
    routing: str | None = None,
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
            On a real backend the model is built on the meta device and sharded before
            anything is allocated: an ``fsdp2`` rank never holds more than its shard (NOTE
            [ Models are built on the meta device ]).
        seed: the initial weights' seed (an integer ``>= 0``): the same weights on every rank,
            for every sharding and world size, on cpu and cuda (NOTE [ Initial weights from a
            seed ]). ``None`` (default): drawn from ``torch``'s global generator (rank 0's for
            ``ddp`` and ``fsdp2``, so every rank builds the same model), so that
            ``torch.manual_seed`` still decides the weights. Ignored by the estimate backend
            (fake tensors have no values).
        lora: a :class:`~batchfit.models.lora.LoraSpec` (or a mapping of its fields): the model
            is wrapped by PEFT's ``get_peft_model`` before sharding, its base frozen, as verl and
            SkyRL build it (NOTE [ LoRA as the frameworks build it ] in
            :mod:`batchfit.models.lora`; needs ``pip install -e '.[lora]'`` in batchfit's checkout). The adapters
            are fp32 whatever ``dtype`` is, and are initialised by PEFT (B zeros) from ``seed``.
            ``None`` or rank 0: no adapters.
        experts_implementation: how a mixture of experts runs its experts, ``grouped_mm``,
            ``batched_mm`` or ``eager`` (NOTE [ Experts as transformers runs them ] in
            :mod:`batchfit.models.moe`); ``None``: transformers' default. Ignored by dense models.
        routing: ``"skewed"`` (every token to the same experts: the worst case) or
            ``"balanced"`` fixes the experts' routing as integers for the model's lifetime
            (NOTE [ The worst case of a routing-dependent loop ]); ``None``: the router decides.
        **config_overrides: config attributes to override, e.g. ``num_hidden_layers=2``
            (a per-layer list such as ``layer_types`` is cut to the new depth).

    Returns:
        The model, in ``train()`` mode, with ``use_cache=False`` (for ``ddp`` on a real
        backend, its ``DistributedDataParallel`` wrapper; with ``lora``, the ``PeftModel``,
        which FSDP2 shards as the root).

    Raises:
        InvalidArgument: bad spec, dtype, attention implementation, backend name,
            sharding, seed or lora (a target that matches no module, PEFT missing), or no
            process group of the sharding's size.

    Example:
        >>> model = build_causal_lm("tiny")
        >>> type(model).__name__, next(model.parameters()).dtype
        ('LlamaForCausalLM', torch.float32)
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from batchfit.models.lora import as_lora
    from batchfit.parallel.shard import shard_model
    from batchfit.parallel.sharding import as_sharding

    torch_dtype = parse_dtype(dtype)
    adapters = as_lora(lora)
    if adapters is not None and not adapters.enabled:
        adapters = None
    check_choice("attn_implementation", attn_implementation, ATTN_IMPLEMENTATIONS)
    experts_implementation = check_experts_implementation("experts_implementation", experts_implementation)
    if routing is not None:
        check_choice("routing", routing, ROUTINGS)
    plan = as_sharding(sharding)
    if seed is not None:
        seed = check_int("seed", seed, minimum=0)
    chosen = resolve_backend(backend)
    config = load_config(spec, **config_overrides)
    set_experts_implementation(config, experts_implementation)
    _cut_layer_lists(config)
    config.use_cache = False
    if value_head:
        config.num_labels = 1
        config.classifier_dropout = 0.0
    factory = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    attn_implementation = _attention_the_class_runs(factory, config, attn_implementation)
    context = chosen.context() if chosen is not None else contextlib.nullcontext()
    device = chosen.device if chosen is not None else torch.device("cpu")
    from torch._guards import active_fake_mode

    construct = functools.partial(
        _construct,
        factory,
        config,
        spec,
        dtype=torch_dtype,
        attn_implementation=attn_implementation,
        routing=routing,
        gradient_checkpointing=gradient_checkpointing,
        adapters=adapters,
        value_head=value_head,
    )
    if (chosen is not None and chosen.simulated) or active_fake_mode() is not None:
        with context:  # fake tensors (estimate, or a task built inside its context): nothing allocated
            model = construct()
            if adapters is not None:
                from batchfit.models.lora import materialise_adapters

                materialise_adapters(model, device)  # fake tensors of PEFT's dtype
            return shard_model(model, plan, fake=True)
    with context:  # NOTE [ Models are built on the meta device ]
        seed = resolve_seed(seed, plan)
        with torch.device("meta"):
            model = construct()
            if plan.spec.shards_on_meta:
                model = _shard_on_meta(model, plan, device)
        return _materialise(model, plan, device, seed, spec)


def _construct(
    factory: Any,
    config: Any,
    spec: Any,
    *,
    dtype: torch.dtype,
    attn_implementation: str,
    routing: str | None,
    gradient_checkpointing: bool,
    adapters: Any,
    value_head: bool,
) -> torch.nn.Module:
    """The model in ``train()`` mode as transformers (and PEFT, with ``adapters``) construct it, on whatever device or mode is current.

    One sequence for the fake build and the meta build (NOTE [ Models are built on the meta
    device ]): construct, fix the routing, enable checkpointing, wrap the adapters.
    """
    model = _from_config(factory, config, spec, dtype=dtype, attn_implementation=attn_implementation)
    fix_routing(model, routing)
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    if adapters is not None:
        from batchfit.models.lora import apply_lora

        model = apply_lora(model, adapters, value_head=value_head)
    return model.train()


def _attention_the_class_runs(factory: Any, config: Any, asked: str) -> str:
    """``asked``, or ``"eager"`` when ``asked`` is sdpa and the model class has no sdpa path.

    transformers itself falls back to eager attention for such a class when none is asked for
    (``PreTrainedModel.get_correct_attn_implementation``): gpt-oss, whose attention sinks sdpa
    cannot express, runs eager attention unless a kernel is installed.
    """
    if asked != "sdpa":
        return asked
    try:
        cls = factory._model_mapping[type(config)]
    except (KeyError, AttributeError):  # transformers decides (and may refuse) at build
        return asked
    return asked if getattr(cls, "_supports_sdpa", True) else "eager"


def resolve_seed(seed: int | None, sharding: Any) -> int:
    """The initial weights' seed: ``seed`` itself, or one drawn from ``torch``'s global generator.

    For a distributed sharding (``ddp``, ``fsdp2``) every rank draws one number and keeps
    rank 0's (one all-reduce on real ranks; none in a simulated world), so every rank builds
    the same model; every rank must then call this. ``none`` draws locally and never
    communicates (one rank may build alone).
    """
    from batchfit.parallel.distributed import all_reduce_max_list, get_rank

    if seed is not None:
        return seed
    drawn = int(torch.randint(0, 2**62, (1,)).item())
    if not sharding.distributed:
        return drawn
    return all_reduce_max_list([drawn if get_rank() == 0 else 0])[0]


def _shard_on_meta(model: torch.nn.Module, plan: Any, device: torch.device) -> torch.nn.Module:
    """``shard_model`` on a model whose parameters are on the meta device, for ``device``."""
    from batchfit.parallel.shard import shard_model

    if device.type == "cpu":
        return shard_model(model, plan)
    # the mesh's device type cannot be read off meta parameters: shard_model must be told it
    return shard_model(model, plan, device=device)


def _materialise(model: torch.nn.Module, plan: Any, device: torch.device, seed: int, spec: Any) -> torch.nn.Module:
    """Allocate a model built on meta (sharded already for ``fsdp2``) on ``device``, initialise it, wrap ``ddp``.

    NOTE [ Models are built on the meta device ]: DDP wraps the initialised replica (its
    constructor broadcasts rank 0's, equal already).

    Raises:
        InvalidArgument: transformers left a buffer uninitialised (NOTE [ Buffers after a meta build ]).
    """
    from batchfit.parallel.shard import shard_model

    # fsdp1: on the host, FSDP1 moves each unit to the device as it wraps it (NOTE [ FSDP1 wraps a
    # materialised model ] in batchfit.parallel.fsdp1)
    home = torch.device("cpu") if plan.offload == "cpu" or plan.spec.materialises_on_host else device
    _allocate(model, home)
    if home != device and not plan.spec.materialises_on_host:  # offloaded parameters live on the host, buffers on the device
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)
    with torch.no_grad():
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.fill_(float("nan"))  # NOTE [ Buffers after a meta build ]
    initialise_weights(model, seed)
    _check_buffers(model, spec)
    if not plan.spec.shards_on_meta:
        model = shard_model(model, plan, device=device)
    return model


# NOTE [ Buffers after a meta build ]
# Allocation leaves buffers uninitialised. transformers 5.x recomputes the non-persistent ones
# (rotary ``inv_freq``, ``original_inv_freq``) in ``init_weights``, as its own meta loading
# needs; transformers 4.x computes rotary frequencies in the module's ``__init__`` only, so a
# rotary module with ``rope_init_fn`` gets them recomputed here. Floating-point buffers are
# filled with NaN before the init and checked after it: a buffer nobody recomputed is an
# error naming it, never garbage trained on.


def _check_buffers(model: torch.nn.Module, spec: Any) -> None:
    """Recompute transformers 4.x rotary buffers and refuse buffers left uninitialised (NOTE above).

    Raises:
        InvalidArgument: a floating-point buffer still holds the NaN it was filled with.
    """
    with torch.no_grad():
        for module in model.modules():
            inv_freq = module._buffers.get("inv_freq")
            rope_init = getattr(module, "rope_init_fn", None)
            if inv_freq is None or not callable(rope_init) or not torch.isnan(inv_freq).any():
                continue
            fresh, _ = rope_init(module.config, inv_freq.device)
            inv_freq.copy_(fresh)
            if "original_inv_freq" in module._buffers:
                module._buffers["original_inv_freq"].copy_(fresh)
            elif hasattr(module, "original_inv_freq"):
                module.original_inv_freq = inv_freq
    left = [name for name, b in model.named_buffers() if b.is_floating_point() and bool(torch.isnan(b).any())]
    if left:
        raise InvalidArgument(
            f"spec={spec_name(spec)}: transformers did not initialise the buffers {', '.join(left)} of a model built on the meta device; use backend='estimate', or a transformers release whose init_weights recomputes them (5.x)"
        )


def _allocate(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` that keeps tied parameters tied and allocates each once.

    ``to_empty`` visits a parameter shared by two modules (tied embeddings) twice: a plain
    parameter comes back as two parameters (the tie broken until ``tie_weights``), a DTensor
    one is allocated twice. Parameters are swapped in place (the object stays, so the tie
    does) and a tensor already off the meta device is kept.
    """
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model._apply(lambda t: t if t.device.type != "meta" else torch.empty_like(t, device=device))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def initialise_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise ``model`` (plain or FSDP2-sharded parameters) with transformers' ``init_weights`` from ``seed``.

    transformers decides what each parameter gets (normal with ``initializer_range``, ones,
    zeros, the rotary buffers in 5.x); every random fill draws seeded values (NOTE [ Initial
    weights from a seed ]). Every module is initialised again, whatever transformers marked
    as initialised. Nothing is communicated between ranks. The global random generators are
    left as they were.

    Args:
        model: a transformers model (``init_weights``), with materialised (not meta) tensors.
        seed: an integer ``>= 0``.
    """
    from torch.distributed.tensor import DTensor

    from batchfit.models.lora import is_peft_model, reset_adapters

    pads = {
        m: m.padding_idx
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None and isinstance(m.weight, DTensor)
    }
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    for item in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(item, "_is_hf_initialized", False):
            item._is_hf_initialized = False  # transformers 4.x marks modules inited on meta
    # transformers initialises module by module through each (sub-)model's _initialize_weights
    owners = [m for m in model.modules() if callable(getattr(m, "_initialize_weights", None))] if pads else []
    try:
        for m in pads:
            m.padding_idx = None  # NOTE [ Models are built on the meta device ]: zeroed in the shard
        for owner in owners:
            owner._initialize_weights = _zeroing_padding_after(owner._initialize_weights, pads)
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)  # fills seeded_fills cannot name (see its NOTE) stay reproducible
            with seeded_fills(model, seed):
                model.init_weights()
                if is_peft_model(model):  # transformers drew the adapters as plain linears
                    reset_adapters(model)
    finally:
        for owner in owners:
            del owner._initialize_weights  # the class's method again
        for m, pad in pads.items():
            m.padding_idx = pad


def _zeroing_padding_after(initialize: Any, pads: dict[torch.nn.Module, int]) -> Any:
    """``initialize(module, ...)``, then the padding row of a sharded embedding zeroed where transformers zeroes it.

    Zeroing right after the embedding's own init (not after the whole init) keeps what
    transformers does when a later init overwrites the row (a tied head drawn again).
    """

    def wrapped(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = initialize(module, *args, **kwargs)
        pad = pads.get(module)
        if pad is not None:
            local, offset = _local_view(module.weight)
            if offset[0] <= pad < offset[0] + local.shape[0]:
                local[pad - offset[0]].zero_()
        return out

    return wrapped


# NOTE [ Initial weights from a seed ]
# A sharded model cannot be initialised by drawing each full parameter from one generator
# (a rank would hold the whole tensor), and DTensor's own random ops do not help: on a CPU
# mesh each rank fills its shard from its local generator (measured: with one seed, rank 0's
# and rank 1's shards hold the same numbers), and on CUDA its RNG tracker gives each shard a
# philox offset that the sharding decides (not one process's tensor). So every random fill of a
# known parameter or buffer (``normal_``, ``uniform_``, ... on the tensor itself, a
# ``.data`` alias included) is replaced by values that depend only on (seed, the tensor's
# name, how many fills that tensor had before, position): the parameter's rows are cut into
# blocks of at least one row and about SEED_BLOCK_ELEMENTS elements, each block is drawn
# whole, in the parameter's dtype, by the same op from a CPU generator seeded with a hash of
# (seed, name, fill, block). A rank draws the blocks that meet its shard and keeps its rows.
# Hence a 2-rank FSDP2 build's full tensors equal a 1-process build's with the same seed,
# and cpu and cuda builds agree (the numbers are drawn on the CPU, then copied). A rank
# holds at most one block more than its shard, on the host. Fills on tensors that are not
# known (views, temporaries) run unchanged with the global generator, seeded with ``seed``.
# Names are taken without PEFT's wrappers (``_unwrapped_name``): a LoRA model's base draws the
# weights of the same-seed model without adapters.


@contextlib.contextmanager
def seeded_fills(model: torch.nn.Module, seed: int) -> Iterator[None]:
    """Inside, random in-place fills of ``model``'s parameters and buffers draw from ``seed`` (NOTE [ Initial weights from a seed ])."""
    with _SeededFills(model, seed):
        yield


_RANDOM_FILLS = frozenset(
    ("normal_", "uniform_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_")
)


def _local_view(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of ``tensor`` this rank holds and its offset in the global tensor (at least 1-D)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        mesh, placements = tensor.device_mesh, tensor.placements
        if mesh.ndim == 1 and len(placements) == 1 and placements[0].is_shard(0) and tensor.dim() > 0:
            # FSDP2's layout: torch.chunk's rows (torch's general helper builds an index of them)
            rows, world = tensor.shape[0], mesh.size()
            start = min(mesh.get_local_rank() * -(-rows // world), rows)
            shape, offset = (local.shape[0], *tensor.shape[1:]), (start, *(0 for _ in tensor.shape[1:]))
        else:
            shape, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
        if tuple(shape) != tuple(local.shape):  # pragma: no cover - a layout torch may add one day
            raise InvalidArgument(
                f"seed: cannot place this rank's shard of shape {tuple(local.shape)} in a parameter of shape {tuple(tensor.shape)} (placements {tensor.placements}); pass seed=None and sharding='none'"
            )
    else:
        local, offset = tensor, (0,) * tensor.dim()
    if local.dim() == 0:
        return local.view(1), (0,)
    return local, tuple(offset)


def _local_numel(tensor: Any) -> int | None:
    """Elements of ``tensor`` this rank holds (its local shard for a DTensor); ``None`` for a non-tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, torch.Tensor):
        return None
    return (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).numel()


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]] | None:
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if local.device.type == "meta" or local.numel() == 0:
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(tensor.shape))


class _SeededFills(TorchDispatchMode):
    """The dispatch mode behind :func:`seeded_fills`."""

    def __init__(self, model: torch.nn.Module, seed: int):
        super().__init__()
        self.seed = seed
        self.by_id: dict[int, str] = {}
        self.by_storage: dict[tuple[int, int, tuple[int, ...]], str] = {}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for path, tensor in named:
            name = _unwrapped_name(path)
            self.by_id.setdefault(id(tensor), name)
            key = _storage_key(tensor)
            if key is not None:
                self.by_storage.setdefault(key, name)
        self.fills: dict[str, int] = {}

    def _name(self, tensor: Any) -> str | None:
        if not isinstance(tensor, torch.Tensor):
            return None
        name = self.by_id.get(id(tensor))
        if name is None:
            key = _storage_key(tensor)
            name = self.by_storage.get(key) if key is not None else None
        return name

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.__name__.split(".")[0] in _RANDOM_FILLS and args:
            if _local_numel(args[0]) == 0:
                return args[0]  # this rank holds no part of it (uneven shards): nothing to draw
            name = self._name(args[0])
            if name is not None and not any(isinstance(a, torch.Tensor) for a in args[1:]):
                self._fill(func, name, args, kwargs)
                return args[0]
        return func(*args, **kwargs)

    def _fill(self, func: Any, name: str, args: tuple, kwargs: dict) -> None:
        tensor, rest = args[0], args[1:]
        fill = self.fills.get(name, 0)
        self.fills[name] = fill + 1
        local, offset = _local_view(tensor)
        shape = tuple(tensor.shape) or (1,)
        row = math.prod(shape[1:])
        per_block = max(1, SEED_BLOCK_ELEMENTS // max(row, 1))
        lo, hi = offset[0], offset[0] + local.shape[0]
        inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:]))
        whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(inner, shape[1:]))
        in_place = whole_rows and local.device.type == "cpu"
        for block in range(lo // per_block, -(-hi // per_block)) if hi > lo else ():
            first, last = block * per_block, min((block + 1) * per_block, shape[0])
            generator = torch.Generator(device="cpu")
            generator.manual_seed(_block_seed(self.seed, name, fill, block))
            drawn = {**kwargs, "generator": generator}
            if in_place and first >= lo and last <= hi:
                func(local[first - lo : last - lo], *rest, **drawn)
                continue
            values = torch.empty((last - first, *shape[1:]), dtype=local.dtype, device="cpu")
            func(values, *rest, **drawn)
            start, stop = max(first, lo), min(last, hi)
            local[start - lo : stop - lo].copy_(values[(slice(start - first, stop - first), *inner)])
            del values


def _unwrapped_name(path: str) -> str:
    """A parameter's path without PEFT's wrappers: a LoRA model's base draws the same-seed model's weights.

    ``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
    ``model.layers.0.self_attn.q_proj.weight`` (NOTE [ Initial weights from a seed ]); so with
    its adapters' B at zero, a LoRA model starts as the model built without them.
    """
    return path.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _block_seed(seed: int, name: str, fill: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{fill}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


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
