"""Tensor-level batching: a rollout batch cut into mini-batches and micro-batches, and its loss weights.

A batch is a mapping of per-sample fields (tensors with the sample dimension first, or lists).

- :mod:`~batchfit.batches.batch`: slicing and taking rows of every field together.
- :mod:`~batchfit.batches.minibatch`: prompt-aligned mini-batch boundaries, cheap
  data-parallel pad rows, the split over ranks.
- :mod:`~batchfit.batches.weights`: exact loss weights, so any split into micro-batches and
  ranks gives the mini-batch's gradient.
- :mod:`~batchfit.batches.layout`: which fields are per token (sequence or response width),
  row alignment that keeps the token budget, packed rows.
- :mod:`~batchfit.batches.microbatch`: :func:`iter_micro_batches`, running a
  :class:`~batchfit.plan.MicroBatchPlan` on a batch.

No collectives here: every rank cuts its own share of the same plan.
"""

from batchfit.batches.batch import concat_batches, slice_batch, take_rows
from batchfit.batches.microbatch import MicroBatch, iter_micro_batches
from batchfit.batches.minibatch import (
    mini_batch_boundaries,
    pad_for_data_parallel,
    prompt_boundaries,
    split_for_data_parallel,
)
from batchfit.batches.weights import loss_weights

__all__ = [
    "MicroBatch",
    "concat_batches",
    "iter_micro_batches",
    "loss_weights",
    "mini_batch_boundaries",
    "pad_for_data_parallel",
    "prompt_boundaries",
    "slice_batch",
    "split_for_data_parallel",
    "take_rows",
]
