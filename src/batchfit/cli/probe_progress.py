"""``batchfit profile``'s progress while probing: a rich bar on a terminal, else a line per event on stderr."""

from __future__ import annotations

import contextlib
import sys
from typing import Any


class ProbeProgress:
    """Progress fed by :class:`~batchfit.budget.BudgetProgress` events: a rich bar on a terminal, else lines.

    When stderr is not a terminal (a log file, a CI job, a pipe) each probe and each finished
    length is one flushed line on stderr, the finished lengths with the time so far and, from
    the first finished length on, the time left for that role (elapsed per length × lengths
    left; lengths are probed longest first, so it errs long). A probe is said in tokens, as the
    sequences it holds (:meth:`~batchfit.budget.Probe.shape`: ``3×32,768 + 1,234 = 99,538
    tokens``), so packed probes of one length never read as the same batch; a finished length
    gives the largest probe measured to fit there.
    """

    def __init__(self, console: Any, enabled: bool):
        self.console, self.enabled = console, enabled
        self.bar: Any = None
        self.tasks: dict[Any, Any] = {}
        self.started: dict[Any, float] = {}
        self.last = 0.0
        self.largest: dict[tuple[Any, int], Any] = {}  # (role, seq_len) -> the largest probe that fitted

    def __enter__(self) -> Any:
        if not self.enabled:
            return False
        if not self.console.is_terminal:
            import time

            self.last = time.monotonic()
            return self.line
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),  # from the lengths done so far (longest first: it errs long)
            console=self.console,
            transient=True,
        )
        self.bar.__enter__()
        return self.update

    def line(self, event: Any) -> None:
        """One line per event on stderr, flushed (see the class docstring)."""
        import time

        role = event.role or "probing"
        now = time.monotonic()
        start = self.started.setdefault(role, self.last)  # a role starts when the one before it ended
        self.last = now
        if event.probe is not None:
            text = f"{role}: probe {event.probes}: {self._probe_text(event)}"
        else:
            done = event.length_index + 1
            total = max(event.n_lengths, done)
            elapsed = now - start
            left = elapsed / done * (total - done)
            largest = self.largest.get((event.role, event.seq_len))
            if largest is not None:
                best = f", largest fitting {largest.shape()}"
            else:
                best = "" if event.max_batch_size is None else f", largest batch {event.max_batch_size:,}"
            eta = f", about {duration(left)} left" if total > done else ""
            text = f"{role}: length {done}/{total} done (s={event.seq_len:,}{best}); {duration(elapsed)} so far{eta}"
        with contextlib.suppress(OSError, ValueError, AttributeError):  # stderr full or closed
            sys.stderr.write(f"batchfit profile: {text}\n")
            sys.stderr.flush()

    def _probe_text(self, event: Any) -> str:
        """``3×32,768 + 1,234 = 99,538 tokens does not fit``; remembers the largest probe that fitted at its length."""
        p = event.probe
        if p.fits:
            key = (event.role, p.seq_len)
            if key not in self.largest or p.total_tokens > self.largest[key].total_tokens:
                self.largest[key] = p
        return f"{p.shape()} {'fits' if p.fits else 'does not fit'}"

    def update(self, event: Any) -> None:
        key = event.role
        if key not in self.tasks:
            self.tasks[key] = self.bar.add_task(f"{key or 'probing'}", total=event.n_lengths)
        task = self.tasks[key]
        if event.probe is not None:
            self.bar.update(task, description=f"{key or 'probing'}: {self._probe_text(event)}")
        else:
            self.bar.update(
                task, total=max(event.n_lengths, event.length_index + 1), completed=event.length_index + 1
            )

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)


def duration(seconds: float) -> str:
    """``"42 s"``, ``"3 min 5 s"``."""
    seconds = max(0, round(seconds))
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"
