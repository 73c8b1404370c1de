"""The one exception family of batchfit.

Every error batchfit raises on purpose derives from :class:`BatchfitError`. Errors about
bad values are also :class:`ValueError`, so callers that only know the standard library
can still catch them.
"""

from __future__ import annotations


class BatchfitError(Exception):
    """Base class of every error batchfit raises on purpose."""


class InvalidArgument(BatchfitError, ValueError):
    """An argument has the wrong type or a value outside its domain.

    Raised by the checks in :mod:`batchfit.validation`; the message names the argument,
    the value received and what would be accepted.
    """


class TaskError(InvalidArgument):
    """The user's own code (an AutoBatch task file or factory) raised or does not parse.

    The message names the file and line and the exception; the original exception is the
    ``__cause__`` (the CLI prints its traceback with ``--debug``). ``location`` is
    ``"file:line"`` or ``""``.
    """

    def __init__(self, message: str, location: str = ""):
        self.location = location
        super().__init__(message)


class BatchConfigError(InvalidArgument):
    """A batch-size configuration breaks one or more rules.

    Raised by :meth:`batchfit.BatchConfig.plan` (and the config loaders) with **every**
    fault at once; ``faults`` holds one message per fault, each naming the fields, their
    values, the rule broken and the nearest valid values.
    """

    def __init__(self, faults: list[str]):
        self.faults = list(faults)
        n = len(self.faults)
        head = f"{n} fault in the batch configuration" if n == 1 else f"{n} faults in the batch configuration"
        super().__init__(head + ":\n" + "\n".join(f"  - {f}" for f in self.faults))


class BatchError(InvalidArgument):
    """A per-sample batch (a mapping of fields) or its uids are malformed.

    Raised by :mod:`batchfit.batches.minibatch` and :mod:`batchfit.batches.batch`: fields with different
    sample counts, a uid that reappears after another uid, a prompt count that does not
    split into whole mini-batches.
    """


class BudgetError(InvalidArgument):
    """A token budget cannot hold what was asked of it.

    Raised by :mod:`batchfit.plan.packing` when one sequence alone costs more than the budget
    (and ``oversize="raise"``), or when a budget is not a positive number of tokens.
    """


class DoesNotFitError(BatchfitError):
    """Nothing fits in memory: even the smallest candidate exceeds the limit.

    Raised by the budget and batch-size searches. ``needed`` and ``available`` are bytes
    (``None`` when unknown), so callers can say by how much it failed.
    """

    def __init__(self, message: str, *, needed: int | None = None, available: int | None = None):
        self.needed = needed
        self.available = available
        #: the smallest fsdp2 world size that would fit, when the raiser looked for one
        self.world_size_hint: int | None = None
        super().__init__(message)


class ProbeAbandoned(BatchfitError):
    """A probe on real ranks was left in the middle of its collectives: the search cannot go on.

    Raised on every rank by the budget search when one rank ran out of memory in the middle
    of a sharded step and the others gave up the collective they were waiting in (NOTE [ One
    rank runs out ] in :mod:`batchfit.budget.guard`). The message names the rank and the probe.
    """

