"""One training step of Megatron-core's ``GPTModel`` on the ranks of its layout, with Megatron's own DDP and optimizer.

- :func:`synthetic_batch`: token ids, positions, labels and a loss mask, the same on every
  rank that passes the same seed (Megatron's layers expect identical inputs across a
  tensor-parallel group).
- :func:`megatron_optimizer`: the model wrapped in Megatron's ``DistributedDataParallel`` and
  Megatron's optimizer over it (:class:`MegatronTraining`), its state made up front
  (NOTE [ The Megatron step's optimizer ]).
- :func:`megatron_train_step`: forward with Megatron's vocab-parallel cross-entropy
  (``GPTModel`` given ``labels``), backward into the fp32 gradient buffer, Megatron's
  ``finalize_model_grads`` (the data-parallel all-reduce or reduce-scatter, the
  sequence-parallel norm gradients), the optimizer step; labelled for the tracked backends
  (NOTE [ Phases and regions ] in :mod:`batchfit.memory.labels`).
- :func:`megatron_pipeline_step`: the same through Megatron's pipeline schedule (1F1B), per stage.
- :func:`megatron_forward_step`: the forward-only pass of old and reference log-probs, as verl's
  Megatron engine runs it (NOTE [ The Megatron forward-only pass ]).

NOTE [ The Megatron step's optimizer ]
The step trains as Megatron-LM's ``train_step`` does, with megatron-core 0.16.1's own classes
on CPU ranks (the patches of NOTE [ Megatron's DDP and optimizer on CPU ranks ] in
:mod:`batchfit.models.megatron`): the model wrapped in
``megatron.core.distributed.DistributedDataParallel`` (``DistributedDataParallelConfig(
grad_reduce_in_fp32=..., use_distributed_optimizer=...)``), the optimizer from
``megatron.core.optimizer.get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=...,
use_distributed_optimizer=...), [model])``, the gradients finalised by
``megatron.core.distributed.finalize_model_grads``. What each rank then holds per parameter
of its model shard, measured (``tests/test_megatron_step.py``):

- the parameter (2 B in bf16); under the distributed optimizer DDP moves every parameter into
  one contiguous buffer per dtype (``param_and_grad_buffer.py`` l. 797, ``param.data`` a view
  of it, l. 831), padded so each data-parallel rank owns an equal range (each parameter
  starts at a multiple of 64 elements, l. 665; the buffer ends at a multiple of
  ``lcm(dp, 128)``, l. 654);
- its gradient, ``param.main_grad``: a view (l. 837) into DDP's persistent contiguous buffer
  (l. 803), fp32 with ``grad_reduce_in_fp32`` (4 B; every rank keeps the whole buffer, the
  distributed optimizer included); the backward's own gradient is added into it and freed at
  once (``distributed_data_parallel.py`` l. 440);
- for a 16-bit parameter, an fp32 main parameter: ``param.detach().clone().float()`` in
  ``Float16OptimizerWithFloat16Params`` (``optimizer/optimizer.py`` l. 674; 4 B), whose
  gradient is ``main_grad`` itself (``.float()`` of an fp32 tensor, l. 759), or, under the
  ``DistributedOptimizer``, only the shard of this data-parallel rank's range
  (``shard_model_param.clone().float()``, ``distrib_optimizer.py`` l. 399; its gradient a
  view of the buffer, l. 2419);
- Adam's two fp32 moments of each main parameter (8 B, ``exp_avg`` and ``exp_avg_sq``:
  1/dp of them under the distributed optimizer), made up front here (SkyRL #1060), and a
  4-byte step count per main parameter (per shard piece).

So a bf16 model keeps 2 + 4 + 4 + 8 = 18 B per parameter (the parameters' 2 B apart: 16 B of
optimizer and gradient), and under the distributed optimizer at DP ``d`` 2 + 4 + 12/d B
(plus padding); an fp32 model (``FP32Optimizer``, no main copy) 4 + 4 + 8 = 16 B. After the
step the distributed optimizer copies each rank's updated shard into the parameter buffer and
all-gathers it (``DistributedOptimizer.step_with_ready_grads``). ``mixed_precision=False``
on a bf16 model is Megatron without ``bf16``: no main parameters, the gradient buffer and
the moments in bf16 (``grad_reduce_in_fp32=False``).

Three choices of a GPU run, modelled as it runs them:
- Adam's kernel: megatron-core takes Transformer Engine's (or Apex's) ``FusedAdam``, and torch's
  ``AdamW`` only when neither is installed (``optimizer/__init__.py`` l. 13–34, "Apex's FusedAdam
  is a drop-in replacement for torch's AdamW"); a fused kernel updates in place, with no
  temporaries, so the inner ``AdamW`` is switched to torch's fused kernel (``fused=True``, which
  runs on the CPU and under fake tensors), not the CPU's per-parameter loop.
- No gradient clipping (``clip_grad=0``): the gradient norm ends in ``.item()``, which a fake
  tensor has no value for; the fused norm and in-place scaling of a GPU keep a few scalars.
- Synchronous gradient reduction (``overlap_grad_reduce=False``, Megatron's default): one
  bucket per buffer, the collectives run after the backward (NOTE [ Megatron's DDP and optimizer
  on CPU ranks ]).
fp16 (a loss scaler whose ``found_inf`` is read with ``.item()``) is refused.

NOTE [ Megatron's optimizer offload and precision-aware optimizer ]
``megatron_optimizer(..., precision=OptimizerPrecision(...), offload_fraction=f)`` models two
options of megatron-core 0.16.1's ``OptimizerConfig`` that cannot run here: the precision-aware
optimizer (``use_precision_aware_optimizer``) needs Transformer Engine's ``FusedAdam``
(``optimizer_config.py`` l. 386–410 raises without it), and ``optimizer_cpu_offload`` builds a
``HybridDeviceOptimizer`` that offloads only ``param.is_cuda`` tensors and opens CUDA streams
(``cpu_offloading/hybrid_optimizer.py`` l. 217, 271). Megatron's DDP and optimizer are built as
always, and the state is then laid out as those classes lay it out, with PyTorch's own tensors:

- precision-aware (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``, ``optimizer_config.py``
  l. 355): megatron-core makes no fp32 main shards (``distrib_optimizer.py`` l. 378: "main params
  are held by FusedAdam"); FusedAdam keeps the master weights in ``main_params_dtype`` and the
  moments in ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (``optimizer/__init__.py`` l. 365–383): the
  inner ``AdamW``'s state is remade as ``torch.zeros_like(p, dtype=...)`` in those dtypes; the
  gradient buffer is ``main_grads_dtype`` (Megatron-LM's ``--main-grads-dtype bf16`` turns
  ``accumulate_allreduce_grads_in_fp32`` off, arguments.py l. 1215);
- CPU offload (Megatron-LM asserts it comes with the precision-aware optimizer, arguments.py
  l. 1885): the ``HybridDeviceOptimizer`` over the shards, ``param_update_in_fp32=True``. It walks
  the parameters in order and moves them to the host until ``offload_fraction`` of their elements
  are there (``_get_sub_optimizer_param_groups``); each moved one gets an fp32 host copy, torch's
  CPU ``AdamW`` two fp32 moments on the host, and a pinned fp32 host gradient the device gradient
  is copied into before the step (``_set_sub_optimizer_grads``): 16 B per element, counted under
  :data:`OFFLOADED_OPTIMIZER_STATE`, a host category (the device peak leaves it out). What stays
  keeps an fp32 copy and fp32 moments on the device (the device ``Adam`` gets none of the
  precision-aware dtypes, ``optimizer/__init__.py`` l. 306–345). The bf16 parameters and the
  gradient buffer stay on the device.

Under either, the step is not run (``MegatronTraining.modelled_step``): FusedAdam and the CPU
``AdamW`` update in place, the device→host gradient copy lands in the pinned buffers made at the
first step and the host→device copy in the parameters themselves, so the step makes no device
tensor; torch's fused ``AdamW`` of the plain path makes none either (``tests/test_megatron_step.py``).

NOTE [ A mixture of experts' two optimizers ]
Under a mixture of experts ``get_megatron_optimizer`` builds two optimizers, chained
(``ChainedOptimizer``): one over the dense parameters (reduced over data parallel) and one over
the experts' (reduced over the expert-data-parallel group, ``DistributedDataParallel``'s
``expert_parallel_buffers``). The chain's ``step`` takes the global gradient norm first, which
ends in a value a fake tensor has not; without clipping (``clip_grad=0``) the norm changes
nothing, so the step runs each optimizer's own ``step`` in turn (``prepare_grads`` and
``step_with_ready_grads``, what the chain runs after the norm), each with its own fused Adam.

NOTE [ Megatron's MoE globals start fresh in every step ]
megatron-core keeps two tensors of a mixture of experts' router in module globals, made by the
first step that needs them and reused by every later one: the layer-wise logging tracker of the
auxiliary and z losses (``moe_utils.save_to_aux_losses_tracker``: ``torch.zeros(num_layers)``
per loss, fp32, 8 B for two layers) and ``MoEAuxLossAutoScaler.main_loss_backward_scale`` (a
scalar, made by the first backward or the pipeline schedule's ``set_loss_scale``). A step that
made them counted their bytes; a second step of the same setting in the same process did not
(measured: 3,416,500 against 3,416,508 B on the tiny Qwen3-MoE's aux-loss step, cpu and estimate
alike), so a step's peak depended on what the process had run before; and an estimate left
them as fake tensors of a fake mode that had ended, which a later step of the process would
mix with its own. Every step here therefore starts from none of them, as the first step of a
fresh process does (:func:`_fresh_moe_globals`, around :func:`megatron_train_step`,
:func:`megatron_pipeline_step` and :func:`megatron_forward_step`), and puts back what the
process held before when it ends: what the step made is dropped with it, after its peak.

NOTE [ A MoE dispatcher keeps its step's graph ]
megatron-core's token dispatchers keep the routing probabilities of the last forward as an
attribute (``MoEAlltoAllTokenDispatcher.probs``, the all-gather dispatcher's ``local_probs``, the
flex dispatcher's manager's ``token_probs``), a tensor that carries the step's autograd graph
back to the router's weight. Through that weight's gradient accumulator (a C++ node) the graph
reaches the post-hook Megatron's DDP registered on it, whose closure holds the DDP and so the
whole model, dispatcher included: a cycle through edges the garbage collector cannot see. In
training the next forward overwrites it; a probe builds a fresh model per measurement, and every
one stayed alive (measured, the tiny Qwen3-MoE under the estimate: one more
``DistributedDataParallel`` alive after each probe, about 0.8 MiB of host memory a probe; on a
real rank its parameters too). After each training step :func:`_drop_step_graphs` lets go of
the dispatchers' tensors that carry a graph (none is read after the step: the next forward
sets them again), after the step's peak.

NOTE [ Pipeline sends are waited on whole ]
A search on real ranks waits in slices (:func:`batchfit.parallel.rank_signals.listening`: each
``Work.wait`` is given 50 ms, then the guard checks whether another rank left, then waits again).
That is harmless for gloo's collectives, but gloo's point-to-point work closes its pair when a
wait times out: the first slice of a ``send_forward`` that the next stage has not received yet
ends both ranks with ``RuntimeError: Application timeout caused pair closure`` (seen on PP 2,
the first probe of a search). :func:`megatron_pipeline_step` therefore runs the schedule with
no listener (``listening(None)``: plain waits, bounded by the process group's timeout). A rank
that left the search in the middle of a pipeline step is then noticed at the next collective
after the schedule, not inside it; real ranks run every probe to the end anyway (NOTE [ Real
ranks run their probes to the end ] in :mod:`batchfit.memory.base`).

NOTE [ The Megatron forward-only pass ]
verl computes old and reference log-probs with Megatron as its engine's ``infer_batch`` does
(verl 0.9.1, ``workers/engine/base.py`` and ``workers/engine/megatron/transformer_impl.py``):
the model in eval mode (``eval_mode``: ``module.eval()``, so no recomputation and no dropout),
``torch.no_grad()``, and Megatron's own schedule with ``forward_only=True``
(``forward_backward_batch(..., forward_only=True)`` through ``get_forward_backward_func()``);
the last stage's ``GPTModel`` runs without labels and returns its ``[b, s, V/t]`` logits
(``logits.transpose(0, 1).contiguous()``, a copy of the ``[s, b, V/t]`` output), and
``_lm_head_logits_processor`` takes ``vocab_parallel_log_probs_from_logits(logits, label)``,
which is ``-tensor_parallel.vocab_parallel_cross_entropy(logits, label)``
(``verl/utils/megatron/tensor_parallel.py``): fp32 ``[b, s]`` log-probs, whose temporaries are
the cross-entropy's fp32 copy of the logits and its softmax. Each micro-batch's log-probs are
detached and kept until the schedule ends (verl's ``postprocess_micro_batch_func`` returns them
as ``model_output``, which the schedule appends to its ``forward_data_store``):
:func:`megatron_forward_step` keeps them too and returns them. Without a backward, nothing
else outlives a micro-batch: 1F1B's forward-only path releases each one's activations after
its forward, so every stage holds one micro-batch's at a time. The temperature (verl divides
the logits in place) and the entropy (``calculate_entropy``: a clone of the logits) are left
out of this default head; ``head=`` runs verl's (or SkyRL's, slime's) on the logits, entropy
included (NOTE [ Framework heads under Megatron ] in :mod:`batchfit.train.megatron_heads`). What stays resident is the caller's: the policy's forward (``policy_forward``) keeps its
DDP buffers and Megatron's optimizer state (:func:`megatron_optimizer`, registered as
:meth:`MegatronTraining.registered`; only the buffers with ``optimizer_state=False``, verl's
``optimizer_offload``), a reference only its parameters (verl builds a forward-only engine with
``wrap_with_ddp=False`` and no optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.dtypes import parse_dtype
from batchfit.errors import InvalidArgument
from batchfit.memory import labels
from batchfit.memory.categories import GRADIENTS, LOGPROB_HEAD, OPTIMIZER_STATE, OPTIMIZER_STEP, PARAMETERS
from batchfit.parallel.rank_signals import listening
from batchfit.train.megatron_heads import MegatronHead, fused_head_outputs, head_loss, head_outputs
from batchfit.train.optim import initialize_optimizer_state
from batchfit.validation import check_positive_int


@dataclass
class MegatronBatch:
    """One micro-batch as ``GPTModel.forward`` takes it: ``[batch, seq]`` tensors.

    Attributes:
        input_ids: token ids (int64).
        position_ids: 0..seq-1 per row (int64).
        labels: the next tokens (int64); the loss of position ``i`` predicts ``labels[:, i]``.
        loss_mask: 1.0 where the loss counts (float32).
        attention_mask: ``[1, 1, seq, seq]`` bool, ``True`` above the diagonal (masked), as
            Megatron-LM's ``get_ltor_masks_and_position_ids`` makes it (NOTE [ Megatron on CPU
            ranks ] in :mod:`batchfit.models.megatron`: without it Megatron makes it on CUDA).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors (to register as the step's inputs): four, and the mask when there is one."""
        tensors = (self.input_ids, self.position_ids, self.labels, self.loss_mask, self.attention_mask)
        return tuple(t for t in tensors if t is not None)


def synthetic_batch(vocab_size: int, batch: int, seq: int, *, seed: int = 0, attention_mask: bool = True) -> MegatronBatch:
    """Random tokens of ``batch`` rows of ``seq`` tokens, the same on every rank that passes the same ``seed``.

    ``attention_mask=False`` leaves the ``[1, 1, seq, seq]`` mask out: fused attention takes the causal
    mask as a flag (:class:`batchfit.models.megatron_attention.SdpaAttention`, as Transformer Engine's).

    Raises:
        InvalidArgument: a size that is not a positive integer.
    """
    vocab_size = check_positive_int("vocab_size", vocab_size)
    batch = check_positive_int("batch", batch)
    seq = check_positive_int("seq", seq)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    return MegatronBatch(
        input_ids=tokens[:, :-1].contiguous(),
        position_ids=torch.arange(seq).expand(batch, seq).contiguous(),
        labels=tokens[:, 1:].contiguous(),
        loss_mask=torch.ones(batch, seq, dtype=torch.float32),
        attention_mask=torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1) if attention_mask else None,
    )


