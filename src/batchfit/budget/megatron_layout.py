"""What a Megatron profile measured beside its budgets (:class:`MegatronLayout`), for reports and ``--json``."""

from __future__ import annotations

import dataclasses
from typing import Any

from batchfit.errors import InvalidArgument, Phrase, Setting, Vocabulary


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """What a Megatron profile measured beside its budgets: each pipeline stage's peak and the one that binds.

    Attributes:
        stage_peaks: stage → the peak of its first rank at the budget's last probe.
        binding_stage: the stage whose peak bounds the budget.
        micro_batches: micro-batches of the measured step (the most 1F1B holds in flight on the first stage).
        attention: the core attention measured (``sdpa``: NOTE [ Fused attention for Megatron budgets ]).
        recompute: Megatron's recomputation (``"full"`` or ``None``).
        heads: role → the framework's head on the last stage's logits (``MegatronHead.describe()``), for the
            roles whose head is not Megatron's own cross-entropy (NOTE [ Framework heads under Megatron ]).
        virtual_stages: model chunks per pipeline rank under the interleaved 1F1B schedule (``None``: 1F1B).
        stage_layers: stage → its decoder layers, when the stages are uneven (Megatron's
            ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``); ``{}`` for an even split.
        router: the router's ``TransformerConfig`` fields the profile set (``ProfileOptions.megatron_router``: NOTE
            [ Megatron's router settings ] in :mod:`batchfit.budget.options`); ``{}``: the model's own mapping.
    """

    stage_peaks: dict[int, int]
    binding_stage: int | None
    micro_batches: int
    attention: str
    recompute: str | None
    heads: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    virtual_stages: int | None = None
    stage_layers: dict[int, int] = dataclasses.field(default_factory=dict)
    router: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def schedule(self) -> str:
        """The pipeline schedule measured, in words."""
        if self.virtual_stages:
            return f"interleaved 1F1B, {self.virtual_stages} model chunks per rank"
        return "1F1B"

    def describe(self) -> str:
        """One line for reports: ``"pipeline stage 0 binds (stage 0: 61.2 GiB, stage 1: 48.0 GiB), 2 micro-batches in flight"``."""
        from batchfit.memory import format_bytes

        router = f", router {' '.join(f'{k}={v}' for k, v in self.router.items())}" if self.router else ""
        if len(self.stage_peaks) <= 1:
            return f"Megatron-core GPTModel, {self.attention} attention, recompute {self.recompute or 'off'}{router}"
        layers = self.stage_layers
        peaks = ", ".join(
            f"stage {s}{f' ({layers[s]} layers)' if s in layers else ''}: {format_bytes(b)}"
            for s, b in sorted(self.stage_peaks.items())
        )
        return (
            f"pipeline stage {self.binding_stage} binds ({peaks}; {self.schedule} with {self.micro_batches} micro-batches), "
            f"{self.attention} attention, recompute {self.recompute or 'off'}{router}"
        )

    def to_dict(self) -> dict[str, Any]:
        out = {
            "stage_peaks": {str(k): v for k, v in sorted(self.stage_peaks.items())},
            "binding_stage": self.binding_stage,
            "micro_batches": self.micro_batches,
            "attention": self.attention,
            "recompute": self.recompute,
        }
        if self.virtual_stages:
            out["virtual_stages"] = self.virtual_stages
        if self.stage_layers:
            out["stage_layers"] = {str(k): v for k, v in sorted(self.stage_layers.items())}
        if self.heads:
            out["heads"] = {role: dict(head) for role, head in self.heads.items()}
        if self.router:
            out["router"] = dict(self.router)
        return out


