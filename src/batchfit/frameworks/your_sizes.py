"""The micro-batch sizes a framework config sets by hand, beside batchfit's budget for the same pass.

A config bounds each pass's micro-batches by a token count (verl ``ppo_max_token_len_per_gpu``,
SkyRL ``trainer.max_tokens_per_microbatch``, OpenRLHF ``--train.max_tokens_per_gpu``, slime
``--max-tokens-per-gpu``) or by a number of sequences (verl ``ppo_micro_batch_size_per_gpu``, SkyRL
``micro_train_batch_size_per_gpu``, OpenRLHF ``--train.micro_batch_size``, slime ``--micro-batch-size``).
Each framework's reader records what its config runs with (:class:`YourSize`, in
:attr:`RunConfig.configured <batchfit.frameworks.run.RunConfig.configured>`); :func:`compare`
puts each beside the profiled budget of its pass: the ratio, and the micro-batches one GPU runs
per optimizer step (per training step for a forward-only pass) under each, when every sequence
is as long as the longest (fewer when they are shorter).

# NOTE [ Per GPU or per micro-batch ]
verl, OpenRLHF and slime count tokens per GPU after a sequence-parallel split (a micro-batch
holds the value × the split's size: verl's ``ulysses_sequence_parallel_size``, OpenRLHF's
``--ds.ring_attn_size``, slime's ``--context-parallel-size``); SkyRL counts the micro-batch
before its split. batchfit's budget counts the micro-batch (NOTE [ A group's budget ] in
:mod:`batchfit.budget.model_profile`), so a per-GPU value is multiplied by the split's size
before they are compared, and batchfit's is shown in the config's unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchfit.errors import BatchfitError

__all__ = ["SizeComparison", "YourSize", "compare", "describe", "pass_sizes", "verl_sizes"]

#: What each pass is called in the sentences.
PASS_NAMES = {
    "policy": "actor update",
    "policy_forward": "old log-probs",
    "reference": "reference log-probs",
    "critic": "critic update",
    "critic_forward": "values",
}


@dataclass(frozen=True)
class YourSize:
    """What a config bounds one pass's micro-batches by.

    Attributes:
        role: the pass (``policy``, ``policy_forward``, ``reference``, ``critic``, ``critic_forward``).
        key: the config's key or flag, as the user writes it.
        value: its value (the framework's default when the config leaves it unset).
        unit: ``"tokens"`` or ``"sequences"``.
        per_gpu: a token count per GPU after a sequence-parallel split (NOTE [ Per GPU or per micro-batch ]).
    """

    role: str
    key: str
    value: int
    unit: str
    per_gpu: bool = True


@dataclass(frozen=True)
class SizeComparison:
    """One pass: the config's size beside batchfit's budget.

    Attributes:
        size: the config's.
        split: the sequence-parallel size a per-GPU token count is multiplied by (1 without a split).
        batchfit_tokens: batchfit's budget, tokens per micro-batch (of the split group).
        longest: the longest sequence the budgets were profiled for.
        batchfit: batchfit's budget in the config's unit: tokens per GPU (or per micro-batch, as
            :attr:`YourSize.per_gpu` says), or sequences of :attr:`longest` tokens (at least 1).
        ratio: ``batchfit / size.value``.
        sequences: sequences a micro-batch holds, ``(yours, batchfit's)``, at the longest length.
        micro_batches: micro-batches one GPU runs per optimizer step (trained passes) or per
            training step (forward passes), ``(yours, batchfit's)``, or ``None`` without a plan.
    """

    size: YourSize
    split: int
    batchfit_tokens: int
    longest: int
    batchfit: int
    ratio: float
    sequences: tuple[int, int]
    micro_batches: tuple[int, int] | None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the pass, the key, both values, the ratio and the micro-batches per step."""
        trained = self.size.role in ("policy", "critic")
        return {
            "pass": self.size.role,
            "key": self.size.key,
            "unit": self.size.unit if self.size.unit == "sequences" else
            ("tokens per GPU" if self.size.per_gpu else "tokens per micro-batch"),
            "yours": self.size.value,
            "batchfit": self.batchfit,
            "ratio": round(self.ratio, 3),
            "batchfit_tokens_per_micro_batch": self.batchfit_tokens,
            "sequences_per_micro_batch": {"yours": self.sequences[0], "batchfit": self.sequences[1]},
            "longest_sequence": self.longest,
            ("micro_batches_per_optimizer_step_per_gpu" if trained else "micro_batches_per_step_per_gpu"): None
            if self.micro_batches is None
            else {"yours": self.micro_batches[0], "batchfit": self.micro_batches[1]},
        }


def compare(profile: Any) -> list[SizeComparison]:
    """Every size the profiled config sets (:attr:`RunConfig.configured`) beside the budget of its pass.

    Args:
        profile: a :class:`~batchfit.frameworks.run_profile.RunProfile`: its run, budgets and options.

    Passes the profile has no budget for (a reference computed by the LoRA policy) are left out.
    """
    run = profile.run
    sizes = getattr(run, "configured", ())
    budgets = profile.budgets
    if not sizes or not budgets:
        return []
    options = profile.options.get("policy") or next(iter(profile.options.values()), None)
    split = 1 if options is None else max(options.sharding.sequence_parallel, 1) * options.sharding.context_parallel
    longest = (options.max_seq_len if options is not None else None) or run.max_seq_len
    if not longest:
        return []
    samples = _samples_per_gpu(run)
    out = []
    for size in sizes:
        budget = budgets.get(size.role)
        if budget is None or not isinstance(size.value, int) or size.value <= 0:
            continue
        tokens = budget.tokens
        group = split if size.per_gpu else 1
        theirs_seq = max(size.value * group // longest, 1) if size.unit == "tokens" else size.value
        ours_seq = max(tokens // longest, 1)
        ours = tokens // group if size.unit == "tokens" else ours_seq
        n = samples.get(size.role)
        micro = None if not n else (math.ceil(n / theirs_seq), math.ceil(n / ours_seq))
        out.append(
            SizeComparison(size, group, tokens, longest, ours, ours / size.value, (theirs_seq, ours_seq), micro)
        )
    return out


def describe(c: SizeComparison) -> str:
    """One sentence: ``actor update: yours actor_rollout_ref.actor.ppo_max_token_len_per_gpu=11,264 per GPU, batchfit 93,325: 8.3× …``."""
    s = c.size
    unit = "per GPU" if s.per_gpu else "per micro-batch"
    name = PASS_NAMES.get(s.role, s.role)
    if s.unit == "tokens":
        text = (
            f"{name}: yours {s.key}={s.value:,} {unit}, batchfit {c.batchfit:,}: {c.ratio:.1f}× "
            f"({c.sequences[0]} → {c.sequences[1]} sequences of {c.longest:,} tokens per micro-batch)"
        )
    else:
        text = (
            f"{name}: yours {s.key}={s.value:,} sequences per micro-batch, batchfit {c.batchfit:,} of "
            f"{c.longest:,} tokens ({c.batchfit_tokens:,} tokens): {c.ratio:.1f}×"
        )
    if c.ratio < 1:
        text += " (yours is above the budget: expect out-of-memory at the longest sequences)"
    if c.micro_batches is not None:
        per = "optimizer step" if s.role in ("policy", "critic") else "training step"
        text += f"; micro-batches per GPU per {per}: {c.micro_batches[0]} → {c.micro_batches[1]}"
        text += " at the longest sequences" if s.unit == "tokens" else ""
    return text


def _samples_per_gpu(run: Any) -> dict[str, int]:
    """Sequences one data-parallel rank runs per optimizer step (trained passes) or per training step (forward)."""
    try:
        plan = run.plan()
    except BatchfitError:  # a config whose plan is refused still gets its sizes compared, without counts
        return {}
    out: dict[str, int] = {}
    forward = plan.samples_per_step_per_gpu
    if plan.policy.samples_per_mini_batch_per_gpu:
        out["policy"] = plan.policy.samples_per_mini_batch_per_gpu
    if plan.critic is not None and plan.critic.samples_per_mini_batch_per_gpu:
        out["critic"] = plan.critic.samples_per_mini_batch_per_gpu
    if forward:
        out.update(policy_forward=forward, reference=forward, critic_forward=forward)
    return out


def pass_sizes(
    train: tuple[str, Any, str],
    forward: tuple[str, Any, str],
    *,
    reference: bool,
    critic: bool,
    per_gpu: bool = True,
) -> tuple[YourSize, ...]:
    """One size for the trained passes and one for the forward passes (SkyRL's, OpenRLHF's and slime's keys).

    Args:
        train: ``(key, value, unit)`` the actor's (and critic's) update is bounded by.
        forward: the same for the forward-only passes (old log-probs, reference, values).
        reference, critic: the run has those passes.
        per_gpu: token counts per GPU after a sequence-parallel split (NOTE [ Per GPU or per micro-batch ]).
    """
    roles = [("policy", train), ("policy_forward", forward)]
    roles += [("reference", forward)] if reference else []
    roles += [("critic", train), ("critic_forward", forward)] if critic else []
    return tuple(
        YourSize(role, key, number, unit, per_gpu)
        for role, (key, value, unit) in roles
        if (number := _int(value)) is not None
    )


def verl_sizes(flat: dict[str, Any], *, reference: bool, critic: bool) -> tuple[YourSize, ...]:
    """What a verl 0.9.1 config bounds each pass by: the token length with its pass's dynamic switch, else the micro size.

    The keys are :data:`batchfit.frameworks.verl_emit.VERL_KEYS`' (token lengths, per GPU after the
    Ulysses split: NOTE [ verl multiplies by the Ulysses size ]) and their ``*_micro_batch_size_per_gpu``.
    """
    a, r, ref, c = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.", "critic."
    rows = [
        ("policy", a + "use_dynamic_bsz", a + "ppo_max_token_len_per_gpu", a + "ppo_micro_batch_size_per_gpu"),
        (
            "policy_forward",
            r + "log_prob_use_dynamic_bsz",
            r + "log_prob_max_token_len_per_gpu",
            r + "log_prob_micro_batch_size_per_gpu",
        ),
    ]
    if reference:
        rows.append(
            (
                "reference",
                ref + "log_prob_use_dynamic_bsz",
                ref + "log_prob_max_token_len_per_gpu",
                ref + "log_prob_micro_batch_size_per_gpu",
            )
        )
    if critic:
        rows += [
            ("critic", c + "use_dynamic_bsz", c + "ppo_max_token_len_per_gpu", c + "ppo_micro_batch_size_per_gpu"),
            (
                "critic_forward",
                c + "use_dynamic_bsz",
                c + "ppo_infer_max_token_len_per_gpu",
                c + "forward_micro_batch_size_per_gpu",
            ),
        ]
    out = []
    for role, switch, tokens, micro in rows:
        dynamic = flat.get(switch, flat.get(a + "use_dynamic_bsz"))
        key = tokens if dynamic is True or str(dynamic).lower() == "true" else micro
        value = _int(flat.get(key))
        if value is not None:
            out.append(YourSize(role, key, value, "tokens" if key == tokens else "sequences"))
    return tuple(out)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None
