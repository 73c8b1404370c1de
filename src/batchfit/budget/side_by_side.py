"""The two shallow copies of a depth-extrapolated step measured at once, the deeper in a forked process.

NOTE [ Shallow copies measured side by side ]
A :class:`~batchfit.budget.depth.DepthExtrapolatedStep` measures each probe twice, once per
shallow copy (NOTE [ Peak memory is affine in depth ]), and the two measurements share
nothing: each copy has its own model, optimizer and fake tensors, and a measurement is a
function of the copy and the lengths alone (NOTE [ A profile is a function of its inputs ]),
not of what was measured before it or beside it. So inside :func:`side_by_side` the deeper
copy's measurements run in a worker process forked once, after the copy is built (it
inherits it as built): the step sends the worker the lengths, measures the shallower copy
itself meanwhile, and reads the worker's measurement back, the same dataclass the copy would
have returned in process. The peaks are the same to the byte (``tests/test_side_by_side.py``
compares every field of every probe, an exceeded one and a forward-only one included, and
``benchmarks/speed.py`` the whole ``--json`` output of the main job and the verl example);
what changes is the wall time, the larger of the two measurements instead of their sum.
The worker's backend is the parent's copy at the fork, and what decides a call changes
between calls (a search stops a candidate at its own limit, or runs it to the end; a world
size sets the reserve): each call carries the backend's
:meth:`~batchfit.memory.Backend.call_settings` of the moment, set in the worker before it
measures (a first version without them stopped verl's update probes that the process ran to
the end).

Only where it is safe and can gain: a simulated backend (fake tensors: no device a forked
process could not share), no real ranks (a rank's collectives stay in its own process), a
POSIX ``fork``, and two CPUs this process may run on. Everything else measures in process as
before, and so does every step while no :func:`side_by_side` block is open (the library's
default; ``batchfit profile`` opens one, ``--jobs 1`` turns it off).

The worker only measures: it never prints (the parent's buffered output is flushed before
the fork and the worker leaves with ``os._exit``), ignores Ctrl-C (the parent stops it), and
sends back the warnings its measurement raised, which the parent raises again where the
in-process measurement would have (so a warning shown once is shown once). An error in the
worker is raised in the parent as the same exception; a worker that dies (killed for memory)
is a :class:`WorkerLost` naming its exit and ``--jobs 1``. Workers end with the block, or when
their pipe closes (the parent gone).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, Pipe
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.validation import check_positive_int

__all__ = ["JOBS_ENV", "MAX_JOBS", "Beside", "Deferred", "Pending", "WorkerLost", "available_cpus", "check_jobs", "jobs", "side_by_side"]

#: Processes a probe's measurements can use: one per shallow copy.
MAX_JOBS = 2
#: The environment variable that sets :func:`side_by_side`'s default (``1`` measures in process).
JOBS_ENV = "BATCHFIT_JOBS"

_JOBS = 1
_WORKERS: list[_Worker] = []


class WorkerLost(RuntimeError):
    """The process measuring a shallow copy exited before it answered."""


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def jobs() -> int:
    """The processes a probe may measure in now: 1 outside a :func:`side_by_side` block."""
    return _JOBS


@contextlib.contextmanager
def side_by_side(jobs: int | None = None) -> Iterator[int]:
    """Measure the shallow copies of depth-extrapolated steps in two processes inside the block (NOTE [ Shallow copies measured side by side ]).

    Args:
        jobs: the processes to use: ``1`` measures in process, ``2`` (or more: a probe has two
            copies) side by side; ``None`` = ``$BATCHFIT_JOBS`` when set, else 2 when this process
            may run on two CPUs, else 1.

    Yields:
        The processes in use (1 or 2). Blocks nest: the innermost wins, the outer one is
        restored on exit. Every worker started inside the block is stopped when it ends.

    Raises:
        InvalidArgument: ``jobs`` (or ``$BATCHFIT_JOBS``) is not a positive integer.
    """
    global _JOBS
    if jobs is None:
        jobs = _jobs_from_environment()
    if jobs is None:
        chosen = MAX_JOBS if available_cpus() >= MAX_JOBS else 1
    else:
        chosen = min(_positive_jobs(jobs), MAX_JOBS)
    before, started = _JOBS, len(_WORKERS)
    _JOBS = chosen
    try:
        yield chosen
    finally:
        _JOBS = before
        while len(_WORKERS) > started:
            _WORKERS.pop().close()


class Pending:
    """A call started by :meth:`Beside.start`: :meth:`get` its answer, or :meth:`drop` it."""

    def __init__(self, worker: _Worker | None, here: Callable[[], Any]):
        self._worker, self._here = worker, here

    def get(self) -> Any:
        """The answer: read from the worker, or computed here now (in process)."""
        return self._here() if self._worker is None else self._worker.result()

    def drop(self) -> None:
        """Not needed after all: the worker's answer is read and discarded (errors too); nothing runs in process."""
        if self._worker is not None:
            with contextlib.suppress(Exception):
                self._worker.result()


