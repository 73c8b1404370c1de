"""A Lightning callback in ``BatchSizeFinder``'s role that works under DDP: every rank runs the same trials and agrees.

:class:`DistributedBatchSizeFinder` sets the training batch size (the ``batch_arg_name``
attribute of the ``LightningModule``, its ``hparams`` or the datamodule, as Lightning's
``BatchSizeFinder`` does) to the largest whose step peaks within a fraction of the device's
memory, found by batchfit's AutoBatch (:func:`batchfit.autobatch.find_batch_size`).

# NOTE [ How this differs from Lightning's BatchSizeFinder ]
Read from pytorch-lightning 2.6.6 (``callbacks/batch_size_finder.py``,
``tuner/batch_size_scaling.py``). ``BatchSizeFinder.setup`` raises ``MisconfigurationException("The
Batch size finder is not supported with distributed strategies.")``; it runs the real fit loop
for ``steps_per_trial`` steps per candidate, doubling (``power``) until an exception that
``is_oom_error`` recognises, or bisecting after it (``binsearch``, then 5% off by ``margin``),
and restores the model from a checkpoint it writes to ``default_root_dir``. A size is "fits" when
it did not crash, so on a CPU (no OOM) it climbs to ``max_val`` = 8192. Here, at ``on_fit_start``
(after the strategy has set up the process group, the model's device and the optimizers; before
the dataloaders exist): every rank builds a batch of each candidate size from the same
``train_dataloader()`` Lightning would call, runs ``training_step``, backward and the optimizer's
step on the unwrapped ``LightningModule`` under the precision plugin's ``train_step_context``,
measured by batchfit's memory backend against ``target_memory_fraction`` of ``memory_limit``; the
verdicts are all-reduced after every trial (NOTE [ Ranks agree on every trial ] in
:mod:`batchfit.autobatch.batch_search`), so every rank sets the same size. Nothing inside a trial
communicates (the DDP wrapper is not called, so its gradient hooks stay idle, and ``self.log``
is silenced: NOTE [ No logging inside a trial ]), so a rank that runs out of memory cannot leave
the others waiting. The weights and the optimizer's state are put back from copies in host
memory, not a checkpoint file.

# NOTE [ No logging inside a trial ]
At ``on_fit_start`` Lightning's result collection does not exist yet, so ``self.log`` inside a
trial's ``training_step`` raises; with ``sync_dist=True`` it would also all-reduce inside the
trial. The callback replaces the module's ``log`` and ``log_dict`` by no-ops on the instance for
the search and removes them afterwards.

# NOTE [ The first batch may be a short one ]
A trial's batch is the first of ``train_dataloader()``; when the rows' lengths vary, the first
batch need not hold the longest row, and a size found on short rows runs out of memory on the
long ones later (the trap of issue 40's HF Trainer sizing: NOTE [ Every row's length, not a
sample ] in :mod:`batchfit.integrations.row_lengths`). So when the dataloader's dataset is cheap
to read whole (a ``datasets.Dataset``, read from Arrow, or an in-memory ``list``/``tuple`` of
rows), or ``read_lengths=True`` asks for a pass over any dataset, every row's length is read and,
when they differ, a trial batch is ``batch_size`` copies of the longest row, collated by the
dataloader's own ``collate_fn``. Rows of one length keep the first batch (the same shapes).
Another dataset (a ``torch.utils.data.Dataset`` that loads or tokenizes on access) keeps the first
batch unless ``read_lengths=True``: :attr:`DistributedBatchSizeFinder.rows` says which was done.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from batchfit.autobatch import BatchSizeResult, find_batch_size
from batchfit.autobatch.batch_search import limited_backend
from batchfit.errors import InvalidArgument
from batchfit.integrations.model_values import values_kept
from batchfit.integrations.row_lengths import LongestRow, longest_row
from batchfit.train.optim import initialize_optimizer_state
from batchfit.validation import check_positive_int

log = logging.getLogger(__name__)

try:  # the pytorch-lightning package (batchfit[lightning]); the unified `lightning` package otherwise
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.model_helpers import is_overridden
    from pytorch_lightning.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr
except ImportError:  # pragma: no cover - depends on which package is installed
    import lightning.pytorch as pl  # type: ignore[no-redef]
    from lightning.pytorch.utilities.model_helpers import is_overridden  # type: ignore[no-redef]
    from lightning.pytorch.utilities.parsing import (  # type: ignore[no-redef]
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )


class DistributedBatchSizeFinder(pl.Callback):
    """Find the largest training batch size that fits a memory fraction, the same on every DDP rank, at ``on_fit_start``.

    Add it to ``Trainer(callbacks=[...])`` on every rank and call ``trainer.fit(model, datamodule)``.
    The ``LightningModule`` (or its ``hparams``, or the datamodule) must hold the batch size in
    ``batch_arg_name`` and build its ``train_dataloader()`` from it, as Lightning's
    ``BatchSizeFinder`` requires. After the search the attribute holds the size found, so the
    dataloader Lightning builds next uses it; :attr:`optimal_batch_size` and :attr:`result` hold
    it too. How this differs from ``BatchSizeFinder``: NOTE [ How this differs from Lightning's
    BatchSizeFinder ].

    A trial step: ``training_step(batch, 0)`` under the precision plugin's ``train_step_context``,
    backward on its loss, the optimizer's step (the one ``configure_optimizers`` returned, its
    state created before the first trial), gradients freed; with ``accumulate_grad_batches`` > 1
    two forward and backward passes run before the step (the second beside the first's gradients).

    Args:
        memory_limit: the device's bytes or a name (``"24GiB"``, ``"a100-40gb"``); required on
            the ``cpu`` backend; on cuda the device's memory by default. Ranks may pass
            different limits (their free memory): the smallest target over the ranks decides.
        target_memory_fraction: in ``(0, 1]``.
        reserve_bytes: bytes of ``memory_limit`` no tracker sees.
        backend: ``"cuda"``, ``"cpu"`` or a :class:`batchfit.memory.Backend`; default ``"cuda"``
            when the module is on a CUDA device, else ``"cpu"``.
        batch_arg_name: the attribute holding the batch size (Lightning's name).
        steps_per_trial: steps per candidate (2 counts what the first optimizer step leaves).
        min_batch_size, max_batch_size: the candidate range (``max_batch_size`` is also capped
            at the training dataset's length, when it has one).
        progress: as :func:`batchfit.autobatch.find_batch_size` (``True`` logs on rank 0).
        read_lengths: read every row's length to size on the longest (NOTE [ The first batch
            may be a short one ]): ``None`` (default) when the dataset is cheap to read whole (a
            ``datasets.Dataset`` or a list/tuple of rows), ``True`` for any dataset with ``len``
            (a pass over every row), ``False`` never (the first batch).

    Attributes (after the search):
        optimal_batch_size, result: the size found and the search behind it.
        rows: the longest row and how the lengths were read, or ``None`` when the trial used
            the dataloader's first batch without reading them.

    Raises (at ``trainer.fit``):
        InvalidArgument: no ``batch_arg_name`` attribute, no ``train_dataloader`` on the module
            or datamodule (dataloaders passed straight to ``fit``), manual optimization, a
            ``training_step`` without a loss, a bad search argument.
        DoesNotFitError: even ``min_batch_size`` does not fit.
        BatchfitError: another rank's trial raised.
    """

    def __init__(
        self,
        memory_limit: Any = None,
        *,
        target_memory_fraction: float = 0.8,
        reserve_bytes: Any = None,
        backend: Any = None,
        batch_arg_name: str = "batch_size",
        steps_per_trial: int = 2,
        min_batch_size: int = 1,
        max_batch_size: int = 8192,
        progress: Any = True,
        read_lengths: bool | None = None,
    ) -> None:
        if not isinstance(batch_arg_name, str) or not batch_arg_name:
            raise InvalidArgument(f"batch_arg_name must be an attribute name, but got batch_arg_name={batch_arg_name!r}")
        self.memory_limit = memory_limit
        self.target_memory_fraction = target_memory_fraction
        self.reserve_bytes = reserve_bytes
        self.backend = backend
        self.batch_arg_name = batch_arg_name
        self.steps_per_trial = check_positive_int("steps_per_trial", steps_per_trial)
        self.min_batch_size = min_batch_size
        self.max_batch_size = max_batch_size
        self.progress = progress
        if read_lengths is not None and not isinstance(read_lengths, bool):
            raise InvalidArgument(f"read_lengths must be None, True or False, but got read_lengths={read_lengths!r}")
        self.read_lengths = read_lengths
        self.optimal_batch_size: int | None = None
        self.result: BatchSizeResult | None = None
        self.rows: LongestRow | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Run the search (every rank) and set ``batch_arg_name`` to the size found."""
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: Any, pl_module: Any) -> int:
        """The search itself (Lightning's method name); returns the size and sets it on the module or datamodule.

        Call it from another hook (a subclass's ``on_train_epoch_start``, say) to search again.
        """
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise InvalidArgument(
                f"batch_arg_name={self.batch_arg_name!r} is not an attribute of the LightningModule, its hparams or the datamodule; store the batch size there and read it in train_dataloader(), or pass batch_arg_name"
            )
        if not pl_module.automatic_optimization:
            raise InvalidArgument(
                "DistributedBatchSizeFinder needs automatic_optimization=True (a manual training_step steps and logs by itself, and under DDP its manual_backward arms the gradient all-reduce); search with batchfit.autobatch.find_batch_size and your own trial instead"
            )
        loader_fn = self._train_dataloader_fn(trainer, pl_module)
        start = lightning_getattr(pl_module, self.batch_arg_name)
        high = self.max_batch_size
        loader = loader_fn()
        with contextlib.suppress(TypeError):  # a batch larger than the dataset is not full (Lightning stops there too)
            rows = len(loader.dataset)
            if isinstance(high, int) and isinstance(self.min_batch_size, int) and rows >= self.min_batch_size:
                high = min(high, rows)
        self.rows = self._longest_row(loader)
        longest = None
        if self.rows is not None and self.rows.varies:  # NOTE [ The first batch may be a short one ]
            longest = (loader.dataset[self.rows.index], loader.collate_fn)
        if self.rows is not None and self.progress is True and trainer.global_rank == 0:
            log.info(f"train_dataloader: {self.rows.describe()}; trials repeat "
                     f"{'it' if longest is not None else 'the first batch (the rows are of one length)'}")
        be = limited_backend(self._backend_name(pl_module), self.memory_limit, self.reserve_bytes)
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise InvalidArgument(
                f"configure_optimizers must return one optimizer for automatic optimization, but the trainer has {len(optimizers)}"
            )
        optimizer = optimizers[0]
        saved_state = _to_cpu(optimizer.state_dict())  # host memory, off the measured device
        step = _FitStep(trainer, pl_module, optimizer, self.batch_arg_name, loader_fn,
                        2 if int(trainer.accumulate_grad_batches) > 1 else 1, longest)
        try:
            with values_kept(pl_module), _no_logging(pl_module):
                with be.context():
                    initialize_optimizer_state(optimizer)
                self.result = find_batch_size(
                    step,
                    mode="train",
                    target_memory_fraction=self.target_memory_fraction,
                    min_batch_size=self.min_batch_size,
                    max_batch_size=high,
                    steps_per_trial=self.steps_per_trial,
                    backend=be,
                    progress=self.progress,
                    register=(pl_module, optimizer),
                )
        except BaseException:
            lightning_setattr(pl_module, self.batch_arg_name, start)
            raise
        finally:
            optimizer.load_state_dict(saved_state)
        self.optimal_batch_size = self.result.batch_size
        lightning_setattr(pl_module, self.batch_arg_name, self.optimal_batch_size)
        return self.optimal_batch_size

    def _longest_row(self, loader: Any) -> LongestRow | None:
        """Every row's length when asked or cheap (NOTE [ The first batch may be a short one ]); ``None``: not read."""
        dataset = getattr(loader, "dataset", None)
        if self.read_lengths is False or dataset is None or getattr(loader, "batch_size", None) is None:
            return None  # no automatic batching: the dataset yields whole batches
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            return None
        cheap = isinstance(dataset, (list, tuple)) or (hasattr(dataset, "with_format") and hasattr(dataset, "column_names"))
        if not (cheap or self.read_lengths):
            return None
        return longest_row(dataset, name="train_dataloader().dataset")

    def _backend_name(self, pl_module: Any) -> Any:
        if self.backend is not None:
            return self.backend
        return "cuda" if pl_module.device.type == "cuda" else "cpu"

    @staticmethod
    def _train_dataloader_fn(trainer: Any, pl_module: Any) -> Callable[[], Any]:
        """The ``train_dataloader`` Lightning would call: the datamodule's, else the module's."""
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("train_dataloader", datamodule):
            return datamodule.train_dataloader
        if is_overridden("train_dataloader", pl_module):
            return pl_module.train_dataloader
        raise InvalidArgument(
            "DistributedBatchSizeFinder needs train_dataloader() on the LightningModule or the LightningDataModule (it rebuilds it at each candidate size), but the dataloaders were passed to trainer.fit directly; move them into a LightningDataModule"
        )


