"""How long ``batchfit profile`` takes, today's code against a base commit's, side by side in one run.

The base commit is checked out in a temporary git worktree and run with ``PYTHONPATH`` at its
``src``; the working tree runs with its own. Each command runs ``--repeat`` times per side,
interleaved (base, new, base, new, …), so both see the same machine and the same load. Per
command it prints the median wall time of each side, the ratio new / base, the median CPU
seconds (user + sys, less sensitive to other processes on a shared machine) and whether the
budgets are the same to the token (every ``tokens`` and ``response_tokens`` in ``--json``) and
the whole ``--json`` output byte for byte. Both sides read the working tree's example files.

The new side runs twice over: ``new`` with an empty profile cache each run (a first run: what
the bar compares), and ``warm``, the same command again after one untimed run filled a cache
(a re-run after a change of config that leaves the profiles alone: NOTE [ A profile is a
function of its inputs ] in ``batchfit.budget.profile_cache``). The base never reads a cache.

    python benchmarks/speed.py                          # base: the merge-base with the upstream, else HEAD
    python benchmarks/speed.py --back 3 --repeat 5      # base: HEAD~3
    python benchmarks/speed.py --base d033994 --long-context --moe
    python benchmarks/speed.py --commands main --repeat 1 --json-out /tmp/speed.json

Rows: ``main`` (``batchfit profile``: qwen2.5-7b at 8192, fsdp2 over 8 × H100), ``verl``
(``--config examples/verl_grpo.yaml --emit verl``); ``--long-context`` adds qwen2.5-7b at
131,072 tokens, packed, verl's head, activation offload (docs/long_context.md's 128k row), and
``--moe`` qwen3-30b-a3b at 8192 over 16 ranks (docs/moe.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("--no-progress", "--json")

COMMANDS: dict[str, tuple[str, ...]] = {
    "main": ("profile",),
    "verl": ("profile", "--config", str(ROOT / "examples" / "verl_grpo.yaml"), "--emit", "verl"),
}
LONG_CONTEXT = (
    "profile", "--model", "qwen2.5-7b", "--max-seq-len", "131072", "--cost", "packed", "--logprobs", "verl",
    "--activation-offload",
)  # fmt: skip
MOE = ("profile", "--model", "qwen3-30b-a3b", "--max-seq-len", "8192", "--world-size", "16")


@dataclass
class Run:
    """One command run once on one side."""

    side: str
    seconds: float
    cpu_seconds: float
    returncode: int
    output: str
    error: str


@dataclass
class Row:
    """One command's runs on both sides, and what they agree on."""

    name: str
    argv: tuple[str, ...]
    runs: list[Run] = field(default_factory=list)

    def seconds(self, side: str) -> list[float]:
        return [r.seconds for r in self.runs if r.side == side]

    def median(self, side: str, cpu: bool = False) -> float | None:
        values = [r.cpu_seconds if cpu else r.seconds for r in self.runs if r.side == side and r.returncode == 0]
        return statistics.median(values) if values else None

    def ratio(self, cpu: bool = False, side: str = "new") -> float | None:
        base, new = self.median("base", cpu), self.median(side, cpu)
        return None if not base or new is None else new / base

    def outputs(self, side: str) -> list[str]:
        return [r.output for r in self.runs if r.side == side and r.returncode == 0]

    @property
    def failed(self) -> list[Run]:
        return [r for r in self.runs if r.returncode != 0]

    @property
    def same_json(self) -> bool | None:
        every = self.outputs("base") + self.outputs("new") + self.outputs("warm")
        if not self.outputs("base") or not self.outputs("new"):
            return None
        return all(_canonical(o) == _canonical(every[0]) for o in every)

    @property
    def same_budgets(self) -> bool | None:
        base, new = self.outputs("base"), self.outputs("new") + self.outputs("warm")
        if not base or not new:
            return None
        first = budgets_of(json.loads(base[0]))
        return all(budgets_of(json.loads(o)) == first for o in base + new)


