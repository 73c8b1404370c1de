"""``find_token_budget``: tie the search to a memory backend, the ranks of a group and a progress hook.

The arithmetic lives in :mod:`batchfit.plan.bracket` (the bracket search) and
:mod:`batchfit.budget.memory_model` (its guess);
this module turns a :class:`~batchfit.budget.probe.BudgetStep` (one micro-batch measured at any
shape) into a probe (measure, compare with the limit, agree across ranks) and runs the search
at several lengths, longest first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from batchfit.budget.guard import RankLeftSearch, SearchGuard, guarded_search
from batchfit.budget.memory_model import MemoryModel, fit_memory_model, guess_max_batch, guess_tokens_by_phase
from batchfit.budget.probe import BudgetStep, CallableStep, Probe, candidate_lengths, response_cap
from batchfit.budget.token_budget import BudgetPoint, TokenBudget, check_cost
from batchfit.errors import DoesNotFitError, InvalidArgument, Phrase, ProbeAbandoned, Setting
from batchfit.memory import BACKEND_NAMES, DEFAULT_SAFETY_MARGIN, Backend
from batchfit.memory.categories import BUFFERS, GRADIENTS, OPTIMIZER_STATE, PARAMETERS, STATE_CATEGORIES
from batchfit.parallel.distributed import (
    agree,
    agreed_max,
    all_reduce_min,
    check_same_arguments,
    is_distributed,
    mark_agreed,
)
from batchfit.plan.bracket import SearchResult, Trial, largest_fitting
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
    step: BudgetStep | Callable[[list[int]], Any],
    *,
    max_seq_len: int,
    memory_limit: int | str | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
    backend: str | Backend = "auto",
    register: Any = (),
    seq_lens: Sequence[int] | None = None,
    cost: str = "padded",
    group: Any = None,
    progress: bool | ProgressCallback = True,
    role: str | None = None,
    hints: Mapping[int, int] | None = None,
) -> TokenBudget:
    """Find the token budget ``C``: any micro-batch of cost ``<= C`` fits in memory.

    Measures one micro-batch of the step at each length of ``seq_lens``, longest first, and
    finds the largest that fits at each with :func:`~batchfit.plan.largest_fitting`
    (unbounded), guided by the memory model fitted so far (two or three probes per length
    once the model has data). ``cost="padded"`` counts rows: ``b`` sequences of ``s`` fit and
    ``b + 1`` do not. ``cost="packed"`` counts tokens (NOTE [ Packed budgets count tokens ]):
    ``T`` tokens — sequences of ``s`` and one shorter remainder, the most memory any split of
    ``T`` tokens into sequences no longer than ``s`` needs — fit and ``T + 1`` do not.
    ``C = min over lengths``; the fitted model ``peak ≈ base + a·b·s + q·b·s²`` then checks
    ``C`` at every length ``1..max_seq_len`` and probes a length where it predicts a failure
    (``model_check`` says what it found).

    A peak fits when it is ``<= safety_margin × usable bytes``, where usable = the backend's
    ``limit_bytes`` (memory limit minus reserve), or ``memory_limit`` minus the backend's
    reserve when given.

    With a process group, every rank probes the same candidates in lockstep: per probe one
    all-reduce agrees on "does not fit" (any rank), the peak (max) and errors (a rank whose
    step raises makes every rank raise, none hangs); the limit is the minimum over ranks.
    See ``# NOTE [ Lockstep probes ]``.

    Args:
        step: a :class:`~batchfit.budget.probe.BudgetStep` (its own backend and
            ``measure(lengths)``: :func:`batchfit.budget.causal_lm_probe.causal_lm_step`, the trainer's
            own micro-batch step), or a plain function ``fn(lengths)`` that runs one
            micro-batch of sequences of those lengths, measured on ``backend`` with
            ``register``.
        max_seq_len: the longest sequence the budget must cover.
        memory_limit: bytes or a string for :func:`batchfit.memory.parse_memory`
            (``"80GiB"``, ``"h100-80gb"``); ``None`` = the backend's limit (the device's total
            memory on cuda). Required for cpu/estimate backends without a limit.
        safety_margin: fraction of the usable bytes a peak may reach, in ``(0, 1]``.
        backend: ``"auto" | "cpu" | "estimate" | "cuda"`` or a backend object; must agree with
            the step's backend when it has one.
        register: a plain function's state (model, optimizer) counted in every peak.
        seq_lens: lengths to probe (``None`` = :func:`default_seq_lens`); ``max_seq_len`` is
            always added, lengths above it are rejected.
        cost: ``"padded"`` (``b × longest``) or ``"packed"`` (sum of lengths, padding removed).
        group: a ``torch.distributed`` process group (``None`` = the default group if one is
            initialised, else single-process).
        progress: ``True`` logs each probe to the ``batchfit.budget`` logger (library code
            never prints), ``False`` is silent, a callable receives :class:`BudgetProgress`.
        role: a name for the profiled model (``"policy"``, ``"critic"``), kept in the result.
        hints: ``{seq_len: expected answer}`` (sequences for padded, tokens for packed) from a
            cheaper model of the same step (the estimate backend predicts a cpu run to the
            byte): the search probes the hint, then the one above, and so needs two measured
            steps per length when the hint is right; a hint contradicted by a probe is
            dropped. Every reported answer is still measured to fit and + 1 measured not to.

    Returns:
        :class:`~batchfit.budget.token_budget.TokenBudget`.

    Raises:
        InvalidArgument: a bad argument (each message names it, its value and the fix), or no
            memory limit on a backend that has none.
        DoesNotFitError: one sequence of ``max_seq_len`` does not fit; the message says what
            to change.

    Example:
        >>> from batchfit.budget.causal_lm_probe import causal_lm_step                # doctest: +SKIP
        >>> from batchfit.memory import get_backend                        # doctest: +SKIP
        >>> from batchfit.models import build_causal_lm                    # doctest: +SKIP
        >>> be = get_backend("estimate", memory_limit="h100-80gb")          # doctest: +SKIP
        >>> step = causal_lm_step(build_causal_lm("qwen2.5-0.5b", backend=be), backend=be)  # doctest: +SKIP
        >>> find_token_budget(step, max_seq_len=8192).tokens                # doctest: +SKIP
    """
    def setup() -> _Checked:
        checked_len = check_max_seq_len(max_seq_len)
        measured = _budget_step(step, backend, memory_limit, register)
        return _Checked(
            max_seq_len=checked_len,
            safety_margin=check_number("safety_margin", safety_margin, low=0.0, high=1.0, low_open=True),
            cost=check_cost(cost),
            lengths=_check_seq_lens(seq_lens, checked_len),
            notify=_progress_sink(progress),
            step=measured,
            usable=_usable_bytes(measured.backend, memory_limit),
        )

    # NOTE [ One rank runs out ] (batchfit.budget.guard): on real ranks every rank joins the
    # same search first, and a way out of it that the others do not share is announced to them
    with guarded_search(f"find_token_budget(role={role!r})", group) as guard:
        # NOTE [ Ranks agree or say why ]: a rank whose arguments or backend fail raises on every rank
        checked = agree(setup, group=group, what="find_token_budget's setup")
        check_same_arguments(
            {
                "max_seq_len": checked.max_seq_len,
                "seq_lens": checked.lengths,
                "cost": checked.cost,
                "safety_margin": checked.safety_margin,
                "role": role,
            },
            group=group,
            what="find_token_budget",
        )
        limit = all_reduce_min(int(checked.safety_margin * checked.usable), group)
        measured = checked.step
        # real ranks run every probe to the end, under the same cap on every device, guarded,
        # and only probe what is predicted to fit
        run = _Search(
            checked=checked,
            probe_at=_make_probe(measured, limit, group, guard),
            cap=measured.backend.limit_bytes if guard is not None else None,
            limit=limit,
            role=role,
            hints=hints,
            group=group,
        )
        with contextlib.ExitStack() as search:
            if guard is not None:
                search.enter_context(measured.backend.running_to_the_end())
                search.enter_context(measured.backend.capped())
            return _search(run)


@dataclass(frozen=True)
class _Checked:
    """:func:`find_token_budget`'s arguments once checked, on every rank alike."""

    max_seq_len: int
    safety_margin: float
    cost: str
    lengths: list[int]
    notify: Callable[[BudgetProgress], None]
    step: BudgetStep
    usable: int