#: Host bytes of the optimizer state Megatron's ``HybridDeviceOptimizer`` moved to the host (NOTE [ Megatron's
#: optimizer offload and precision-aware optimizer ]): a host category, not in the device peak.
OFFLOADED_OPTIMIZER_STATE = "offloaded_optimizer_state"
#: Megatron-LM's dtype names of the precision-aware optimizer's flags (``--exp-avg-dtype`` …; ``fp8``: e4m3).
STATE_DTYPES = {**{short: parse_dtype(short) for short in ("fp32", "fp16", "bf16")}, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class OptimizerPrecision:
    """Megatron's precision-aware optimizer (``--use-precision-aware-optimizer``) and its dtypes, Megatron-LM's defaults.

    ``main_params`` is ``fp32`` or ``fp16``, ``main_grads`` ``fp32`` or ``bf16``, the moments ``fp32``, ``fp16``,
    ``bf16`` or ``fp8`` (Megatron-LM arguments.py l. 3671–3683 choices).

    Raises:
        InvalidArgument: a dtype Megatron-LM does not offer for that field.
    """

    main_params: str = "fp32"
    main_grads: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    def __post_init__(self) -> None:
        from batchfit.validation import check_choice

        for name, choices in (
            ("main_params", ("fp32", "fp16")),
            ("main_grads", ("fp32", "bf16")),
            ("exp_avg", tuple(STATE_DTYPES)),
            ("exp_avg_sq", tuple(STATE_DTYPES)),
        ):
            check_choice(f"{name}_dtype", getattr(self, name), choices)

    def dtype(self, name: str) -> torch.dtype:
        return STATE_DTYPES[getattr(self, name)]


@dataclass
class MegatronTraining:
    """What one rank trains with (NOTE [ The Megatron step's optimizer ]): its model in Megatron's DDP, Megatron's optimizer.

    Attributes:
        model: the model wrapped in ``megatron.core.distributed.DistributedDataParallel``
            (its ``module`` is the ``GPTModel``); with virtual pipeline stages the first chunk's.
        optimizer: Megatron's optimizer (``Float16OptimizerWithFloat16Params``,
            ``DistributedOptimizer`` or ``FP32Optimizer``); its ``optimizer`` is the inner
            ``torch.optim.AdamW`` over the main parameters.
        mixed_precision: fp32 main parameters and gradients for 16-bit parameters.
        distributed: Megatron's distributed optimizer (main parameters and moments sharded
            over the data-parallel group).
        chunks: every model chunk of this stage in its DDP wrapper (``[model]`` without virtual
            pipeline stages).
        device_state: the optimizer state on the device when it is laid out as the precision-aware or
            offloaded optimizer keeps it (NOTE [ Megatron's optimizer offload and precision-aware optimizer ]);
            ``None``: the inner Adams' own main parameters and moments.
        host_state: the offloaded share's host tensors (fp32 copies, moments, gradients).
        modelled_step: the optimizer step is not run (it makes no device tensor under those optimizers).
    """

    model: torch.nn.Module
    optimizer: Any
    mixed_precision: bool
    distributed: bool
    chunks: list[torch.nn.Module] = dataclasses.field(default_factory=list)
    device_state: list[torch.Tensor] | None = None
    host_state: list[torch.Tensor] = dataclasses.field(default_factory=list)
    modelled_step: bool = False

    def __post_init__(self) -> None:
        if not self.chunks:
            self.chunks = [self.model]

    def gradient_buffers(self) -> list[torch.Tensor]:
        """DDP's contiguous gradient buffers (``main_grad`` of every parameter is a view of one)."""
        return [b.grad_data for b in self._buffers()]

    def parameter_buffers(self) -> list[torch.Tensor]:
        """DDP's contiguous parameter buffers (the distributed optimizer's; none without it)."""
        return [b.param_data for b in self._buffers() if b.param_data is not None]

    @property
    def optimizers(self) -> list[Any]:
        """Megatron's optimizers: one for a dense model; a mixture of experts' dense and expert parameters each have
        their own (their data-parallel groups differ), chained (NOTE [ A mixture of experts' two optimizers ])."""
        return list(getattr(self.optimizer, "chained_optimizers", None) or [self.optimizer])

    def main_parameters(self) -> list[torch.Tensor]:
        """The tensors the inner Adams update: fp32 main parameters (or their shards), or the parameters themselves."""
        return [p for o in self.optimizers for group in o.optimizer.param_groups for p in group["params"]]

    def registered(self, *, optimizer_state: bool = True) -> tuple[list[Any], list[str | None]]:
        """What a measurement registers beside the ``GPTModel`` (register the model first), with their categories.

        Use as ``objects, categories = training.registered()`` then ``backend.measure(fn,
        register=(model, *objects, inputs), categories=(None, *categories, None))``: the
        gradient buffers are ``gradients``, the main parameters and Adam's moments
        ``optimizer_state``, the distributed optimizer's parameter buffer ``parameters`` (it
        holds the model's parameters and their padding; a storage counts once).
        ``optimizer_state=False`` leaves the main parameters and moments out: DDP's buffers
        alone, what a forward pass keeps when the optimizer state is offloaded between updates
        (verl's ``optimizer_offload``: NOTE [ The Megatron forward-only pass ]).
        """
        if not optimizer_state:
            return [self.parameter_buffers(), self.gradient_buffers()], [PARAMETERS, GRADIENTS]
        if self.device_state is not None:  # NOTE [ Megatron's optimizer offload and precision-aware optimizer ]
            return (
                [self.parameter_buffers(), self.gradient_buffers(), self.device_state, self.host_state],
                [PARAMETERS, GRADIENTS, OPTIMIZER_STATE, OFFLOADED_OPTIMIZER_STATE],
            )
        return (
            [self.parameter_buffers(), self.gradient_buffers(), self.main_parameters(), [o.optimizer for o in self.optimizers]],
            [PARAMETERS, GRADIENTS, OPTIMIZER_STATE, OPTIMIZER_STATE],
        )

    def _buffers(self) -> list[Any]:
        # DDP's lists (they shadow Module.buffers), every chunk's
        return [b for chunk in self.chunks for b in (*chunk.buffers, *chunk.expert_parallel_buffers)]


def megatron_optimizer(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    *,
    mixed_precision: bool | None = None,
    distributed: bool = False,
    lr: float = 1e-6,
    precision: OptimizerPrecision | None = None,
    offload_fraction: float = 0.0,
) -> MegatronTraining:
    """Wrap ``model`` in Megatron's DDP and build Megatron's optimizer over it, its state made now (NOTE [ The Megatron step's optimizer ]).

    Call it inside :func:`batchfit.models.megatron.model_parallel` and
    :func:`~batchfit.models.megatron.megatron_cpu_patches` (and the backend's ``context()``),
    on every rank at once: the optimizer gathers its parameter groups over the world.

    Args:
        model: this rank's ``GPTModel`` (:func:`batchfit.models.megatron.build_gpt_model`), or its
            model chunks under virtual pipeline stages (:func:`~batchfit.models.megatron.build_gpt_chunks`:
            one DDP wrapper each, one optimizer over them all, as Megatron-LM's ``get_model``).
        mixed_precision: fp32 main parameters, fp32 gradient buffer (``OptimizerConfig.bf16``,
            ``grad_reduce_in_fp32``); ``None``: when the parameters are bf16. Nothing to do for
            fp32 parameters.
        distributed: Megatron's distributed optimizer (``use_distributed_optimizer``): each
            data-parallel rank keeps the main parameters and moments of its 1/dp range of the
            gradient buffer, which is reduce-scattered instead of all-reduced.
        lr: the learning rate.
        precision: Megatron's precision-aware optimizer and its dtypes; ``None``: off.
        offload_fraction: the share of the main parameters' elements Megatron's ``HybridDeviceOptimizer``
            moves to the host (``optimizer_cpu_offload`` with ``optimizer_offload_fraction``); 0: no offload.
            Needs ``precision`` (Megatron-LM asserts it). NOTE [ Megatron's optimizer offload and
            precision-aware optimizer ].

    Returns:
        The wrapped model and the optimizer; the inner Adam's moments exist, zero.

    Raises:
        InvalidArgument: fp16 parameters, or ``mixed_precision=False`` with the distributed
            optimizer on 16-bit parameters (it always keeps fp32 main shards); an offload
            without the precision-aware optimizer, or a fraction outside [0, 1].
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    config = chunks[0].config
    dtype = config.params_dtype
    if dtype is torch.float16:
        raise InvalidArgument(
            "fp16 parameters train with a loss scaler whose overflow check reads a value (found_inf.item()), which the estimate "
            "backend's fake tensors have not; build the model with dtype=torch.bfloat16 or torch.float32"
        )
    sixteen_bit = dtype is torch.bfloat16
    if mixed_precision is None:
        mixed_precision = sixteen_bit
    mixed_precision = bool(mixed_precision) and sixteen_bit
    if distributed and sixteen_bit and not mixed_precision:
        raise InvalidArgument(
            "mixed_precision=False with distributed=True: Megatron's distributed optimizer always keeps fp32 main shards "
            "of bf16 parameters (DistributedOptimizer._build_model_and_main_param_groups); pass mixed_precision=True, or distributed=False"
        )
    offload_fraction = float(offload_fraction)
    if not 0.0 <= offload_fraction <= 1.0:
        raise InvalidArgument(
            f"offload_fraction={offload_fraction} must be a fraction in [0, 1] (Megatron's optimizer_offload_fraction); pass e.g. 1.0"
        )
    if offload_fraction and precision is None:
        raise InvalidArgument(
            "an optimizer offloaded to the host needs the precision-aware optimizer (Megatron-LM arguments.py: 'The optimizer "
            "cpu offload must be used in conjunction with --use-precision-aware-optimizer'); pass precision=OptimizerPrecision()"
        )
    fp32_grads = mixed_precision and (precision is None or precision.main_grads == "fp32")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_grads or dtype is torch.float32,
        use_distributed_optimizer=bool(distributed),
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    wrapped = [
        # Megatron-LM's get_model: bucketing off for every chunk but the first (it overlaps nothing here)
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        bf16=mixed_precision,
        params_dtype=dtype,
        use_distributed_optimizer=bool(distributed),
        clip_grad=0.0,
    )
    optimizer = get_megatron_optimizer(optimizer_config, wrapped, use_gloo_process_groups=False)
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None and len(chained) == 1:
        optimizer = chained[0]  # a dense model: one optimizer; the chain's step would take the norm (clip_grad=0)
    for inner in chained or [optimizer]:  # NOTE [ A mixture of experts' two optimizers ]
        _fused_adam(inner.optimizer)
        _initialize_main_state(inner.optimizer)
    training = MegatronTraining(
        model=wrapped[0], optimizer=optimizer, mixed_precision=mixed_precision, distributed=bool(distributed), chunks=wrapped
    )
    if precision is not None and mixed_precision:
        _lay_out_state(training, precision, offload_fraction)
    return training


def _lay_out_state(training: MegatronTraining, precision: OptimizerPrecision, offload_fraction: float) -> None:
    """The optimizer state as the precision-aware optimizer (and the ``HybridDeviceOptimizer``) keeps it, in PyTorch's own
    tensors (NOTE [ Megatron's optimizer offload and precision-aware optimizer ])."""
    device: list[torch.Tensor] = []
    host: list[torch.Tensor] = []
    for inner in training.optimizers:
        adam = inner.optimizer
        params = [p for group in adam.param_groups for p in group["params"]]
        threshold, moved = offload_fraction * sum(p.numel() for p in params), 0
        for p in params:
            state = adam.state.get(p, {})
            if moved < threshold:  # HybridDeviceOptimizer._get_sub_optimizer_param_groups: in order, by elements
                moved += p.numel()
                # the fp32 host copy, CPU AdamW's two fp32 moments, the pinned fp32 host gradient
                host += [torch.empty(p.shape, dtype=torch.float32) for _ in range(4)]
            elif offload_fraction:
                # HybridDeviceOptimizer's device share: an fp32 copy (param_update_in_fp32) and the device Adam's fp32 moments
                device += [torch.empty(p.shape, dtype=torch.float32) for _ in range(3)]
            else:
                # FusedAdam's master weight and moments in the configured dtypes
                device += [
                    torch.empty(p.shape, dtype=precision.dtype("main_params")),
                    torch.zeros_like(p, dtype=precision.dtype("exp_avg")),
                    torch.zeros_like(p, dtype=precision.dtype("exp_avg_sq")),
                ]
            state.clear()  # megatron-core's own fp32 main shard and moments are not made under these optimizers
    training.device_state, training.host_state, training.modelled_step = device, host, True


def _fused_adam(adam: torch.optim.Optimizer) -> None:
    """Run torch's AdamW with its fused kernel, as Transformer Engine's ``FusedAdam`` runs (NOTE [ The Megatron step's optimizer ])."""
    if not isinstance(adam, torch.optim.AdamW | torch.optim.Adam):
        return
    adam.defaults["fused"], adam.defaults["foreach"] = True, False
    for group in adam.param_groups:
        group["fused"], group["foreach"] = True, False


def _initialize_main_state(adam: torch.optim.Optimizer) -> None:
    """Make the inner Adam's moments now: the main parameters are copies (``requires_grad=False``), so mark them for the helper."""
    params = [p for group in adam.param_groups for p in group["params"]]
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        initialize_optimizer_state(adam)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside Megatron's DDP (the model itself otherwise)."""
    from megatron.core.distributed import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _per_token_loss(model: torch.nn.Module, batch: MegatronBatch, head: MegatronHead | None = None) -> torch.Tensor:
    """``GPTModel``'s forward: ``[b, s]`` per-token losses on the last stage, hidden states elsewhere; the head labelled.

    ``head`` (a framework's, NOTE [ Framework heads under Megatron ] in
    :mod:`batchfit.train.megatron_heads`): ``GPTModel`` without labels gives its logits, which the
    framework's head turns into the loss; ``None`` or ``"megatron"``: Megatron's own cross-entropy.
    """
    inner = _unwrapped(model)
    head_module = getattr(inner, "output_layer", None) if getattr(inner, "post_process", True) else None
    handles = []
    if head_module is not None:  # the logits and the cross-entropy are the head's (NOTE [ Phases and regions ])
        handles.append(head_module.register_forward_pre_hook(lambda module, args: labels.set_region(LOGPROB_HEAD)))
        handles.append(head_module.register_forward_pre_hook(lambda module, args: labels.set_position(labels.HEAD)))
    try:
        if head is None or head.is_default:
            return model(batch.input_ids, batch.position_ids, batch.attention_mask, labels=batch.labels)
        with _hidden_states_out(head_module if head.fused else None) as weight:
            output = model(batch.input_ids, batch.position_ids, batch.attention_mask)  # the logits on the last stage
        if head_module is None:
            return output
        return head_loss(head, output, batch.labels, weight=weight.get("weight"))  # still in the head's region
    finally:
        labels.set_region(None)
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _hidden_states_out(output_layer: torch.nn.Module | None) -> Iterator[dict[str, torch.Tensor]]:
    """SkyRL's fused LM head (NOTE [ SkyRL's fused LM head ] in :mod:`batchfit.train.megatron_heads`): ``output_layer``
    returns its input, the ``[s, b, h]`` hidden states (gathered over the tensor-parallel group under sequence
    parallelism, as the layer would before its matmul), and leaves the weight it would use in the dict yielded.
    ``None``: nothing changes."""
    seen: dict[str, torch.Tensor] = {}
    if output_layer is None:
        yield seen
        return

    def forward(hidden_states: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple[torch.Tensor, None]:
        seen["weight"] = output_layer.weight if weight is None else weight
        if getattr(output_layer, "sequence_parallel", False):
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=True)
        return hidden_states, None

    output_layer.forward = forward  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        del output_layer.forward


def _masked_mean(per_token: torch.Tensor, batch: MegatronBatch) -> torch.Tensor:
    mask = batch.loss_mask
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def megatron_loss(model: torch.nn.Module, batch: MegatronBatch, *, head: MegatronHead | None = None) -> torch.Tensor:
    """The masked mean of Megatron's per-token loss: ``GPTModel(..., labels=...)`` runs its vocab-parallel cross-entropy.

    ``model`` is the ``GPTModel`` or its DDP wrapper. The batch's causal mask is passed in (the
    local spec's ``DotProductAttention`` would make one on CUDA). With pipeline parallelism use
    :func:`megatron_pipeline_step`. ``head``: a framework's head on the logits instead
    (:func:`batchfit.train.megatron_heads.head_loss`).
    """
    return _masked_mean(_per_token_loss(model, batch, head), batch)


def finalize_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """All-reduce over the tensor-parallel group the ``.grad`` of parameters sequence parallelism replicates (a model without Megatron's DDP).

    Under sequence parallelism each TP rank's norm weights see only its part of the sequence;
    Megatron's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums
    their ``main_grad`` over the TP group, which :func:`megatron_train_step` runs; this is the
    same in place in ``.grad``, for a model trained with a plain torch optimizer. Nothing to do
    without sequence parallelism.
    """
    config = getattr(model, "config", None)
    if config is None or not config.sequence_parallel or config.tensor_model_parallel_size == 1:
        return
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad, group=group)


def _training(optimizer: Any) -> MegatronTraining:
    if not isinstance(optimizer, MegatronTraining):
        raise InvalidArgument(
            f"the Megatron step trains with Megatron's DDP and optimizer, but got optimizer={type(optimizer).__name__}; "
            "pass what megatron_optimizer(model) returns"
        )
    return optimizer


def _zero_grads(training: MegatronTraining) -> None:
    """What Megatron-LM's ``train_step`` does first: zero the gradient buffers, drop the main parameters' gradients."""
    for chunk in training.chunks:
        chunk.zero_grad_buffer()
    training.optimizer.zero_grad()


def _optimizer_step(training: MegatronTraining) -> None:
    if training.modelled_step:  # NOTE [ Megatron's optimizer offload and precision-aware optimizer ]: no device tensor
        return
    with labels.phase(labels.OPTIMIZER), labels.region(OPTIMIZER_STEP):
        for optimizer in training.optimizers:  # NOTE [ A mixture of experts' two optimizers ]
            optimizer.step()


@contextlib.contextmanager
def _fresh_moe_globals() -> Iterator[None]:
    """Run a step without megatron-core's MoE globals, then put back what the process held (NOTE [ Megatron's MoE globals start fresh in every step ])."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    scaler = moe_utils.MoEAuxLossAutoScaler
    saved_tracker, saved_scale = dict(tracker), scaler.main_loss_backward_scale
    tracker.clear()
    scaler.main_loss_backward_scale = None
    try:
        yield
    finally:
        tracker.clear()
        tracker.update(saved_tracker)
        scaler.main_loss_backward_scale = saved_scale


def _drop_step_graphs(chunks: Sequence[torch.nn.Module]) -> None:
    """Let go of what the MoE token dispatchers of ``chunks`` kept of the step's graph (NOTE [ A MoE dispatcher keeps its step's graph ])."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None:
                continue
            for holder in (dispatcher, getattr(dispatcher, "_comm_manager", None)):
                for name, value in list(vars(holder).items()) if holder is not None else ():
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)