class Beside:
    """One step whose calls run in a worker process while a :func:`side_by_side` block allows it, else here.

    NOTE [ Shallow copies measured side by side ]. The worker is forked at the first call inside
    a block, inheriting ``step`` as it is then, or (:meth:`building`) before the step is built,
    to build it itself; a worker whose block ended is dropped and the calls run here again (a
    measurement does not depend on the ones before it), on a step built here then if need be.

    Args:
        step: the step (the deeper shallow copy), or ``None`` with ``make``.
        backend: its backend (only a simulated one is measured beside).
        make: builds the step here when it is first needed here (``step`` ``None``).
    """

    def __init__(self, step: Any, backend: Any, make: Callable[[], Any] | None = None):
        self._step, self.backend, self._make = step, backend, make
        self._worker: _Worker | None = None

    @classmethod
    def building(cls, make: Callable[[], Any], backend: Any) -> Beside | None:
        """A worker forked now that builds ``make()`` while the caller builds its own copy; ``None`` where not allowed.

        Call :meth:`built` once the caller's copy is built: it raises the worker's build error, if any.
        """
        if not _beside_allowed(backend):
            return None
        beside = cls(None, backend, make)
        beside._worker = _Worker(build=make, backend=backend)
        _WORKERS.append(beside._worker)
        return beside

    def built(self) -> None:
        """Wait for the worker started by :meth:`building` to have built its step (its error raised here)."""
        if self._worker is not None:
            self._worker.result()

    @property
    def step(self) -> Any:
        """The step in this process (built now if it was built in the worker only)."""
        if self._step is None:
            if self._make is None:  # Beside's own invariant, not user input
                raise RuntimeError("a Beside without a step needs make")
            self._step = self._make()
        return self._step

    def start(self, fn: Callable[..., Any], *args: Any) -> Pending:
        """Start ``fn(step, *args)`` (a module-level function) in the worker, or hold it to run here on :meth:`Pending.get`."""
        worker = self._current()
        if worker is not None:
            settings = self.backend.call_settings() if hasattr(self.backend, "call_settings") else None
            worker.submit(fn, *args, settings=settings)
        return Pending(worker, lambda: fn(self.step, *args))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(step, *args)`` in the worker or here, its answer."""
        return self.start(fn, *args).get()

    def _current(self) -> _Worker | None:
        if self._worker is not None and self._worker.closed:
            self._worker = None
        if self._worker is None and _beside_allowed(self.backend):
            self._worker = _Worker(self.step, backend=self.backend)
            _WORKERS.append(self._worker)
        return self._worker


class Deferred:
    """Stands for a step a :class:`Beside` worker built: its backend is known here; any other attribute builds it here first."""

    def __init__(self, beside: Beside):
        self._beside = beside

    @property
    def backend(self) -> Any:
        return self._beside.backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._beside.step, name)


def _beside_allowed(backend: Any) -> bool:
    if _JOBS < 2 or not getattr(backend, "simulated", False) or not hasattr(os, "fork"):
        return False
    from batchfit.parallel.distributed import is_distributed

    return not is_distributed()


def call_method(step: Any, name: str, *args: Any) -> Any:
    """``step.name(*args)``: a method call :meth:`Beside.start` can send to a worker."""
    return getattr(step, name)(*args)


class _Worker:
    """One forked process serving ``measure`` and ``measure_state`` calls of one step over a pipe."""

    def __init__(self, step: Any = None, build: Callable[[], Any] | None = None, backend: Any = None):
        mine, theirs = Pipe(duplex=True)
        sys.stdout.flush()
        sys.stderr.flush()
        with warnings.catch_warnings():
            # Python 3.12+ warns that a forked child of a threaded process may deadlock; the
            # worker takes no lock another thread could hold (it never prints or logs)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                mine.close()
                _serve(step, theirs, build, backend)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        self.pid, self._conn, self._pending = pid, mine, False

    @property
    def closed(self) -> bool:
        """The worker was stopped (its block ended) or lost."""
        return self._conn.closed

    def submit(self, fn: Callable[..., Any], *args: Any, settings: dict[str, Any] | None = None) -> None:
        """Ask the worker to run ``fn(step, *args)`` (``fn`` a module-level function) with its backend's ``settings``
        (:meth:`~batchfit.memory.Backend.call_settings` here, now); :meth:`result` reads the answer."""
        if self._pending:
            raise RuntimeError("the worker's previous answer was not read")  # a bug of the caller, not user input
        try:
            self._conn.send((fn, args, settings))
        except OSError as exc:
            raise self._lost() from exc
        self._pending = True

    def result(self) -> Any:
        """The answer to the last :meth:`submit`: its value, or its exception raised here."""
        self._pending = False
        try:
            kind, value, caught = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._lost() from exc
        for message, category, filename, lineno, module in caught:
            registry = vars(sys.modules[module]).setdefault("__warningregistry__", {}) if module in sys.modules else None
            warnings.warn_explicit(message, category, filename, lineno, module=module or None, registry=registry)
        if kind == "error":
            raise value
        return value

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``submit`` then ``result``."""
        self.submit(fn, *args)
        return self.result()

    def close(self) -> None:
        """Stop the worker and reap it (killed if it does not leave within a few seconds)."""
        if self._conn.closed:
            return
        self._conn.close()  # the worker reads the end of its pipe and leaves
        for _ in range(50):
            try:
                done, _status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if done:
                return
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)

    def _lost(self) -> WorkerLost:
        self._conn.close()
        status = "still running"
        for _ in range(50):  # a process whose pipe just closed may take a moment to be reaped
            try:
                done, raw = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                status = "already reaped"
                break
            if done:
                status = f"killed by signal {os.WTERMSIG(raw)}" if os.WIFSIGNALED(raw) else f"exit code {os.WEXITSTATUS(raw)}"
                break
            time.sleep(0.02)
        return WorkerLost(
            f"the process measuring the deeper shallow copy (pid {self.pid}) stopped answering ({status}); "
            "run with --jobs 1 (side_by_side(jobs=1) from Python) to measure both copies in this process"
        )