@dataclass(frozen=True)
class _Search:
    """One search's fixed inputs: its checked arguments, how it probes, the limit and the cap.

    ``cap`` is the device's limit on real ranks (a probe past it is skipped when proven not
    to fit, NOTE [ Skipped only when proven ]), ``None`` where a probe may run past it.
    """

    checked: _Checked
    probe_at: Callable[..., Probe]
    cap: int | None
    limit: int
    role: str | None
    hints: Mapping[int, int] | None
    group: Any = None


def _search(run: _Search) -> TokenBudget:
    """The search of :func:`find_token_budget` once its arguments are checked and agreed on."""
    checked = run.checked
    measured, cost, lengths, notify = checked.step, checked.cost, checked.lengths, checked.notify
    limit, role = run.limit, run.role

    trials: list[Probe] = []
    points: list[BudgetPoint] = []
    planned = len(lengths)

    def run_length(seq_len: int, index: int, n_lengths: int) -> BudgetPoint:
        before = len(trials)

        def probe(lengths: list[int], to_the_end: bool = False) -> Probe:
            skipped = _skipped_peak(trials, seq_len, sum(lengths), run.cap, measured.backend.runs_past_limit)
            if skipped is not None:  # NOTE [ Skipped only when proven ]
                result = Probe(len(lengths), seq_len, skipped, fits=False, exceeded=True, tokens=sum(lengths), predicted=True)
            else:
                result = run.probe_at(lengths, seq_len, to_the_end)
            trials.append(result)
            notify(BudgetProgress(role, seq_len, index, n_lengths, result, None, len(trials), limit))
            return result

        def finish(point: BudgetPoint) -> BudgetPoint:
            size = point.tokens if cost == "packed" else point.max_batch_size
            if size:
                point = replace(point, response_tokens=response_cap(measured, candidate_lengths(size, seq_len, cost)))
            notify(BudgetProgress(role, seq_len, index, n_lengths, None, point.max_batch_size, len(trials), limit))
            return point

        hint = (run.hints or {}).get(seq_len)
        if points:  # NOTE [ A length that does not bind ]
            so_far = min(p.tokens for p in points)
            whole = so_far // seq_len
            tokens = so_far if cost == "packed" else whole * seq_len
            if whole >= 1 and probe(candidate_lengths(tokens, seq_len, "packed")).fits:
                return finish(_point(seq_len, whole, tokens, trials[before:], cost, largest=False))
        warm = _warm_start(points, seq_len)
        if cost == "packed":  # NOTE [ Packed budgets count tokens ]
            found = _search_tokens(probe, trials, seq_len, limit, hint, warm, run.group).batch_size
            whole = found // seq_len
            return finish(_point(seq_len, whole, found if whole else 0, trials[before:], cost))
        rows = _search_rows(probe, trials, seq_len, limit, hint, warm, run.group)
        return finish(_point(seq_len, rows.batch_size, rows.batch_size * seq_len, trials[before:], cost))

    # NOTE [ Lengths the probes already decide ]: the longest and the shortest first, then the rest
    order = [*lengths[:1], *lengths[-1:][: len(lengths) > 1], *lengths[1:-1]]
    for index, seq_len in enumerate(order):
        point = _proven_point(measured, trials, points, seq_len, limit, cost) if index >= 2 else None
        if point is not None:
            points.append(point)
            notify(BudgetProgress(role, seq_len, index, planned, None, point.max_batch_size, len(trials), limit))
            continue
        point = run_length(seq_len, index, planned)
        if point.max_batch_size == 0:
            one = next(p for p in reversed(trials) if p.seq_len == seq_len and p.total_tokens == seq_len)
            # the same probes and verdicts on every rank: raised on every rank alike
            raise mark_agreed(_does_not_fit(one, limit=limit, usable=checked.usable, margin=checked.safety_margin, step=measured))
        points.append(point)

    tokens = min(p.tokens for p in points)
    model = fit_memory_model(_completed(trials))
    check = ""
    for extra in range(_MAX_EXTRA_LENGTHS + 1):
        worst, check = _check_against_model(model, tokens, checked.max_seq_len, limit, cost)
        probed = {p.seq_len for p in points}
        if worst is None or worst < 2 or worst in probed or extra == _MAX_EXTRA_LENGTHS:
            break
        point = run_length(worst, planned + extra, planned + extra + 1)
        points.append(point)
        tokens = min(p.tokens for p in points)
        model = fit_memory_model(_completed(trials))
        check = f"{check}; probed seq_len={worst}: max batch {point.max_batch_size}"

    response_budget = _response_budget(points)
    return TokenBudget(
        tokens=tokens,
        max_seq_len=checked.max_seq_len,
        cost=cost,
        points=tuple(sorted(points, key=lambda p: -p.seq_len)),
        memory_model=model,
        probes=len(trials),
        limit_bytes=limit,
        usable_bytes=checked.usable,
        safety_margin=checked.safety_margin,
        backend=measured.backend.name,
        role=role,
        trials=tuple(trials),
        model_check=check,
        response_tokens=response_budget,
        response_fraction=None if response_budget is None else getattr(measured, "response_fraction", None),
    )


