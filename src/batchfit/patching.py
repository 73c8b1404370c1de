"""The one way batchfit changes process-wide state: a shared change, counted, restored exactly.

batchfit patches torch, transformers and the C library while it measures: the live-storage
tracker wraps ``torch.UntypedStorage.resize_`` and ``torch.distributed.Work.wait`` (what no
dispatch mode sees), a guarded search makes ``Work.wait`` poll for ranks that left, the
estimate backend makes transformers and FSDP1 decide on fake tensors as on real ones
(:mod:`batchfit.memory.fake_patches`, :mod:`batchfit.memory.fake_fsdp1`), and a cpu-backend
search keeps freed host memory in glibc's heap (:mod:`batchfit.memory.heap`). Every one of
them is a :class:`SharedChange`: one reference count under a lock, one install by the first
user and one restore path by the last, used as ``with change.active():`` (nested, re-entrant
on one thread, concurrent on several, and undone on exceptions). An attribute of a class or
a module is replaced by an :class:`AttributePatch`; several independent uses of one
attribute share one patch, each registering a layer of its one wrapper
(:class:`LayeredPatch`: ``Work.wait``).

The module is on the ground floor (it imports only the standard library), so every layer
patches through it: ``memory`` for measuring, ``parallel`` for FSDP1's pinning of host memory
(``torch.Tensor.pin_memory``, :mod:`batchfit.parallel.fsdp1`).

NOTE [ Shared and counted ]
- The first :meth:`SharedChange.acquire` installs the change, the last :meth:`SharedChange.release`
  removes it, whatever the order in which users (blocks, threads) leave; a change that fails
  to install leaves the count and the process as they were; a change that fails to uninstall
  has lost its user all the same (the error propagates, the next first user starts again).
- :meth:`SharedChange.active` is the context manager over the two, which releases in
  ``finally``: an exception in the block propagates after the change is undone.

NOTE [ Patched once, restored exactly ]
- **Once.** The first user (a tracker, an estimate context, a guarded search) installs the
  wrapper, the last one to exit removes it; nested users and users on other threads share
  it (NOTE [ Shared and counted ]). The wrapper is one module-level function per attribute, recognised by identity: it is never
  installed over itself, nor over a wrapper that already calls it (followed through
  ``__wrapped__``, which ``functools.wraps`` sets, as ``MemTracker`` does). A chain that calls
  it again without saying so (a wrapper without ``__wrapped__``) is cut by a per-thread
  guard: re-entered on the same thread, it calls the bottom of the chain (the C method).
- **Exactly.** Installing remembers the attribute's own entry in the class (or module) ``__dict__``;
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
  tracker then calls :meth:`AttributePatch.ensure` before every op it sees, which finds the
  attribute changed (one ``__dict__`` lookup) and installs ours on top again. Resizes
  between that change and the next op are missed by our tracker; FSDP2's resize is followed
  by the all-gather that writes into the storage, whose output the tracker sees and
  accounts at its new size (NOTE [ Sharded tensors and storage resizes ]), so the peak is
  kept, only a category may differ. After all exit, the attribute then holds the C method in
  the class ``__dict__`` (where ``MemTracker`` put it): the same object as before.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
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


class SharedChange:
    """A process-wide change installed by its first user and undone by its last (NOTE [ Shared and counted ]).

    Subclasses say what the change is: :meth:`_install` makes it (and undoes what it made
    before raising), :meth:`_uninstall` undoes it (running every undo step, NOTE [ Every
    undo step runs ]). Both run under the lock, only for the first and the last user.

    Attributes:
        users: the users inside now (any thread).

    Example:
        >>> class Flag(SharedChange):
        ...     on = False
        ...     def _install(self): Flag.on = True
        ...     def _uninstall(self): Flag.on = False
        >>> flag = Flag()
        >>> with flag.active(), flag.active():
        ...     Flag.on
        True
        >>> Flag.on, flag.users
        (False, 0)
    """

    def __init__(self) -> None:
        self.users = 0
        self._lock = threading.RLock()  # re-entrant: a user may enter again from inside (nested blocks)

    def acquire(self) -> None:
        """One more user; the first installs the change.

        Raises:
            Whatever installing raises; the count and the process are then as they were.
        """
        with self._lock:
            self.users += 1
            if self.users == 1:
                try:
                    self._install()
                except BaseException:
                    self.users -= 1
                    raise

    def release(self) -> None:
        """One user less; the last undoes the change (a release without a user does nothing).

        Raises:
            Whatever undoing raises; the user is gone all the same.
        """
        with self._lock:
            if self.users == 0:
                return
            self.users -= 1
            if self.users == 0:
                self._uninstall()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The change is in force inside (shared with every other user); undone after the last, also on errors."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def _install(self) -> None:
        raise NotImplementedError

    def _uninstall(self) -> None:
        raise NotImplementedError


class AttributePatch(SharedChange):
    """``owner.name`` replaced by ``wrapper`` while at least one user uses it (NOTE [ Patched once, restored exactly ]).

    ``owner`` is a class or a module, given as a function returning it (``None`` when it does
    not exist, e.g. torch without distributed, or an optional library); an owner without the
    attribute is left alone. ``wrapper`` calls :meth:`call_below` to run what it replaced.

    Args:
        owner: returns the class or module; called once.
        name: the attribute.
        lazy: look the owner up at the first use instead of now (a module costly to import).
            A class attribute is looked up now, before any wrapper of another library, so
            that the bottom of the chain is the original (the recursion guard calls it).

    Attributes:
        name: the attribute.
        wrapper: the function installed.
        users: users of the patch now (any thread).
    """

    def __init__(self, owner: Callable[[], Any], name: str, *, lazy: bool = False) -> None:
        super().__init__()
        self._owner = functools.cache(owner)
        self.name = name
        self.wrapper: Callable[..., Any] | None = None
        self._below: Any = None  # what the wrapper calls; kept after removal (NOTE)
        # the original at the bottom of every chain, for the recursion guard: taken before any
        # tracker runs (at import), so that a wrapper installed later is never mistaken for it
        self._base: Any = _NOTHING
        self._restore: Any = _NOTHING  # the __dict__ entry to put back, _ABSENT to delete ours
        self._seen: Any = _NOTHING  # the __dict__ entry after our last look
        self._guard = threading.local()
        if not lazy:
            self._find_base()

    def bind(self, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """Set the wrapper (used as a decorator on the module-level wrapper function)."""
        self.wrapper = wrapper
        return wrapper

    def _find_base(self) -> None:
        if self._base is _NOTHING:
            owner = self._owner()
            current = None if owner is None else getattr(owner, self.name, None)
            self._base = None if current is None else _bottom(current)

    # ----------------------------------------------------------------- calls through the wrapper
    def call_below(self, *args: Any, **kwargs: Any) -> Any:
        """Call what the wrapper replaced; re-entered on the same thread, call the original (NOTE)."""
        guard = self._guard
        if getattr(guard, "inside", False):
            return self._base(*args, **kwargs)
        guard.inside = True
        try:
            return self._below(*args, **kwargs)
        finally:
            guard.inside = False

    # ----------------------------------------------------------------- install / remove
    def ensure(self) -> None:
        """Re-establish the wrapper if something replaced the attribute since our last look (cheap when not)."""
        owner = self._owner()
        if owner is None or self.users == 0 or owner.__dict__.get(self.name, _ABSENT) is self._seen:
            return
        with self._lock:
            if self.users:
                self._install()

    def _install(self) -> None:
        owner = self._owner()
        if owner is None or not hasattr(owner, self.name):
            return
        self._find_base()
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

    def _uninstall(self) -> None:
        """Put the attribute back if ours is still on top (a failed delattr/setattr leaves it installed and remembered)."""
        owner = self._owner()
        restore = self._restore
        if (
            owner is not None
            and restore is not _NOTHING
            and owner.__dict__.get(self.name, _ABSENT) is self.wrapper
        ):
            # still ours on top (else whoever replaced it restores what it saved)
            if restore is _ABSENT:
                delattr(owner, self.name)
            else:
                setattr(owner, self.name, restore)
        self._restore, self._seen = _NOTHING, _NOTHING

    def _entry_for(self, value: Any) -> Any:
        """The ``__dict__`` entry that makes ``owner.name`` be ``value``: none if the base classes give it."""
        owner = self._owner()
        for klass in getattr(owner, "__mro__", (owner,))[1:]:  # a module has no bases
            if self.name in klass.__dict__:
                return _ABSENT if getattr(klass, self.name) is value else value
        return value


#: A layer of a :class:`LayeredPatch`: called with the next layer (or what the patch
#: replaced) and the call's arguments.
Layer = Callable[..., Any]


class LayeredPatch(AttributePatch):
    """One wrapper of ``owner.name`` for several independent uses: each registers a layer.

    The wrapper calls the layers in the order they were registered, each around the ones
    registered after it: ``layer(call, *args, **kwargs)``, where ``call(*args, **kwargs)`` runs
    the next layer, the last one what the patch replaced. A layer that has nothing to do for
    the calling context calls ``call`` with the arguments it got. One count: the attribute is
    patched while any user of any layer is inside.
    """

    def __init__(self, owner: Callable[[], Any], name: str, *, lazy: bool = False) -> None:
        super().__init__(owner, name, lazy=lazy)
        self._layers: list[Layer] = []
        patch = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return patch._through(0, args, kwargs)

        wrapper.__name__ = wrapper.__qualname__ = f"layered_{name}"
        self.bind(wrapper)

    def layer(self, fn: Layer) -> Layer:
        """Register ``fn`` as the innermost layer so far (used as a decorator); returns it."""
        self._layers.append(fn)
        return fn

    def _through(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if index == len(self._layers):
            return self.call_below(*args, **kwargs)
        return self._layers[index](lambda *a, **k: self._through(index + 1, a, k), *args, **kwargs)