def budgets_of(report: Any, path: str = "") -> dict[str, Any]:
    """Every ``tokens``, ``response_tokens`` and ``tokens_per_gpu`` in a ``--json`` report, by its path (the budgets)."""
    found: dict[str, Any] = {}
    if isinstance(report, dict):
        for key, value in report.items():
            here = f"{path}.{key}"
            if key in ("tokens", "response_tokens", "tokens_per_gpu") and not isinstance(value, (dict, list)):
                found[here] = value
            elif key != "trials":  # a probe's tokens are how the search went, not a budget
                found.update(budgets_of(value, here))
    elif isinstance(report, list):
        for i, value in enumerate(report):
            found.update(budgets_of(value, f"{path}[{i}]"))
    return found


def _canonical(output: str) -> str:
    try:
        return json.dumps(json.loads(output), sort_keys=True)
    except ValueError:
        return output


def resolve_base(base: str | None, back: int | None) -> str:
    """The base commit: ``base``; else ``HEAD~back``; else the merge-base of HEAD with its upstream; else HEAD."""
    if base is not None:
        return _git("rev-parse", "--verify", f"{base}^{{commit}}")
    if back is not None:
        return _git("rev-parse", "--verify", f"HEAD~{back}^{{commit}}")
    try:
        return _git("merge-base", "HEAD", "@{upstream}")
    except subprocess.CalledProcessError:
        return _git("rev-parse", "HEAD")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return out.stdout.strip()


class Worktree:
    """The base commit checked out apart (``git worktree add --detach``), removed on exit unless kept."""

    def __init__(self, commit: str, keep: bool = False):
        self.commit, self.keep = commit, keep
        self.path = Path(tempfile.mkdtemp(prefix="batchfit-speed-base-"))

    def __enter__(self) -> Worktree:
        self.path.rmdir()
        _git("worktree", "add", "--detach", str(self.path), self.commit)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.keep:
            return
        try:
            _git("worktree", "remove", "--force", str(self.path))
        except subprocess.CalledProcessError:
            shutil.rmtree(self.path, ignore_errors=True)
            _git("worktree", "prune")