# NOTE [ A budget in two dimensions ]
# With a response-only head (model_logprobs(only_loss_tokens=True)) the peak grows with the
# micro-batch's tokens (the trunk) and with its response tokens (the head) apart. The probes
# hold sequences with a stated share f of response tokens (response_tokens(L, f) each), so
# the search stays one-dimensional along the ray response = f × tokens and finds, at every
# probed length s, the most tokens T_s whose candidate fits; that candidate holds R_s
# response tokens. The peak only grows with either count, so a micro-batch with at most
# T_s tokens and at most R_s response tokens fits at s: the budget is the box of both caps,
# tokens = min_s T_s and response_tokens = min_s R_s, which plan_micro_batches honours
# together (response_budget). A share higher than f is not assumed: the second cap holds it.


def _response_budget(points: Sequence[BudgetPoint]) -> int | None:
    """The smallest response cap of the points (NOTE [ A budget in two dimensions ]), ``None`` without one."""
    caps = [p.response_tokens for p in points]
    return None if not caps or None in caps else min(c for c in caps if c is not None)


# NOTE [ Packed budgets count tokens ]
# A packed micro-batch costs the sum of its lengths, so its budget is a token count, not a
# multiple of max_seq_len: rounding it down to whole sequences left 11% of the tokens unused
# for qwen2.5-7b at 8192 over 8 ranks (24,576 tokens where 27,708 fit). At each length s the
# packed search therefore searches tokens: the budget at s is the most tokens T whose
# candidate, measured, fits while T + 1 tokens' does not. A candidate of T tokens is always
# ⌊T/s⌋ whole sequences and one remainder (candidate_lengths): the worst split of T tokens into
# sequences no longer than s, since a sequence's attention and head terms grow with its length.
# It starts from one sequence (or the hint, or the previous length's tokens) and is guided
# phase by phase (NOTE [ Each phase is a line in tokens ] in batchfit.budget.memory_model).
# Until issue 29 it searched whole rows first, then the remainder, which spent two probes on
# the rows either side of the answer. A candidate within one sequence of a measured fit runs
# to the end (its exact peak guides the next guess). The memory model sees a candidate as
# T / s sequences of s (a fractional batch), which it is up to the remainder's quadratic term.

