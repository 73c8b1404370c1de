"""benchmarks/gpu_check.py: without a GPU it says so and exits 0; its table reads the confirm's JSON."""

from __future__ import annotations

from pathlib import Path

import torch

from script_helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def _module():
    return load_script(SCRIPT, "gpu_check")


def test_without_a_gpu_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _module().main([]) == 0
    assert "no GPU on this machine" in capsys.readouterr().out


def test_the_rows_show_each_category_and_its_ratio():
    data = {"confirm": {"roles": {"policy": {
        "shape": "3 × 8,192 tokens", "peak": {"relative_error": 0.0125}, "allocator_overhead_bytes": 1024, "fits": True,
        "categories": {"parameters": {"estimated_bytes": 1000, "measured_bytes": 1000},
                       "activations": {"estimated_bytes": 2000, "measured_bytes": 2050}},
    }}}}  # fmt: skip
    lines = _module()._rows("tiny", data)
    assert "policy at 3 × 8,192 tokens: peak error +1.25%, reserved − allocated 1024 B, fits True" in lines[1]
    assert lines[2].split()[-1] == "1.0000" and lines[3].split()[-1] == "1.0250"  # 2,050 / 2,000
