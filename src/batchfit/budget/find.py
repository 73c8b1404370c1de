"""``find_token_budget``: tie the search to a memory backend, the ranks of a group and a progress hook.

The arithmetic lives in :mod:`batchfit.search` (the bracket search) and
:mod:`batchfit.budget.memory_model` (its guess);
this module turns ``step(batch_size, seq_len)`` into a probe (measure, compare with the limit,
agree across ranks) and runs the search at several lengths, longest first.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchfit.budget.memory_model import MemoryModel, fit_memory_model, guess_max_batch
from batchfit.budget.probe import Probe
from batchfit.budget.token_budget import BudgetPoint, TokenBudget, check_cost
from batchfit.distributed import agree, agreed_max, all_reduce_min, check_same_arguments
from batchfit.errors import DoesNotFitError, InvalidArgument
from batchfit.memory import BACKEND_NAMES
from batchfit.search import SearchResult, Trial, largest_fitting
from batchfit.validation import check_choice, check_number, check_positive_int, is_int

logger = logging.getLogger("batchfit.budget")

# The largest batch size a search tries; a step whose memory does not grow with the batch stops here.
MAX_BATCH_SIZE = 2**20

#: The longest sequence a budget is searched for (16M tokens, beyond any model's context).
MAX_SEQ_LEN = 2**24

# Lengths the model check may add when it predicts the budget fails between probed lengths.
_MAX_EXTRA_LENGTHS = 2


@dataclass(frozen=True)
class BudgetProgress:
    """What a progress callback receives after each probe and after each finished length.

    Attributes:
        role: the role being profiled (``None`` if not named).
        seq_len: the length being searched.
        length_index: its position (0-based) among ``n_lengths``.
        n_lengths: lengths planned (the model check may add up to two).
        probe: the probe just measured, or ``None`` when the length is done.
        max_batch_size: the verified largest batch at ``seq_len`` once done, else ``None``.
        probes: probes run so far in this search.
        limit_bytes: the limit peaks are compared with.
    """

    role: str | None
    seq_len: int
    length_index: int
    n_lengths: int
    probe: Probe | None
    max_batch_size: int | None
    probes: int
    limit_bytes: int


ProgressCallback = Callable[[BudgetProgress], None]


def default_seq_lens(max_seq_len: int, count: int = 4) -> list[int]:
    """Lengths to probe: ``max_seq_len, max_seq_len/2, /4, …`` (``count`` of them), longest first.

    A geometric spread over ``(0, max_seq_len]`` separates the per-token and the quadratic
    (attention) terms of the memory model; lengths below 2 (a next-token loss needs two
    tokens) and duplicates are dropped.

    Example:
        >>> default_seq_lens(4096)
        [4096, 2048, 1024, 512]
    """
    max_seq_len = check_positive_int("max_seq_len", max_seq_len)
    count = check_positive_int("count", count)
    # 2 is the shortest length a next-token loss can train on
    lens = [max(min(2, max_seq_len), max_seq_len >> i) for i in range(count)]
    return sorted(set(lens), reverse=True)


def find_token_budget(
    step: Callable[[int, int], Any],
    *,
    max_seq_len: int,
    memory_limit: int | str | None = None,
    safety_margin: float = 0.9,
    backend: str | Any = "auto",
    seq_lens: Sequence[int] | None = None,
    cost: str = "padded",
    group: Any = None,
    progress: bool | ProgressCallback = True,
    role: str | None = None,
    hints: Mapping[int, int] | None = None,
) -> TokenBudget:
    """Find the token budget ``C``: any micro-batch of cost ``<= C`` fits in memory.

    Probes ``step(batch_size, seq_len)`` (one forward + backward, optimizer step optional) at
    each length of ``seq_lens``, longest first, and finds the largest batch that fits at each
    with :func:`~batchfit.search.largest_fitting` (unbounded, capped at ``MAX_BATCH_SIZE``),
    guided by the memory model fitted so far (two or three probes per length once the model
    has data; at most ``2·ceil(log2(b + 1)) + 3`` for any model). Every reported batch size ``b`` was measured to fit and
    ``b + 1`` measured not to. ``C = min over lengths of b·s``; the fitted model
    ``peak ≈ base + a·b·s + q·b·s²`` then checks ``C`` at every length ``1..max_seq_len``
    and probes a length where it predicts a failure (``model_check`` says what it found).

    A peak fits when it is ``<= safety_margin × usable bytes``, where usable = the backend's
    ``limit_bytes`` (memory limit minus reserve), or ``memory_limit`` minus the backend's
    reserve when given.

    With a process group, every rank probes the same candidates in lockstep: per probe one
    all-reduce agrees on "does not fit" (any rank), the peak (max) and errors (a rank whose
    step raises makes every rank raise, none hangs); the limit is the minimum over ranks.
    See ``# NOTE [ Lockstep probes ]``.

    Args:
        step: ``step(batch_size, seq_len)`` runs one training step on random tokens. If it has
            ``.backend`` (a :class:`batchfit.memory.Backend`) and ``.persistent`` (objects to
            register: model, optimizer), as :func:`batchfit.models.causal_lm_step` builds,
            they are used; if it has ``.measure(batch_size, seq_len)`` returning a
            :class:`~batchfit.memory.MemoryMeasurement` (a
            :class:`~batchfit.models.TrainingStep`, a depth-extrapolated step), that is
            how each probe is measured.
        max_seq_len: the longest sequence the budget must cover.
        memory_limit: bytes or a string for :func:`batchfit.memory.parse_memory`
            (``"80GiB"``, ``"h100-80gb"``); ``None`` = the backend's limit (the device's total
            memory on cuda). Required for cpu/estimate backends without a limit.
        safety_margin: fraction of the usable bytes a peak may reach, in ``(0, 1]``.
        backend: ``"auto" | "cpu" | "estimate" | "cuda"`` or a backend object; must agree with
            ``step.backend`` when the step has one.
        seq_lens: lengths to probe (``None`` = :func:`default_seq_lens`); ``max_seq_len`` is
            always added, lengths above it are rejected.
        cost: ``"padded"`` (``b × longest``) or ``"packed"`` (sum of lengths, padding removed).
        group: a ``torch.distributed`` process group (``None`` = the default group if one is
            initialised, else single-process).
        progress: ``True`` logs each probe to the ``batchfit.budget`` logger (library code
            never prints), ``False`` is silent, a callable receives :class:`BudgetProgress`.
        role: a name for the profiled model (``"policy"``, ``"critic"``), kept in the result.
        hints: ``{seq_len: expected max batch}`` from a cheaper model of the same step (the
            estimate backend predicts a cpu run to the byte): the search probes the hint,
            then the hint + 1, and so needs two measured steps per length when the hint is
            right; a hint contradicted by a probe is dropped. Every reported size is still
            measured to fit and + 1 measured not to.

    Returns:
        :class:`~batchfit.budget.token_budget.TokenBudget`.

    Raises:
        InvalidArgument: a bad argument (each message names it, its value and the fix), or no
            memory limit on a backend that has none.
        DoesNotFitError: one sequence of ``max_seq_len`` does not fit; the message says what
            to reduce.

    Example:
        >>> from batchfit.models import build_causal_lm, causal_lm_step   # doctest: +SKIP
        >>> from batchfit.memory import get_backend                        # doctest: +SKIP
        >>> be = get_backend("estimate", memory_limit="h100-80gb")          # doctest: +SKIP
        >>> step = causal_lm_step(build_causal_lm("qwen2.5-0.5b", backend=be), backend=be)  # doctest: +SKIP
        >>> find_token_budget(step, max_seq_len=8192).tokens                # doctest: +SKIP
    """
    def setup() -> tuple[Any, ...]:
        checked_len = check_max_seq_len(max_seq_len)
        margin = check_number("safety_margin", safety_margin, low=0.0, high=1.0, low_open=True)
        chosen_cost = check_cost(cost)
        lens = _check_seq_lens(seq_lens, checked_len)
        sink = _progress_sink(progress)
        chosen = _resolve_backend(step, backend, memory_limit)
        return checked_len, margin, chosen_cost, lens, sink, chosen, _usable_bytes(chosen, memory_limit)

    # NOTE [ Ranks agree or say why ]: a rank whose arguments or backend fail raises on every rank
    max_seq_len, safety_margin, cost, lengths, notify, be, usable = agree(
        setup, group=group, what="find_token_budget's setup"
    )
    check_same_arguments(
        {"max_seq_len": max_seq_len, "seq_lens": lengths, "cost": cost, "safety_margin": safety_margin, "role": role},
        group=group,
        what="find_token_budget",
    )
    limit = all_reduce_min(int(safety_margin * usable), group)
    register = tuple(getattr(step, "persistent", ()) or ())
    probe_at = _make_probe(step, be, register, limit, group)

    trials: list[Probe] = []
    points: list[BudgetPoint] = []
    planned = len(lengths)

    def run_length(seq_len: int, index: int, n_lengths: int) -> BudgetPoint:
        before = len(trials)

        def probe(batch_size: int) -> Trial:
            result = probe_at(batch_size, seq_len)
            trials.append(result)
            notify(BudgetProgress(role, seq_len, index, n_lengths, result, None, len(trials), limit))
            return result.as_trial()

        hint = (hints or {}).get(seq_len)

        def guess(done: Sequence[Trial]) -> float | None:
            if hint is not None and all((t.batch_size <= hint) == t.fits for t in done):
                return hint + 0.5  # probe the hint, then the size above it
            return guess_max_batch(_completed(trials), seq_len, limit)

        start = hint if hint is not None and hint >= 1 else _warm_start(points, seq_len)
        start = min(start, MAX_BATCH_SIZE)
        found = largest_fitting(probe, guess=guess, start=start, cap=MAX_BATCH_SIZE)
        best = next(
            (p for p in reversed(trials[before:]) if p.batch_size == found.batch_size and p.fits), None
        )
        point = _point(seq_len, found, len(trials) - before, best)
        notify(
            BudgetProgress(role, seq_len, index, n_lengths, None, point.max_batch_size, len(trials), limit)
        )
        return point

    for index, seq_len in enumerate(lengths):
        point = run_length(seq_len, index, planned)
        if point.max_batch_size == 0:
            one = next(p for p in reversed(trials) if p.seq_len == seq_len and p.batch_size == 1)
            raise _does_not_fit(one, limit=limit, usable=usable, margin=safety_margin, step=step)
        points.append(point)

    tokens = min(p.tokens for p in points)
    model = fit_memory_model(_completed(trials))
    check = ""
    for extra in range(_MAX_EXTRA_LENGTHS + 1):
        worst, check = _check_against_model(model, tokens, max_seq_len, limit, cost)
        probed = {p.seq_len for p in points}
        if worst is None or worst < 2 or worst in probed or extra == _MAX_EXTRA_LENGTHS:
            break
        point = run_length(worst, planned + extra, planned + extra + 1)
        points.append(point)
        tokens = min(p.tokens for p in points)
        model = fit_memory_model(_completed(trials))
        check = f"{check}; probed seq_len={worst}: max batch {point.max_batch_size}"

    return TokenBudget(
        tokens=tokens,
        max_seq_len=max_seq_len,
        cost=cost,
        points=tuple(sorted(points, key=lambda p: -p.seq_len)),
        memory_model=model,
        probes=len(trials),
        limit_bytes=limit,
        usable_bytes=usable,
        safety_margin=safety_margin,
        backend=str(getattr(be, "name", type(be).__name__)),
        role=role,
        trials=tuple(trials),
        model_check=check,
    )


# --------------------------------------------------------------------------- arguments


def check_max_seq_len(max_seq_len: Any, name: str = "max_seq_len") -> int:
    """``max_seq_len`` as an int in ``[1, MAX_SEQ_LEN]``.

    Raises:
        InvalidArgument: anything else, naming the value and the bound.
    """
    max_seq_len = check_positive_int(name, max_seq_len)
    if max_seq_len > MAX_SEQ_LEN:
        raise InvalidArgument(
            f"{name} must be at most {MAX_SEQ_LEN:,} tokens, but got {name}={max_seq_len}; pass the longest sequence you train on"
        )
    return max_seq_len


def _check_seq_lens(seq_lens: Sequence[int] | None, max_seq_len: int) -> list[int]:
    if seq_lens is None:
        return default_seq_lens(max_seq_len)
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence):
        raise InvalidArgument(
            f"seq_lens must be a sequence of positive integers, but got seq_lens={seq_lens!r}; "
            "pass e.g. seq_lens=[4096, 1024] or None for the default spread"
        )
    out = {check_positive_int(f"seq_lens[{i}]", s) for i, s in enumerate(seq_lens)}
    too_long = sorted(s for s in out if s > max_seq_len)
    if too_long:
        raise InvalidArgument(
            f"seq_lens must be <= max_seq_len={max_seq_len}, but got seq_lens={list(seq_lens)!r}; "
            f"drop {too_long!r} or raise max_seq_len"
        )
    out.add(max_seq_len)  # the guarantee rests on the longest length being measured
    return sorted(out, reverse=True)


def _resolve_backend(step: Any, backend: Any, memory_limit: Any) -> Any:
    own = getattr(step, "backend", None)
    if isinstance(backend, str):
        backend = check_choice("backend", backend, BACKEND_NAMES)
    if own is not None:
        name = getattr(own, "name", None)
        if isinstance(backend, str) and backend not in ("auto", name):
            raise InvalidArgument(
                f"backend must match the step's backend {name!r}, but got backend={backend!r}; "
                "build the step for that backend or pass backend='auto'"
            )
        if not isinstance(backend, str) and backend is not own:
            raise InvalidArgument(
                f"backend must be the step's own backend, but got backend={backend!r} while "
                f"step.backend={own!r}; pass backend='auto'"
            )
        backend = own
    elif isinstance(backend, str):
        from batchfit.memory import get_backend

        return get_backend(backend, memory_limit=memory_limit)
    own_limit = getattr(backend, "memory_limit", None)
    if memory_limit is not None and own_limit is not None and _as_bytes(memory_limit) != own_limit:
        raise InvalidArgument(
            f"memory_limit must match the backend's memory_limit={own_limit} bytes, but got "
            f"memory_limit={memory_limit!r}; build the backend with that limit or pass memory_limit=None"
        )
    return backend


def _as_bytes(memory: Any) -> int:
    if is_int(memory):
        return check_positive_int("memory_limit", memory)
    from batchfit.memory import parse_memory

    return int(parse_memory(memory))


def _usable_bytes(backend: Any, memory_limit: Any) -> int:
    if memory_limit is not None:
        usable = _as_bytes(memory_limit) - int(getattr(backend, "reserve_bytes", 0) or 0)
    else:
        usable = getattr(backend, "limit_bytes", None)
        if usable is None:
            name = getattr(backend, "name", backend)
            raise InvalidArgument(
                f"memory_limit must be given for backend {name!r}, which has no memory limit of its own, "
                "but got memory_limit=None; pass memory_limit='80GiB' or a device such as 'h100-80gb'"
            )
    if usable <= 0:
        raise InvalidArgument(
            f"memory_limit must exceed the backend's reserve, but got memory_limit={memory_limit!r} "
            f"(usable {usable} bytes); raise memory_limit or lower the reserve"
        )
    return int(usable)


def _progress_sink(progress: Any) -> Callable[[BudgetProgress], None]:
    if callable(progress):
        return progress
    if progress is True:
        return _log_progress
    if progress is False or progress is None:
        return lambda event: None
    raise InvalidArgument(
        f"progress must be True, False or a callable taking BudgetProgress, but got progress={progress!r}"
    )


def _log_progress(event: BudgetProgress) -> None:
    if event.probe is not None:
        p = event.probe
        verdict = "fits" if p.fits else "does not fit"
        logger.info(f"seq_len={p.seq_len} batch_size={p.batch_size}: peak {p.peak_bytes} bytes, {verdict}")
    else:
        logger.info(f"seq_len={event.seq_len}: max batch size {event.max_batch_size}")


# --------------------------------------------------------------------------- probing


def _make_probe(
    step: Callable[[int, int], Any], backend: Any, register: tuple, limit: int, group: Any
) -> Callable[[int, int], Probe]:
    def probe(batch_size: int, seq_len: int) -> Probe:
        # NOTE [ Lockstep probes ]
        # Every rank runs the same candidate, then ONE all-reduce (max) of
        # [step raised, does not fit, peak, aborted] gives every rank the same verdict and
        # peak. The search is a deterministic function of those, so every rank picks the
        # same next candidate: no rank waits in a collective the others never enter, and
        # one rank's OOM makes every rank treat the candidate as not fitting. Errors other
        # than OOM (which the backend reports as exceeded) are caught only to be agreed
        # on: this rank re-raises its own bare, the others raise BatchfitError.
        error: BaseException | None = None
        peak, fits, exceeded = 0, False, False
        breakdown: dict[str, int] = {}
        host = 0
        try:
            # NOTE [ Stop at the search's limit ]: a candidate above it is stopped there; the
            # one-sequence check runs to the end, its peak says how much is missing
            stopping = getattr(backend, "stopping_above", None)  # a duck-typed backend may lack it
            stop = stopping(limit) if stopping is not None and batch_size > 1 else contextlib.nullcontext()
            with stop:
                if callable(own_measure):
                    m = own_measure(batch_size, seq_len)
                else:
                    m = backend.measure(lambda: step(batch_size, seq_len), register=register)
            peak, exceeded = int(m.peak_bytes), bool(m.exceeded)
            footprint = max(peak, int(getattr(m, "reserved_bytes", None) or 0))
            fits = bool(m.fits) and not exceeded and footprint <= limit
            breakdown, host = dict(getattr(m, "breakdown", {})), int(getattr(m, "host_bytes", 0))
        except Exception as exc:
            error = exc
        over, peak, exceeded_any = agreed_max(
            [int(not fits), peak, int(exceeded)],
            error,
            group=group,
            what=f"the probe of batch_size={batch_size}, seq_len={seq_len}",
        )
        return Probe(
            batch_size,
            seq_len,
            int(peak),
            fits=not over,
            exceeded=bool(exceeded_any),
            breakdown=breakdown,
            host_bytes=host,
        )

    own_measure = getattr(step, "measure", None)
    return probe


def _completed(trials: Sequence[Probe]) -> list[tuple[int, int, int]]:
    """Probes whose peak is a measurement, not an abort's lower bound."""
    return [(p.batch_size, p.seq_len, p.peak_bytes) for p in trials if not p.exceeded]