# A guess at or above this many (sequences or tokens) is "everything fits" (inf) once agreed.
NO_GUESS_ABOVE = 2**62


def _agreed_guess(predicted: float | None, group: Any) -> float | None:
    """``predicted`` the same on every rank: the least over the ranks, as ``⌊p⌋ + 0.5``.

    A guess reads this rank's breakdowns and phase peaks, which differ between ranks where a
    model shards unevenly, and the ranks must pick the same candidate (NOTE [ Lockstep
    probes ]). ``None`` (or NaN) on any rank is ``None`` on every rank.
    """
    if not is_distributed(group):
        return predicted
    if predicted is None or math.isnan(predicted):
        code = -1
    else:
        code = NO_GUESS_ABOVE if predicted >= NO_GUESS_ABOVE else max(0, math.floor(predicted))
    agreed = all_reduce_min(code, group)
    if agreed < 0:
        return None
    return math.inf if agreed >= NO_GUESS_ABOVE else agreed + 0.5


def _search_rows(
    probe: Callable[[list[int]], Probe],
    trials: Sequence[Probe],
    seq_len: int,
    limit: int,
    hint: int | None,
    warm: int,
    group: Any = None,
) -> SearchResult:
    """The most sequences of ``seq_len`` that fit (``0`` if one does not), guided by the memory model."""

    def guess(done: Sequence[Trial]) -> float | None:
        if hint is not None and all((t.batch_size <= hint) == t.fits for t in done):
            return hint + 0.5  # probe the hint, then the size above it
        # a remainder probe here is not a row count: the rows' secant takes whole rows only
        whole = [p for p in trials if p.seq_len != seq_len or p.total_tokens % seq_len == 0]
        predicted = guess_max_batch(_completed(whole), seq_len, limit, _resident_state(trials))
        return _agreed_guess(predicted, group)

    def rows(size: int) -> Trial:
        return _trial(size, probe([seq_len] * size))

    start = hint if hint is not None and hint >= 1 else warm
    return largest_fitting(rows, guess=guess, start=min(start, MAX_BATCH_SIZE), cap=MAX_BATCH_SIZE)


