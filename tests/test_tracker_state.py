"""The tracker's state belongs to the tracker: labels per context, patches installed once and restored exactly.

NOTE [ Phases and regions ] (batchfit/memory/labels.py) and NOTE [ Patched once,
restored exactly ] (batchfit/patching.py) state what these tests hold: a tracker reads
only its own labels, a resize or a ``Work.wait()`` on another thread changes nothing for the
measured thread, ``UntypedStorage.resize_`` and ``Work.wait`` are what they were after every
tracker exits, and PyTorch's own ``MemTracker``/``FSDPMemTracker`` and batchfit's tracker
each measure what they measure alone whichever is entered first.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker

from batchfit.memory import MemoryTracker, get_backend, labels
from batchfit.memory.cpu import CpuBackend
from multirank import scaled
from sharded_helpers import fully_shard_layers

pytestmark = pytest.mark.usefixtures("one_thread")

KiB, MiB = 1024, 1024 * 1024
_ABSENT = object()


def _class_entries() -> tuple[Any, Any, Any]:
    """What ``resize_`` and ``wait`` are: the class ``__dict__`` entries (or their absence) and the looked-up method."""
    return (
        torch.UntypedStorage.__dict__.get("resize_", _ABSENT),
        dist.Work.__dict__.get("wait", _ABSENT),
        torch.UntypedStorage.resize_,
    )


def _run_in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # surfaced in the test thread
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout=scaled(30))
    assert not thread.is_alive(), "the helper thread hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


# --------------------------------------------------------------------------- labels


def test_labels_outside_any_tracker_do_nothing():
    with labels.phase(labels.FORWARD), labels.region("logprob_head"):
        labels.set_position(labels.HEAD)
        labels.set_region("optimizer_step")
        assert (labels.current_phase(), labels.coarse_phase(), labels.current_region()) == (
            "step",
            "step",
            None,
        )
    with MemoryTracker() as t:  # and leave nothing behind for the next tracker
        y = torch.ones(256)  # 1 KiB
    assert t.phase_peaks == {"step": 1024} and t.peak_breakdown == {"activations": 1024}
    del y


def test_labels_of_one_tracker_are_not_seen_by_another_thread():
    seen: dict[str, Any] = {}
    with MemoryTracker() as t, labels.phase(labels.FORWARD), labels.region("logprob_head"):
        labels.set_position(labels.HEAD)

        def other() -> None:
            seen["outside"] = (labels.current_phase(), labels.current_region())
            with MemoryTracker() as mine, labels.phase(labels.OPTIMIZER):
                labels.set_region("optimizer_step")
                seen["inside"] = (labels.current_phase(), labels.current_region())
                kept = torch.ones(512)  # 2 KiB, seen by this thread's tracker only
            seen["mine"] = (mine.phase_peaks, mine.peak_breakdown)
            del kept

        _run_in_thread(other)
        # a context of its own (asyncio tasks, copy_context) sees no tracker either
        seen["fresh context"] = contextvars.Context().run(labels.current_phase)
        assert (labels.current_phase(), labels.current_region()) == ("forward:head", "logprob_head")
        y = torch.ones(256)  # 1 KiB under this thread's labels
    assert seen == {
        "outside": ("step", None),
        "inside": ("optimizer", "optimizer_step"),
        "mine": ({"optimizer": 2048}, {"optimizer_step": 2048}),
        "fresh context": "step",
    }
    assert t.phase_peaks == {"forward:head": 1024} and t.peak_breakdown == {"logprob_head": 1024}
    del y


def test_a_tracker_entered_inside_a_labelled_block_starts_from_its_labels_and_both_follow_the_step():
    with MemoryTracker() as outer, labels.phase(labels.FORWARD), MemoryTracker() as inner:
        assert labels.current_phase() == "forward"
        with labels.region("logprob_head"):
            y = torch.ones(256)  # 1 KiB
    assert outer.phase_breakdowns == inner.phase_breakdowns == {"forward": {"logprob_head": 1024}}
    del y


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_backward_hooks_on_cpu_run_in_the_callers_thread_and_context(checkpointing):
    # NOTE [ Phases and regions ]: a hook that ends a region mid-backward (the
    # probe steps do) must reach the tracker of the thread that called backward()
    main = threading.get_ident()
    threads: list[int] = []
    x = torch.randn(64, 64, requires_grad=True)

    def end_region(grad: torch.Tensor) -> None:
        threads.append(threading.get_ident())
        labels.set_region(None)

    def block(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        if h.requires_grad:  # also during the recomputation of checkpointing
            h.register_hook(end_region)
        return h.sin()

    with MemoryTracker() as t:
        if checkpointing is None:
            out = block(x)
        else:
            out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=checkpointing == "reentrant")
        x.register_post_accumulate_grad_hook(lambda p: threads.append(threading.get_ident()) and None)
        loss = out.sum()
        with labels.region("logprob_head"):
            loss.backward()
            ended = labels.current_region()
        categories = set(t._by_category)  # every category that held bytes at some point
    assert len(threads) == 2 and set(threads) == {main}  # the tensor hook and the accumulation hook
    assert ended is None  # the hook's set_region reached this thread's tracker
    assert t._live[x.grad.untyped_storage()._cdata][1] == "activations"  # made after the hook ran
    assert "logprob_head" in categories or checkpointing == "reentrant"  # made before it


# --------------------------------------------------------------------------- other threads


@pytest.fixture
def slow_wait(monkeypatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``Work.wait`` replaced (before any tracker) by one that blocks until told: ``(entered, release)``."""
    entered, release = threading.Event(), threading.Event()

    def wait(work: Any, *args: Any, **kwargs: Any) -> bool:
        entered.set()
        assert release.wait(timeout=scaled(30))
        return True

    monkeypatch.setattr(dist.Work, "wait", wait)
    yield entered, release
    release.set()


