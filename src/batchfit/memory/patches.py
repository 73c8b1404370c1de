"""Class attributes the live-storage tracker replaces while it is active, installed once and restored exactly.

The tracker must see two calls that no dispatch mode sees: ``torch.UntypedStorage.resize_``
(FSDP2 allocates and frees unsharded parameters with it) and ``torch.distributed.Work.wait``
(what a backend allocates while completing a collective is not counted). Both are class
attributes, so replacing them is process-wide; :class:`ClassPatch` does it so that it
composes with the other code that patches the same attribute, above all PyTorch's
``torch.distributed._tools.mem_tracker.MemTracker`` and ``FSDPMemTracker``.

NOTE [ Patched once, restored exactly ]
- **Once.** The first tracker entered installs the wrapper, the last one to exit removes it;
  nested trackers and trackers on other threads share it (a count under a lock). The
  wrapper is one module-level function per attribute, recognised by identity: it is never
  installed over itself, nor over a wrapper that already calls it (followed through
  ``__wrapped__``, which ``functools.wraps`` sets, as ``MemTracker`` does). A chain that calls
  it again without saying so (a wrapper without ``__wrapped__``) is cut by a per-thread
  guard: re-entered on the same thread, it calls the bottom of the chain (the C method).
- **Exactly.** Installing remembers the attribute's own entry in the class ``__dict__``;
  removing puts that entry back, or deletes ours when there was none (``resize_`` is
  inherited from ``torch._C.StorageBase``: assigning the C method instead would leave a copy
  in ``torch.UntypedStorage.__dict__``). It is removed only if it is still on top: if
  something replaced it since, that code restores what it saved, and the wrapper it may put
  back is harmless (below).
- **Only the caller's trackers.** The wrapper acts only for the trackers of the calling
  context (:func:`batchfit.memory.labels._in_context`), so a resize or a ``wait()`` on another
  thread neither adds to nor hides the measured thread's bytes; with no tracker in the
  context it only calls what it wraps. A reference to it that outlives our installation
  therefore stays correct: what it wraps (``below``) is kept after removal.
- **Composition with MemTracker.** ``MemTracker`` saves ``resize_`` when it is *constructed*,
  installs its wrapper on ``__enter__`` and assigns what it saved on ``__exit__``.
  Constructed and entered inside our block, its wrapper calls ours: both see every resize,
  and at its exit ours is on top again. Entered outside our block (before it), ours calls
  its wrapper. Constructed inside our block and entered after it, its wrapper calls ours,
  which only passes the call on; at its exit it puts our wrapper back for good: the next
  tracker then finds it on top, takes it over and, at exit, restores what it wraps (the C
  method: the attribute is deleted), so the leftover is cleaned at the next measurement.
- **The limit.** A ``MemTracker`` constructed *before* our block and entered inside it
  installs a wrapper over the C method that bypasses ours, and its exit removes ours. The
  tracker then calls :meth:`ClassPatch.ensure` before every op it sees, which finds the
  attribute changed (one ``__dict__`` lookup) and installs ours on top again. Resizes
  between that change and the next op are missed by our tracker; FSDP2's resize is followed
  by the all-gather that writes into the storage, whose output the tracker sees and
  accounts at its new size (NOTE [ Sharded tensors and storage resizes ]), so the peak is
  kept, only a category may differ. After all exit, the attribute then holds the C method in
  the class ``__dict__`` (where ``MemTracker`` put it): the same object as before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

_ABSENT = object()  # no entry of that name in the class __dict__
_NOTHING = object()  # we have not installed the wrapper: nothing to restore

_MAX_CHAIN = 64  # __wrapped__ links followed before giving up


def undo_all(steps: Iterable[Callable[[], object]], error: BaseException | None = None) -> None:
    """Call every undo step in order, even when one raises (NOTE [ Every undo step runs ]).

    Args:
        steps: the undo steps, already in the order to run (the reverse of the setup).
        error: the exception that made the caller unwind (a failed setup), or ``None`` (an
            ordinary exit).

    Raises:
        The first exception a step raised, when ``error`` is ``None``; the later ones are
        attached to it as notes. With ``error``, nothing: the failures are attached to
        ``error`` as notes, and the caller re-raises ``error``.

    NOTE [ Every undo step runs ]
    A context manager that changes several things (a dispatch mode pushed, class attributes
    patched, a process-wide setting) undoes all of them on exit and on a failed entry, in
    the reverse order of the setup, even when one undo step raises: a step that fails must
    not leave the later ones undone (a dispatch mode left on the stack would track every op
    of the process for good). The first failure is the one raised: the others follow from
    the state it left.
    """
    first = error
    for step in steps:
        try:
            step()
        except BaseException as exc:  # collected, re-raised below
            if first is None:
                first = exc
            else:
                first.add_note(f"while undoing, another step also failed: {exc!r}")
    if error is None and first is not None:
        raise first


def _reaches(fn: Any, target: Any) -> bool:
    """True when ``fn`` is ``target`` or wraps it, following ``__wrapped__`` links."""
    for _ in range(_MAX_CHAIN):
        if fn is target:
            return True
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return False
    return False


def _bottom(fn: Any) -> Any:
    """The end of ``fn``'s ``__wrapped__`` chain (the C method under every wrapper that says what it wraps)."""
    for _ in range(_MAX_CHAIN):
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            return fn
        fn = inner
    return fn


