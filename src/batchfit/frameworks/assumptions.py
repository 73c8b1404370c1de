"""What a run's budgets assume, written as each framework's keys or flags, or refused in one line.

:func:`setting_keys` takes the options every model role was profiled with
(:func:`batchfit.frameworks.run_profile.role_options`, kept in :attr:`RunProfile.options`) and writes,
for verl, SkyRL, OpenRLHF or slime, the key or flag that makes the framework run what was
profiled: each framework's emit module (``<name>_emit.py``, its ``assumption_keys``, reached
through :meth:`FrameworkSpec.emit_module <batchfit.frameworks.registry.FrameworkSpec.emit_module>`)
writes them from the :class:`Assumptions` with the checks and refusals here (:func:`refuse`,
:func:`check_strategy`, ...); :func:`check_emit` refuses, before any probe, what a framework
cannot express. :mod:`batchfit.frameworks.emit` adds these keys to the token budgets' keys.

NOTE [ Emitted keys carry every assumption ]
A token budget holds only for the run that was profiled: its sharding (strategy, ranks,
resharding after forward, mixed precision, CPU offload), the dtype its parameters are stored in,
activation checkpointing, packed rows, LoRA adapters and the log-prob head. A comment that
mentions one is not enough: the emitted YAML, overrides or flags are pasted as they are, and a run
without the offload its budget assumed does not fit one sequence. So ``--emit`` writes a key for
each of these, the value profiled even when it is the framework's default (the file it is merged
into may say otherwise), and profiling the merged file without the command line's options gives
the same budgets (``tests/test_emit.py``). What a framework cannot express is refused with one
line naming the option, its value and the fix (:class:`EmitError`, exit 2): CPU offload in
OpenRLHF and slime, DDP anywhere, LoRA in slime, a head the framework does not run,
batchfit's response-only head everywhere. Settings of the algorithm rather than of memory
(whether the update computes an entropy, the sampling temperature) are never changed: with the
config in the target's own vocabulary they must match what its keys say, else the profile is
refused; from another framework's config a comment states what the budgets assumed.

Every key the emit modules write cites where the framework reads it; the releases are those of
:mod:`~batchfit.frameworks.verl` (verl 0.9.1), :mod:`~batchfit.frameworks.skyrl` (SkyRL 0.4.0),
:mod:`~batchfit.frameworks.openrlhf` (OpenRLHF 0.11.2) and :mod:`~batchfit.frameworks.slime`
(slime 624b824a).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.frameworks.registry import get_framework
from batchfit.frameworks.run import RunConfig, dtype_name
from batchfit.models.lora import LoraSpec
from batchfit.parallel.sharding import Sharding
from batchfit.train.framework_heads import FrameworkHead, as_framework_head
from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

__all__ = [
    "Assumptions",
    "EmitError",
    "Key",
    "allocator_comment",
    "assumptions",
    "check_emit",
    "check_head",
    "check_precision",
    "check_strategy",
    "lora_adapter_keys",
    "lora_value",
    "nodes_and_gpus",
    "refuse",
    "setting_keys",
    "switch_keys",
]


class EmitError(InvalidArgument):
    """``--emit`` cannot write a setting the budgets were profiled with.

    Raised when the target framework has no key or flag that expresses it (CPU offload in
    OpenRLHF, LoRA in slime, DDP anywhere, ...), or when no added flag can undo one the launch
    command sets. The message names the option, its value and the fix (NOTE [ Emitted keys carry
    every assumption ]).
    """


Value = int | float | bool | str | tuple[str, ...]


@dataclass(frozen=True)
class Key:
    """One key to set: its dotted path (or flag), value and why.

    For flags, ``True`` is a switch given alone (``store_true``), a tuple is a flag's several
    values, and a key with an empty ``path`` (or the value ``False``) is a comment only.
    """

    path: str
    value: Value
    comment: str = ""


@dataclass(frozen=True)
class Assumptions:
    """The settings a run's budgets were profiled with, in batchfit's terms (one per run: every model shares them).

    Attributes:
        roles: the model roles profiled (``policy``, ``critic``, ``reference``).
        sharding: the sharding every model was profiled with.
        dtypes: model role → the dtype its parameters were stored in (``fp32``, ``bf16``).
        gradient_checkpointing: activation checkpointing of every layer.
        cost: ``packed`` or ``padded`` rows.
        head: the policy's log-prob head: ``full``, ``chunked``, ``fused``, a :class:`FrameworkHead`, or under
            Megatron each pass's :class:`~batchfit.train.megatron_heads.MegatronHeads` (slime's).
        lora: model role (``policy``, ``critic``) → its adapters, ``None`` without.
        response_only: the head ran on the loss tokens only.
        activation_offload: the trained models offloaded their layers' saved activations to the
            host (:func:`batchfit.train.activation_offload`, verl's ``enable_activation_offloading``).
        allocator: the CUDA allocator setting the budgets assume (``expandable_segments`` or
            ``caching``: NOTE [ The allocator's share ] in :mod:`batchfit.memory.cuda_untracked`).
        optimizer_offload: the forward-only passes were profiled without the optimizer state
            (verl's ``optimizer_offload``).
    """

    roles: tuple[str, ...]
    sharding: Sharding
    dtypes: dict[str, str]
    gradient_checkpointing: bool
    cost: str
    head: str | FrameworkHead | MegatronHeads
    lora: dict[str, LoraSpec | None]
    response_only: bool
    activation_offload: bool = False
    allocator: str = "expandable_segments"
    optimizer_offload: bool = False

    @property
    def trained_dtype(self) -> str:
        """The policy's parameter dtype (the critic's is the same: one ``dtype`` for trained models)."""
        return self.dtypes["policy"]


def assumptions(by_role: Mapping[str, Any]) -> Assumptions:
    """The :class:`Assumptions` of a run from each model role's profile options.

    Args:
        by_role: model role → the :class:`~batchfit.budget.ProfileOptions` it was profiled with
            (:func:`batchfit.frameworks.run_profile.role_options`); it must hold the policy.

    Raises:
        InvalidArgument: no policy among the roles.
    """
    if "policy" not in by_role:
        raise InvalidArgument(
            f"the profile's options name no policy (roles {sorted(by_role)}): emit needs the options each model was "
            "profiled with (batchfit.frameworks.run_profile.role_options, RunProfile.options)"
        )
    policy = by_role["policy"]
    head = policy.logprobs
    return Assumptions(
        roles=tuple(by_role),
        sharding=policy.sharding,
        dtypes={role: _dtype(options) for role, options in by_role.items()},
        gradient_checkpointing=policy.gradient_checkpointing,
        cost=policy.cost,
        head=as_framework_head(head) or head,
        lora={role: _enabled(by_role[role].lora) for role in ("policy", "critic") if role in by_role},
        response_only=policy.response_only,
        activation_offload=policy.activation_offload,
        allocator=str(policy.allocator),
        optimizer_offload=bool(policy.optimizer_offload),
    )


def _dtype(options: Any) -> str:
    from batchfit.budget.model_profile import default_dtype

    name = options.dtype if options.dtype is not None else default_dtype(options.sharding)
    return dtype_name(str(name)) or str(name)


def _enabled(spec: LoraSpec | None) -> LoraSpec | None:
    return spec if spec is not None and spec.enabled else None


def check_emit(run: RunConfig, options: Any, target: str) -> None:
    """Refuse now, before any probe, a profile of ``run`` with ``options`` that ``target``'s keys cannot express.

    Args:
        run: the config (:func:`batchfit.frameworks.read_run_config`).
        options: the :class:`~batchfit.budget.ProfileOptions` of the profile (before each role's).
        target: ``verl``, ``skyrl``, ``openrlhf`` or ``slime``.

    Raises:
        EmitError: the first setting the target cannot carry (NOTE [ Emitted keys carry every
            assumption ]).
    """
    from batchfit.frameworks.run_profile import role_options

    setting_keys(run, role_options(run, options), target)


def setting_keys(run: RunConfig, by_role: Mapping[str, Any], target: str) -> list[Key]:
    """The keys (or flags) that make ``target`` run what each model role was profiled with.

    Args:
        run: the config the profile read.
        by_role: model role → its :class:`~batchfit.budget.ProfileOptions` (:attr:`RunProfile.options`).
        target: ``verl``, ``skyrl``, ``openrlhf`` or ``slime``.

    Returns:
        The keys, each with a comment naming what it carries and where the framework reads it.

    Raises:
        EmitError: a setting the target cannot carry.
    """
    a = assumptions(by_role)
    if a.response_only:
        raise refuse(
            target,
            "--response-only",
            f"{get_framework(target).title} runs its log-prob head over every token and bounds total tokens only (no framework "
            "has a key for the response tokens of a micro-batch), so budgets of batchfit's response-only head do not "
            "hold there",
            "profile without --response-only",
        )
    if a.cost != "packed":
        raise refuse(
            target,
            f"--cost {a.cost}",
            f"{get_framework(target).title} counts a micro-batch's tokens, which bound packed rows only, and the emitted keys pack "
            "them",
            "drop --cost padded (emit profiles packed rows)",
        )
    if a.activation_offload and target not in ACTIVATION_OFFLOAD_TARGETS:
        raise refuse(
            target,
            "--activation-offload",
            "batchfit models verl's activation offload (verl/utils/activation_offload.py) and has not read how "
            f"{get_framework(target).title} offloads activations, if it does",
            "profile without --activation-offload",
        )
    module = get_framework(target).emit_module()
    return [*module.assumption_keys(run, a, run.vocabulary == target), *module.allocator_keys(a)]


def allocator_comment(a: Assumptions, how: str) -> Key:
    """A comment saying which allocator setting the budgets assume and ``how`` the target gets it (no key to set)."""
    from batchfit.memory.cuda_untracked import ALLOCATOR_CONF

    if a.allocator == "expandable_segments":
        said = f"the budgets assume expandable segments (PYTORCH_CUDA_ALLOC_CONF={ALLOCATOR_CONF[a.allocator]})"
    else:
        said = "the budgets assume the caching allocator's default segments (a lower safety margin)"
    return Key("", False, f"{said}: {how}")


#: The frameworks whose activation offload batchfit runs (NOTE [ Activation offload as verl runs it ]
#: in :mod:`batchfit.train.activation_offload`).
ACTIVATION_OFFLOAD_TARGETS = ("verl",)


def ring_keys(run: Any, a: Assumptions, flag: str, attention: str) -> list[Key]:
    """``flag`` set to the profiled sequence-parallel size, when the profile or the run splits sequences.

    For a framework whose ring attention (``attention``, e.g. ``"OpenRLHF's ring attention"``)
    batchfit profiles as Ulysses over the same GPUs; ``[]`` when neither splits.
    """
    sp = a.sharding.sequence_parallel
    if sp == 1 and (run.batch.context_parallel or 1) == 1:
        return []
    return [
        Key(
            flag,
            sp,
            f"each sequence split over these GPUs: {attention}, profiled as Ulysses sequence parallelism (the same "
            "tokens per GPU outside attention)",
        )
    ]


def refuse(target: str, setting: str, why: str, fix: str) -> EmitError:
    """The :class:`EmitError` that says ``--emit target`` cannot carry ``setting``, why, and the fix (the caller raises it)."""
    return EmitError(f"--emit {target} cannot carry {setting}: {why}; {fix}")


def nodes_and_gpus(run: RunConfig, a: Assumptions, target: str) -> tuple[int, int]:
    """(nodes, GPUs per node) of the profiled ranks, over the config's node count.

    Raises:
        EmitError: the ranks do not split into the config's nodes equally.
    """
    world = a.sharding.world_size
    nodes = run.batch.num_nodes if isinstance(run.batch.num_nodes, int) and run.batch.num_nodes > 0 else 1
    if world % nodes:
        raise refuse(
            target,
            f"--world-size {world}",
            f"the config spreads its GPUs over {nodes} nodes, and {world} ranks do not split into {nodes} equal nodes",
            f"pass a multiple of {nodes}",
        )
    return nodes, world // nodes


def check_strategy(target: str, a: Assumptions, allowed: tuple[str, ...], why: str) -> None:
    """Refuse a strategy ``target`` does not run; ``none`` is one GPU (the framework's FSDP over one rank).

    Raises:
        EmitError: the strategy is not one of ``allowed`` (``why`` says so), or ``none`` over several GPUs.
    """
    s = a.sharding
    if not s.distributed and s.world_size > 1:
        raise refuse(
            target,
            f"--sharding none over {s.world_size} GPUs",
            f"{get_framework(target).title} shards every model over its GPUs",
            f"pass --sharding {allowed[-1]}",
        )
    if s.distributed and s.strategy not in allowed:
        raise refuse(target, f"--sharding {s.strategy}", why, f"pass --sharding {allowed[-1]}")


def check_precision(target: str, a: Assumptions, why: str) -> None:
    """Refuse anything but fp32 parameters with bf16 mixed precision (FSDP over more than one GPU).

    Raises:
        EmitError: another precision or dtype (``why`` says what the framework runs).
    """
    if not a.sharding.distributed or a.sharding.mixed_precision != "bf16":
        raise refuse(
            target,
            f"--mixed-precision {a.sharding.mixed_precision}",
            why,
            "profile with --sharding fsdp2 --mixed-precision bf16 --dtype fp32 (fsdp2 over one rank for one GPU)",
        )
    if a.trained_dtype != "fp32":
        raise refuse(target, f"--dtype {a.trained_dtype}", why, "pass --dtype fp32")


def check_head(target: str, a: Assumptions, allowed: tuple[str, ...], why: str, fix: str) -> None:
    """Refuse a log-prob head ``target`` does not run (a :class:`FrameworkHead` or Megatron head by its framework's name).

    Raises:
        EmitError: the policy's head is not one of ``allowed``.
    """
    head = a.head
    if isinstance(head, MegatronHeads):
        head = head.update
    name = head.framework if isinstance(head, (FrameworkHead, MegatronHead)) else head
    if name not in allowed:
        raise refuse(target, f"--logprobs {name}", why, fix)


def lora_value(spec: LoraSpec) -> Value:
    """The adapters' target modules as a key's value: ``all-linear`` as it is, module names as a tuple."""
    return spec.targets if isinstance(spec.targets, str) else tuple(spec.targets)


def switch_keys(
    target: str, run: RunConfig, same: bool, flag: str, on: bool, given: bool, option: str, why: str
) -> list[Key]:
    """A ``store_true`` flag: given when on; when off, refused if the launch command gives it (no flag undoes it).

    Raises:
        EmitError: ``on`` is false, and the target's own launch command (``same``) gives the flag (``given``).
    """
    if on:
        return [Key(flag, True, why)]
    if same and given:
        raise refuse(
            target,
            option.replace("--", "--no-", 1),
            f"the launch command gives {flag}, and no flag added after it turns it off",
            f"remove {flag} from the command, or drop {option.replace('--', '--no-', 1)}",
        )
    return [Key("", False, f"profiled without {flag}: leave it out of the command")]


def lora_adapter_keys(spec: LoraSpec | None, rank: str, alpha: str, targets: str) -> list[Key]:
    """The keys ``rank``, ``alpha`` and ``targets`` of ``spec``'s adapters; rank 0 alone without LoRA."""
    if spec is None:
        return [Key(rank, 0, "no LoRA: every parameter trained")]
    return [
        Key(rank, spec.rank, f"{spec.describe()}: adapters on a frozen base"),
        Key(alpha, int(spec.alpha) if spec.alpha == int(spec.alpha) else spec.alpha),
        Key(targets, lora_value(spec)),
    ]
