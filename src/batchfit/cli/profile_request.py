"""``batchfit profile``'s request: its flags checked once and resolved (defaults, ``--config``, ``--calibration``).

:func:`request_from_args` builds one frozen :class:`ProfileRequest` from argparse's namespace
(which it never changes), failing fast on bad values before any model is built. The settings
that reach the library are checked by the library, named in this command's flags (:data:`FLAGS`);
what only the command line knows (torchrun's ranks, which flags go together, the files it
reads) is checked here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchfit.budget.model_profile import check_roles
from batchfit.budget.options import ProfileOptions
from batchfit.cli._ranks import launched_world
from batchfit.cli.flag_words import as_flags
from batchfit.cli.sequence_parallel import check_sequence_parallel
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.frameworks.config_options import ProfileChoices
from batchfit.frameworks.run import RunConfig
from batchfit.memory import DEFAULT_ESTIMATE_TARGET, backend_class

if TYPE_CHECKING:
    from batchfit.memory.calibration import CalibratedLimits
    from batchfit.models.lora import LoraSpec

# train it (FSDP2, fp32 master weights with bf16 compute, activation checkpointing).
DEFAULT_MODEL = "qwen2.5-7b"
# The cpu backend really runs the model on this host: its default is the toy preset.
DEFAULT_CPU_MODEL = "tiny"
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_ESTIMATE_WORLD_SIZE = 8
# The command line checkpoints every layer unless told not to (or the config says otherwise), as
# the frameworks' 7B recipes do; the library's ProfileOptions leaves it off unless asked.
DEFAULT_GRADIENT_CHECKPOINTING = True
# The most ranks the estimate backend simulates (torch's process groups count ranks in a C int;
# a million GPUs is beyond any run).
MAX_ESTIMATE_WORLD_SIZE = 2**20

#: The library's keyword names → this command's flags: the settings its errors name are written
#: as these flags (NOTE [ Messages in the caller's vocabulary ] in :mod:`batchfit.errors`).
FLAGS = {
    "max_seq_len": "--max-seq-len",
    "experts_implementation": "--experts-implementation",
    "compare_routing": "--compare-routing",
    "memory_limit": "--memory",
    "reserve_bytes": "--reserve",
    "safety_margin": "--safety-margin",
    "allocator": "--allocator",
    "engine_reserve": "--engine-reserve",
    "backend": "--backend",
    "sharding": "--sharding",
    "world_size": "--world-size",
    "offload": "--offload",
    "sequence_parallel": "--sequence-parallel",
    "mixed_precision": "--mixed-precision",
    "dtype": "--dtype",
    "gradient_checkpointing": "--gradient-checkpointing",
    "activation_offload": "--activation-offload",
    "roles": "--roles",
    "logprobs": "--logprobs",
    "response_only": "--response-only",
    "lora_rank": "--lora-rank",
    "response_fraction": "--response-fraction",
    "cost": "--cost",
    "depth_extrapolation": "--depth-extrapolation",
    "emit": "--emit",
}


def _check_context_parallel(size: int | None) -> None:
    """Refuse ring attention (``--context-parallel`` above 1) in one line, with the reason and the flag that serves.

    NOTE [ Ring attention is refused ]: PyTorch's own ring attention
    (``torch.distributed.tensor.experimental.context_parallel``) dispatches only the CUDA sdpa kernels;
    on the CPU (gloo, and the estimate's fake tensors) it raises "Operator
    aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
    registered" (torch 2.13), and it takes no packed rows (no per-sequence boundaries), so batchfit
    cannot run it, measure it or estimate it. Ulysses (``--sequence-parallel``) gives each rank the
    same share of the tokens.

    Raises:
        InvalidArgument: ``size`` is not a positive int, or above 1.
    """
    if size is None:
        return
    from batchfit.validation import check_int

    check_int("--context-parallel", size, minimum=1)
    if size > 1:
        raise InvalidArgument(
            f"--context-parallel {size} (ring attention) is not modelled: PyTorch's context_parallel runs only CUDA's "
            "sdpa kernels (no CPU, no estimate) and no packed rows; use --sequence-parallel "
            f"{size} (Ulysses: the same tokens per rank)"
        )


@dataclass(frozen=True)
class ProfileRequest:
    """One ``batchfit profile`` command, its flags checked and resolved: what to profile, how, and how to show it.

    Attributes:
        model: the model profiled without ``--config`` (a preset, directory or hub id); with
            it, ``run.models`` names each role's.
        roles: the passes profiled without ``--config`` (with it, every pass the run makes).
        options: what the library profiles with (its ``progress`` off: each run mode sets its own).
        run: the ``--config`` run as profiled, or ``None``.
        notes: how the profile models the framework's step (``--config``), one sentence each.
        config: the ``--config`` path, or ``None``.
        emit: the framework whose keys ``--emit`` writes, or ``None``.
        emit_format: ``yaml`` or ``overrides``.
        confirm: ``--confirm``: run the real step at each estimated budget.
        calibration_path: ``--calibration FILE``, written with ``--confirm``, else read.
        calibration: the limits read from ``calibration_path`` (without ``--confirm``), or ``None``.
        memory_defaulted: the estimate's target device is the default (no ``--memory``).
        launched: the ranks torchrun launched (1 without it).
        json: print the result as JSON.
        plot: the ``--plot`` file, or ``None``.
        progress: show progress (when not ``--json`` and on rank 0).
    """

    model: str
    roles: tuple[str, ...]
    options: ProfileOptions
    run: RunConfig | None = None
    notes: tuple[str, ...] = ()
    config: str | None = None
    emit: str | None = None
    emit_format: str = "yaml"
    confirm: bool = False
    calibration_path: str | None = None
    calibration: CalibratedLimits | None = None
    memory_defaulted: bool = False
    launched: int = 1
    json: bool = False
    plot: str | None = None
    progress: bool = True

    @property
    def backend(self) -> str:
        """The backend profiled on (``auto`` resolved)."""
        return self.options.backend

    @property
    def memory(self) -> int | str | None:
        """The device memory per rank as given (a size or a preset), calibrated (bytes), or ``None`` (the device's)."""
        return self.options.memory_limit


def request_from_args(args: argparse.Namespace) -> ProfileRequest:
    """The :class:`ProfileRequest` of ``batchfit profile``'s parsed flags (``args`` is left as it is).

    Raises:
        InvalidArgument: bad backend, memory, world size, sharding, roles or dtype (one
            line each, exit 2), or a world size that is not the torchrun group's.
        BatchConfigError: the ``--config`` cannot be read (one line per fault).
    """
    from batchfit.frameworks.emit import FORMATS
    from batchfit.memory import BACKEND_NAMES, backend_name, parse_memory
    from batchfit.models import load_config, parse_dtype
    from batchfit.validation import check_choice, check_int

    for flag, value in (("--memory", args.memory), ("--reserve", args.reserve), ("--engine-reserve", args.engine_reserve)):
        check_size_text(flag, value)
    backend = backend_name(check_choice("--backend", args.backend, BACKEND_NAMES))
    check_choice("--emit-format", args.emit_format, FORMATS)
    run = _read_config(args)
    limits = _calibration(args, backend)
    memory = args.memory
    if memory is None and limits is not None:
        memory = limits.memory_limit  # the calibrated device
    defaulted = memory is None and backend_class(backend).simulated
    if defaulted:
        memory = DEFAULT_ESTIMATE_TARGET
    reserve = _reserve(args.reserve) if limits is None else limits.reserve_bytes
    if memory is not None:
        parse_memory(memory, name="--memory")
    elif backend_class(backend).host_memory:
        raise InvalidArgument(
            "--memory is required with --backend cpu (the host has no device limit to fit), but got no "
            "--memory; pass e.g. --memory 2GiB, or use --backend estimate to predict a GPU"
        )
    model = args.model if args.model is not None else DEFAULT_CPU_MODEL if backend_class(backend).host_memory else DEFAULT_MODEL
    launched = launched_world()
    if backend_class(backend).simulated:
        if launched > 1:
            raise InvalidArgument(
                f"--backend estimate simulates --world-size ranks in one process, but this process is one of "
                f"WORLD_SIZE={launched} torchrun ranks; run it without torchrun, or use --backend cpu or cuda"
            )
        world = args.world_size  # else the config's, else the default
        default_world = DEFAULT_ESTIMATE_WORLD_SIZE
    else:
        world = launched if args.world_size is None else args.world_size  # never the config's: the group's
        default_world = launched
    _check_response_flags(args)
    _check_context_parallel(args.context_parallel)
    check_sequence_parallel(args.sequence_parallel, args.world_size, run, model, default_world)
    chosen = ProfileChoices(
        max_seq_len=args.max_seq_len,
        backend=backend,
        memory_limit=memory,
        reserve_bytes=reserve,
        dtype=args.dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        activation_offload=getattr(args, "activation_offload", None),
        logprobs=args.logprobs,
        cost=args.cost,
        safety_margin=args.safety_margin if limits is None else limits.safety_margin,
        depth_extrapolation=args.depth_extrapolation,
        response_only=args.response_only,
        response_fraction=args.response_fraction,
        strategy=args.sharding,
        world_size=world,
        reshard_after_forward=args.reshard_after_forward,
        mixed_precision=args.mixed_precision,
        offload=args.offload,
        sequence_parallel=args.sequence_parallel,
        allocator=args.allocator if limits is None else _calibrated_allocator(args.allocator, limits),
        engine_reserve=args.engine_reserve,
    )
    defaults = ProfileChoices(
        max_seq_len=DEFAULT_MAX_SEQ_LEN,
        gradient_checkpointing=DEFAULT_GRADIENT_CHECKPOINTING,
        world_size=default_world,
        # with --config the config's strategy; else FSDP2 wherever there are ranks to shard over
        strategy="fsdp2" if backend_class(backend).simulated or (world or default_world) > 1 else "none",
    )
    vocabulary = Vocabulary(FLAGS)
    notes: tuple[str, ...] = ()
    if run is None:
        try:
            options = chosen.or_(defaults).options(vocabulary)
        except InvalidArgument as exc:  # Sharding's checks speak keywords: name the flags (issue 40)
            words = {k: v for k, v in FLAGS.items() if k != "dtype"}  # "trains in its dtype" is prose
            raise InvalidArgument(as_flags(str(exc), {**words, "strategy": "--sharding"})) from None
    else:
        from batchfit.frameworks.config_options import run_profile_options

        config = run_profile_options(run, chosen, defaults, emit=args.emit, vocabulary=vocabulary)
        run, options, notes = config.run, config.options, config.notes
    sharding = options.sharding
    if backend_class(backend).simulated:
        check_int("--world-size", sharding.world_size, minimum=1, maximum=MAX_ESTIMATE_WORLD_SIZE)
    elif sharding.world_size != launched:
        raise InvalidArgument(
            f"--world-size must equal the number of launched ranks with --backend {backend} "
            f"(WORLD_SIZE={launched}), but got --world-size {sharding.world_size}; launch with torchrun --nproc-per-node "
            f"{sharding.world_size} (or drop --world-size), or use --backend estimate to simulate {sharding.world_size} ranks"
        )
    if memory is not None:
        check_reserve_fits(memory, reserve, backend, sharding.world_size if sharding.distributed else 1)
    # a one-rank cpu profile runs over a simulated group of one (budget.profile.simulated_world_for);
    # cuda, and a confirm's real step, need the ranks torchrun starts
    if (
        sharding.distributed
        and not backend_class(backend).simulated
        and sharding.world_size == 1
        and launched == 1
        and (backend_class(backend).reads_device or args.confirm)
    ):
        raise InvalidArgument(
            f"--sharding {sharding.strategy} with --backend {backend} runs on real ranks: launch with torchrun "
            f"--nproc-per-node N batchfit profile ..., or use --backend estimate --world-size N"
        )
    # profile_model checks its roles too, in its keywords' words
    roles = check_roles(args.roles, "--roles") if args.roles is not None else ("policy",)
    if args.dtype is not None:
        parse_dtype(args.dtype)
    if run is None:
        load_config(model)
    else:
        for role, role_model in run.models.items():
            _check_config_model(role, role_model, run)
    lora = _lora(args, model if run is None else run.models.get("policy"))
    if lora is not None:
        options = options.replace(lora=lora)
    options = _experts(args, options)
    if args.plot:
        from batchfit.cli.render_budget import require_matplotlib

        require_matplotlib(args.plot)
    return ProfileRequest(
        model=model,
        roles=roles,
        options=options,
        run=run,
        notes=notes,
        config=args.config,
        emit=args.emit,
        emit_format=args.emit_format,
        confirm=args.confirm,
        calibration_path=args.calibration,
        calibration=limits,
        memory_defaulted=defaulted,
        launched=launched,
        json=args.json,
        plot=args.plot,
        progress=args.progress,
    )


MAX_SIZE_TEXT = 64
"""Longest ``--memory``/``--reserve`` text read as a size: ``80GiB`` is 5 characters, a preset about 12."""


def check_size_text(flag: str, value: Any) -> None:
    """Refuse a ``--memory``/``--reserve`` string too long to be a size (5,000 digits overflow a float).

    Raises:
        InvalidArgument: naming the flag, the start of the value and what a size looks like.
    """
    from batchfit.validation import short_repr

    if isinstance(value, str) and len(value) > MAX_SIZE_TEXT:
        raise InvalidArgument(
            f"{flag} is not a memory size: got {len(value):,} characters ({short_repr(value, 20)}); pass bytes, "
            "a size such as 80GiB, or a device preset such as h100-80gb"
        )


def check_reserve_fits(memory: Any, reserve: int | None, backend: str, world: int) -> None:
    """Refuse a ``--memory`` the reserve leaves nothing of, naming a default reserve as the default it is.

    Args:
        memory: ``--memory`` as given (a size or a preset), or a calibrated byte count.
        reserve: ``--reserve`` in bytes, ``None`` for the backend's default (the estimate backend:
            CUDA context, workspaces and, over more than one rank, NCCL's buffers; cpu: 0).
        backend: the backend's name.
        world: the ranks the model is sharded over (NCCL's buffers when > 1).

    Raises:
        InvalidArgument: the reserve is at least ``memory``; a default reserve is said to be the
            default, with ``--reserve`` to change it (never a byte count the user did not pass).
    """
    from batchfit.memory import format_bytes, parse_memory, untracked_memory

    total = parse_memory(memory, name="--memory")
    if reserve is not None:
        if reserve >= total:
            raise InvalidArgument(
                f"--memory {memory} leaves nothing once --reserve {format_bytes(reserve)} is taken off; raise "
                "--memory or lower --reserve (e.g. --reserve 0)"
            )
        return
    if not backend_class(backend).simulated:
        return  # cpu: no reserve; cuda: measured on the device
    untracked = untracked_memory(str(memory), world_size=world, total_bytes=total)
    if untracked.reserve_bytes >= total:
        ranks = f" over {world} ranks" if world > 1 else ""
        raise InvalidArgument(
            f"--memory {memory} ({format_bytes(total)}) leaves nothing once the default reserve of "
            f"{format_bytes(untracked.reserve_bytes)} is taken off (what no tracker sees on a GPU{ranks}: "
            f"{untracked.describe()}); raise --memory, or pass --reserve SIZE (e.g. --reserve 0) to set it yourself"
        )


def _experts(args: argparse.Namespace, options: ProfileOptions) -> ProfileOptions:
    """``--experts-implementation`` into the options; ``--expert-parallel`` above 1 refused (NOTE [ Expert parallelism is not modelled ] in batchfit.models.moe).

    Raises:
        InvalidArgument: an unknown implementation, or ``--expert-parallel N`` with ``N > 1``.
    """
    from batchfit.models.moe import check_expert_parallel, check_experts_implementation

    check_expert_parallel("--expert-parallel", getattr(args, "expert_parallel", None))
    if getattr(args, "compare_routing", False):
        options = options.replace(compare_routing=True)
    chosen = getattr(args, "experts_implementation", None)
    if chosen is None:
        return options
    return options.replace(experts_implementation=check_experts_implementation("--experts-implementation", chosen))


def _lora(args: argparse.Namespace, model: Any) -> LoraSpec | None:
    """``--lora-rank/--lora-alpha/--lora-targets`` as a :class:`~batchfit.models.lora.LoraSpec` (``None`` without them).

    The targets are checked against the policy's model now (built on the meta device), before
    any probe.

    Raises:
        InvalidArgument: a bad value, ``--lora-alpha``/``--lora-targets`` without ``--lora-rank``,
            targets that match no module, or PEFT not installed (one line each).
    """
    from batchfit.models import load_config
    from batchfit.models.lora import lora_parameters, lora_spec

    if args.lora_rank is None:
        for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-targets", args.lora_targets)):
            if value is not None:
                raise InvalidArgument(
                    f"{flag} needs --lora-rank N (the adapters' rank), but got {flag} without it"
                )
        return None
    names = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets"}
    spec = lora_spec(args.lora_rank, args.lora_alpha, args.lora_targets, names=names)
    if spec.enabled:
        lora_parameters(load_config(model), spec, name="--lora-targets")
    return spec


def _calibration(args: argparse.Namespace, backend: str) -> CalibratedLimits | None:
    """Check ``--confirm`` and ``--calibration``; read the calibration when profiling with it.

    Returns:
        The :class:`~batchfit.memory.calibration.CalibratedLimits` of ``--calibration FILE``
        without ``--confirm``, else ``None``.

    Raises:
        InvalidArgument: ``--confirm`` with ``--config`` or without a real device, a
            ``--calibration`` folder that does not exist (with ``--confirm``), ``--reserve`` or
            ``--safety-margin`` beside a calibration to read, or a bad calibration file (one line each).
    """
    from pathlib import Path

    from batchfit.memory.calibration import calibrated_limits, load_calibration

    path = args.calibration
    if args.confirm:
        if args.config is not None:
            raise InvalidArgument(
                "--confirm runs one model's step and cannot be combined with --config; confirm each model with "
                "--model and the config's settings as flags"
            )
        if backend_class(backend).simulated:
            chose = " (auto chose estimate: no GPU here)" if args.backend == "auto" else ""
            raise InvalidArgument(
                f"--confirm runs the real step on a device, but got --backend {args.backend}{chose}; use "
                "--backend cpu --memory SIZE (real CPU tensors) or --backend cuda on a GPU"
            )
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise InvalidArgument(
                f"--calibration {path!r}: the folder {str(Path(path).parent)!r} does not exist; create it or write "
                "the calibration elsewhere"
            )
        return None
    if path is None:
        return None
    for flag, value in (("--reserve", args.reserve), ("--safety-margin", args.safety_margin)):
        if value is not None:
            raise InvalidArgument(
                f"{flag} cannot be combined with --calibration {path} (the calibration sets the reserve and the "
                f"safety margin); drop {flag}, or drop --calibration to set them by hand"
            )
    from batchfit.fileio import parse_json, read_text

    what = f"calibration file {str(path)!r}"
    if Path(path).exists():  # bounded first (NOTE [ Untrusted input files ]); the loader names a missing file
        parse_json(read_text(path, what), what)
    limits = calibrated_limits(load_calibration(path))
    cal = limits.calibration
    if backend != cal.backend and not backend_class(backend).simulated:  # the estimate takes any device's
        raise InvalidArgument(
            f"--calibration {path} was measured on {cal.backend} and does not apply to --backend {backend}; use "
            f"--backend {cal.backend} or estimate, or calibrate this device with --confirm --backend {backend} "
            f"--calibration FILE"
        )
    return limits


def _calibrated_allocator(chosen: str | None, limits: CalibratedLimits) -> str | None:
    """The allocator a calibrated profile assumes: the one its runs had (NOTE [ The allocator setting ] in
    :mod:`batchfit.memory.calibration`); ``--allocator`` must agree with it.

    Raises:
        InvalidArgument: ``--allocator`` names another setting than the calibration's runs had.
    """
    measured = limits.calibration.allocator or None
    if chosen is not None and measured is not None and chosen != measured:
        raise InvalidArgument(
            f"--allocator {chosen} differs from the calibration's ({measured}: its margin was measured under it); drop "
            f"--allocator, or calibrate under {chosen} (profile --confirm --calibration FILE with that setting)"
        )
    return chosen or measured


def _read_config(args: argparse.Namespace) -> RunConfig | None:
    """The ``--config`` run (``--model`` replacing its policy's model), or ``None`` without ``--config``.

    Raises:
        InvalidArgument: ``--emit`` without ``--config``, ``--roles`` with it.
        BatchConfigError: the config cannot be read (one line per fault).
    """
    if args.config is None:
        if args.emit is not None:
            raise InvalidArgument(
                "--emit needs --config (the framework config whose keys to write); pass --config FILE"
            )
        return None
    from batchfit.frameworks import read_run_config

    if args.roles is not None:
        raise InvalidArgument(
            "--roles cannot be combined with --config: the config says which models run (drop --roles)"
        )
    run = read_run_config(args.config)
    return run if args.model is None else run.replace(model=args.model)


def _check_response_flags(args: argparse.Namespace) -> None:
    """``--response-fraction`` needs ``--response-only`` and a share in ``(0, 1]``."""
    from batchfit.budget.causal_lm_probe import check_response_fraction

    if args.response_fraction is None:
        return
    if not args.response_only:
        raise InvalidArgument(
            f"--response-fraction {args.response_fraction:g} is read only by the response-only head; add --response-only"
        )
    check_response_fraction(args.response_fraction, "--response-fraction")


def _check_config_model(role: str, model: Any, run: Any) -> None:
    """The config's model must load: name the key it came from and the override."""
    from batchfit.models import load_config

    if not model:
        raise InvalidArgument(f"the config names no {role} model; pass --model PRESET|DIR")
    try:
        load_config(model)
    except InvalidArgument as exc:
        if role == "critic":  # --model replaces the policy's model (and so the reference's) only
            where = "read from the critic's model path in the config; --model sets the policy's model only: set the critic's path there"
        else:
            where = f"read from {run.source.get('model', 'the config')}; --model overrides it"
        raise InvalidArgument(f"{exc} ({where})") from None


def _reserve(value: str | None) -> int | None:
    """``--reserve`` in bytes (``0`` allowed), ``None`` when not given (the backend's default)."""
    from batchfit.memory import parse_memory

    if value is None:
        return None
    if value.strip() in ("0", "0B", "0b"):
        return 0
    return parse_memory(value, name="--reserve")
