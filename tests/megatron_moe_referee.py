"""The estimate-against-gloo-ranks referee of a tiny Megatron mixture of experts, shared by its test files.

A config (a transformers ``model_type`` and its fields) runs as :class:`~batchfit.budget.megatron_probe.MegatronStep`
under the skewed routing, in bf16 with sdpa attention, at one row of 64 tokens, in each of :data:`RUNS` on 2 ranks.
``tests/test_megatron_mla.py`` (DeepSeek-V3) and ``tests/test_megatron_glm.py`` (GLM-4.5) hold their config's
estimate to the real rank's peak, category by category.
"""

from __future__ import annotations

from typing import Any

ROWS, SEQ = 1, 64

#: each 2-rank run: TP 2 + SP with the experts over EP 2 (expert TP 1); EP 2 over data parallelism 2
RUNS = (
    {"tensor_parallel": 2, "sequence_parallel": True, "data_parallel": 1, "expert_parallel": 2, "expert_tensor_parallel": 1},
    {"data_parallel": 2, "expert_parallel": 2},
)
IDS = ["tp2-sp-ep2-etp1", "dp2-ep2"]


def hf_config(fields: dict[str, Any]) -> Any:
    """The transformers config of ``fields``."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**fields)


def step(fields: dict[str, Any], backend_name: str, **kwargs: Any) -> Any:
    """The referee's ``MegatronStep`` of ``fields`` on ``backend_name``, ``kwargs`` its layout."""
    import warnings

    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    return MegatronStep(
        hf_config(fields), routing="skewed", backend=get_backend(backend_name, round_to=1), dtype=torch.bfloat16, attention="sdpa", **kwargs
    )


def measure(fields: dict[str, Any], backend_name: str, run: dict) -> dict[str, object]:
    """One measurement of ``run``: its peak and breakdown."""
    got = step(fields, backend_name, **run).measure([SEQ] * ROWS)
    return {"peak": got.peak_bytes, "breakdown": dict(got.breakdown)}


def real_rank(rank: int, fields: dict[str, Any], runs: tuple[dict, ...]) -> list[dict[str, object]]:
    """Each run on this gloo rank, the lower of two real runs, as in test_megatron_step.py: a gloo buffer let go after
    its last Python reference an op late adds its bytes to one run's peak (dp2-ep2 once in a .ci/run, 2026-12-02)."""
    return [min((measure(fields, "cpu", run) for _ in range(2)), key=lambda got: got["peak"]) for run in runs]
