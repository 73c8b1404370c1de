"""SkyRL's vocabulary (``trainer.*``, ``trainer.placement.*``, ``generator.*``) in batchfit's terms.

Mirrors skyrl/train/config/config.py (defaults) and skyrl/train/utils/utils.py
(``validate_cfg``, ``validate_batch_sizes``) of NovaSky-AI/SkyRL a9564572.
"""

from __future__ import annotations

from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.frameworks.run import RunConfig, as_bool, as_int, misspelt_keys
from batchfit.frameworks.source import flatten
from batchfit.plan.config import BatchConfig

# SkyRL key -> BatchConfig field.
KEYS: dict[str, str] = {
    "trainer.train_batch_size": "train_batch_size",
    "trainer.policy_mini_batch_size": "policy_mini_batch_size",
    "trainer.critic_mini_batch_size": "critic_mini_batch_size",
    "trainer.micro_train_batch_size_per_gpu": "micro_train_batch_size_per_gpu",
    "trainer.micro_forward_batch_size_per_gpu": "micro_forward_batch_size_per_gpu",
    "trainer.update_epochs_per_batch": "update_epochs_per_batch",
    "trainer.placement.policy_num_nodes": "num_nodes",
    "trainer.placement.policy_num_gpus_per_node": "gpus_per_node",
    "trainer.policy.sequence_parallel_size": "sequence_parallel",
    "trainer.policy.megatron_config.tensor_model_parallel_size": "tensor_parallel",
    "trainer.policy.megatron_config.pipeline_model_parallel_size": "pipeline_parallel",
    "trainer.policy.megatron_config.context_parallel_size": "context_parallel",
    "generator.n_samples_per_prompt": "n_samples_per_prompt",
}
TOKEN_KEY = "trainer.max_tokens_per_microbatch"
# The step-wise switch: generator.step_wise_trajectories today; the other two are older names.
STEP_WISE_KEYS = (
    "generator.step_wise_trajectories",
    "trainer.step_wise_training",
    "generator.step_wise_training",
)
OTHER_KEYS = (
    TOKEN_KEY,
    "trainer.max_tokens_per_micro_batch",
    "trainer.logprobs_chunk_size",
    "trainer.placement.critic_num_nodes",
    "trainer.placement.critic_num_gpus_per_node",
    *STEP_WISE_KEYS,
)


def read(data: dict[str, Any], given: dict[str, Any]) -> RunConfig:
    """A resolved SkyRL config (defaults merged) as a :class:`RunConfig`; ``given`` is the
    user's own resolved keys (flat), to tell what the file says from what SkyRL defaults."""
    flat = flatten(data)
    misspelt = misspelt_keys(flat, set(flatten(_defaults())) | set(KEYS) | set(OTHER_KEYS))
    if misspelt:
        raise BatchConfigError(misspelt)
    faults: list[str] = []
    values: dict[str, Any] = {field: as_int(flat[key]) for key, field in KEYS.items() if key in flat}
    tokens = as_int(flat.get(TOKEN_KEY, flat.get("trainer.max_tokens_per_micro_batch")))
    values["max_tokens_per_micro_batch"] = (
        None if tokens is None or (isinstance(tokens, int) and tokens <= 0) else tokens
    )
    values["step_wise"] = _step_wise(given, faults)
    critic_model = flat.get("trainer.critic.model.path") or None
    if not critic_model:
        values["critic_mini_batch_size"] = None  # SkyRL: no critic model, no critic
    else:
        values["critic_world_size"] = _critic_world_size(flat, values, faults)
    algorithm = "trainer.algorithm."
    reference = bool(as_bool(flat.get(algorithm + "use_kl_loss"))) or bool(
        as_bool(flat.get(algorithm + "use_kl_in_reward"))
    )
    estimator = flat.get(algorithm + "advantage_estimator")
    if values["step_wise"] is True and estimator in ("gae", "reinforce++"):
        # validate_cfg: step-wise trajectories need an outcome-level estimator
        faults.append(
            f"generator.step_wise_trajectories=true does not work with trainer.algorithm.advantage_estimator="
            f"{estimator} (SkyRL validate_cfg); use grpo or rloo, or turn step-wise off"
        )
    if estimator == "gae" and not critic_model:
        # validate_cfg: PPO (gae) needs trainer.critic.model.path
        faults.append(
            "trainer.algorithm.advantage_estimator=gae needs a critic: set trainer.critic.model.path"
        )
    prompt = flat.get("generator.max_input_length") or flat.get("trainer.max_prompt_length")
    response = flat.get("generator.sampling_params.max_generate_length")
    prompt, response = as_int(prompt), as_int(response)
    max_seq_len = prompt + response if isinstance(prompt, int) and isinstance(response, int) else None
    offload = "cpu" if as_bool(flat.get("trainer.policy.fsdp_config.cpu_offload")) is True else "none"
    colocated, resident = _placement(flat, bool(critic_model), reference, offload)
    return RunConfig(
        vocabulary="skyrl",
        batch=BatchConfig(**values, framework="skyrl"),
        model=flat.get("trainer.policy.model.path"),
        critic_model=critic_model,
        reference=reference,
        max_seq_len=max_seq_len,
        strategy=flat.get("trainer.strategy"),
        offload=offload,
        gradient_checkpointing=as_bool(flat.get("trainer.gradient_checkpointing")),
        logprobs_chunk_size=as_int(flat.get("trainer.logprobs_chunk_size")),
        colocated=colocated,
        resident=resident,
        faults=tuple(faults),
        key_names={
            **{field: key for key, field in KEYS.items() if field not in ("num_nodes", "gpus_per_node")},
            "max_tokens_per_micro_batch": TOKEN_KEY,
        },
        source={
            "max_seq_len": "generator.max_input_length + generator.sampling_params.max_generate_length",
            "world_size": "trainer.placement.policy_num_nodes × policy_num_gpus_per_node",
            "model": "trainer.policy.model.path",
        },
    )


