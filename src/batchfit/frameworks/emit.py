"""The keys to set in a SkyRL or verl config, from measured budgets: YAML with a comment per key, or overrides.

:func:`emit_keys` picks the keys and values; :func:`render_yaml` and :func:`render_overrides`
write them. The YAML merged into the profiled config passes ``batchfit plan`` on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchfit.errors import InvalidArgument
from batchfit.frameworks.profile import RunProfile

TARGETS = ("verl", "skyrl")
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
    ("critic_forward", "critic.use_dynamic_bsz", "critic.forward_max_token_len_per_gpu", "values (no_grad)"),
)
FORMATS = ("yaml", "overrides")


@dataclass(frozen=True)
class Key:
    """One key to set: its dotted path, value and why."""

    path: str
    value: int | bool
    comment: str = ""


def emit_keys(profile: RunProfile, target: str, *, max_seq_len: int, margin: float) -> list[Key]:
    """The keys that configure ``target`` with ``profile``'s budgets.

    Raises:
        InvalidArgument: ``target`` is not one of :data:`TARGETS`.
    """
    if target not in TARGETS:
        raise InvalidArgument(f"--emit must be one of {', '.join(TARGETS)}, but got {target!r}")
    budgets = {role: b.tokens for role, b in profile.budgets.items()}

    def why(role: str, what: str) -> str:
        b = profile.budgets[role]
        return f"{what}: measured budget {b.tokens:,} tokens per GPU ({margin:g} of {b.usable_bytes / 2**30:.1f} GiB usable)"

    if target == "verl":
        keys = [
            Key("actor_rollout_ref.actor.use_dynamic_bsz", True, "micro-batches by the token lengths below")
        ]
        for role, switch, length, what in VERL_KEYS:
            if role in budgets:
                if all(k.path != switch for k in keys):
                    keys.append(Key(switch, True))
                keys.append(Key(length, budgets[role], why(role, what)))
        return keys
    return _skyrl_keys(profile, budgets, max_seq_len)


def _skyrl_keys(profile: RunProfile, budgets: dict[str, int], max_seq_len: int) -> list[Key]:
    """SkyRL has one token key for every pass, and micro sizes validate_batch_sizes checks."""
    trained = min(budgets[r] for r in ("policy", "critic") if r in budgets)
    forward = min(budgets[r] for r in ("policy_forward", "critic_forward", "reference") if r in budgets)
    binding = min(budgets, key=budgets.get)
    keys = [
        Key(
            "trainer.max_tokens_per_microbatch",
            min(trained, forward),
            f"every pass (SkyRL uses one key): the smallest budget, set by {binding}",
        )
    ]
    run = profile.run
    plan = run.batch.replace(max_tokens_per_micro_batch=None, micro_train_batch_size_per_gpu=1).plan()
    if plan.samples_per_mini_batch_per_gpu is not None:
        # the micro sizes SkyRL validates even with the token key: divisors of the per-GPU mini-batch
        per_gpu = min(r.samples_per_mini_batch_per_gpu for r in plan.roles)
        micro = _largest_divisor_at_most(per_gpu, max(trained // max_seq_len, 1))
        keys.append(
            Key(
                "trainer.micro_train_batch_size_per_gpu",
                micro,
                f"sample-based fallback: {micro} sequences of {max_seq_len:,} tokens fit, and {micro} divides {per_gpu}",
            )
        )
    keys.append(
        Key(
            "trainer.micro_forward_batch_size_per_gpu",
            max(forward // max_seq_len, 1),
            f"sample-based fallback: forward passes of {max_seq_len:,}-token sequences",
        )
    )
    if run.logprobs_chunk_size is not None:
        keys.append(
            Key(
                "trainer.logprobs_chunk_size",
                run.logprobs_chunk_size,
                "kept: the budgets were measured with the full fp32 logits, which chunking does not exceed",
            )
        )
    return keys


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def render_yaml(keys: list[Key], header: list[str]) -> str:
    """The keys as nested YAML, a ``# comment`` per key, ``header`` lines first."""
    lines = [f"# {line}" for line in header]
    open_path: list[str] = []
    for key in keys:
        *sections, leaf = key.path.split(".")
        common = 0
        while common < min(len(sections), len(open_path)) and sections[common] == open_path[common]:
            common += 1
        for depth in range(common, len(sections)):
            lines.append(f"{'  ' * depth}{sections[depth]}:")
        open_path = sections
        value = str(key.value).lower() if isinstance(key.value, bool) else str(key.value)
        comment = f"  # {key.comment}" if key.comment else ""
        lines.append(f"{'  ' * len(sections)}{leaf}: {value}{comment}")
    return "\n".join(lines) + "\n"


def render_overrides(keys: list[Key]) -> str:
    """The keys as Hydra command-line overrides, one ``path=value`` per line."""
    return (
        "\n".join(f"{k.path}={str(k.value).lower() if isinstance(k.value, bool) else k.value}" for k in keys)
        + "\n"
    )
