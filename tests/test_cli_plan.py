"""``batchfit plan``: the tree on success, one line per fault and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from batchfit.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_plan_prints_the_tree(capsys):
    assert main(["plan", str(EXAMPLES / "grpo_4gpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "optimizer steps per training step: 4" in out
    assert "samples per mini-batch per GPU: 320" in out


def test_plan_json(capsys):
    assert main(["plan", "--train-batch-size", "64", "--policy-mini-batch-size", "16", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"]["optimizer_steps_per_step"] == 4
    assert data["dp_size"] == 1


def test_skyrl_example_has_a_critic(capsys):
    assert main(["plan", str(EXAMPLES / "skyrl_ppo.yaml")]) == 0
    assert "critic: mini-batch of 256 prompts" in capsys.readouterr().out


def test_faults_are_one_line_each_with_exit_2(capsys):
    code = main(
        [
            "plan",
            "--train-batch-size",
            "100",
            "--policy-mini-batch-size",
            "256",
            "--world-size",
            "6",
            "--tensor-parallel",
            "4",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 2
    assert all(line.startswith("batchfit plan: error: ") for line in err)


def test_missing_file_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "batchfit", "plan", "no-such-file.yaml"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "batchfit plan: error: config file 'no-such-file.yaml' does not exist"


def test_unknown_flag_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "batchfit", "plan", "--polcy", "3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
