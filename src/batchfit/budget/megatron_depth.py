"""A Megatron step measured at two shallow depths and extrapolated stage by stage to the model's depth.

NOTE [ Megatron stages are affine in their depth ]
Every decoder layer of a Megatron ``GPTModel`` is the same module, and a pipeline stage holds
``L / pp`` of them beside what does not repeat (the first stage's embedding, the last stage's final
norm, output layer and loss). One rank's peak is affine in the layers per stage ``k``: its
parameters, gradients and optimizer state grow by one layer's shards per layer, its activations by
one layer's per micro-batch in flight (1F1B holds a fixed number of micro-batches on each stage),
and full recomputation keeps one input per layer plus one layer's recomputed activations
(docs/megatron.md: the 24-layer peaks equal the 2-layer peak plus 22 per-layer differences to the
byte at TP 1 and TP 2). The stage that binds can change with depth: a short model's last stage
(the head) can bind where a deep one's first stage (the micro-batches in flight) does, and the
maximum of two affine functions is not affine. So each stage is extrapolated on its own, from its
measurements at ``k1`` and ``k2`` layers per stage (:func:`batchfit.budget.depth.extrapolate`,
phase by phase), and the largest extrapolated peak binds. Two builds of ``2·pp`` and ``3·pp``
layers replace one of ``L``: the difference between minutes and seconds for a 64-layer model under
fake tensors.

With virtual pipeline stages (``v`` model chunks per stage, NOTE [ Virtual pipeline stages ] in
:mod:`batchfit.budget.megatron_probe`) every chunk holds ``L / (pp·v)`` layers and a stage's peak
is affine in the layers per chunk: the copies hold ``k1·pp·v`` and ``k2·pp·v`` layers (``k`` per
chunk) and each stage is extrapolated to ``L / (pp·v)`` per chunk. The interleaved schedule's
micro-batches in flight do not depend on the depth, so the law is the same.

Uneven stages (Megatron's ``num_layers_in_first_pipeline_stage`` / ``..._last_...``) change only
how many layers each stage holds: a stage's peak depends on its own layers, not on its
neighbours', so the copies split evenly (``k1·pp``, ``k2·pp`` layers) and each stage is read at its
own layers (``layers_per_stage`` one count per stage, :func:`batchfit.budget.megatron_layout.stage_layers`).

NOTE [ Dense first layers in the shallow copies ]
A mixture of experts whose first ``d`` layers are dense (DeepSeek-V3's and GLM-4.5's
``first_k_dense_replace``: ``moe_layer_freq`` ``[0]·d + [1]·(L − d)``) has two kinds of layer, and a
stage's peak is affine in each kind's count, not in its layers. The dense layers are the model's
first, so they lie on the first stage (its first model chunk). The copies keep them there, on top
of the ``k`` MoE layers every stage holds: ``d + k·pp`` layers with ``moe_layer_freq``
``[0]·d + [1]·k·pp`` and ``num_layers_in_first_pipeline_stage = d + k`` (``pp > 1``), so every stage
adds one MoE layer from one copy to the next, and the first stage carries its ``d`` dense layers in
both. The first stage is then read at its own MoE layers (``layers_per_stage[0] − d``), the others at
theirs: each stage exact (``tests/test_megatron_dense_first.py``: the extrapolated stage peaks equal
the full build's to the byte). Where the dense layers do not all fit on the first stage beside one
MoE layer, or with virtual pipeline stages (a chunk's uneven share), the copies make every layer a
MoE instead (NOTE [ Shallow copies of DeepSeek-V3 ] in :mod:`batchfit.models.megatron_mla`): the
first stage is then overestimated by ``d`` × (a MoE layer's share − a dense layer's), on the safe side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchfit.budget.depth import extrapolate
from batchfit.budget.side_by_side import Beside
from batchfit.memory import MemoryMeasurement

#: The layers per pipeline stage (per model chunk, with virtual stages) the two shallow copies hold.
STAGE_DEPTHS = (2, 3)


class DepthExtrapolatedMegatronStep:
    """Two :class:`~batchfit.budget.megatron_probe.MegatronStep` copies of ``k1`` and ``k2`` layers per stage, read as ``depth``.

    NOTE [ Megatron stages are affine in their depth ]. Estimate backend only (every stage is
    simulated in this process). ``make(n)`` builds the step of ``n`` layers; ``chunks`` is the
    model chunks along the pipeline (``pipeline_parallel``, times the virtual stages), so the
    copies hold ``k · chunks`` layers and are read at ``layers_per_stage`` per chunk (one count for
    every stage, or a sequence of one per stage: uneven stages).

    Attributes:
        stage_peaks: each stage's extrapolated peak at the last measurement.
        binding_stage: the stage whose extrapolated peak is the largest.
        peaks_by_shape: every measurement's ``stage_peaks``, by its
            :func:`~batchfit.budget.megatron_probe.shape_key`.
    """

    def __init__(self, make: Any, chunks: int, layers_per_stage: int | Sequence[int], backend: Any):
        k1, k2 = STAGE_DEPTHS
        self.steps = {k: make(k * chunks) for k in (k1, k2)}
        self.layers_per_stage = layers_per_stage
        self.backend = backend
        self.stage_peaks: dict[int, int] = {}
        self.binding_stage: int | None = None
        self.peaks_by_shape: dict[tuple[int, int], dict[int, int]] = {}
        self._deeper = Beside(self.steps[k2], backend)

    @property
    def _step(self) -> Any:
        return self.steps[STAGE_DEPTHS[0]]

    @property
    def micro_batches(self) -> int:
        return self._step.micro_batches

    @property
    def overrides(self) -> dict[str, Any]:
        return self._step.overrides

    def remedies(self) -> list[Any]:
        return self._step.remedies()

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """The binding stage's peak at the model's depth, each stage extrapolated from its two copies."""
        from batchfit.budget.megatron_probe import shape_key, stage_measurements

        k1, k2 = STAGE_DEPTHS
        # NOTE [ Shallow copies measured side by side ] (batchfit.budget.side_by_side)
        pending = self._deeper.start(stage_measurements, list(lengths))
        try:
            shallow = stage_measurements(self.steps[k1], lengths)
        except BaseException:
            pending.drop()
            raise
        deeper = pending.get()
        limit = self.backend.limit_bytes
        per_stage = self.layers_per_stage
        at_depth = {
            stage: extrapolate(
                shallow[stage], deeper[stage], k1, k2, per_stage if isinstance(per_stage, int) else per_stage[stage], limit
            )
            for stage in shallow
        }
        self.stage_peaks = {stage: m.peak_bytes for stage, m in at_depth.items()}
        self.peaks_by_shape[shape_key(lengths)] = self.stage_peaks
        self.binding_stage = max(at_depth, key=lambda stage: (at_depth[stage].peak_bytes, -stage))
        return at_depth[self.binding_stage]


def dense_first_layers(config: Any, plan: Any, layers_per_stage: Sequence[int]) -> int:
    """The dense first layers of ``config`` (``first_k_dense_replace``) the shallow copies keep on their first stage
    (NOTE [ Dense first layers in the shallow copies ]); 0 for a model without, with virtual pipeline stages, or
    when they leave the first stage (``layers_per_stage[0]`` layers) no MoE layer."""
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if dense <= 0 or (plan.virtual_pipeline_parallel or 1) > 1 or dense >= layers_per_stage[0]:
        return 0
    return dense


def dense_first_copy(dense: int, layers: int, pipeline_parallel: int) -> dict[str, Any]:
    """The ``TransformerConfig`` fields of a shallow copy of ``layers`` MoE layers (``layers / pipeline_parallel`` a
    stage) that keeps the ``dense`` first layers on its first stage (NOTE [ Dense first layers in the shallow copies ])."""
    fields: dict[str, Any] = {"num_layers": dense + layers, "moe_layer_freq": [0] * dense + [1] * layers}
    if pipeline_parallel > 1:
        fields["num_layers_in_first_pipeline_stage"] = dense + layers // pipeline_parallel
    return fields


def extrapolates(
    backend: Any, num_layers: int, chunks: int, wanted: bool | None, *, per_stage: Sequence[int] | None = None
) -> bool:
    """Whether a Megatron profile measures two shallow copies: on the estimate backend (unless ``wanted`` is
    ``False``), with the layers splitting evenly over the ``chunks`` model chunks (the stages, times the
    virtual stages) and deeper than the copies; with uneven stages (``per_stage``, one count per stage) every
    stage deeper than the copies."""
    if wanted is False or not backend.simulated:
        return False
    if per_stage is not None:
        return min(per_stage) > STAGE_DEPTHS[1]
    if num_layers % chunks:
        return False
    return num_layers // chunks > STAGE_DEPTHS[1]


__all__ = ["STAGE_DEPTHS", "DepthExtrapolatedMegatronStep", "dense_first_copy", "dense_first_layers", "extrapolates"]
