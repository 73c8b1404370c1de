"""DeepSpeed 0.19.8 itself as the referee of batchfit's ZeRO-1/2, on 2 gloo ranks (slow; needs ``deepspeed``).

Both run the tiny model's training step in bf16 (batchfit's loss, the second micro-batch of an
accumulation of two, its optimizer step): DeepSpeed under ``deepspeed.initialize``, batchfit
as it models ZeRO; each measured by batchfit's cpu tracker (``tests/zero_referee_helpers.py``).
Measured: batchfit's peak, and the peak of the forward and of the backward, is 12 bytes under
DeepSpeed's on every rank, for both stages: three fp32 scalars DeepSpeed keeps
(``_global_grad_norm`` and two of its loss bookkeeping). The optimizer step's peak matches too,
but it varies from run to run: in about one run of six batchfit's holds one more fp32 temporary of
the partition's size (131 KB above DeepSpeed's), and DeepSpeed's has held a few more bytes of
scalars; the test bounds it, and why it varies is not yet explained.
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
        # the optimizer step varies from run to run on both sides: in about one run of six batchfit's peak
        # there holds one more fp32 temporary of the partition's size (131 KB above DeepSpeed's), and
        # DeepSpeed's has held 17 bytes of scalars beside the usual 12; bounded, not equal
        extra = bf["phases"]["optimizer"] - ds["phases"]["optimizer"]
        assert -16 * SCALARS <= extra <= 4 * max(bf["partition_size"]), (rank, ds["phases"], bf["phases"])
        if stage == 2:  # the gradients of the rank's partition (DeepSpeed: and its 4-byte grad norm)
            assert ds["breakdown"]["gradients"] - bf["breakdown"]["gradients"] == 4, rank
