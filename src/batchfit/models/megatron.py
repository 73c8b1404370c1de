"""Megatron-core's ``GPTModel`` built from a Hugging Face config, the way verl converts it (mbridge), on CPU ranks.

- :func:`transformer_config`: the ``TransformerConfig`` mbridge's bridge builds from a
  transformers config (``mbridge.AutoBridge.from_config``, verl's converter), with what a CPU
  run needs changed (NOTE [ Megatron from a Hugging Face config ]).
- :func:`gpt_model_args`: ``GPTModel``'s own arguments (vocabulary, RoPE, tied embeddings).
- :func:`build_gpt_model`: the model of this rank's tensor/pipeline stage, Megatron-core's
  local layer spec (no Transformer Engine), inside :func:`megatron_cpu_patches`.
- :func:`model_parallel`: Megatron's ``parallel_state`` over the default process group.

Needs ``pip install -e '.[megatron]'`` (megatron-core 0.16.1 and mbridge 0.15.1).

NOTE [ Megatron from a Hugging Face config ]
verl builds its Megatron models through mbridge (``AutoBridge.from_config(hf_config)``, then
``bridge.get_model``); mbridge 0.15.1's ``LLMBridge._build_base_config`` maps ``num_hidden_layers``,
``hidden_size``, ``num_attention_heads``, ``num_key_value_heads`` (GQA: ``num_query_groups``),
``intermediate_size``, ``rms_norm_eps``, ``head_dim`` (``kv_channels``) and fixes RMSNorm, SwiGLU
(``gated_linear_unit`` with SiLU) and no linear biases; its ``Qwen2Bridge`` adds the qkv bias,
``Qwen3Bridge`` the q/k RMSNorm, ``LlamaBridge`` reads ``attention_bias``. That config is used
here as mbridge builds it, with five changes a CPU run needs: ``use_cpu_initialization`` (weights
made on the host, each rank slicing its shard from the full matrix), ``masked_softmax_fusion``
off (a CUDA kernel), fixed tensor shapes between pipeline stages (NOTE [ Megatron under the fake
process group ]), ``sequence_parallel`` as asked (mbridge turns it on whenever TP > 1, as verl
runs) and the parameter dtype asked. Two things of mbridge's are not used: its layer spec
(``get_gpt_decoder_block_spec(use_transformer_engine=True)``: Transformer Engine does not run on
a CPU; Megatron-core's own local spec has the same parameters), and its ``_get_gptmodel_args``,
which reads ``hf_config.rope_theta``, gone in transformers 5 (RoPE lives in
``rope_parameters``): :func:`gpt_model_args` writes those few arguments once. Llama 3's RoPE
scaling becomes ``rope_scaling=True`` with its factor (Megatron's ``apply_rope_scaling`` is
Llama 3.1's formula); no vocabulary padding (``make_vocab_size_divisible_by`` unset, as verl
calls mbridge), so the vocabulary must divide by TP.

NOTE [ Megatron on CPU ranks ]
megatron-core 0.16.1 runs forward and backward on gloo CPU ranks after two patches (verified,
``../shared/facts/megatron_core_tp2_on_cpu.py``, learned absolute positions):
``GlobalMemoryBuffer.get_tensor``, the all-gather buffer of sequence parallelism, allocates on
``torch.cuda.current_device()`` (here on the CPU, the same reuse by name and dtype);
``CudaRNGStatesTracker.fork`` forks CUDA's generator around dropout in tensor-parallel regions
(here a null context: every dropout of the presets is 0, so no random number is drawn under it;
a dropout above 0 draws from torch's CPU generator instead of a forked CUDA one, other values,
the same bytes: ``benchmarks/megatron_referee.py`` runs with dropout 0.1).
RoPE, which every preset uses, needs a third: ``RotaryEmbedding.forward`` moves ``inv_freq`` to
``torch.cuda.current_device()``, as the sequence-parallel gathers and scatters of
``tensor_parallel/mappings.py`` make their outputs there; inside the patches
``torch.cuda.current_device()`` returns the CPU device (on a CPU-only torch it raises anyway).
Sequence parallelism (and bf16) needs a fourth: without Apex, the norms are ``WrappedTorchNorm``, which
refuses ``sequence_parallel`` only because torch's norms do not mark their weights for the
gradient all-reduce over the TP group; Apex's ``FusedLayerNorm`` computes the same norm over the
hidden dimension of each rank's part of the sequence and sets ``weight.sequence_parallel``: the
patched ``WrappedTorchNorm`` builds torch's norm and sets it
(:func:`batchfit.train.megatron_step.finalize_sequence_parallel_grads` sums those gradients).
The same patch makes torch's norms in ``params_dtype``: they take their dtype from torch's
default, so a bf16 model had fp32 norms (87,808 bytes more on qwen2.5-0.5b), where Megatron's
``Float16Module`` casts the whole model (``module.bfloat16()``) and Transformer Engine's norms
take ``params_dtype``.
Pipeline parallelism needs two more: Megatron's schedules make their token counter with
``device="cuda"`` (``total_num_tokens`` in ``schedules.py``), so inside the patches a torch
function mode turns a CUDA device given to any torch function into the CPU, and
``Tensor.cuda()`` into the tensor itself (the copy of a tied embedding on the last stage,
``LanguageModule.setup_embeddings_and_output_layer``), a mode scoped to the block, not a patch; and the exchange of tensor shapes between stages (``variable_seq_lengths``,
which mbridge sets, as verl runs) calls ``torch.cuda.synchronize()`` after its ``isend``/``irecv``
(``P2PCommunicator._communicate_shapes``): a no-op here, where every op is synchronous.

NOTE [ Megatron's DDP and optimizer on CPU ranks ]
Megatron-core 0.16.1's own ``DistributedDataParallel`` and ``get_megatron_optimizer`` (what
:func:`batchfit.train.megatron_step.megatron_optimizer` builds) run on gloo CPU ranks and under
the fake process group with three more changes, besides ``device='cuda'`` turned into the CPU
(``found_inf``, ``_scale_one``, ``_dummy_overflow_buf``: ``optimizer/optimizer.py`` l. 473–485,
907) and ``torch.cuda.current_device()`` (the grad and param buffers, ``param_and_grad_buffer.py``
l. 797–806):
- ``Tensor.type()`` names CUDA's type: ``Float16OptimizerWithFloat16Params`` and
  ``DistributedOptimizer`` sort parameters by ``param.type() in ['torch.cuda.HalfTensor',
  'torch.cuda.BFloat16Tensor']`` (``optimizer/optimizer.py`` l. 671, ``distrib_optimizer.py``
  l. 361, 582) and refuse any other; inside the patches a ``Tensor.type()`` without arguments
  returns ``torch.cuda.BFloat16Tensor`` for a CPU bf16 tensor (the torch function mode);
- ``torch.distributed.all_gather_object`` under the fake process group gives every rank this
  rank's object: ``_get_param_groups`` gathers the parameter-group keys of every rank
  (``optimizer/__init__.py`` l. 181) through a tensor it reads back with ``.numpy()``, which a
  fake tensor has not; dense model-parallel ranks hold the same keys. Real ranks gather;
- ``_coalescing_manager`` in ``param_and_grad_buffer.py`` (l. 274, 433) runs each collective as
  it is called: the fake process group has no coalesced all-reduce
  (``c10d.allreduce_coalesced_`` has no fake kernel), and NCCL's coalescing only batches kernel
  launches (no buffer of its own). Only the synchronous collectives are supported
  (``overlap_grad_reduce`` and ``overlap_param_gather`` off, Megatron's defaults).
The gradient all-reduce, reduce-scatter (distributed optimizer) and the parameter all-gather
after the step then run on gloo, and on fake tensors under the fake group.

NOTE [ Dropout as CUDA runs it ]
ATen's ``dropout`` takes its fused path, ``native_dropout``, only on CUDA (and XPU, lazy and
private-use devices: ``is_fused_kernel_acceptable`` in ``aten/src/ATen/native/Dropout.cpp``); it
saves a **bool** mask for backward, one byte per element. On a CPU tensor, fake or real, the
same ``F.dropout`` multiplies by a noise tensor of the input's dtype and saves that: two bytes per
element in bf16, four in fp32. Inside the patches a ``torch.nn.functional.dropout`` in training
with ``0 < p < 1`` therefore calls ``torch.native_dropout`` (it runs on a CPU too), so the bytes a
dropout keeps are CUDA's (Korthikanti et al.'s ``sbh`` per hidden dropout and ``as²b`` for the
attention's, ``benchmarks/megatron_referee.py``). The presets' dropouts are 0, which saves nothing
on either path.

NOTE [ Megatron's parameters in one dtype ]
A bf16 Megatron run wraps the model in ``Float16Module``, which casts it whole (``module.bfloat16()``).
Built here without it, the few parameters Megatron makes with torch's default dtype stayed fp32:
the learned absolute position embedding (``LanguageModelEmbedding.position_embeddings``, a plain
``torch.nn.Embedding``) made the hidden states fp32 from the first layer on (twice every
activation's bytes under the estimate; a real CPU run refuses the mixed dtypes in its LayerNorm).
:func:`build_gpt_model` builds under torch's default dtype set to ``params_dtype``, the dtype
``Float16Module`` would cast them to (``module.to()`` is not available under fake tensors).

The causal mask is passed in (:class:`batchfit.train.megatron_step.MegatronBatch`): without one,
``FusedScaleMaskSoftmax`` makes it with ``device="cuda"`` (``get_default_causal_mask``). The
patches go through :mod:`batchfit.patching`.

NOTE [ Megatron under the fake process group ]
The estimate backend runs the same model and step under ``FakeTensorMode`` inside
:func:`batchfit.parallel.distributed.simulated_world` (PyTorch's fake process group: this process
is rank 0 of the simulated world, every collective returns at once). megatron-core 0.16.1 needs
one change for it: ``initialize_model_parallel`` creates a gloo copy of several groups by default
(``create_gloo_process_groups=True``), and a gloo group cannot be made over the fake store (an
internal assert in ``ProcessGroupGloo``); :func:`model_parallel` turns them off (on real CPU ranks
the default group is gloo already, and the step uses none of them). Nothing else: its parallel
state, the tensor-parallel layers' all-reduces, the sequence-parallel all-gathers and
reduce-scatters, the vocab-parallel cross-entropy's all-reduces and the global buffer all run on
fake tensors (build with ``initialise=False``: fake tensors have no values to draw). A
pipeline's stages exchange no shapes (``variable_seq_lengths=False``, Megatron-LM's default):
mbridge turns it on for verl's dynamic batches, but the fake group delivers no values, so a
received shape would be garbage; the shapes then come from ``seq_length`` and
``micro_batch_size``, and only the exchange's 3-element int64 tensors are not modelled. On the tiny
preset with TP = 2 the estimate equals each real gloo rank's peak to the byte, category by
category, with and without sequence parallelism (``tests/test_megatron_step.py``). Rank 0 stands
for every rank: dense tensor-parallel ranks hold the same shapes.

Megatron makes two things on first use and keeps them: the RoPE table (``RotaryEmbedding.forward``
is ``lru_cache``'d) and the global memory buffer (``parallel_state._GLOBAL_MEMORY_BUFFER``). The
first step's measurement creates and counts them; a later step sees them as state it did not
create and no one registered (69,632 bytes on the tiny preset at TP = 2, 2 × 64 tokens), so
measure the first step of a fresh model.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from batchfit.errors import InvalidArgument
from batchfit.models.megatron_glm import GLM_MODEL_TYPES, rotary_percent
from batchfit.models.megatron_mla import mla_cpu_patches
from batchfit.models.moe_megatron import moe_cpu_patches
from batchfit.models.specs import load_config
from batchfit.patching import AttributePatch
from batchfit.validation import check_positive_int, is_int

#: The megatron-core release this module was verified with (the newest the registry serves).
MEGATRON_CORE_VERSION = "0.16.1"

_INSTALL = "pip install -e '.[megatron]' in batchfit's checkout (megatron-core==0.16.1, mbridge==0.15.1)"


def require_megatron() -> None:
    """Raise unless megatron-core and mbridge are importable.

    Raises:
        InvalidArgument: one is missing, naming the fix.
    """
    missing = [name for name in ("megatron.core", "mbridge") if importlib.util.find_spec(name.split(".")[0]) is None]
    if missing:
        raise InvalidArgument(f"Megatron models need {' and '.join(missing)}, which are not installed; {_INSTALL}")


# ----------------------------------------------------------------- NOTE [ Megatron on CPU ranks ]
def _global_memory_buffer() -> Any:
    from megatron.core.utils import GlobalMemoryBuffer

    return GlobalMemoryBuffer


def _torch_norm() -> Any:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _param_and_grad_buffer() -> Any:
    from megatron.core.distributed import param_and_grad_buffer

    return param_and_grad_buffer


def _rng_tracker() -> Any:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


def _megatron_random() -> Any:
    from megatron.core.tensor_parallel import random

    return random


_BUFFER_ON_CPU = AttributePatch(_global_memory_buffer, "get_tensor", lazy=True)
_NO_CUDA_FORK = AttributePatch(_rng_tracker, "fork", lazy=True)
_CURRENT_DEVICE_IS_CPU = AttributePatch(lambda: torch.cuda, "current_device")
_NORM_UNDER_SEQUENCE_PARALLEL = AttributePatch(_torch_norm, "__new__", lazy=True)
_NO_CUDA_SYNCHRONIZE = AttributePatch(lambda: torch.cuda, "synchronize")
# NOTE [ Megatron's DDP and optimizer on CPU ranks ]
_OBJECTS_GATHERED_WHEN_SIMULATED = AttributePatch(lambda: torch.distributed, "all_gather_object")
_NO_COALESCING = AttributePatch(_param_and_grad_buffer, "_coalescing_manager", lazy=True)
# recomputation (tensor_parallel.random.CheckpointFunction) saves and restores the RNG states around each layer
_NO_CUDA_RNG_STATE = AttributePatch(_megatron_random, "_get_cuda_rng_state", lazy=True)
_NO_CUDA_RNG_RESTORE = AttributePatch(_megatron_random, "_set_cuda_rng_state", lazy=True)


@_BUFFER_ON_CPU.bind
def _get_tensor_on_cpu(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str, mem_alloc_context: Any = None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` of megatron-core 0.16.1 with the buffer on the CPU (NOTE [ Megatron on CPU ranks ])."""
    required = math.prod(tensor_shape)
    held = self.buffer.get((name, dtype))
    if held is None or held.numel() < required:
        with (mem_alloc_context or contextlib.nullcontext)():
            self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
    return self.buffer[(name, dtype)][0:required].view(*tensor_shape)