def megatron_train_step(
    model: torch.nn.Module, optimizer: MegatronTraining, batch: MegatronBatch, *, head: MegatronHead | None = None
) -> float:
    """One step on this rank: forward (vocab-parallel cross-entropy), backward, ``finalize_model_grads``, Megatron's optimizer step.

    Run it inside :func:`batchfit.models.megatron.megatron_cpu_patches` on every rank of the
    layout at once (the layers' and the gradients' collectives pair them). With data parallelism
    the gradient buffer is all-reduced over the data-parallel group (reduce-scattered under the
    distributed optimizer, whose step then all-gathers the parameters).

    Args:
        model: the ``GPTModel`` (or ``optimizer.model``, its DDP wrapper).
        optimizer: :func:`megatron_optimizer`'s result for it.
        batch: this rank's micro-batch.
        head: the framework's head on the logits (NOTE [ Framework heads under Megatron ] in
            :mod:`batchfit.train.megatron_heads`); ``None``: Megatron's cross-entropy.

    Returns:
        The loss (a float; ``nan`` under fake tensors, which have no values).

    Raises:
        InvalidArgument: ``optimizer`` is not a :class:`MegatronTraining`.
    """
    from megatron.core.distributed import finalize_model_grads

    training = _training(optimizer)
    with _fresh_moe_globals():  # NOTE [ Megatron's MoE globals start fresh in every step ]
        _zero_grads(training)
        with labels.phase(labels.FORWARD):
            labels.set_position(labels.EMBED)
            loss = megatron_loss(training.model, batch, head=head)
        with labels.phase(labels.BACKWARD):
            loss.backward()
            finalize_model_grads([training.model])
        _optimizer_step(training)
    _drop_step_graphs(training.chunks)  # NOTE [ A MoE dispatcher keeps its step's graph ]
    return _value(loss)


