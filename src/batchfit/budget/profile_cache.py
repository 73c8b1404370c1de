"""Profiles answered again from disk: the same inputs under the same code give the same budgets.

NOTE [ A profile is a function of its inputs ]
On the estimate backend a profile runs fake tensors over a simulated world: no device, no
clock, no randomness that is not seeded. Its answer is a function of what
:func:`~batchfit.budget.model_profile.profile_model` is given (the model's config, the
options, the roles, the resident bytes, the engine), of batchfit's own code and of the
versions of the libraries whose modules it runs (torch, transformers, megatron-core). A
user runs ``batchfit profile`` before every run and after every change of config, and
most changes (batch sizes, epochs, learning rates) leave all of those alone: the answer is
the one already measured. So a profile is kept, pickled, under a digest of all of it:

- every input as plain data (:func:`plain`: dataclasses, enums, configs by their
  ``to_dict``; an input it cannot write out, such as a live ``nn.Module`` or a callable,
  makes the call uncached rather than keyed by something that does not identify it);
- a digest of every file of the installed ``batchfit`` package (an edit anywhere is a new
  key: no version number to forget to bump), and the versions of Python, torch,
  transformers and megatron-core;
- the ``BATCHFIT_*`` environment (but this cache's own variables).

Only the estimate backend is kept (cpu and cuda measure a device, whose answer is the
point of running them), never inside a real process group (ranks that disagree on a hit
would deadlock in the search's collectives), and only answers: a does-not-fit error is
measured again. A file that cannot be read back is a miss and is removed; writes go to a
temporary file renamed into place, so a reader never sees half a file.

The command line turns it on (``batchfit profile``; ``--no-cache`` or ``BATCHFIT_CACHE=0``
turn it off; ``BATCHFIT_CACHE_DIR`` moves it from ``$XDG_CACHE_HOME/batchfit/profiles``);
the Python API only inside :func:`caching`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import math
import os
import pickle
import platform
import sys
import tempfile
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["CACHE_DIR_ENV", "CACHE_ENV", "ProfileCache", "active", "caching", "default_directory", "plain"]

#: Where the profiles are kept (default ``$XDG_CACHE_HOME/batchfit/profiles``, else ``~/.cache/batchfit/profiles``).
CACHE_DIR_ENV = "BATCHFIT_CACHE_DIR"
#: ``0``, ``off``, ``false`` or ``no`` turns the cache off wherever it would be on.
CACHE_ENV = "BATCHFIT_CACHE"
#: The most profiles kept; the least recently written go first.
MAX_ENTRIES = 512
_FORMAT = 1  # bump when what a file holds changes shape


class Uncacheable(Exception):
    """An input :func:`plain` cannot write out as data: the call is not cached."""


def plain(obj: Any) -> Any:
    """``obj`` as JSON-able data that identifies it: equal data for equal inputs, and no two inputs alike.

    Raises:
        Uncacheable: ``obj`` holds something that is not data (a module, a callable, an
            object without a plain form).
    """
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return repr(obj) if not math.isfinite(obj) else obj
    if isinstance(obj, enum.Enum):
        return {"enum": type(obj).__qualname__, "name": obj.name}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "progress"}
        return {"dataclass": f"{type(obj).__module__}.{type(obj).__qualname__}", "fields": fields}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [plain(v) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"set": sorted((plain(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(obj, Mapping):
        items = [[plain(k), plain(v)] for k, v in obj.items()]
        return {"mapping": sorted(items, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if isinstance(obj, Path):
        return {"path": str(obj.resolve())}
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict) and type(obj).__name__.endswith("Config"):  # a transformers config
        return {"config": f"{type(obj).__module__}.{type(obj).__qualname__}", "fields": plain(to_dict())}
    if type(obj).__name__ == "Vocabulary" and type(obj).__module__ == "batchfit.errors":  # how messages name settings
        return {"vocabulary": plain(obj.flags)}
    if type(obj).__module__ == "torch" and type(obj).__name__ == "dtype":
        return {"dtype": str(obj)}
    raise Uncacheable(type(obj).__qualname__)


def default_directory() -> Path:
    """``$BATCHFIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/batchfit/profiles``, else ``~/.cache/batchfit/profiles``."""
    given = os.environ.get(CACHE_DIR_ENV, "").strip()
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "batchfit" / "profiles"


def turned_off() -> bool:
    """``$BATCHFIT_CACHE`` says off."""
    return os.environ.get(CACHE_ENV, "").strip().lower() in ("0", "off", "false", "no")


_CODE_DIGEST: str | None = None


def code_digest() -> str:
    """A digest of every file of the installed ``batchfit`` package (read once per process)."""
    global _CODE_DIGEST
    if _CODE_DIGEST is None:
        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
        _CODE_DIGEST = h.hexdigest()
    return _CODE_DIGEST


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "implementation": sys.implementation.name}
    for name in ("torch", "transformers", "megatron-core", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


class ProfileCache:
    """Profiles kept in ``directory``, one pickled file per key (NOTE [ A profile is a function of its inputs ]).

    Attributes:
        directory: where the files are.
        hits: the keys answered from disk in this process.
        misses: the keys measured (and written) in this process.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        self.directory = Path(directory)
        self.hits: list[str] = []
        self.misses: list[str] = []

    def key(self, inputs: Mapping[str, Any]) -> str | None:
        """The digest of ``inputs`` (the call's arguments, by name) under this code and these libraries; ``None``: uncached."""
        try:
            data = plain(dict(inputs))
        except Uncacheable:
            return None
        environment = {k: v for k, v in os.environ.items() if k.startswith("BATCHFIT_") and k not in (CACHE_ENV, CACHE_DIR_ENV)}
        document = {"format": _FORMAT, "code": code_digest(), "versions": _versions(), "env": environment, "inputs": data}
        return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.pickle"

    def get(self, key: str) -> Any | None:
        """The profile kept under ``key``, or ``None`` (never kept, or unreadable: then removed)."""
        path = self._path(key)
        try:
            with path.open("rb") as f:
                kept = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception:  # a file cut short, or from code that no longer unpickles: measure again
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        if not (isinstance(kept, tuple) and len(kept) == 2 and kept[0] == key):
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.hits.append(key)
        return kept[1]

    def put(self, key: str, profile: Any) -> None:
        """Keep ``profile`` under ``key`` (a directory that cannot be written keeps nothing, silently)."""
        self.misses.append(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".writing-", suffix=".pickle")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((key, profile), f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, self._path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            self._prune()
        except (OSError, pickle.PicklingError, TypeError, AttributeError):
            return

    def _prune(self) -> None:
        files = sorted(self.directory.glob("*.pickle"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(0, len(files) - MAX_ENTRIES)]:
            with contextlib.suppress(OSError):
                old.unlink()


_ACTIVE: ProfileCache | None = None


def active() -> ProfileCache | None:
    """The cache :func:`caching` turned on, or ``None``."""
    return _ACTIVE


@contextlib.contextmanager
def caching(directory: str | os.PathLike[str] | None = None, *, enabled: bool = True) -> Iterator[ProfileCache | None]:
    """Answer :func:`~batchfit.budget.model_profile.profile_model` from ``directory`` (default :func:`default_directory`) inside the block.

    Off (yields ``None``) when ``enabled`` is false or ``$BATCHFIT_CACHE`` says off. Blocks
    nest: an inner block without a ``directory`` shares the outer one's cache (its hits are
    the outer's); otherwise the innermost wins, and the one before is restored on exit.
    """
    global _ACTIVE
    before = _ACTIVE
    if not enabled or turned_off():
        cache = None
    elif directory is None and before is not None:
        cache = before
    else:
        cache = ProfileCache(default_directory() if directory is None else directory)
    _ACTIVE = cache
    try:
        yield cache
    finally:
        _ACTIVE = before
