"""The token budget's probe for a Megatron-core ``GPTModel``: one training step (or forward-only pass) of this layout's binding pipeline stage.

:class:`MegatronStep` is a :class:`~batchfit.budget.probe.BudgetStep`: ``step.measure(lengths)``
builds this tensor/pipeline/data-parallel layout's model fresh (:func:`batchfit.models.megatron.build_gpt_model`),
wraps it in Megatron's DDP with Megatron's optimizer, its state made up front (NOTE [ The Megatron
step's optimizer ] in :mod:`batchfit.train.megatron_step`), and measures one training step of ``micro_batches`` micro-batches of
``len(lengths)`` rows of ``max(lengths)`` tokens through Megatron's own schedule
(:mod:`batchfit.train.megatron_step`), so :func:`batchfit.budget.find_token_budget` gives a per-rank
token budget for the layout. ``forward_only=True`` measures the forward-only pass of old or
reference log-probs instead (NOTE [ Forward-only Megatron probes ]):

    >>> from batchfit.budget import find_token_budget                                  # doctest: +SKIP
    >>> from batchfit.memory import get_backend                                        # doctest: +SKIP
    >>> backend = get_backend("estimate", memory_limit="24MiB", reserve_bytes=0)      # doctest: +SKIP
    >>> step = MegatronStep("tiny", tensor_parallel=2, backend=backend, num_layers=2)  # doctest: +SKIP
    >>> find_token_budget(step, max_seq_len=128, cost="padded").tokens                 # doctest: +SKIP
    1280

NOTE [ A fresh Megatron model per measurement ]
Megatron makes two things on first use and keeps them: the RoPE table (``RotaryEmbedding.forward``
is ``lru_cache``'d on the module and the length) and the global memory buffer
(``parallel_state._GLOBAL_MEMORY_BUFFER``, sequence parallelism's all-gather buffer, which only
grows). A step measured after another of a longer sequence would find both made and unregistered,
and miss them (69,632 bytes on the tiny preset at TP 2, 2 × 64 tokens: NOTE [ Megatron under the
fake process group ] in :mod:`batchfit.models.megatron`); a shorter one would find a larger buffer
than its own step makes. Each measurement therefore runs inside its own
:func:`~batchfit.models.megatron.model_parallel` (which destroys and remakes the buffer) on a model
built for it, and clears the RoPE cache afterwards (it would keep the old modules' tables alive).
The build is outside the measured call (registered state, as a trainer's model is resident); on
real ranks the new groups of ``model_parallel`` are collectives every rank enters in lockstep
(NOTE [ Lockstep probes ] in :mod:`batchfit.budget.budget_search`). A trainer's second step would
see the same buffer and table, made by its first: the first step's peak is the one that binds.

NOTE [ The binding pipeline stage ]
Under 1F1B without interleaving, stage ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, so the
first stage holds ``min(p, micro_batches)`` micro-batches' activations at once and the last holds
one; but the last holds the output layer, its ``[s, b, V/t]`` logits and the vocab-parallel
cross-entropy's fp32 temporaries, and under tied embeddings a second copy of the embedding. Which
binds depends on the shape (tiny, 2 × 64, PP 2: the first stage; a large vocabulary and a short
sequence can make it the last), so every stage is measured and the largest peak is the step's:
on real ranks each rank measures its own stage and the search's all-reduce (max) agrees on it; on
the estimate backend :meth:`MegatronStep.measure` simulates the first rank of each stage in turn
(:func:`~batchfit.models.megatron.simulated_rank`, Megatron's order: tp fastest, then dp, then pp:
stage ``s`` begins at rank ``s × tp × dp``) and keeps the largest. Tensor-parallel ranks of one
stage hold the same shapes (dense layers), and so do data-parallel ranks, but for the
distributed optimizer's shards: each rank's 1/dp range of the gradient buffer cuts the
parameters at other places, so the number of shard pieces (a 4-byte step count each) differs
(tiny, 2 layers, bf16, DP 2: rank 0 holds 772 B more than rank 1); the stage's first rank stands
for all of them. :attr:`MegatronStep.stage_peaks` keeps the last
measurement's peak per stage, :attr:`MegatronStep.binding_stage` the one that bound. More
micro-batches than ``p`` add nothing in flight (docs/megatron.md: 2, 4 and 8 give the same first
stage at PP 2), so ``micro_batches`` defaults to ``p``.

NOTE [ Megatron micro-batches are padded rows ]
Megatron-core's local layer spec (no Transformer Engine, which does not run on a CPU) has no
packed (THD) attention: ``packed_seq_params`` needs Transformer Engine's fused attention. A
micro-batch is therefore ``len(lengths)`` rows of its longest length, the cost ``"padded"``
counts; a ``"packed"`` search would measure each candidate padded to its longest sequence (an
over-estimate), so search with ``cost="padded"``. Every token's loss counts (the loss mask is all
ones), the most a micro-batch of those rows can train on.

NOTE [ Forward-only Megatron probes ]
``MegatronStep(..., forward_only=True, optimizer=...)`` measures
:func:`~batchfit.train.megatron_step.megatron_forward_step` (NOTE [ The Megatron forward-only
pass ] in :mod:`batchfit.train.megatron_step`: eval mode, ``no_grad``, Megatron's schedule with
``forward_only=True``, the logits' vocab-parallel log-probs kept per micro-batch) on the same
freshly built stage, with what the pass keeps resident registered beside it:

- ``optimizer="resident"`` (the policy's old log-probs, ``policy_forward``): the model in
  Megatron's DDP with Megatron's optimizer, its state made, as between the policy's updates:
  the parameters, the fp32 gradient buffer, the main parameters and moments;
- ``optimizer="offloaded"`` (the same under verl's ``optimizer_offload``): DDP's buffers only,
  the optimizer's main parameters and moments on the host;
- ``optimizer="none"`` (the reference): the parameters alone, no DDP wrapper and no optimizer
  (verl builds its reference engine ``forward_only`` with ``wrap_with_ddp=False``).

Every stage is measured and the largest binds, as for training (NOTE [ The binding pipeline
stage ]); without a backward 1F1B keeps no activations between micro-batches, so what binds is
the resident state plus one micro-batch's forward (the last stage's logits and the
cross-entropy's fp32 temporaries, or one layer's transients). ``micro_batches`` keeps its
default (``pipeline_parallel``); more only add their kept log-probs (4 B a token on the last stage).

NOTE [ The Megatron probe's worst rank ]
A mixture of experts under Megatron routes drop-less (no ``moe_expert_capacity_factor``, as mbridge
and verl run it): how many token-expert pairs an EP rank's experts receive is decided by every
rank's router. The probe fixes every router's choice (:func:`batchfit.models.moe_megatron.fix_megatron_routing`,
Megatron's own top-k replay hook) to :func:`batchfit.models.moe.fixed_routing` of ``routing``:
``"skewed"``, the worst case, sends every rank's pairs to experts ``0 … top-k − 1``, held by EP rank 0,
which receives ``ep`` times its own (:func:`batchfit.models.moe.received_rows`); the estimate
simulates each stage's first rank, which is EP rank 0 in Megatron's expert order (``tp-ep-dp-pp``),
and the count exchange under the fake process group gives this rank's counts for every rank (NOTE
[ Megatron's mixture of experts on CPU ranks ] in :mod:`batchfit.models.moe_megatron`). On real
ranks every rank routes the same way and rank 0 receives the most. A dense model has no router:
``routing`` changes nothing.

NOTE [ Virtual pipeline stages ]
``MegatronStep(..., virtual_pipeline=v)`` builds each stage's ``v`` model chunks
(:func:`~batchfit.models.megatron.build_gpt_chunks`: Megatron's ``vp_stage``, chunk ``i`` of
stage ``r`` holding virtual stage ``i·p + r``'s ``L / (p·v)`` layers, the first chunk of the
first stage embedding and the last chunk of the last stage holding the head), one DDP wrapper
each and one optimizer over them, under ``parallel_state``'s virtual pipeline size, and runs
Megatron's interleaved 1F1B schedule (``get_forward_backward_func()`` with the list of chunks,
each reading its own iterator of the same micro-batches). Stage ``r`` warms up
``(p - r - 1)·2 + (v - 1)·g`` chunk forwards (``g = microbatch_group_size_per_vp_stage``,
Megatron's default ``p``), so the first stage holds more activations than without virtual stages
at the same parameters (tiny, PP 2 × VPP 2, 4 micro-batches: ``tests/test_megatron_step.py``).
The interleaved schedule runs micro-batches in groups of ``p``: ``micro_batches`` must be a
multiple of ``p`` (its default ``p`` is). Each stage's first rank is measured, as without virtual
stages; the pipeline's exchanges are not overlapped (``overlap_p2p_comm=False``, which mbridge
turns on with virtual stages: each receive is waited on before the next forward).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from batchfit.budget.probe import GENERIC_REMEDIES
from batchfit.errors import InvalidArgument, Phrase, Setting
from batchfit.memory import Backend, MemoryMeasurement
from batchfit.validation import check_choice, check_positive_int

#: What a forward-only pass keeps resident (NOTE [ Forward-only Megatron probes ]).
FORWARD_STATES = ("resident", "offloaded", "none")


class MegatronStep:
    """One training step (or forward-only pass) of a Megatron-core ``GPTModel`` layout, measured on its binding stage: ``step.measure(lengths)``.

    See NOTE [ A fresh Megatron model per measurement ], NOTE [ The binding pipeline stage ],
    NOTE [ Megatron micro-batches are padded rows ] and NOTE [ Forward-only Megatron probes ].

    Args:
        spec: a preset name, directory, hub id or ``PretrainedConfig`` (:func:`batchfit.models.megatron.transformer_config`).
        tensor_parallel, pipeline_parallel, sequence_parallel: Megatron's model-parallel layout.
        virtual_pipeline: model chunks per pipeline stage (Megatron's
            ``virtual_pipeline_model_parallel_size``: the interleaved 1F1B schedule, NOTE [ Virtual
            pipeline stages ]); ``None`` or 1: none. Needs ``pipeline_parallel > 1``, the layers
            divisible by ``pipeline_parallel × virtual_pipeline`` and ``micro_batches`` a multiple
            of ``pipeline_parallel``.
        data_parallel: data-parallel ranks; the world is ``tensor_parallel × context_parallel ×
            pipeline_parallel × data_parallel`` ranks (Megatron's order: tp fastest, then cp, then
            dp, then pp).
        context_parallel: ranks each row is cut over (Megatron's ``context_parallel_size``, NOTE
            [ Context parallelism as Megatron runs it ] in :mod:`batchfit.models.megatron_context`):
            a measurement of rows of ``s`` tokens runs ``s / context_parallel`` of them on each rank
            (``s`` padded up to a multiple of ``2 × context_parallel``, and of ``tensor_parallel``
            more under sequence parallelism, as verl and slime pad), attention a ring over the
            group. Needs ``attention="sdpa"``.
        expert_parallel, expert_tensor_parallel: a mixture of experts' ``expert_model_parallel_size``
            and ``expert_tensor_parallel_size`` (NOTE [ The Megatron probe's worst rank ]); their
            product divides ``tensor_parallel × context_parallel × data_parallel``.
            ``expert_tensor_parallel=None`` is Megatron's own default, ``tensor_parallel``
            (``initialize_model_parallel``: what verl's ``null`` gives).
        routing: the fixed routing of a mixture of experts' routers (:data:`batchfit.models.moe.ROUTINGS`):
            ``"skewed"``, the worst case (the default), or ``"balanced"``.
        distributed_optimizer: Megatron's distributed optimizer (main parameters and Adam's
            moments sharded over the data-parallel group, the gradient buffer reduce-scattered).
        main_params_fp32: Megatron's mixed-precision optimizer (fp32 main parameters and fp32
            gradient buffer) for 16-bit parameters; ``None``: when ``dtype`` is bf16. Must not be
            ``False`` with the distributed optimizer on bf16 parameters.
        precision, offload_fraction: Megatron's precision-aware optimizer (an
            :class:`~batchfit.train.megatron_step.OptimizerPrecision`; ``None``: off) and the share of its
            state ``optimizer_cpu_offload`` moves to the host (0: none; needs ``precision``), counted in
            the measurement's ``host_bytes`` (NOTE [ Megatron's optimizer offload and precision-aware
            optimizer ] in :mod:`batchfit.train.megatron_step`).
        micro_batches: micro-batches of the step under pipeline parallelism (1F1B); ``None``:
            ``pipeline_parallel``, the most the first stage holds in flight. Must be 1 (or
            ``None``) without pipeline parallelism.
        backend: ``estimate`` (the simulated world, built here; call it with no process group)
            or ``cpu`` (this rank of ``world_size`` real gloo ranks).
        dtype: the parameters' dtype (Megatron's ``params_dtype``).
        seed: torch's seed before each real build (Megatron's CPU initialisation draws each full
            matrix from torch's generator, so every rank builds the same model).
        gpt_args: ``GPTModel`` arguments over the preset's (:func:`~batchfit.models.megatron.build_gpt_model`).
        forward_only: measure the forward-only pass of log-probs (NOTE [ Forward-only Megatron
            probes ]) instead of a training step.
        optimizer: what a forward-only pass keeps resident: ``"resident"`` (DDP's buffers and
            Megatron's optimizer state, the default), ``"offloaded"`` (DDP's buffers) or
            ``"none"`` (the parameters: a reference). A training step keeps everything: only
            ``"resident"`` without ``forward_only``.
        attention: the layers' core attention: ``"local"`` (Megatron's unfused ``DotProductAttention``,
            the default: the referees count its scores) or ``"sdpa"`` (fused, as Transformer Engine runs
            it, and no ``[s, s]`` mask in the inputs: NOTE [ Fused attention for Megatron budgets ] in
            :mod:`batchfit.models.megatron_attention`).
        head: the head on the last stage's logits: ``"megatron"`` or ``None`` (Megatron's own
            cross-entropy, the default), a framework's name (``"verl"``, ``"skyrl"``, ``"slime"``:
            its default config for this pass) or a :class:`~batchfit.train.megatron_heads.MegatronHead`
            (NOTE [ Framework heads under Megatron ] in :mod:`batchfit.train.megatron_heads`).
        **overrides: ``TransformerConfig`` fields (``num_layers=2``, ``hidden_dropout=0.1``, ...).

    Attributes:
        stage_peaks: the last measurement's peak per pipeline stage (every stage on the
            estimate backend, this rank's on real ranks).
        binding_stage: the stage whose peak the last measurement returned.
        peaks_by_shape: every measurement's ``stage_peaks``, by its :func:`shape_key` (a report
            gives the budget point's, :func:`batchfit.budget.megatron_profile.budget_stage_peaks`).

    Raises:
        InvalidArgument: a bad size, a backend other than ``estimate`` and ``cpu``,
            ``micro_batches`` without pipeline parallelism, fp16 parameters, or
            ``main_params_fp32=False`` with the distributed optimizer on bf16 parameters,
            an unknown ``optimizer``, or ``optimizer`` other than ``"resident"`` for a training step.
    """

    def __init__(
        self,
        spec: Any,
        *,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        sequence_parallel: bool = False,
        micro_batches: int | None = None,
        virtual_pipeline: int | None = None,
        data_parallel: int = 1,
        context_parallel: int = 1,
        expert_parallel: int = 1,
        expert_tensor_parallel: int | None = None,
        routing: str = "skewed",
        distributed_optimizer: bool = False,
        main_params_fp32: bool | None = None,
        precision: Any = None,
        offload_fraction: float = 0.0,
        backend: Backend,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        gpt_args: Mapping[str, Any] | None = None,
        attention: str = "local",
        forward_only: bool = False,
        optimizer: str = "resident",
        head: Any = None,
        **overrides: Any,
    ):
        from batchfit.models.megatron_attention import ATTENTIONS
        from batchfit.train.megatron_heads import as_megatron_head

        self.spec = spec
        self.forward_only = bool(forward_only)
        self.optimizer = check_choice("optimizer", optimizer, FORWARD_STATES)
        if not self.forward_only and self.optimizer != "resident":
            raise InvalidArgument(
                f"optimizer={optimizer!r} with forward_only=False: a training step keeps Megatron's DDP buffers and optimizer "
                "state resident; pass forward_only=True to measure a forward pass without them, or leave optimizer unset"
            )
        self.attention = check_choice("attention", attention, ATTENTIONS)
        self.head = as_megatron_head(head, forward_only=self.forward_only)
        self.tensor_parallel = check_positive_int("tensor_parallel", tensor_parallel)
        self.pipeline_parallel = check_positive_int("pipeline_parallel", pipeline_parallel)
        self.sequence_parallel = bool(sequence_parallel)
        self.data_parallel = check_positive_int("data_parallel", data_parallel)
        self.context_parallel = check_positive_int("context_parallel", context_parallel)
        self.expert_parallel = check_positive_int("expert_parallel", expert_parallel)
        self.expert_tensor_parallel = check_positive_int(
            "expert_tensor_parallel", self.tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
        )
        from batchfit.models.moe import ROUTINGS

        self.routing = check_choice("routing", routing, ROUTINGS)
        experts = self.expert_parallel * self.expert_tensor_parallel
        if self._stage_ranks % experts:
            raise InvalidArgument(
                f"expert_parallel × expert_tensor_parallel = {self.expert_parallel} × {self.expert_tensor_parallel} must divide "
                f"tensor_parallel × context_parallel × data_parallel = {self._stage_ranks} (Megatron carves the expert groups out of "
                "a stage's ranks); raise data_parallel or lower expert_parallel"
            )
        if self.context_parallel > 1 and self.attention == "local":
            raise InvalidArgument(
                f"context_parallel={context_parallel} needs attention='sdpa' (Megatron's local DotProductAttention has no "
                "context parallelism: it is Transformer Engine's, modelled by the fused attention's ring); pass attention='sdpa'"
            )
        self.distributed_optimizer = bool(distributed_optimizer)
        self.precision = precision
        self.offload_fraction = float(offload_fraction)
        if self.offload_fraction and precision is None:
            raise InvalidArgument(
                f"offload_fraction={offload_fraction} needs the precision-aware optimizer (Megatron-LM asserts "
                "--optimizer-cpu-offload comes with --use-precision-aware-optimizer); pass precision=OptimizerPrecision()"
            )
        if micro_batches is None:
            micro_batches = self.pipeline_parallel
        self.micro_batches = check_positive_int("micro_batches", micro_batches)
        self.virtual_pipeline = _virtual_pipeline(virtual_pipeline, self.pipeline_parallel, self.micro_batches)
        if self.pipeline_parallel == 1 and self.micro_batches != 1:
            raise InvalidArgument(
                f"micro_batches={micro_batches} needs pipeline_parallel > 1 (one micro-batch is what a budget measures "
                "without a pipeline: gradient accumulation holds one micro-batch's activations at a time); leave micro_batches unset"
            )
        # NOTE [ Backends say what they can do ]: a tracked backend (simulated ranks, or real CPU ranks:
        # the patches' device); Megatron on a GPU runs Transformer Engine and CUDA's RNG, not patched here
        if backend.reads_device:
            raise InvalidArgument(
                f"MegatronStep measures with a tracking backend (simulated or real CPU ranks), but got one that reads "
                f"the device's allocator ({backend!r}); pass get_backend('estimate', ...) or get_backend('cpu', ...)"
            )
        if dtype is torch.float16:
            raise InvalidArgument(
                "dtype=torch.float16 is not modelled (Megatron's fp16 loss scaler reads found_inf.item(), which fake tensors "
                "have not); pass dtype=torch.bfloat16 or torch.float32"
            )
        sixteen_bit = dtype is torch.bfloat16
        self.main_params_fp32 = sixteen_bit if main_params_fp32 is None else bool(main_params_fp32) and sixteen_bit
        if self.distributed_optimizer and sixteen_bit and not self.main_params_fp32:
            raise InvalidArgument(
                "main_params_fp32=False with distributed_optimizer=True: Megatron's distributed optimizer always keeps fp32 "
                "main shards of bf16 parameters; pass main_params_fp32=True (the default), or distributed_optimizer=False"
            )
        self.backend = backend
        backend.expect_world_size(self.world_size)  # its default reserve: what one rank of the layout holds untracked (NCCL)
        self.dtype = dtype
        self.seed = int(seed)
        self.overrides = dict(overrides)
        self.gpt_args = dict(gpt_args or {})
        if self.attention != "local":
            from batchfit.models.megatron_attention import layer_spec

            self.gpt_args.setdefault("transformer_layer_spec", functools.partial(layer_spec, attention=self.attention))
        self.stage_peaks: dict[int, int] = {}
        self.binding_stage: int | None = None
        self.peaks_by_shape: dict[tuple[int, int], dict[int, int]] = {}

    @property
    def world_size(self) -> int:
        """The ranks of the layout: ``tensor_parallel × context_parallel × pipeline_parallel × data_parallel``."""
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @property
    def _stage_ranks(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.data_parallel

    def stage_first_rank(self, stage: int) -> int:
        """The global rank of ``stage``'s first rank (Megatron's order: tp fastest, then cp, then dp, then pp)."""
        return stage * self._stage_ranks

    def local_length(self, seq: int) -> int:
        """Tokens of a row of ``seq`` each rank runs: ``seq`` padded (to a multiple of ``2 × context_parallel``, and
        ``× tensor_parallel`` under sequence parallelism) over ``context_parallel`` (NOTE [ Context parallelism as
        Megatron runs it ])."""
        if self.context_parallel == 1:
            return seq
        multiple = 2 * self.context_parallel * (self.tensor_parallel if self.sequence_parallel else 1)
        return -(-seq // multiple) * multiple // self.context_parallel

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """The peak of one training step (or forward-only pass) of ``micro_batches`` micro-batches of ``len(lengths)`` rows of ``max(lengths)`` tokens.

        On the estimate backend: the largest stage's measurement (NOTE [ The binding pipeline
        stage ]); on real ranks: this rank's.

        Raises:
            InvalidArgument: no lengths or a bad one; on the estimate backend a process group
                already initialised; on the cpu backend no process group of ``world_size`` ranks.
        """
        if self.backend.simulated:
            measured = stage_measurements(self, lengths)
        else:
            rows, seq = _rows_and_length(lengths)
            measured = {self._this_stage(): self._measure_here(rows, seq)}
        self.stage_peaks = {stage: m.peak_bytes for stage, m in measured.items()}
        self.peaks_by_shape[shape_key(lengths)] = self.stage_peaks
        # the first of equal peaks binds: the stage with the most micro-batches in flight
        self.binding_stage = max(measured, key=lambda stage: (measured[stage].peak_bytes, -stage))
        return measured[self.binding_stage]

    def _this_stage(self) -> int:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            have = dist.get_world_size() if dist.is_initialized() else None
            raise InvalidArgument(
                f"MegatronStep on the cpu backend runs on tensor_parallel × context_parallel × pipeline_parallel × data_parallel = {self.world_size} real ranks, "
                f"but the process group has {have}; run it on every rank of a group of {self.world_size} (torchrun)"
            )
        return dist.get_rank() // self._stage_ranks  # Megatron's order: tp fastest, then cp, then dp, then pp

    def _measure_here(self, rows: int, seq: int) -> MemoryMeasurement:
        """Build this rank's stage fresh and measure its first step (NOTE [ A fresh Megatron model per measurement ])."""
        from batchfit.models.megatron import build_gpt_chunks, megatron_cpu_patches, model_parallel
        from batchfit.train.megatron_step import (
            megatron_forward_step,
            megatron_optimizer,
            megatron_pipeline_step,
            megatron_train_step,
            synthetic_batch,
        )

        backend, real = self.backend, not self.backend.simulated
        from batchfit.models.moe_megatron import fix_megatron_routing

        parallel = model_parallel(
            self.tensor_parallel,
            self.pipeline_parallel,
            self.virtual_pipeline,
            context_parallel=self.context_parallel,
            expert_parallel=self.expert_parallel,
            expert_tensor_parallel=self.expert_tensor_parallel,
        )
        with parallel, megatron_cpu_patches(), _rope_cache_cleared():
            if real:
                torch.manual_seed(self.seed)
            with backend.context():
                chunks = build_gpt_chunks(
                    self.spec,
                    virtual_pipeline=self.virtual_pipeline,
                    tensor_parallel=self.tensor_parallel,
                    pipeline_parallel=self.pipeline_parallel,
                    sequence_parallel=self.sequence_parallel,
                    context_parallel=self.context_parallel,
                    expert_parallel=self.expert_parallel,
                    expert_tensor_parallel=self.expert_tensor_parallel,
                    dtype=self.dtype,
                    initialise=real,
                    gpt_args=self.gpt_args,
                    **self.overrides,
                )
                for chunk in chunks:  # NOTE [ The Megatron probe's worst rank ]: a mixture of experts' routing fixed
                    fix_megatron_routing(chunk, self.routing)
                model = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)  # what is registered
                optimizer = None
                if self.optimizer != "none":  # NOTE [ Forward-only Megatron probes ]
                    optimizer = megatron_optimizer(
                        chunks, mixed_precision=self.main_params_fp32, distributed=self.distributed_optimizer,
                        precision=self.precision, offload_fraction=self.offload_fraction,
                    )
                vocab = chunks[0].vocab_size
                if self.head is not None and self.head.framework == "skyrl":
                    # SkyRL's backward keeps one index a target in this rank's vocabulary shard (masked_select):
                    # every token drawn from the simulated rank's shard, the rank that holds the most
                    # (NOTE [ SkyRL's fused LM head ] in batchfit.train.megatron_heads)
                    vocab //= self.tensor_parallel
                mask = self.attention == "local"  # fused attention takes the causal mask as a flag
                batches = [
                    synthetic_batch(vocab, rows, self.local_length(seq), seed=i, attention_mask=mask)
                    for i in range(self.micro_batches)
                ]
            if self.forward_only:
                forward_chunks = chunks if optimizer is None else optimizer.chunks

                def run() -> None:
                    megatron_forward_step(forward_chunks, batches, head=self.head)
            elif self.pipeline_parallel == 1:
                (batch,) = batches

                def run() -> None:
                    megatron_train_step(chunks[0], optimizer, batch, head=self.head)
            else:

                def run() -> None:
                    megatron_pipeline_step(model, optimizer, batches, head=self.head)

            objects: list[Any] = []
            categories: list[str | None] = []
            if optimizer is not None:
                objects, categories = optimizer.registered(optimizer_state=self.optimizer == "resident")
            from batchfit.train.megatron_step import OFFLOADED_OPTIMIZER_STATE

            return backend.measure(
                run,
                register=(model, *objects, [b.tensors() for b in batches]),
                categories=(None, *categories, None),
                host_categories=(OFFLOADED_OPTIMIZER_STATE,),  # the offloaded optimizer's host share
            )

    def remedies(self) -> list[str | Phrase]:
        """What would make a longer sequence fit under Megatron, leaving out what the layout already does."""
        out: list[str | Phrase] = [Phrase("reduce ", Setting("max_seq_len"))]
        if self.forward_only and self.optimizer == "resident":
            out.append(Phrase("offload the optimizer state outside the update (", Setting("optimizer_offload", True), ")"))
        out.append(Phrase("raise the tensor parallelism (", Setting("tensor_parallel", 2 * self.tensor_parallel), ")"))
        if self.tensor_parallel > 1 and not self.sequence_parallel:
            out.append(Phrase("split the activations over the tensor-parallel group (", Setting("sequence_parallel", True), ")"))
        if self.data_parallel > 1 and not self.distributed_optimizer:
            out.append(Phrase("shard the optimizer state over data parallel (", Setting("distributed_optimizer", True), ")"))
        recompute = self.overrides.get("recompute_granularity")
        if recompute is None and not self.forward_only:  # a forward pass under no_grad saves nothing to recompute
            out.append(Phrase("recompute the activations (", Setting("recompute_granularity", "selective"), ")"))
        out.extend(GENERIC_REMEDIES[1:])
        return out

    def describe(self) -> dict[str, Any]:
        """The layout as plain values (for a report); ``head`` only when it is not Megatron's own."""
        out = {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "context_parallel": self.context_parallel,
            "expert_parallel": self.expert_parallel,
            "expert_tensor_parallel": self.expert_tensor_parallel,
            "virtual_pipeline": self.virtual_pipeline,
            "sequence_parallel": self.sequence_parallel,
            "micro_batches": self.micro_batches,
            "data_parallel": self.data_parallel,
            "distributed_optimizer": self.distributed_optimizer,
            "main_params_fp32": self.main_params_fp32,
            "precision_aware": None if self.precision is None else dict(vars(self.precision)),
            "offload_fraction": self.offload_fraction,
            "world_size": self.world_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "attention": self.attention,
            "forward_only": self.forward_only,
            "optimizer": self.optimizer,
            "stage_peaks": dict(self.stage_peaks),
            "binding_stage": self.binding_stage,
        }
        if not self.head.is_default:
            out["head"] = self.head.describe()
        return out