def megatron_pipeline_step(
    model: torch.nn.Module,
    optimizer: MegatronTraining,
    micro_batches: Sequence[MegatronBatch],
    *,
    head: MegatronHead | None = None,
) -> float | None:
    """One step of this pipeline stage under Megatron's own schedule, then Megatron's optimizer step.

    ``megatron.core.pipeline_parallel.get_forward_backward_func()`` picks the schedule: with
    pipeline parallelism, 1F1B without interleaving (``forward_backward_pipelining_without_interleaving``:
    stage ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, so the first stage holds up to ``p``
    micro-batches' activations in flight); without, forward and backward per micro-batch. Every
    stage passes the same micro-batches (the first reads the tokens, the last the labels); the
    schedule sends activations and their gradients between stages (``isend``/``irecv`` over the
    pipeline group), divides each micro-batch's loss by their number and ends with
    ``finalize_model_grads`` (set as the config's ``finalize_model_grads_func``, with DDP's
    ``no_sync`` as ``no_sync_func``, as Megatron-LM's ``train`` sets them). With virtual pipeline
    stages (``optimizer.chunks``: :func:`~batchfit.models.megatron.build_gpt_chunks`) it is the
    interleaved 1F1B schedule (``forward_backward_pipelining_with_interleaving``) over the chunks,
    each reading its own iterator of the same micro-batches; their number must be a multiple of
    the pipeline's stages.

    Args:
        model: this stage's ``GPTModel`` (:func:`batchfit.models.megatron.build_gpt_model`) or its DDP wrapper.
        optimizer: :func:`megatron_optimizer`'s result for it.
        micro_batches: the step's micro-batches, all of one shape.
        head: the framework's head on the last stage's logits (as :func:`megatron_train_step`).

    Returns:
        The mean loss over the micro-batches on the last stage (``nan`` under fake tensors),
        ``None`` on the others.

    Raises:
        InvalidArgument: no micro-batch, micro-batches of different shapes, an optimizer not
            made by :func:`megatron_optimizer`, or (virtual stages) micro-batches that are not a
            multiple of the pipeline's stages.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    training = _training(optimizer)
    ((micro_batch_size, seq_length),) = _one_shape(micro_batches)
    losses: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, stage: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = _masked_mean(per_token, batch)
            losses.append(loss.detach().clone())  # the schedule divides the returned loss in place
            return loss, {"loss": loss.detach()}

        return _per_token_loss(stage, batch, head), loss_func

    chunks = training.chunks
    _check_interleaved(len(chunks), len(micro_batches))
    config = _unwrapped(training.model).config
    saved = (config.finalize_model_grads_func, config.no_sync_func)
    no_sync = training.model.no_sync if len(chunks) == 1 else [chunk.no_sync for chunk in chunks]  # Megatron-LM's train
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, no_sync
    _zero_grads(training)
    forward_backward = get_forward_backward_func()
    with _fresh_moe_globals():  # NOTE [ Megatron's MoE globals start fresh in every step ]
        try:
            with listening(None):  # type: ignore[arg-type]  # NOTE [ Pipeline sends are waited on whole ]
                forward_backward(
                    forward_step_func=forward_step,
                    data_iterator=_data_iterators(micro_batches, len(chunks)),
                    model=list(chunks),
                    num_microbatches=len(micro_batches),
                    seq_length=seq_length * _context_parallel(),  # the schedule's shapes divide it by cp
                    micro_batch_size=micro_batch_size,
                    forward_only=False,
                )
        finally:
            config.finalize_model_grads_func, config.no_sync_func = saved
        _optimizer_step(training)
    _drop_step_graphs(chunks)  # NOTE [ A MoE dispatcher keeps its step's graph ]
    if not losses:
        return None
    return _value(torch.stack(losses).mean())


def _log_probs_head(inner: torch.nn.Module) -> Any:
    """A forward pre-hook labelling ``inner``'s output layer as the head (NOTE [ Phases and regions ]), or ``None`` off the last stage."""
    head = getattr(inner, "output_layer", None) if getattr(inner, "post_process", True) else None
    if head is None:
        return None

    def enter(module: torch.nn.Module, args: Any) -> None:
        labels.set_region(LOGPROB_HEAD)
        labels.set_position(labels.HEAD)

    return head.register_forward_pre_hook(enter)


