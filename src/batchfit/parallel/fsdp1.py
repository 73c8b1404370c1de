"""PyTorch's FSDP1 (``FullyShardedDataParallel``) applied to a causal LM as verl 0.9.1 applies it.

:func:`wrap_fsdp1` is what :func:`batchfit.parallel.shard.shard_model` runs for
``Sharding("fsdp1", ...)``; :func:`is_fsdp1` tells the wrapper apart. On the estimate backend
the process group is simulated and the model's tensors are fake: FSDP1's real code predicts
one rank's memory, as FSDP2's does (its data-pointer tests made right for fake tensors: NOTE
[ FSDP1 compares data pointers ] in :mod:`batchfit.memory.fake_fsdp1`).

NOTE [ FSDP1 as verl wraps it ]
verl's default ``strategy: fsdp`` is FSDP1 (``verl/workers/engine/fsdp/transformer_impl.py``,
``_build_fsdp_module``; ``verl/utils/fsdp_utils.py``, ``get_fsdp_wrap_policy``;
``verl/workers/engine/fsdp/utils.py``, ``get_sharding_strategy``), with the defaults of its
generated ``_generated_ppo_trainer.yaml``. :func:`wrap_fsdp1` passes the same arguments:

- ``auto_wrap_policy``: ``transformer_auto_wrap_policy`` over the decoder-layer class (verl
  reads it from ``_no_split_modules``; here the class of :func:`batchfit.parallel.shard.decoder_layers`' blocks), so
  one unit per decoder layer and the root unit for the rest (embeddings, final norm, head or
  value head). For a LoRA (PEFT) model verl adds its lambda policy: every leaf module whose
  ``weight`` requires grad (the adapters) is a unit of its own, so that no flat parameter mixes
  frozen and trainable parameters. :func:`wrap_policy` builds it; see NOTE [ LoRA under FSDP1 ].
- ``sharding_strategy``: ``FULL_SHARD`` (``reshard_after_forward: true``, verl's default) or
  ``SHARD_GRAD_OP`` (``false``): on a 1-D mesh, what ``get_sharding_strategy`` picks.
  FSDP1 never frees the root unit after forward: it stays gathered until its backward.
- ``mixed_precision``: ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32,
  buffer_dtype=fp32)`` (verl's defaults) for ``mixed_precision="bf16"``; none for ``"none"``.
- ``use_orig_params=False`` (the generated config's ``use_orig_params: false``): the wrapped
  model's ``parameters()`` are the units' ``FlatParameter`` shards, which the optimizer steps.
- ``cpu_offload``: ``CPUOffload(offload_params=True)`` for ``offload="cpu"`` (verl forces it
  for a forward-only reference model and never trains with it: its comment says it gives
  wrong results with gradient accumulation).
- ``forward_prefetch=False`` (verl's default); ``backward_prefetch`` (``BACKWARD_PRE``) and
  ``limit_all_gathers`` (``True``) FSDP1's defaults, which verl keeps.

NOTE [ LoRA under FSDP1 ]
PEFT's ``lora.Linear.forward`` casts the layer's input to ``lora_A.weight.dtype`` before the
adapters run. Under FSDP1 that attribute is read in the decoder layer's unit, before the
adapter's own unit gathers it; with ``use_orig_params=False`` it is a view FSDP1 left behind,
of freed storage (0 bytes) but with a dtype: fp32 (the flat parameter's) until the adapter's
first forward, bf16 (its gathered buffer's) after it (checked on the tiny preset). So with bf16 mixed
precision the first forward casts the bf16 input to fp32 and hands it to a unit that
computes in bf16: ``expected m1 and m2 to have the same dtype`` on real tensors (torch 2.13,
PEFT 0.21; reproduced on the tiny preset, 2 simulated ranks, cpu backend); the estimate
does not check that and measured the fp32 copies (the tiny preset, rank 8: the first probe
502,272 B above the next ones). From the second forward on PEFT reads bf16 and casts nothing.
verl runs because its engine computes under ``torch.autocast(dtype=param_dtype)``
(``transformer_impl.py``, ``forward_step``), which feeds the GEMM bf16 whatever PEFT cast;
its training micro-batches then run in that steady state: bf16 input, no copy (only the first
forward after a full-precision ``summon_full_params``, its LoRA weight sync, casts again, in
its forward-only log-prob pass). :func:`wrap_fsdp1` models the steady state from the first
step: with bf16 mixed precision it turns off PEFT's input cast on the adapted layers (PEFT's
own switch, ``cast_input_dtype_enabled``, which ``peft.helpers.disable_input_dtype_casting``
sets), so every probe measures what verl's update does. Without mixed precision every unit
computes in its own dtype and PEFT's cast is what runs (an fp32 copy of the input for fp32
adapters on a bf16 base: NOTE [ LoRA as the frameworks build it ] in
:mod:`batchfit.models.lora`). verl also casts fp32 adapters to a bf16 base's dtype
(``_build_lora_module``); FSDP1 needs it only within one flat parameter, and the adapters are
units of their own, so batchfit keeps PEFT's dtype as it does for ``fsdp2``.

Not reproduced: ``sync_module_states=True`` (verl broadcasts rank 0's weights once at
construction; batchfit initialises every rank from one seed already) and ``param_init_fn``
(see NOTE [ FSDP1 wraps a materialised model ]).

NOTE [ FSDP1 wraps a materialised model ]
FSDP1 flattens each unit's parameters into one ``FlatParameter`` (a copy) and keeps the
rank's chunk; unlike FSDP2 it cannot take the meta DTensor shards that keep an ``fsdp2``
rank's build at its shard (NOTE [ Models are built on the meta device ] in
:mod:`batchfit.models.build`), and its ``param_init_fn`` materialises one module at a time,
without the names that the seeded initialisation draws by (NOTE [ Initial weights from a
seed ]). So the model is built and initialised on the host as for ``none``, from the same
seed, and then wrapped; given ``device_id``, FSDP1 moves each unit to the device as it
wraps it (verl's rank 0 loads its whole model on the CPU the same way). The device thus
holds at most the shards plus one unit while wrapping; the host holds the whole model until
the wrap is done. On the cpu backend host and device are one memory: the build peaks at
the whole model plus one unit's flat copy.

NOTE [ FSDP1 initialised at the wrap ]
FSDP1 allocates its per-unit state (the low-precision shard buffer, the gathered flat
buffer, CPU offload's pinned shard and gradient) lazily, in the first forward. The wrap runs
that initialisation at once (``_lazy_init``), so the model's persistent state exists before
any probe is measured, as it does after a trainer's first step. CPU offload pins host memory
for faster copies: on a torch without an accelerator (this project's CPU machines) and for
fake tensors pinning fails (``Cannot access accelerator device``, ``NYI: aten._pin_memory``),
so there the shard and the gradient stay in ordinary host memory: the same bytes.

NOTE [ FSDP1 in the breakdown ]
What the live-storage tracker sees of FSDP1 (checked against PyTorch's ``MemTracker`` on two
gloo ranks, ``tests/test_fsdp1.py``), in FSDP2's categories where the roles match:

- ``gathered_parameters``: each unit's gathered flat buffer (``_full_param_padded``), which
  FSDP1 allocates and frees with ``storage.resize_`` (the tracker wraps it) and all-gathers
  into (on CPU tensors, so under the estimate too, as an ``all_gather`` into chunks of it; on
  CUDA as ``all_gather_into_tensor``: the same bytes); with bf16 mixed precision also the
  all-gather's input, the low-precision shard ``_mp_shard``, grown the same way and freed
  after the gather. The root unit stays gathered from its forward to its backward (FSDP1
  never reshards the root after forward), every unit does under ``SHARD_GRAD_OP``.
- ``gradients``: the resident sharded gradient (the ``FlatParameter``'s ``.grad``, set aside
  during backward and added into), the reduce-scatter's output (a new sharded gradient, freed
  once added), and -- unlike FSDP2 -- a unit's unsharded gradient between its backward and its
  reduce-scatter: FSDP1's autograd leaf is the ``FlatParameter`` itself, so autograd
  accumulates the unsharded gradient (bf16 under mixed precision) into its ``.grad``
  (``MemTracker`` calls it Gradient too; FSDP2's unsharded gradients are ``activations``).
- ``communication``: the reduce-scatter's input, the fp32 copy of that gradient
  (``reduce_dtype``), from the collective on (a temporary, ``activations``, until then).
- ``optimizer_state``: AdamW's moments of the flat shards, and one step counter per unit.

Not modelled, with CPU offload on a GPU (the simulation's "device" is the host, where
FSDP1's copies between the two are no-ops): the device copy of a unit's shard made to gather
it (one unit's shard, 1/N of a unit, while it is gathered), and in training the sharded
gradients FSDP1 keeps on the device from each unit's reduce-scatter to the end of backward
(up to the whole fp32 sharded gradient) before copying them to the host. verl gives CPU
offload to its forward-only reference model only, which needs neither.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any

import torch

from batchfit.parallel.sharding import Sharding
from batchfit.patching import AttributePatch


def is_fsdp1(model: torch.nn.Module) -> bool:
    """True when ``model`` is an FSDP1 ``FullyShardedDataParallel`` wrapper."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def wrap_policy(model: torch.nn.Module, layers: Iterable[torch.nn.Module]) -> Any:
    """verl's ``get_fsdp_wrap_policy`` for ``model`` (NOTE [ FSDP1 as verl wraps it ]): the class of its decoder ``layers``, and LoRA's trainable leaves."""
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy

    layer_classes = {type(layer) for layer in layers}
    policies = []
    if hasattr(model, "peft_config"):  # a PeftModel: verl's is_lora, with min_num_params 0

        def trainable_leaf(module: torch.nn.Module) -> bool:
            weight = getattr(module, "weight", None)
            return len(list(module.named_children())) == 0 and weight is not None and weight.requires_grad

        policies.append(functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf))
    policies.append(functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes))
    return functools.partial(_or_policy, policies=policies)


