"""The ``Task`` protocol: what ``batchfit autobatch`` needs to know about a model, and its steps.

A task is any object with

- ``model``: the ``nn.Module``;
- ``make_batch(batch_size, mode)``: a batch (a tensor, or a dict/list/tuple of tensors) of
  ``batch_size`` samples for ``mode`` (``"train"`` or ``"val"``), created on the CPU or on
  the model's device (batchfit moves it to the model's device);
- ``loss(model, batch)``: the scalar loss of ``model`` on ``batch``;
- optionally ``make_optimizer(parameters)``: an optimizer factory (default:
  ``torch.optim.AdamW``; ``make_optimizer = None`` means no optimizer step).

# NOTE [ Tasks are built inside the backend's context ]
The task factory (``module:function``, called with no arguments) is called inside
``backend.context()`` by :func:`build_task`: on the ``estimate`` backend that is a
``FakeTensorMode``, so the model's parameters are fake and nothing is allocated. Build the
model directly in the factory (``module.to()`` under the fake mode fails); batchfit moves it
to ``backend.device`` only when that differs (cuda). ``make_batch`` and the steps run inside
``backend.measure``, which enters the same context.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from batchfit.autobatch.task_names import BUILTIN_TASKS, MODES
from batchfit.errors import BatchfitError, InvalidArgument, TaskError
from batchfit.memory.base import is_out_of_memory
from batchfit.memory.tracker import MemoryLimitExceeded
from batchfit.validation import check_choice, closest


@runtime_checkable
class Task(Protocol):
    """A model with a batch factory and a loss (see the module docstring)."""

    model: torch.nn.Module

    def make_batch(self, batch_size: int, mode: str) -> Any:
        """A batch of ``batch_size`` samples for ``mode`` (``"train"`` or ``"val"``)."""
        ...

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``model`` on ``batch``."""
        ...


def is_task(obj: Any) -> bool:
    """True if ``obj`` has a ``model`` module and callable ``make_batch`` and ``loss``."""
    return (
        isinstance(getattr(obj, "model", None), torch.nn.Module)
        and callable(getattr(obj, "make_batch", None))
        and callable(getattr(obj, "loss", None))
    )


