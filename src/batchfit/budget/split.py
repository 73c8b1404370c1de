"""How many tokens one pass of a split sequence may run: measured, beside the sequence's keys and values.

NOTE [ A split pass holds the whole sequence's KV ]
A sequence longer than the budget runs in chunks (NOTE [ Over-long sequences run in chunks ]
in :mod:`batchfit.train.long_sequence`). Each pass holds one chunk's activations and, beside
them, what grows with the whole sequence: its keys and values three times (the cache filled
without gradients, the slots of its gradient, and the ``[0, end)`` keys and values each
layer's attention keeps for its backward), and with eager or sdpa attention a ``[chunk,
length]`` mask and attention over ``chunk × length`` positions. A chunk of the full budget
therefore runs over it: on the cpu backend (tiny preset, fp32, vocabulary 2,048, 160 MiB),
a 20,480-token sequence in chunks of the 10,240-token budget peaked at 211 MiB against the
budget's 136 MiB limit. The budget's memory model, fit on micro-batches without a past, does
not predict those terms (it under-predicted a 710-token chunk by 20 MiB), so
:func:`split_chunk_tokens` measures: it runs the split step itself — the budget's own probe
(:class:`~batchfit.budget.causal_lm_probe.TrainingStep`) on a synthetic sequence of ``longest`` tokens,
through :func:`batchfit.train.micro_batch_backward`, then the optimizer step — and finds the
largest chunk whose peak stays within the limit. The estimate backend runs the same code on
fake tensors (equal to the cpu backend to the byte on the tiny preset).
"""

from __future__ import annotations

from batchfit.budget.causal_lm_probe import TrainingStep, on_device
from batchfit.errors import BudgetError, InvalidArgument
from batchfit.validation import check_positive_int

__all__ = ["split_chunk_tokens", "split_peak"]


def split_peak(step: TrainingStep, longest: int, chunk_tokens: int) -> int:
    """The peak bytes of ``step`` on one sequence of ``longest`` tokens run in passes of at most ``chunk_tokens``.

    The step's state registered, as its probes are: the micro-batch, the split passes
    (:func:`batchfit.train.micro_batch_backward`, the step's head and loss) and the optimizer
    step.

    Raises:
        InvalidArgument: a step that is not a training step (forward-only or not a
            :class:`~batchfit.budget.causal_lm_probe.TrainingStep`), bad sizes.
        BudgetError: the model cannot run in chunks exactly (:func:`batchfit.train.split_refusal`).
    """
    from batchfit.train.long_sequence import micro_batch_backward

    if not isinstance(step, TrainingStep) or step.forward_only:
        raise InvalidArgument(
            f"step must be a training TrainingStep (causal_lm_step(..., forward_only=False)), but got {type(step).__name__}"
        )
    longest = check_positive_int("longest", longest)
    chunk_tokens = check_positive_int("chunk_tokens", chunk_tokens)
    mb = step.micro_batch([longest])

    def run() -> None:
        with step.backend.context():
            batch, _held = on_device(mb, step.backend)
            micro_batch_backward(step.model, batch, chunk_tokens=chunk_tokens, **step.loss_options)
            if step.optimizer is not None:
                step.optimizer.step()
            step.model.zero_grad(set_to_none=False)

    measured = step.backend.measure(run, register=step.persistent, categories=step.categories)
    return int(measured.peak_bytes)


def split_chunk_tokens(step: TrainingStep, longest: int, limit_bytes: int, *, most: int) -> int:
    """The largest chunk (tokens per pass) in which a sequence of ``longest`` tokens trains within ``limit_bytes``.

    NOTE [ A split pass holds the whole sequence's KV ]: a binary search over ``[2, most]``
    of :func:`split_peak` (about ``log₂ most`` measured split steps, the largest chunks first;
    the peak grows with the chunk). Pass the result as ``plan_micro_batches(..., oversize="split", split_tokens=...)``;
    it reaches :func:`batchfit.train.micro_batch_backward` and the forward passes through the
    plan.

    Args:
        step: the budget's probe of the trained role (``causal_lm_step``), on the backend
            the budget was found with.
        longest: the longest sequence the plan may split.
        limit_bytes: the budget's ``limit_bytes``.
        most: the largest chunk to consider, the budget's ``tokens``.

    Returns:
        A chunk size in ``[2, most]``.

    Raises:
        BudgetError: not even passes of 2 tokens fit beside the sequence's keys and values
            (names the length, the peak and the limit), or the model cannot run in chunks.
        InvalidArgument: bad arguments (as :func:`split_peak`).

    Example:
        >>> chunk = split_chunk_tokens(step, 2 * budget.tokens, budget.limit_bytes, most=budget.tokens)  # doctest: +SKIP
    """
    longest = check_positive_int("longest", longest)
    limit_bytes = check_positive_int("limit_bytes", limit_bytes)
    most = check_positive_int("most", most)
    if most < 2:
        raise InvalidArgument(f"most must be at least 2 (a token and its label per pass), but got most={most}")
    low, high = 1, most  # low: the largest chunk known to fit, 1 = none yet (2 is the smallest pass)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if split_peak(step, longest, mid) <= limit_bytes else (low, mid - 1)
    if low < 2:
        raise BudgetError(
            f"a sequence of {longest:,} tokens cannot run in chunks within {limit_bytes:,} bytes: even passes of 2 "
            "tokens run over (its keys and values grow with the whole sequence); shard over more ranks, give more "
            "memory or truncate the sequence"
        )
    return low