def test_a_wait_on_another_thread_does_not_hide_the_measured_threads_allocations(slow_wait):
    entered, release = slow_wait
    with MemoryTracker() as t:
        waiter = threading.Thread(target=dist.Work().wait)
        waiter.start()  # async checkpointing waits on its own thread
        assert entered.wait(timeout=scaled(30))
        y = torch.ones(256 * KiB)  # 1 MiB while the other thread is inside wait()
        release.set()
        waiter.join(timeout=scaled(30))
    assert t.peak_bytes == MiB and t.peak_breakdown == {"activations": MiB}
    del y


def test_a_wait_on_the_measured_thread_leaves_what_the_backend_allocates_uncounted(monkeypatch):
    # NOTE [ Inside the communication backend ]: what the backend allocates inside wait()
    def wait(work: Any, *args: Any, **kwargs: Any) -> bool:
        torch.ones(256 * KiB)  # a 1 MiB temporary of the backend
        return True

    monkeypatch.setattr(dist.Work, "wait", wait)
    with MemoryTracker() as t:
        dist.Work().wait()
        y = torch.ones(256)  # 1 KiB after wait() returned: counted
    assert t.peak_bytes == 1024 and labels.current_region() is None
    del y


def test_another_threads_allocations_and_resizes_do_not_change_the_measured_peak():
    def other() -> None:
        big = torch.ones(4 * MiB // 4)  # 4 MiB on this thread
        storage = torch.empty(0).untyped_storage()
        storage.resize_(2 * MiB)  # FSDP2-style growth of a storage, on this thread
        storage.resize_(0)
        del big

    with MemoryTracker() as t:
        y = torch.ones(256)  # 1 KiB
        _run_in_thread(other)
        z = torch.ones(256)  # 1 KiB
    assert t.peak_bytes == 2048 and t.current_bytes == 2048
    assert t.peak_breakdown == {"activations": 2048}
    del y, z


def test_a_resize_is_counted_once_by_each_tracker_of_the_context():
    x = torch.empty(0)
    with MemoryTracker() as outer, MemoryTracker() as inner:
        outer.register_tensor(x, "inputs")
        inner.register_tensor(x, "inputs")
        x.untyped_storage().resize_(4096)
        x.untyped_storage().resize_(0)
    assert outer.peak_bytes == inner.peak_bytes == 4096
    assert outer.current_bytes == inner.current_bytes == 0


# --------------------------------------------------------------------------- patches: exact restoration


def _nested(exit_order: str) -> None:
    a, b = MemoryTracker(), MemoryTracker()
    a.__enter__()
    b.__enter__()
    assert torch.UntypedStorage.resize_.__name__ == "_tracked_resize"
    if exit_order == "inner first":
        b.__exit__(None, None, None)
        a.__exit__(None, None, None)
    else:
        a.__exit__(None, None, None)
        b.__exit__(None, None, None)


def _raising() -> None:
    with pytest.raises(ValueError, match="inside the block"), MemoryTracker():
        torch.ones(4)
        raise ValueError("inside the block")


def _raising_nested() -> None:
    with MemoryTracker():
        with pytest.raises(ValueError, match="inner"), MemoryTracker():
            raise ValueError("inner")
        assert torch.UntypedStorage.resize_.__name__ == "_tracked_resize"  # still the outer's


def _reentered() -> None:
    t = MemoryTracker()
    with t, t:
        torch.ones(4)


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda: MemoryTracker().__enter__().__exit__(None, None, None), id="one tracker"),
        pytest.param(_raising, id="exception inside"),
        pytest.param(lambda: _nested("inner first"), id="nested"),
        pytest.param(lambda: _nested("outer first"), id="nested, exited out of order"),
        pytest.param(_raising_nested, id="exception in a nested tracker"),
        pytest.param(_reentered, id="one tracker entered twice"),
        pytest.param(lambda: get_backend("cpu").measure(lambda: torch.ones(4)), id="a backend measurement"),
    ],
)
def test_resize_and_wait_are_restored_exactly_after_every_tracker_exits(use):
    before = _class_entries()
    use()
    assert _class_entries() == before


