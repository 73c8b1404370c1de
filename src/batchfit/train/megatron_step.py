"""One training step of Megatron-core's ``GPTModel`` on the ranks of its tensor-parallel group.

- :func:`synthetic_batch`: token ids, positions, labels and a loss mask, the same on every
  rank of a tensor-parallel group (Megatron's layers expect identical inputs across it).
- :func:`megatron_optimizer`: the optimizer (NOTE [ Pipeline sends are waited on whole ]
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

NOTE [ The Megatron step's optimizer ]), its state made up front.
- :func:`megatron_pipeline_step`: the same through Megatron's pipeline schedule (1F1B), per stage.
- :func:`megatron_train_step`: forward with Megatron's vocab-parallel cross-entropy (``GPTModel``
  given ``labels``), backward, the sequence-parallel gradient all-reduce Megatron's
  ``finalize_model_grads`` makes, the optimizer step; labelled for the tracked backends
  (NOTE [ Phases and regions ] in :mod:`batchfit.memory.labels`).

NOTE [ The Megatron step's optimizer ]
The step trains with torch's AdamW (``foreach=True``, :func:`batchfit.train.optim.default_optimizer`)
over the model's parameters, not Megatron's own optimizer: megatron-core 0.16.1's optimizers need
its ``DistributedDataParallel`` (they step from ``param.main_grad``, the contiguous fp32 gradient
buffer it makes), and both allocate on CUDA by name: ``param_and_grad_buffer.py`` makes its buffers
on ``torch.cuda.current_device()`` and overlaps communication on ``torch.cuda`` streams, and
``MixedPrecisionOptimizer`` makes ``found_inf`` with ``device='cuda'`` (``optimizer/optimizer.py``).
With fp32 parameters and one data-parallel rank the state is the same: two fp32 moments per
parameter, gradients of the parameters' dtype. What this leaves out of a bf16 Megatron run (the
fp32 main gradients and main parameters of its mixed-precision optimizer, its distributed
optimizer's sharding over data parallel) is the next step of issue 42.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.memory import labels
from batchfit.memory.categories import LOGPROB_HEAD, OPTIMIZER_STEP
from batchfit.parallel.rank_signals import listening
from batchfit.train.optim import allocate_gradients, default_optimizer, initialize_optimizer_state
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
    attention_mask: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five tensors (to register as the step's inputs)."""
        return (self.input_ids, self.position_ids, self.labels, self.loss_mask, self.attention_mask)


def synthetic_batch(vocab_size: int, batch: int, seq: int, *, seed: int = 0) -> MegatronBatch:
    """Random tokens of ``batch`` rows of ``seq`` tokens, the same on every rank that passes the same ``seed``.

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
        attention_mask=torch.ones(1, 1, seq, seq, dtype=torch.bool).triu(1),
    )


def megatron_optimizer(model: torch.nn.Module, lr: float = 1e-6) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters with its state and gradients made now (NOTE [ The Megatron step's optimizer ]).

    The state exists before the first measured step (SkyRL #1060 missed it) and every gradient is
    allocated, as from an accumulation's second micro-batch on (NOTE [ Gradients are resident
    between micro-batches ] in :mod:`batchfit.train.optim`).
    """
    optimizer = default_optimizer(model.parameters(), lr=lr)
    initialize_optimizer_state(optimizer)
    allocate_gradients(model)
    return optimizer


def _per_token_loss(model: torch.nn.Module, batch: MegatronBatch) -> torch.Tensor:
    """``GPTModel``'s forward: ``[b, s]`` per-token losses on the last stage, hidden states elsewhere; the head labelled."""
    head = getattr(model, "output_layer", None) if getattr(model, "post_process", True) else None
    handles = []
    if head is not None:  # the logits and the cross-entropy are the head's (NOTE [ Phases and regions ])
        handles.append(head.register_forward_pre_hook(lambda module, args: labels.set_region(LOGPROB_HEAD)))
        handles.append(head.register_forward_pre_hook(lambda module, args: labels.set_position(labels.HEAD)))
    try:
        return model(batch.input_ids, batch.position_ids, batch.attention_mask, labels=batch.labels)
    finally:
        labels.set_region(None)
        for handle in handles:
            handle.remove()


def _masked_mean(per_token: torch.Tensor, batch: MegatronBatch) -> torch.Tensor:
    mask = batch.loss_mask
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)


def megatron_loss(model: torch.nn.Module, batch: MegatronBatch) -> torch.Tensor:
    """The masked mean of Megatron's per-token loss: ``GPTModel(..., labels=...)`` runs its vocab-parallel cross-entropy.

    The batch's causal mask is passed in (the local spec's ``DotProductAttention`` would make
    one on CUDA). With pipeline parallelism use :func:`megatron_pipeline_step`.
    """
    return _masked_mean(_per_token_loss(model, batch), batch)


