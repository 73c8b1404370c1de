"""Context managers unwind on every failure; process-wide settings are put back on exit (issue 21).

NOTE [ Every undo step runs ] (batchfit/patching.py), NOTE [ Trackers exit out of
order ] (batchfit/memory/tracker.py) and NOTE [ What the heap is given back ]
(batchfit/memory/heap.py) state what these tests hold: a failure injected at any step of a
setup leaves no dispatch mode on the stack, no patched attribute, no hook and no changed
``mallopt`` setting; an undo step that raises does not stop the later ones, and the first
failure is the one raised.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.utils._python_dispatch as dispatch

from batchfit.memory import CpuBackend, MemoryTracker, heap, labels
from batchfit.memory import fake_patches as fp
from batchfit.memory import tracker as tracker_module
from batchfit.patching import AttributePatch, undo_all
from multirank import scaled

_ABSENT = object()


class Injected(RuntimeError):
    """The failure the tests inject."""


def _process_state() -> dict[str, Any]:
    """Everything a tracker may change in the process, as comparable values."""
    return {
        "modes": [id(m) for m in dispatch._get_current_dispatch_mode_stack()],
        "flags": (
            dispatch._is_in_torch_dispatch_mode,
            dispatch._is_in_non_infra_torch_dispatch_mode,
            dispatch._is_in_any_mode_without_ignore_compile_internals,
        ),
        "resize_": torch.UntypedStorage.__dict__.get("resize_", _ABSENT),
        "wait": dist.Work.__dict__.get("wait", _ABSENT),
        "users": [p.users for p in tracker_module._PATCHES],
        "labels": labels._in_context(),
    }


def _after_the_real(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    """Make ``owner.name`` do its work, then raise :class:`Injected`."""
    real = getattr(owner, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        real(*args, **kwargs)
        raise Injected(name)

    monkeypatch.setattr(owner, name, failing)


def _raising(*args: Any, **kwargs: Any) -> Any:
    raise Injected("setup step")


# --------------------------------------------------------------------------- undo_all


def test_undo_all_runs_every_step_and_raises_the_first_failure_with_the_others_as_notes():
    ran = []

    def step(name: str, fail: bool) -> Any:
        def run() -> None:
            ran.append(name)
            if fail:
                raise Injected(name)

        return run

    with pytest.raises(Injected, match="b") as info:
        undo_all([step("a", False), step("b", True), step("c", True), step("d", False)])
    assert ran == ["a", "b", "c", "d"]
    assert any("'c'" in note for note in info.value.__notes__)
    setup_error = ValueError("setup")
    undo_all([step("e", True)], setup_error)  # unwinding a failed setup: nothing raised here
    assert "'e'" in setup_error.__notes__[0]


# --------------------------------------------------------------------------- the tracker


_ENTRY_STEPS = {
    "labels pushed": (labels, "_push"),
    "resize_ patched": (tracker_module._RESIZE, "acquire"),
    "wait patched": (tracker_module.WORK_WAIT, "acquire"),
    "dispatch mode pushed": (dispatch.TorchDispatchMode, "__enter__"),
}


@pytest.mark.parametrize("step", list(_ENTRY_STEPS))
def test_a_failed_tracker_entry_leaves_no_mode_no_patch_and_no_labels(monkeypatch, step):
    before = _process_state()
    monkeypatch.setattr(*_ENTRY_STEPS[step], _raising)
    t = MemoryTracker()
    with pytest.raises(Injected), t:
        pytest.fail("the block must not run")  # pragma: no cover
    monkeypatch.undo()
    assert _process_state() == before
    assert t._labels.owner is None and t._depth == 0
    with MemoryTracker() as again:  # and the next tracker works
        torch.ones(256)
    assert again.peak_bytes == 1024 and _process_state() == before


_EXIT_STEPS = {
    "dispatch mode popped": (dispatch.TorchDispatchMode, "__exit__"),
    "wait restored": (tracker_module.WORK_WAIT, "release"),
    "resize_ restored": (tracker_module._RESIZE, "release"),
    "labels popped": (labels, "_pop"),
}


@pytest.mark.parametrize("step", list(_EXIT_STEPS))
def test_an_exit_step_that_raises_does_not_stop_the_others(monkeypatch, step):
    before = _process_state()
    _after_the_real(monkeypatch, *_EXIT_STEPS[step])
    with pytest.raises(Injected), MemoryTracker():
        torch.ones(4)
    monkeypatch.undo()
    assert _process_state() == before


def test_an_exception_in_the_block_propagates_and_everything_is_undone():
    before = _process_state()
    with pytest.raises(Injected, match="in the block"), MemoryTracker():
        raise Injected("in the block")
    assert _process_state() == before


def test_trackers_exited_out_of_order_leave_the_other_one_active_and_the_flags_clean():
    # NOTE [ Trackers exit out of order ]: the first exit used to pop the second's mode
    before = _process_state()
    a, b = MemoryTracker(), MemoryTracker()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert dispatch._get_current_dispatch_mode_stack()[len(before["modes"]) :] == [b]
    torch.ones(256)
    assert (a.peak_bytes, b.peak_bytes) == (0, 1024)
    b.__exit__(None, None, None)
    assert _process_state() == before


def test_an_exit_without_an_entry_is_refused():
    t = MemoryTracker()
    with pytest.raises(RuntimeError, match="not active"):
        t.__exit__(None, None, None)
    with t, t:  # re-entered: supported, one tracker
        torch.ones(256)
    assert t.peak_bytes == 1024
    with pytest.raises(RuntimeError, match="not active"):
        t.__exit__(None, None, None)


# --------------------------------------------------------------------------- AttributePatch


class _Touchy(type):
    """A metaclass whose class attributes can be made to refuse assignment and deletion."""

    refuse = False

    def __setattr__(cls, name: str, value: Any) -> None:
        if _Touchy.refuse:
            raise Injected(f"setattr {name}")
        super().__setattr__(name, value)

    def __delattr__(cls, name: str) -> None:
        if _Touchy.refuse:
            raise Injected(f"delattr {name}")
        super().__delattr__(name)


class _Base:
    def method(self) -> str:
        return "base"


class _Owner(_Base, metaclass=_Touchy):
    pass


@pytest.fixture
def toy_patch(monkeypatch):
    monkeypatch.setattr(_Touchy, "refuse", False)
    patch = AttributePatch(lambda: _Owner, "method")

    @patch.bind
    def wrapper(self: Any) -> str:
        return "wrapped " + patch.call_below(self)

    yield patch
    _Touchy.refuse = False
    while patch.users:
        patch.release()
    assert "method" not in _Owner.__dict__


def test_a_patch_that_fails_to_install_changes_nothing(toy_patch):
    _Touchy.refuse = True
    with pytest.raises(Injected):
        toy_patch.acquire()
    assert toy_patch.users == 0 and "method" not in _Owner.__dict__
    _Touchy.refuse = False
    toy_patch.acquire()
    assert _Owner().method() == "wrapped base"
    toy_patch.release()
    assert "method" not in _Owner.__dict__ and _Owner.method is _Base.method  # was absent: deleted


def test_a_patch_that_fails_to_uninstall_is_removed_by_the_next_last_user(toy_patch):
    toy_patch.acquire()
    _Touchy.refuse = True
    with pytest.raises(Injected):
        toy_patch.release()
    assert toy_patch.users == 0 and _Owner.__dict__["method"] is toy_patch.wrapper
    _Touchy.refuse = False
    toy_patch.acquire()
    assert _Owner().method() == "wrapped base"  # taken over, not wrapped twice
    toy_patch.release()
    assert "method" not in _Owner.__dict__


def test_a_patch_over_an_own_attribute_puts_back_the_same_object(toy_patch):
    def own(self: Any) -> str:
        return "own"

    _Owner.method = own
    try:
        toy_patch.acquire()
        assert _Owner().method() == "wrapped own"
        toy_patch.release()
        assert _Owner.__dict__["method"] is own
    finally:
        del _Owner.method


# --------------------------------------------------------------------------- hooks and the backend


def _hook_counts(module: torch.nn.Module) -> list[int]:
    return [len(p._post_accumulate_grad_hooks or {}) for p in module.parameters()]


def test_a_hook_that_fails_to_register_removes_the_hooks_registered_before_it(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before, state = _hook_counts(model), _process_state()
    real = torch.Tensor.register_post_accumulate_grad_hook
    calls = []

    def third_fails(self: torch.Tensor, hook: Any) -> Any:
        calls.append(self)
        if len(calls) == 3:
            raise Injected("hook")
        return real(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_post_accumulate_grad_hook", third_fails)
    with pytest.raises(Injected):
        CpuBackend().measure(lambda: model(torch.ones(1, 4)).sum().backward(), register=model)
    assert len(calls) == 3 and _hook_counts(model) == before and _process_state() == state


def test_a_failed_tracker_entry_in_a_measurement_removes_the_hooks(monkeypatch):
    model = torch.nn.Linear(4, 4)
    before, state = _hook_counts(model), _process_state()
    monkeypatch.setattr(tracker_module.WORK_WAIT, "acquire", _raising)
    with pytest.raises(Injected):
        CpuBackend().measure(lambda: model(torch.ones(1, 4)), register=model)
    monkeypatch.undo()
    assert _hook_counts(model) == before and _process_state() == state


def test_a_peak_tracker_whose_registration_fails_leaves_no_mode():
    from batchfit.train.measure import PeakTracker

    before = _process_state()
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0]]), torch.tensor([1.0]), (4,), check_invariants=True
    )  # no storage
    try:
        with pytest.raises(Exception), PeakTracker(sparse):  # noqa: B017 - whatever torch raises
            pass
        assert _process_state() == before
    finally:
        while len(dispatch._get_current_dispatch_mode_stack()) > len(
            before["modes"]
        ):  # clean up for the next tests
            mode = dispatch._get_current_dispatch_mode_stack()[-1]
            mode.__exit__(None, None, None)


# --------------------------------------------------------------------------- mallopt


class FakeLibc:
    """A glibc stand-in recording ``mallopt``/``malloc_trim``; ``fail_at``: the call numbers (1-based) that raise."""

    def __init__(self, fail_at: tuple[int, ...] = (), refuse: tuple[int, ...] = ()) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.values: dict[int, Any] = {heap._M_MMAP_THRESHOLD: "start", heap._M_TRIM_THRESHOLD: "start"}
        self.fail_at, self.refuse = fail_at, refuse

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append(("mallopt", parameter, value))
        if len(self.calls) in self.fail_at:
            raise Injected(f"call {len(self.calls)}")
        if len(self.calls) in self.refuse:
            return 0
        self.values[parameter] = value
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", pad))
        if len(self.calls) in self.fail_at:
            raise Injected(f"call {len(self.calls)}")
        return 1


MMAP, TRIM, DEFAULT, RETAIN = (
    heap._M_MMAP_THRESHOLD,
    heap._M_TRIM_THRESHOLD,
    heap._DEFAULT_THRESHOLD,
    heap._RETAIN,
)


@pytest.fixture
def libc(monkeypatch):
    """A fresh heap module state and a fake libc where heap.py looks it up (the start-up environment empty)."""
    fake = FakeLibc()
    monkeypatch.setattr(heap, "_glibc", lambda: fake)
    monkeypatch.setattr(heap, "_startup_environment", dict)
    monkeypatch.setattr(heap, "_HEAP", heap._RetainedHeap())
    return fake


def test_mallopt_is_raised_inside_and_given_back_the_defaults_after(libc):
    with heap.retain_freed_memory():
        assert libc.values == {MMAP: RETAIN, TRIM: RETAIN}
        with heap.retain_freed_memory():  # nested: shares the change
            pass
        assert libc.values == {MMAP: RETAIN, TRIM: RETAIN}
    assert libc.values == {MMAP: DEFAULT, TRIM: DEFAULT} and libc.calls[-1] == ("malloc_trim", 0)
    assert len(libc.calls) == 5 and heap._HEAP.users == 0


def test_the_thresholds_the_process_started_with_are_put_back(libc, monkeypatch):
    env = {
        "GLIBC_TUNABLES": "glibc.malloc.check=0:glibc.malloc.mmap_threshold=65536",
        "MALLOC_TRIM_THRESHOLD_": "0x40000",
    }
    monkeypatch.setattr(heap, "_startup_environment", lambda: env)
    with heap.retain_freed_memory():
        pass
    assert libc.values == {MMAP: 65536, TRIM: 0x40000}


def test_thresholds_set_at_start_up_to_something_unreadable_leave_the_heap_alone(libc, monkeypatch):
    monkeypatch.setattr(heap, "_startup_environment", lambda: {"MALLOC_MMAP_THRESHOLD_": "lots"})
    with heap.retain_freed_memory():
        pass
    assert libc.calls == []


@pytest.mark.parametrize("fail_at", [1, 2])
def test_a_mallopt_that_raises_while_setting_undoes_what_was_set(libc, fail_at):
    libc.fail_at = (fail_at,)
    with pytest.raises(Injected), heap.retain_freed_memory():
        pytest.fail("the block must not run")  # pragma: no cover
    expected = {MMAP: "start", TRIM: "start"} if fail_at == 1 else {MMAP: DEFAULT, TRIM: "start"}
    assert libc.values == expected and heap._HEAP.users == 0
    libc.fail_at = ()
    with heap.retain_freed_memory():
        assert libc.values == {MMAP: RETAIN, TRIM: RETAIN}
    assert libc.values == {MMAP: DEFAULT, TRIM: DEFAULT}


def test_a_refused_mallopt_makes_the_block_a_no_op(libc):
    libc.refuse = (2,)
    with heap.retain_freed_memory():
        assert libc.values == {MMAP: DEFAULT, TRIM: "start"}  # the first one undone
    assert libc.calls[2:] == [("mallopt", MMAP, DEFAULT)]  # no restore at exit, no trim


@pytest.mark.parametrize("fail_at", [3, 4, 5])
def test_a_restoring_call_that_raises_does_not_stop_the_others(libc, fail_at):
    libc.fail_at = (fail_at,)
    with pytest.raises(Injected, match=f"call {fail_at}"), heap.retain_freed_memory():
        pass
    assert libc.calls[2:] == [("mallopt", TRIM, DEFAULT), ("mallopt", MMAP, DEFAULT), ("malloc_trim", 0)]
    assert heap._HEAP.users == 0


def test_concurrent_blocks_restore_when_the_last_one_exits(libc):
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with heap.retain_freed_memory():
            inside.set()
            release.wait(timeout=scaled(30))

    thread = threading.Thread(target=other)
    with heap.retain_freed_memory():
        thread.start()
        assert inside.wait(timeout=scaled(30))
    assert libc.values == {MMAP: RETAIN, TRIM: RETAIN}  # the other thread is still inside
    release.set()
    thread.join(timeout=scaled(30))
    assert libc.values == {MMAP: DEFAULT, TRIM: DEFAULT}


# --------------------------------------------------------------------------- the transformers patch


def test_the_transformers_patch_is_restored_by_the_last_block_whatever_the_exit_order():
    import transformers.masking_utils as mu

    original = mu.find_packed_sequence_indices
    outer, inner = fp.transformers_fake_patches(), fp.transformers_fake_patches()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # exited first, as another thread's block may
    assert mu.find_packed_sequence_indices is fp._find_packed_sequence_indices
    inner.__exit__(None, None, None)
    assert mu.find_packed_sequence_indices is original
    with contextlib.suppress(Injected), fp.transformers_fake_patches():
        raise Injected("in the block")
    assert mu.find_packed_sequence_indices is original and fp._PATCH.users == 0


def test_fsdp1_fake_patches_exited_out_of_order_leave_torch_as_found():
    from torch.distributed.fsdp import _flat_param, _runtime_utils

    from batchfit.memory.fake_fsdp1 import fsdp1_fake_patches

    originals = (_runtime_utils._catch_all_reshard, _flat_param._same_storage, _flat_param._data_ptr_allocated)
    first, second = fsdp1_fake_patches(), fsdp1_fake_patches()
    first.__enter__()
    second.__enter__()
    assert _flat_param._same_storage is not originals[1]
    first.__exit__(None, None, None)  # the first entered exits first
    assert _flat_param._same_storage is not originals[1]  # the second is still inside
    second.__exit__(None, None, None)
    assert (_runtime_utils._catch_all_reshard, _flat_param._same_storage, _flat_param._data_ptr_allocated) == originals


def test_pinning_patch_nests_on_one_thread_and_restores_the_inherited_method():
    from batchfit.parallel.fsdp1 import _pinning_where_possible

    assert "pin_memory" not in torch.Tensor.__dict__
    with _pinning_where_possible(), _pinning_where_possible():  # was a deadlock: a plain lock held across yield
        assert "pin_memory" in torch.Tensor.__dict__
    assert "pin_memory" not in torch.Tensor.__dict__