def check_layout(config: Any, sharding: Any, vocabulary: Vocabulary | None = None) -> None:
    """Refuse a Megatron layout the model cannot be split into, before anything is built.

    Megatron splits the attention heads and the key-value groups over the tensor-parallel group
    (``TransformerConfig.__post_init__``: ``num_attention_heads`` and ``num_query_groups`` multiples
    of ``tensor_model_parallel_size``) and the layers evenly over the pipeline stages
    (``num_layers % pipeline_model_parallel_size == 0``, ``transformer_block.py``).

    Raises:
        InvalidArgument: a tensor-parallel size that does not divide the heads or the key-value
            heads, or a pipeline size that does not divide the layers, naming the sizes that do.
    """
    heads = int(config.num_attention_heads)
    groups = int(getattr(config, "num_key_value_heads", None) or heads)
    layers = int(config.num_hidden_layers)
    tp, pp = sharding.tensor_parallel, sharding.pipeline_parallel
    if heads % tp or groups % tp:
        fits = [n for n in range(1, groups + 1) if heads % n == 0 and groups % n == 0]
        raise InvalidArgument(
            Phrase(
                Setting("tensor_parallel", tp),
                f" must divide the model's {heads} attention heads and {groups} key-value heads (Megatron splits them "
                f"over the tensor-parallel group); use one of {', '.join(map(str, fits))}",
            ).say(vocabulary)
        )
    if uneven(sharding):
        stage_layers(layers, sharding, vocabulary)
        return
    if layers % pp:
        fits = [n for n in range(1, layers + 1) if layers % n == 0]
        raise InvalidArgument(
            Phrase(
                Setting("pipeline_parallel", pp),
                f" must divide the model's {layers} layers (Megatron gives every pipeline stage as many); use one of "
                f"{', '.join(map(str, fits))}, or size the last stage (",
                Setting("last_pipeline_stage_layers", layers - (pp - 1) * (layers // pp)),
                ", Megatron's num_layers_in_last_pipeline_stage)",
            ).say(vocabulary)
        )


def uneven(sharding: Any) -> bool:
    """Whether ``sharding`` sets the first or the last pipeline stage's layers (Megatron's uneven pipeline)."""
    return getattr(sharding, "first_pipeline_stage_layers", None) is not None or (
        getattr(sharding, "last_pipeline_stage_layers", None) is not None
    )


def stage_layers(layers: int, sharding: Any, vocabulary: Vocabulary | None = None) -> tuple[int, ...]:
    """The decoder layers of each pipeline stage of a ``layers``-layer model, as Megatron-core builds them.

    Megatron-core 0.16.1 ``transformer_block.py`` ``get_num_layers_to_build``: the first (last)
    stage holds ``num_layers_in_first_pipeline_stage`` (``..._last_...``) when set, and the middle
    stages split the rest evenly; without either, every stage holds ``layers / pp``.
    ``TransformerConfig.__post_init__`` refuses middle layers left without middle stages (or middle
    stages left without layers) and ``get_num_layers_to_build`` a rest the middle stages do not
    divide; both are refused here, naming the field, its value and the fix.

        >>> from types import SimpleNamespace as S
        >>> stage_layers(94, S(pipeline_parallel=4, first_pipeline_stage_layers=None, last_pipeline_stage_layers=22))
        (24, 24, 24, 22)

    Raises:
        InvalidArgument: the uneven stages Megatron refuses; an even split that does not divide.
    """
    pp = int(sharding.pipeline_parallel)
    first, last = getattr(sharding, "first_pipeline_stage_layers", None), getattr(sharding, "last_pipeline_stage_layers", None)
    if first is None and last is None:
        if layers % pp:
            raise InvalidArgument(f"pipeline_parallel={pp} must divide the model's {layers} layers; use a divisor or uneven stages")
        return (layers // pp,) * pp
    set_ = [(name, n) for name, n in (("first_pipeline_stage_layers", first), ("last_pipeline_stage_layers", last)) if n is not None]
    rest = layers - sum(n for _, n in set_)
    middle = pp - len(set_)
    named = Phrase(*[part for i, (name, n) in enumerate(set_) for part in ((" + " if i else ""), Setting(name, n))])
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % middle):
        name, value = set_[-1]
        other = sum(n for _, n in set_[:-1])
        if middle == 0:
            fits = [layers - other] if layers - other > 0 else []
        else:  # the values of the last one set that leave the middle stages an even split
            near = sorted((n for n in range(1, layers - other) if (layers - other - n) % middle == 0), key=lambda n: abs(n - value))
            fits = sorted(near[:2])
        fix = f"set {name} to {' or '.join(map(str, fits))}" if fits else "lower them"
        raise InvalidArgument(
            Phrase(
                *named.parts,
                f" leave {rest} of the model's {layers} layers to {middle} middle pipeline stages of ",
                Setting("pipeline_parallel", pp),
                " (Megatron-core splits the rest evenly over the middle stages, and refuses middle layers without middle "
                f"stages); {fix}",
            ).say(vocabulary)
        )
    each = rest // middle if middle else 0
    return tuple(
        first if (s == 0 and first is not None) else last if (s == pp - 1 and last is not None) else each for s in range(pp)
    )


__all__ = ["MegatronLayout", "check_layout", "stage_layers", "uneven"]
