"""``batchfit autobatch``: the largest batch size at each target memory fraction, for train and val.

Parses flags (and ``--config`` YAML whose keys mirror the flags), calls
:func:`batchfit.autobatch.sweep`, renders a table (rich) and writes the report rows
(``--output``: ``.jsonl`` or ``.csv``). Flags given on the command line override the file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any

from batchfit.autobatch.task_names import BUILTIN_TASKS, DEFAULT_TASK, MODES
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.memory.backends import BACKEND_NAMES, backend_class, backend_name
from batchfit.validation import closest, is_int, short_repr

if TYPE_CHECKING:
    from batchfit.autobatch.batch_guess import Trial

MAX_STEPS = 1000
"""Most steps per trial: ten to the twentieth would never end, and the peak is reached in two."""

# config key -> (flag, default); config keys mirror the flags ("min-bs" and "min_bs" both work).
OPTIONS: dict[str, tuple[str, Any]] = {
    "task": ("--task", DEFAULT_TASK),
    "fractions": ("--fractions", "0.8"),
    "modes": ("--modes", ",".join(MODES)),
    "steps": ("--steps", 2),
    "min_bs": ("--min-bs", 1),
    "max_bs": ("--max-bs", 512),
    "memory": ("--memory", None),
    "reserve": ("--reserve", None),
    "backend": ("--backend", "auto"),
    "output": ("--output", None),
}


#: The library's keyword names → this command's flags: the settings its errors name are written
#: as these flags (NOTE [ Messages in the caller's vocabulary ] in :mod:`batchfit.errors`).
FLAGS = {
    "target_memory_fraction": "--fractions",
    "min_batch_size": "--min-bs",
    "max_batch_size": "--max-bs",
    "steps_per_trial": "--steps",
    "memory_limit": "--memory",
    "reserve_bytes": "--reserve",
    "backend": "--backend",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``batchfit autobatch`` on the dispatcher's subparsers."""
    p = sub.add_parser(
        "autobatch",
        help="find the largest batch size that fits a target memory fraction (train and val), any model",
        description=(
            "For every target memory fraction × mode, find the largest batch size whose peak memory is at "
            "most fraction × usable memory (memory minus reserve), with a bounded model-guided search. "
            f"Tasks: built-in {', '.join(BUILTIN_TASKS)} (default {DEFAULT_TASK}), or module:function / "
            "file.py:function returning an object with model, make_batch(batch_size, mode), loss(model, batch)."
        ),
    )
    p.add_argument(
        "--config", metavar="FILE", help="YAML file whose keys mirror the flags (task, fractions, ...)"
    )
    p.add_argument(
        "--task", metavar="SPEC", help=f"built-in name or module:function (default {DEFAULT_TASK})"
    )
    p.add_argument("--fractions", metavar="F,F", help="target memory fractions in (0, 1] (default 0.8)")
    p.add_argument("--modes", metavar="M,M", help="train and/or val (default train,val)")
    p.add_argument(
        "--steps", type=int, metavar="N", help="steps per trial; the peak is over them (default 2)"
    )
    p.add_argument(
        "--min-bs", "--min_bs", dest="min_bs", type=int, metavar="N", help="smallest batch size (default 1)"
    )
    p.add_argument(
        "--max-bs", "--max_bs", dest="max_bs", type=int, metavar="N", help="largest batch size (default 512)"
    )
    p.add_argument(
        "--memory", metavar="SIZE", help="device memory: bytes, 16GiB, 80GB or a preset (h100-80gb)"
    )
    p.add_argument("--reserve", metavar="SIZE", help="bytes of --memory no tracker sees (default: backend's)")
    p.add_argument("--backend", metavar="NAME", help=f"{', '.join(BACKEND_NAMES)} (default auto)")
    p.add_argument("--output", metavar="FILE", help="write the rows to FILE.jsonl or FILE.csv")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress display")
    p.set_defaults(func=run, vocabulary=Vocabulary(FLAGS))


