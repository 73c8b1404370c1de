"""benchmarks/guard.py: the guard's overhead per micro-batch runs at small sizes and prints its three loops."""

from __future__ import annotations

from pathlib import Path

import pytest

from script_helpers import load_script

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "guard.py"

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(240)]


def test_the_benchmark_prints_each_loop_with_its_overhead_against_the_loop_without_the_guard():
    lines: list[str] = []
    bench = load_script(SCRIPT, "guard_benchmark")
    assert bench.main(["--mini-batches", "1", "--rows", "4", "--repeats", "1"], out=lines.append) == 0
    assert lines[0].startswith("tiny fp32 on the CPU (") and "1 mini-batches of 4 rows, packed budget 512" in lines[0]
    assert lines[1].split() == ["loop", "s", "/", "micro-batch", "overhead", "µs", "ratio", "empty", "step:", "µs", "share"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert list(rows) == ["accumulate", "guard", "guard+peaks"]
    assert rows["accumulate"][1:] == ["0.0", "1.0000", "0.0", "0.00%"]  # the loop every ratio is taken against
    assert all(float(row[0]) > 0 for row in rows.values())


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--budget", "100"], ["--repeats", "-1"]], ids=["rows", "budget", "repeats"])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        load_script(SCRIPT, "guard_benchmark").parse_args(argv)
    assert info.value.code == 2
    assert "must" in capsys.readouterr().err