class ClassPatch:
    """``owner.name`` replaced by ``wrapper`` while at least one tracker uses it (NOTE [ Patched once, restored exactly ]).

    ``wrapper`` calls :meth:`call_below` to run what it replaced. ``owner`` is a function
    returning the class (``None`` when it does not exist, e.g. torch without distributed).

    Attributes:
        name: the attribute.
        users: trackers using the patch now (any thread).
    """

    def __init__(self, owner: Callable[[], type | None], name: str) -> None:
        self._owner = functools.cache(owner)
        self.name = name
        self.wrapper: Callable[..., Any] | None = None
        self.users = 0
        self._lock = threading.RLock()
        self._below: Any = None  # what the wrapper calls; kept after removal (NOTE)
        # the C method at the bottom of every chain, for the recursion guard: taken before any
        # tracker runs (at import), so that a wrapper installed later is never mistaken for it
        cls = self._owner()
        self._base: Any = None if cls is None else _bottom(getattr(cls, name))
        self._restore: Any = _NOTHING  # the __dict__ entry to put back, _ABSENT to delete ours
        self._seen: Any = _NOTHING  # the __dict__ entry after our last look
        self._guard = threading.local()

    def bind(self, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """Set the wrapper (used as a decorator on the module-level wrapper function)."""
        self.wrapper = wrapper
        return wrapper

    # ----------------------------------------------------------------- calls through the wrapper
    def call_below(self, *args: Any, **kwargs: Any) -> Any:
        """Call what the wrapper replaced; re-entered on the same thread, call the C method (NOTE)."""
        guard = self._guard
        if getattr(guard, "inside", False):
            return self._base(*args, **kwargs)
        guard.inside = True
        try:
            return self._below(*args, **kwargs)
        finally:
            guard.inside = False

    # ----------------------------------------------------------------- install / remove
    def acquire(self) -> None:
        """One more user; the first installs the wrapper.

        When installing raises, the count and the attribute are as they were before the call.
        """
        with self._lock:
            self.users += 1
            if self.users == 1:
                try:
                    self._establish()
                except BaseException:
                    self.users -= 1
                    raise

    def release(self) -> None:
        """One user less; the last removes the wrapper if it is still on top.

        When removing raises, the user is gone all the same and the wrapper stays installed,
        remembered as ours: the next first user takes it over and the next last one removes it.
        """
        with self._lock:
            if self.users == 0:
                return
            self.users -= 1
            if self.users == 0:
                self._withdraw()

    def ensure(self) -> None:
        """Re-establish the wrapper if something replaced the attribute since our last look (cheap when not)."""
        owner = self._owner()
        if owner is None or self.users == 0 or owner.__dict__.get(self.name, _ABSENT) is self._seen:
            return
        with self._lock:
            if self.users:
                self._establish()

    def _establish(self) -> None:
        owner = self._owner()
        if owner is None:
            return
        entry = owner.__dict__.get(self.name, _ABSENT)
        current = getattr(owner, self.name)
        if current is self.wrapper:
            if self._restore is _NOTHING:
                # put back by code that saved it (a MemTracker constructed inside our block):
                # take it over, and restore what it wraps at the end
                if self._below is None:  # pragma: no cover - only we install it, which sets _below
                    self._below = self._base
                self._restore = self._entry_for(self._below)
            self._seen = entry
            return
        if _reaches(current, self.wrapper):
            self._seen = entry
            return  # a wrapper above ours already calls ours
        # the state changes only once the attribute is ours: a failed setattr changes nothing
        setattr(owner, self.name, self.wrapper)
        self._restore, self._below, self._seen = entry, current, self.wrapper
        if self._base is None:
            self._base = _bottom(current)

    def _withdraw(self) -> None:
        owner = self._owner()
        restore = self._restore
        if (
            owner is not None
            and restore is not _NOTHING
            and owner.__dict__.get(self.name, _ABSENT) is self.wrapper
        ):
            # still ours on top (else whoever replaced it restores what it saved); a failed
            # delattr/setattr leaves it installed and remembered (see release)
            if restore is _ABSENT:
                delattr(owner, self.name)
            else:
                setattr(owner, self.name, restore)
        self._restore, self._seen = _NOTHING, _NOTHING

    def _entry_for(self, value: Any) -> Any:
        """The ``__dict__`` entry that makes ``owner.name`` be ``value``: none if the base classes give it."""
        owner = self._owner()
        for klass in owner.__mro__[1:]:
            if self.name in klass.__dict__:
                return _ABSENT if getattr(klass, self.name) is value else value
        return value
