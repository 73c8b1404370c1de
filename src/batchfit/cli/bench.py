"""``batchfit bench``: benchmarks; ``batchfit bench logprobs`` times and sizes the log-prob paths.

The numbers come from :func:`batchfit.train.logprobs_bench.run_logprobs_bench`; this module only parses,
shows progress on stderr (a spinner on a terminal, one line per step otherwise) and renders a
rich table (or ``--json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from batchfit.dtypes import DTYPES
from batchfit.memory import BACKEND_NAMES, backend_class, backend_name
from batchfit.memory.sizes import MiB
from batchfit.train.logprobs_bench import METHODS, STARTS, LogprobsBench, run_logprobs_bench

# Default grids: what the CPU runs in about a minute, and what the estimate backend is for.
DEFAULT_GRID = {
    "cpu": ([32768], [1024, 4096], [None, 1024]),
    "cuda": ([32768, 131072], [8192, 32768], [None, 1024, 4096]),
    "estimate": ([32768, 131072], [8192, 32768, 131072], [None, 1024, 4096]),
}


def _chunk(text: str) -> int | None:
    if text.lower() in ("none", "off"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"chunk size must be a positive integer or 'none', but got {text!r}"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"chunk size must be a positive integer or 'none', but got {text!r}")
    return value


MAX_RUNS = 1000
"""Most timed (``--repeats``) or untimed (``--warmup``) runs per case: a best-of-1000 is already exact."""

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its sub-subcommand ``logprobs``."""
    p = sub.add_parser("bench", help="benchmarks (logprobs: time and peak memory of log-prob paths)")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=type(p))
    p.set_defaults(func=lambda args: _missing_benchmark(p))

    lp = bench_sub.add_parser(
        "logprobs",
        help="naive vs chunked-from-logits vs fused-from-hidden log-probs: time, peak MiB, savings",
        description=(
            "Forward+backward of logp.sum() + entropy.sum() per method over a grid of vocab sizes, "
            "sequence lengths and chunk sizes. cpu: real run, live-storage tracker, best-of-N time; "
            "estimate: FakeTensorMode + the same tracker (any size, no time); cuda: torch.cuda stats."
        ),
    )
    lp.add_argument("--vocab", type=int, nargs="+", help="vocabulary sizes (default depends on --backend)")
    lp.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default depends on --backend)")
    lp.add_argument(
        "--chunk", type=_chunk, nargs="+", metavar="N|none", help="chunk sizes, 'none' = unchunked"
    )
    lp.add_argument("--method", nargs="+", choices=METHODS, default=list(METHODS))
    lp.add_argument(
        "--backend", choices=BACKEND_NAMES, default="cpu", help="cpu (default), estimate, cuda, or auto"
    )
    lp.add_argument("--batch", type=int, default=1)
    lp.add_argument("--hidden", type=int, default=256, help="hidden size of the inputs (default 256)")
    lp.add_argument(
        "--dtype", choices=tuple(DTYPES), help="input dtype (default float32 on cpu, bfloat16 otherwise)"
    )
    lp.add_argument(
        "--start", choices=STARTS, default="hidden", help="inputs: hidden states + weight, or a logits leaf"
    )
    lp.add_argument("--no-entropy", action="store_true", help="log-probs only")
    lp.add_argument("--temperature", type=float, default=1.0)
    lp.add_argument("--repeats", type=int, default=3, help="timed runs per case (best is reported)")
    lp.add_argument("--warmup", type=int, default=1)
    lp.add_argument("--seed", type=int, default=0)
    lp.add_argument("--json", action="store_true", help="print the result as JSON")
    lp.add_argument("--no-progress", dest="progress", action="store_false", help="no progress on stderr")
    lp.set_defaults(func=run_logprobs)