def wrap_fsdp1(
    model: torch.nn.Module,
    sharding: Sharding,
    layers: Iterable[torch.nn.Module],
    group: Any = None,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """``FullyShardedDataParallel(model, ...)`` with verl's arguments (NOTE [ FSDP1 as verl wraps it ]), initialised.

    Args:
        model: a transformers causal LM or value-head model (or a PEFT model), materialised
            (NOTE [ FSDP1 wraps a materialised model ]): on ``device``, or on the host to be
            moved there unit by unit; fake tensors on the estimate backend (call inside its
            context).
        sharding: ``Sharding("fsdp1", ...)``; its options pick the sharding strategy, mixed
            precision and offload.
        layers: the model's decoder layers (:func:`batchfit.parallel.shard.decoder_layers`):
            their class is the unit FSDP1 wraps.
        group: the process group (``None``: the default one, e.g. a simulated world).
        device: the device to compute on (default: the parameters' device).

    Returns:
        The ``FullyShardedDataParallel`` root, lazily initialised already (NOTE [ FSDP1
        initialised at the wrap ]).

    A PEFT (LoRA) model is wrapped as verl wraps it (NOTE [ LoRA under FSDP1 ]).
    """
    from torch.distributed.fsdp import (
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp._runtime_utils import _lazy_init

    where = torch.device(device) if device is not None else next(model.parameters()).device
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": wrap_policy(model, layers),
        "device_id": where,
        "sharding_strategy": (
            ShardingStrategy.FULL_SHARD if sharding.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
        ),
        "use_orig_params": False,
        "forward_prefetch": False,
    }
    if group is not None:
        kwargs["process_group"] = group
    if sharding.mixed_precision == "bf16":
        kwargs["mixed_precision"] = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
        )
    if sharding.offload == "cpu":
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    wrapped = FullyShardedDataParallel(model, **kwargs)
    if sharding.mixed_precision == "bf16":
        _compute_adapters_in_the_units_dtype(wrapped)
    with _pinning_where_possible():  # NOTE [ FSDP1 initialised at the wrap ]
        _lazy_init(wrapped, wrapped)
    return wrapped