def _build(make: Callable[[], Any]) -> Any:
    return make()


def _serve(step: Any, conn: Connection, build: Callable[[], Any] | None = None, backend: Any = None) -> None:
    """The worker's loop: build the step first if asked (answering ``None``), then answer each call until the pipe closes.

    Each call first takes the parent's backend settings of the moment (its limits, a search's
    stop, running to the end): the worker's copy of the backend is the parent's at the fork.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when a run stops
    # the parent's OpenMP threads are not in this process: a parallel region here would wait for
    # them forever (GNU libgomp's team barrier, seen when the parent had run a large host op first);
    # one intra-op thread runs every region inline. A measurement's host ops are small.
    import torch

    torch.set_num_threads(1)
    first = None if build is None else (_build, (build,), None)
    while True:
        if first is not None:
            (fn, args, settings), first = first, None
        else:
            try:
                fn, args, settings = conn.recv()
            except (EOFError, OSError):
                return
        if settings is not None and backend is not None:
            backend.apply_call_settings(settings)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # the parent's filters and registries decide what is shown
            try:
                if fn is _build:
                    step = _build(*args)
                    answer: tuple[str, Any] = ("value", None)
                else:
                    answer = ("value", fn(step, *args))
            except Exception as exc:
                answer = ("error", _portable(exc))
        seen = [(str(w.message), w.category, w.filename, w.lineno, _module_of(w.filename)) for w in caught]
        conn.send((*answer, seen))


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return RuntimeError(f"the deeper shallow copy's measurement raised {type(exc).__name__}:\n{text}")


def _module_of(filename: str) -> str:
    """The name of the loaded module defined in ``filename`` (``""`` when none), for its warning registry."""
    for name, module in list(sys.modules.items()):
        if getattr(module, "__file__", None) == filename:
            return name
    return ""


def _jobs_from_environment() -> int | None:
    given = os.environ.get(JOBS_ENV, "").strip()
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise InvalidArgument(
            f"{JOBS_ENV} must be a positive integer (1 measures in this process, 2 side by side), but got "
            f"{JOBS_ENV}={given!r}; set it to 1 or 2, or unset it"
        )
    return int(given)


def check_jobs(value: Any) -> int | None:
    """``--jobs`` as given: ``None`` (automatic) or a positive integer.

    Raises:
        InvalidArgument: anything else, naming the value and the fix.
    """
    return None if value is None else _positive_jobs(value)


def _positive_jobs(value: Any) -> int:
    try:
        return check_positive_int("jobs", value)
    except InvalidArgument:
        raise InvalidArgument(
            f"jobs must be a positive integer (1 measures in this process, 2 measures the two shallow copies "
            f"side by side), but got jobs={value!r}"
        ) from None
