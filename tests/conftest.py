"""Shared fixtures, and the one timeout setting every test's limits derive from (multirank.scaled)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from multirank import TIMEOUT_SCALE_ENV, scaled, timeout_scale


def pytest_configure(config: pytest.Config) -> None:
    timeout_scale()  # a bad BATCHFIT_TEST_TIMEOUT_SCALE stops the session here, with its name
    # One intra-op thread for the session, and for spawned ranks and subprocesses (they read
    # OMP_NUM_THREADS): the tests' models are tiny, and two threads on a shared 2-core machine
    # only contend -- a tiny profile took twice the CPU time with two.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # Every test (and its subprocesses) measures: a profile answered from the user's cache would
    # test the cache, not the code (tests/test_profile_cache.py turns it on in a folder of its own).
    os.environ["BATCHFIT_CACHE"] = "0"
    # The suite's workers already fill the machine's CPUs: a profile measures its shallow copies in
    # process (tests/test_side_by_side.py opens side_by_side(2) itself and holds the two equal).
    os.environ["BATCHFIT_JOBS"] = "1"


def pytest_report_header(config: pytest.Config) -> str:
    how = "given" if os.environ.get(TIMEOUT_SCALE_ENV, "").strip() else "twice the load per core, read at each test's start"
    return f"timeouts: x{timeout_scale():g} now ({TIMEOUT_SCALE_ENV}: {how})"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Scale pytest-timeout's limit of ``item`` as it starts (before pytest-timeout reads it): its
    ``@pytest.mark.timeout(s)``, or the ini ``timeout``; a ``--timeout`` on the command line is taken
    as given for tests without a marker.
    """
    config = item.config
    if config.pluginmanager.hasplugin("timeout"):
        base = float(config.getini("timeout") or 0)
        explicit = config.getoption("timeout", None) is not None
        marker = item.get_closest_marker("timeout")
        original = item.stash.setdefault(_BASE_TIMEOUT, marker)
        if original is not None:
            kwargs = dict(original.kwargs)
            seconds = original.args[0] if original.args else kwargs.pop("timeout", None)
            if seconds is not None and float(seconds) > 0:
                item.add_marker(pytest.mark.timeout(scaled(float(seconds)), *original.args[1:], **kwargs), append=False)
        elif base > 0 and not explicit:
            item.add_marker(pytest.mark.timeout(scaled(base)), append=False)
    yield


_BASE_TIMEOUT = pytest.StashKey()


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


@pytest.fixture
def megatron():
    """Skips a test where megatron-core or mbridge is not installed (the first tier installs neither)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