def _search_tokens(
    probe: Callable[..., Probe],
    trials: Sequence[Probe],
    seq_len: int,
    limit: int,
    hint: int | None,
    warm: int,
    group: Any = None,
) -> SearchResult:
    """The most tokens in sequences no longer than ``seq_len`` that fit (NOTE [ Packed budgets count tokens ]).

    Below ``seq_len`` when one sequence of it does not fit. The guess: the hint while no probe
    contradicts it; else each phase's line through this length's probes (NOTE [ Each phase is
    a line in tokens ]); before any, the memory model of the other lengths; none (bisection)
    when it reaches a size measured not to fit. ``warm``: the sequences to start from when
    nothing guesses.
    """

    def guess(done: Sequence[Trial]) -> float | None:
        if hint is not None and all((t.batch_size <= hint) == t.fits for t in done):
            return hint + 0.5  # probe the hint, then one token above it
        here = [
            (p.total_tokens, p.phase_peaks or {"step": p.peak_bytes}, p.phase_state)
            for p in trials
            if p.seq_len == seq_len and not p.exceeded
        ]
        predicted = guess_tokens_by_phase(here, seq_len, limit)
        if predicted is None:
            rows = guess_max_batch(_completed(trials), seq_len, limit, _resident_state(trials))
            predicted = None if rows is None else rows * seq_len
        failing = [t.batch_size for t in done if not t.fits]
        if predicted is not None and failing and predicted >= min(failing):
            predicted = None  # the lines are wrong above (a probe stopped there has no phases): bisect
        return _agreed_guess(predicted, group)

    def tokens(size: int) -> Trial:
        near = any(p.fits and size - seq_len <= p.total_tokens < size for p in trials if p.seq_len == seq_len)
        return _trial(size, probe(candidate_lengths(size, seq_len, "packed"), to_the_end=near))

    start = hint if hint is not None and hint >= seq_len else warm * seq_len
    cap = MAX_BATCH_SIZE * seq_len
    return largest_fitting(tokens, low=seq_len, guess=guess, start=min(start, cap), cap=cap)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def _trial(size: int, result: Probe) -> Trial:
    return Trial(size, result.peak_bytes, result.fits, exact=not result.exceeded)


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


def _budget_step(step: Any, backend: Any, memory_limit: Any, register: Any) -> BudgetStep:
    """``step`` as a :class:`BudgetStep` on the backend it agrees with; a plain function is wrapped."""
    if isinstance(backend, str):
        backend = check_choice("backend", backend, BACKEND_NAMES)
    if isinstance(step, BudgetStep):
        own = step.backend
        if isinstance(backend, str) and backend not in ("auto", own.name):
            raise InvalidArgument(
                f"backend must match the step's backend {own.name!r}, but got backend={backend!r}; "
                "build the step for that backend or pass backend='auto'"
            )
        if not isinstance(backend, str) and backend is not own:
            raise InvalidArgument(
                f"backend must be the step's own backend, but got backend={backend!r} while "
                f"step.backend={own!r}; pass backend='auto'"
            )
        chosen = own
    elif callable(step):
        if isinstance(backend, str):
            from batchfit.memory import get_backend

            backend = get_backend(backend, memory_limit=memory_limit)
        elif not isinstance(backend, Backend):
            raise InvalidArgument(
                f"backend must be a backend name or a batchfit.memory.Backend, but got backend={backend!r}"
            )
        step, chosen = CallableStep(step, backend, register), backend
    else:
        raise InvalidArgument(
            f"step must be a BudgetStep (measure(lengths), backend) or a function of the lengths, but got a {type(step).__name__}"
        )
    own_limit = chosen.memory_limit
    if memory_limit is not None and own_limit is not None and _as_bytes(memory_limit) != own_limit:
        raise InvalidArgument(
            f"memory_limit must match the backend's memory_limit={own_limit} bytes, but got "
            f"memory_limit={memory_limit!r}; build the backend with that limit or pass memory_limit=None"
        )
    return step


def _as_bytes(memory: Any) -> int:
    if is_int(memory):
        return check_positive_int("memory_limit", memory)
    from batchfit.memory import parse_memory

    return int(parse_memory(memory))


