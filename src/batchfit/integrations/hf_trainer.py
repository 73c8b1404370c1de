"""The Hugging Face ``Trainer``'s per-device batch sizes, found from memory before the ``Trainer`` is built.

:func:`find_trainer_batch_sizes` runs the step the ``Trainer`` will run (the model's forward with
labels, backward, the optimizer ``Trainer.get_optimizer_cls_and_kwargs(args, model)`` names, the
gradient accumulation, activation checkpointing and bf16/fp16 autocast ``args`` asks for) at
candidate batch sizes under batchfit's AutoBatch (:func:`batchfit.autobatch.find_batch_size`), and
returns a copy of the ``TrainingArguments`` with the largest ``per_device_train_batch_size`` (and
``per_device_eval_batch_size``) whose peak stays within a fraction of the device.

# NOTE [ Sized before the Trainer exists ]
The batch size must be known before the ``Trainer`` is built: ``Trainer.get_train_dataloader``
reads ``self._train_batch_size``, set from ``args`` in ``Trainer.__init__``, and a
``TrainerCallback``'s first hook (``on_init_end``, ``on_train_begin``) runs after that (DESIGN.md,
"Verified facts for the long-context and MoE work"). So this is a function called on every rank
before ``Trainer(...)``, not a callback.

# NOTE [ How this differs from auto_find_batch_size ]
``TrainingArguments(auto_find_batch_size=True)`` wraps ``Trainer._inner_training_loop`` in
``transformers.trainer_utils.find_executable_batch_size``, which calls Accelerate's
``accelerate.utils.memory.find_executable_batch_size`` (transformers 5.24, accelerate 1.15): it
starts the whole training loop at ``per_device_train_batch_size``, and when an exception that
``should_reduce_batch_size`` calls out-of-memory escapes, it multiplies the size by 0.9 and starts
the loop again. It finds a size that ran, not the largest that fits (it never grows, and the
size it keeps may be 10% below the limit); each process decides alone, so under DDP one rank that
runs out of memory retries with a smaller size while the others wait in the gradient all-reduce
of the size they kept; a run that fits only thanks to fragmentation luck is not caught before the
job starts; nothing sizes the eval batch. Here every rank runs the same trials before training,
the verdicts are all-reduced after each (NOTE [ Ranks agree on every trial ] in
:mod:`batchfit.autobatch.batch_search`), the size is the largest within the target (size + 1
measured over it), and the eval size is searched in eval mode.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.autobatch import BatchSizeResult, find_batch_size
from batchfit.autobatch.batch_search import limited_backend
from batchfit.errors import InvalidArgument
from batchfit.integrations.model_values import values_kept
from batchfit.integrations.row_lengths import LongestRow, longest_row
from batchfit.parallel.distributed import get_rank
from batchfit.train.optim import initialize_optimizer_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainerBatchSizes:
    """What :func:`find_trainer_batch_sizes` found.

    Attributes:
        args: a copy of the ``TrainingArguments`` given, with ``per_device_train_batch_size``
            (and ``per_device_eval_batch_size`` when an eval search ran) set; pass it to ``Trainer``.
        train: the training search (every trial, the peak, the target).
        eval: the evaluation search, or ``None`` when none ran.
        train_rows: the longest row of ``train_dataset`` the trials repeat, with how every row's
            length was read (NOTE [ Every row's length, not a sample ]); ``None`` with ``make_batch``.
        eval_rows: the same for the eval search's rows, or ``None``.
    """

    args: Any
    train: BatchSizeResult
    eval: BatchSizeResult | None
    train_rows: LongestRow | None = None
    eval_rows: LongestRow | None = None


def find_trainer_batch_sizes(
    model: torch.nn.Module,
    args: Any,
    train_dataset: Any = None,
    *,
    eval_dataset: Any = None,
    data_collator: Callable[[list[Any]], Any] | None = None,
    make_batch: Callable[[int], Any] | None = None,
    include_eval: bool = False,
    target_memory_fraction: float = 0.8,
    memory_limit: Any = None,
    reserve_bytes: Any = None,
    backend: Any = None,
    min_batch_size: int = 1,
    max_batch_size: int = 512,
    steps_per_trial: int = 2,
    progress: Any = True,
    group: Any = None,
) -> TrainerBatchSizes:
    """The largest per-device batch sizes of a Hugging Face ``Trainer`` run at a memory fraction, alike on every rank.

    Call it on every rank (under ``torchrun``, before ``Trainer(...)``: NOTE [ Sized before the
    Trainer exists ]) with the model, arguments and data you will give the ``Trainer``. Each
    candidate runs ``steps_per_trial`` training steps of the ``Trainer``'s own kind on the
    unwrapped model (no collective inside a trial: NOTE [ Ranks agree on every trial ]), measured by
    batchfit's memory backend; the verdicts are agreed across ranks, so every rank returns the same
    sizes. The model's weights are put back afterwards (NOTE [ A search leaves the weights as it
    found them ]). How this differs from ``auto_find_batch_size``: NOTE [ How this differs from
    auto_find_batch_size ].

    A training step: ``model.train()``; the accumulation window's ``args.gradient_accumulation_steps``
    batches made and put on the device first and held to the end (``Trainer.get_batch_samples``);
    one forward and backward, or two when accumulating (the second with the first's gradients
    resident, as accumulation does);
    the loss is ``model(**batch).loss`` under bf16/fp16 autocast when ``args.bf16``/``args.fp16``;
    then the step of the optimizer ``Trainer.get_optimizer_cls_and_kwargs(args, model)`` builds
    (its state created before the first trial). With ``args.activation_checkpointing`` the model's
    ``activation_checkpointing_enable`` is called with ``args.activation_checkpointing_kwargs`` for
    the search and undone after; ``model.config.use_cache`` is ``args.use_cache`` (False by default)
    during the search, as ``Trainer.__init__`` sets it. An eval step: ``eval()``, ``no_grad``, the
    forward with labels.

    Args:
        model: the model you will pass to ``Trainer`` (a ``PreTrainedModel`` or any module whose
            forward returns an output with ``.loss`` when given labels). It is moved to the
            backend's device (the ``Trainer`` moves it to ``args.device`` too).
        args: the ``transformers.TrainingArguments`` (or a subclass such as TRL's configs).
            Reading ``args.device`` first sets up torch.distributed under ``torchrun`` (the
            ``Trainer``'s own ``PartialState``), so the group exists for the search.
        train_dataset: the rows the ``Trainer`` will train on (a ``datasets.Dataset`` or any
            indexable sequence of mappings); a trial batch is ``batch_size`` copies of its longest
            row, found from every row's length (``len(row["input_ids"])``, read from the Arrow
            column, ``args.length_column_name`` or a pass over the rows: NOTE [ Every row's length,
            not a sample ] in :mod:`batchfit.integrations.row_lengths`; the result's
            ``train_rows`` says which row and how), columns the model's forward does not take
            dropped when ``args.remove_unused_columns`` (as the ``Trainer`` does), collated by
            ``data_collator``.
        eval_dataset: rows for the eval search (default: ``train_dataset``).
        data_collator: the collator you will pass to the ``Trainer`` (default:
            ``transformers.default_data_collator``). It must produce labels (e.g.
            ``DataCollatorForLanguageModeling(tokenizer, mlm=False)``).
        make_batch: instead of the dataset, ``make_batch(batch_size)`` returns one collated batch
            (a mapping of tensors with labels) of your worst case.
        include_eval: also search ``per_device_eval_batch_size`` (in eval mode).
        target_memory_fraction: in ``(0, 1]``; the fraction of usable memory a step may peak at.
        memory_limit: the device's bytes or a name (``"24GiB"``, ``"a100-40gb"``); required on the
            ``cpu`` backend, default on cuda: the device's memory. It may differ between ranks
            (each rank's free memory): the smallest target over the ranks decides.
        reserve_bytes: bytes of ``memory_limit`` no tracker sees.
        backend: ``"cuda"``, ``"cpu"`` or a :class:`batchfit.memory.Backend`; default: ``"cuda"``
            when ``args.device`` is a CUDA device, else ``"cpu"``.
        min_batch_size, max_batch_size: the candidate range.
        steps_per_trial: steps per candidate (2 counts what the first optimizer step leaves).
        progress: as :func:`batchfit.autobatch.find_batch_size` (``True`` logs on rank 0).
        group: the process group (``None``: the default one, or a single process).

    Returns:
        :class:`TrainerBatchSizes`: ``.args`` (a copy; ``args`` itself is unchanged), ``.train``
        and ``.eval`` (:class:`batchfit.autobatch.BatchSizeResult`).

    Raises:
        InvalidArgument: neither ``train_dataset`` nor ``make_batch``, an empty dataset, a batch
            without a loss (no labels), or a bad search argument.
        DoesNotFitError: even ``min_batch_size`` does not fit (the message says by how much).
        BatchfitError: another rank's trial raised.
        ImportError: transformers' ``Trainer`` cannot be imported (``pip install -e '.[hf]'`` in batchfit's checkout).
    """
    from transformers import Trainer, default_data_collator

    if train_dataset is None and make_batch is None:
        raise InvalidArgument(
            "find_trainer_batch_sizes needs the rows a trial trains on, but got train_dataset=None and make_batch=None; pass the Trainer's train_dataset (and data_collator), or make_batch(batch_size)"
        )
    device = args.device  # sets up torch.distributed under torchrun, as the Trainer will
    if backend is None:
        backend = "cuda" if device.type == "cuda" else "cpu"
    be = limited_backend(backend, memory_limit, reserve_bytes)
    _move(model, be.device)
    collate = data_collator or default_data_collator
    columns = _kept_columns(model, args)
    search = {
        "target_memory_fraction": target_memory_fraction,
        "min_batch_size": min_batch_size,
        "max_batch_size": max_batch_size,
        "steps_per_trial": steps_per_trial,
        "backend": be,
        "progress": progress,
        "group": group,
    }
    length_column = getattr(args, "length_column_name", "length")
    train_rows = None if make_batch is not None else _read_lengths(train_dataset, length_column, "train_dataset", progress, group)
    train_batch = make_batch or _batch_maker(train_dataset, train_rows, collate, columns)
    optimizer_cls, optimizer_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    with values_kept(model), _checkpointing(model, args), _cache_as_the_trainer_sets_it(model, args):
        optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], **optimizer_kwargs)
        with be.context():
            initialize_optimizer_state(optimizer)
        window = int(args.gradient_accumulation_steps)
        train = find_batch_size(
            _TrainStep(model, optimizer, train_batch, _autocast(args, be.device), window, be.device),
            mode="train",
            register=(model, optimizer),
            **search,
        )
        del optimizer
    evaluated = eval_rows = None
    if include_eval:
        rows = train_dataset if eval_dataset is None else eval_dataset
        if make_batch is None:
            eval_rows = train_rows if eval_dataset is None else _read_lengths(rows, length_column, "eval_dataset", progress, group)
        eval_batch = make_batch or _batch_maker(rows, eval_rows, collate, columns)
        with _cache_as_the_trainer_sets_it(model, args):
            evaluated = find_batch_size(
                _EvalStep(model, eval_batch, _autocast(args, be.device), be.device),
                mode="val",
                register=(model,),
                **search,
            )
    sized = copy.copy(args)
    sized.per_device_train_batch_size = train.batch_size
    if evaluated is not None:
        sized.per_device_eval_batch_size = evaluated.batch_size
    return TrainerBatchSizes(args=sized, train=train, eval=evaluated, train_rows=train_rows, eval_rows=eval_rows)


def _move(model: torch.nn.Module, device: torch.device) -> None:
    """``model.to(device)`` only when its parameters are elsewhere (``.to`` under a fake mode fails)."""
    first = next(model.parameters(), None)
    if first is not None and first.device != device:
        model.to(device)


def _kept_columns(model: torch.nn.Module, args: Any) -> set[str] | None:
    """The row keys the Trainer keeps (``Trainer._set_signature_columns_if_needed``), ``None`` = all."""
    if not getattr(args, "remove_unused_columns", True):
        return None
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT, as the Trainer does
    names = set(inspect.signature(inner.forward).parameters)
    return names | {"label", "label_ids", *(getattr(args, "label_names", None) or [])}


def _read_lengths(rows: Any, length_column: str, name: str, progress: Any, group: Any) -> LongestRow:
    """The longest of every row of ``rows`` (NOTE [ Every row's length, not a sample ]), logged on rank 0 when ``progress``."""
    found = longest_row(rows, length_column=length_column, name=name)
    if progress is True and get_rank(group) == 0:
        logger.info(f"{name}: {found.describe()}; each trial repeats it")
    return found


def _batch_maker(
    rows: Any, longest: LongestRow, collate: Callable[[list[Any]], Any], columns: set[str] | None
) -> Callable[[int], Any]:
    """``make(batch_size)``: ``batch_size`` copies of the longest row (``longest.index``), collated."""
    row = rows[longest.index]
    if columns is not None and isinstance(row, Mapping):
        row = {k: v for k, v in row.items() if k in columns}

    def make(batch_size: int) -> Any:
        return collate([dict(row) if isinstance(row, Mapping) else row for _ in range(batch_size)])

    return make


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """``model(**batch).loss``, as ``Trainer.compute_loss`` reads it when the batch has labels."""
    if not isinstance(batch, Mapping):
        raise InvalidArgument(
            f"a trial batch must be a mapping of tensors (the model's keyword arguments), but the collator or make_batch returned {type(batch).__name__}"
        )
    outputs = model(**batch)
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None:
        raise InvalidArgument(
            f"the model returned no loss for a trial batch with keys {sorted(batch)}; give the batch labels (e.g. data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False)), as the Trainer needs them"
        )
    return loss


def _autocast(args: Any, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The autocast the Trainer's ``Accelerator`` runs the forward under (``mixed_precision`` from bf16/fp16)."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def _cache_as_the_trainer_sets_it(model: torch.nn.Module, args: Any) -> Iterator[None]:
    """``model.config.use_cache = args.use_cache`` (default False), as ``Trainer.__init__`` sets it, undone after.

    A model whose config asks for a cache builds one in every forward; in an eval step (no saved
    activations to share its tensors) that is a whole extra copy of every layer's keys and values.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = bool(getattr(args, "use_cache", False))
    try:
        yield
    finally:
        config.use_cache = before


@contextlib.contextmanager
def _checkpointing(model: torch.nn.Module, args: Any) -> Iterator[None]:
    """``args.activation_checkpointing`` applied as ``Trainer._inner_training_loop`` applies it, undone after."""
    wanted = bool(getattr(args, "activation_checkpointing", False))
    was_on = bool(getattr(model, "is_activation_checkpointing", False))
    if not wanted or was_on or not hasattr(model, "activation_checkpointing_enable"):
        yield
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
    )
    try:
        yield
    finally:
        model.activation_checkpointing_disable()


class _TrainStep:
    """One ``Trainer`` optimizer step at ``batch_size`` rows per device (``find_batch_size``'s trial)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        make_batch: Callable[[int], Any],
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
        window: int,
        device: torch.device,
    ):
        self.model, self.optimizer, self.make_batch = model, optimizer, make_batch
        self.autocast, self.window, self.device = autocast, window, device
        self.micro_steps = min(window, 2)

    def __call__(self, batch_size: int) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        # Trainer.get_batch_samples takes the whole accumulation window's batches, on the device,
        # before the first forward, and holds them until the optimizer step
        batches = [_to_device(self.make_batch(batch_size), self.device) for _ in range(self.window)]
        for batch in batches[: self.micro_steps]:  # the second forward runs beside the first's gradients
            with self.autocast():
                loss = _loss(self.model, batch)
            loss.backward()
            del loss
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        del batches


class _EvalStep:
    """One ``Trainer`` prediction step (``find_batch_size`` runs it under ``no_grad`` with the model in ``eval()``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        make_batch: Callable[[int], Any],
        autocast: Callable[[], contextlib.AbstractContextManager[Any]],
        device: torch.device,
    ):
        self.model, self.make_batch, self.autocast, self.device = model, make_batch, autocast, device

    def __call__(self, batch_size: int) -> None:
        batch = _to_device(self.make_batch(batch_size), self.device)
        with self.autocast():
            _loss(self.model, batch)