@_NO_CUDA_RNG_STATE.bind
def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    """No CUDA generator to save before a recomputed layer: dropout draws from torch's CPU generator (the fork is null)."""
    return None


@_NO_CUDA_RNG_RESTORE.bind
def _no_cuda_rng_restore(*args: Any, **kwargs: Any) -> None:
    """Nothing to restore (:func:`_no_cuda_rng_state`); the CPU generator's state is restored by Megatron itself."""
    return None


@_NO_CUDA_FORK.bind
def _fork_nothing(self: Any, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
    """``CudaRNGStatesTracker.fork`` as a null context (NOTE [ Megatron on CPU ranks ]: dropout 0)."""
    return contextlib.nullcontext()


@_CURRENT_DEVICE_IS_CPU.bind
def _cpu_device() -> torch.device:
    """``torch.cuda.current_device()`` inside :func:`megatron_cpu_patches`: the CPU (NOTE [ Megatron on CPU ranks ])."""
    return torch.device("cpu")


@_NO_CUDA_SYNCHRONIZE.bind
def _synchronize_nothing(device: Any = None) -> None:
    """``torch.cuda.synchronize()`` inside :func:`megatron_cpu_patches`: nothing to wait for (NOTE [ Megatron on CPU ranks ])."""
    return None


@_OBJECTS_GATHERED_WHEN_SIMULATED.bind
def _all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """``torch.distributed.all_gather_object``; under the fake process group every rank's object is this rank's (NOTE [ Megatron's DDP and optimizer on CPU ranks ])."""
    from batchfit.parallel.distributed import is_simulated

    if not is_simulated(group):
        return _OBJECTS_GATHERED_WHEN_SIMULATED.call_below(object_list, obj, group=group)
    for i in range(len(object_list)):
        object_list[i] = obj
    return None


@_NO_COALESCING.bind
@contextlib.contextmanager
def _collectives_one_by_one(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[None]:
    """``torch.distributed._coalescing_manager`` for Megatron's grad buffers: each collective runs as it is called (NOTE [ Megatron's DDP and optimizer on CPU ranks ])."""
    if async_ops:
        raise InvalidArgument(
            "Megatron's gradient and parameter collectives run synchronously on CPU ranks, but got async_ops=True "
            "(overlap_grad_reduce or overlap_param_gather); leave DistributedDataParallelConfig's overlap options off"
        )
    yield None


@_NORM_UNDER_SEQUENCE_PARALLEL.bind
def _torch_norm_marked(cls: Any, config: Any, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``WrappedTorchNorm`` in the parameters' dtype, and under sequence parallelism as Apex's ``FusedLayerNorm`` makes it (NOTE [ Megatron on CPU ranks ])."""
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if sequence_parallel:
        config = copy.copy(config)
        config.sequence_parallel = False
    dtype = getattr(config, "params_dtype", None)
    default = torch.get_default_dtype()
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        torch.set_default_dtype(dtype)  # torch's norms take no dtype from Megatron's config
    try:
        norm = _NORM_UNDER_SEQUENCE_PARALLEL.call_below(cls, config, *args, **kwargs)
    finally:
        torch.set_default_dtype(default)
    if sequence_parallel:
        for param in norm.parameters():
            param.sequence_parallel = True  # its gradient is summed over the TP group (finalize_model_grads)
    return norm


def _names_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # an index is a CUDA device


def _cuda_type_name(name: str) -> str:
    """``Tensor.type()``'s name of the same tensor on CUDA (``torch.BFloat16Tensor`` → ``torch.cuda.BFloat16Tensor``)."""
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


def _dropout_as_cuda_runs_it(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` through ``torch.native_dropout``, as ATen runs it on CUDA (NOTE [ Dropout as CUDA runs it ])."""
    if not training or p == 0 or inplace or not 0 < p < 1 or input.numel() == 0:
        return torch.nn.functional.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]


class _CudaFactoriesOnCpu(TorchFunctionMode):
    """``device="cuda"`` (or a CUDA index) given to a torch function becomes the CPU, ``Tensor.cuda()`` keeps the tensor, ``Tensor.type()`` names CUDA's type (NOTE [ Megatron on CPU ranks ])."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:  # the tied embedding's copy on the last pipeline stage
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # Megatron's optimizers ask for CUDA types
            return _cuda_type_name(func(*args))
        if func is torch.nn.functional.dropout:
            return _dropout_as_cuda_runs_it(*args, **kwargs)
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if kwargs.get("pin_memory"):  # host memory on a GPU (the context-parallel RoPE slice's index); no accelerator here
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_cpu_patches() -> Iterator[None]:
    """Megatron-core runs on CPU tensors inside (NOTE [ Megatron on CPU ranks ]); undone on exit, shared and counted."""
    require_megatron()
    with (
        _BUFFER_ON_CPU.active(),
        _NO_CUDA_FORK.active(),
        _CURRENT_DEVICE_IS_CPU.active(),
        _NORM_UNDER_SEQUENCE_PARALLEL.active(),
        _NO_CUDA_SYNCHRONIZE.active(),
        _OBJECTS_GATHERED_WHEN_SIMULATED.active(),
        _NO_COALESCING.active(),
        _NO_CUDA_RNG_STATE.active(),
        _NO_CUDA_RNG_RESTORE.active(),
        moe_cpu_patches(),
        mla_cpu_patches(),
        _CudaFactoriesOnCpu(),
    ):
        yield


# ----------------------------------------------------------------- parallel state
@contextlib.contextmanager
def model_parallel(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int = 1,
) -> Iterator[None]:
    """Megatron's ``parallel_state`` over the default process group inside; destroyed on exit.

    The default group (real gloo ranks, or :func:`batchfit.parallel.distributed.simulated_world`)
    must have a multiple of ``tensor_parallel * context_parallel * pipeline_parallel`` members; the
    rest is data parallel, in Megatron's order (tp fastest, then cp, then dp, then pp:
    ``order="tp-cp-ep-dp-pp"``). ``virtual_pipeline`` (> 1, with
    ``pipeline_parallel > 1``) sets Megatron's ``virtual_pipeline_model_parallel_size``: each
    stage holds that many model chunks (the interleaved schedule). ``expert_parallel`` and
    ``expert_tensor_parallel`` (Megatron's expert groups, in its expert order ``tp-ep-dp-pp``:
    ``expert_tensor_parallel × expert_parallel`` must divide ``tensor_parallel × context_parallel ×
    data_parallel``) spread a mixture of experts' experts.

    Raises:
        InvalidArgument: no process group, a bad size, a world the sizes do not divide, or
            virtual stages without pipeline parallelism.
    """
    import torch.distributed as dist

    require_megatron()
    tp = check_positive_int("tensor_parallel", tensor_parallel)
    pp = check_positive_int("pipeline_parallel", pipeline_parallel)
    cp = check_positive_int("context_parallel", context_parallel)
    ep = check_positive_int("expert_parallel", expert_parallel)
    etp = check_positive_int("expert_tensor_parallel", expert_tensor_parallel)
    vp = virtual_stages(virtual_pipeline, pp)
    if not dist.is_initialized():
        raise InvalidArgument(
            f"Megatron's model parallelism (tensor_parallel={tp}, pipeline_parallel={pp}) needs a process group; run under torchrun or inside simulated_world"
        )
    world = dist.get_world_size()
    if world % (tp * cp * pp):
        raise InvalidArgument(
            f"world_size={world} must be a multiple of tensor_parallel * context_parallel * pipeline_parallel = {tp * cp * pp}; "
            "change the sizes or the number of ranks"
        )
    if (world // pp) % (ep * etp):
        raise InvalidArgument(
            f"expert_parallel × expert_tensor_parallel = {ep} × {etp} must divide the {world // pp} ranks of a pipeline stage "
            "(Megatron carves the expert groups out of tensor × context × data parallel); change the sizes"
        )
    from megatron.core import parallel_state

    # NOTE [ Megatron under the fake process group ]: no extra gloo groups (the default is gloo already)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


def virtual_stages(virtual_pipeline: int | None, pipeline_parallel: int) -> int | None:
    """Megatron's ``virtual_pipeline_model_parallel_size``: ``None`` for 1 or ``None``; > 1 needs pipeline parallelism."""
    if virtual_pipeline is None:
        return None
    vp = check_positive_int("virtual_pipeline", virtual_pipeline)
    if vp == 1:
        return None
    if pipeline_parallel == 1:
        raise InvalidArgument(
            f"virtual_pipeline={vp} needs pipeline_parallel > 1 (virtual stages interleave a pipeline's stages), but got "
            "pipeline_parallel=1; raise pipeline_parallel or leave virtual_pipeline unset"
        )
    return vp


@contextlib.contextmanager
def simulated_rank(world_size: int, rank: int) -> Iterator[None]:
    """Simulate rank ``rank`` of ``world_size`` in this process with PyTorch's fake process group (NOTE [ Megatron under the fake process group ]).

    :func:`batchfit.parallel.distributed.simulated_world` is always rank 0; a pipeline's stages
    differ (the first embeds, the last holds the head and the loss), so each is simulated as
    the rank it is. The group is destroyed on exit.

    Raises:
        InvalidArgument: a bad size or rank, or a process group already initialised.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from batchfit.parallel.distributed import FAKE_BACKEND

    world_size = check_positive_int("world_size", world_size)
    if not (is_int(rank) and 0 <= rank < world_size):
        raise InvalidArgument(f"rank must be an integer in [0, {world_size}), but got rank={rank!r}; choose a rank of the world")
    if dist.is_initialized():
        raise InvalidArgument(
            f"simulating rank {rank} of {world_size} needs no process group, but one of {dist.get_world_size()} ranks is initialised; simulate outside torchrun"
        )
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- NOTE [ Megatron from a Hugging Face config ]
def transformer_config(
    spec: Any,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    virtual_pipeline: int | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int = 1,
    **overrides: Any,
) -> Any:
    """Megatron's ``TransformerConfig`` for ``spec`` as mbridge converts it, made to run on CPU ranks.

    Args:
        spec: a preset name, a directory, a hub id or a ``PretrainedConfig`` (:func:`batchfit.models.load_config`).
        tensor_parallel: Megatron's ``tensor_model_parallel_size``.
        pipeline_parallel: Megatron's ``pipeline_model_parallel_size``.
        sequence_parallel: Megatron's sequence parallelism (activations split over the TP group
            outside attention); needs ``tensor_parallel > 1``.
        dtype: the parameters' dtype (``params_dtype``, ``pipeline_dtype``; ``bf16`` when bfloat16).
        virtual_pipeline: Megatron's ``virtual_pipeline_model_parallel_size`` (model chunks per
            stage; ``None`` or 1: none); needs ``pipeline_parallel > 1`` and the layers divisible
            by ``pipeline_parallel × virtual_pipeline``.
        context_parallel: Megatron's ``context_parallel_size`` (each sequence cut over that many
            ranks, attention a ring: NOTE [ Context parallelism as Megatron runs it ] in
            :mod:`batchfit.models.megatron_context`; needs the ``sdpa`` layer spec).
        expert_parallel: Megatron's ``expert_model_parallel_size`` (a mixture of experts' experts
            spread over that many ranks, tokens sent by the all-to-all dispatcher: NOTE [ Megatron's
            mixture of experts on CPU ranks ] in :mod:`batchfit.models.moe_megatron`).
        expert_tensor_parallel: Megatron's ``expert_tensor_parallel_size`` (mbridge's default 1).
        **overrides: ``TransformerConfig`` fields to set last (``num_layers=2``, ``recompute_granularity=...``).

    Raises:
        InvalidArgument: megatron missing, a bad size, expert parallelism on a dense model,
            sequence parallelism without tensor parallelism, or virtual stages without pipeline
            parallelism or with layers they do not divide.

    Example (needs megatron):
        >>> transformer_config("qwen2.5-0.5b").num_query_groups  # doctest: +SKIP
        2
    """
    require_megatron()
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates

    tp = check_positive_int("tensor_parallel", tensor_parallel)
    pp = check_positive_int("pipeline_parallel", pipeline_parallel)
    cp = check_positive_int("context_parallel", context_parallel)
    if sequence_parallel and tp == 1:
        raise InvalidArgument(
            "sequence_parallel=True needs tensor_parallel > 1 (Megatron splits the sequence over the tensor-parallel group), but got tensor_parallel=1"
        )
    ep = check_positive_int("expert_parallel", expert_parallel)
    etp = check_positive_int("expert_tensor_parallel", expert_tensor_parallel)
    hf_config = load_config(spec)
    moe = _is_mixture_of_experts(hf_config)
    kind = getattr(hf_config, "model_type", None)
    if moe and kind not in MOE_MODEL_TYPES:
        why = UNMAPPED_MOE_REASONS.get(kind, "a mixture of experts batchfit does not map to Megatron yet")
        raise InvalidArgument(
            f"model_type={kind!r} is {why} (mapped: {', '.join(sorted(MOE_MODEL_TYPES))}); profile it with --sharding fsdp2"
        )
    if moe and tp > 1 and not sequence_parallel:
        # megatron-core 0.16.1 moe_layer.py MoELayer.forward raises ValueError when training so
        raise InvalidArgument(
            f"a mixture of experts at tensor_parallel={tp} needs Megatron's sequence parallelism (Megatron-core's "
            "MoELayer refuses to train without it); pass --megatron-sequence-parallel (sequence_parallel=True), as "
            "verl, SkyRL and slime turn it on with tensor parallelism"
        )
    # Megatron's expert tensor parallelism defaults to the tensor-parallel size and means nothing to a dense model
    if (ep > 1 or etp not in (1, tp)) and not moe:
        raise InvalidArgument(
            f"expert_parallel={ep}, expert_tensor_parallel={etp} need a mixture of experts, but "
            f"model_type={getattr(hf_config, 'model_type', None)!r} is dense; use expert_parallel=1 and expert_tensor_parallel=1"
        )
    vp = virtual_stages(virtual_pipeline, pp)
    if vp is not None:
        layers = int(overrides.get("num_layers", hf_config.num_hidden_layers))
        if layers % (pp * vp):
            raise InvalidArgument(
                f"num_layers={layers} must be divisible by pipeline_parallel × virtual_pipeline = {pp} × {vp} = {pp * vp} "
                "(Megatron gives every model chunk the same layers); choose sizes that divide the layers"
            )
    states = ParallelStates(tp_size=tp, pp_size=pp, vpp_size=vp, cp_size=cp, ep_size=ep, etp_size=etp)
    if kind in MLA_MODEL_TYPES:  # NOTE [ DeepSeek-V3 from a Hugging Face config ]
        from batchfit.models.megatron_mla import deepseek_v3_bridge, deepseek_v3_settings

        bridge = deepseek_v3_bridge(hf_config, dtype=dtype, parallel_states=states)
        overrides = {**deepseek_v3_settings(hf_config, overrides.get("num_layers")), **overrides}
    elif kind in GLM_MODEL_TYPES:  # NOTE [ GLM-4.5 from a Hugging Face config ]: mbridge's GLM4MoEBridge
        from batchfit.models.megatron_glm import glm4_moe_settings

        bridge = AutoBridge.from_config(hf_config, dtype=dtype, parallel_states=states)
        overrides = {**glm4_moe_settings(hf_config, overrides.get("num_layers")), **overrides}
    else:
        bridge = AutoBridge.from_config(hf_config, dtype=dtype, parallel_states=states)
    if moe:
        from batchfit.models.moe_megatron import MOE_CPU_SETTINGS

        overrides = {**MOE_CPU_SETTINGS, **overrides}  # NOTE [ Megatron's mixture of experts on CPU ranks ]
    bridge.set_extra_args(
        use_cpu_initialization=True,
        variable_seq_lengths=False,
        masked_softmax_fusion=False,
        sequence_parallel=bool(sequence_parallel),
        context_parallel_size=cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        # mbridge turns overlap_p2p_comm on with virtual stages; off (Megatron's default) each exchange is waited on
        **{"overlap_p2p_comm": False, **overrides},
    )
    return bridge.config


#: Mixtures of experts mapped to Megatron (NOTE [ Megatron's mixture of experts on CPU ranks ]): mbridge's bridges
#: whose every layer is a MoE under megatron-core's local spec with standard attention, DeepSeek-V3 (dense first
#: layers, multi-latent attention: Megatron's decoder block spec, NOTE [ DeepSeek-V3 from a Hugging Face config ]) and
#: GLM-4.5 (mbridge's bridge: dense first layers, a shared expert, the sigmoid router's expert bias, the qkv bias, partial
#: RoPE; NOTE [ GLM-4.5 from a Hugging Face config ]). gpt-oss is refused, saying why (NOTE [ gpt-oss under Megatron ]).
MOE_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"})
# NOTE [ gpt-oss under Megatron ]
# megatron-core 0.16.1 has every piece of gpt-oss: attention sinks (``softmax_type="learnable"``: a learned offset per
# head), sliding-window layers (``window_size`` with ``window_attn_skip_freq=2``), the clamped SwiGLU
# (``activation_func_clamp_value``, ``glu_linear_offset``), the router's and experts' biases (``add_bias_linear``) and
# YaRN (``position_embedding_type="yarn"``); Megatron-LM's own example trains it with Transformer Engine
# (``examples/gptoss/02_train.sh``, NVIDIA/Megatron-LM d98e8a64: ``--transformer-impl transformer_engine
# --softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2 --quick-geglu --glu-linear-offset 1.0
# --activation-func-clamp-value 7.0``). mbridge 0.15.1 has no bridge for it. The sinks are what stops a CPU run:
# fused, they are Transformer Engine's (``TEDotProductAttention`` passes ``softmax_type``, extensions/
# transformer_engine.py), which does not run here; batchfit's stand-in for fused attention (``SdpaAttention``, NOTE
# [ Fused attention for Megatron budgets ]) is PyTorch's kernel, which takes no sink; and megatron-core's local
# ``DotProductAttention`` runs them (``SoftmaxOne`` over the scores) only on its unfused path, whose ``[b, heads, s, s]``
# scores a budget would count and no GPU run keeps. So gpt-oss is refused by name. Mapping it needs the sink in
# ``SdpaAttention`` (its ``[heads/t]`` parameter, the output scaled by ``sigmoid(lse - sink)`` from the kernel's
# log-sum-exp) and a bridge of the fields above.
#: Why a mixture of experts is not mapped, where it is known (NOTE [ gpt-oss under Megatron ]).
UNMAPPED_MOE_REASONS = {
    "gpt_oss": (
        "a mixture of experts not mapped to Megatron: its attention sinks (megatron-core 0.16.1's softmax_type='learnable') run fused only in "
        "Transformer Engine's attention, which does not run on a CPU; batchfit's stand-in for it (PyTorch's "
        "scaled_dot_product_attention) has no sinks, megatron-core's unfused DotProductAttention would budget "
        "[b, heads, s, s] scores no GPU run keeps, and mbridge 0.15.1 has no gpt-oss bridge"
    ),
}
#: Models with multi-latent attention (:mod:`batchfit.models.megatron_mla`).
MLA_MODEL_TYPES = frozenset({"deepseek_v3"})


def _is_mixture_of_experts(hf_config: Any) -> bool:
    return any(
        getattr(hf_config, key, None)
        for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
    )


def gpt_model_args(spec: Any) -> dict[str, Any]:
    """``GPTModel``'s arguments beside its config: vocabulary, context, RoPE, tied embeddings.

    The RoPE base comes from transformers 5's ``rope_parameters`` (or 4.x's ``rope_theta``);
    Llama 3's scaling becomes Megatron's ``rope_scaling`` with its factor (NOTE [ Megatron from a
    Hugging Face config ]).
    """
    hf_config = load_config(spec)
    rope = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    args: dict[str, Any] = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": 10000 if base is None else base,
        "share_embeddings_and_output_weights": bool(getattr(hf_config, "tie_word_embeddings", False)),
    }
    if rotary_percent(hf_config) != 1.0:  # GLM-4.5's partial RoPE (NOTE [ GLM-4.5 from a Hugging Face config ])
        args["rotary_percent"] = rotary_percent(hf_config)
    if rope.get("rope_type", rope.get("type")) == "llama3":
        args["rope_scaling"] = True
        args["rope_scaling_factor"] = float(rope["factor"])
    return args


def build_gpt_model(
    spec: Any,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    initialise: bool = True,
    gpt_args: Mapping[str, Any] | None = None,
    virtual_pipeline: int | None = None,
    vp_stage: int | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int = 1,
    **overrides: Any,
) -> torch.nn.Module:
    """This rank's ``GPTModel`` (its tensor shard of its pipeline stage, or of one model chunk of it), in ``train()`` mode.

    Build it inside :func:`model_parallel` with the same sizes; Megatron's ``parallel_state``
    decides the stage (``pre_process`` on the first, ``post_process`` with the output layer on
    the last) and the layers this stage builds. Runs inside :func:`megatron_cpu_patches`; the
    model's forward must run inside them too.

    Args:
        spec, tensor_parallel, pipeline_parallel, sequence_parallel, context_parallel, dtype,
            overrides: as :func:`transformer_config`.
        initialise: draw the initial weights (Megatron's ``perform_initialization``; its CPU
            path draws the full matrix and slices this rank's shard); ``False`` leaves them
            empty (for counting, or under a meta or fake device).
        gpt_args: ``GPTModel`` arguments to set over :func:`gpt_model_args`'s
            (``{"position_embedding_type": "learned_absolute"}``, as Korthikanti et al.'s GPT);
            ``transformer_layer_spec`` may be a function of the ``TransformerConfig`` and
            ``vp_stage`` (:func:`batchfit.models.megatron_attention.layer_spec`), default Megatron's
            local spec (its decoder block spec for DeepSeek-V3, with PyTorch's fused attention).
        virtual_pipeline, vp_stage: with virtual stages (:func:`transformer_config`), the model
            chunk ``vp_stage`` of ``virtual_pipeline`` this builds (Megatron's ``vp_stage``: its
            layers, and the embedding or the head when it is the pipeline's first or last);
            :func:`build_gpt_chunks` builds them all.

    Raises:
        InvalidArgument: as :func:`transformer_config`; Megatron's parallel state not initialised
            with these sizes; a vocabulary that tensor parallelism does not divide; a
            ``vp_stage`` outside ``[0, virtual_pipeline)``.
    """
    from megatron.core import parallel_state

    config = transformer_config(
        spec,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        sequence_parallel=sequence_parallel,
        dtype=dtype,
        virtual_pipeline=virtual_pipeline,
        context_parallel=context_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
        perform_initialization=bool(initialise),
        **overrides,
    )
    chunks = config.virtual_pipeline_model_parallel_size
    if (vp_stage is not None) if chunks is None else not (is_int(vp_stage) and 0 <= vp_stage < chunks):
        raise InvalidArgument(
            f"vp_stage={vp_stage!r} must be a model chunk in [0, {chunks}) with virtual_pipeline={virtual_pipeline!r} "
            "(and None without virtual stages); build every chunk with build_gpt_chunks"
        )
    ready = parallel_state.model_parallel_is_initialized()
    have = (
        parallel_state.get_tensor_model_parallel_world_size() if ready else None,
        parallel_state.get_pipeline_model_parallel_world_size() if ready else None,
        parallel_state.get_context_parallel_world_size() if ready else None,
        parallel_state.get_expert_model_parallel_world_size() if ready else None,
    )
    want = (
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        config.context_parallel_size,
        config.expert_model_parallel_size,
    )
    if have != want:
        raise InvalidArgument(
            f"build_gpt_model(tensor_parallel={tensor_parallel}, pipeline_parallel={pipeline_parallel}, context_parallel={context_parallel}, "
            f"expert_parallel={expert_parallel}) needs Megatron's parallel state of those sizes, but it has (tp, pp, cp, ep)={have}; "
            f"build inside model_parallel({tensor_parallel}, {pipeline_parallel}, context_parallel={context_parallel}, expert_parallel={expert_parallel})"
        )
    args = {**gpt_model_args(spec), **dict(gpt_args or {})}
    if args["vocab_size"] % config.tensor_model_parallel_size:
        raise InvalidArgument(
            f"vocab_size={args['vocab_size']} must be divisible by tensor_parallel={tensor_parallel} (no vocabulary padding, as verl calls mbridge); choose a tensor_parallel that divides it"
        )
    from megatron.core.models.gpt.gpt_model import GPTModel

    layer_spec = args.pop("transformer_layer_spec", None)  # a ModuleSpec, or a function of the config (and vp_stage) making one
    if layer_spec is None:  # with experts: Megatron's MoELayer, SequentialMLP (NOTE [ Megatron's mixture of experts on CPU ranks ])
        from batchfit.models.megatron_attention import layer_spec as local_spec

        # multi-latent attention runs with PyTorch's fused attention only (megatron_attention.layer_spec)
        attention = "sdpa" if getattr(config, "multi_latent_attention", False) else "local"
        layer_spec = local_spec(config, attention=attention, vp_stage=vp_stage)
    elif callable(layer_spec):
        layer_spec = layer_spec(config, vp_stage=vp_stage)  # a decoder block spec holds this chunk's layers
    default = torch.get_default_dtype()
    if config.params_dtype.is_floating_point:
        torch.set_default_dtype(config.params_dtype)  # NOTE [ Megatron's parameters in one dtype ]
    try:
        with megatron_cpu_patches():
            model = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                **args,
            )
    finally:
        torch.set_default_dtype(default)
    return model.train()


def build_gpt_chunks(spec: Any, *, virtual_pipeline: int | None = None, **kwargs: Any) -> list[torch.nn.Module]:
    """This rank's model chunks: ``[build_gpt_model(...)]`` without virtual stages, else one per virtual stage.

    With ``virtual_pipeline = v`` (> 1) stage ``r`` of ``p`` holds chunks ``0 … v-1``, chunk ``i``
    the layers of virtual stage ``i·p + r`` (``L / (p·v)`` each, Megatron's interleaved order); the
    first chunk of the first stage embeds and the last chunk of the last stage holds the head.
    Build inside :func:`model_parallel` with the same ``virtual_pipeline``. Megatron-LM's
    ``get_model`` builds them the same way.

    Raises:
        InvalidArgument: as :func:`build_gpt_model`.
    """
    pp = int(kwargs.get("pipeline_parallel", 1))
    vp = virtual_stages(virtual_pipeline, pp)
    if vp is None:
        return [build_gpt_model(spec, **kwargs)]
    return [build_gpt_model(spec, virtual_pipeline=vp, vp_stage=i, **kwargs) for i in range(vp)]