def test_resize_is_restored_by_removing_our_class_attribute_when_it_was_inherited(monkeypatch):
    if "resize_" in torch.UntypedStorage.__dict__:  # left there by a MemTracker of an earlier test
        monkeypatch.delattr(torch.UntypedStorage, "resize_")
    with MemoryTracker():
        assert "resize_" in torch.UntypedStorage.__dict__
    assert "resize_" not in torch.UntypedStorage.__dict__
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_


def test_the_tracker_and_a_guarded_search_share_one_wait_patch_restored_by_the_last():
    # NOTE [ Shared and counted ] (batchfit/patching.py): Work.wait is patched once, the
    # tracker's layer outside the search guard's polling one
    import batchfit.budget.guard  # noqa: F401 - registers the guard's layer
    from batchfit.memory.tracker import WORK_WAIT

    assert [layer.__name__ for layer in WORK_WAIT._layers] == ["_untracked_wait", "_polling_wait"]
    before = _class_entries()
    with WORK_WAIT.active():  # what a guarded search holds while it runs
        with MemoryTracker():
            assert dist.Work.__dict__["wait"] is WORK_WAIT.wrapper and WORK_WAIT.users == 2
        assert dist.Work.__dict__["wait"] is WORK_WAIT.wrapper and WORK_WAIT.users == 1
        with pytest.raises(ValueError, match="inside"), MemoryTracker():
            raise ValueError("inside")
        assert WORK_WAIT.users == 1
    assert _class_entries() == before and WORK_WAIT.users == 0


def test_a_shared_change_is_installed_once_by_nested_blocks_and_undone_by_the_last_also_on_errors():
    from batchfit.patching import SharedChange

    calls = []

    class Change(SharedChange):
        def _install(self) -> None:
            calls.append("install")

        def _uninstall(self) -> None:
            calls.append("uninstall")

    change = Change()
    with change.active(), change.active():  # nested on one thread
        assert change.users == 2
    with pytest.raises(ValueError, match="in the block"), change.active():
        raise ValueError("in the block")
    assert calls == ["install", "uninstall", "install", "uninstall"] and change.users == 0


# --------------------------------------------------------------------------- patches: composition


def test_a_memtracker_made_inside_our_block_and_used_after_it_neither_recurses_nor_wraps_twice():
    pristine = torch._C.StorageBase.resize_
    with MemoryTracker():
        referee = MemTracker()  # saves our wrapper as the "original" resize_
    x = torch.empty(0)
    referee.track_external(x)
    with referee:  # installs its wrapper over ours, puts ours back at its exit
        x.untyped_storage().resize_(4096)
        torch.ones(1)  # MemTracker updates its peak after an op
        x.untyped_storage().resize_(0)
    assert _referee_peak(referee)[0] == 4096 + 4  # it saw the resize (through ours, which passed it on)
    assert torch.UntypedStorage.resize_.__name__ == "_tracked_resize"  # MemTracker's leftover
    with MemoryTracker() as t:  # takes the leftover over instead of wrapping it (or itself) again
        t.register_tensor(x, "inputs")
        x.untyped_storage().resize_(8192)
        x.untyped_storage().resize_(0)
    assert t.peak_bytes == 8192 and t.current_bytes == 0  # counted once, no RecursionError
    assert torch.UntypedStorage.resize_ is pristine  # and the leftover is gone


