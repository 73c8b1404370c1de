"""What a rollout engine sharing the trainer's GPUs keeps on each of them: :func:`engine_reserve`.

In verl's, SkyRL's, OpenRLHF's and slime's colocated modes a vLLM or SGLang engine generates on
the trainer's GPUs and sleeps while the trainer steps. Asleep it still holds memory no trainer
tensor is: a budget searched under the whole device would leave that out.
:class:`~batchfit.plan.placement.RolloutEngine` says how a framework config runs its engine; :func:`engine_reserve` gives what it keeps on each
GPU while the trainer steps, term by term (:class:`EngineReserve`), which
:func:`batchfit.budget.profile_model` takes off the usable memory like the reserve;
:func:`awake_engine_bytes` gives what it takes while it generates, which the trainer's own
resident state must leave free (:func:`check_awake_phase`).

NOTE [ What a sleeping engine keeps ]
Read in the released code the frameworks pin (vLLM 0.24/0.29/0.30/0.33, SGLang 0.5.23; the
figures marked *reported* are other people's measurements):

- **Weights and KV cache: freed.** vLLM's sleep mode allocates them in its ``CuMemAllocator``
  pool (tags ``weights``, ``kv_cache``); ``sleep(level=1)`` copies the weights to the host and
  unmaps both, level 2 discards both (``v1/worker/gpu_worker.py`` ``sleep``, 0.24;
  ``sleep_mode_backend.py`` ``CuMemBackend.suspend``, 0.30/0.33), then empties torch's cache.
  SGLang's ``release_memory_occupation`` pauses the ``weights`` and ``kv_cache`` regions of
  torch_memory_saver. verl sleeps at level 2 (1 for LoRA adapters), SkyRL at level 2, OpenRLHF
  at level 1, TRL at level 2: the level changes host memory, not the device's.
- **The CUDA-graph pool: kept.** vLLM captures its graphs into torch's graph-private pool, outside
  the ``CuMemAllocator`` pool (0.33 moves them into it only with ``sleep_mode_offload_cudagraph``,
  off by default, ``config/model.py``), and torch frees a private pool only once its graphs are
  destroyed (``c10/cuda/CUDACachingAllocator.cpp`` ``release_cached_blocks``): verl's
  ``rollout.yaml`` says so ("cudagraph in inference engine can not be offloaded during update
  policy"). Its size is not computed from the model by vLLM before capture; batchfit counts
  :data:`GRAPH_BYTES_PER_LAYER` per captured graph and decoder layer (the graphs of one size
  share activations; what each graph adds is per layer: piecewise graphs split at every
  attention). Fitted on the reported pools: Kimi-K2.6 (61 layers, 86 graphs) 1.40 GiB per rank
  (vLLM #47654), 0.27 MiB per graph and layer; Llama-3.2-1B (16 layers, 35 graphs) 0.21 GiB
  (vLLM PR #11349), 0.38 MiB; batchfit takes 0.375 MiB, the larger. The graphs are vLLM's
  default list, :func:`~batchfit.plan.placement.vllm_capture_sizes` (``config/vllm.py``: 51 piecewise and 35 full
  graphs at ``max_num_seqs`` 256), or the config's ``cudagraph_capture_sizes``;
  ``enforce_eager`` captures none. SGLang's pool follows its own reserve heuristic,
  :data:`SGLANG_GRAPH_BYTES_PER_BATCH` per decode batch size (``reserve_for_graph_mb``:
  ``max_bs × 2`` MB; *reported* ~0.8 GB per rank, SGLang PR #32718); verl releases SGLang's
  ``kv_cache`` and ``weights`` only (the pool stays), slime releases every tag (it goes).
- **NCCL: kept.** A tensor-parallel engine's communicators are allocated outside the pools and
  left alone by sleep (``CuMemBackend``'s docstring; ``enable_nccl_comm_suspend`` is off by
  default): *reported* ~1 GiB per rank at TP 4 (vLLM PR #51485) and 958 MiB on 8 GPUs (PR #46234),
  :data:`ENGINE_NCCL_BYTES`; vLLM's custom all-reduce adds :data:`CUSTOM_ALL_REDUCE_BYTES`
  (8 MiB of buffer, 16 MiB of data, 8 MiB of rank data: ``custom_all_reduce.py``). A TP-1 engine
  has no communicator.
- **A CUDA context per engine process: kept.** verl (``distributed_executor_backend="mp"``),
  SkyRL and OpenRLHF (Ray actors) and slime (SGLang servers) run each engine rank in a process
  of its own on the trainer's GPU: :data:`ENGINE_CONTEXT_BYTES`, the upper end of the 0.3–0.5 GiB
  reported for a process with lazily loaded kernels (an engine loads more kernels than a
  trainer's 287 MB, :data:`batchfit.memory.cuda_untracked.CONTEXT_BYTES`). TRL's colocated vLLM
  runs in the trainer's own process: no context of its own.
- **An engine that does not sleep keeps everything**: verl with ``free_cache_engine: false``,
  OpenRLHF without ``--vllm.enable_sleep``, TRL without ``vllm_enable_sleep_mode``. vLLM takes
  ``gpu_memory_utilization × total`` (weights, activations, graphs, KV cache: ``v1/worker/utils.py``
  ``requested_memory``), SGLang ``mem_fraction_static`` of the free memory.

Not modelled: an expert-parallel engine's all-to-all buffers (the #47654 engine, Kimi-K2.6 over
two GB200 nodes, held 6.80–6.95 GiB asleep, of which 1.40 GiB graphs: its all-to-all and
cross-node NCCL buffers are the rest). The engine's own logs give the figure to pass as
``engine_reserve`` instead: vLLM's "Sleep mode freed X GiB memory, Y GiB memory is still in
use" (the device's whole use, the trainer's included), "Graph capturing finished in … took X GiB".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit.errors import DoesNotFitError, InvalidArgument
from batchfit.memory.sizes import GiB, MiB, format_bytes
from batchfit.plan.placement import SGLANG_MAX_BATCH, RolloutEngine

__all__ = [
    "CUSTOM_ALL_REDUCE_BYTES",
    "ENGINE_CONTEXT_BYTES",
    "ENGINE_NCCL_BYTES",
    "GRAPH_BYTES_PER_LAYER",
    "SGLANG_GRAPH_BYTES_PER_BATCH",
    "AwakePhase",
    "EngineReserve",
    "awake_engine_bytes",
    "check_awake_phase",
    "engine_reserve",
    "given_engine_reserve",
]

#: A CUDA context of an engine process (NOTE [ What a sleeping engine keeps ]).
ENGINE_CONTEXT_BYTES = 512 * MiB
#: NCCL's buffers of a tensor-parallel engine rank (reported, NOTE [ What a sleeping engine keeps ]).
ENGINE_NCCL_BYTES = 1 * GiB
#: vLLM's custom all-reduce buffers of a tensor-parallel rank (``custom_all_reduce.py``).
CUSTOM_ALL_REDUCE_BYTES = 32 * MiB
#: What one captured CUDA graph keeps per decoder layer (fitted, NOTE [ What a sleeping engine keeps ]).
GRAPH_BYTES_PER_LAYER = 384 * 1024
#: SGLang's graph reserve per decode batch size (``reserve_for_graph_mb``: ``max_bs × 2`` MB).
SGLANG_GRAPH_BYTES_PER_BATCH = 2 * 1000**2
#: vLLM's ``gpu_memory_utilization`` when a config leaves it out (``config/cache.py``, 0.24–0.33).
VLLM_MEMORY_FRACTION = 0.92


@dataclass(frozen=True)
class EngineReserve:
    """What an engine keeps on each GPU while the trainer steps, term by term (NOTE [ What a sleeping engine keeps ]).

    Attributes:
        context_bytes: the CUDA context of the engine's process on this GPU.
        communicator_bytes: NCCL's buffers and vLLM's custom all-reduce of a tensor-parallel engine.
        graph_pool_bytes: the CUDA-graph pool, kept while asleep.
        awake_bytes: an engine that does not sleep: its whole share of the device.
        graphs: the CUDA graphs counted in ``graph_pool_bytes``.
        layers: the decoder layers counted in ``graph_pool_bytes`` (vLLM).
        given_bytes: the amount given instead of the model (``engine_reserve``), else ``None``.
        engine: the engine modelled, ``None`` when given.
    """

    context_bytes: int = 0
    communicator_bytes: int = 0
    graph_pool_bytes: int = 0
    awake_bytes: int = 0
    graphs: int = 0
    layers: int = 0
    given_bytes: int | None = None
    engine: RolloutEngine | None = None

    @property
    def bytes(self) -> int:
        """The sum: what the budget takes off each GPU's usable memory."""
        if self.given_bytes is not None:
            return self.given_bytes
        return self.context_bytes + self.communicator_bytes + self.graph_pool_bytes + self.awake_bytes

    def describe(self) -> str:
        """The terms in words: ``vllm asleep (TP 2): CUDA context 512.00 MiB + NCCL 1.03 GiB + CUDA graphs 882.00 MiB (86 graphs × 28 layers)``."""
        if self.given_bytes is not None:
            return f"engine_reserve {format_bytes(self.given_bytes)} (given)"
        engine = self.engine
        if engine is None or not engine.colocated:
            return "none: the engine runs on GPUs of its own"
        if not engine.sleeps:
            share = "gpu_memory_utilization" if engine.name == "vllm" else "mem_fraction_static"
            return f"{engine.name} awake (it does not sleep): {share} × the device = {format_bytes(self.awake_bytes)}"
        terms = []
        if self.context_bytes:
            terms.append(f"CUDA context {format_bytes(self.context_bytes)}")
        if self.communicator_bytes:
            terms.append(f"NCCL {format_bytes(self.communicator_bytes)}")
        if self.graph_pool_bytes:
            count = f"{self.graphs} graphs × {self.layers} layers" if engine.name == "vllm" else f"{self.graphs} batch sizes"
            terms.append(f"CUDA graphs {format_bytes(self.graph_pool_bytes)} ({count})")
        return f"{engine.name} asleep (TP {engine.tensor_parallel}): " + (" + ".join(terms) or "nothing")

    def to_dict(self) -> dict[str, Any]:
        """The terms, their sum and the engine (JSON-ready)."""
        return {
            "bytes": self.bytes,
            "context_bytes": self.context_bytes,
            "communicator_bytes": self.communicator_bytes,
            "graph_pool_bytes": self.graph_pool_bytes,
            "awake_bytes": self.awake_bytes,
            "graphs": self.graphs,
            "layers": self.layers,
            "given_bytes": self.given_bytes,
            "engine": None if self.engine is None else self.engine.to_dict(),
        }


