"""The reusable parts of an RL training loop built on batchfit, so no trainer writes them again.

- :func:`model_logprobs`: token-aligned per-token log-probs of a micro-batch (padded rows or
  one packed row), fused from hidden states, through the model's own forward, so DDP and
  FSDP2 wrappers work (NOTE [ Fused log-probs through the wrapper ]).
- :func:`forward_logprobs`: the old/reference log-probs of a whole batch under ``no_grad``,
  micro-batched under a forward-only budget, gathered over ranks.
- :func:`policy_loss`: PPO/GRPO's clipped surrogate, every per-token factor (log-probs,
  ``old_log_probs``, ``advantages``, ``weights``) on the column of its token, summed with
  exact loss weights and the data-parallel scale.
- :func:`accumulate` / :func:`gradient_sync` / :func:`data_parallel_size`: gradient
  accumulation with DDP's ``no_sync`` or FSDP2's ``set_requires_gradient_sync`` until the
  last micro-batch, the ``× dp_size`` that turns the ranks' average into the sum, and the
  bytes of the gradients kept between micro-batches (NOTE [ Accumulate, then sync once ]).
- :func:`group_advantages`: GRPO's group-relative advantages (and RLOO's leave-one-out) from
  one reward per rollout.
- :func:`micro_batch_backward`: a micro-batch's loss and backward; a lone sequence longer
  than the budget (a plan made with ``oversize="split"``) runs in chunks with the unsplit
  gradient (NOTE [ Over-long sequences run in chunks ]); :func:`split_outputs` is its
  forward-only counterpart (old log-probs, values).
- :func:`activation_offload`: what each decoder layer saves for backward waits in host memory, as
  verl's ``enable_activation_offload`` runs it (NOTE [ Activation offload as verl runs it ]).
- :class:`PeakTracker` / :class:`CollectiveBytes`: peak bytes per micro-batch (cpu tracker)
  and bytes of collectives per optimizer step; :class:`DevicePeaks`, the CUDA allocator's peak.
- :class:`MicroBatchGuard`: the loop's micro-batches guarded: each peak against its prediction,
  and a micro-batch that runs out of memory lowers the budget and runs its mini-batch again on
  every rank (NOTE [ A micro-batch runs out ], ``docs/guard.md``).

The loop, per optimizer step (``examples/grpo_stepwise.py`` runs it, single process or
FSDP2 under ``torchrun``)::

    mini, _ = pad_for_data_parallel(slice_batch(batch, start, end), dp)
    mini["weights"] = loss_weights(mini["loss_mask"], reduction="token_mean")
    plan = plan_micro_batches(mini["attention_mask"].sum(-1), budget, dp_size=dp, cost="packed")
    micro = iter_micro_batches(mini, plan, rank, layout="packed")
    for mb in accumulate(model, micro, plan.num_micro_batches):
        logp = model_logprobs(model, mb.batch)
        policy_loss(logp, mb.batch, scale=dp).backward()
    optimizer.step()
"""

from batchfit.train.accumulate import (
    accumulate,
    accumulated_gradient_bytes,
    data_parallel_size,
    gradient_sync,
)
from batchfit.train.activation_offload import activation_offload
from batchfit.train.advantages import ESTIMATORS, group_advantages, group_ids
from batchfit.train.forward import forward_logprobs, forward_values
from batchfit.train.long_sequence import micro_batch_backward, split_loss_backward, split_outputs
from batchfit.train.loss import policy_loss, response_columns, value_loss
from batchfit.train.measure import CollectiveBytes, DevicePeaks, PeakTracker
from batchfit.train.micro_batch_guard import (
    MicroBatchesDoNotFit,
    MicroBatchGuard,
    MicroBatchRecord,
    MiniBatchRecord,
    OutOfMemoryOutsideMicroBatch,
    RankLeftTraining,
    RestartAtLowerBudget,
    Shortfall,
)
from batchfit.train.micro_batch_step import micro_batch_loss, micro_batch_outputs
from batchfit.train.model_outputs import (
    HEADS,
    fused_output_head,
    model_logprobs,
    model_values,
    next_token_labels,
)
from batchfit.train.optim import allocate_gradients, default_optimizer, initialize_optimizer_state

__all__ = [
    "ESTIMATORS",
    "HEADS",
    "CollectiveBytes",
    "DevicePeaks",
    "MicroBatchGuard",
    "MicroBatchRecord",
    "MicroBatchesDoNotFit",
    "MiniBatchRecord",
    "OutOfMemoryOutsideMicroBatch",
    "PeakTracker",
    "RankLeftTraining",
    "RestartAtLowerBudget",
    "Shortfall",
    "accumulate",
    "accumulated_gradient_bytes",
    "activation_offload",
    "allocate_gradients",
    "data_parallel_size",
    "default_optimizer",
    "forward_logprobs",
    "forward_values",
    "fused_output_head",
    "gradient_sync",
    "group_advantages",
    "group_ids",
    "initialize_optimizer_state",
    "micro_batch_backward",
    "micro_batch_loss",
    "micro_batch_outputs",
    "model_logprobs",
    "model_values",
    "next_token_labels",
    "policy_loss",
    "response_columns",
    "split_loss_backward",
    "split_outputs",
    "value_loss",
]
