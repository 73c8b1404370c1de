"""DeepSpeed 0.19.8 itself as the referee of batchfit's ZeRO-1/2, on 2 gloo ranks (slow; needs ``deepspeed``).

Both run the tiny model's training step in bf16 (batchfit's loss, the second micro-batch of an
accumulation of two, its optimizer step): DeepSpeed under ``deepspeed.initialize``, batchfit
as it models ZeRO; each measured by batchfit's cpu tracker (``tests/zero_referee_helpers.py``).
Measured: batchfit's peak, and the peak of the forward and of the backward, is 12 bytes under
DeepSpeed's on every rank, for both stages: three fp32 scalars DeepSpeed keeps
(``_global_grad_norm`` and two of its loss bookkeeping). The optimizer step's peak matches too,
but in about one run of six batchfit's holds one more fp32 temporary of the partition's size
(131 KB above DeepSpeed's): an upper bound there, not yet explained.
"""

from __future__ import annotations

import pytest

from multirank import run_ranks
from zero_referee_helpers import compare_on_rank

#: What DeepSpeed holds that batchfit does not model: fp32 scalars (12 bytes measured), never more.
SCALARS = 16


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_batchfit_zero_peak_equals_deepspeeds_within_its_scalars(stage):
    pytest.importorskip("deepspeed")
    out = run_ranks(compare_on_rank, stage, 50_000, world=2, timeout=400)
    for rank, runs in out.items():
        ds, bf = runs["deepspeed"], runs["batchfit"]
        assert (bf["flat_numel"], bf["partition_size"]) == (ds["flat_numel"], ds["partition_size"])
        assert bf["breakdown"]["optimizer_state"] == ds["breakdown"]["optimizer_state"], rank
        assert 0 <= ds["peak"] - bf["peak"] <= SCALARS, (rank, ds["peak"], bf["peak"])
        for phase in ("forward", "backward"):  # and each phase's own peak
            assert 0 <= ds["phases"][phase] - bf["phases"][phase] <= SCALARS, (rank, phase, ds["phases"], bf["phases"])
        # the optimizer step: in about one run of six batchfit's peak there holds one more fp32 temporary of
        # the partition's size (131 KB above DeepSpeed's, seen at both stages, never below): an upper bound
        extra = bf["phases"]["optimizer"] - ds["phases"]["optimizer"]
        assert -SCALARS <= extra <= 4 * max(bf["partition_size"]), (rank, ds["phases"], bf["phases"], bf["partition_size"])
        if stage == 2:  # the gradients of the rank's partition (DeepSpeed: and its 4-byte grad norm)
            assert ds["breakdown"]["gradients"] - bf["breakdown"]["gradients"] == 4, rank
