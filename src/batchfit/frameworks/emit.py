"""The keys to set in a framework's config, from the profiled budgets: YAML, overrides or flags, a comment per key.

:func:`emit_keys` picks the keys and values; :func:`render_yaml` and :func:`render_overrides`
write SkyRL's and verl's keys, :func:`render_flags` OpenRLHF's and slime's command-line flags
(the flags their trainers' argument parsers accept, ``defaults/<framework>_flags.json``);
:func:`render_keys` picks by target. The YAML merged into the profiled config, or the flags
added to the launch command, pass ``batchfit plan`` on it. Each comment says whether its budget
was **estimated** (the estimate backend) or **measured** (cpu, cuda): :func:`provenance`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.frameworks.profile import RunProfile

TARGETS = ("verl", "skyrl", "openrlhf", "slime")
FLAG_TARGETS = ("openrlhf", "slime")
"""Targets configured by command-line flags (rendered by :func:`render_flags`)."""
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
FORMATS = ("yaml", "overrides")


@dataclass(frozen=True)
class Key:
    """One key to set: its dotted path (or flag), value and why.

    For flags, ``True`` is a switch given alone (``store_true``), and a key with an empty
    ``path`` is a comment only.
    """

    path: str
    value: int | bool
    comment: str = ""


# verl and SkyRL count a micro-batch's valid tokens (the attention mask's sum): a token budget
# bounds packed rows only; with padding kept, a micro-batch is as wide as its longest row times
# its rows, which no token count bounds.
_REMOVE_PADDING = (
    "the budgets bound packed rows, and {framework} counts valid tokens: without it every micro-batch "
    "is padded to its longest row, which no token budget bounds"
)


def provenance(backend: str) -> str:
    """``"estimated"`` for a budget from the estimate backend, ``"measured"`` for one from cpu or cuda.

    >>> provenance("estimate"), provenance("cuda")
    ('estimated', 'measured')
    """
    return "estimated" if backend == "estimate" else "measured"


def emit_keys(profile: RunProfile, target: str, *, max_seq_len: int, margin: float) -> list[Key]:
    """The keys (or flags, for :data:`FLAG_TARGETS`) that configure ``target`` with ``profile``'s budgets.

    Each key's comment names the pass it bounds and its budget, ``estimated`` or ``measured``
    (:func:`provenance`), with the safety margin and the usable memory it came from.

    Raises:
        InvalidArgument: ``target`` is not one of :data:`TARGETS`.
    """
    if target not in TARGETS:
        raise InvalidArgument(f"--emit must be one of {', '.join(TARGETS)}, but got {target!r}")
    budgets = {role: b.tokens for role, b in profile.budgets.items()}

    def why(role: str, what: str) -> str:
        b = profile.budgets[role]
        return (
            f"{what}: {provenance(b.backend)} budget {b.tokens:,} tokens per GPU ({margin:g} of "
            f"{b.usable_bytes / 2**30:.1f} GiB usable)"
        )

    if target in FLAG_TARGETS:
        return (
            _openrlhf_keys(profile, budgets, why)
            if target == "openrlhf"
            else _slime_keys(profile, budgets, why)
        )

    if target == "verl":
        keys = [
            Key("actor_rollout_ref.actor.use_dynamic_bsz", True, "micro-batches by the token lengths below"),
            Key("actor_rollout_ref.model.use_remove_padding", True, _REMOVE_PADDING.format(framework="verl")),
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
                keys.append(Key(length, value, why(bound, what)))
        return keys
    return _skyrl_keys(profile, budgets, max_seq_len, why)


_NAMES = {"verl": "verl", "skyrl": "SkyRL", "openrlhf": "OpenRLHF", "slime": "slime"}


def lost_notes(profile: RunProfile, target: str) -> list[str]:
    """What ``target``'s keys cannot express of ``profile``'s budgets, one sentence each (empty: nothing).

    A response-only head's budgets (NOTE [ A budget in two dimensions ] in
    :mod:`batchfit.budget.find`) have a second cap, the response tokens of a micro-batch; no
    framework has a key for it (verl, SkyRL, OpenRLHF and slime bound total tokens only), and
    each runs its own head over every token unless its log-prob computation is replaced.

    Example: ``lost_notes(profile, "verl")`` is ``[]`` for a profile without ``--response-only``.
    """
    capped = {role: b for role, b in profile.budgets.items() if b.response_tokens is not None}
    if not capped:
        return []
    name = _NAMES.get(target, target)
    caps = ", ".join(f"{role} {b.response_tokens:,}" for role, b in capped.items())
    fractions = {b.response_fraction for b in capped.values()}
    share = "every token" if fractions == {None} else f"{max(f or 1.0 for f in fractions):.3g}"
    return [
        f"lost: the response cap (response tokens per micro-batch: {caps}); {name} bounds total tokens only, so "
        f"the token keys hold for micro-batches whose response share is at most the probed {share}; "
        "--response-fraction 1 profiles a budget that holds at any share",
        f"lost unless patched: {name} runs its head over every token; the budgets assume batchfit's "
        "response-only head (batchfit.train.model_logprobs(..., only_loss_tokens=True)) in its log-prob computation",
    ]


def _skyrl_keys(profile: RunProfile, budgets: dict[str, int], max_seq_len: int, why: Any) -> list[Key]:
    """SkyRL has one token key for every pass, and micro sizes validate_batch_sizes checks."""
    trained = min(budgets[r] for r in ("policy", "critic") if r in budgets)
    forward = min(budgets[r] for r in ("policy_forward", "critic_forward", "reference") if r in budgets)
    binding = min(budgets, key=budgets.get)
    keys = [
        Key(
            "trainer.max_tokens_per_microbatch",
            min(trained, forward),
            why(binding, f"every pass (SkyRL uses one key): the smallest budget, set by {binding}"),
        ),
        Key("trainer.remove_microbatch_padding", True, _REMOVE_PADDING.format(framework="SkyRL")),
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
                f"kept: the budgets were {provenance(profile.budgets[binding].backend)} with SkyRL's entropy "
                "chunked by it",
            )
        )
    return keys


def _smallest(budgets: dict[str, int], roles: tuple[str, ...]) -> str | None:
    """The role of ``roles`` with the smallest budget (the one a shared key must take), or ``None``."""
    present = [r for r in roles if r in budgets]
    return min(present, key=budgets.get) if present else None


def _cost_note(profile: RunProfile, framework: str) -> str:
    costs = {b.cost for b in profile.budgets.values()}
    if costs == {"packed"}:
        return f"packed rows, as {framework} runs them"
    return f"padded rows; {framework} packs samples into one row (varlen): --cost packed profiles that"


def _openrlhf_keys(profile: RunProfile, budgets: dict[str, int], why: Any) -> list[Key]:
    """OpenRLHF 0.11.2: one token flag for the actor and critic updates, one for the experience passes.

    ``--train.max_tokens_per_gpu`` bounds the training micro-batches of the actor and the critic
    (replay_buffer.setup_dynamic_batch); ``--rollout.max_tokens_per_gpu`` the forward passes that
    make experience: old log-probs, reference log-probs, values (experience_maker).
    """
    trained = _smallest(budgets, ("policy", "critic"))
    forward = _smallest(budgets, ("policy_forward", "reference", "critic_forward"))
    values = getattr(profile.run, "values", {})
    keys = [
        Key(
            "--train.dynamic_batch_enable",
            True,
            "micro-batches by the token counts below (replay_buffer.setup_dynamic_batch, experience_maker)",
        ),
        Key(
            "--ds.packing_samples",
            True,
            "train_ppo_ray turns it on with dynamic batches anyway; it needs vLLM (--vllm.num_engines > 0)"
            + ("" if values.get("vllm.num_engines") else ", which this command does not set"),
        ),
    ]
    if trained is not None:
        what = (
            "actor and critic updates (one flag): the smaller budget"
            if "critic" in budgets
            else "actor update"
        )
        keys.append(
            Key("--train.max_tokens_per_gpu", budgets[trained], why(trained, f"{what}, set by {trained}"))
        )
    if forward is not None:
        passes = [p for p in ("policy_forward", "reference", "critic_forward") if p in budgets]
        keys.append(
            Key(
                "--rollout.max_tokens_per_gpu",
                budgets[forward],
                why(forward, f"experience passes ({', '.join(passes)}; no_grad), set by {forward}"),
            )
        )
    keys.append(
        Key(
            "",
            False,
            f"the budgets count {_cost_note(profile, 'OpenRLHF')}; OpenRLHF's caps are soft: it balances samples "
            "into the first-fit count of micro-batches, and rounds the experience passes' count down to a multiple "
            "of the actor ranks, so a micro-batch can hold more than its cap (the safety margin absorbs a little)",
        )
    )
    return keys


def _slime_keys(profile: RunProfile, budgets: dict[str, int], why: Any) -> list[Key]:
    """slime (624b824a): one token flag for every pass; log-probs and values run the training micro-batches.

    ``build_dp_schedule`` cuts each step into micro-batches of at most ``--max-tokens-per-gpu``
    (× context-parallel size); ``compute_log_prob`` (old, reference) and the critic's values reuse
    that schedule, so the flag takes the smallest budget. ``--log-probs-max-tokens-per-gpu`` is
    parsed but not read at that commit, so it is not emitted.
    """
    binding = _smallest(budgets, tuple(budgets))
    keys = [
        Key("--use-dynamic-batch-size", True, "micro-batches by the token count below (build_dp_schedule)")
    ]
    if binding is not None:
        keys.append(
            Key(
                "--max-tokens-per-gpu",
                budgets[binding],
                why(
                    binding,
                    f"every pass (slime runs log-probs and values over the training micro-batches), set by {binding}",
                ),
            )
        )
    keys.append(Key("", False, f"the budget counts {_cost_note(profile, 'slime')}"))
    return keys


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def render_yaml(keys: list[Key], header: list[str]) -> str:
    """The keys as nested YAML, a ``# comment`` per key, ``header`` lines first.

    Keys of one section are written together, in the order the section first appears (a
    section written twice would be a duplicate YAML key, the second replacing the first).
    """
    lines = [f"# {line}" for line in header]
    open_path: list[str] = []
    for key in _grouped(keys):
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


def _grouped(keys: list[Key]) -> list[Key]:
    """``keys`` reordered so that each section's keys are contiguous (first appearances kept in order)."""
    first: dict[str, int] = {}
    for index, key in enumerate(keys):
        parts = key.path.split(".")[:-1]
        for depth in range(1, len(parts) + 1):
            first.setdefault(".".join(parts[:depth]), index)

    def order(item: tuple[int, Key]) -> tuple[int, ...]:
        index, key = item
        parts = key.path.split(".")[:-1]
        return (*(first[".".join(parts[:depth])] for depth in range(1, len(parts) + 1)), index)

    return [key for _, key in sorted(enumerate(keys), key=order)]


