"""verl 0.9.1's keys for ``--emit verl``: the token lengths of each pass, and every setting the budgets assume.

:func:`token_keys` writes the switch and token length of each pass (:data:`VERL_KEYS`);
:func:`assumption_keys` the key of every setting the budgets were profiled with, or refuses what
verl cannot express (NOTE [ Emitted keys carry every assumption ] in
:mod:`batchfit.frameworks.assumptions`). :data:`batchfit.frameworks.verl.SPEC` names this module
(``FrameworkSpec.emit``); :mod:`batchfit.frameworks.emit` calls it through the registry.
"""

from __future__ import annotations

from typing import Any

from batchfit.frameworks.assumptions import (
    Assumptions,
    Key,
    allocator_comment,
    check_head,
    check_strategy,
    lora_adapter_keys,
    nodes_and_gpus,
    refuse,
)
from batchfit.frameworks.emit import REMOVE_PADDING
from batchfit.frameworks.run import RunConfig
from batchfit.frameworks.run_profile import RunProfile
from batchfit.frameworks.source import in_composed
from batchfit.frameworks.verl import SPEC
from batchfit.train.framework_heads import FrameworkHead

__all__ = ["VERL_KEYS", "assumption_keys", "override_prefix", "token_keys"]

# verl: each pass → the key that turns token-length micro-batching on, its length key, and what runs.
VERL_KEYS = (
    (
        "policy",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor update",
    ),
    (
        "policy_forward",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
        "old log-probs (no_grad)",
    ),
    (
        "reference",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "reference log-probs (no_grad)",
    ),
    ("critic", "critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "critic update"),
    # verl 0.9.1's V1 trainer (trainer_base.py) sets the critic engine's training and inference
    # token lengths both from ppo_infer_max_token_len_per_gpu: it takes the smaller budget
    (
        "critic_forward",
        "critic.use_dynamic_bsz",
        "critic.ppo_infer_max_token_len_per_gpu",
        "values (no_grad) and, in verl's V1 trainer, the critic update too",
    ),
)


def override_prefix(path: str) -> str:
    """``""`` for a key of verl 0.9.1's composed ``ppo_trainer`` config, ``"++"`` for one it lacks.

    verl's Hydra refuses to override a key its composed config does not have (``Could not
    override 'actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype'. To append to your
    config use +``): ``FSDPEngineConfig.mixed_precision`` is a dataclass field (``None`` by default)
    that ``engine/fsdp.yaml`` leaves out. ``++`` adds it, or replaces the value a launch script
    added with ``+`` (verl's own scripts write both). The composed config is the wheel's
    ``_generated_ppo_trainer.yaml`` (:func:`~batchfit.frameworks.source.in_composed`:
    ``critic.ppo_infer_max_token_len_per_gpu`` is a field of ``CriticConfig`` that ``critic.yaml``
    leaves out).

    >>> override_prefix("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), override_prefix(
    ...     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")
    ('', '++')
    """
    return "" if in_composed("verl", path) else "++"


def token_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """verl has a switch and a token length per pass (:data:`VERL_KEYS`), per GPU: the budget over the Ulysses size.

    NOTE [ verl multiplies by the Ulysses size ]: verl 0.9.1's actor multiplies each token length by
    ``ulysses_sequence_parallel_size`` (``verl/workers/actor/dp_actor.py``: ``max_token_len =
    ppo_max_token_len_per_gpu * self.ulysses_sequence_parallel_size`` for the update,
    ``data.meta_info["max_token_len"] * self.ulysses_sequence_parallel_size`` for log-probs; the
    critic and reward passes alike) and splits each micro-batch over the sp GPUs of its group. A
    budget of ``C`` tokens per group's micro-batch is therefore written as ``C // sp``.
    """
    del max_seq_len, world
    sp = profile.options["policy"].sharding.sequence_parallel
    keys = [
        Key("actor_rollout_ref.actor.use_dynamic_bsz", True, "micro-batches by the token lengths below"),
        Key("actor_rollout_ref.model.use_remove_padding", True, REMOVE_PADDING.format(framework="verl")),
    ]
    if "critic" in budgets:
        keys.append(Key("critic.model.use_remove_padding", True, "the critic's micro-batches packed too"))
    for role, switch, length, what in VERL_KEYS:
        if role in budgets:
            if all(k.path != switch for k in keys):
                keys.append(Key(switch, True))
            value = (
                min(budgets[role], budgets.get("critic", budgets[role]))
                if role == "critic_forward"
                else budgets[role]
            )
            bound = "critic" if role == "critic_forward" and value == budgets.get("critic") else role
            comment = why(bound, what)
            if sp > 1:
                comment += (
                    f"; per GPU: verl multiplies it by ulysses_sequence_parallel_size={sp} (dp_actor.py), so a "
                    f"micro-batch holds {value // sp * sp:,} tokens split over {sp} GPUs"
                )
            keys.append(Key(length, value // sp, comment))
    return keys


_V_MODEL = "actor_rollout_ref.model."
_V_ACTOR = "actor_rollout_ref.actor."
_V_ENGINE = _V_ACTOR + "fsdp_config."  # FSDPActorConfig.fsdp_config: the actor's FSDPEngineConfig
_V_REF_ENGINE = "actor_rollout_ref.ref.fsdp_config."
_V_CRITIC_ENGINE = "critic.fsdp."  # FSDPCriticConfig's FSDPEngineConfig
_V_SRC = "verl/workers/engine/fsdp/transformer_impl.py"
#: batchfit's strategy → verl's ``actor.strategy`` (a verl fact: its ``fsdp`` is FSDP1, ``fsdp2`` is fully_shard).
_V_STRATEGY = {"fsdp1": "fsdp", "fsdp2": "fsdp2"}


def assumption_keys(run: RunConfig, a: Assumptions, same: bool) -> list[Key]:
    target = "verl"
    s = a.sharding
    critic = "critic" in a.roles
    check_strategy(
        target,
        a,
        tuple(_V_STRATEGY),
        "verl's FSDP engines are FSDP1 (strategy fsdp) and FSDP2 (strategy fsdp2), not DDP",
    )
    if s.offload == "cpu" and _V_STRATEGY.get(s.strategy) == "fsdp":
        raise refuse(
            target,
            "--offload cpu with --sharding fsdp1",
            f"verl's FSDP1 engine turns CPU offload off for the actor and the critic ({_V_SRC} _build_fsdp_module: "
            "cpu_offload=None unless forward_only)",
            "pass --sharding fsdp2 (strategy fsdp2 reads fsdp_config.offload_policy)",
        )
    nodes, per_node = nodes_and_gpus(run, a, target)
    keys = [
        Key("trainer.nnodes", nodes, f"the {s.world_size} GPUs profiled (verl: trainer.nnodes × n_gpus_per_node)"),
        Key("trainer.n_gpus_per_node", per_node),
    ]
    name = _V_STRATEGY.get(s.strategy)
    if name is not None:
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
    if a.activation_offload or run.activation_offload:
        # fsdp_workers.py: enable_activation_offloading(module, strategy, enable_gradient_checkpointing)
        on = a.activation_offload
        keys.append(
            Key(
                _V_MODEL + "enable_activation_offload",
                on,
                "each layer's saved activations (with checkpointing: its inputs) offloaded to the host, as "
                "verl/utils/activation_offload.py does"
                if on
                else "profiled with activations on the GPU",
            )
        )
        if critic:
            keys.append(Key("critic.model.enable_activation_offload", on))
    keys.append(
        Key(
            _V_MODEL + "enable_gradient_checkpointing",
            a.gradient_checkpointing,
            f"profiled {'with' if a.gradient_checkpointing else 'without'} activation checkpointing",
        )
    )
    if critic:
        keys.append(Key("critic.model.enable_gradient_checkpointing", a.gradient_checkpointing))
    for role, (rank, alpha, targets) in SPEC.lora_keys.items():
        if role in a.roles:
            keys += lora_adapter_keys(a.lora.get(role), rank, alpha, targets)
    keys += _verl_head(run, a, same)
    return keys + _verl_sequence_parallel(run, a, critic)


def _verl_sequence_parallel(run: RunConfig, a: Assumptions, critic: bool) -> list[Key]:
    """The Ulysses size profiled (NOTE [ verl multiplies by the Ulysses size ]), when it or the config's is above 1."""
    sp = a.sharding.sequence_parallel
    if sp == 1 and (run.batch.sequence_parallel or 1) == 1:
        return []
    keys = [
        Key(
            _V_ENGINE + "ulysses_sequence_parallel_size",
            sp,
            f"each micro-batch split over {sp} GPUs (Ulysses), as profiled" if sp > 1 else "sequences unsplit, as profiled",
        ),
        # FSDPActorConfig.__post_init__: the deprecated actor key, when > 1, overrides the engine's
        Key(_V_ACTOR + "ulysses_sequence_parallel_size", sp, "the same (verl reads this one first when > 1)"),
    ]
    if critic:
        keys.append(Key(_V_CRITIC_ENGINE + "ulysses_sequence_parallel_size", sp))
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
    check_head(
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
    assert isinstance(head, FrameworkHead)  # check_head let only verl's head through
    modes = {head.entropy, head.forward_entropy} - {"none"}
    if len(modes) > 1:
        raise refuse(
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
            raise refuse(
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


def allocator_keys(a: Assumptions) -> list[Key]:
    """verl turns expandable segments on in its trainer itself; the optimizer offload the forward budgets assume."""
    keys = [
        allocator_comment(
            a,
            "verl 0.9.1 switches them on in the trainer after each weight sync (verl/workers/engine_workers.py "
            "update_weights: set_expandable_segments(True)), nothing to set",
        )
    ]
    if a.optimizer_offload:
        keys.append(
            Key(
                "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                True,
                "the old log-probs' budget holds without the optimizer state on the GPU (BaseEngineCtx: eval_mode "
                "loads the parameters only)",
            )
        )
    return keys