def load_task(spec: str) -> Callable[[], Any]:
    """The task factory named by ``spec``.

    Args:
        spec: a built-in name (``"causal-lm"``, ``"vision-cnn"``), ``"package.module:function"``
            or ``"path/to/file.py:function"``.

    Returns:
        The factory, to be called with no arguments inside ``backend.context()``
        (:func:`build_task`).

    Raises:
        InvalidArgument: malformed spec, module that cannot be imported, missing or
            non-callable function (one line each, naming the spec and the fix).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument(f"task must be a string 'module:function', but got task={spec!r}")
    spec = spec.strip()
    target = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, func_name = target.rpartition(":")
    if not sep or not module_name or not func_name:
        near = closest(spec, list(BUILTIN_TASKS))
        hint = f"; did you mean {near!r}?" if near else ""
        if spec.endswith(".py"):
            hint = f"; name the function that makes the task: {spec}:FUNCTION"
        raise InvalidArgument(
            f"task must be 'module:function', 'path/to/file.py:function' or one of {', '.join(map(repr, BUILTIN_TASKS))}, but got task={spec!r}{hint}"
        )
    module = _import(module_name, spec)
    factory = getattr(module, func_name, None)
    if not callable(factory):
        kind = "file" if module_name.endswith(".py") else "module"
        raise InvalidArgument(
            f"task={spec!r}: {kind} {module_name!r} has no callable {func_name!r}; name a function that returns a task"
        )
    return factory


def _import(module_name: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise InvalidArgument(f"task={spec!r}: file {module_name!r} does not exist; check the path")
        name = f"_batchfit_task_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:  # pragma: no cover - .py files always load
            raise InvalidArgument(f"task={spec!r}: cannot load {module_name!r} as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except (Exception, SystemExit) as exc:  # the user's file: SyntaxError, ImportError, sys.exit, anything
            sys.modules.pop(name, None)
            raise task_error(exc, f"your task file {module_name!r} raised") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and module_name.startswith(missing):  # the module itself, not an import inside it
            raise InvalidArgument(
                f"task={spec!r}: cannot import module {module_name!r} ({exc}); check the name and that it is on PYTHONPATH"
            ) from None
        raise task_error(exc, f"your task module {module_name!r} raised") from exc


def task_error(exc: BaseException, what: str) -> TaskError:
    """``what`` plus the exception and where in the user's code it was raised, as one line.

    The location is the innermost frame outside batchfit and torch (the user's code), or
    for a ``SyntaxError`` the file and line that do not parse.
    """
    location = ""
    if isinstance(exc, SyntaxError) and exc.filename:
        location = f"{exc.filename}:{exc.lineno}"
    else:
        for frame in reversed(traceback.extract_tb(exc.__traceback__)):
            if not _library_frame(frame.filename):
                location = f"{frame.filename}:{frame.lineno}"
                break
    detail = " ".join(str(exc).split()) or "(no message)"
    if isinstance(exc, SystemExit):
        detail = f"sys.exit({exc.code!r}): a task must return, not exit"
    where = f" at {location}" if location else ""
    return TaskError(f"{what} {type(exc).__name__}: {detail}{where}", location=location)


def _library_frame(filename: str) -> bool:
    """A frame of batchfit, torch, the standard library's import machinery or Python itself."""
    return filename.startswith("<frozen") or any(
        part in filename for part in (f"{os.sep}batchfit{os.sep}", f"{os.sep}torch{os.sep}")
    )


def build_task(factory: Callable[[], Any], backend: Any) -> Any:
    """Call ``factory()`` inside ``backend.context()`` and check that it returned a task.

    See NOTE [ Tasks are built inside the backend's context ]. The model is moved to
    ``backend.device`` when its parameters are elsewhere (a real CPU model for cuda).

    Raises:
        InvalidArgument: the returned object lacks ``model``, ``make_batch`` or ``loss``.
    """
    with backend.context():
        try:
            task = factory()
        except (Exception, SystemExit) as exc:  # sys.exit() in a factory (or --task sys:exit) is no task
            if is_out_of_memory(exc) or isinstance(exc, BatchfitError):
                raise
            name = getattr(factory, "__qualname__", repr(factory))
            raise task_error(exc, f"your task factory {name!r} raised") from exc
    if not is_task(task):
        missing = [
            name
            for name, ok in (
                ("model (an nn.Module)", isinstance(getattr(task, "model", None), torch.nn.Module)),
                ("make_batch(batch_size, mode)", callable(getattr(task, "make_batch", None))),
                ("loss(model, batch)", callable(getattr(task, "loss", None))),
            )
            if not ok
        ]
        raise InvalidArgument(
            f"the task factory {getattr(factory, '__qualname__', factory)!r} returned {type(task).__name__}, which lacks {', '.join(missing)}; return an object with model, make_batch and loss"
        )
    device = _device_of(task.model)
    if device is not None and device != backend.device:
        task.model.to(backend.device)
    return task


def _device_of(model: torch.nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


def _to_device(batch: Any, device: torch.device | None) -> Any:
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class TaskTrial:
    """One step of a task in one mode, as ``find_batch_size`` runs it: ``trial(batch_size)``.

    Train: ``model.train()``, forward, ``loss.backward()``, optimizer step (the optimizer comes
    from the task's ``make_optimizer``, or :func:`batchfit.train.optim.default_optimizer`, the
    one ``TrainingStep`` uses; its state is created before the first trial), then gradients set
    to ``None`` (NOTE
    [ Gradients do not outlive the step ]). Val: gradients dropped, ``model.eval()`` and ``torch.no_grad()`` around the batch and
    the loss. :attr:`persistent` holds what lives across steps (model, optimizer) for
    ``backend.measure(register=...)``.
    """

    def __init__(self, task: Any, mode: str):
        self.task = task
        self.mode = check_choice("mode", mode, MODES)
        self.model: torch.nn.Module = task.model
        self.optimizer: torch.optim.Optimizer | None = None
        if self.mode == "train":
            if not any(p.requires_grad for p in self.model.parameters()):
                raise TaskError(
                    f"the task's model ({type(self.model).__name__}) has no parameters that require gradients, so "
                    "there is nothing to train; give it parameters, or search --modes val only"
                )
            factory = getattr(task, "make_optimizer", _adamw)
            if factory is not None:
                with _user_code("make_optimizer"):
                    self.optimizer = factory(self.model.parameters())
                if not callable(getattr(self.optimizer, "step", None)) or not hasattr(self.optimizer, "param_groups"):
                    raise TaskError(
                        f"the task's make_optimizer returned {type(self.optimizer).__name__}, not a "
                        "torch.optim.Optimizer; return one (e.g. torch.optim.AdamW(parameters)), or set "
                        "make_optimizer = None for no optimizer step"
                    )
        else:
            for p in self.model.parameters():
                p.grad = None

    def prepare(self) -> None:
        """Create the optimizer's state before any trial, as ``TrainingStep`` does (call inside the backend's context).

        Without it the first trial would also allocate the state, and a one-step trial would
        miss it (SkyRL #1060); :func:`batchfit.models.initialize_optimizer_state` leaves the
        parameters, and any state a user's optimizer already has, unchanged.
        """
        if self.optimizer is not None:
            from batchfit.train.optim import initialize_optimizer_state

            with _user_code("optimizer"):
                initialize_optimizer_state(self.optimizer)

    @property
    def persistent(self) -> tuple[Any, ...]:
        """Objects counted in every measurement: the model, and the optimizer in train mode."""
        return (self.model,) if self.optimizer is None else (self.model, self.optimizer)

    def __call__(self, batch_size: int) -> None:
        """Run one step of ``batch_size`` samples."""
        device = _device_of(self.model)
        if self.mode == "val":
            self.model.eval()
            with torch.no_grad(), _user_code("make_batch / loss"):
                batch = _to_device(self.task.make_batch(batch_size, "val"), device)
                self.task.loss(self.model, batch)
            return
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        with _user_code("make_batch / loss"):
            batch = _to_device(self.task.make_batch(batch_size, "train"), device)
            loss = self.task.loss(self.model, batch)
        del batch
        _check_loss(loss)
        with _user_code("loss backward"):
            loss.backward()
        del loss
        if self.optimizer is not None:
            with _user_code("optimizer step"):
                self.optimizer.step()
        # NOTE [ Gradients do not outlive the step ]: a training loop frees them (zero_grad with
        # set_to_none) before the next forward; freeing them here keeps every trial alike.
        self.model.zero_grad(set_to_none=True)


def _check_loss(loss: Any) -> None:
    """A train step needs a scalar tensor with a graph to run backward on.

    Raises:
        TaskError: a float, a tensor of more than one value, or a tensor without gradients
            (names what the task's loss returned and the fix).
    """
    if not isinstance(loss, torch.Tensor):
        raise TaskError(
            f"the task's loss(model, batch) returned {type(loss).__name__}, not a tensor; return the scalar loss "
            "tensor (e.g. model(batch).square().mean()), not loss.item()"
        )
    if loss.numel() != 1:
        raise TaskError(
            f"the task's loss(model, batch) returned a tensor of shape {tuple(loss.shape)}, not a scalar; reduce it "
            "(e.g. .mean()) to one value"
        )
    if not loss.requires_grad:
        raise TaskError(
            "the task's loss(model, batch) returned a tensor without gradients (computed under torch.no_grad(), "
            "detached, or not from the model's parameters); compute it from model(batch)"
        )


@contextlib.contextmanager
def _user_code(what: str) -> Iterator[None]:
    """Name an exception of the task's own methods as the task's, not batchfit's.

    Running out of memory, and the tracker's abort at the limit, pass through unchanged: the
    search decides on them (NOTE [ What counts as OOM ]).
    """
    try:
        yield
    except (Exception, SystemExit) as exc:
        if is_out_of_memory(exc) or isinstance(exc, (BatchfitError, MemoryLimitExceeded)):
            raise
        raise task_error(exc, f"your task's {what} raised") from exc


def _adamw(parameters: Any) -> torch.optim.Optimizer:
    from batchfit.train.optim import default_optimizer

    return default_optimizer(parameters, lr=1e-4)