def _compute_adapters_in_the_units_dtype(model: torch.nn.Module) -> None:
    """Turn off PEFT's cast of an adapted layer's input to its adapter's dtype (NOTE [ LoRA under FSDP1 ]).

    Every PEFT tuner layer (``BaseTunerLayer``: the one with ``_cast_input_dtype``) gets
    ``cast_input_dtype_enabled = False``; a model without adapters is left as it is.
    """
    for module in model.modules():
        if callable(getattr(module, "_cast_input_dtype", None)):
            module.cast_input_dtype_enabled = False


def _can_pin() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()  # pragma: no cover - torch before torch.accelerator


#: ``Tensor.pin_memory`` while FSDP1 initialises (NOTE [ Patched once, restored exactly ] in
#: :mod:`batchfit.patching`): a fake tensor, or any tensor on a torch without an accelerator,
#: is returned as it is (host memory all the same, NOTE [ FSDP1 initialised at the wrap ]).
_PIN = AttributePatch(lambda: torch.Tensor, "pin_memory")


@_PIN.bind
def _pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(self) or not _can_pin():
        return self
    return _PIN.call_below(self, *args, **kwargs)


def _pinning_where_possible() -> contextlib.AbstractContextManager[None]:
    """Inside, ``Tensor.pin_memory()`` of a fake tensor, or on a torch without an accelerator, returns the tensor itself."""
    return _PIN.active()