def render_overrides(keys: list[Key]) -> str:
    """The keys as Hydra command-line overrides, one ``path=value`` per line."""
    return (
        "\n".join(f"{k.path}={str(k.value).lower() if isinstance(k.value, bool) else k.value}" for k in keys)
        + "\n"
    )


def render_flags(keys: list[Key], header: list[str]) -> str:
    """The keys as command-line flags to add to the launch command: ``# comment`` lines, then the flags.

    Switches (``True``) are given alone, other values after their flag; every flag line but
    the last ends in `` \\`` so the block pastes into a shell command.

    >>> print(render_flags([Key("--use-dynamic-batch-size", True), Key("--max-tokens-per-gpu", 8192, "why")], []), end="")
    # --max-tokens-per-gpu: why
    --use-dynamic-batch-size \\
    --max-tokens-per-gpu 8192
    """
    lines = [f"# {line}" for line in header]
    lines += [f"# {k.path}: {k.comment}" if k.path else f"# {k.comment}" for k in keys if k.comment]
    flags = [
        k.path if k.value is True else f"{k.path} {k.value}" for k in keys if k.path and k.value is not False
    ]
    lines += [f"{flag} \\" for flag in flags[:-1]] + flags[-1:]
    return "\n".join(lines) + "\n"


def render_keys(keys: list[Key], target: str, header: list[str], fmt: str = "yaml") -> str:
    """``keys`` as ``target`` takes them: flags for :data:`FLAG_TARGETS`, else YAML or overrides (``fmt``)."""
    if target in FLAG_TARGETS:
        return render_flags(keys, header)
    return render_yaml(keys, header) if fmt == "yaml" else render_overrides(keys)
