"""Ending a process that ran collectives, without racing their worker threads through the interpreter's exit.

NOTE [ A collective's worker outlives the interpreter ]
A gloo process group runs each collective on a worker thread of its own, and that thread
drops its reference to the finished work *after* the caller's ``wait()`` has returned.
Dropping it releases the work's tensors, and releasing a tensor that has a Python object
takes the GIL. When the main thread has meanwhile reached the interpreter's exit
(``Py_FinalizeEx``), the worker's ``take_gil`` ends its thread, the unwind meets a
``noexcept`` destructor, and the process aborts with "terminate called without an active
exception" (SIGABRT), after it printed everything it meant to. Seen here on one run in ten
of ``torchrun --nproc-per-node 2 examples/trl_grpo_packed.py`` beside two CPU burners
(2026-12-02): the core's crashing thread is ``ProcessGroupGloo::runLoop`` →
``~AsyncAllgatherWork`` → ``decref_pyobject`` → ``take_gil`` → ``pthread_exit``.
``destroy_process_group()`` does not help (it does not join the workers), nor does a
``barrier()`` after the last collective (its work holds the previous ones: the same
destructor runs from ``~AsyncBarrierWork``). PyTorch's own fix (pytorch/pytorch#179291,
an atexit ``destroy_process_group``) was abandoned as not enough.

The only exit that no worker can race is one without finalization: flush what the process
wrote, then ``os._exit``. :func:`exit_after_collectives` does that; the CLI calls it when it
joined torchrun's ranks itself (:func:`batchfit.cli._ranks.process_group`), and the examples
that gather their ranks' results call it last.

NOTE [ A command ends without tearing torch down ]
The interpreter's finalization of a process that imported torch and transformers takes
longer than most of what ``batchfit`` does after its imports: 1.34 s here (2026-12-03, load
~1.5: ``import torch, transformers`` and the Qwen2 classes, then exit: 5.25 s; the same ending
in ``os._exit``: 3.91 s), and 1.2–1.5 s after ``batchfit profile``, whose own work ends in
about 7 s. Nothing it would do matters to a command that has finished: its files are written
and closed, its workers stopped, its process group destroyed. So the console script ends in
:func:`quick_exit`: the ``atexit`` handlers run (a temporary directory a finalizer would
remove is removed), logging, stdout and stderr are flushed, then ``os._exit``. Library
callers and the tests, which call :func:`batchfit.cli.main`, return as before.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn

_JOINED = False


def note_joined() -> None:
    """Record that this process joined a process group whose workers may outlive its exit."""
    global _JOINED
    _JOINED = True


def joined() -> bool:
    """Whether :func:`note_joined` ran in this process."""
    return _JOINED


def exit_after_collectives(code: int = 0) -> NoReturn:
    """Flush stdout, stderr and logging, then end the process with ``code`` and no finalization.

    NOTE [ A collective's worker outlives the interpreter ]. ``atexit`` handlers do not
    run: call it only once everything the process owns is closed (temporary directories
    removed, files written, process groups destroyed).
    """
    _flushed()
    os._exit(code)


def quick_exit(code: int = 0) -> NoReturn:
    """End a finished command with ``code``: ``atexit`` handlers, then flush, then ``os._exit`` (NOTE [ A command ends without tearing torch down ])."""
    run_handlers = getattr(atexit, "_run_exitfuncs", None)  # CPython's: what the interpreter runs at exit
    if run_handlers is not None:
        with contextlib.suppress(Exception):
            run_handlers()
    _flushed()
    os._exit(code)


def _flushed() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