def given_engine_reserve(nbytes: int) -> EngineReserve:
    """An :class:`EngineReserve` of ``nbytes`` given by the user (``--engine-reserve``), replacing the model."""
    if nbytes < 0:
        raise InvalidArgument(f"engine_reserve must be 0 or more bytes, but got engine_reserve={nbytes!r}")
    return EngineReserve(given_bytes=int(nbytes))


def awake_engine_bytes(engine: RolloutEngine, device_bytes: int) -> int:
    """What ``engine`` takes of one GPU of ``device_bytes`` while it generates (0 when not colocated).

    vLLM: ``ceil(gpu_memory_utilization × total)`` (``v1/worker/utils.py`` ``requested_memory``: the
    engine refuses to start unless that much is free) and, in a process of its own, its CUDA
    context; SGLang: ``mem_fraction_static`` of the device (of its free memory at start, at most
    the device) and its context.

    Example:
        >>> awake_engine_bytes(RolloutEngine(memory_fraction=0.5, own_process=False), 80 * 2**30) == 40 * 2**30
        True
    """
    if not engine.colocated:
        return 0
    fraction = engine.memory_fraction
    if fraction is None:
        fraction = VLLM_MEMORY_FRACTION if engine.name == "vllm" else 1.0 - 10 * GiB / max(device_bytes, 1)
    context = ENGINE_CONTEXT_BYTES if engine.own_process else 0
    return math.ceil(fraction * device_bytes) + context