def _to_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_cpu(v) for v in state]
    return state


@contextlib.contextmanager
def _no_logging(pl_module: Any) -> Iterator[None]:
    """NOTE [ No logging inside a trial ]: ``log`` and ``log_dict`` silenced on the instance, then removed."""

    def silent(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log = silent
    pl_module.log_dict = silent
    try:
        yield
    finally:
        del pl_module.log
        del pl_module.log_dict


def _loss(output: Any) -> torch.Tensor:
    """The loss of a ``training_step`` output: a tensor, or a mapping's ``"loss"`` (Lightning's rule)."""
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise InvalidArgument(
            f"training_step returned {type(output).__name__} without a loss tensor; return the loss, or a dict with 'loss', for the batch size search"
        )
    return loss


class _FitStep:
    """One optimizer step of the fit loop at ``batch_size`` (``find_batch_size``'s trial)."""

    def __init__(
        self,
        trainer: Any,
        pl_module: Any,
        optimizer: torch.optim.Optimizer,
        batch_arg_name: str,
        loader_fn: Callable[[], Any],
        micro_steps: int,
        longest: tuple[Any, Callable[[list[Any]], Any]] | None = None,
    ):
        self.trainer, self.module, self.optimizer = trainer, pl_module, optimizer
        self.batch_arg_name, self.loader_fn, self.micro_steps = batch_arg_name, loader_fn, micro_steps
        self.longest = longest

    def batch(self, batch_size: int) -> Any:
        """``batch_size`` copies of the longest row collated by the loader's ``collate_fn`` (NOTE [ The first
        batch may be a short one ]), else the first batch of ``train_dataloader()`` with the attribute at
        ``batch_size``; on the device."""
        lightning_setattr(self.module, self.batch_arg_name, batch_size)
        if self.longest is not None:
            row, collate = self.longest
            batch = collate([dict(row) if isinstance(row, Mapping) else row for _ in range(batch_size)])
        else:
            batch = next(iter(self.loader_fn()))
        return self.trainer.strategy.batch_to_device(batch)

    def __call__(self, batch_size: int) -> None:
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.micro_steps):
            batch = self.batch(batch_size)  # alive through the backward, as the fit loop holds it
            with self.trainer.precision_plugin.train_step_context():
                loss = _loss(self.module.training_step(batch, 0))
            loss.backward()
            del loss, batch
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
