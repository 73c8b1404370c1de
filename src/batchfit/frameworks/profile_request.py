"""A profile request resolved once: :func:`resolve_request` turns the settings a caller chose into a :class:`ProfileRequest`.

NOTE [ One resolver for every caller ]
``batchfit profile`` parses its flags into the table's keywords (NOTE [ One table of profile
settings ] in :mod:`batchfit.budget.settings`) and calls :func:`resolve_request`; a Python caller
calls it with the same keywords. Every policy of a request is applied here, once, before any model
is built: the backend (``auto`` resolved), the device memory and reserve read to bytes
(:func:`batchfit.memory.device_memory.resolve_device_memory`), a ``--config`` read and merged
(:func:`batchfit.frameworks.config_options.run_profile_options`), a calibration read, the world
and sharding rules (torchrun's ranks, the simulated world's bound), the roles, the model's config,
LoRA's targets on a meta model, the experts. Messages name each setting in the caller's
vocabulary: the command line's flags (:func:`batchfit.budget.settings.flag_vocabulary`) or
keywords. :meth:`ProfileRequest.profile` then makes the one library call, and its
:class:`ProfileAnswer`'s :meth:`~ProfileAnswer.to_dict` is the document ``--json`` prints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchfit.budget.choices import Choices
from batchfit.budget.options import ProfileOptions
from batchfit.budget.settings import (
    DEFAULT_CPU_MODEL,
    DEFAULT_ESTIMATE_WORLD_SIZE,
    DEFAULT_GRADIENT_CHECKPOINTING,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MODEL,
    MAX_ESTIMATE_WORLD_SIZE,
    SETTINGS,
)
from batchfit.budget.side_by_side import check_jobs
from batchfit.errors import KEYWORDS, InvalidArgument, Setting, Vocabulary
from batchfit.frameworks.run import RunConfig
from batchfit.memory import backend_class
from batchfit.parallel.sharding import MODEL_PARALLEL_STRATEGIES

if TYPE_CHECKING:
    from batchfit.budget.model_profile import ModelProfile
    from batchfit.frameworks.run_profile import RunProfile
    from batchfit.memory.calibration import CalibratedLimits
    from batchfit.models.lora import LoraSpec

__all__ = ["ProfileAnswer", "ProfileRequest", "confirm_document", "launched_world", "resolve_request"]


def launched_world() -> int:
    """Ranks torchrun launched this process among (``WORLD_SIZE``), 1 without torchrun."""
    raw = os.environ.get("WORLD_SIZE", "1")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


@dataclass(frozen=True)
class ProfileRequest:
    """One profile request, its settings checked and resolved: what to profile, how, and how to show it.

    Attributes:
        model: the model profiled without ``config`` (a preset, directory or hub id); with
            it, ``run.models`` names each role's.
        roles: the passes profiled without ``config`` (with it, every pass the run makes).
        options: what the library profiles with (its ``progress`` off: each run mode sets its own).
        run: the ``config`` run as profiled, or ``None``.
        notes: how the profile models the framework's step (``config``), one sentence each.
        config: the config path, or ``None``.
        emit: the framework whose keys to write, or ``None``.
        emit_format: ``yaml`` or ``overrides``.
        confirm: run the real step at each estimated budget.
        calibration_path: the calibration file, written with ``confirm``, else read.
        calibration: the limits read from ``calibration_path`` (without ``confirm``), or ``None``.
        memory_defaulted: the estimate's target device is the default (no memory named).
        launched: the ranks torchrun launched (1 without it).
        json: print the result as JSON.
        plot: the plot's file, or ``None``.
        progress: show progress (when not ``json`` and on rank 0).
        cache: :meth:`profile` answers estimates from the profile cache when it can (NOTE [ A profile is a
            function of its inputs ] in :mod:`batchfit.budget.profile_cache`); on unless ``--no-cache``.
        jobs: the processes :meth:`profile` measures a probe in (NOTE [ Shallow copies measured side by
            side ] in :mod:`batchfit.budget.side_by_side`): ``None`` = 2 where two CPUs are free, else 1.
        vocabulary: how this request's messages name its settings.
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
    cache: bool = True
    jobs: int | None = None
    vocabulary: Vocabulary = field(default=KEYWORDS, compare=False, repr=False)

    @property
    def backend(self) -> str:
        """The backend profiled on (``auto`` resolved)."""
        return self.options.backend

    @property
    def memory(self) -> int | str | None:
        """The device memory per rank as given (a size or a preset), calibrated (bytes), or ``None`` (the device's)."""
        return self.options.memory_limit

    def profile(self, progress: bool | Callable[..., Any] = False) -> ProfileAnswer:
        """Profile the request (a model's roles, or the config's run with its emitted keys): one library call.

        Args:
            progress: as :class:`ProfileOptions`' ``progress``.

        Raises:
            InvalidArgument: the request is a ``confirm`` (:func:`batchfit.budget.confirm.plan_confirm` runs it),
                or an emit target cannot carry the run.
            DoesNotFitError: a role does not fit one sequence.
        """
        if self.confirm:
            raise InvalidArgument(
                "a confirm request runs on the device's ranks: call batchfit.budget.confirm.plan_confirm and "
                "run_confirm (batchfit profile --confirm does)"
            )
        from batchfit.budget.profile_cache import caching
        from batchfit.budget.side_by_side import side_by_side

        with caching(enabled=self.cache), side_by_side(self.jobs):
            return self._profile(self.options.replace(progress=progress))

    def _profile(self, options: ProfileOptions) -> ProfileAnswer:
        if self.run is None:
            from batchfit.budget.model_profile import profile_model

            return ProfileAnswer(self, profile=profile_model(self.model, options, roles=self.roles))
        from batchfit.frameworks.emit import check_emit, emit_keys
        from batchfit.frameworks.older_torch import older_torch_notes
        from batchfit.frameworks.run_profile import profile_run

        if self.emit is not None:  # what the target cannot carry is refused before any probe
            check_emit(self.run, self.options, self.emit)
        result = profile_run(self.run, options)
        notes = (*self.notes, *older_torch_notes(result), *result.notes)
        keys = None
        if self.emit is not None:
            keys = tuple(
                emit_keys(result, self.emit, max_seq_len=self.options.max_seq_len, margin=self.options.safety_margin)
            )
        return ProfileAnswer(self, result=result, notes=notes, keys=keys)


