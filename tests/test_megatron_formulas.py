"""Megatron-LM's own ``compute_weight_and_optimizer_memory`` against the state batchfit's Megatron probe measures.

Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` ships in no wheel, so this test runs only
where that file is given: ``BATCHFIT_MEGATRON_LM=/path/to/theoretical_memory_usage.py`` (``git show
<commit>:megatron/training/theoretical_memory_usage.py`` from NVIDIA/Megatron-LM; checked at d98e8a64,
the file last changed at 1bcb3b9e). Nothing is fetched. ``benchmarks/megatron_budgets.py`` loads it
standalone and builds its ``args`` as Megatron-LM's arguments would be set (``megatron_lm_args``).

Stated tolerance: 0.01%. The remainder is asserted exactly: the formula counts no linear biases, and
Qwen2.5's query, key and value projections have them; the distributed optimizer's step counts add a few
few tens of KiB with DDP's buffer padding (36,480 B here).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest

pytestmark = pytest.mark.slow

SOURCE = os.environ.get("BATCHFIT_MEGATRON_LM")
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def bench():
    if not SOURCE or not pathlib.Path(SOURCE).is_file():
        pytest.skip("Megatron-LM's theoretical_memory_usage.py is not given (it is in no wheel): set "
                    "BATCHFIT_MEGATRON_LM=/path/to/megatron/training/theoretical_memory_usage.py to run this referee")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "megatron_budgets.py"
    spec = importlib.util.spec_from_file_location("megatron_budgets", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_state_bytes_equal_megatron_lms_weights_and_optimizer_within_the_tolerance(bench):
    from batchfit.budget.model_profile import resident_state_bytes
    from batchfit.budget.options import ProfileOptions
    from batchfit.parallel.sharding import Sharding

    lm = bench.load_megatron_lm(pathlib.Path(SOURCE))
    # qwen2.5-0.5b, TP 2 × DP 4 (8 GPUs), SP, the distributed optimizer
    theirs = lm.compute_weight_and_optimizer_memory(bench.megatron_lm_args("qwen2.5-0.5b", 2, 1, 8, 2048, 1))
    sharding = Sharding("megatron", world_size=8, tensor_parallel=2, megatron_sequence_parallel=True, distributed_optimizer=True)
    options = ProfileOptions(max_seq_len=2048, backend="estimate", memory_limit="h100-80gb", sharding=sharding)
    ours = resident_state_bytes("qwen2.5-0.5b", "policy", options, kinds=("parameters", "gradients", "optimizer_state"))
    # its count: (24 layers × 14,909,440 TP-split + 896 × 151,936 tied embedding) / 2 + 24 × 1,792 + 896 norms
    # = 247,024,512 parameters × (6 + 12/4) B = 2,223,220,608 B
    assert theirs == 2_223_220_608
    assert abs(ours - theirs) / theirs < TOLERANCE
    # the biases of q, k, v: 24 layers × (896 + 128 + 128) / 2 = 13,824 parameters × 9 B = 124,416 B; the rest
    # (36,480 B at 13:40 UTC 2026-12-02) is Megatron's buffer padding and the optimizer's step counts
    assert 0 <= ours - theirs - 124_416 < 64 * 1024