def _warm_start(points: Sequence[BudgetPoint], seq_len: int) -> int:
    """Without a model guess: the token count of the previous length (fits if ``q >= 0``)."""
    if not points:
        return 1
    prev = points[-1]
    return max(1, prev.tokens // seq_len)


def _point(seq_len: int, found: SearchResult, probes: int, best_probe: Probe | None) -> BudgetPoint:
    best = found.peak_bytes
    above = next((t for t in found.trials if t.batch_size == found.batch_size + 1), None)
    return BudgetPoint(
        seq_len=seq_len,
        max_batch_size=found.batch_size,
        peak_bytes=0 if best is None else best,
        next_peak_bytes=None if above is None else above.peak_bytes,
        probes=probes,
        capped=found.batch_size >= MAX_BATCH_SIZE,
        breakdown={} if best_probe is None else dict(best_probe.breakdown),
        host_bytes=0 if best_probe is None else best_probe.host_bytes,
    )


def _does_not_fit(one: Probe, *, limit: int, usable: int, margin: float, step: Any = None) -> DoesNotFitError:
    """The error for one sequence of ``max_seq_len`` (the probe ``one``) not fitting."""
    at_least = "at least " if one.exceeded else ""
    return DoesNotFitError(
        f"one sequence of max_seq_len={one.seq_len} does not fit: its training step needs {at_least}"
        f"{_fmt(one.peak_bytes)} but the limit is {_fmt(limit)} (safety_margin={margin} × {_fmt(usable)} "
        f"usable); {_what_to_change(step)}",
        needed=one.peak_bytes,
        available=limit,
    )


def _what_to_change(step: Any) -> str:
    """The remedies that are not already in use by ``step`` (a TrainingStep, or anything)."""
    model = getattr(step, "model", None)
    model = getattr(model, "module", model)  # DDP
    sharding = getattr(step, "sharding", None)
    remedies = ["reduce max_seq_len"]
    # transformers 5.x renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
    if not getattr(model, name, False):
        remedies.append("enable gradient checkpointing")
    if getattr(step, "logprobs", "fused") != "fused" and not getattr(step, "critic", False):
        remedies.append("compute log-probs fused from the hidden states (logprobs='fused')")
    if sharding is None or getattr(sharding, "strategy", "none") != "fsdp2":
        remedies.append("shard the model over more ranks (fsdp2)")
    elif getattr(sharding, "offload", "none") != "cpu":
        remedies.append("offload the sharded state to the CPU")
    remedies.append("or give more memory (memory_limit, safety_margin)")
    return ", ".join(remedies)


# --------------------------------------------------------------------------- model check


def _check_against_model(
    model: MemoryModel, tokens: int, max_seq_len: int, limit: int, cost: str
) -> tuple[int | None, str]:
    """Check ``C`` at every length ``1..max_seq_len`` through the model.

    Padded: ``b = C // s`` sequences of length ``s``. Packed: also ``C`` tokens made of
    sequences of ``max_seq_len`` (``b = C / max_seq_len``, fractional), the worst mixture
    because the quadratic term grows with the length (see docs/budget.md). A prediction
    may exceed the limit by the fit's own largest residual before it counts as a failure.

    Returns:
        ``(worst failing length or None, a one-line summary)``. O(max_seq_len) arithmetic.
    """
    s = np.arange(1, max_seq_len + 1, dtype=np.float64)
    b = np.floor(tokens / s)
    predicted = model.base + model.linear * b * s + model.quadratic * b * s * s
    if cost == "packed":
        worst_mix = model.predict(tokens / max_seq_len, max_seq_len)
        predicted[-1] = max(predicted[-1], worst_mix)
    tolerance = model.max_residual
    excess = predicted - (limit + tolerance)
    i = int(np.argmax(excess))
    if excess[i] > 0:
        return int(s[i]), (
            f"the model predicts {_fmt(predicted[i])} > limit {_fmt(limit)} (+{_fmt(tolerance)} fit error) "
            f"at seq_len={int(s[i])}"
        )
    j = int(np.argmax(predicted))
    headroom = limit - predicted[j]
    if headroom >= 0:
        return None, (
            f"the model agrees at every length 1..{max_seq_len}: worst predicted peak {_fmt(predicted[j])} "
            f"at seq_len={int(s[j])} ({_fmt(headroom)} below the limit)"
        )
    return None, (
        f"no length 1..{max_seq_len} is predicted above the limit by more than the fit's error: the worst, "
        f"seq_len={int(s[j])}, is predicted {_fmt(-headroom)} above it, within the largest residual "
        f"{_fmt(tolerance)} (the probed lengths were measured to fit)"
    )


def _fmt(nbytes: float) -> str:
    from batchfit.memory import format_bytes

    return format_bytes(round(float(nbytes)))


__all__ = ["BudgetProgress", "ProgressCallback", "default_seq_lens", "find_token_budget"]
