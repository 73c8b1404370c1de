"""The keys to set in a framework's config, from the profiled budgets: YAML, overrides or flags, a comment per key.

:func:`emit_keys` picks the keys and values: each framework's token keys are written by its emit
module (``<name>_emit.py``, :meth:`FrameworkSpec.emit_module
<batchfit.frameworks.registry.FrameworkSpec.emit_module>`), from the helpers here
(:data:`REMOVE_PADDING`, :func:`smallest_budget`, :func:`cost_note`). :func:`render_yaml` and :func:`render_overrides`
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
from batchfit.frameworks.your_sizes import compare, describe
from batchfit.memory import backend_class

__all__ = [
    "FLAG_TARGETS",
    "REMOVE_PADDING",
    "TARGETS",
    "EmitError",
    "Key",
    "check_emit",
    "cost_note",
    "emit_keys",
    "override_comments",
    "provenance",
    "render_flags",
    "render_keys",
    "render_overrides",
    "render_yaml",
    "smallest_budget",
    "target_head",
    "yours_keys",
]

TARGETS = tuple(name for name in framework_names() if get_framework(name).emit is not None)
"""Every framework of :mod:`batchfit.frameworks.registry` with an emit module: ``verl``, ``skyrl``, ``openrlhf``, ``slime``."""
FLAG_TARGETS = tuple(name for name in TARGETS if get_framework(name).reads_command)
"""Targets configured by command-line flags (rendered by :func:`render_flags`): ``openrlhf``, ``slime``."""
FORMATS = ("yaml", "overrides")


# verl and SkyRL count a micro-batch's valid tokens (the attention mask's sum): a token budget
# bounds packed rows only; with padding kept, a micro-batch is as wide as its longest row times
# its rows, which no token count bounds.
REMOVE_PADDING = (
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
    return _token_keys(profile, target, max_seq_len, margin, world) + settings + yours_keys(profile)


def yours_keys(profile: RunProfile) -> list[Key]:
    """Comments (keys without a path) putting each size the config sets beside batchfit's budget (:func:`your_sizes.compare`).

    Compared in the profiled config's own keys, whatever the target: the config's value, batchfit's, the
    ratio and the micro-batches per step each gives (issue 40's "say what the user's own number was").
    """
    return [Key("", False, describe(c)) for c in compare(profile)]


def _token_keys(profile: RunProfile, target: str, max_seq_len: int, margin: float, world: int) -> list[Key]:
    """The token budgets' keys of ``target`` (and the micro sizes and switches that go with them): its emit module's ``token_keys``."""
    budgets = {role: b.tokens for role, b in profile.budgets.items()}
    sp = profile.options["policy"].sharding.sequence_parallel

    def why(role: str, what: str) -> str:
        b = profile.budgets[role]
        # NOTE [ A group's budget ] (batchfit.budget.model_profile): under sequence parallelism a budget counts the tokens of a
        # micro-batch split over the sp GPUs of a group
        held = f"{b.tokens:,} tokens per GPU" if sp == 1 else f"{b.tokens:,} tokens per micro-batch split over {sp} GPUs"
        return f"{what}: {provenance(b.backend)} budget {held} ({margin:g} of {b.usable_bytes / 2**30:.1f} GiB usable)"

    return get_framework(target).emit_module().token_keys(profile, budgets, why, max_seq_len, world)


def smallest_budget(budgets: dict[str, int], roles: tuple[str, ...]) -> str | None:
    """The role of ``roles`` with the smallest budget (the one a shared key must take), or ``None``."""
    present = [r for r in roles if r in budgets]
    return min(present, key=budgets.get) if present else None


def cost_note(profile: RunProfile, framework: str) -> str:
    """What the budgets' rows are (packed, as ``framework`` runs them, or padded) for a flag target's comment."""
    costs = {b.cost for b in profile.budgets.values()}
    if costs == {"packed"}:
        return f"packed rows, as {framework} runs them"
    return f"padded rows; {framework} packs samples into one row (varlen): --cost packed profiles that"


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


def render_overrides(keys: list[Key], prefix: Callable[[str], str] | None = None) -> str:
    """The keys as Hydra command-line overrides, one ``path=value`` per line.

    Args:
        keys: the keys to set (a key without a path is a comment: :func:`override_comments`).
        prefix: path → the override's prefix: ``""`` for a key of the framework's composed config,
            ``"++"`` for one it does not have, which Hydra refuses to override without a prefix
            (``Could not override … To append to your config use +``); ``++`` adds the key or
            replaces the one a launch command added before it. ``None``: no prefixes.

    >>> print(render_overrides([Key("a.b", 1), Key("a.c", True)], lambda p: "++" * (p == "a.c")), end="")
    a.b=1
    ++a.c=true
    """
    add = prefix or (lambda path: "")
    return "\n".join(f"{add(k.path)}{k.path}={_text(k.value, 'overrides')}" for k in keys if k.path) + "\n"


def override_comments(keys: list[Key], header: list[str]) -> str:
    """What the YAML form says in comments, for the overrides form's stderr: ``header``, then each key's comment.

    Hydra takes no comments among overrides (``#`` is not in its override grammar: hydra-core 1.3.8
    raises ``OverrideParseException: LexerNoViableAltException``), so the caveats go beside them,
    as shell comments (``# line``).
    """
    lines = [f"# {line}" for line in header]
    lines += [f"# {k.path}: {k.comment}" if k.path else f"# {k.comment}" for k in keys if k.comment]
    return "".join(f"{line}\n" for line in lines)


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
    """``keys`` as ``target`` takes them: flags for :data:`FLAG_TARGETS`, else YAML or overrides (``fmt``; the
    caveats the YAML form writes as comments are then :func:`override_comments`, for stderr)."""
    if target in FLAG_TARGETS:
        return render_flags(keys, header)
    if fmt == "yaml":
        own = getattr(get_framework(target).emit_module(), "render", None)  # prime_rl_emit.render: TOML tables
        return own(keys, header) if own is not None else render_yaml(keys, header)
    # each emit module may say which of its keys the framework's composed config lacks (verl_emit.override_prefix)
    return render_overrides(keys, getattr(get_framework(target).emit_module(), "override_prefix", None))
