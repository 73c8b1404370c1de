"""The keys to set in a framework's config, from the profiled budgets: YAML, overrides or flags, a comment per key.

:func:`emit_keys` picks the keys and values; :func:`render_yaml` and :func:`render_overrides`
write SkyRL's and verl's keys, :func:`render_flags` OpenRLHF's and slime's command-line flags
(the flags their trainers' argument parsers accept, ``defaults/<framework>_flags.json``);
:func:`render_keys` picks by target. The YAML merged into the profiled config, or the flags
added to the launch command, pass ``batchfit plan`` on it. Each comment says whether its budget
was **estimated** (the estimate backend) or **measured** (cpu, cuda): :func:`provenance`.
Beside the token keys, every setting the budgets were profiled with is written as the target's
key or flag, or refused (:mod:`batchfit.frameworks.assumptions`, NOTE [ Emitted keys carry every
assumption ]).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.frameworks.assumptions import EmitError, Key, check_emit, setting_keys
from batchfit.frameworks.registry import framework_names, get_framework
from batchfit.frameworks.run_profile import RunProfile
from batchfit.memory import backend_class

__all__ = [
    "FLAG_TARGETS",
    "TARGETS",
    "EmitError",
    "Key",
    "check_emit",
    "emit_keys",
    "provenance",
    "render_flags",
    "render_keys",
    "render_overrides",
    "render_yaml",
    "target_head",
]

TARGETS = framework_names()
"""Every framework of :mod:`batchfit.frameworks.registry`: ``verl``, ``skyrl``, ``openrlhf``, ``slime``."""
FLAG_TARGETS = tuple(name for name in TARGETS if get_framework(name).reads_command)
"""Targets configured by command-line flags (rendered by :func:`render_flags`): ``openrlhf``, ``slime``."""
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


# verl and SkyRL count a micro-batch's valid tokens (the attention mask's sum): a token budget
# bounds packed rows only; with padding kept, a micro-batch is as wide as its longest row times
# its rows, which no token count bounds.
_REMOVE_PADDING = (
    "the budgets bound packed rows, and {framework} counts valid tokens: without it every micro-batch "
    "is padded to its longest row, which no token budget bounds"
)


def target_head(target: str) -> str:
    """The log-prob head ``target`` runs by default, for a profile of another framework's config emitted to it.

    verl's and SkyRL's own heads (:data:`batchfit.train.HEADS` ``"verl"``, ``"skyrl"``: their
    default configs'); OpenRLHF and slime take log-probs from the whole logits (``"full"``):
    :attr:`FrameworkSpec.head <batchfit.frameworks.registry.FrameworkSpec.head>`.
    """
    if target not in TARGETS:
        raise InvalidArgument(f"--emit must be one of {', '.join(TARGETS)}, but got {target!r}")
    return get_framework(target).head


def target_reference_dtype(target: str) -> str:
    """The dtype ``target`` loads its reference model in by default, for a profile of another framework's config.

    verl composes the reference's engine from ``engine/fsdp.yaml`` (``model_dtype: fp32``);
    SkyRL (``trainer.bf16: true``), OpenRLHF (``--ds.param_dtype bf16``, ``launcher.py``) and
    slime load it in bf16 (:attr:`FrameworkSpec.reference_dtype
    <batchfit.frameworks.registry.FrameworkSpec.reference_dtype>`).
    """
    if target not in TARGETS:
        raise InvalidArgument(f"--emit must be one of {', '.join(TARGETS)}, but got {target!r}")
    return get_framework(target).reference_dtype


def provenance(backend: str) -> str:
    """``"estimated"`` for a budget from the estimate backend, ``"measured"`` for one from cpu or cuda.

    >>> provenance("estimate"), provenance("cuda")
    ('estimated', 'measured')
    """
    return "estimated" if backend_class(backend).simulated else "measured"


def emit_keys(profile: RunProfile, target: str, *, max_seq_len: int, margin: float) -> list[Key]:
    """The keys (or flags, for :data:`FLAG_TARGETS`) that configure ``target`` with ``profile``'s budgets.

    Each key's comment names the pass it bounds and its budget, ``estimated`` or ``measured``
    (:func:`provenance`), with the safety margin and the usable memory it came from. The token
    keys come first, then the keys of every setting the budgets assume
    (:func:`~batchfit.frameworks.assumptions.setting_keys`, read from ``profile.options``).

    Raises:
        InvalidArgument: ``target`` is not one of :data:`TARGETS`, or ``profile`` does not say
            what each model was profiled with (``profile.options``).
        EmitError: a setting ``target`` cannot carry (NOTE [ Emitted keys carry every assumption ]).
    """
    if target not in TARGETS:
        raise InvalidArgument(f"--emit must be one of {', '.join(TARGETS)}, but got {target!r}")
    options = getattr(profile, "options", None)
    if not options:
        raise InvalidArgument(
            "profile.options is empty: emit_keys writes the settings each model was profiled with, so it needs the "
            "RunProfile of profile_run (or options=role_options(run, options))"
        )
    settings = setting_keys(profile.run, options, target)
    world = options["policy"].sharding.world_size
    return _token_keys(profile, target, max_seq_len, margin, world) + settings


def _token_keys(profile: RunProfile, target: str, max_seq_len: int, margin: float, world: int) -> list[Key]:
    """The token budgets' keys of ``target`` (and the micro sizes and switches that go with them)."""
    budgets = {role: b.tokens for role, b in profile.budgets.items()}

    def why(role: str, what: str) -> str:
        b = profile.budgets[role]
        return (
            f"{what}: {provenance(b.backend)} budget {b.tokens:,} tokens per GPU ({margin:g} of "
            f"{b.usable_bytes / 2**30:.1f} GiB usable)"
        )

    return _TOKEN_KEYS[target](profile, budgets, why, max_seq_len, world)


def _verl_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """verl has a switch and a token length per pass (:data:`VERL_KEYS`)."""
    del profile, max_seq_len, world
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


def _skyrl_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """SkyRL has one token key for every pass, and micro sizes validate_batch_sizes checks (over the profiled GPUs)."""
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
    plan = skyrl_plan(profile.run, world)
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
    return keys


def skyrl_plan(run: Any, world: int) -> Any:
    """The batch plan SkyRL's micro sizes are derived from: ``run``'s sizes over ``world`` GPUs, sample micro-batches.

    Raises:
        BatchConfigError: the plan's faults in the config's own key names.
    """
    from batchfit.errors import BatchConfigError

    batch = run.batch
    nodes = batch.num_nodes if isinstance(batch.num_nodes, int) and batch.num_nodes > 0 else 1
    if world != run.world_size and world % nodes == 0:
        batch = batch.replace(world_size=None, num_nodes=nodes, gpus_per_node=world // nodes)
    try:
        return batch.replace(max_tokens_per_micro_batch=None, micro_train_batch_size_per_gpu=1).plan()
    except BatchConfigError as exc:
        raise BatchConfigError([run.in_own_words(f) for f in exc.faults]) from None


def _smallest(budgets: dict[str, int], roles: tuple[str, ...]) -> str | None:
    """The role of ``roles`` with the smallest budget (the one a shared key must take), or ``None``."""
    present = [r for r in roles if r in budgets]
    return min(present, key=budgets.get) if present else None


def _cost_note(profile: RunProfile, framework: str) -> str:
    costs = {b.cost for b in profile.budgets.values()}
    if costs == {"packed"}:
        return f"packed rows, as {framework} runs them"
    return f"padded rows; {framework} packs samples into one row (varlen): --cost packed profiles that"


def _openrlhf_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """OpenRLHF 0.11.2: one token flag for the actor and critic updates, one for the experience passes.

    ``--train.max_tokens_per_gpu`` bounds the training micro-batches of the actor and the critic
    (replay_buffer.setup_dynamic_batch); ``--rollout.max_tokens_per_gpu`` the forward passes that
    make experience: old log-probs, reference log-probs, values (experience_maker).
    """
    del max_seq_len, world
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


def _slime_keys(profile: RunProfile, budgets: dict[str, int], why: Any, max_seq_len: int, world: int) -> list[Key]:
    """slime (624b824a): one token flag for every pass; log-probs and values run the training micro-batches.

    ``build_dp_schedule`` cuts each step into micro-batches of at most ``--max-tokens-per-gpu``
    (× context-parallel size); ``compute_log_prob`` (old, reference) and the critic's values reuse
    that schedule, so the flag takes the smallest budget. ``--log-probs-max-tokens-per-gpu`` is
    parsed but not read at that commit, so it is not emitted.
    """
    del max_seq_len, world
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


# Each target's token keys, ``(profile, budgets, why, max_seq_len, world) → keys``.
_TOKEN_KEYS: dict[str, Callable[[RunProfile, dict[str, int], Any, int, int], list[Key]]] = {
    "verl": _verl_keys,
    "skyrl": _skyrl_keys,
    "openrlhf": _openrlhf_keys,
    "slime": _slime_keys,
}


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def render_yaml(keys: list[Key], header: list[str]) -> str:
    """The keys as nested YAML, a ``# comment`` per key, ``header`` lines first (then keys without a path: comments).

    Keys of one section are written together, in the order the section first appears (a
    section written twice would be a duplicate YAML key, the second replacing the first).
    """
    lines = [f"# {line}" for line in header]
    lines += [f"# {key.comment}" for key in keys if not key.path and key.comment]  # what no key can say
    open_path: list[str] = []
    for key in _grouped([key for key in keys if key.path]):
        *sections, leaf = key.path.split(".")
        common = 0
        while common < min(len(sections), len(open_path)) and sections[common] == open_path[common]:
            common += 1
        for depth in range(common, len(sections)):
            lines.append(f"{'  ' * depth}{sections[depth]}:")
        open_path = sections
        value = _text(key.value, "yaml")
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
    return "\n".join(f"{k.path}={_text(k.value, 'overrides')}" for k in keys if k.path) + "\n"


def _text(value: Any, style: str) -> str:
    """A key's value as YAML (``true``, ``[q_proj, v_proj]``), a Hydra override (``[q_proj,v_proj]``) or flag words."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        if style == "flags":
            return " ".join(map(str, value))
        return "[" + (", " if style == "yaml" else ",").join(map(str, value)) + "]"
    return str(value)


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
        k.path if k.value is True else f"{k.path} {_text(k.value, 'flags')}" for k in keys if k.path and k.value is not False
    ]
    lines += [f"{flag} \\" for flag in flags[:-1]] + flags[-1:]
    return "\n".join(lines) + "\n"


def render_keys(keys: list[Key], target: str, header: list[str], fmt: str = "yaml") -> str:
    """``keys`` as ``target`` takes them: flags for :data:`FLAG_TARGETS`, else YAML or overrides (``fmt``)."""
    if target in FLAG_TARGETS:
        return render_flags(keys, header)
    return render_yaml(keys, header) if fmt == "yaml" else render_overrides(keys)
