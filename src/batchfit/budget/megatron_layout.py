"""What a Megatron profile measured beside its budgets (:class:`MegatronLayout`), for reports and ``--json``."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    """What a Megatron profile measured beside its budgets: each pipeline stage's peak and the one that binds.

    Attributes:
        stage_peaks: stage → the peak of its first rank at the budget's last probe.
        binding_stage: the stage whose peak bounds the budget.
        micro_batches: micro-batches of the measured step (the most 1F1B holds in flight on the first stage).
        attention: the core attention measured (``sdpa``: NOTE [ Fused attention for Megatron budgets ]).
        recompute: Megatron's recomputation (``"full"`` or ``None``).
    """

    stage_peaks: dict[int, int]
    binding_stage: int | None
    micro_batches: int
    attention: str
    recompute: str | None

    def describe(self) -> str:
        """One line for reports: ``"pipeline stage 0 binds (stage 0: 61.2 GiB, stage 1: 48.0 GiB), 2 micro-batches in flight"``."""
        from batchfit.memory import format_bytes

        if len(self.stage_peaks) <= 1:
            return f"Megatron-core GPTModel, {self.attention} attention, recompute {self.recompute or 'off'}"
        peaks = ", ".join(f"stage {s}: {format_bytes(b)}" for s, b in sorted(self.stage_peaks.items()))
        return (
            f"pipeline stage {self.binding_stage} binds ({peaks}; 1F1B with {self.micro_batches} micro-batches), "
            f"{self.attention} attention, recompute {self.recompute or 'off'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage_peaks": {str(k): v for k, v in sorted(self.stage_peaks.items())},
            "binding_stage": self.binding_stage,
            "micro_batches": self.micro_batches,
            "attention": self.attention,
            "recompute": self.recompute,
        }


__all__ = ["MegatronLayout"]
