"""What a run's budgets assume, written as each framework's keys or flags, or refused in one line.

:func:`setting_keys` takes the options every model role was profiled with
(:func:`batchfit.frameworks.run_profile.role_options`, kept in :attr:`RunProfile.options`) and writes,
for verl, SkyRL, OpenRLHF or slime, the key or flag that makes the framework run what was
profiled; :func:`check_emit` refuses, before any probe, what a framework cannot express.
:mod:`batchfit.frameworks.emit` adds these keys to the token budgets' keys.

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

Every key below cites where the framework reads it; the releases are those of
:mod:`~batchfit.frameworks.verl` (verl 0.9.1), :mod:`~batchfit.frameworks.skyrl` (SkyRL 0.4.0),
:mod:`~batchfit.frameworks.openrlhf` (OpenRLHF 0.11.2) and :mod:`~batchfit.frameworks.slime`
(slime 624b824a).
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.frameworks.registry import get_framework
from batchfit.frameworks.run import RunConfig, dtype_name
from batchfit.models.lora import LoraSpec
from batchfit.parallel.sharding import Sharding
from batchfit.train.framework_heads import FrameworkHead, as_framework_head

__all__ = ["Assumptions", "EmitError", "Key", "assumptions", "check_emit", "setting_keys"]


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
        head: the policy's log-prob head: ``full``, ``chunked``, ``fused`` or a :class:`FrameworkHead`.
        lora: model role (``policy``, ``critic``) → its adapters, ``None`` without.
        response_only: the head ran on the loss tokens only.
    """

    roles: tuple[str, ...]
    sharding: Sharding
    dtypes: dict[str, str]
    gradient_checkpointing: bool
    cost: str
    head: str | FrameworkHead
    lora: dict[str, LoraSpec | None]
    response_only: bool

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
        raise _refuse(
            target,
            "--response-only",
            f"{get_framework(target).title} runs its log-prob head over every token and bounds total tokens only (no framework "
            "has a key for the response tokens of a micro-batch), so budgets of batchfit's response-only head do not "
            "hold there",
            "profile without --response-only",
        )
    if a.cost != "packed":
        raise _refuse(
            target,
            f"--cost {a.cost}",
            f"{get_framework(target).title} counts a micro-batch's tokens, which bound packed rows only, and the emitted keys pack "
            "them",
            "drop --cost padded (emit profiles packed rows)",
        )
    return _WRITERS[target](run, a, run.vocabulary == target)


def _refuse(target: str, setting: str, why: str, fix: str) -> EmitError:
    return EmitError(f"--emit {target} cannot carry {setting}: {why}; {fix}")