def test_a_foreign_wrapper_that_calls_ours_without_saying_so_does_not_recurse():
    entry = torch.UntypedStorage.__dict__.get("resize_", _ABSENT)
    x = torch.empty(0)
    try:
        with MemoryTracker() as t:
            t.register_tensor(x, "inputs")
            ours = torch.UntypedStorage.resize_

            def foreign(storage: Any, size: int) -> Any:  # no functools.wraps: no __wrapped__
                return ours(storage, size)

            torch.UntypedStorage.resize_ = foreign
            torch.ones(1)  # the tracker sees the change at its next op and installs itself on top
            assert torch.UntypedStorage.resize_ is ours
            x.untyped_storage().resize_(4096)  # ours -> foreign -> ours -> the C method
            x.untyped_storage().resize_(0)
        assert t.peak_bytes == 4096 and t.current_bytes == 0  # the resize counted once
        assert torch.UntypedStorage.__dict__["resize_"] is foreign  # what was there when we installed
    finally:
        if entry is _ABSENT:
            del torch.UntypedStorage.resize_
        else:
            torch.UntypedStorage.resize_ = entry
        with MemoryTracker():  # let the patch forget the foreign wrapper it wrapped
            pass


# ---- MemTracker / FSDPMemTracker and batchfit's tracker, in either order, on FSDP2 with resizes


def _simulated_world(world: int) -> Any:
    try:
        from batchfit.parallel.distributed import simulated_world
    except ImportError:  # pragma: no cover - before the package's move
        from batchfit.distributed import simulated_world  # type: ignore[no-redef]
    return simulated_world(world)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor) -> None:
    logits = model(input_ids=input_ids).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten()).backward()
    optimizer.step()


@pytest.fixture(scope="module")
def fsdp2_on_two_simulated_ranks() -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]]:
    """The tiny model, FSDP2 over 2 simulated ranks (real CPU tensors; unsharding resizes storages)."""
    from batchfit.models import build_causal_lm

    with _simulated_world(2):
        torch.manual_seed(0)
        model = fully_shard_layers(build_causal_lm("tiny"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        input_ids = torch.randint(0, 1024, (2, 32))
        _step(model, optimizer, input_ids)  # optimizer state, FSDP2's lazy init
        optimizer.zero_grad(set_to_none=True)
        yield model, optimizer, input_ids


def _referee(
    kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor
) -> Any:
    if kind == "FSDPMemTracker":
        referee = FSDPMemTracker(model, optimizer)
        referee.track_inputs((input_ids,))
    else:
        referee = MemTracker()
        referee.track_external(model, optimizer, input_ids)
    return referee


def _referee_peak(referee: Any) -> tuple[int, dict[str, int]]:
    ((_, snapshot),) = referee.get_tracker_snapshot("peak").items()
    return snapshot["Total"], {str(getattr(k, "value", k)): v for k, v in snapshot.items() if v}


@pytest.mark.parametrize("kind", ["MemTracker", "FSDPMemTracker"])
@pytest.mark.parametrize(
    "order",
    [
        "referee outside",
        "batchfit outside, referee made inside",
        "batchfit outside, referee made before",  # the limit of NOTE [ Patched once, restored exactly ]
    ],
)
def test_pytorchs_trackers_and_ours_measure_what_they_measure_alone_in_either_nesting_order(
    fsdp2_on_two_simulated_ranks, kind, order
):
    model, optimizer, input_ids = fsdp2_on_two_simulated_ranks
    cpu = CpuBackend(attention_kernels="own")  # the referees run the CPU's own attention kernel
    state = (model, optimizer, input_ids)
    before = _class_entries()
    with _simulated_world(2):
        alone = cpu.measure(lambda: _step(*state), register=state)
        optimizer.zero_grad(set_to_none=True)
        referee = _referee(kind, *state)
        with referee:
            _step(*state)
        referee_alone = _referee_peak(referee)
        optimizer.zero_grad(set_to_none=True)

        if order == "referee outside":
            referee = _referee(kind, *state)
            with referee:
                nested = cpu.measure(lambda: _step(*state), register=state)
        else:
            made_before = _referee(kind, *state) if order.endswith("made before") else None

            def step_under_the_referee() -> None:
                nonlocal referee
                referee = made_before or _referee(kind, *state)
                with referee:
                    _step(*state)

            nested = cpu.measure(step_under_the_referee, register=state)
        optimizer.zero_grad(set_to_none=True)
    assert (nested.peak_bytes, nested.breakdown) == (alone.peak_bytes, alone.breakdown)
    assert _referee_peak(referee) == referee_alone
    assert alone.breakdown["gathered_parameters"] > 0  # the resizes were seen
    assert alone.peak_bytes == referee_alone[0]  # and the two agree (tests/test_referees.py)
    assert torch.UntypedStorage.resize_ is before[2] and dist.Work.__dict__["wait"] is before[1]
