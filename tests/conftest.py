"""Shared fixtures, and the one timeout setting every test's limits derive from (multirank.scaled)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from multirank import TIMEOUT_SCALE_ENV, scaled, timeout_scale


def _load_scale() -> float:
    """The machine's load per core (1-minute average), at least 1: how much slower than unloaded it runs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, round(load / cores, 1))


def pytest_configure(config: pytest.Config) -> None:
    # once per session, before anything spawns: children and subprocesses inherit the same factor
    if not os.environ.get(TIMEOUT_SCALE_ENV, "").strip():
        os.environ[TIMEOUT_SCALE_ENV] = str(_load_scale())
    timeout_scale()  # a bad value stops the session here, with its name
    # One intra-op thread for the session, and for spawned ranks and subprocesses (they read
    # OMP_NUM_THREADS): the tests' models are tiny, and two threads on a shared 2-core machine
    # only contend -- a tiny profile took twice the CPU time with two.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_report_header(config: pytest.Config) -> str:
    return f"timeouts: x{timeout_scale():g} ({TIMEOUT_SCALE_ENV}; the machine's load per core when unset)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Scale pytest-timeout's limits: each ``@pytest.mark.timeout(s)`` and the ini ``timeout`` for the rest.

    A ``--timeout`` on the command line is taken as given for tests without a marker.
    """
    if not config.pluginmanager.hasplugin("timeout"):
        return
    base = float(config.getini("timeout") or 0)
    explicit = config.getoption("timeout", None) is not None
    for item in items:
        marker = item.get_closest_marker("timeout")
        if marker is not None:
            kwargs = dict(marker.kwargs)
            seconds = marker.args[0] if marker.args else kwargs.pop("timeout", None)
            if seconds is None or float(seconds) <= 0:
                continue
            item.add_marker(
                pytest.mark.timeout(scaled(float(seconds)), *marker.args[1:], **kwargs), append=False
            )
        elif base > 0 and not explicit:
            item.add_marker(pytest.mark.timeout(scaled(base)), append=False)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: tiny models on a shared 2-core machine only contend (45x slower measured).

    The session runs on one thread already (pytest_configure); this keeps a module on one if that changes.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class HostMemory:
    """This process's resident memory in bytes, from ``/proc/self`` (Linux).

    Unlike ``ru_maxrss`` (a lifetime high-water mark) the peak can be reset, and unlike page
    fault counts the bytes do not depend on the page size (transparent huge pages).
    """

    @staticmethod
    def _status(field: str) -> int:
        text = Path("/proc/self/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", text, flags=re.MULTILINE).group(1)) * 1024

    def current(self) -> int:
        """Resident bytes now (VmRSS)."""
        return self._status("VmRSS")

    def reset_peak(self) -> int:
        """Set the peak to the resident bytes now (``clear_refs`` 5); returns them."""
        Path("/proc/self/clear_refs").write_text("5")
        return self.current()

    def peak(self) -> int:
        """The most resident bytes since :meth:`reset_peak` (VmHWM)."""
        return self._status("VmHWM")


@pytest.fixture
def host_memory() -> HostMemory:
    """:class:`HostMemory`; skips where ``/proc/self/clear_refs`` cannot reset the peak (not Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as exc:
        pytest.skip(f"the resident-memory peak cannot be reset here: {exc}")
    return HostMemory()
