"""verl's vocabulary (``data.*``, ``actor_rollout_ref.*``, ``critic.*``, ``trainer.*``) in batchfit's terms.

Mirrors verl/utils/config.py ``validate_config``, the actor and critic configs' checks
(verl/workers/config/actor.py, critic.py), the workers' normalisation
(verl/workers/fsdp_workers.py) and ``rearrange_micro_batches``
(verl/utils/seqlen_balancing.py) of volcengine/verl b178a3cd.

Units: verl counts ``train_batch_size`` and ``ppo_mini_batch_size`` in prompts (the workers
multiply by ``rollout.n``), micro sizes in samples per GPU, token lengths per GPU.
"""

from __future__ import annotations

from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.frameworks.run import RunConfig, as_bool, as_int, misspelt_keys
from batchfit.frameworks.source import flatten
from batchfit.plan.config import BatchConfig

ACTOR = "actor_rollout_ref.actor."
REF = "actor_rollout_ref.ref."
ROLLOUT = "actor_rollout_ref.rollout."
# Keys verl has beyond its defaults file that batchfit knows of (not misspellings).
EXTRA_KEYS = (
    "data.val_batch_size",
    "data.gen_batch_size",
    ACTOR + "fsdp_config.ulysses_sequence_parallel_size",
    "critic.model.fsdp_config.ulysses_sequence_parallel_size",
    "critic.forward_micro_batch_size",
    "reward_model.micro_batch_size",
    "reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length",
    ROLLOUT + "max_num_batched_tokens",
    ROLLOUT + "tensor_model_parallel_size",
)