def engine_reserve(engine: RolloutEngine | None, config: Any, *, device_bytes: int | None) -> EngineReserve:
    """What ``engine`` keeps on each GPU while the trainer steps (NOTE [ What a sleeping engine keeps ]).

    Args:
        engine: the run's engine (``None`` or not colocated: nothing).
        config: the served model's config (its ``num_hidden_layers`` sizes vLLM's graph pool).
        device_bytes: one GPU's memory (an engine that does not sleep keeps a share of it);
            ``None``: the device's own (cuda), required then only for an engine that does not sleep.

    Raises:
        InvalidArgument: an engine that does not sleep on a device of unknown size.
    """
    if engine is None or not engine.colocated:
        return EngineReserve(engine=engine)
    context = ENGINE_CONTEXT_BYTES if engine.own_process else 0
    if not engine.sleeps:
        if device_bytes is None:
            raise InvalidArgument(
                f"the {engine.name} engine does not sleep, so it keeps a share of the device; pass the device's "
                "memory (memory_limit, --memory) or engine_reserve (--engine-reserve)"
            )
        return EngineReserve(awake_bytes=awake_engine_bytes(engine, device_bytes), engine=engine)
    communicators = 0
    if engine.tensor_parallel > 1:
        communicators = ENGINE_NCCL_BYTES + (CUSTOM_ALL_REDUCE_BYTES if engine.name == "vllm" else 0)
    graphs = 0 if engine.releases_graphs else engine.graph_count()
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if engine.name == "vllm":
        pool = graphs * layers * GRAPH_BYTES_PER_LAYER
    else:
        largest = max(engine.capture_sizes) if engine.capture_sizes else SGLANG_MAX_BATCH
        pool = largest * SGLANG_GRAPH_BYTES_PER_BATCH if graphs else 0
    return EngineReserve(
        context_bytes=context,
        communicator_bytes=communicators,
        graph_pool_bytes=pool,
        graphs=graphs,
        layers=layers if engine.name == "vllm" else 0,
        engine=engine,
    )


