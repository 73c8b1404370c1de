"""The stdout console of the commands that print tables: never narrower than its tables when piped."""

from __future__ import annotations

from typing import Any


def stdout_console(*renderables: Any) -> Any:
    """A rich ``Console`` on stdout; when stdout is not a terminal, as wide as ``renderables`` need.

    rich gives a piped console 80 columns, which folds or cuts a wide table; a file or a pipe has
    no width, so the console takes the widest renderable's natural width (at least 80).
    """
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console.width = 1_000_000  # measure without a cap
        widest = max((console.measure(r).maximum for r in renderables), default=80)
        console.width = max(80, widest)
    return console
