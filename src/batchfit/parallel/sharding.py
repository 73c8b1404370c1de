"""How a model is spread over data-parallel ranks: :class:`Sharding` (a strategy and its memory options).

Four strategies, one name each:

- ``none``: one device holds the whole model, its gradients and optimizer state.
- ``ddp``: every rank holds a full replica plus DDP's gradient buckets (PyTorch
  ``DistributedDataParallel``, ``gradient_as_bucket_view=False``, its default).
- ``fsdp2``: PyTorch ``torch.distributed.fsdp.fully_shard`` on every decoder layer and then
  on the root (embeddings, final norm, head), the way SkyRL, verl and torchtitan wrap: each
  rank holds ``1/world_size`` of the parameters, gradients and optimizer state, and
  gathers one layer's parameters at a time.
- ``fsdp1``: PyTorch's ``FullyShardedDataParallel`` (FSDP1, verl's default ``strategy: fsdp``),
  wrapped as verl 0.9.1 wraps it: one unit per decoder layer and the root, each unit's
  parameters flattened into one ``FlatParameter`` and sharded (:mod:`batchfit.parallel.fsdp1`).

The options that change memory under ``fsdp2`` and ``fsdp1``: ``reshard_after_forward``
(``False`` keeps every layer's gathered parameters from forward to backward; FSDP1's
``SHARD_GRAD_OP`` instead of ``FULL_SHARD``), ``mixed_precision`` (``"bf16"``: fp32 sharded
parameters, bf16 compute, fp32 gradient reduction, i.e.
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, what SkyRL and verl run, and
FSDP1's ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=fp32)``;
``"none"``: parameters, compute and reduction in the model's dtype) and ``offload``
(``"cpu"``: ``CPUOffloadPolicy``, sharded parameters, gradients and optimizer state in host
memory, the optimizer step on the CPU; FSDP1's ``CPUOffload(offload_params=True)``, which
verl gives its forward-only reference model).

- ``megatron``: Megatron-core's ``GPTModel`` split ``tensor_parallel`` ways within each layer,
  each sequence over ``context_parallel`` ranks and the layers over ``pipeline_parallel`` stages,
  data parallel over the rest of ``world_size`` (Megatron's order: tp fastest, then cp, then dp,
  then pp); ``megatron_sequence_parallel`` splits the activations
  outside attention over the tensor-parallel group, ``distributed_optimizer`` shards the optimizer
  state over data parallel. Profiled by its own probe (:mod:`batchfit.budget.megatron_profile`).
- ``zero1`` / ``zero2``: DeepSpeed ZeRO stage 1 / 2 (what OpenRLHF and many TRL users run):
  parameters replicated (one flat 16-bit buffer), the fp32 master copy and AdamW's state
  partitioned over the ranks, and for ``zero2`` the gradients too
  (:mod:`batchfit.parallel.zero`). Their options: ``reduce_bucket_size`` (elements,
  DeepSpeed's default 500,000,000) and ``overlap_comm`` (two buckets).

``sequence_parallel`` (``sp``, ``fsdp1``/``fsdp2`` only) splits each packed micro-batch over groups
of ``sp`` consecutive ranks with Ulysses attention (NOTE [ Ulysses sequence parallelism ] in
:mod:`batchfit.parallel.sequence`), as verl's ``ulysses_sequence_parallel_size`` and SkyRL's
``sequence_parallel_size`` do: parameters, gradients and optimizer state stay sharded over the
whole ``world_size`` (``dp × sp``: verl's ``fsdp_workers.py`` and SkyRL's FSDP2 strategy shard over
every rank and build the ``(dp, sp)`` mesh only for the data), and each rank runs ``1/sp`` of a
micro-batch's tokens.

Each strategy is one :class:`~batchfit.parallel.strategies.StrategySpec` in
:mod:`batchfit.parallel.strategies`; :class:`Sharding` validates its options from the spec
(``gathers_layers``: FSDP's options; ``sequence_parallel``: the Ulysses axis; ``zero_stage``:
ZeRO's options), and :attr:`Sharding.spec` is what code outside :mod:`batchfit.parallel` asks.

This module is configuration only (no process groups): :func:`batchfit.models.shard_model`
applies a :class:`Sharding` to a model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.parallel.strategies import StrategySpec, get_strategy, strategy_names
from batchfit.validation import check_choice, check_positive_int

#: The registered strategies' names (:mod:`batchfit.parallel.strategies`).
STRATEGIES = strategy_names()
#: The strategies that shard parameters, gradients and optimizer state (and have the FSDP options).
FSDP_STRATEGIES = tuple(n for n in STRATEGIES if get_strategy(n).gathers_layers)
#: DeepSpeed ZeRO stages 1 and 2: parameters replicated, optimizer state (and stage 2's gradients) partitioned.
ZERO_STRATEGIES = tuple(n for n in STRATEGIES if get_strategy(n).zero_stage)
#: The strategies that split each layer over tensor-parallel ranks and the layers over pipeline stages (Megatron).
MODEL_PARALLEL_STRATEGIES = tuple(n for n in STRATEGIES if get_strategy(n).model_parallel)
#: DeepSpeed's default ``zero_optimization.reduce_bucket_size`` (elements).
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000
MIXED_PRECISION = ("bf16", "none")
OFFLOAD = ("none", "cpu")


@dataclass(frozen=True)
class Sharding:
    """A data-parallel strategy and the options that change its memory, validated on creation.

    Attributes:
        strategy: ``"none"``, ``"ddp"``, ``"fsdp1"`` or ``"fsdp2"`` (module docstring).
        world_size: data-parallel ranks the model is spread over (``>= 1``).
        reshard_after_forward: ``fsdp1``/``fsdp2`` only: free each layer's gathered
            parameters after its forward (default ``True``, FSDP2's default and FSDP1's
            ``FULL_SHARD``; ``False`` is FSDP1's ``SHARD_GRAD_OP``).
        mixed_precision: ``"bf16"`` or ``"none"``; default (``None``) ``"bf16"`` with
            ``fsdp1``/``fsdp2``, ``"none"`` otherwise. ``"bf16"`` is ``fsdp1``/``fsdp2`` only.
        offload: ``"none"`` or ``"cpu"`` (``fsdp1``/``fsdp2`` only).
        sequence_parallel: ranks each packed micro-batch is split over (Ulysses; ``fsdp1``/``fsdp2``
            only); divides ``world_size``; default 1 (no split).
        reduce_bucket_size: ``zero1``/``zero2`` only: the gradient bucket's elements
            (DeepSpeed's ``zero_optimization.reduce_bucket_size``, default 500,000,000).
        overlap_comm: ``zero1``/``zero2`` only: DeepSpeed's ``overlap_comm`` (two buckets).
        tensor_parallel, pipeline_parallel: ``megatron`` only: the tensor-parallel group's size and
            the pipeline's stages; their product divides ``world_size`` (default 1).
        megatron_sequence_parallel: ``megatron`` only: Megatron's sequence parallelism (the
            activations outside attention split over the tensor-parallel group); read as ``False``
            at ``tensor_parallel=1``, as Megatron-LM's ``arguments.py`` turns it off there.
        distributed_optimizer: ``megatron`` only: the optimizer state sharded over data parallel
            (Megatron's ``use_distributed_optimizer``).
        virtual_pipeline_parallel: ``megatron`` only: model chunks per pipeline stage (Megatron's
            ``virtual_pipeline_model_parallel_size``, the interleaved 1F1B schedule); ``None`` or 1:
            none; above 1 needs ``pipeline_parallel > 1`` (the layers must divide by
            ``pipeline_parallel × virtual_pipeline_parallel``, checked when the model is built).
        context_parallel: ``megatron`` only: ranks each sequence is cut over (Megatron's
            ``context_parallel_size``: ``2 × context_parallel`` load-balanced chunks, attention a
            ring, NOTE [ Context parallelism as Megatron runs it ]); ``tensor_parallel ×
            context_parallel × pipeline_parallel`` divides ``world_size``; default 1.
        expert_parallel: ``fsdp2`` or ``megatron``: ranks each MoE layer's experts are spread over (each
            holds ``experts / expert_parallel`` of them, tokens sent by all-to-all: NOTE [ Expert
            parallelism the torchtitan way ] in :mod:`batchfit.parallel.expert_parallel`, or Megatron's
            ``expert_model_parallel_size``, NOTE [ Megatron's mixture of experts on CPU ranks ] in
            :mod:`batchfit.models.moe_megatron`); divides ``world_size`` (under ``megatron`` a pipeline
            stage's ranks, ``world_size / pipeline_parallel``); default 1.
        expert_tensor_parallel: ``megatron`` only: Megatron's ``expert_tensor_parallel_size``, the ranks
            each expert's matrices are split over; ``None``: Megatron's default, ``tensor_parallel``
            (what verl's ``null`` gives); ``expert_parallel × expert_tensor_parallel`` divides a pipeline
            stage's ranks (frameworks set 1 beside a large ``expert_parallel``).
        first_pipeline_stage_layers, last_pipeline_stage_layers: ``megatron`` only: the layers of the
            pipeline's first and last stage (Megatron's ``num_layers_in_first_pipeline_stage`` /
            ``num_layers_in_last_pipeline_stage``, Megatron-LM's ``--decoder-first-pipeline-num-layers``
            / ``--decoder-last-pipeline-num-layers``), the middle stages splitting the rest evenly;
            ``None``: an even split. Need ``pipeline_parallel > 1``; checked against the model's
            layers when it is built (:func:`batchfit.budget.megatron_layout.stage_layers`).
        optimizer_cpu_offload, optimizer_offload_fraction: ``megatron`` only: Megatron's
            ``HybridDeviceOptimizer`` (``--optimizer-cpu-offload``), moving ``optimizer_offload_fraction``
            of the main parameters' elements (Megatron-LM's default 1.0) with their moments and
            gradient copies to the host; needs ``precision_aware_optimizer`` (Megatron-LM asserts it).
        precision_aware_optimizer, main_params_dtype, main_grads_dtype, exp_avg_dtype, exp_avg_sq_dtype:
            ``megatron`` only: Megatron's precision-aware optimizer (``--use-precision-aware-optimizer``,
            Transformer Engine's FusedAdam) and its state's dtypes (Megatron-LM's defaults ``fp32``);
            needs ``distributed_optimizer`` (megatron-core asserts it); the dtypes need it on.

    Raises:
        InvalidArgument: an unknown name (the choices and the closest are listed), a bad
            ``world_size``, or an option the strategy does not have.

    Example:
        >>> s = Sharding("fsdp2", world_size=8)
        >>> s.mixed_precision, s.reshard_after_forward, s.shards_state
        ('bf16', True, True)
        >>> Sharding("ddp", world_size=8, offload="cpu")
        Traceback (most recent call last):
        ...
        batchfit.errors.InvalidArgument: offload='cpu' needs strategy='fsdp1' or 'fsdp2' (FSDP offloads its shards to the host), but got strategy='ddp'; use strategy='fsdp2' or offload='none'
    """

    strategy: str = "none"
    world_size: int = 1
    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    offload: str = "none"
    sequence_parallel: int = 1
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE
    overlap_comm: bool = False
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    megatron_sequence_parallel: bool = False
    distributed_optimizer: bool = False
    virtual_pipeline_parallel: int | None = None
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: int | None = None
    first_pipeline_stage_layers: int | None = None
    last_pipeline_stage_layers: int | None = None
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    precision_aware_optimizer: bool = False
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"

    def __post_init__(self) -> None:
        strategy = check_choice("sharding", self.strategy, strategy_names())
        spec = get_strategy(strategy)
        check_positive_int("world_size", self.world_size)
        if not isinstance(self.reshard_after_forward, bool):
            raise InvalidArgument(
                f"reshard_after_forward must be True or False, but got reshard_after_forward={self.reshard_after_forward!r}"
            )
        precision = self.mixed_precision
        if precision is None:
            precision = "bf16" if spec.gathers_layers else "none"
        check_choice("mixed_precision", precision, MIXED_PRECISION)
        check_choice("offload", self.offload, OFFLOAD)
        if not spec.gathers_layers:
            if precision != "none":
                raise InvalidArgument(
                    f"mixed_precision={precision!r} needs strategy='fsdp1' or 'fsdp2' (it is FSDP's mixed precision policy), but got strategy={strategy!r}; use strategy='fsdp2' or mixed_precision='none' (the model then trains in its dtype)"
                )
            if self.offload != "none":
                raise InvalidArgument(
                    f"offload={self.offload!r} needs strategy='fsdp1' or 'fsdp2' (FSDP offloads its shards to the host), but got strategy={strategy!r}; use strategy='fsdp2' or offload='none'"
                )
            if not self.reshard_after_forward:
                raise InvalidArgument(
                    f"reshard_after_forward=False needs strategy='fsdp1' or 'fsdp2' (only FSDP gathers parameters), but got strategy={strategy!r}; keep reshard_after_forward=True or use strategy='fsdp2'"
                )
        check_positive_int("sequence_parallel", self.sequence_parallel)
        if self.sequence_parallel > 1 and not spec.sequence_parallel:
            raise InvalidArgument(
                f"sequence_parallel={self.sequence_parallel} needs strategy='fsdp1' or 'fsdp2' (verl and SkyRL split "
                f"sequences under FSDP), but got strategy={strategy!r}; use strategy='fsdp2' or sequence_parallel=1"
            )
        if self.world_size % self.sequence_parallel:
            raise InvalidArgument(
                f"sequence_parallel must divide world_size={self.world_size} (world = data-parallel × sequence-parallel "
                f"ranks), but got sequence_parallel={self.sequence_parallel}; use a divisor of {self.world_size}"
            )
        check_positive_int("reduce_bucket_size", self.reduce_bucket_size)
        if not isinstance(self.overlap_comm, bool):
            raise InvalidArgument(f"overlap_comm must be True or False, but got overlap_comm={self.overlap_comm!r}")
        if not spec.zero_stage and (
            self.overlap_comm or self.reduce_bucket_size != DEFAULT_REDUCE_BUCKET_SIZE
        ):
            raise InvalidArgument(
                f"reduce_bucket_size and overlap_comm are DeepSpeed ZeRO's options and need strategy='zero1' or 'zero2', but got strategy={strategy!r}; use strategy='zero2' or leave them at their defaults"
            )
        self._check_model_parallel(strategy, spec)
        self._check_expert_parallel(strategy)
        self._check_megatron_optimizer(strategy)
        object.__setattr__(self, "mixed_precision", precision)

    def _check_expert_parallel(self, strategy: str) -> None:
        ep = check_positive_int("expert_parallel", self.expert_parallel)
        if ep > 1 and strategy not in ("fsdp2", "megatron"):
            raise InvalidArgument(
                f"expert_parallel={ep} needs strategy='fsdp2' (experts spread over an EP group, the rest sharded by "
                f"FSDP2, as torchtitan runs MoE) or 'megatron' (its expert_model_parallel_size), but got "
                f"strategy={strategy!r}; use one of them or expert_parallel=1"
            )
        stage = self.world_size // self.pipeline_parallel  # checked by _check_model_parallel
        if strategy == "megatron" and stage % ep:
            raise InvalidArgument(
                f"expert_parallel={ep} must divide a pipeline stage's {stage} ranks (world_size={self.world_size} / "
                f"pipeline_parallel={self.pipeline_parallel}: Megatron carves the expert groups out of tensor × context × "
                f"data parallel); use a divisor of {stage}"
            )
        if self.world_size % ep:
            raise InvalidArgument(
                f"expert_parallel must divide world_size={self.world_size} (each EP group spans expert_parallel ranks), "
                f"but got expert_parallel={ep}; use a divisor of {self.world_size}"
            )
        etp = self.expert_tensor_parallel
        if etp is None:
            return
        check_positive_int("expert_tensor_parallel", etp)
        if strategy != "megatron":
            raise InvalidArgument(
                f"expert_tensor_parallel={etp} is Megatron's expert_tensor_parallel_size and needs strategy='megatron', "
                f"but got strategy={strategy!r}; drop it"
            )
        if stage % (ep * etp):
            raise InvalidArgument(
                f"expert_parallel × expert_tensor_parallel = {ep} × {etp} must divide a pipeline stage's {stage} ranks "
                f"(Megatron carves the expert groups out of tensor × context × data parallel); lower one of them"
            )

    def _check_megatron_optimizer(self, strategy: str) -> None:
        """Megatron's optimizer offload and precision-aware optimizer: what Megatron-LM and megatron-core refuse."""
        from batchfit.validation import check_choice

        for name in ("optimizer_cpu_offload", "precision_aware_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be True or False, but got {name}={getattr(self, name)!r}")
        fraction = self.optimizer_offload_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise InvalidArgument(
                f"optimizer_offload_fraction must be a fraction in [0, 1] (Megatron's share of the optimizer state on the "
                f"host), but got optimizer_offload_fraction={fraction!r}; pass e.g. 1.0"
            )
        dtypes = {
            "main_params_dtype": ("fp32", "fp16"),  # Megatron-LM arguments.py --main-params-dtype choices
            "main_grads_dtype": ("fp32", "bf16"),
            "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
            "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
        }
        for name, choices in dtypes.items():
            check_choice(name, getattr(self, name), choices)
        changed = [n for n in dtypes if getattr(self, n) != "fp32"]
        on = [n for n in ("optimizer_cpu_offload", "precision_aware_optimizer") if getattr(self, n)]
        if (on or changed) and strategy != "megatron":
            name = (on or changed)[0]
            raise InvalidArgument(
                f"{name}={getattr(self, name)!r} is Megatron's optimizer's and needs strategy='megatron', but got "
                f"strategy={strategy!r}; use strategy='megatron' or drop it"
            )
        if changed and not self.precision_aware_optimizer:
            raise InvalidArgument(
                f"{changed[0]}={getattr(self, changed[0])!r} needs precision_aware_optimizer=True (megatron-core: "
                f"'{changed[0]} can only be fp32 when not using precision-aware optimizer'); turn it on or use fp32"
            )
        if self.optimizer_cpu_offload and not self.precision_aware_optimizer:
            raise InvalidArgument(
                "optimizer_cpu_offload=True needs precision_aware_optimizer=True (Megatron-LM: 'The optimizer cpu offload "
                "must be used in conjunction with --use-precision-aware-optimizer'); turn it on"
            )
        if self.precision_aware_optimizer and not self.distributed_optimizer:
            raise InvalidArgument(
                "precision_aware_optimizer=True needs distributed_optimizer=True (megatron-core: '--use-precision-aware-"
                "optimizer only supported with distributed optimizer'); turn the distributed optimizer on"
            )

    def _check_model_parallel(self, strategy: str, spec: StrategySpec) -> None:
        tp = check_positive_int("tensor_parallel", self.tensor_parallel)
        pp = check_positive_int("pipeline_parallel", self.pipeline_parallel)
        cp = check_positive_int("context_parallel", self.context_parallel)
        for name in ("megatron_sequence_parallel", "distributed_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name} must be True or False, but got {name}={getattr(self, name)!r}")
        vp = self.virtual_pipeline_parallel
        if vp is not None:
            vp = check_positive_int("virtual_pipeline_parallel", vp)
            if vp == 1:
                object.__setattr__(self, "virtual_pipeline_parallel", None)  # one chunk per stage: no virtual stages
            elif not spec.model_parallel:
                raise InvalidArgument(
                    f"virtual_pipeline_parallel={vp} is Megatron's and needs strategy='megatron', but got strategy={strategy!r}; "
                    "use strategy='megatron' or leave virtual_pipeline_parallel unset"
                )
            elif pp == 1:
                raise InvalidArgument(
                    f"virtual_pipeline_parallel={vp} needs pipeline_parallel > 1 (virtual stages interleave a pipeline's "
                    "stages), but got pipeline_parallel=1; raise pipeline_parallel or leave virtual_pipeline_parallel unset"
                )
        for name in ("first_pipeline_stage_layers", "last_pipeline_stage_layers"):
            layers = getattr(self, name)
            if layers is None:
                continue
            check_positive_int(name, layers)  # Megatron: "must be larger than 0"
            if not spec.model_parallel:
                raise InvalidArgument(
                    f"{name}={layers} is Megatron's and needs strategy='megatron', but got strategy={strategy!r}; "
                    f"use strategy='megatron' or leave {name} unset"
                )
            if pp == 1:
                raise InvalidArgument(
                    f"{name}={layers} needs pipeline_parallel > 1 (it sizes one stage of a pipeline), but got "
                    f"pipeline_parallel=1; raise pipeline_parallel or leave {name} unset"
                )
        if not spec.model_parallel:
            for name, value, default in (
                ("tensor_parallel", tp, 1),
                ("pipeline_parallel", pp, 1),
                ("context_parallel", cp, 1),
                ("megatron_sequence_parallel", self.megatron_sequence_parallel, False),
                ("distributed_optimizer", self.distributed_optimizer, False),
            ):
                if value != default:
                    raise InvalidArgument(
                        f"{name}={value} is Megatron's and needs strategy='megatron', but got strategy={strategy!r}; "
                        f"use strategy='megatron' or leave {name} at {default}"
                    )
            return
        if self.world_size % (tp * cp * pp):
            names, sizes = ("tensor_parallel × pipeline_parallel", f"{tp} × {pp}") if cp == 1 else (
                "tensor_parallel × context_parallel × pipeline_parallel", f"{tp} × {cp} × {pp}"
            )
            raise InvalidArgument(
                f"{names} = {sizes} = {tp * cp * pp} must divide world_size={self.world_size} (world = tensor × "
                f"{'' if cp == 1 else 'context × '}pipeline × data parallel ranks); use a world size that is a multiple of {tp * cp * pp}"
            )
        if tp == 1:
            object.__setattr__(self, "megatron_sequence_parallel", False)  # Megatron-LM arguments.py does the same

    @property
    def spec(self) -> StrategySpec:
        """What the strategy does (:class:`~batchfit.parallel.strategies.StrategySpec`): ask it, not the name."""
        return get_strategy(self.strategy)

    @property
    def data_parallel_size(self) -> int:
        """Groups that run different micro-batches: ``world_size // sequence_parallel``, or under ``megatron``
        ``world_size // (tensor_parallel × context_parallel × pipeline_parallel)``."""
        return self.world_size // (self.sequence_parallel * self.model_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        """The ranks one micro-batch spans: ``tensor_parallel × context_parallel × pipeline_parallel`` (1 but under
        ``megatron``)."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel

    @property
    def shards_state(self) -> bool:
        """True when parameters, gradients and optimizer state are split over the ranks (``fsdp1``, ``fsdp2``)."""
        return self.spec.gathers_layers

    @property
    def partitioned(self) -> tuple[str, ...]:
        """The state categories split over the ranks: FSDP's parameters, gradients and optimizer state; ZeRO-1's
        optimizer state (fp32 master weights and AdamW's moments); ZeRO-2's gradients too."""
        return self.spec.partitioned

    @property
    def distributed(self) -> bool:
        """True when the strategy talks to other ranks (``ddp``, ``fsdp1`` or ``fsdp2``)."""
        return self.spec.distributed

    def describe(self) -> str:
        """One line for reports, e.g. ``"fsdp2 over 8 ranks (fp32 params, bf16 compute, fp32 reduce)"``.

        ``fsdp1`` names its sharding strategy first: ``"fsdp1 over 8 ranks (FULL_SHARD, fp32 params, ...)"``.
        """
        if self.strategy == "none":
            return "none (one device)"
        if self.strategy == "ddp":
            return f"ddp over {self._ranks()} (full replica + gradient buckets)"
        if self.spec.model_parallel:
            context = "" if self.context_parallel == 1 else f" × context {self.context_parallel}"
            parts = [
                f"tensor {self.tensor_parallel}{context} × pipeline {self.pipeline_parallel} × data {self.data_parallel_size}"
            ]
            if self.virtual_pipeline_parallel:
                parts.append(f"{self.virtual_pipeline_parallel} virtual stages per pipeline stage")
            uneven = [
                f"{end} stage {layers} layers"
                for end, layers in (("first", self.first_pipeline_stage_layers), ("last", self.last_pipeline_stage_layers))
                if layers is not None
            ]
            if uneven:  # Megatron's num_layers_in_first/last_pipeline_stage
                parts.append(", ".join(uneven))
            if self.expert_parallel > 1:  # Megatron's expert_model_parallel_size, over tensor × context × data
                parts.append(f"expert parallel {self.expert_parallel}")
            if self.expert_tensor_parallel is not None:
                parts.append(f"expert tensor parallel {self.expert_tensor_parallel}")
            if self.megatron_sequence_parallel:
                parts.append("sequence parallel")
            if self.distributed_optimizer:
                parts.append("distributed optimizer")
            if self.precision_aware_optimizer:
                dtypes = "/".join(
                    getattr(self, n) for n in ("main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
                )
                parts.append(f"precision-aware optimizer (main params/grads/exp_avg/exp_avg_sq {dtypes})")
            if self.optimizer_cpu_offload:
                parts.append(f"optimizer offloaded to the host ({self.optimizer_offload_fraction:g})")
            return f"{self.strategy} over {self._ranks()} ({', '.join(parts)})"
        if self.strategy in ZERO_STRATEGIES:
            what = "optimizer state and gradients" if self.strategy == "zero2" else "optimizer state"
            overlap = ", overlap_comm: two reduce buckets" if self.overlap_comm else ""
            return (
                f"{self.strategy} over {self._ranks()} (DeepSpeed ZeRO-{self.strategy[-1]}: parameters replicated, "
                f"fp32 master weights, {what} partitioned{overlap})"
            )
        parts = [
            "fp32 params, bf16 compute, fp32 reduce"
            if self.mixed_precision == "bf16"
            else "no mixed precision",
        ]
        if self.strategy == "fsdp1":
            parts.insert(0, "FULL_SHARD" if self.reshard_after_forward else "SHARD_GRAD_OP")
        elif not self.reshard_after_forward:
            parts.append("no reshard after forward")
        if self.offload == "cpu":
            parts.append("CPU offload")
        if self.expert_parallel > 1:
            parts.append(f"expert parallel {self.expert_parallel}")
        if self.sequence_parallel > 1:
            parts.append(f"Ulysses sequence parallel {self.sequence_parallel} × data parallel {self.data_parallel_size}")
        return f"{self.strategy} over {self._ranks()} ({', '.join(parts)})"

    def _ranks(self) -> str:
        return "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain values (JSON-ready); ``sequence_parallel`` only when above 1, ZeRO's options
        (``reduce_bucket_size``, ``overlap_comm``) with ``zero1``/``zero2`` only, Megatron's (and its
        ``data_parallel``) with ``megatron`` only."""
        out = asdict(self)
        if out["sequence_parallel"] == 1:
            del out["sequence_parallel"]
        if not self.spec.zero_stage:
            del out["reduce_bucket_size"], out["overlap_comm"]
        if out["virtual_pipeline_parallel"] is None:
            del out["virtual_pipeline_parallel"]
        if out["context_parallel"] == 1:
            del out["context_parallel"]
        if out["expert_parallel"] == 1:
            del out["expert_parallel"]
        if out["expert_tensor_parallel"] is None:
            del out["expert_tensor_parallel"]
        for name in ("first_pipeline_stage_layers", "last_pipeline_stage_layers"):
            if out[name] is None:
                del out[name]
        if not self.optimizer_cpu_offload:
            del out["optimizer_cpu_offload"], out["optimizer_offload_fraction"]
        if not self.precision_aware_optimizer:
            for name in ("precision_aware_optimizer", "main_params_dtype", "main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
                del out[name]
        if self.spec.model_parallel:
            out["data_parallel"] = self.data_parallel_size
        else:
            for name in ("tensor_parallel", "pipeline_parallel", "megatron_sequence_parallel", "distributed_optimizer"):
                del out[name]
        return out


def as_sharding(value: Any) -> Sharding:
    """A :class:`Sharding` from ``None`` (no sharding), a strategy name or a ``Sharding``.

    Raises:
        InvalidArgument: anything else, or an unknown strategy name.
    """
    if value is None:
        return Sharding()
    if isinstance(value, Sharding):
        return value
    if isinstance(value, str):
        return Sharding(value)
    raise InvalidArgument(
        f"sharding must be a Sharding, a strategy name ({', '.join(STRATEGIES)}) or None, but got sharding={value!r}"
    )