@dataclass(frozen=True)
class AwakePhase:
    """One GPU while a colocated vLLM engine generates: what it takes, what the trainer keeps beside it.

    Attributes:
        engine_bytes: what the engine takes awake (:func:`awake_engine_bytes`).
        trainer_bytes: the trainer's state kept on the GPU while the engine generates.
        untracked_bytes: the trainer's own memory outside its tensors (context, workspaces, NCCL).
        device_bytes: the GPU's memory.
    """

    engine_bytes: int
    trainer_bytes: int
    untracked_bytes: int
    device_bytes: int

    @property
    def spare_bytes(self) -> int:
        """What is left of the GPU (negative: the engine cannot start)."""
        return self.device_bytes - self.engine_bytes - self.trainer_bytes - self.untracked_bytes

    def describe(self) -> str:
        """``while vLLM generates: it takes 40.50 GiB, the trainer keeps 14.19 GiB (+ 593.75 MiB untracked): 24.90 GiB to spare``."""
        return (
            f"while vLLM generates: it takes {format_bytes(self.engine_bytes)}, the trainer keeps "
            f"{format_bytes(self.trainer_bytes)} (+ {format_bytes(self.untracked_bytes)} outside its tensors) of "
            f"{format_bytes(self.device_bytes)}: {format_bytes(self.spare_bytes)} to spare"
        )

    def to_dict(self) -> dict[str, Any]:
        """The figures and what is left (JSON-ready)."""
        return {
            "engine_bytes": self.engine_bytes,
            "trainer_bytes": self.trainer_bytes,
            "untracked_bytes": self.untracked_bytes,
            "device_bytes": self.device_bytes,
            "spare_bytes": self.spare_bytes,
        }


def check_awake_phase(
    engine: RolloutEngine | None,
    *,
    device_bytes: int | None,
    trainer_bytes: int,
    untracked_bytes: int,
    fix: str,
) -> AwakePhase | None:
    """The GPU while ``engine`` generates beside the trainer; refuse a run where the engine cannot start.

    vLLM refuses to start unless ``gpu_memory_utilization × total`` is free
    (``v1/worker/utils.py``); while it generates, the trainer keeps ``trainer_bytes`` per GPU
    (the state its framework does not offload between phases) and ``untracked_bytes`` (its own
    CUDA context, workspaces and NCCL). SGLang sizes itself from the free memory and always
    starts; it is not checked.

    Args:
        engine: the run's engine (``None``, not colocated or SGLang: nothing to check).
        device_bytes: one GPU's memory; ``None`` (the device's own, unknown here): nothing checked.
        trainer_bytes: the trainer's state kept on each GPU while the engine generates.
        untracked_bytes: the trainer's own memory outside its tensors.
        fix: what to change, in the config's words (the engine's fraction key and the offload keys).

    Returns:
        The :class:`AwakePhase` when it was checked (and fits), else ``None``.

    Raises:
        DoesNotFitError: one line with both figures and ``fix``.
    """
    if engine is None or not engine.colocated or engine.name != "vllm" or device_bytes is None:
        return None
    phase = AwakePhase(awake_engine_bytes(engine, device_bytes), trainer_bytes, untracked_bytes, device_bytes)
    if phase.spare_bytes >= 0:
        return phase
    room = device_bytes - trainer_bytes - untracked_bytes - (ENGINE_CONTEXT_BYTES if engine.own_process else 0)
    most = math.floor(100 * max(room, 0) / device_bytes) / 100
    fraction = VLLM_MEMORY_FRACTION if engine.memory_fraction is None else engine.memory_fraction
    raise DoesNotFitError(
        f"the colocated vLLM engine cannot start while the trainer keeps its state on the GPU: "
        f"{engine.key('memory_fraction')}={fraction:g} asks for {format_bytes(phase.engine_bytes)} of "
        f"{format_bytes(device_bytes)} per GPU, but the trainer keeps {format_bytes(trainer_bytes)} there while it "
        f"generates (and {format_bytes(untracked_bytes)} outside its tensors); lower {engine.key('memory_fraction')} "
        f"to {most:g} or less, or {fix}",
        needed=phase.engine_bytes + trainer_bytes + untracked_bytes,
        available=device_bytes,
    )
