"""``batchfit plan``: the tree on success, one line per fault and exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_every_fault_of_a_plan_is_listed_at_once(capsys):
    # issue 20: 100 prompts, mini-batch 32, 3 GPUs. 100 % 32 != 0, and 32 samples do not split over 3
    # GPUs: two independent faults (the second used to be hidden behind the first)
    argv = ["plan", "--train-batch-size", "100", "--policy-mini-batch-size", "32", "--world-size", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    # issue 40: the settings given as flags are named as the flags
    assert "--train-batch-size 100 is not a multiple of --policy-mini-batch-size 32" in err[0]
    assert "32 × 1 = 32 samples per mini-batch do not split evenly over dp_size=3" in err[1]
    # under SkyRL's rules: its assert, its floored per-GPU counts, its tail-dropping
    assert main([*argv, "--framework", "skyrl"]) == 2
    err = capsys.readouterr().err
    assert err.count("batchfit plan: error: ") == 3
    assert "validate_batch_sizes asserts it" in err and "_remove_tail_data" in err


def test_missing_file_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "batchfit", "plan", "no-such-file.yaml"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "batchfit plan: error: config file 'no-such-file.yaml' does not exist"


@pytest.mark.slow  # a Python start (issue 41): test_missing_file_exits_2_without_traceback is the real process
def test_unknown_flag_is_one_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "batchfit", "plan", "--polcy", "3"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


def test_step_wise_text_and_json_agree_on_the_micro_size(capsys):
    argv = ["plan", "--train-batch-size", "8", "--policy-mini-batch-size", "4", "--n-samples-per-prompt", "2"]
    argv += ["--world-size", "2", "--micro-train-batch-size-per-gpu", "2", "--step-wise", "true"]
    assert main(argv) == 0
    assert "micro-batches of 2 samples per GPU (count varies)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    policy = json.loads(capsys.readouterr().out)["policy"]
    assert policy["micro_batch_size_per_gpu"] == 2
    assert policy["gradient_accumulation_steps"] is None  # the count varies with the turns


def test_errors_are_json_too_with_json(capsys):
    argv = ["plan", "--train-batch-size", "8", "--policy-mini-batch-size", "3", "--world-size", "0", "--json"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    error = json.loads(captured.out)["error"]
    assert error["type"] == "BatchConfigError"
    assert len(error["faults"]) == 2 and "--world-size 0" in error["faults"][0]  # the flag, as given
    assert captured.err.count("batchfit plan: error:") == 2


def test_ctrl_c_while_building_the_parser_exits_130(monkeypatch, capsys):
    import batchfit.cli as cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert main(["plan"]) == 130
    assert capsys.readouterr().err == "batchfit: interrupted\n"