def _usable_bytes(backend: Backend, memory_limit: Any) -> int:
    if memory_limit is not None:
        usable = _as_bytes(memory_limit) - int(backend.reserve_bytes or 0)
    else:
        usable = backend.limit_bytes
        if usable is None:
            raise InvalidArgument(
                f"memory_limit must be given for backend {backend.name!r}, which has no memory limit of its own, "
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
        # in tokens: packed probes at one length differ in tokens, not always in sequences
        logger.info(f"seq_len={p.seq_len} {p.shape()}: peak {p.peak_bytes} bytes, {verdict}")
    else:
        logger.info(f"seq_len={event.seq_len}: max batch size {event.max_batch_size}")


# --------------------------------------------------------------------------- probing


def _make_probe(step: BudgetStep, limit: int, group: Any, guard: SearchGuard | None) -> Callable[..., Probe]:
    count = itertools.count()

    def probe(lengths: list[int], seq_len: int, to_the_end: bool = False) -> Probe:
        # NOTE [ Lockstep probes ]
        # Every rank runs the same candidate, then ONE all-reduce (max) of [step raised, does
        # not fit, peak, aborted, the rank that ran out + 1, a collective given up] gives every rank the same verdict and peak. The search is a deterministic function
        # of those, so every rank picks the same next candidate: no rank waits in a
        # collective the others never enter, and one rank's OOM makes every rank treat the
        # candidate as not fitting. Errors other than OOM (which the backend reports as
        # exceeded) are caught only to be agreed on: this rank re-raises its own bare, the
        # others raise BatchfitError. On real ranks each probe is guarded (NOTE [ One rank
        # runs out ]): a rank that left the step early says so, the others stop waiting for
        # it, and a collective left behind ends the search on every rank.
        index = next(count)
        what = f"the probe of {_count(len(lengths), 'sequence')} ({sum(lengths):,} tokens, the longest {seq_len:,})"
        error: BaseException | None = None
        peak, fits, exceeded, abandoned = 0, False, False, False
        breakdown: dict[str, int] = {}
        phase_peaks: dict[str, int] = {}
        phase_state: dict[str, int] = {}
        host = 0
        with contextlib.ExitStack() as guarded:
            guarded_probe = guarded.enter_context(guard.probe(index, what)) if guard is not None else None
            try:
                # NOTE [ Stop at the search's limit ]: a candidate above it is stopped there; the
                # one-sequence check runs to the end (its peak says how much is missing), and so
                # does a remainder candidate (within one sequence of the limit, its exact peak
                # guides the next guess). A backend that holds no memory (the estimate) runs every
                # candidate to the end, past the device too: it costs only time, a "does not fit"
                # names every category, and the exact peak of a candidate over the limit puts the
                # secant of the next guess on both sides of it (verl's reference at 4,096 tokens:
                # 10 probes instead of 12, a stopped candidate's peak being only a floor)
                one = len(lengths) == 1
                with contextlib.ExitStack() as limits:
                    if not step.backend.holds_memory:
                        limits.enter_context(step.backend.running_to_the_end())
                    elif not (to_the_end or one):
                        limits.enter_context(step.backend.stopping_above(limit))
                    m = step.measure(lengths)
                peak, exceeded = int(m.peak_bytes), bool(m.exceeded)
                fits = m.fits and not exceeded and m.footprint_bytes <= limit
                breakdown, host = dict(m.breakdown), int(m.host_bytes)
                phase_peaks = {phase: int(peak) for phase, peak in m.phase_peaks.items()}
                phase_state = {
                    phase: sum(b for c, b in m.phase_breakdowns.get(phase, {}).items() if c in STATE_CATEGORIES)
                    for phase in phase_peaks
                }
            except RankLeftSearch:
                raise  # another rank left the search: no agreement to wait for
            except BaseException as exc:  # an interrupt too: agreed on below, re-raised on this rank
                error = exc
            if guarded_probe is not None:
                abandoned = guarded_probe.abandoned
                if (exceeded or error is not None) and not abandoned:
                    guard.signal(index)  # this rank left the step early: the others stop waiting
        ran_out = guard.rank + 1 if guard is not None and exceeded and not abandoned else 0
        over, peak, exceeded_any, ran_out_rank, left_behind = agreed_max(
            [int(not fits), peak, int(exceeded), ran_out, int(abandoned)], error, group=group, what=what
        )
        if guard is not None:
            guard.forget(index)
        if left_behind:
            raise mark_agreed(ProbeAbandoned(
                f"rank {ran_out_rank - 1} ran out of memory in the middle of {what}, and the other ranks gave up the "
                "collective they were waiting in: the model's process group cannot be used again, so the search stops "
                f"here on every rank (NOTE [ One rank runs out ]); the device refused more than "
                f"{_fmt(step.backend.limit_bytes or limit)} on that rank: lower safety_margin, or free the memory other "
                "processes hold on its device"
            ))
        return Probe(
            len(lengths),
            seq_len,
            int(peak),
            fits=not over,
            exceeded=bool(exceeded_any),
            breakdown=breakdown,
            host_bytes=host,
            tokens=sum(lengths),
            phase_peaks=phase_peaks,
            phase_state=phase_state,
        )

    return probe


def _skipped_peak(trials: Sequence[Probe], seq_len: int, tokens: int, cap: int | None, runs_past: bool) -> int | None:
    """The bound for which a real-rank search leaves this candidate unmeasured, ``None`` when it must run.

    NOTE [ Skipped only when proven ]
    On real ranks (``cap`` is the device's own limit, :meth:`batchfit.memory.Backend.capped`)
    a candidate is recorded as not fitting without being run only when the probes measured so
    far prove it (:mod:`batchfit.budget.bounds`, NOTE [ The shape of a step's peak ]):

    - its **lower bound** exceeds the device by more than :data:`_PROOF_SLACK` (a probe it
      contains, or a secant of whole rows extended to it, measured above): it cannot fit, on
      any backend;
    - on a backend that cannot run a step past its device (``cuda``: a rank that runs out in
      the middle of a collective ends the search, NOTE [ One rank runs out ]), also when its
      **upper bound** exceeds the device: it might run out. Bounds come from measured probes
      and the state that is live throughout, never from the memory model's fit.

    Everything else runs, to the end (tracked backends, NOTE [ Real ranks run their probes to
    the end ]) or under the guard. A fit never ranks a larger probe's peak on a smaller
    candidate, nor one line through the origin on a step whose state is most of its peak: both
    once shrank budgets of real ranks 2.8× to 8.6× against one process (issue 28).
    A candidate whose bounds say nothing (the first probe of a search) runs.
    """
    if cap is None:
        return None
    from batchfit.budget.bounds import peak_lower_bound, peak_upper_bound

    low = peak_lower_bound(trials, seq_len, tokens)
    if low > cap * (1 + _PROOF_SLACK):
        return low
    if runs_past:
        return None
    high = peak_upper_bound(trials, seq_len, tokens)
    return high if high is not None and high > cap else None


#: How far beyond the device a lower bound must reach before it proves a misfit: allocators round
#: each block (512 B on CUDA), so a step's bytes are affine in its rows only to within that.
_PROOF_SLACK = 0.01


def _completed(trials: Sequence[Probe]) -> list[tuple[float, int, int]]:
    """Probes whose peak is a measurement, not an abort's lower bound, as ``(sequences, seq_len, peak)``.

    A packed probe of ``T`` tokens counts ``T / seq_len`` sequences (NOTE [ Packed budgets count tokens ]).
    """
    return [(p.total_tokens / p.seq_len, p.seq_len, p.peak_bytes) for p in trials if not p.exceeded]


def _resident_state(trials: Sequence[Probe]) -> int:
    """The bytes a step holds whatever its batch (parameters, resident gradients, optimizer state), from a probe's breakdown.

    A guess's intercept before two lengths give one (:func:`guess_max_batch`), not a bound:
    a line from it through one probe predicted qwen2.5-7b's 3 × 8,192 on the first guess where
    a line from the origin predicted 2 and cost one more probe.
    """
    first = next((p for p in trials if p.breakdown and not p.exceeded), None)
    if first is None:
        return 0
    return sum(first.breakdown.get(c, 0) for c in (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS))


def _warm_start(points: Sequence[BudgetPoint], seq_len: int) -> int:
    """Without a model guess: the token count of the previous length in sequences of ``seq_len`` (fits if ``q >= 0``)."""
    if not points:
        return 1
    return max(1, points[-1].tokens // seq_len)


def _proven_point(
    step: BudgetStep, trials: Sequence[Probe], points: Sequence[BudgetPoint], seq_len: int, limit: int, cost: str
) -> BudgetPoint | None:
    """The budget so far at ``seq_len``, when the probes measured prove it fits there; ``None`` when it must be probed.

    NOTE [ Lengths the probes already decide ]
    Between the longest and the shortest length, both measured, a length whose candidate of
    the budget so far (C // s rows padded, C tokens packed) can be cut out of a candidate
    measured to fit at a longer length is bounded by that candidate's peak (NOTE [ The shape
    of a step's peak ], :func:`batchfit.budget.bounds.peak_upper_bound`): it is not probed when
    that bound stays 1% below the limit (per-sequence bytes are not in the argument). Its point
    says so (``measured=False``, the bound as its peak), and the memory model's check still
    covers every length. A response-only head is always probed: cut sequences each keep their
    own response share. The main job's padded 4,096 and 2,048 are decided this way: with NOTE
    [ A length that does not bind ] it takes 4 probes, 10 before issue 28.
    """
    from batchfit.budget.bounds import peak_upper_bound

    if not points or response_cap(step, [seq_len]) is not None:
        return None
    so_far = min(p.tokens for p in points)
    whole = so_far // seq_len
    tokens = so_far if cost == "packed" else whole * seq_len
    bound = peak_upper_bound(trials, seq_len, tokens) if whole >= 1 else None
    if bound is None or bound > limit * (1 - _PROOF_SLACK):
        return None
    return BudgetPoint(
        seq_len=seq_len,
        max_batch_size=whole,
        peak_bytes=bound,
        next_peak_bytes=None,
        probes=0,
        max_tokens=tokens if cost == "packed" else None,
        largest=False,
        measured=False,
    )


# NOTE [ A length that does not bind ]
# The budget is the least, over the probed lengths, of what fits at each. Once a length has been
# searched, the budget so far is C; at a shorter length s only one question is left: do C tokens
# fit there (C // s rows padded, C tokens packed)? One probe answers it. When they fit, s
# cannot lower the budget, and how much more would fit there changes nothing: its point is
# that fit (BudgetPoint.largest is False, shown as "≥") and the search moves on; the memory
# model still gets a measured point at s. When they do not, s binds and is searched in full.
# The main job (qwen2.5-7b at 8192) spent 2 probes at each shorter length; it spends one, or none
# (NOTE [ Lengths the probes already decide ]).


def _point(
    seq_len: int, whole: int, tokens: int, at_length: Sequence[Probe], cost: str, largest: bool = True
) -> BudgetPoint:
    """The verified answer at ``seq_len``: ``whole`` sequences of it, ``tokens`` in all (packed: plus a remainder).

    ``largest=False``: measured to fit, nothing larger tried (NOTE [ A length that does not bind ]).
    """

    def measured(total: int) -> Probe | None:
        return next((p for p in reversed(at_length) if p.total_tokens == total and p.batch_size >= 1), None)

    best = measured(tokens) if whole else None
    above = measured(tokens + (1 if cost == "packed" else seq_len))
    return BudgetPoint(
        seq_len=seq_len,
        max_batch_size=whole,
        peak_bytes=0 if best is None else best.peak_bytes,
        next_peak_bytes=None if above is None else above.peak_bytes,
        probes=len(at_length),
        capped=whole >= MAX_BATCH_SIZE,
        breakdown={} if best is None else dict(best.breakdown),
        host_bytes=0 if best is None else best.host_bytes,
        max_tokens=tokens if cost == "packed" else None,
        largest=largest,
    )


def _does_not_fit(one: Probe, *, limit: int, usable: int, margin: float, step: BudgetStep) -> DoesNotFitError:
    """The error for one sequence of ``max_seq_len`` (the probe ``one``) not fitting.

    It gives what the user needs to choose a remedy: the sequence's peak by category (one
    rank's, largest first), the limit, the usable memory and the reserve it is taken from,
    and the step's remedies, whose settings the caller's vocabulary writes (NOTE [ Messages
    in the caller's vocabulary ] in :mod:`batchfit.errors`).
    """
    at_least = "at least " if one.exceeded else ""
    reserve = int(step.backend.reserve_bytes or 0)
    pass_ = "forward pass (no_grad)" if getattr(step, "forward_only", False) else "training step"
    parts = sorted(((b, c) for c, b in one.breakdown.items() if b > 0), reverse=True)
    by_category = ", ".join(f"{c.replace('_', ' ')} {_fmt(b)}" for b, c in parts)
    message = Phrase(
        "one sequence of ",
        Setting("max_seq_len", one.seq_len),
        f" does not fit: its {pass_} needs {at_least}{_fmt(one.peak_bytes)}",
        f" ({'where it was stopped: ' if one.exceeded else ''}{by_category})" if by_category else "",
        f" but the limit is {_fmt(limit)} = ",
        Setting("safety_margin", margin),
        f" × {_fmt(usable)} usable (memory {_fmt(usable + reserve)} − reserve {_fmt(reserve)})",
    )
    return DoesNotFitError(
        message,
        needed=one.peak_bytes,
        available=limit,
        breakdown=one.breakdown,
        reserve_bytes=reserve,
        usable_bytes=usable,
        remedies=step.remedies(),
    )


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