# BatchConfig field -> the verl key it is read from (for messages in verl's words).
KEY_NAMES = {
    "train_batch_size": "data.train_batch_size",
    "policy_mini_batch_size": ACTOR + "ppo_mini_batch_size",
    "n_samples_per_prompt": ROLLOUT + "n",
    "micro_train_batch_size_per_gpu": ACTOR + "ppo_micro_batch_size_per_gpu",
    "micro_forward_batch_size_per_gpu": ROLLOUT + "log_prob_micro_batch_size_per_gpu",
    "max_tokens_per_micro_batch": ACTOR + "ppo_max_token_len_per_gpu",
    "update_epochs_per_batch": ACTOR + "ppo_epochs",
    "critic_mini_batch_size": "critic.ppo_mini_batch_size",
    "sequence_parallel": ACTOR + "ulysses_sequence_parallel_size",
}


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved verl config (defaults merged) as a :class:`RunConfig`."""
    del given  # every verl rule reads the merged config
    flat = flatten(data)
    misspelt = misspelt_keys(flat, set(flatten(_defaults())) | set(EXTRA_KEYS))
    if misspelt:
        raise BatchConfigError(misspelt)
    faults: list[str] = []

    def get(key: str) -> Any:
        return as_int(flat.get(key))

    n = get(ROLLOUT + "n")
    nnodes, per_node = get("trainer.nnodes"), get("trainer.n_gpus_per_node")
    world = nnodes * per_node if isinstance(nnodes, int) and isinstance(per_node, int) else None
    sp = get(ACTOR + "ulysses_sequence_parallel_size")
    if sp in (None, 1):
        sp = get(ACTOR + "fsdp_config.ulysses_sequence_parallel_size") or 1
    dynamic = as_bool(flat.get(ACTOR + "use_dynamic_bsz")) is True
    prompt, response = get("data.max_prompt_length"), get("data.max_response_length")
    max_seq_len = prompt + response if isinstance(prompt, int) and isinstance(response, int) else None

    micro = _micro_per_gpu(flat, ACTOR, "ppo_micro_batch_size", "actor", world, sp, dynamic, faults)
    _micro_per_gpu(
        flat, ROLLOUT, "log_prob_micro_batch_size", "actor_rollout_ref.rollout", world, sp, dynamic, faults
    )
    reference = (
        as_bool(flat.get(ACTOR + "use_kl_loss")) is True
        or as_bool(flat.get("algorithm.use_kl_in_reward")) is True
    )
    if reference:
        _micro_per_gpu(
            flat, REF, "log_prob_micro_batch_size", "actor_rollout_ref.ref", world, sp, dynamic, faults
        )
    critic = _uses_critic(flat)
    critic_mini = None
    if critic:
        critic_mini = get("critic.ppo_mini_batch_size")
        critic_dynamic = as_bool(flat.get("critic.use_dynamic_bsz")) is True
        critic_micro = _micro_per_gpu(
            flat, "critic.", "ppo_micro_batch_size", "critic", world, sp, critic_dynamic, faults
        )
        _check_critic_micro(critic_mini, n, world, sp, critic_micro, faults)
    _check_token_lengths(flat, max_seq_len, dynamic, reference, critic, faults)
    values = {
        "train_batch_size": get("data.train_batch_size"),
        "policy_mini_batch_size": get(ACTOR + "ppo_mini_batch_size"),
        "n_samples_per_prompt": n,
        "critic_mini_batch_size": critic_mini,
        "max_tokens_per_micro_batch": get(ACTOR + "ppo_max_token_len_per_gpu") if dynamic else None,
        "update_epochs_per_batch": get(ACTOR + "ppo_epochs"),
        "num_nodes": nnodes,
        "gpus_per_node": per_node,
        "sequence_parallel": sp,
    }
    if micro is not None:
        values["micro_train_batch_size_per_gpu"] = micro
    forward = get(ROLLOUT + "log_prob_micro_batch_size_per_gpu")
    if forward is not None:
        values["micro_forward_batch_size_per_gpu"] = forward
    # fsdp_workers: offload_policy is FSDP2's CPUOffloadPolicy (the sharded state lives on the
    # host); param_offload / optimizer_offload move state to the host between phases only.
    offload = "cpu" if as_bool(flat.get(ACTOR + "fsdp_config.offload_policy")) is True else "none"
    roles = ["policy", *(["reference"] if reference else []), *(["critic"] if critic else [])]
    return RunConfig(
        vocabulary="verl",
        batch=BatchConfig(**values, framework="verl"),
        model=flat.get("actor_rollout_ref.model.path"),
        critic_model=flat.get("critic.model.path") if critic else None,
        reference=reference,
        max_seq_len=max_seq_len,
        strategy=flat.get(ACTOR + "strategy"),
        offload=offload,
        gradient_checkpointing=as_bool(flat.get("actor_rollout_ref.model.enable_gradient_checkpointing")),
        # actor, rollout and reference share one worker; the critic shares the global pool
        colocated=tuple(roles) if len(roles) > 1 else (),
        resident={
            "policy": _kept(flat, ACTOR + "fsdp_config.", optimizer=True),
            "reference": _kept(flat, REF + "fsdp_config.", optimizer=False),
            "critic": _kept(flat, "critic.model.fsdp_config.", optimizer=True),
        },
        faults=tuple(faults),
        key_names=KEY_NAMES,
        source={
            "max_seq_len": "data.max_prompt_length + data.max_response_length",
            "world_size": "trainer.nnodes × trainer.n_gpus_per_node",
            "model": "actor_rollout_ref.model.path",
        },
    )


def _kept(flat: dict[str, Any], prefix: str, *, optimizer: bool) -> tuple[str, ...]:
    """The state a model keeps on its GPUs while a colocated one runs (not offloaded)."""
    kept = [] if as_bool(flat.get(prefix + "param_offload")) is True else ["parameters"]
    if optimizer and as_bool(flat.get(prefix + "optimizer_offload")) is not True:
        kept.append("optimizer_state")
    return tuple(kept)


def _uses_critic(flat: dict[str, Any]) -> bool:
    """verl trainer/ppo/utils.py ``need_critic``: ``critic.enable`` if set, else GAE advantages."""
    enable = as_bool(flat.get("critic.enable"))
    if enable is not None:
        return enable is True
    return flat.get("algorithm.adv_estimator") == "gae"


def _micro_per_gpu(
    flat: dict[str, Any],
    prefix: str,
    name: str,
    section: str,
    world: int | None,
    sp: int,
    dynamic: bool,
    faults: list[str],
) -> int | None:
    """The per-GPU micro size from ``<name>_per_gpu`` or the deprecated global ``<name>``.

    Without dynamic batch sizes verl needs exactly one of the two
    (``check_mutually_exclusive``, ``ActorConfig.__post_init__``); the global one is
    divided by the data-parallel size (fsdp_workers).
    """
    per_gpu, global_ = as_int(flat.get(prefix + name + "_per_gpu")), as_int(flat.get(prefix + name))
    if dynamic:
        return per_gpu
    if per_gpu is None and global_ is None:
        faults.append(
            f"[{section}] set {prefix}{name}_per_gpu (samples per forward/backward on one GPU) or "
            f"use_dynamic_bsz=true with a token length; verl refuses neither"
        )
        return None
    if per_gpu is not None and global_ is not None:
        faults.append(
            f"[{section}] both {prefix}{name} and {prefix}{name}_per_gpu are set; remove {prefix}{name} "
            "(deprecated), as verl requires"
        )
        return per_gpu
    if per_gpu is None and isinstance(global_, int) and isinstance(world, int):
        return max(global_ // max(world // sp, 1), 1)
    return per_gpu


def _check_critic_micro(
    mini: Any, n: Any, world: int | None, sp: int, micro: int | None, faults: list[str]
) -> None:
    """fsdp_workers CriticWorker: normalised mini-batch per GPU divisible by the micro size."""
    if not all(isinstance(v, int) and v > 0 for v in (mini, n, world, micro)):
        return
    per_gpu = mini * n // max(world // sp, 1)
    if per_gpu and per_gpu % micro:
        faults.append(
            f"critic: the normalised ppo_mini_batch_size per GPU = {mini} × {n} / {world // sp} = {per_gpu} is "
            f"not divisible by critic.ppo_micro_batch_size_per_gpu={micro}; set it to a divisor of {per_gpu}"
        )


def _check_token_lengths(
    flat: dict[str, Any],
    max_seq_len: int | None,
    dynamic: bool,
    reference: bool,
    critic: bool,
    faults: list[str],
) -> None:
    """rearrange_micro_batches asserts max_token_len >= the sequence length at run time."""
    if max_seq_len is None:
        return
    keys = []
    if dynamic:
        keys.append(ACTOR + "ppo_max_token_len_per_gpu")
    if as_bool(flat.get(ROLLOUT + "log_prob_use_dynamic_bsz")) is True:
        keys.append(ROLLOUT + "log_prob_max_token_len_per_gpu")
    if reference and as_bool(flat.get(REF + "log_prob_use_dynamic_bsz")) is True:
        keys.append(REF + "log_prob_max_token_len_per_gpu")
    if critic and as_bool(flat.get("critic.use_dynamic_bsz")) is True:
        keys += ["critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu"]
    for key in keys:
        value = as_int(flat.get(key))
        if isinstance(value, int) and value < max_seq_len:
            faults.append(
                f"{key}={value} is below the longest sequence, data.max_prompt_length + data.max_response_length "
                f"= {max_seq_len}: verl's rearrange_micro_batches refuses it at run time; set it to at least {max_seq_len}"
            )


def _defaults() -> dict[str, Any]:
    from importlib import resources

    import yaml

    return yaml.safe_load(
        resources.files("batchfit.frameworks").joinpath("defaults", "verl.yaml").read_text()
    )
