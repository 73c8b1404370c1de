"""Report rows of batch-size searches and writing them as JSON Lines or CSV."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from batchfit.autobatch.batch_search import BatchSizeResult
from batchfit.errors import InvalidArgument

REPORT_FIELDS = (
    "mode",
    "memory_fraction",
    "batch_size",
    "max_batch_size",
    "capped_by_max_batch_size",
    "peak_bytes",
    "target_bytes",
    "limit_bytes",
    "trials",
    "max_trials",
    "backend",
    "world_size",
    "trial_log",
)
FORMATS = {".jsonl": "jsonl", ".csv": "csv"}


def report_rows(results: Iterable[BatchSizeResult]) -> list[dict[str, Any]]:
    """One row per result (:meth:`BatchSizeResult.to_row`), keys in :data:`REPORT_FIELDS` order."""
    return [{k: r.to_row()[k] for k in REPORT_FIELDS} for r in results]


def report_format(path: str | Path) -> str:
    """``"jsonl"`` or ``"csv"``, from the extension of ``path``.

    Raises:
        InvalidArgument: any other extension.
    """
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise InvalidArgument(
            f"output must end in .jsonl or .csv (the format follows the extension), but got output={str(path)!r}"
        )
    return FORMATS[suffix]


def check_report_path(path: str | Path) -> str:
    """Check, before any search, that a report can be written to ``path``; returns its format.

    Raises:
        InvalidArgument: an extension other than ``.jsonl``/``.csv``, a directory, a folder that
            does not exist, or a file or folder this process may not write (each names ``output``).
    """
    fmt = report_format(path)
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise InvalidArgument(f"output must be a file, but got output={str(path)!r}, a directory; name a .jsonl or .csv file")
    if not folder.is_dir():
        raise InvalidArgument(
            f"output must be in an existing folder, but got output={str(path)!r} and {str(folder)!r} does not exist; create it or name another path"
        )
    # the report is written beside the target and moved over it (NOTE [ Writes replace, never truncate ])
    writable = os.access(folder, os.W_OK | os.X_OK) and (not target.exists() or os.access(target, os.W_OK))
    if not writable:
        raise InvalidArgument(
            f"output cannot be written: output={str(path)!r} is not writable by this process; name another path"
        )
    return fmt


def trial_log_text(trial_log: Sequence[dict[str, Any]]) -> str:
    """The CSV form of a trial log: ``batch_size:peak_bytes:fit|over`` per trial, space-separated.

    An aborted run's peak (a lower bound) is written with a ``>=`` prefix.

    Example:
        >>> trial_log_text([{"batch_size": 1, "peak_bytes": 10, "fits": True, "exact": True},
        ...                 {"batch_size": 9, "peak_bytes": 99, "fits": False, "exact": False}])
        '1:10:fit 9:>=99:over'
    """
    parts = []
    for t in trial_log:
        peak = "?" if t["peak_bytes"] is None else f"{'' if t.get('exact', True) else '>='}{t['peak_bytes']}"
        parts.append(f"{t['batch_size']}:{peak}:{'fit' if t['fits'] else 'over'}")
    return " ".join(parts)


def write_report(path: str | Path, rows: Sequence[dict[str, Any]]) -> str:
    """Write ``rows`` to ``path`` as JSON Lines (``.jsonl``) or CSV (``.csv``); returns the format.

    JSON Lines keep ``trial_log`` as a list of trials; CSV writes it with :func:`trial_log_text`.
    Both have the columns of :data:`REPORT_FIELDS`.

    The rows go to a temporary file beside ``path`` that replaces it only once written whole:
    a write that fails (disk full, file-size limit) leaves an existing report unchanged.

    Raises:
        InvalidArgument: unknown extension, or the file cannot be written (names ``output`` and
            the reason; :func:`check_report_path` finds most of these before a search).
    """
    from batchfit.fileio import replacing

    fmt = report_format(path)
    try:  # NOTE [ Writes replace, never truncate ]: a failed write leaves the old report as it was
        with replacing(path) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
            if fmt == "jsonl":
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            else:
                writer = csv.DictWriter(f, fieldnames=list(REPORT_FIELDS))
                writer.writeheader()
                for row in rows:
                    writer.writerow({**row, "trial_log": trial_log_text(row["trial_log"])})
    except OSError as exc:
        raise InvalidArgument(
            f"output cannot be written: output={str(path)!r} ({exc.strerror or exc}); name another path "
            "(a file there before is unchanged)"
        ) from None
    return fmt