def _flag(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"


def _gpus(run: RunConfig, a: Assumptions, target: str) -> tuple[int, int]:
    """(nodes, GPUs per node) of the profiled ranks, over the config's node count."""
    world = a.sharding.world_size
    nodes = run.batch.num_nodes if isinstance(run.batch.num_nodes, int) and run.batch.num_nodes > 0 else 1
    if world % nodes:
        raise _refuse(
            target,
            f"--world-size {world}",
            f"the config spreads its GPUs over {nodes} nodes, and {world} ranks do not split into {nodes} equal nodes",
            f"pass a multiple of {nodes}",
        )
    return nodes, world // nodes


def _check_strategy(target: str, a: Assumptions, allowed: tuple[str, ...], why: str) -> None:
    """Refuse a strategy ``target`` does not run; ``none`` is one GPU (the framework's FSDP over one rank)."""
    s = a.sharding
    if s.strategy == "none" and s.world_size > 1:
        raise _refuse(
            target,
            f"--sharding none over {s.world_size} GPUs",
            f"{get_framework(target).title} shards every model over its GPUs",
            f"pass --sharding {allowed[-1]}",
        )
    if s.strategy not in (*allowed, "none"):
        raise _refuse(target, f"--sharding {s.strategy}", why, f"pass --sharding {allowed[-1]}")


def _check_precision(target: str, a: Assumptions, why: str) -> None:
    """Refuse anything but fp32 parameters with bf16 mixed precision (FSDP over more than one GPU)."""
    if a.sharding.strategy == "none" or a.sharding.mixed_precision != "bf16":
        raise _refuse(
            target,
            f"--mixed-precision {a.sharding.mixed_precision}",
            why,
            "profile with --sharding fsdp2 --mixed-precision bf16 --dtype fp32 (fsdp2 over one rank for one GPU)",
        )
    if a.trained_dtype != "fp32":
        raise _refuse(target, f"--dtype {a.trained_dtype}", why, "pass --dtype fp32")


def _check_head(target: str, a: Assumptions, allowed: tuple[str, ...], why: str, fix: str) -> None:
    head = a.head
    name = head.framework if isinstance(head, FrameworkHead) else head
    if name not in allowed:
        raise _refuse(target, f"--logprobs {name}", why, fix)


def _lora_value(spec: LoraSpec) -> Value:
    return spec.targets if isinstance(spec.targets, str) else tuple(spec.targets)


# --------------------------------------------------------------------------- verl 0.9.1

_V_MODEL = "actor_rollout_ref.model."
_V_ACTOR = "actor_rollout_ref.actor."
_V_ENGINE = _V_ACTOR + "fsdp_config."  # FSDPActorConfig.fsdp_config: the actor's FSDPEngineConfig
_V_REF_ENGINE = "actor_rollout_ref.ref.fsdp_config."
_V_CRITIC_ENGINE = "critic.fsdp."  # FSDPCriticConfig's FSDPEngineConfig
_V_SRC = "verl/workers/engine/fsdp/transformer_impl.py"


def _verl(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "verl"
    s = a.sharding
    critic = "critic" in a.roles
    _check_strategy(
        target,
        a,
        ("fsdp1", "fsdp2"),
        "verl's FSDP engines are FSDP1 (strategy fsdp) and FSDP2 (strategy fsdp2), not DDP",
    )
    if s.offload == "cpu" and s.strategy == "fsdp1":
        raise _refuse(
            target,
            "--offload cpu with --sharding fsdp1",
            f"verl's FSDP1 engine turns CPU offload off for the actor and the critic ({_V_SRC} _build_fsdp_module: "
            "cpu_offload=None unless forward_only)",
            "pass --sharding fsdp2 (strategy fsdp2 reads fsdp_config.offload_policy)",
        )
    nodes, per_node = _gpus(run, a, target)
    keys = [
        Key("trainer.nnodes", nodes, f"the {s.world_size} GPUs profiled (verl: trainer.nnodes × n_gpus_per_node)"),
        Key("trainer.n_gpus_per_node", per_node),
    ]
    if s.strategy in ("fsdp1", "fsdp2"):
        name = "fsdp" if s.strategy == "fsdp1" else "fsdp2"
        why = f"profiled as {s.strategy} ({'FullyShardedDataParallel' if name == 'fsdp' else 'fully_shard'})"
        keys.append(Key(_V_ACTOR + "strategy", name, why))
        if critic:
            keys.append(Key("critic.strategy", name))
        after = f"{_V_SRC}: fully_shard(reshard_after_forward=), FSDP1 FULL_SHARD / SHARD_GRAD_OP"
        keys.append(Key(_V_ENGINE + "reshard_after_forward", s.reshard_after_forward, after))
        if critic:
            keys.append(Key(_V_CRITIC_ENGINE + "reshard_after_forward", s.reshard_after_forward))
        if "reference" in a.roles:
            keys.append(Key(_V_REF_ENGINE + "reshard_after_forward", s.reshard_after_forward))
        offload = s.offload == "cpu"
        keys.append(
            Key(
                _V_ENGINE + "offload_policy",
                offload,
                "FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer state on the host"
                if offload
                else "sharded state on the GPU",
            )
        )
        if critic:
            keys.append(Key(_V_CRITIC_ENGINE + "offload_policy", offload))
    keys += _verl_precision(a, critic)
    keys.append(
        Key(
            _V_MODEL + "enable_gradient_checkpointing",
            a.gradient_checkpointing,
            f"profiled {'with' if a.gradient_checkpointing else 'without'} activation checkpointing",
        )
    )
    if critic:
        keys.append(Key("critic.model.enable_gradient_checkpointing", a.gradient_checkpointing))
    for role, prefix in (("policy", _V_MODEL), ("critic", "critic.model.")):
        if role in a.roles:
            keys += _lora_keys(a.lora.get(role), prefix + "lora_rank", prefix + "lora_alpha", prefix + "target_modules")
    keys += _verl_head(run, a, same)
    return keys


def _verl_precision(a: Assumptions, critic: bool) -> list[Key]:
    """model_dtype and mixed_precision: FSDPEngine._build_module loads in model_dtype, _build_fsdp_module casts by mixed_precision."""
    dtype = a.trained_dtype
    bf16 = a.sharding.mixed_precision == "bf16"
    param, reduce = ("bf16", "fp32") if bf16 else (dtype, dtype)
    buffer = "fp32" if bf16 else dtype
    what = (
        "bf16 compute, fp32 gradient reduction" if bf16 else f"compute and reduction in {dtype}: no mixed precision"
    )
    keys = []
    for engine in (_V_ENGINE, *([_V_CRITIC_ENGINE] if critic else [])):
        keys += [
            Key(
                engine + "model_dtype",
                dtype,
                f"parameters stored in {dtype} ({_V_SRC} _build_module)" if engine == _V_ENGINE else "",
            ),
            Key(
                engine + "mixed_precision.param_dtype",
                param,
                f"{what} ({_V_SRC} _build_fsdp_module)" if engine == _V_ENGINE else "",
            ),
            Key(engine + "mixed_precision.reduce_dtype", reduce),
            Key(engine + "mixed_precision.buffer_dtype", buffer),
        ]
    if "reference" in a.roles:
        keys.append(Key(_V_REF_ENGINE + "model_dtype", a.dtypes["reference"], "the reference's stored dtype"))
    return keys


def _verl_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """use_fused_kernels, or verl's own head: the engine's entropy keys (prepare_model_outputs)."""
    target = "verl"
    fix = "drop --logprobs (the config's head), or pass --logprobs verl or --logprobs fused"
    _check_head(
        target,
        a,
        ("verl", "fused"),
        "verl computes log-probs with its own head (or, with use_fused_kernels, from the hidden states), which has no "
        "key for batchfit's or another framework's",
        fix,
    )
    if a.head == "fused":
        return [
            Key(
                _V_MODEL + "use_fused_kernels",
                True,
                "log-probs from the hidden states, profiled with batchfit's fused head",
            )
        ]
    head = a.head
    assert isinstance(head, FrameworkHead)  # _check_head let only verl's head through
    modes = {head.entropy, head.forward_entropy} - {"none"}
    if len(modes) > 1:
        raise _refuse(
            target,
            f"--logprobs with {head.entropy} entropy in the update and {head.forward_entropy} in the log-prob pass",
            "verl's engine computes both passes' entropy one way (entropy_checkpointing, "
            "entropy_from_logits_with_chunking)",
            fix,
        )
    mode = modes.pop() if modes else "full"
    keys = [
        Key(_V_MODEL + "use_fused_kernels", False, f"log-probs from the logits: {head.describe()}"),
        Key(_V_ENGINE + "entropy_checkpointing", mode == "checkpointed", f"entropy computed {mode}"),
        Key(_V_ENGINE + "entropy_from_logits_with_chunking", mode == "chunked"),
    ]
    if mode == "chunked":
        keys.append(Key(_V_ENGINE + "entropy_from_logits_chunk_size", head.entropy_chunk_size))
    in_update = head.entropy != "none"
    algorithm = (
        f"the update computes {'an' if in_update else 'no'} entropy (actor.calculate_entropy or entropy_coeff != 0), "
        f"{'in the loss' if head.entropy_in_loss else 'not in the loss'}; the old-log-prob pass "
        f"{'computes' if head.forward_entropy != 'none' else 'skips'} it; temperature {head.temperature:g}"
    )
    if same:
        own = (
            run.entropy != "none",
            run.entropy_in_loss,
            run.forward_entropy != "none",
            float(run.temperature or 1.0),
        )
        if own != (in_update, head.entropy_in_loss, head.forward_entropy != "none", head.temperature):
            raise _refuse(
                target,
                f"--logprobs {head.framework}",
                f"the head profiled assumes {algorithm}, but the config's actor.calculate_entropy, entropy_coeff, "
                "algorithm.rollout_correction.bypass_mode and rollout.temperature say otherwise (settings of the "
                "algorithm, which emit does not change)",
                "drop --logprobs to profile the config's own head",
            )
    else:
        keys.append(Key("", False, f"the budgets assume verl's head where {algorithm}: keep the config's alike"))
    return keys


# --------------------------------------------------------------------------- SkyRL 0.4.0

_S_PLACEMENT = "trainer.placement."
_S_FSDP = {"policy": "trainer.policy.fsdp_config.", "critic": "trainer.critic.fsdp_config.", "reference": "trainer.ref.fsdp_config."}
_S_STRATEGY = "skyrl/backends/skyrl_train/distributed/fsdp_strategy.py _fsdp_init_model"


def _skyrl(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "skyrl"
    s = a.sharding
    _check_strategy(
        target,
        a,
        ("fsdp2",),
        "SkyRL's FSDP strategy is fully_shard (FSDP2: trainer.strategy fsdp, fsdp_strategy.py apply_fsdp2)",
    )
    if a.trained_dtype != "fp32":
        raise _refuse(
            target,
            f"--dtype {a.trained_dtype}",
            "SkyRL loads the policy and the critic it trains in fp32 (skyrl/backends/skyrl_train/workers/fsdp/"
            "fsdp_worker.py: HFModelWrapper(bf16=policy.inference_only_init), critic bf16=False)",
            "pass --dtype fp32",
        )
    nodes, per_node = _gpus(run, a, target)
    keys = [
        Key(_S_PLACEMENT + "policy_num_nodes", nodes, f"the {s.world_size} GPUs profiled, for every model"),
        Key(_S_PLACEMENT + "policy_num_gpus_per_node", per_node),
    ]
    for role, name in (("critic", "critic"), ("reference", "ref")):
        if role in a.roles:
            keys += [
                Key(_S_PLACEMENT + f"{name}_num_nodes", nodes),
                Key(_S_PLACEMENT + f"{name}_num_gpus_per_node", per_node),
            ]
    keys.append(Key("trainer.strategy", "fsdp", "fully_shard (FSDP2) over the GPUs, as profiled"))
    bf16 = s.mixed_precision == "bf16"
    for role in a.roles:
        prefix = _S_FSDP[role]
        policy = role == "policy"
        keys.append(
            Key(
                prefix + "cpu_offload",
                s.offload == "cpu",
                f"FSDP2's CPUOffloadPolicy ({_S_STRATEGY})" if policy else "",
            )
        )
        keys.append(Key(prefix + "reshard_after_forward", s.reshard_after_forward))
        if role != "reference":
            param, reduce = ("bf16", "fp32") if bf16 else ("fp32", "fp32")
            keys += [
                Key(
                    prefix + "mixed_precision.param_dtype",
                    param,
                    f"MixedPrecisionPolicy(param_dtype, reduce_dtype) ({_S_STRATEGY})" if policy else "",
                ),
                Key(prefix + "mixed_precision.reduce_dtype", reduce),
            ]
    if "reference" in a.roles:
        ref = a.dtypes["reference"]
        if ref not in ("bf16", "fp32"):
            raise _refuse(target, f"--dtype {ref}", "SkyRL loads its reference in bf16 or fp32 (trainer.bf16)", "pass --dtype fp32")
        keys.append(
            Key("trainer.bf16", ref == "bf16", f"the reference loads in {ref} (fsdp_worker.py: HFModelWrapper(bf16=trainer.bf16))")
        )
    keys.append(
        Key(
            "trainer.gradient_checkpointing",
            a.gradient_checkpointing,
            f"every model {'with' if a.gradient_checkpointing else 'without'} activation checkpointing (fsdp_worker.py)",
        )
    )
    for role, prefix in (("policy", "trainer.policy.model.lora."), ("critic", "trainer.critic.model.lora.")):
        if role in a.roles:
            keys += _lora_keys(a.lora.get(role), prefix + "rank", prefix + "alpha", prefix + "target_modules")
    keys += _skyrl_head(run, a, same)
    return keys


def _skyrl_head(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    """SkyRL's head (model_wrapper.py): log-probs and an entropy chunked by logprobs_chunk_size tokens."""
    target = "skyrl"
    why = (
        "SkyRL's FSDP workers compute log-probs with its own head and chunked entropy (model_wrapper.py; "
        "fused_lm_head_logprob needs trainer.strategy megatron, TrainerConfig.__post_init__)"
    )
    fix = "drop --logprobs (the config's head), or pass --logprobs skyrl"
    _check_head(target, a, ("skyrl",), why, fix)
    head = a.head
    assert isinstance(head, FrameworkHead)
    if head.entropy != "chunked" or head.forward_entropy != "none":
        raise _refuse(target, f"--logprobs skyrl with {head.entropy} entropy", why, fix)
    keys = [
        Key(
            "trainer.logprobs_chunk_size",
            head.entropy_chunk_size,
            f"the entropy in chunks of {head.entropy_chunk_size:,} tokens: {head.describe()}",
        )
    ]
    algorithm = (
        f"the entropy {'is' if head.entropy_in_loss else 'is not'} in the loss (trainer.algorithm.use_entropy_loss), "
        f"temperature {head.temperature:g}"
    )
    if same:
        own = (run.entropy_grad, run.entropy_in_loss, float(run.temperature or 1.0))
        if own != (head.entropy_grad, head.entropy_in_loss, head.temperature):
            raise _refuse(
                target,
                "--logprobs skyrl",
                f"the head profiled assumes {algorithm}, but the config's trainer.algorithm.use_entropy_loss and "
                "temperature say otherwise (settings of the algorithm, which emit does not change)",
                "drop --logprobs to profile the config's own head",
            )
    else:
        keys.append(Key("", False, f"the budgets assume SkyRL's head where {algorithm}: keep the config's alike"))
    return keys


# --------------------------------------------------------------------------- OpenRLHF 0.11.2

_O_DS = "openrlhf/utils/deepspeed/deepspeed.py"


def _openrlhf(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "openrlhf"
    s = a.sharding
    _check_strategy(
        target,
        a,
        ("fsdp2",),
        "OpenRLHF trains with DeepSpeed ZeRO, whose stage 3 batchfit profiles as FSDP2 (--ds.zero_stage 3); it has no "
        "DDP or FSDP1",
    )
    if not s.reshard_after_forward:
        raise _refuse(
            target,
            "--no-reshard-after-forward",
            "ZeRO-3 gathers each layer's parameters again for backward, and ZeRO-2 keeps whole parameters on every "
            "GPU, which batchfit does not model",
            "drop --no-reshard-after-forward",
        )
    if s.offload == "cpu":
        raise _refuse(
            target,
            "--offload cpu",
            f"OpenRLHF never offloads the parameters of a model it trains ({_O_DS}: get_train_ds_config(offload=False)); "
            "--ds.adam_offload moves the optimizer state only",
            "profile with --offload none",
        )
    _check_precision(
        target,
        a,
        "OpenRLHF trains with DeepSpeed in bf16 or fp16 (--ds.param_dtype) with fp32 master weights, which batchfit "
        "models as fp32 parameters with bf16 compute (fsdp2, --mixed-precision bf16 --dtype fp32)",
    )
    nodes, per_node = _gpus(run, a, target)
    keys = [
        Key("--actor.num_nodes", nodes, f"the {s.world_size} GPUs profiled, for every model"),
        Key("--actor.num_gpus_per_node", per_node),
    ]
    for role, name in (("critic", "critic"), ("reference", "ref")):
        if role in a.roles:
            keys += [Key(f"--{name}.num_nodes", nodes), Key(f"--{name}.num_gpus_per_node", per_node)]
    keys.append(Key("--ds.zero_stage", 3, "ZeRO-3, profiled as FSDP2 over the same GPUs"))
    keys.append(
        Key(
            "--ds.param_dtype",
            "bf16",
            "bf16 compute over fp32 master weights, profiled as fp32 parameters with bf16 mixed precision",
        )
    )
    if "reference" in a.roles and a.dtypes["reference"] != "bf16":
        raise _refuse(
            target,
            f"--dtype {a.dtypes['reference']}",
            "OpenRLHF loads its reference in --ds.param_dtype (bf16, openrlhf/trainer/ray/launcher.py)",
            "drop --dtype",
        )
    keys += _switch(
        target,
        run,
        same,
        "--actor.gradient_checkpointing_enable",
        a.gradient_checkpointing,
        bool(run.gradient_checkpointing),
        "--gradient-checkpointing",
        "activation checkpointing of the actor and the critic (ppo_actor.py, ppo_critic.py read this one flag)",
    )
    policy, critic = a.lora.get("policy"), a.lora.get("critic")
    if "critic" in a.roles and policy != critic:
        raise _refuse(
            target,
            f"LoRA {_lora_text(policy)} for the policy and {_lora_text(critic)} for the critic",
            "OpenRLHF's --ds.lora.* adapt the actor and the critic alike (ppo_actor.py, ppo_critic.py)",
            "give both the same adapters (--lora-rank with a config whose critic has them too)",
        )
    if policy is not None and policy.alpha != int(policy.alpha):
        raise _refuse(target, f"--lora-alpha {policy.alpha:g}", "--ds.lora.alpha takes an integer", "pass an integer --lora-alpha")
    keys.append(
        Key(
            "--ds.lora.rank",
            0 if policy is None else policy.rank,
            f"{_lora_text(policy)} for the actor and the critic (ppo_actor.py, ppo_critic.py)",
        )
    )
    if policy is not None:
        keys.append(Key("--ds.lora.alpha", int(policy.alpha)))
        keys += _openrlhf_targets(run, policy, same)
    _check_head(
        target,
        a,
        ("full",),
        "OpenRLHF computes log-probs from the whole logits (profiled with batchfit's full head) and has no flag for "
        "another head",
        "drop --logprobs (full is OpenRLHF's)",
    )
    return keys


def _openrlhf_targets(run: RunConfig, spec: LoraSpec, same: bool) -> list[Key]:
    """``--ds.lora.target_modules`` (``nargs="*"``): module names; all-linear only as the flag's default.

    Given on the command line the flag is a list, and PEFT expands ``all-linear`` only from a
    string (``peft/tuners/tuners_utils.py`` ``_maybe_include_all_linear_layers``): the default
    ``"all-linear"`` must stay the default.
    """
    if not isinstance(spec.targets, str):
        return [Key("--ds.lora.target_modules", _lora_value(spec))]
    given = getattr(run, "values", {}).get("ds.lora.target_modules", "all-linear")
    if same and given != "all-linear":
        raise _refuse(
            "openrlhf",
            "--lora-targets all-linear",
            f"the launch command gives --ds.lora.target_modules {shlex.join(map(str, given))}, and all-linear is "
            "only its default (given as a flag it is a list, which PEFT reads as a module name)",
            "remove --ds.lora.target_modules from the command, or pass --lora-targets with module names",
        )
    return [Key("", False, "LoRA on every linear layer: --ds.lora.target_modules left at its default, all-linear")]


# --------------------------------------------------------------------------- slime 624b824a


def _slime(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "slime"
    s = a.sharding
    _check_strategy(
        target,
        a,
        ("fsdp2",),
        "slime trains with Megatron-LM only (--train-backend megatron), which batchfit approximates by FSDP2 over the "
        "same GPUs",
    )
    if not s.reshard_after_forward:
        raise _refuse(
            target,
            "--no-reshard-after-forward",
            "slime trains with Megatron-LM, approximated by FSDP2 resharding after forward",
            "drop --no-reshard-after-forward",
        )
    if s.offload == "cpu":
        raise _refuse(
            target,
            "--offload cpu",
            "slime keeps the training state on the GPUs while it trains (--offload-train moves it to the host "
            "between phases only)",
            "profile with --offload none",
        )
    _check_precision(
        target,
        a,
        "slime always trains in bf16 with Megatron's distributed optimizer, fp32 main parameters "
        "(slime/backends/megatron_utils/arguments.py set_default_megatron_args: bf16, use_distributed_optimizer)",
    )
    if a.lora.get("policy") is not None:
        raise _refuse(target, f"--lora-rank {a.lora['policy'].rank}", "slime at 624b824a has no LoRA flags", "pass --lora-rank 0")
    nodes, per_node = _gpus(run, a, target)
    keys = [
        Key("--actor-num-nodes", nodes, f"the {s.world_size} GPUs profiled (the critic shares them)"),
        Key("--actor-num-gpus-per-node", per_node),
        Key(
            "",
            False,
            "profiled as FSDP2 over these GPUs with fp32 main parameters and bf16 compute, an approximation of "
            "Megatron's layout (slime sets bf16 and the distributed optimizer itself)",
        ),
    ]
    on = a.gradient_checkpointing
    if on:
        # Megatron's TransformerConfig needs a method with full recompute; uniform over 1 layer checkpoints every
        # layer's input, as batchfit does (slime's scripts/run-qwen3-4B.sh passes these three)
        keys += [
            Key("--recompute-granularity", "full", "every layer's input checkpointed (Megatron's full recompute)"),
            Key("--recompute-method", "uniform"),
            Key("--recompute-num-layers", 1),
        ]
    else:
        keys += _switch(
            target,
            run,
            same,
            "--recompute-granularity full",
            False,
            bool(run.gradient_checkpointing),
            "--gradient-checkpointing",
            "",
        )
    _check_head(
        target,
        a,
        ("full",),
        "slime computes log-probs from the whole logits (profiled with batchfit's full head) and has no flag for "
        "another head",
        "drop --logprobs (full is slime's)",
    )
    return keys


def _switch(
    target: str, run: RunConfig, same: bool, flag: str, on: bool, given: bool, option: str, why: str
) -> list[Key]:
    """A ``store_true`` flag: given when on; when off, refused if the launch command gives it (no flag undoes it)."""
    if on:
        return [Key(flag, True, why)]
    if same and given:
        raise _refuse(
            target,
            option.replace("--", "--no-", 1),
            f"the launch command gives {flag}, and no flag added after it turns it off",
            f"remove {flag} from the command, or drop {option.replace('--', '--no-', 1)}",
        )
    return [Key("", False, f"profiled without {flag}: leave it out of the command")]


def _lora_text(spec: LoraSpec | None) -> str:
    return "no LoRA" if spec is None else spec.describe()


def _lora_keys(spec: LoraSpec | None, rank: str, alpha: str, targets: str) -> list[Key]:
    if spec is None:
        return [Key(rank, 0, "no LoRA: every parameter trained")]
    return [
        Key(rank, spec.rank, f"{spec.describe()}: adapters on a frozen base"),
        Key(alpha, int(spec.alpha) if spec.alpha == int(spec.alpha) else spec.alpha),
        Key(targets, _lora_value(spec)),
    ]


_WRITERS: dict[str, Callable[[RunConfig, Assumptions, bool], list[Key]]] = {
    "verl": _verl,
    "skyrl": _skyrl,
    "openrlhf": _openrlhf,
    "slime": _slime,
}