def _virtual_pipeline(virtual_pipeline: int | None, pipeline_parallel: int, micro_batches: int) -> int | None:
    """``None`` for no virtual stages; else the chunks per stage, checked against the pipeline (NOTE [ Virtual pipeline stages ])."""
    from batchfit.models.megatron import virtual_stages

    vp = virtual_stages(virtual_pipeline, pipeline_parallel)
    if vp is not None and micro_batches % pipeline_parallel:
        raise InvalidArgument(
            f"micro_batches={micro_batches} with virtual_pipeline={vp}: the interleaved schedule needs a multiple of "
            f"pipeline_parallel={pipeline_parallel}; pass micro_batches={pipeline_parallel * max(1, micro_batches // pipeline_parallel)} or leave it unset"
        )
    return vp


def _rows_and_length(lengths: Sequence[int]) -> tuple[int, int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise InvalidArgument(
            f"lengths must be a non-empty sequence of sequence lengths, but got lengths={lengths!r}; pass e.g. [4096, 4096]"
        )
    checked = [check_positive_int(f"lengths[{i}]", n) for i, n in enumerate(lengths)]
    return len(checked), max(checked)  # NOTE [ Megatron micro-batches are padded rows ]


@contextlib.contextmanager
def _rope_cache_cleared() -> Iterator[None]:
    """Clear Megatron's RoPE table cache on exit (NOTE [ A fresh Megatron model per measurement ])."""
    try:
        yield
    finally:
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        RotaryEmbedding.forward.cache_clear()


def shape_key(lengths: Sequence[int]) -> tuple[int, int]:
    """A micro-batch's shape as a budget's :class:`~batchfit.budget.probe.Probe` records it: its longest row and its tokens
    (rows of the longest length and one shorter remainder, padded or packed)."""
    return (max(lengths), sum(lengths))


def stage_measurements(step: MegatronStep, lengths: Sequence[int]) -> dict[int, MemoryMeasurement]:
    """Every stage's measurement of ``lengths`` on the estimate backend (for reports and referees).

    Raises:
        InvalidArgument: ``step`` is not on the estimate backend.
    """
    if not step.backend.simulated:
        raise InvalidArgument("stage_measurements simulates every stage: it needs the estimate backend; on real ranks call step.measure on each")
    from batchfit.models.megatron import simulated_rank

    rows, seq = _rows_and_length(lengths)
    out = {}
    for stage in range(step.pipeline_parallel):
        with simulated_rank(step.world_size, step.stage_first_rank(stage)):
            out[stage] = step._measure_here(rows, seq)
    return out


__all__ = ["FORWARD_STATES", "MegatronStep", "stage_measurements"]