def megatron_log_probs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of ``target`` from vocab-parallel ``[b, s, V/t]`` logits: verl's ``vocab_parallel_log_probs_from_logits``.

    ``-megatron.core.tensor_parallel.vocab_parallel_cross_entropy(logits, target)``: fp32 ``[b, s]``
    (NOTE [ The Megatron forward-only pass ]).
    """
    from megatron.core import tensor_parallel

    return -tensor_parallel.vocab_parallel_cross_entropy(vocab_parallel_logits=logits, target=target)


def megatron_forward_step(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    micro_batches: Sequence[MegatronBatch],
    *,
    head: MegatronHead | None = None,
) -> list[torch.Tensor] | None:
    """The forward-only pass of old or reference log-probs on this stage, through Megatron's schedule (NOTE [ The Megatron forward-only pass ]).

    Under ``torch.no_grad()`` with the model in eval mode (restored after), Megatron's
    ``get_forward_backward_func()`` runs ``forward_only=True`` over ``micro_batches`` (1F1B's
    forward-only path under pipeline parallelism, one forward per micro-batch without); the last
    stage's ``GPTModel`` gives its ``[b, s, V/t]`` logits and :func:`megatron_log_probs` their
    per-token log-probs, kept until the schedule ends, as verl keeps them. Run it inside
    :func:`batchfit.models.megatron.megatron_cpu_patches` on every rank of the layout at once.

    Args:
        model: this stage's ``GPTModel`` or its DDP wrapper (a trained model's forward pass:
            :func:`megatron_optimizer`'s ``model``), or its model chunks under virtual pipeline
            stages (the interleaved schedule; ``MegatronTraining.chunks``).
        micro_batches: the pass's micro-batches, all of one shape (a multiple of the pipeline's
            stages with virtual stages).
        head: the framework's head on the logits (NOTE [ Framework heads under Megatron ] in
            :mod:`batchfit.train.megatron_heads`), its entropy kept beside the log-probs until the
            schedule ends where it computes one (verl's and slime's ``model_output``); ``None``:
            :func:`megatron_log_probs`.

    Returns:
        Each micro-batch's fp32 ``[b, s]`` log-probs on the last stage, ``None`` on the others.

    Raises:
        InvalidArgument: no micro-batch, micro-batches of different shapes, or (virtual stages)
            micro-batches that are not a multiple of the pipeline's stages.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ((micro_batch_size, seq_length),) = _one_shape(micro_batches)
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    _check_interleaved(len(chunks), len(micro_batches))
    kept: list[torch.Tensor] = []
    kept_entropy: list[torch.Tensor] = []  # alive until the schedule ends, as the log-probs

    def forward_step(data_iterator: Any, stage: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)
        inner = _unwrapped(stage)
        hook = _log_probs_head(inner)
        fused = head is not None and head.fused and getattr(inner, "post_process", True)
        try:
            with _hidden_states_out(inner.output_layer if fused else None) as weight:
                output = stage(batch.input_ids, batch.position_ids, batch.attention_mask)  # no labels: the logits
        finally:
            if hook is None:
                labels.set_region(None)
            else:
                hook.remove()

        def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            try:
                with labels.region(LOGPROB_HEAD):
                    if head is None or head.is_default:
                        log_probs = megatron_log_probs(logits, batch.labels)
                    else:
                        log_probs, entropy = (
                            fused_head_outputs(head, logits, weight["weight"], batch.labels) if fused
                            else head_outputs(head, logits, batch.labels)
                        )
                        if entropy is not None:
                            kept_entropy.append(entropy.detach())
            finally:
                labels.set_region(None)
            kept.append(log_probs.detach())
            return torch.ones(()), {"log_probs": kept[-1]}  # verl's loss placeholder without a loss function

        return output, loss_func

    was_training = [chunk.training for chunk in chunks]
    for chunk in chunks:
        chunk.eval()
    forward_backward = get_forward_backward_func()
    try:
        # NOTE [ Megatron's MoE globals start fresh in every step ]
        with torch.no_grad(), labels.phase(labels.FORWARD), listening(None), _fresh_moe_globals():  # type: ignore[arg-type]
            labels.set_position(labels.EMBED)
            forward_backward(
                forward_step_func=forward_step,
                data_iterator=_data_iterators(micro_batches, len(chunks)),
                model=chunks,
                num_microbatches=len(micro_batches),
                seq_length=seq_length * _context_parallel(),  # the schedule's shapes divide it by cp
                micro_batch_size=micro_batch_size,
                forward_only=True,
            )
    finally:
        for chunk, mode in zip(chunks, was_training):
            chunk.train(mode)
    return kept or None


