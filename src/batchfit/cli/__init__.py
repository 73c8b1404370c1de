"""The ``batchfit`` command line: parse, call one library function, render.

Each subcommand lives in its own module exposing ``add_parser(subparsers)``, which
registers the parser and sets ``func(args) -> int``. Bad input from the user (any
:class:`~batchfit.errors.BatchfitError` that is a ``ValueError``, and argparse usage
errors) prints one line per fault on stderr and exits 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, NoReturn

from batchfit.errors import BatchConfigError, BatchfitError, DoesNotFitError, TaskError, Vocabulary

# Subcommand modules, in the order `batchfit --help` lists them, with the one line it shows for each
# (each module's own `help=` says the same; tests/test_cli_help.py holds them equal).
# NOTE [ A light --help ]: a subcommand module may import torch (seconds); `batchfit --help`,
# `--version` and a bare or mistyped command import none of them, and a command imports its own only.
COMMANDS: dict[str, str] = {
    "profile": "find the token budget per rank: the largest micro-batch cost that fits in memory",
    "plan": "validate and explain train / mini / micro batch sizes and the data-parallel layout",
    "autobatch": "find the largest batch size that fits a target memory fraction (train and val), any model",
    "bench": "benchmarks (logprobs: time and peak memory of log-prob paths)",
    "demo": "run examples/grpo_stepwise.py: step-wise GRPO on a tiny model, token budgets, packed micro-batches",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) instead of the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser(commands: Sequence[str] | None = None) -> ArgumentParser:
    """The ``batchfit`` parser; ``commands``: the subcommands whose modules are imported (default: all).

    The others are registered by name and help line only (NOTE [ A light --help ]): enough for
    ``--help``, ``--version`` and argparse's "invalid choice" message, nothing to run.
    """
    from batchfit import __version__

    wanted = COMMANDS if commands is None else commands

    parser = ArgumentParser(
        prog="batchfit",
        description="Fit LLM training to accelerator memory: batch plans, token budgets, micro-batching.",
    )
    parser.add_argument("--version", action="version", version=f"batchfit {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback when your own code (a task file) raises"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name, summary in COMMANDS.items():
        if name not in wanted:
            sub.add_parser(name, help=summary)
            continue
        try:
            module = importlib.import_module(f"batchfit.cli.{name}")
        except ModuleNotFoundError as exc:  # a subcommand not built yet
            if exc.name == f"batchfit.cli.{name}":
                continue
            raise
        module.add_parser(sub)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top level takes no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _faults(exc: BaseException, vocabulary: Vocabulary | None = None) -> list[str]:
    if isinstance(exc, BatchConfigError):
        return list(exc.faults)
    text = exc.say(vocabulary) if isinstance(exc, DoesNotFitError) else str(exc)
    return [line.strip() for line in text.splitlines() if line.strip()] or [type(exc).__name__]


def report_error(
    prog: str, exc: BaseException, *, as_json: bool = False, vocabulary: Vocabulary | None = None
) -> None:
    """Print ``exc`` as one line per fault on stderr; with ``as_json`` also as a JSON document on stdout.

    The document is ``{"schema_version": 2, "error": {"type": ..., "faults": [...]}}``, so a script reading
    ``--json`` output gets JSON whatever happened; a :class:`~batchfit.errors.DoesNotFitError`
    adds its numbers (``needed_bytes``, ``limit_bytes``, ``reserve_bytes``, ``usable_bytes``,
    the one sequence's ``breakdown``) and ``remedies`` (``text``, and the settings to ``change``).
    Settings are named in ``vocabulary``, the command's flags (NOTE [ Messages in the caller's
    vocabulary ] in :mod:`batchfit.errors`). A stdout that cannot be written (full, closed, a
    closed pipe) loses the document, never the lines on stderr.
    """
    faults = _faults(exc, vocabulary)
    _say("".join(f"{prog}: error: {fault}\n" for fault in faults))
    if as_json:
        error: dict[str, Any] = {"type": type(exc).__name__, "faults": faults}
        if isinstance(exc, DoesNotFitError):
            error.update(exc.to_dict(vocabulary))
        try:
            from batchfit.budget.document import error_document  # NOTE [ The --json schema ]

            json.dump(
                error_document(error),
                sys.stdout,
                indent=2,
                ensure_ascii=False,
            )
            sys.stdout.write("\n")
            sys.stdout.flush()
        except OSError:  # the lines above already said it; nothing is left to flush at exit
            _silence(getattr(sys.stdout, "_stream", sys.stdout))


def _say(text: str) -> None:
    """Write ``text`` on stderr; a stderr that cannot be written is silent (nowhere else to say it)."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()


class StdoutError(OSError):
    """stdout cannot be written (full, closed, a closed pipe): told apart from the files a command writes."""