@dataclass(frozen=True)
class ProfileAnswer:
    """What a :class:`ProfileRequest` found: a model's profile, or a run's with the keys to emit.

    Attributes:
        request: the request answered.
        profile: the model's profile (no config), else ``None``.
        result: the run's profile (a config), else ``None``.
        notes: how the profile models the framework's step, the older torch's and the run's notes.
        keys: the emitted keys (``request.emit``), else ``None``.
    """

    request: ProfileRequest
    profile: ModelProfile | None = None
    result: RunProfile | None = None
    notes: tuple[str, ...] = ()
    keys: tuple[Any, ...] | None = None

    @property
    def budgets(self) -> Any:
        """Each role's budget (the model's or the run's)."""
        return (self.profile or self.result).budgets

    def to_dict(self) -> dict[str, Any]:
        """The answer as ``batchfit profile --json`` prints it (NOTE [ The --json schema ] in :mod:`batchfit.budget.document`)."""
        from batchfit.budget.document import profile_document
        from batchfit.frameworks.emit import provenance
        from batchfit.frameworks.older_torch import older_torch_notes

        request = self.request
        if self.profile is not None:
            data = self.profile.to_dict()
            data["memory_defaulted"] = request.memory_defaulted
            if request.calibration is not None:
                data["calibration"] = {"path": request.calibration_path, **request.calibration.to_dict()}
            return profile_document(data, provenance=provenance(self.profile.backend))
        assert self.result is not None and request.run is not None  # made by ProfileRequest.profile
        data = self.result.to_dict()
        data["memory_defaulted"] = request.memory_defaulted
        data["older_torch"] = older_torch_notes(self.result)
        data["notes"] = list(self.notes)  # the framework step's, the older torch's and the run's
        data["run_notes"] = list(request.run.notes)
        data["warnings"] = list(request.run.warnings)  # what the config sets that the budgets do not model
        if self.keys is not None:
            data["emit"] = {k.path: list(k.value) if isinstance(k.value, tuple) else k.value for k in self.keys if k.path}
            data["emit_notes"] = [k.comment for k in self.keys if not k.path]  # what no key can say
        return profile_document(data, provenance=provenance(request.backend))