def load_settings(config: str | None) -> dict[str, Any]:
    """The settings in a ``--config`` YAML file, keys normalised (``min-bs`` -> ``min_bs``).

    Raises:
        InvalidArgument: missing, unreadable or not UTF-8, not a mapping, or an unknown key (the
            closest key is suggested).
    """
    if config is None:
        return {}
    from batchfit.fileio import parse_yaml, read_text

    what = f"--config {config!r}"
    try:  # NOTE [ Untrusted input files ]: size, aliases, depth and integers bounded
        data = parse_yaml(read_text(config, what), what)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{exc}; pass a YAML file whose keys mirror the flags") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise InvalidArgument(
            f"config={config!r} must hold a mapping of settings, but got {type(data).__name__}"
        )
    settings: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in OPTIONS:
            near = closest(name, list(OPTIONS))
            hint = f"; did you mean {near!r}?" if near else f"; known keys: {', '.join(OPTIONS)}"
            raise InvalidArgument(f"config={config!r} has unknown key {key!r}{hint}")
        settings[name] = value
    return settings


def _split(name: str, value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    raise InvalidArgument(f"{name} must be a comma-separated list, but got {name}={value!r}")


def _fractions(value: Any) -> tuple[float, ...]:
    items = []
    for v in _split("fractions", value):
        try:
            items.append(float(v) if isinstance(v, str) else v)
        except ValueError:
            raise InvalidArgument(f"fractions must be numbers in (0, 1], but got fraction={v!r}") from None
    from batchfit.autobatch.fraction_sweep import check_fractions

    return check_fractions(items)


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the ``--config`` file, then flags given on the command line; checked.

    Raises:
        InvalidArgument: any bad setting (one line, naming it), an unknown backend or an
            ``--output`` that cannot be written, before any model is built.
    """
    settings = {key: default for key, (_, default) in OPTIONS.items()}
    settings.update(load_settings(args.config))
    for key in OPTIONS:
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    for key in ("task", "backend", "output"):  # a YAML number or list where a name goes
        if settings[key] is not None and not isinstance(settings[key], str):
            flag = OPTIONS[key][0]
            raise InvalidArgument(
                f"{flag} must be a name, but got {key}={short_repr(settings[key])} ({type(settings[key]).__name__}) "
                "in the config; write it as a string"
            )
    if is_int(settings["steps"]) and settings["steps"] > MAX_STEPS:  # the library checks the rest
        raise InvalidArgument(
            f"--steps must be at most {MAX_STEPS:,} (each trial runs that many steps; the peak is reached in the "
            f"first two), but got steps={settings['steps']:,}; use the default 2"
        )
    from batchfit.memory.device_memory import resolve_device_memory

    backend = backend_name(settings["backend"])
    # one process: no NCCL buffers in the default reserve
    device = resolve_device_memory(
        settings["memory"], settings["reserve"], backend, vocabulary=Vocabulary(FLAGS), purpose="to take a fraction of"
    )
    settings["memory_defaulted"] = device.defaulted
    settings["memory"] = device.memory
    if settings["reserve"] is not None and isinstance(settings["reserve"], str) and settings["reserve"].strip().isdigit():
        settings["reserve"] = int(settings["reserve"])  # a plain byte count from the command line
    settings["fractions"] = _fractions(settings["fractions"])
    from batchfit.autobatch import check_report_path
    from batchfit.autobatch.fraction_sweep import check_modes

    settings["modes"] = check_modes(_split("modes", settings["modes"]))
    if settings["output"] is not None:  # before the search, which may take minutes
        check_report_path(settings["output"])
    return settings


#: Flags every torchrun rank must pass alike (the table, the report and --json are rank 0's).
_AGREED_FLAGS = ("task", "config", "memory", "reserve", "backend", "fractions", "modes", "steps", "min_bs", "max_bs")


def run(args: argparse.Namespace) -> int:
    """``batchfit autobatch``: search, print the table (or JSON), write ``--output``; exit code.

    Under torchrun the command joins the ranks, checks they were given the same flags, and
    rank 0 alone prints and writes; the search's verdicts are agreed across ranks.
    """
    from batchfit.fileio import said_on_interrupt

    s = resolve(args)
    # Ctrl-C: the line says whether --output is the old file, untouched, or the new report, whole
    with said_on_interrupt(s["output"], "--output", "report"):
        return _run(args, s)


def _run(args: argparse.Namespace, s: dict[str, Any]) -> int:
    from batchfit.autobatch import report_rows, sweep, write_report
    from batchfit.cli._ranks import check_same_flags, process_group

    kwargs = dict(
        fractions=s["fractions"],
        modes=s["modes"],
        steps_per_trial=s["steps"],
        min_batch_size=s["min_bs"],
        max_batch_size=s["max_bs"],
        memory_limit=s["memory"],
        reserve_bytes=s["reserve"],
        backend=s["backend"],
    )
    with process_group("cuda" if backend_class(s["backend"]).reads_device else "cpu") as rank:
        # under torchrun: ranks agree on the flags or all say which differ (NOTE [ Ranks agree or say why ])
        check_same_flags(args, _AGREED_FLAGS, "autobatch")
        progress = args.progress and not args.json and rank == 0
        if progress and sys.stderr.isatty():  # no spinner residue in logs and pipes
            results = _with_progress(s["task"], kwargs)
        elif progress:  # a log or a pipe: one flushed line per trial
            results = sweep(s["task"], progress=_progress_line(s["task"]), **kwargs)
        else:
            results = sweep(s["task"], **kwargs)  # the verdicts are agreed across ranks (autobatch.batch_search)
    if rank != 0:
        return 0
    rows = report_rows(results)
    if s["output"] is not None:
        write_report(s["output"], rows)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_table(s, results, rows)
    return 0


def _progress_line(task: str) -> Any:
    """A progress callback writing one flushed line per trial on stderr (when it is not a terminal)."""

    def line(mode: str, fraction: float, trial: Trial) -> None:
        verdict = "fits" if trial.fits else "over"
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr full or closed
            sys.stderr.write(f"batchfit autobatch: {task}: {mode} @ {fraction:g}: batch {trial.batch_size} {verdict}\n")
            sys.stderr.flush()

    return line


def _with_progress(task: str, kwargs: dict[str, Any]) -> list[Any]:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn

    from batchfit.autobatch import sweep

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=console, transient=True) as bar:
        line = bar.add_task(f"autobatch {task}: building the model", total=None)

        def update(mode: str, fraction: float, trial: Trial) -> None:
            verdict = "fits" if trial.fits else "over"
            bar.update(
                line,
                description=f"autobatch {task}: {mode} @ {fraction:g}: batch {trial.batch_size} {verdict}",
            )

        return sweep(task, progress=update, **kwargs)


def _print_table(settings: dict[str, Any], results: list[Any], rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from batchfit.cli.console import stdout_console
    from batchfit.memory import format_bytes

    first = results[0]
    target = (
        f" → {settings['memory']} (default target without a GPU; set --memory)"
        if settings["memory_defaulted"]
        else ""
    )
    table = Table(
        title=f"autobatch {settings['task']} — backend {first.backend}{target}, usable memory {format_bytes(first.limit_bytes)}",
        title_justify="left",
    )
    for name in ("mode", "fraction", "batch size", "peak", "target", "peak / usable", "trials"):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for r in rows:
        share = "?" if r["peak_bytes"] is None else f"{r['peak_bytes'] / r['limit_bytes']:.1%}"
        table.add_row(
            r["mode"],
            f"{r['memory_fraction']:g}",
            f"{r['batch_size']:,}" + (" (capped)" if r["capped_by_max_batch_size"] else ""),
            format_bytes(r["peak_bytes"]),
            format_bytes(r["target_bytes"]),
            share,
            f"{r['trials']} (≤ {r['max_trials']})",
        )
    console = stdout_console(table)
    console.print(table)
    if any(r["capped_by_max_batch_size"] for r in rows):
        console.print(
            f"(capped): --max-bs {first.max_batch_size:,} itself fits, so the search stopped there; "
            "a larger batch may fit too: raise --max-bs to find the largest.",
            soft_wrap=True,
        )
    if settings["output"] is not None:
        console.print(f"wrote {len(rows)} rows to {settings['output']}")