def _data_iterators(micro_batches: Sequence[MegatronBatch], chunks: int) -> Any:
    """The schedule's data: one iterator, or one per model chunk (the interleaved schedule reads chunk ``i``'s from the ``i``-th)."""
    return iter(micro_batches) if chunks == 1 else [iter(micro_batches) for _ in range(chunks)]


def _check_interleaved(chunks: int, micro_batches: int) -> None:
    """The interleaved schedule runs micro-batches in groups of the pipeline's stages: a multiple of them."""
    if chunks == 1:
        return
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if micro_batches % pp:
        raise InvalidArgument(
            f"{micro_batches} micro-batches under virtual pipeline stages ({chunks} model chunks per stage): the interleaved "
            f"schedule needs a multiple of pipeline_parallel={pp}; pass {pp * max(1, micro_batches // pp)} micro-batches"
        )


def _one_shape(micro_batches: Sequence[MegatronBatch]) -> set[tuple[int, ...]]:
    if not micro_batches:
        raise InvalidArgument("micro_batches must hold at least one MegatronBatch, but got none")
    shapes = {tuple(b.input_ids.shape) for b in micro_batches}
    if len(shapes) != 1:
        raise InvalidArgument(
            f"micro_batches must share one [batch, seq] shape (Megatron's schedule sends one tensor shape), but got {sorted(shapes)}"
        )
    return shapes


def _context_parallel() -> int:
    """Megatron's context-parallel size: a micro-batch's rows hold ``seq / cp`` tokens on each rank (NOTE [ Context
    parallelism as Megatron runs it ] in :mod:`batchfit.models.megatron_context`)."""
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def _value(loss: torch.Tensor) -> float:
    from torch._subclasses.fake_tensor import is_fake

    return float("nan") if is_fake(loss) else float(loss.detach())


__all__ = [
    "OFFLOADED_OPTIMIZER_STATE",
    "STATE_DTYPES",
    "MegatronBatch",
    "MegatronTraining",
    "OptimizerPrecision",
    "finalize_sequence_parallel_grads",
    "megatron_forward_step",
    "megatron_log_probs",
    "megatron_loss",
    "megatron_optimizer",
    "megatron_pipeline_step",
    "megatron_train_step",
    "synthetic_batch",
]