def confirm_document(request: ProfileRequest, report: Any, calibration: Any = None) -> dict[str, Any]:
    """A confirm's document, as ``batchfit profile --confirm --json`` prints it (NOTE [ The --json schema ]).

    Args:
        request: the confirm request.
        report: its :class:`~batchfit.budget.confirm.ConfirmReport` (:func:`~batchfit.budget.confirm.run_confirm`).
        calibration: the :class:`~batchfit.memory.calibration.Calibration` written to
            ``request.calibration_path``, ``None`` when none was (or none was asked).
    """
    from batchfit.budget.document import profile_document

    data = report.profile.to_dict()
    data["memory_defaulted"] = request.memory_defaulted
    data["confirm"] = report.to_dict()
    if request.calibration_path:
        data["calibration"] = {"path": request.calibration_path, "written": calibration is not None}
        if calibration is not None:
            data["calibration"].update(calibration.to_dict())
    error = report.error()
    if error is not None:
        data["error"] = {"type": type(error).__name__, "faults": [str(error)]}
    return profile_document(data)


_NAMES = frozenset(row.name for row in SETTINGS)


def resolve_request(
    settings: Mapping[str, Any] | None = None,
    *,
    launched: int | None = None,
    vocabulary: Vocabulary | None = None,
    **keywords: Any,
) -> ProfileRequest:
    """The :class:`ProfileRequest` of the settings a caller chose (NOTE [ One resolver for every caller ]).

    Args:
        settings: the table's keywords (:data:`batchfit.budget.settings.SETTINGS`) → values;
            a missing or ``None`` one is not chosen (its row's default, then the request's policy).
        launched: the ranks torchrun launched (``None``: ``WORLD_SIZE``, 1 without torchrun).
        vocabulary: how messages name the settings (``None``: keywords).
        keywords: more settings, as ``settings``.

    Returns:
        The request, every value checked and normalised (the memory and reserve read, a complete
        sharding, the config's settings merged under the caller's).

    Raises:
        InvalidArgument: an unknown setting, or a bad value, combination or world (one line each,
            in ``vocabulary``).
        BatchConfigError: the config cannot be read (one line per fault).
    """
    given = {**(settings or {}), **keywords}
    unknown = sorted(set(given) - _NAMES)
    if unknown:
        raise InvalidArgument(
            f"a profile request has no setting {unknown[0]!r}; its settings are {', '.join(sorted(_NAMES))}"
        )
    values = {row.name: row.default for row in SETTINGS}
    values.update({k: v for k, v in given.items() if v is not None})
    return _Resolver(values, launched_world() if launched is None else launched, vocabulary or KEYWORDS).request()