def finalize_sequence_parallel_grads(model: torch.nn.Module) -> None:
    """All-reduce over the tensor-parallel group the gradients of parameters sequence parallelism replicates.

    Under sequence parallelism each TP rank's norm weights see only its part of the sequence;
    Megatron's ``finalize_model_grads`` (``_allreduce_non_tensor_model_parallel_grads``) sums
    their gradients over the TP group, here in place in ``.grad`` (Megatron sums ``main_grad``,
    through a flattened copy). Nothing to do without sequence parallelism.
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


def megatron_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: MegatronBatch) -> float:
    """One step on this rank: forward (vocab-parallel cross-entropy), backward, sequence-parallel all-reduce, AdamW.

    Run it inside :func:`batchfit.models.megatron.megatron_cpu_patches` on every rank of the
    tensor-parallel group at once (the layers' collectives pair them). Gradients are zeroed
    after the step and kept allocated (``set_to_none=False``), as :func:`megatron_optimizer`
    made them.

    Returns:
        The loss (a float; ``nan`` under fake tensors, which have no values).

    Raises:
        InvalidArgument: more than one data-parallel rank (their gradients are not all-reduced
            here yet: Megatron's ``DistributedDataParallel`` does it, NOTE [ The Megatron step's optimizer ]).
    """
    _one_data_parallel_rank()
    with labels.phase(labels.FORWARD):
        labels.set_position(labels.EMBED)
        loss = megatron_loss(model, batch)
    with labels.phase(labels.BACKWARD):
        loss.backward()
        finalize_sequence_parallel_grads(model)
    with labels.phase(labels.OPTIMIZER), labels.region(OPTIMIZER_STEP):
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return _value(loss)


def megatron_pipeline_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Sequence[MegatronBatch]
) -> float | None:
    """One step of this pipeline stage under Megatron's own schedule, then AdamW.

    ``megatron.core.pipeline_parallel.get_forward_backward_func()`` picks the schedule: with
    pipeline parallelism, 1F1B without interleaving (``forward_backward_pipelining_without_interleaving``:
    stage ``r`` of ``p`` runs ``p - r - 1`` warm-up forwards, so the first stage holds up to ``p``
    micro-batches' activations in flight); without, forward and backward per micro-batch. Every
    stage passes the same micro-batches (the first reads the tokens, the last the labels); the
    schedule sends activations and their gradients between stages (``isend``/``irecv`` over the
    pipeline group) and divides each micro-batch's loss by their number.

    Args:
        model: this stage's model (:func:`batchfit.models.megatron.build_gpt_model`).
        optimizer: its optimizer (:func:`megatron_optimizer`).
        micro_batches: the step's micro-batches, all of one shape.

    Returns:
        The mean loss over the micro-batches on the last stage (``nan`` under fake tensors),
        ``None`` on the others.

    Raises:
        InvalidArgument: no micro-batch, micro-batches of different shapes, or more than one
            data-parallel rank (:func:`megatron_train_step`).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _one_data_parallel_rank()
    if not micro_batches:
        raise InvalidArgument("micro_batches must hold at least one MegatronBatch, but got none")
    shapes = {tuple(b.input_ids.shape) for b in micro_batches}
    if len(shapes) != 1:
        raise InvalidArgument(
            f"micro_batches must share one [batch, seq] shape (Megatron's schedule sends one tensor shape), but got {sorted(shapes)}"
        )
    ((micro_batch_size, seq_length),) = shapes
    losses: list[torch.Tensor] = []

    def forward_step(data_iterator: Any, stage: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        batch = next(data_iterator)

        def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            loss = _masked_mean(per_token, batch)
            losses.append(loss.detach().clone())  # the schedule divides the returned loss in place
            return loss, {"loss": loss.detach()}

        return _per_token_loss(stage, batch), loss_func

    forward_backward = get_forward_backward_func()
    with listening(None):  # type: ignore[arg-type]  # NOTE [ Pipeline sends are waited on whole ]
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=False,
        )
    with labels.phase(labels.BACKWARD):
        finalize_sequence_parallel_grads(model)
    with labels.phase(labels.OPTIMIZER), labels.region(OPTIMIZER_STEP):
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    if not losses:
        return None
    return _value(torch.stack(losses).mean())


def _one_data_parallel_rank() -> None:
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_world_size() > 1:
        raise InvalidArgument(
            f"the Megatron step runs one data-parallel rank, but Megatron's parallel state has data_parallel={parallel_state.get_data_parallel_world_size()}; make world_size = tensor_parallel * pipeline_parallel"
        )


def _value(loss: torch.Tensor) -> float:
    from torch._subclasses.fake_tensor import is_fake

    return float("nan") if is_fake(loss) else float(loss.detach())


__all__ = [
    "MegatronBatch",
    "finalize_sequence_parallel_grads",
    "megatron_loss",
    "megatron_optimizer",
    "megatron_pipeline_step",
    "megatron_train_step",
    "synthetic_batch",
]