def _step_wise(given: dict[str, Any], faults: list[str]) -> Any:
    """The step-wise switch; the file's step-wise keys must agree (SkyRL reads only the first)."""
    set_keys = {key: as_bool(given[key]) for key in STEP_WISE_KEYS if given.get(key) is not None}
    if len(set(map(repr, set_keys.values()))) > 1:
        faults.append(
            "conflicting step-wise keys: "
            + ", ".join(f"{k}={v!r}" for k, v in set_keys.items())
            + f"; set only {STEP_WISE_KEYS[0]}"
        )
    return next(iter(set_keys.values()), False)


def _placement(
    flat: dict[str, Any], critic: bool, reference: bool, offload: str
) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """Which models share GPUs, and what each keeps there while another runs.

    ``colocate_all``: every model shares the GPUs with the inference engines, and SkyRL
    offloads each model to the host when it is not running (nothing stays resident).
    ``colocate_policy_ref`` (without it): the reference shares the policy's GPUs, both kept.
    """
    roles = ["policy", *(["critic"] if critic else []), *(["reference"] if reference else [])]
    placement = "trainer.placement."
    if as_bool(flat.get(placement + "colocate_all")) is True:
        return tuple(roles), {}
    if reference and as_bool(flat.get(placement + "colocate_policy_ref", True)) is True:
        kept = () if offload == "cpu" else ("parameters", "optimizer_state")
        return ("policy", "reference"), {"policy": kept, "reference": ("parameters",)}
    return (), {}


def _critic_world_size(flat: dict[str, Any], values: dict[str, Any], faults: list[str]) -> Any:
    """The critic's GPUs from its own placement keys (validate_batch_sizes uses them)."""
    nodes = as_int(flat.get("trainer.placement.critic_num_nodes", 1))
    per_node = as_int(flat.get("trainer.placement.critic_num_gpus_per_node", 1))
    if not (isinstance(nodes, int) and isinstance(per_node, int)):
        return None
    critic = nodes * per_node
    policy_nodes, policy_per_node = values.get("num_nodes") or 1, values.get("gpus_per_node") or 1
    colocated = as_bool(flat.get("trainer.placement.colocate_all"))
    if colocated is True and isinstance(policy_nodes, int) and isinstance(policy_per_node, int):
        policy = policy_nodes * policy_per_node
        if critic != policy:
            # trainer.build_models asserts it under colocate_all
            faults.append(
                f"trainer.placement.colocate_all=true needs the critic on the policy's GPUs, but the critic "
                f"has {nodes} × {per_node} = {critic} and the policy {policy}: set "
                "trainer.placement.critic_num_nodes/critic_num_gpus_per_node to the policy's, or colocate_all=false"
            )
    return critic


def _defaults() -> dict[str, Any]:
    from importlib import resources

    import yaml

    return yaml.safe_load(
        resources.files("batchfit.frameworks").joinpath("defaults", "skyrl.yaml").read_text()
    )