class _Resolver:
    """One request's resolution: :meth:`request` applies the policies in the order their faults are reported."""

    def __init__(self, values: dict[str, Any], launched: int, vocabulary: Vocabulary):
        self.v = values
        self.launched = launched
        self.vocabulary = vocabulary

    def said(self, name: str, value: Any = None) -> str:
        return self.vocabulary.say(Setting(name, value))

    def request(self) -> ProfileRequest:
        from batchfit.budget.model_profile import check_roles
        from batchfit.frameworks.emit import FORMATS
        from batchfit.frameworks.sequence_parallel import check_sequence_parallel
        from batchfit.memory import BACKEND_NAMES, backend_name
        from batchfit.memory.device_memory import check_size_text, resolve_device_memory
        from batchfit.models import load_config, parse_dtype
        from batchfit.validation import check_choice, check_int

        v, said = self.v, self.said
        for name in ("memory_limit", "reserve_bytes", "engine_reserve"):
            check_size_text(said(name), v[name])
        backend = backend_name(check_choice(said("backend"), v["backend"], BACKEND_NAMES))
        kind = backend_class(backend)
        check_choice(said("emit_format"), v["emit_format"], FORMATS)
        run = self._read_config()
        limits = self._calibration(backend)
        memory = v["memory_limit"]
        if memory is None and limits is not None:
            memory = limits.memory_limit  # the calibrated device
        reserve = v["reserve_bytes"] if limits is None else limits.reserve_bytes
        # the reserve is checked against the world below, once the world is known
        device = resolve_device_memory(memory, reserve, backend, vocabulary=self.vocabulary, world=None)
        model = v["model"] if v["model"] is not None else DEFAULT_CPU_MODEL if kind.host_memory else DEFAULT_MODEL
        launched = self.launched
        if kind.simulated:
            if launched > 1:
                raise InvalidArgument(
                    f"{said('backend', 'estimate')} simulates {said('world_size')} ranks in one process, but this process "
                    f"is one of WORLD_SIZE={launched} torchrun ranks; run it without torchrun, or use "
                    f"{said('backend', 'cpu')} or cuda"
                )
            world = v["world_size"]  # else the config's, else the default
            default_world = DEFAULT_ESTIMATE_WORLD_SIZE
        else:
            world = launched if v["world_size"] is None else v["world_size"]  # never the config's: the group's
            default_world = launched
        self._check_response()
        self._check_context_parallel(run)
        check_sequence_parallel(
            v["sequence_parallel"], v["world_size"], run, model, default_world,
            names=(said("sequence_parallel"), said("world_size")),
        )  # fmt: skip
        chosen = Choices(
            max_seq_len=v["max_seq_len"],
            backend=backend,
            memory_limit=device.memory,
            reserve_bytes=device.reserve_bytes,
            dtype=v["dtype"],
            gradient_checkpointing=v["gradient_checkpointing"],
            activation_offload=v["activation_offload"],
            logprobs=v["logprobs"],
            cost=v["cost"],
            safety_margin=v["safety_margin"] if limits is None else limits.safety_margin,
            depth_extrapolation=v["depth_extrapolation"],
            response_only=v["response_only"] or None,
            response_fraction=v["response_fraction"],
            strategy=v["sharding"],
            world_size=world,
            reshard_after_forward=v["reshard_after_forward"],
            mixed_precision=v["mixed_precision"],
            offload=v["offload"],
            sequence_parallel=v["sequence_parallel"],
            expert_parallel=v["expert_parallel"],
            expert_tensor_parallel=v["expert_tensor_parallel"],
            tensor_parallel=v["tensor_parallel"],
            pipeline_parallel=v["pipeline_parallel"],
            context_parallel=v["context_parallel"],
            virtual_pipeline_parallel=v["virtual_pipeline_parallel"],
            first_pipeline_stage_layers=v["first_pipeline_stage_layers"],
            last_pipeline_stage_layers=v["last_pipeline_stage_layers"],
            optimizer_cpu_offload=v["optimizer_cpu_offload"],
            optimizer_offload_fraction=v["optimizer_offload_fraction"],
            precision_aware_optimizer=v["precision_aware_optimizer"],
            main_params_dtype=v["main_params_dtype"],
            main_grads_dtype=v["main_grads_dtype"],
            exp_avg_dtype=v["exp_avg_dtype"],
            exp_avg_sq_dtype=v["exp_avg_sq_dtype"],
            megatron_sequence_parallel=v["megatron_sequence_parallel"],
            distributed_optimizer=v["distributed_optimizer"],
            allocator=v["allocator"] if limits is None else self._calibrated_allocator(limits),
            engine_reserve=v["engine_reserve"],
            megatron_router=v["megatron_router"],
        )
        defaults = Choices(
            max_seq_len=DEFAULT_MAX_SEQ_LEN,
            gradient_checkpointing=DEFAULT_GRADIENT_CHECKPOINTING,
            world_size=default_world,
            # with a config the config's strategy; else FSDP2 wherever there are ranks to shard over
            strategy="fsdp2" if kind.simulated or (world or default_world) > 1 else "none",
        )
        notes: tuple[str, ...] = ()
        if run is None:
            options = self._options(chosen.or_(defaults))
        else:
            from batchfit.frameworks.config_options import run_profile_options

            config = run_profile_options(run, chosen, defaults, emit=v["emit"], vocabulary=self.vocabulary)
            run, options, notes = config.run, config.options, config.notes
        sharding = options.sharding
        if kind.simulated:
            check_int(said("world_size"), sharding.world_size, minimum=1, maximum=MAX_ESTIMATE_WORLD_SIZE)
        elif sharding.world_size != launched:
            n = sharding.world_size
            raise InvalidArgument(
                f"{said('world_size')} must equal the number of launched ranks with {said('backend', backend)} "
                f"(WORLD_SIZE={launched}), but got {said('world_size', n)}; launch with torchrun --nproc-per-node "
                f"{n} (or drop {said('world_size')}), or use {said('backend', 'estimate')} to simulate {n} ranks"
            )
        if device.total_bytes is not None:
            from batchfit.memory.device_memory import check_reserve_fits

            ranks = sharding.world_size if sharding.distributed else 1
            check_reserve_fits(device.memory, device.total_bytes, device.reserve_bytes, backend, ranks, self.vocabulary)
        # a one-rank cpu profile runs over a simulated group of one (budget.profile.simulated_world_for);
        # cuda, and a confirm's real step, need the ranks torchrun starts
        if (
            sharding.distributed
            and not kind.simulated
            and sharding.world_size == 1
            and launched == 1
            and (kind.reads_device or v["confirm"])
        ):
            raise InvalidArgument(
                f"{said('sharding', sharding.strategy)} with {said('backend', backend)} runs on real ranks: launch with "
                f"torchrun --nproc-per-node N batchfit profile ..., or use {said('backend', 'estimate')} "
                f"{said('world_size', 'N')}"
            )
        # profile_model checks its roles too, in its keywords' words
        roles = check_roles(v["roles"], said("roles")) if v["roles"] is not None else ("policy",)
        if v["dtype"] is not None:
            parse_dtype(v["dtype"])
        if run is None:
            load_config(model)
        else:
            for role, role_model in run.models.items():
                self._check_config_model(role, role_model, run)
        lora = self._lora(model if run is None else run.models.get("policy"))
        changes: dict[str, Any] = {}
        if lora is not None:
            changes["lora"] = lora
        changes.update(self._experts())
        if changes:
            options = options.replace(**changes)
        return ProfileRequest(
            model=model,
            roles=roles,
            options=options,
            run=run,
            notes=notes,
            config=v["config"],
            emit=v["emit"],
            emit_format=v["emit_format"],
            confirm=bool(v["confirm"]),
            calibration_path=v["calibration"],
            calibration=limits,
            memory_defaulted=device.defaulted,
            launched=launched,
            json=bool(v["json"]),
            plot=v["plot"],
            progress=bool(v["progress"]),
            cache=bool(v["cache"]),
            jobs=check_jobs(v["jobs"]),
            vocabulary=self.vocabulary,
        )

    def _options(self, choices: Choices) -> ProfileOptions:
        """The options of a request without a config; Sharding's own checks (in keywords) said in the caller's words."""
        try:
            return choices.options(self.vocabulary)
        except InvalidArgument as exc:  # Sharding's checks speak keywords: name them as the caller does (issue 40)
            flags = self.vocabulary.flags
            if flags is None:
                raise
            from batchfit.budget.settings import PROSE_FLAGS
            from batchfit.errors import as_flags

            raise InvalidArgument(as_flags(str(exc), {**PROSE_FLAGS, "strategy": flags["sharding"]})) from None

    def _check_context_parallel(self, run: Any) -> None:
        """Refuse ring attention (``context_parallel`` above 1) but under Megatron, in one line, with the reason and the
        setting that serves.

        Under ``--sharding megatron`` (or a Megatron config) context parallelism is Megatron's, modelled
        (NOTE [ Context parallelism as Megatron runs it ] in :mod:`batchfit.models.megatron_context`).
        NOTE [ Ring attention is refused ] (every other strategy): PyTorch's own ring attention
        (``torch.distributed.tensor.experimental.context_parallel``) dispatches only the CUDA sdpa kernels;
        on the CPU (gloo, and the estimate's fake tensors) it raises "Operator
        aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
        registered" (torch 2.13), and it takes no packed rows (no per-sequence boundaries), so batchfit
        cannot run it, measure it or estimate it. Ulysses (``sequence_parallel``) gives each rank the
        same share of the tokens.

        Raises:
            InvalidArgument: ``context_parallel`` is not a positive int, or above 1.
        """
        size = self.v["context_parallel"]
        if size is None:
            return
        from batchfit.validation import check_int

        check_int(self.said("context_parallel"), size, minimum=1)
        strategy = self.v["sharding"] or getattr(run, "strategy", None)
        if size > 1 and strategy not in MODEL_PARALLEL_STRATEGIES:
            raise InvalidArgument(
                f"{self.said('context_parallel', size)} (ring attention) is not modelled under {self.said('sharding', strategy or 'fsdp2')}: "
                "PyTorch's context_parallel runs only CUDA's sdpa kernels (no CPU, no estimate) and no packed rows; use "
                f"{self.said('sequence_parallel', size)} (Ulysses: the same tokens per rank), or "
                f"{self.said('sharding', 'megatron')} (Megatron's context parallelism)"
            )

    def _check_response(self) -> None:
        """``response_fraction`` needs ``response_only`` and a share in ``(0, 1]``."""
        from batchfit.budget.causal_lm_probe import check_response_fraction

        fraction = self.v["response_fraction"]
        if fraction is None:
            return
        if not self.v["response_only"]:
            raise InvalidArgument(
                f"{self.said('response_fraction', f'{fraction:g}')} is read only by the response-only head; add "
                f"{self.said('response_only')}"
            )
        check_response_fraction(fraction, self.said("response_fraction"))

    def _experts(self) -> dict[str, Any]:
        """``experts_implementation`` and ``compare_routing`` as options' changes; ``expert_parallel`` checked
        (a positive integer: NOTE [ Expert parallelism the torchtitan way ] in batchfit.parallel.expert_parallel).

        Raises:
            InvalidArgument: an unknown implementation, or ``expert_parallel`` not a positive integer.
        """
        from batchfit.models.moe import check_expert_parallel, check_experts_implementation

        check_expert_parallel(self.said("expert_parallel"), self.v["expert_parallel"])
        changes: dict[str, Any] = {}
        if self.v["compare_routing"]:
            changes["compare_routing"] = True
        chosen = self.v["experts_implementation"]
        if chosen is not None:
            changes["experts_implementation"] = check_experts_implementation(self.said("experts_implementation"), chosen)
        return changes

    def _lora(self, model: Any) -> LoraSpec | None:
        """``lora_rank``/``lora_alpha``/``lora_targets`` as a :class:`~batchfit.models.lora.LoraSpec` (``None`` without them).

        The targets are checked against the policy's model now (built on the meta device), before
        any probe.

        Raises:
            InvalidArgument: a bad value, an alpha or targets without a rank, targets that match no
                module, or PEFT not installed (one line each).
        """
        from batchfit.models import load_config
        from batchfit.models.lora import lora_parameters, lora_spec

        v, said = self.v, self.said
        if v["lora_rank"] is None:
            for name in ("lora_alpha", "lora_targets"):
                if v[name] is not None:
                    raise InvalidArgument(
                        f"{said(name)} needs {said('lora_rank', 'N')} (the adapters' rank), but got {said(name)} without it"
                    )
            return None
        names = {"rank": said("lora_rank"), "alpha": said("lora_alpha"), "targets": said("lora_targets")}
        spec = lora_spec(v["lora_rank"], v["lora_alpha"], v["lora_targets"], names=names)
        if spec.enabled:
            lora_parameters(load_config(model), spec, name=said("lora_targets"))
        return spec

    def _calibration(self, backend: str) -> CalibratedLimits | None:
        """Check ``confirm`` and ``calibration``; read the calibration when profiling with it.

        Returns:
            The :class:`~batchfit.memory.calibration.CalibratedLimits` of the calibration file
            without ``confirm``, else ``None``.

        Raises:
            InvalidArgument: ``confirm`` with a config or without a real device, a calibration
                folder that does not exist (with ``confirm``), a reserve or safety margin beside a
                calibration to read, or a bad calibration file (one line each).
        """
        from pathlib import Path

        from batchfit.memory.calibration import calibrated_limits, load_calibration

        v, said = self.v, self.said
        path = v["calibration"]
        if v["confirm"]:
            if v["config"] is not None:
                raise InvalidArgument(
                    f"{said('confirm')} runs one model's step and cannot be combined with {said('config')}; confirm each "
                    f"model with {said('model')} and the config's settings as flags"
                )
            if backend_class(backend).simulated:
                chose = " (auto chose estimate: no GPU here)" if v["backend"] == "auto" else ""
                raise InvalidArgument(
                    f"{said('confirm')} runs the real step on a device, but got {said('backend', v['backend'])}{chose}; "
                    f"use {said('backend', 'cpu')} {said('memory_limit', 'SIZE')} (real CPU tensors) or "
                    f"{said('backend', 'cuda')} on a GPU"
                )
            if path is not None and not Path(path).resolve().parent.is_dir():
                raise InvalidArgument(
                    f"{said('calibration')} {path!r}: the folder {str(Path(path).parent)!r} does not exist; create it or "
                    "write the calibration elsewhere"
                )
            return None
        if path is None:
            return None
        for name in ("reserve_bytes", "safety_margin"):
            if v[name] is not None:
                raise InvalidArgument(
                    f"{said(name)} cannot be combined with {said('calibration', path)} (the calibration sets the reserve "
                    f"and the safety margin); drop {said(name)}, or drop {said('calibration')} to set them by hand"
                )
        from batchfit.fileio import parse_json, read_text

        what = f"calibration file {str(path)!r}"
        if Path(path).exists():  # bounded first (NOTE [ Untrusted input files ]); the loader names a missing file
            parse_json(read_text(path, what), what)
        limits = calibrated_limits(load_calibration(path))
        cal = limits.calibration
        if backend != cal.backend and not backend_class(backend).simulated:  # the estimate takes any device's
            raise InvalidArgument(
                f"{said('calibration', path)} was measured on {cal.backend} and does not apply to "
                f"{said('backend', backend)}; use {said('backend', cal.backend)} or estimate, or calibrate this device "
                f"with {said('confirm')} {said('backend', backend)} {said('calibration', 'FILE')}"
            )
        return limits

    def _calibrated_allocator(self, limits: CalibratedLimits) -> str | None:
        """The allocator a calibrated profile assumes: the one its runs had (NOTE [ The allocator setting ] in
        :mod:`batchfit.memory.calibration`); a chosen allocator must agree with it.

        Raises:
            InvalidArgument: the chosen allocator is another setting than the calibration's runs had.
        """
        chosen = self.v["allocator"]
        measured = limits.calibration.allocator or None
        if chosen is not None and measured is not None and chosen != measured:
            raise InvalidArgument(
                f"{self.said('allocator', chosen)} differs from the calibration's ({measured}: its margin was measured "
                f"under it); drop {self.said('allocator')}, or calibrate under {chosen} (profile --confirm --calibration "
                "FILE with that setting)"
            )
        return chosen or measured

    def _read_config(self) -> RunConfig | None:
        """The config's run (the chosen model replacing its policy's model), or ``None`` without a config.

        Raises:
            InvalidArgument: ``emit`` without a config, ``roles`` with it.
            BatchConfigError: the config cannot be read (one line per fault).
        """
        v, said = self.v, self.said
        if v["config"] is None:
            if v["emit"] is not None:
                raise InvalidArgument(
                    f"{said('emit')} needs {said('config')} (the framework config whose keys to write); pass "
                    f"{said('config', 'FILE')}"
                )
            return None
        from batchfit.frameworks import read_run_config

        if v["roles"] is not None:
            raise InvalidArgument(
                f"{said('roles')} cannot be combined with {said('config')}: the config says which models run (drop "
                f"{said('roles')})"
            )
        run = read_run_config(v["config"])
        return run if v["model"] is None else run.replace(model=v["model"])

    def _check_config_model(self, role: str, model: Any, run: Any) -> None:
        """The config's model must load: name the key it came from and the override."""
        from batchfit.models import load_config

        if not model:
            raise InvalidArgument(f"the config names no {role} model; pass {self.said('model', 'PRESET|DIR')}")
        try:
            load_config(model)
        except InvalidArgument as exc:
            model_ = self.said("model")
            if role == "critic":  # the chosen model replaces the policy's model (and so the reference's) only
                where = (
                    f"read from the critic's model path in the config; {model_} sets the policy's model only: set the "
                    "critic's path there"
                )
            else:
                where = f"read from {run.source.get('model', 'the config')}; {model_} overrides it"
            raise InvalidArgument(f"{exc} ({where})") from None