def run_once(side: str, src: Path, argv: Sequence[str], timeout: float, cache: Path | None = None) -> Run:
    """``python -m batchfit ARGV --no-progress --json`` with ``src`` first on ``PYTHONPATH``; wall and CPU seconds.

    ``cache``: the profile cache's folder (``BATCHFIT_CACHE_DIR``); ``None`` turns it off.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("BATCHFIT_CACHE", None)
    if cache is None:
        env["BATCHFIT_CACHE"] = "0"
    else:
        env["BATCHFIT_CACHE_DIR"] = str(cache)
    before = os.times()
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "batchfit", *argv, *FLAGS],
            cwd=src.parent, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = 124, "", f"timed out after {timeout:g} s: {exc}"
    seconds = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return Run(side, seconds, cpu, code, out, err[-2000:])


def interleaved(rows: Sequence[Row], sides: dict[str, Path], repeat: int, timeout: float, folder: Path) -> Iterator[Run]:
    """Run every row ``repeat`` times per side, base, new and warm alternating (the order turns each round).

    ``new`` gets an empty cache folder under ``folder`` each run; ``warm`` one folder per row,
    filled by an untimed run first.
    """
    for r, row in enumerate(rows):
        warm = folder / f"warm-{r}"
        run_once("warm", sides["new"], row.argv, timeout, warm)  # fills the cache
        sides_order = ["base", "new", "warm"]
        for i in range(repeat):
            order = sides_order[i % 3 :] + sides_order[: i % 3]
            for side in order:
                src = sides["base" if side == "base" else "new"]
                cache = None if side == "base" else warm if side == "warm" else folder / f"cold-{r}-{i}"
                run = run_once(side, src, row.argv, timeout, cache)
                row.runs.append(run)
                yield run


def _fmt(value: float | None, unit: str = " s") -> str:
    return "–" if value is None else f"{value:.2f}{unit}"


def _yes(value: bool | None) -> str:
    return "–" if value is None else ("yes" if value else "NO")


def render(rows: Sequence[Row], base: str, load: tuple[tuple[float, ...], tuple[float, ...]]) -> str:
    lines = [
        f"base {base[:12]} (worktree) vs the working tree at {ROOT}",
        f"load average before {', '.join(f'{x:.2f}' for x in load[0])}; after {', '.join(f'{x:.2f}' for x in load[1])}"
        f"; {os.cpu_count()} CPUs",
        "",
        f"{'command':<14}{'base wall':>11}{'new wall':>11}{'new/base':>10}{'base cpu':>11}{'new cpu':>11}"
        f"{'cpu ratio':>11}{'warm wall':>11}{'warm/base':>11}{'warm cpu':>10}{'cpu ratio':>11}{'budgets':>9}{'json':>6}",
    ]
    for row in rows:
        lines.append(
            f"{row.name:<14}{_fmt(row.median('base')):>11}{_fmt(row.median('new')):>11}"
            f"{_fmt(row.ratio(), '×'):>10}{_fmt(row.median('base', True)):>11}{_fmt(row.median('new', True)):>11}"
            f"{_fmt(row.ratio(cpu=True), '×'):>11}{_fmt(row.median('warm')):>11}{_fmt(row.ratio(side='warm'), '×'):>11}"
            f"{_fmt(row.median('warm', True)):>10}{_fmt(row.ratio(cpu=True, side='warm'), '×'):>11}"
            f"{_yes(row.same_budgets):>9}{_yes(row.same_json):>6}"
        )
    for row in rows:
        for run in row.failed:
            lines.append(f"{row.name} ({run.side}) exited {run.returncode}: {run.error.strip().splitlines()[-1:]}")
    lines.append("")
    lines.append("walls per run: " + "; ".join(
        f"{r.name} base {', '.join(f'{s:.1f}' for s in r.seconds('base'))} / new {', '.join(f'{s:.1f}' for s in r.seconds('new'))}"
        f" / warm {', '.join(f'{s:.1f}' for s in r.seconds('warm'))}"
        for r in rows
    ))  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", metavar="REV", help="the base commit (default: the merge-base with the upstream, else HEAD)")
    parser.add_argument("--back", metavar="N", type=int, help="the base is HEAD~N")
    parser.add_argument("--repeat", metavar="K", type=int, default=3, help="runs per command per side (default 3)")
    parser.add_argument("--commands", default="main,verl", help=f"rows, comma-separated, of {', '.join(COMMANDS)}")
    parser.add_argument("--long-context", action="store_true", help="add qwen2.5-7b at 131,072 tokens (packed, offload)")
    parser.add_argument("--moe", action="store_true", help="add qwen3-30b-a3b at 8192 over 16 ranks")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run (default 1800)")
    parser.add_argument("--keep", action="store_true", help="keep the base worktree")
    parser.add_argument("--json-out", metavar="FILE", help="also write every run's figures as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, but got --repeat {args.repeat}")
    names = [n.strip() for n in args.commands.split(",") if n.strip()]
    unknown = [n for n in names if n not in COMMANDS]
    if unknown:
        parser.error(f"--commands names {unknown[0]!r}, which is none of {', '.join(COMMANDS)}")
    rows = [Row(n, COMMANDS[n]) for n in names]
    if args.long_context:
        rows.append(Row("long-context", LONG_CONTEXT))
    if args.moe:
        rows.append(Row("moe", MOE))
    base = resolve_base(args.base, args.back)
    load_before = os.getloadavg()
    with Worktree(base, keep=args.keep) as tree, tempfile.TemporaryDirectory(prefix="batchfit-speed-cache-") as folder:
        sides = {"base": tree.path / "src", "new": ROOT / "src"}
        for run in interleaved(rows, sides, args.repeat, args.timeout, Path(folder)):
            print(f"  {run.side:<4} {run.seconds:7.1f} s (exit {run.returncode})", file=sys.stderr, flush=True)
    load = (load_before, os.getloadavg())
    print(render(rows, base, load))
    if args.json_out:
        figures = {
            "base": base,
            "load": load,
            "rows": [
                {
                    "name": r.name, "argv": list(r.argv), "same_budgets": r.same_budgets, "same_json": r.same_json,
                    "median": {s: r.median(s) for s in ("base", "new", "warm")}, "ratio": r.ratio(),
                    "warm_ratio": r.ratio(side="warm"),
                    "cpu_median": {s: r.median(s, True) for s in ("base", "new", "warm")}, "cpu_ratio": r.ratio(cpu=True),
                    "warm_cpu_ratio": r.ratio(cpu=True, side="warm"),
                    "runs": [{k: v for k, v in asdict(x).items() if k != "output"} for x in r.runs],
                }
                for r in rows
            ],
        }  # fmt: skip
        Path(args.json_out).write_text(json.dumps(figures, indent=1))
    return 0 if all(r.same_budgets is not False for r in rows) and not any(r.failed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
