"""``batchfit profile --sharding megatron``: the report names Megatron's optimizer, buffers and binding stage."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")


@pytest.mark.slow
def test_the_report_says_what_megatron_holds(capsys):
    from batchfit.cli import main

    code = main(["profile", "--sharding", "megatron", "--tensor-parallel", "2", "--pipeline-parallel", "2",
                 "--world-size", "8", "--megatron-sequence-parallel", "--distributed-optimizer", "--model", "tiny",
                 "--max-seq-len", "128", "--memory", "1GiB", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Megatron's distributed optimizer (Adam)" in out and "AdamW" not in out
    assert "megatron over 8 ranks (tensor 2 × pipeline 2 × data 2, sequence parallel, distributed optimizer)" in out
    assert "megatron: pipeline stage " in out and " binds (stage 0: " in out
    assert "gradients (fp32 main_grad buffer)" in out and "parameters gathered by FSDP" not in out
