"""benchmarks/response_head.py: the --quick cpu table runs; the bar check reads the estimate rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from script_helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "response_head.py"


def _module():
    return load_script(SCRIPT, "response_head", register=True)  # dataclasses look their module up there


def test_quick_cpu_table_shows_every_head_and_the_response_only_head_peaks_lower(capsys):
    bench = _module()
    assert bench.main(["--quick", "--part", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    full = next(line for line in lines if " full " in line and "all tokens" in line)
    only = next(line for line in lines if " full " in line and "resp-only 4:1" in line)
    assert "fused" in "\n".join(lines)
    # the full head over 1,024 tokens holds [1024, 4096] fp32 logits; over the 4:1 responses ~1/5 of them
    assert float(only.split()[5]) < float(full.split()[5])  # peak MiB, resp-only < all tokens


def test_bar_check_divides_the_response_only_budget_by_the_fused_one():
    bench = _module()
    row = bench.EstimateRow
    rows = [
        row(8192, "fused", None, 100_000, None, 8192, 1, 2, 3, 1.0),
        row(8192, "fused", "4:1", 160_000, 32_000, 4096, 1, 2, 3, 1.0),
        row(8192, "full", None, 25_000, None, 8192, 1, 2, 3, 1.0),
        row(8192, "full", "4:1", 90_000, 18_000, 4096, 1, 2, 3, 1.0),
    ]
    lines = bench.bar_check(rows)
    assert "response-only fused C / fused C = 160,000 / 100,000 = 1.60" in lines[1]
    assert any("response-only full C / full C = 90,000 / 25,000 = 3.60" in line for line in lines)


@pytest.mark.parametrize("argv", [["--ratios", "4-1"], ["--lengths", "0"], ["--seqs", "0"]], ids=["ratio", "length", "seqs"])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        _module().parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err