def _missing_benchmark(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    sys.stderr.write("batchfit bench: error: name a benchmark (logprobs); see batchfit bench --help\n")
    return 2


def run_logprobs(args: argparse.Namespace) -> int:
    """Run the log-prob benchmark from parsed arguments; render a table or JSON on stdout.

    Progress goes to stderr unless ``--no-progress``: a spinner on a terminal, else one line per
    step, so a piped or logged run shows what it is doing during minutes of measuring.
    """
    from batchfit.validation import check_int

    # runs per case and the seed are bounded here: 10**20 repeats never end, torch refuses a seed past 64 bits
    check_int("--repeats", args.repeats, minimum=1, maximum=MAX_RUNS)
    check_int("--warmup", args.warmup, minimum=0, maximum=MAX_RUNS)
    check_int("--seed", args.seed, minimum=-(2**63), maximum=2**64 - 1)  # what torch.manual_seed takes
    backend = backend_name(args.backend)
    vocabs, seqs, chunks = DEFAULT_GRID[backend]
    chunks = args.chunk if args.chunk is not None else chunks
    dtype = args.dtype or ("float32" if backend_class(backend).host_memory else "bfloat16")
    stop, say = _progress() if args.progress else (None, None)
    try:
        result = run_logprobs_bench(
            args.vocab or vocabs,
            args.seq or seqs,
            chunks,
            methods=args.method,
            backend=backend,
            batch=args.batch,
            hidden=args.hidden,
            dtype=dtype,
            start=args.start,
            entropy=not args.no_entropy,
            temperature=args.temperature,
            repeats=args.repeats,
            warmup=args.warmup,
            seed=args.seed,
            on_progress=say,
        )
    finally:
        if stop is not None:
            stop()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render_logprobs(result)
    return 0


def _progress() -> tuple[Callable[[], None], Callable[[str], None]]:
    """``(stop, say)``: a transient spinner on a terminal's stderr, else a line on stderr per call."""
    if not sys.stderr.isatty():

        def line(text: str) -> None:
            sys.stderr.write(f"bench logprobs: {text}\n")
            sys.stderr.flush()

        return (lambda: None), line

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn

    prog = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), console=Console(stderr=True), transient=True
    )
    task = prog.add_task("bench logprobs: starting", total=None)
    prog.start()
    return prog.stop, lambda text: prog.update(task, description=f"bench logprobs: {text}")


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def render_logprobs(result: LogprobsBench, console: Any = None) -> None:
    """Print ``result`` as a rich table (one row per case) with the settings in the title.

    Without ``console``, stdout; when stdout is not a terminal (piped, redirected) the console is
    as wide as the table, so no column is cut to fit 80 columns.
    """
    from rich.table import Table

    from batchfit.cli.console import stdout_console
    from batchfit.memory import format_bytes

    title = (
        f"log-probs forward+backward · backend={result.backend} · dtype={result.dtype} · "
        f"batch={result.batch} · start={result.start}"
        + (f" · hidden={result.hidden}" if result.start == "hidden" else "")
        + (" · with entropy" if result.entropy else "")
        + (f" · T={result.temperature:g}" if result.temperature != 1.0 else "")
    )
    table = Table(title=title)
    names = ("vocab", "seq", "method", "chunk", "time ms", "speed vs no-chunk", "peak MiB", "extra MiB")
    for name in (*names, "saved vs naive"):
        table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for r in result.rows:
        table.add_row(
            f"{r.vocab:,}",
            f"{r.seq:,}",
            r.method,
            "none" if r.chunk_size is None else f"{r.chunk_size:,}",
            "OOM" if r.oom else _fmt(r.time_ms, ",.0f"),
            _fmt(r.speedup_vs_nochunk, ".2f", "×"),
            "OOM" if r.oom else _fmt(None if r.peak_bytes is None else r.peak_bytes / MiB, ",.0f"),
            _fmt(None if r.extra_bytes is None else r.extra_bytes / MiB, ",.0f"),
            _fmt(r.memory_saved_vs_naive, ".1f", "×"),
        )
    notes = [
        "time: best of repeats; extra = peak − inputs − their gradients; speed vs no-chunk = "
        "time(chunk none) / time (> 1 faster); saved vs naive = naive extra / extra."
    ]
    if any(r.oom for r in result.rows):
        where = "the host's available memory" if backend_class(result.backend).host_memory else "the device"
        notes.append(
            f"OOM: the case needs more than {where} ({format_bytes(result.limit_bytes)}); "
            "--backend estimate sizes it without allocating."
        )
    if console is None:
        console = stdout_console(table)
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True)
