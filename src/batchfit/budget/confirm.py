"""Confirm an estimated budget on the real device: the real step, once, at each role's budget.

``batchfit profile --confirm`` calls this. The estimate finds each role's budget in seconds
(:func:`~batchfit.budget.model_profile.profile_model` on the estimate backend, against the real
device's memory and reserve); then the real step (:mod:`batchfit.budget.causal_lm_probe`, full depth,
real tensors) runs once at each role's binding point — the shape that sets ``C``, the peak
the budget is closest to its limit at — on the real device (``cuda``, or ``cpu`` tensors
under the live-storage tracker), and the report puts estimate and measurement side by side
per category, with the relative error, and on cuda the caching allocator's reservation
beyond what was allocated. A run that does not fit is a :class:`DoesNotFitError` naming the
role, the shape, the bytes and what to change. The measurements make a
:class:`~batchfit.memory.calibration.Calibration` (:meth:`ConfirmReport.calibration`), from
which later profiles take their reserve and safety margin.

Two halves, because a sharded confirm needs both a simulated world (the estimate) and the
real ranks (the run), and one process cannot hold both process groups:
:func:`plan_confirm` estimates (no process group initialised), :func:`run_confirm` measures
(inside the real group when sharded). :func:`confirm_profile` is both, in one process.

NOTE [ Confirm like with like ]
The estimate backend predicts a cpu run to the byte when it rounds storages as that run does
(``round_to=1``); by default it rounds to 512 B, the CUDA caching allocator's block, which
for small tensors is far from the cpu run (a 64-byte buffer counts 512). So the estimate is
compared at the device's own rounding: the budget is searched as the user's estimate
searches it (512 B), then the step is estimated once more at the binding shape with the
device's rounding (cpu: 1 B; cuda: 512 B, the same as the search, so the search's numbers are
used as they are), and that estimate is what each category's error is computed against; the
search's own peak is reported beside it. The reserve is the device's on both sides (cpu: the
reserve given, default 0; cuda: given, or measured as ``total − free − torch's reserved``),
so the budget is searched against the limit the run is judged by. cuda's breakdown knows only
the registered state (parameters, gradients, optimizer state, buffers, communication
buffers, inputs) and calls the rest of the allocated peak ``activations``; the estimate's
other categories (``logprob_head``, ``optimizer_step``, ``gathered_parameters``, …) are summed
into ``activations`` there, so both sides add up the same way. What no estimate sees on cuda
is reported apart: ``max_memory_reserved − max_memory_allocated`` (the allocator's rounding
and fragmentation) and the memory outside torch's allocator (CUDA context, NCCL). The
estimate may be extrapolated from two shallow copies (NOTE [ Peak memory is affine in
depth ]); the confirm runs the full model.

Example:
    >>> r = confirm_profile("tiny", max_seq_len=64, backend="cpu", memory_limit="16MiB",
    ...                     seq_lens=[64])
    >>> r.fits, abs(r.roles["policy"].relative_error) < 0.01
    (True, True)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch

from batchfit.budget.confirm_report import (
    CategoryConfirmation,
    ConfirmPlan,
    ConfirmPoint,
    ConfirmReport,
    RoleConfirmation,
)
from batchfit.budget.model_profile import (
    ModelProfile,
    RoleBuilder,
    check_host_memory,
    check_roles,
    default_dtype,
    depth_plan,
    model_name,
    profile_model,
    resolve_options,
    simulated_world_for,
)
from batchfit.budget.options import ProfileOptions
from batchfit.budget.probe import candidate_lengths
from batchfit.errors import InvalidArgument
from batchfit.memory import DEFAULT_ROUND_TO, backend_class, backend_name, format_bytes, get_backend
from batchfit.memory.calibration import process_allocator_setting
from batchfit.memory.categories import (
    ACTIVATIONS,
    BUFFERS,
    COMMUNICATION,
    GRADIENTS,
    INPUTS,
    OPTIMIZER_STATE,
    PARAMETERS,
)
from batchfit.parallel.distributed import (
    agree,
    agreed_max,
    check_same_arguments,
    get_world_size,
    is_distributed,
)

#: What a confirm runs on: the real devices.
CONFIRM_BACKENDS = ("cpu", "cuda")
#: The categories cuda's breakdown knows (the registered state); the rest of its peak is
#: ``activations`` (NOTE [ Confirm like with like ]).
REGISTERED_CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, BUFFERS, COMMUNICATION, INPUTS)


def confirm_profile(
    model: Any = "tiny",
    options: ProfileOptions | None = None,
    *,
    roles: str | Sequence[str] | None = None,
    profile: ModelProfile | None = None,
    check: bool = True,
    **settings: Any,
) -> ConfirmReport:
    """Estimate the budgets, then run the real step once at each role's budget on the device and compare.

    In one process: :func:`plan_confirm` and then :func:`run_confirm`. A sharded confirm runs
    on real ranks, which need those two halves apart (the estimate simulates the ranks and
    must run before the real process group exists): ``batchfit profile --confirm`` under
    ``torchrun`` does that.

    Args:
        model: a preset, a directory, a hub id, a ``PretrainedConfig`` or a transformers model
            (as :func:`~batchfit.budget.profile_model`), or a :class:`ModelProfile` from the
            estimate backend to confirm instead of estimating (its ``model`` must load).
        options: the :class:`ProfileOptions` of the device: ``backend`` ``cpu`` or ``cuda``
            (``auto`` picks cuda when present), ``memory_limit`` (required on cpu),
            ``reserve_bytes``, and the model's settings; keyword ``settings`` build or override it.
        roles: the roles (default: the profile's, else ``policy``).
        profile: the estimate to confirm (default: estimated here, against the device).
        check: raise :class:`DoesNotFitError` when a run does not fit (else only report it).

    Returns:
        :class:`ConfirmReport`.

    Raises:
        InvalidArgument: a backend that is not a device (``estimate``), no ``memory_limit`` on
            cpu, a model the host cannot hold on cpu, a sharded confirm in one process, a
            profile unlike the options, or the errors of :func:`profile_model`.
        DoesNotFitError: the estimate found no budget, or (``check``) a confirm run does not
            fit; the error's ``report`` attribute holds the report.
    """
    opts = resolve_options(options, settings)
    if opts.sharding.distributed:
        n = opts.sharding.world_size
        raise InvalidArgument(
            f"a sharded confirm (sharding={opts.sharding.strategy!r} over {_ranks(n)}) runs the step on real ranks, "
            f"which confirm_profile cannot start in one process; launch torchrun --nproc-per-node {n} batchfit "
            "profile --confirm ... (gloo on cpu, nccl on cuda), or call plan_confirm before init_process_group "
            "and run_confirm after on every rank"
        )
    return run_confirm(plan_confirm(model, opts, roles=roles, profile=profile), check=check)


def plan_confirm(
    model: Any = "tiny",
    options: ProfileOptions | None = None,
    *,
    roles: str | Sequence[str] | None = None,
    profile: ModelProfile | None = None,
    **settings: Any,
) -> ConfirmPlan:
    """The estimate half of a confirm: each role's budget, binding shape and estimate at the device's rounding.

    Needs no process group and must run before a real one exists when sharded (the estimate
    simulates the ranks). On cuda the device's total and reserve are read here, so set the
    rank's device first (``torch.cuda.set_device(local_rank)``).

    Args: as :func:`confirm_profile`.

    Returns:
        :class:`ConfirmPlan`.

    Raises:
        InvalidArgument: see :func:`confirm_profile`; also a sharded plan inside a process group.
        DoesNotFitError: the estimate found no budget for a role.
    """
    from batchfit.models import load_config, parse_dtype

    if isinstance(model, ModelProfile):
        if profile is not None and profile is not model:
            raise InvalidArgument(
                "pass the profile to confirm once: as the first argument or as profile=, but got two different profiles"
            )
        model, profile = model.model, model
    opts = resolve_options(options, settings)
    backend = backend_name(opts.backend)
    if backend not in CONFIRM_BACKENDS:
        raise InvalidArgument(
            f"a confirm runs the real step on a device, so backend must be 'cpu' or 'cuda', but got "
            f"backend={opts.backend!r} ({backend} here); pass backend='cpu' (real CPU tensors) or run on a GPU "
            "(backend='cuda')"
        )
    sharding = opts.sharding
    if sharding.spec.profile:
        raise InvalidArgument(
            f"a confirm runs the causal-LM step batchfit builds, but sharding={sharding.strategy!r} is profiled on its "
            "own model (Megatron-core's GPTModel), whose real-rank runs are the cpu backend's own profile: profile with "
            "backend='cpu' under torchrun instead of confirming (the estimate equals it to the byte, docs/megatron.md)"
        )
    if sharding.distributed and torch.distributed.is_available() and torch.distributed.is_initialized():
        raise InvalidArgument(
            f"plan_confirm estimates sharding={sharding.strategy!r} over {_ranks(sharding.world_size)} (simulated), which "
            f"needs no process group, but one of {_ranks(get_world_size())} is initialised; call plan_confirm before "
            "init_process_group and run_confirm after (batchfit profile --confirm under torchrun does)"
        )
    start = time.perf_counter()
    config = load_config(model)
    name = model_name(model)
    dtype = parse_dtype(default_dtype(sharding) if opts.dtype is None else opts.dtype)
    if backend_class(backend).host_memory:
        from batchfit.memory.device_memory import resolve_device_memory

        # the one rule for a host backend's limit (NOTE [ Validated once ] in batchfit.budget.options)
        resolve_device_memory(opts.memory_limit, opts.reserve_bytes, backend, world=None, vocabulary=opts.caller_vocabulary)
        check_host_memory(config, name)  # the cpu run builds the real model
    device = get_backend(backend, memory_limit=opts.memory_limit, reserve_bytes=opts.reserve_bytes)
    memory, reserve, round_to = int(device.memory_limit), int(device.reserve_bytes), int(device.round_to)
    untracked = _untracked_bytes(device) if device.reads_device else None
    del device
    quiet = opts.replace(progress=False)
    if profile is None:
        estimate_opts = opts.replace(backend="estimate", memory_limit=memory, reserve_bytes=reserve)
        chosen = check_roles(roles if roles is not None else ("policy",))
        profile = profile_model(model, estimate_opts, roles=chosen)
    else:
        chosen = _check_profile(profile, quiet, dtype, roles)
    twin = None
    if round_to != DEFAULT_ROUND_TO:  # NOTE [ Confirm like with like ]
        twin = get_backend("estimate", reserve_bytes=0, round_to=round_to)
        depth, extrapolate = depth_plan(config, twin, quiet.depth_extrapolation)
        builder = RoleBuilder(config, twin, dtype, quiet, extrapolate, depth)
    points: dict[str, ConfirmPoint] = {}
    for role in chosen:
        budget = profile.budgets[role]
        point = budget.binding_point
        if point is None:  # pragma: no cover - a found budget always has one
            raise InvalidArgument(f"the {role} budget has no binding point to confirm; profile again")
        size = point.max_batch_size if budget.cost == "padded" else point.tokens
        lengths = tuple(candidate_lengths(size, point.seq_len, budget.cost))
        peak, breakdown = point.peak_bytes, dict(point.breakdown)
        if twin is not None:
            with simulated_world_for(twin, sharding):
                step = builder.step(role)
                try:
                    m = step.measure(list(lengths))
                finally:
                    del step
                    gc.collect()
            peak, breakdown = m.peak_bytes, dict(m.breakdown)
        points[role] = ConfirmPoint(
            role=role,
            cost=budget.cost,
            seq_len=point.seq_len,
            lengths=lengths,
            tokens=sum(lengths) if budget.cost == "packed" else len(lengths) * point.seq_len,
            profiled_peak_bytes=point.peak_bytes,
            estimated_peak_bytes=peak,
            estimated_breakdown=breakdown,
            budget_limit_bytes=budget.limit_bytes,
            safety_margin=budget.safety_margin,
        )
    return ConfirmPlan(
        model=name,
        config=config,
        options=quiet,
        dtype=dtype,
        profile=profile,
        backend=backend,
        memory_limit=memory,
        reserve_bytes=reserve,
        round_to=round_to,
        untracked_bytes=untracked,
        points=points,
        seconds=time.perf_counter() - start,
    )


def run_confirm(plan: ConfirmPlan, *, check: bool = True) -> ConfirmReport:
    """The measured half of a confirm: the real step, full depth, once per role at the planned shape.

    On one process, or on every rank of a real process group of ``sharding.world_size`` ranks
    (all ranks pass the same plan; each builds and shards the model, runs the step, and one
    all-reduce per role agrees on the verdict, so no rank hangs when another runs out of memory).
    The report's breakdowns are this rank's (rank 0's matches the estimate's simulated rank 0).

    Returns:
        :class:`ConfirmReport`.

    Raises:
        InvalidArgument: a sharded plan without a real process group of its world size.
        DoesNotFitError: (``check``) a run did not fit; its ``report`` attribute holds the report.
    """
    if not isinstance(plan, ConfirmPlan):
        raise InvalidArgument(
            f"plan must be a ConfirmPlan, but got a {type(plan).__name__}; make one with plan_confirm(model, options)"
        )
    sharding = plan.options.sharding
    world = get_world_size() if is_distributed() else 1
    if sharding.distributed and world != sharding.world_size:
        n = sharding.world_size
        raise InvalidArgument(
            f"a sharded confirm (sharding={sharding.strategy!r} over {_ranks(n)}) runs on {n} real ranks, but this "
            f"process is one of {world}; launch torchrun --nproc-per-node {n} batchfit profile --confirm ... "
            "(gloo on cpu, nccl on cuda), or use sharding='none' in one process"
        )
    check_same_arguments(
        {role: p.lengths for role, p in plan.points.items()},
        what="the confirm runs (plan_confirm on every rank)",
    )
    device = get_backend(plan.backend, memory_limit=plan.memory_limit, reserve_bytes=plan.reserve_bytes)
    depth = int(plan.config.num_hidden_layers)
    builder = RoleBuilder(plan.config, device, plan.dtype, plan.options, False, depth)
    tracked = not device.reads_device
    results: dict[str, RoleConfirmation] = {}
    with device.probing():  # NOTE [ Probing reuses host pages ]
        for role, point in plan.points.items():
            step = agree(lambda role=role: builder.step(role), what=f"building the {role} model")
            error: BaseException | None = None
            measured = None
            try:
                measured = step.measure(list(point.lengths))
            except Exception as exc:  # agreed across ranks below; re-raised on this rank
                error = exc
            finally:
                del step
                gc.collect()
            mine = [0, 1] if measured is None else [measured.footprint_bytes, int(not measured.fits)]
            # one all-reduce: the verdict on every rank, and this rank's own error re-raised
            top, failed = agreed_max(mine, error, what=f"the {role} confirm run")
            if measured is None:  # pragma: no cover - agreed_max raised
                raise RuntimeError(f"the {role} confirm run returned no measurement")
            results[role] = RoleConfirmation(
                role=role,
                cost=point.cost,
                seq_len=point.seq_len,
                lengths=point.lengths,
                tokens=point.tokens,
                categories=_compare(point.estimated_breakdown, measured.breakdown, tracked),
                estimated_peak_bytes=point.estimated_peak_bytes,
                measured_peak_bytes=measured.peak_bytes,
                profiled_peak_bytes=point.profiled_peak_bytes,
                reserved_bytes=measured.reserved_bytes,
                limit_bytes=plan.memory_limit - plan.reserve_bytes,
                budget_limit_bytes=point.budget_limit_bytes,
                safety_margin=point.safety_margin,
                fits=not failed,
                exceeded=measured.exceeded,
                max_rank_bytes=top,
                seconds=measured.seconds,
            )
    untracked = plan.untracked_bytes
    if device.reads_device:
        after = _untracked_bytes(device)
        (after,) = agreed_max([after], None, what="reading the device's memory")
        untracked = max(untracked or 0, after)
    report = ConfirmReport(
        profile=plan.profile,
        model=plan.model,
        backend=plan.backend,
        device=_device_name(device),
        memory_limit=plan.memory_limit,
        reserve_bytes=plan.reserve_bytes,
        round_to=plan.round_to,
        profiled_round_to=DEFAULT_ROUND_TO,
        roles=results,
        untracked_bytes=untracked,
        world_size=world,
        differences=_differences(plan),
        estimate_seconds=plan.seconds,
        # the setting the caching allocator ran with (NOTE [ The allocator setting ]); a cpu run has none
        allocator=process_allocator_setting() if device.reads_device else "",
    )
    if check and not report.fits:
        raise report.error()  # type: ignore[misc]
    return report


def _check_profile(
    profile: ModelProfile, options: ProfileOptions, dtype: Any, roles: str | Sequence[str] | None
) -> tuple[str, ...]:
    """The roles to confirm of a given profile; it must be an estimate made with ``options``' settings."""
    if not isinstance(profile, ModelProfile):
        raise InvalidArgument(
            f"profile must be a ModelProfile, but got a {type(profile).__name__}; pass profile_model(...)'s result"
        )
    if not backend_class(profile.backend).simulated:
        raise InvalidArgument(
            f"a confirm compares an estimate with a real run, but the profile was measured on "
            f"backend={profile.backend!r}; profile with backend='estimate' (or pass no profile)"
        )
    cost = next(iter(profile.budgets.values())).cost
    ours = {
        "sharding": options.sharding,
        "gradient_checkpointing": options.gradient_checkpointing,
        "logprobs": options.logprobs,
        "cost": options.cost,
        "dtype": str(dtype).removeprefix("torch."),
    }
    theirs = {
        "sharding": profile.sharding,
        "gradient_checkpointing": profile.gradient_checkpointing,
        "logprobs": profile.logprobs,
        "cost": cost,
        "dtype": profile.dtype,
    }
    for key, want in ours.items():
        if theirs[key] != want:
            raise InvalidArgument(
                f"the profile was made with {key}={theirs[key]!r} but options say {key}={want!r}; confirm with "
                "the options the profile was made with, or pass no profile to estimate again"
            )
    if roles is None:
        return tuple(profile.budgets)
    chosen = check_roles(roles)
    missing = [r for r in chosen if r not in profile.budgets]
    if missing:
        raise InvalidArgument(
            f"roles names {missing[0]!r}, which the profile has no budget for (it has {', '.join(profile.budgets)}); "
            "confirm its roles or profile that role too"
        )
    return chosen


def _compare(
    estimated: dict[str, int], measured: dict[str, int], tracked: bool
) -> tuple[CategoryConfirmation, ...]:
    """Category by category; on cuda the estimate's untracked categories are summed into activations.

    See NOTE [ Confirm like with like ].
    """
    if not tracked:
        folded: dict[str, int] = {}
        for cat, n in estimated.items():
            key = cat if cat in REGISTERED_CATEGORIES else ACTIVATIONS
            folded[key] = folded.get(key, 0) + n
        estimated = folded
    names = list(dict.fromkeys([*estimated, *measured]))
    return tuple(CategoryConfirmation(c, int(estimated.get(c, 0)), int(measured.get(c, 0))) for c in names)


def _untracked_bytes(device: Any) -> int:
    """cuda: bytes in use on the device outside torch's caching allocator (``total − free − reserved``)."""
    free, total = torch.cuda.mem_get_info(device.device)
    return max(0, int(total) - int(free) - int(torch.cuda.memory_reserved(device.device)))


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _device_name(device: Any) -> str:
    if device.reads_device:
        return str(torch.cuda.get_device_name(device.device))
    return "cpu"


def _differences(plan: ConfirmPlan) -> tuple[str, ...]:
    """What differs between the compared estimate, the budget search and the run (NOTE [ Confirm like with like ])."""
    out = []
    limit = (
        f"both sides use the device's memory {format_bytes(plan.memory_limit)} and reserve "
        f"{format_bytes(plan.reserve_bytes)}"
    )
    if not backend_class(plan.backend).reads_device:
        out.append(
            f"estimate and run share one tracker; the estimate is compared at the cpu run's rounding "
            f"({plan.round_to} B), the budget search rounded storages to {DEFAULT_ROUND_TO} B (its peak beside "
            f"each run); {limit}"
        )
    else:
        out.append(
            f"estimate and search round storages to {DEFAULT_ROUND_TO} B, as the caching allocator does; {limit} "
            "(the reserve measured outside torch's allocator unless given)"
        )
        out.append(
            "cuda's breakdown knows the registered state only: the estimate's other categories are summed into "
            "activations; reserved − allocated and the memory outside torch's allocator are what no estimate sees"
        )
    if plan.profile.measured_depths:
        k1, k2 = plan.profile.measured_depths
        out.append(
            f"the estimate extrapolated {plan.profile.depth} layers from {k1} and {k2}; the run has all "
            f"{plan.profile.depth}"
        )
    return tuple(out)


__all__ = [
    "CONFIRM_BACKENDS",
    "CategoryConfirmation",
    "ConfirmPlan",
    "ConfirmPoint",
    "ConfirmReport",
    "RoleConfirmation",
    "confirm_profile",
    "plan_confirm",
    "run_confirm",
]