class _Stdout:
    """``sys.stdout`` during a command: its write failures become :class:`StdoutError`.

    ``stream`` is ``None`` when the process started with stdout closed (``>&-``): every write
    then fails with ``EBADF``, as the shell's redirection means.
    """

    def __init__(self, stream: Any):
        self._stream = stream
        #: a write or flush failed: what is left is not flushed again
        self.broken = False

    def write(self, text: str) -> int:
        if self._stream is None:
            self.broken = True
            raise StdoutError(errno.EBADF, "stdout is closed")
        try:
            return self._stream.write(text)
        except OSError as exc:
            self.broken = True
            raise StdoutError(exc.errno, exc.strerror or str(exc)) from exc

    def flush(self) -> None:
        if self._stream is None or self.broken:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            self.broken = True
            raise StdoutError(exc.errno, exc.strerror or str(exc)) from exc

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


EXIT_OUTPUT = 2
"""Exit code when stdout cannot be written (full, closed): like a file named on the command line."""


def console() -> NoReturn:
    """The ``batchfit`` console script and ``python -m batchfit``: :func:`main`, then a quick exit.

    NOTE [ A command ends without tearing torch down ] in :mod:`batchfit.parallel.process_exit`.
    """
    code = main()
    from batchfit.parallel.process_exit import quick_exit

    quick_exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command of ``argv`` (default ``sys.argv[1:]``); returns the exit code (the console script is :func:`console`).

    A process that joined torchrun's ranks here ends in :func:`~batchfit.parallel.process_exit.exit_after_collectives`
    instead of returning (NOTE [ A collective's worker outlives the interpreter ]).
    """
    code = _main(argv)
    exiting = sys.modules.get("batchfit.parallel.process_exit")  # imported only by a command that joined ranks
    if exiting is not None and exiting.joined():
        exiting.exit_after_collectives(code)
    return code


def _main(argv: Sequence[str] | None) -> int:
    """The command's exit code.

    Ctrl-C at any point, the imports that building the parser triggers included, exits 130
    with ``batchfit: interrupted`` and no traceback; a command that writes a file adds, on the
    same line, whether the file is the old one, untouched, or the new one, complete. A stdout that cannot be written exits
    :data:`EXIT_OUTPUT` (2) with one line on stderr (0 and nothing for a pipe its reader
    closed, as ``batchfit plan --json | head``), never a traceback.
    """
    real, real_err = sys.stdout, sys.stderr
    guard = sys.stdout = _Stdout(real)
    if sys.stderr is None:  # started with stderr closed (2>&-): nowhere to say anything
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - closed in the finally below
    try:
        code = _run(argv)
        guard.flush()  # a full disk shows here, not at exit
        if guard.broken:  # the error report's JSON was lost; its lines on stderr said it all
            _silence(real)
        return code
    except KeyboardInterrupt as exc:
        # a command may say what its output file holds (batchfit.fileio.said_on_interrupt)
        _say(f"batchfit: interrupted; {exc}\n" if str(exc) else "batchfit: interrupted\n")
        return 130
    except StdoutError as exc:
        guard.broken = True
        _silence(real)
        if isinstance(exc.__cause__, BrokenPipeError) or exc.errno == errno.EPIPE:
            return 0
        _say(
            f"batchfit: error: cannot write the output to stdout ({exc.strerror or exc}); redirect it to a "
            "file or pipe that accepts it\n"
        )
        return EXIT_OUTPUT
    finally:
        sys.stdout = real
        if sys.stderr is not real_err:
            sys.stderr.close()
            sys.stderr = real_err


def _silence(stream: Any) -> None:
    """Point a failed stdout at /dev/null, so the interpreter's last flush at exit does not fail again."""
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def _run(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser([c for c in [_command(argv)] if c in COMMANDS])  # NOTE [ A light --help ]
    # --debug may stand anywhere: the full traceback of what the user's own code raised
    debug = "--debug" in argv
    args = parser.parse_args([a for a in argv if a != "--debug"])
    if args.command is None:
        with contextlib.suppress(OSError):
            parser.print_usage(sys.stderr)
        _say(f"batchfit: error: name a command ({', '.join(COMMANDS)}); see batchfit --help\n")
        return 2
    prog = f"batchfit {args.command}"
    as_json = bool(getattr(args, "json", False))
    # the command's flags, which its errors name (set by its parser: NOTE [ Messages in the caller's vocabulary ])
    vocabulary = getattr(args, "vocabulary", None)
    try:
        return int(args.func(args) or 0)
    except BatchfitError as exc:
        # Bad input (a ValueError subclass) exits 2; "nothing fits" and other verdicts exit 1.
        if isinstance(exc, TaskError):
            if debug and exc.__cause__ is not None:
                traceback.print_exception(exc.__cause__, file=sys.stderr)
            elif not debug and exc.__cause__ is not None:
                exc = TaskError(f"{exc}; add --debug for the traceback", exc.location)
        report_error(prog, exc, as_json=as_json, vocabulary=vocabulary)
        return 2 if isinstance(exc, ValueError) else 1
    except StdoutError:
        raise
    except BrokenPipeError:  # e.g. `batchfit plan --json | head`
        return 0
    except OSError as exc:  # a file named on the command line cannot be read or written
        report_error(prog, exc, as_json=as_json)
        return 2
