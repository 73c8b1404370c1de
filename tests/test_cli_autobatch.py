"""``batchfit autobatch``: report schemas (JSONL, CSV), fractions × modes rows, YAML config, one-line errors."""

from __future__ import annotations

import copy
import csv
import json
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from batchfit.autobatch.builtin_tasks import vision_cnn
from batchfit.autobatch.report import REPORT_FIELDS
from batchfit.cli import main

TASK = f"{__file__}:small_task"
BASE = [
    "autobatch",
    "--task",
    TASK,
    "--backend",
    "cpu",
    "--memory",
    "1MiB",
    "--max-bs",
    "64",
    "--no-progress",
]


def small_task() -> object:
    """A conv-net small enough for sub-second searches (a ``module:function`` task for the CLI)."""
    return vision_cnn(width=4, image_size=16)


pytestmark = pytest.mark.usefixtures("one_thread")


def _exit_code(argv: list[str]) -> int:
    """``main(argv)``, with argparse's usage errors (SystemExit) turned into their exit code."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)


def _errors(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_jsonl_report_has_one_row_per_fraction_and_mode(tmp_path, capsys):
    out = tmp_path / "report.jsonl"
    assert main([*BASE, "--fractions", "0.6,0.8", "--modes", "train,val", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["memory_fraction"]) for r in rows] == [
        ("train", 0.6),
        ("train", 0.8),
        ("val", 0.6),
        ("val", 0.8),
    ]
    for r in rows:
        assert tuple(r) == REPORT_FIELDS
        assert r["peak_bytes"] <= r["target_bytes"] == int(r["memory_fraction"] * (1 << 20))
        assert r["trials"] == len(r["trial_log"]) <= r["max_trials"] == 9  # ceil(log2(64)) + 3
        assert {"batch_size", "peak_bytes", "fits"} <= set(r["trial_log"][0])
    assert rows[2]["batch_size"] > rows[0]["batch_size"]  # val fits more than train
    printed = capsys.readouterr().out
    assert "batch size" in printed and "wrote 4 rows" in printed


def test_csv_report_has_the_same_columns(tmp_path):
    out = tmp_path / "report.csv"
    assert main([*BASE, "--fractions", "0.5", "--modes", "val", "--output", str(out)]) == 0
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    assert tuple(rows[0]) == REPORT_FIELDS
    assert rows[0]["mode"] == "val" and rows[0]["memory_fraction"] == "0.5"
    assert len(rows[0]["trial_log"].split()) == int(rows[0]["trials"])


def test_json_flag_prints_the_rows(capsys):
    assert main([*BASE, "--modes", "val", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["memory_fraction"]) for r in rows] == [("val", 0.8)]


def test_config_file_keys_mirror_the_flags_and_flags_win(tmp_path):
    out = tmp_path / "from_config.jsonl"
    config = tmp_path / "autobatch.yaml"
    config.write_text(
        f"task: {TASK}\nfractions: [0.5, 0.7]\nmodes: val\nsteps: 1\nmin-bs: 2\nmax_bs: 32\n"
        f"memory: 1MiB\nbackend: cpu\noutput: {tmp_path / 'ignored.jsonl'}\n"
    )
    assert main(["autobatch", "--config", str(config), "--output", str(out), "--no-progress"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["mode"], r["memory_fraction"]) for r in rows] == [("val", 0.5), ("val", 0.7)]
    assert all(
        r["trial_log"][0]["batch_size"] == 2 and r["max_trials"] == 8 for r in rows
    )  # ceil(log2(31)) + 3
    assert not (tmp_path / "ignored.jsonl").exists()


def test_progress_display_does_not_change_the_result(tmp_path, capsys):
    args = [a for a in BASE if a != "--no-progress"]
    assert main([*args, "--modes", "val", "--json"]) == 0
    with_progress = json.loads(capsys.readouterr().out)
    assert main([*args, "--modes", "val", "--output", str(tmp_path / "p.jsonl")]) == 0
    assert json.loads((tmp_path / "p.jsonl").read_text())["batch_size"] == with_progress[0]["batch_size"]


def test_estimate_without_memory_targets_an_h100_and_says_so(capsys):
    argv = [
        "autobatch",
        "--task",
        TASK,
        "--backend",
        "estimate",
        "--modes",
        "val",
        "--max-bs",
        "4",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "h100-80gb (default target without a GPU; set --memory)" in out
    assert "4 (capped)" in out  # a tiny model at 80 GB reaches --max-bs
    assert "(capped): --max-bs 4 itself fits, so the search stopped there" in out


def test_json_rows_say_when_max_bs_capped_the_answer(capsys):
    # the small task at 1 MiB: val fits more than 2 samples, train at 0.5 fits fewer
    argv = [*BASE, "--max-bs", "2", "--fractions", "0.05", "--modes", "train,val", "--json"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["batch_size"], r["max_batch_size"], r["capped_by_max_batch_size"]) for r in rows] == [
        (1, 2, False),
        (2, 2, True),
    ]


def test_output_that_cannot_be_written_exits_2_before_any_search(tmp_path, capsys, monkeypatch):
    import batchfit.autobatch

    def no_search(*args, **kwargs):
        raise AssertionError("the search ran before --output was checked")

    monkeypatch.setattr(batchfit.autobatch, "sweep", no_search)  # the command imports it from there to run
    for output, message in [
        (
            tmp_path / "missing" / "r.jsonl",
            r"output must be in an existing folder, but got output='.*r\.jsonl'",
        ),
        (tmp_path / "folder.csv", r"output must be a file, but got output='.*folder\.csv', a directory"),
    ]:
        (tmp_path / "folder.csv").mkdir(exist_ok=True)
        assert main([*BASE, "--output", str(output)]) == 2
        lines = _errors(capsys)
        assert len(lines) == 1 and re.search(message, lines[0]), lines


@dataclass
class ClonedLayersTask:
    """A model whose layers are copies (``copy.deepcopy``), as ``nn.TransformerEncoder`` builds them."""

    model: nn.Module

    def make_batch(self, batch_size: int, mode: str) -> torch.Tensor:
        return torch.randn(batch_size, 8)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch).sum()


def cloned_layers_task() -> ClonedLayersTask:
    layer = nn.Linear(8, 8)
    return ClonedLayersTask(nn.Sequential(layer, copy.deepcopy(layer)))


def test_estimate_prints_no_fake_tensor_data_ptr_warning(capsys):
    argv = ["autobatch", "--task", f"{__file__}:cloned_layers_task", "--backend", "estimate"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main([*argv, "--memory", "64MiB", "--reserve", "0", "--max-bs", "4", "--no-progress"]) == 0
    assert not [w for w in seen if "data pointer of FakeTensor" in str(w.message)]


def test_cpu_without_memory_exits_2(capsys):
    assert main(["autobatch", "--task", TASK, "--backend", "cpu"]) == 2
    assert "--memory is required with --backend cpu" in _errors(capsys)[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        pytest.param(
            ["--fractions", "0"], r"fraction must be in \(0, 1\], but got fraction=0.0", id="fraction-zero"
        ),
        pytest.param(["--fractions", "-0.5"], r"fraction must be in \(0, 1\]", id="fraction-negative"),
        pytest.param(
            ["--fractions", "0.5,1.2"],
            r"fraction must be in \(0, 1\], but got fraction=1.2",
            id="fraction-above-one",
        ),
        pytest.param(["--fractions", "half"], "fractions must be numbers", id="fraction-not-a-number"),
        pytest.param(
            ["--min-bs", "9", "--max-bs", "3"],
            "max_batch_size must be >= min_batch_size=9",
            id="min-above-max",
        ),
        pytest.param(["--min-bs", "0"], "min_batch_size must be an integer >= 1", id="min-zero"),
        pytest.param(["--modes", "train,test"], "mode must be one of 'train', 'val'", id="mode-unknown"),
        pytest.param(
            ["--task", "no_such_module_xyz:make"],
            "cannot import module 'no_such_module_xyz'",
            id="task-unknown-module",
        ),
        pytest.param(["--task", "vision"], "task must be 'module:function'", id="task-unknown-name"),
        pytest.param(["--output", "report.txt"], r"output must end in .jsonl or .csv", id="output-extension"),
        pytest.param(["--backend", "tpu"], "backend must be one of", id="backend-unknown"),
        pytest.param(["--memory", "lots"], "memory", id="memory-unreadable"),
        pytest.param(["--steps", "x"], "invalid int value", id="steps-not-int"),
    ],
)
def test_bad_settings_exit_2_with_one_line(extra, message, capsys):
    assert _exit_code([*BASE, *extra]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1, lines
    assert lines[0].startswith("batchfit autobatch: error:")
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.parametrize(
    "config, message",
    [
        pytest.param(
            "fractoins: [0.5]\n", "unknown key 'fractoins'; did you mean 'fractions'", id="unknown-key"
        ),
        pytest.param("- 0.5\n", "must hold a mapping", id="not-a-mapping"),
        pytest.param("fractions: [0.5, 2]\n", r"fraction must be in \(0, 1\]", id="bad-fraction"),
        pytest.param("fractions: [0.5\n", "is not valid YAML", id="bad-yaml"),
    ],
)
def test_bad_config_files_exit_2_with_one_line(tmp_path, config, message, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(config)
    assert main(["autobatch", "--config", str(path), "--memory", "1MiB", "--backend", "cpu"]) == 2
    lines = _errors(capsys)
    assert len(lines) == 1 and re.search(message, lines[0]), lines


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["autobatch", "--config", str(tmp_path / "none.yaml")]) == 2
    assert len(_errors(capsys)) == 1


def test_nothing_fits_exits_1_and_says_by_how_much_naming_the_flags(capsys):
    assert main([*BASE, "--memory", "16KiB"]) == 1  # the last --memory wins
    lines = _errors(capsys)
    assert len(lines) == 1 and "even --min-bs 1 does not fit in train mode" in lines[0] and " by " in lines[0]
    # NOTE [ Messages in the caller's vocabulary ]: the flags, not find_batch_size's keywords
    # at --min-bs 1 nothing is lower to offer
    assert "to make it fit: raise --fractions or --memory; use a smaller model" in lines[0]
    assert "lower --min-bs" not in lines[0]
    assert "min_batch_size" not in lines[0] and "memory_limit" not in lines[0]


def test_nothing_fits_in_json_carries_the_numbers_and_the_flags(capsys):
    assert main([*BASE, "--memory", "16KiB", "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "DoesNotFitError" and error["limit_bytes"] == int(0.8 * 16 * 1024)  # 13,107
    assert error["usable_bytes"] == 16 * 1024 and error["reserve_bytes"] == 0
    assert error["needed_bytes"] > error["limit_bytes"] and error["breakdown"]  # where the trial was stopped
    assert [c for r in error["remedies"] for c in r["change"]] == ["--fractions", "--memory"]  # at --min-bs 1, no "lower --min-bs"


def _autobatch_rank(rank: int, memories: tuple[str, str]) -> dict:
    import contextlib
    import io
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE="2")  # launched as torchrun launches: the group exists
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        flags = ["--max-bs", "8", "--modes", "val", "--fractions", "0.5", "--json", "--no-progress"]
        code = main(["autobatch", "--task", TASK, "--backend", "cpu", "--memory", memories[rank], "--reserve", "0", *flags])
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def test_under_torchrun_ranks_agree_on_the_flags_and_rank_0_alone_prints():
    from multirank import run_ranks

    differ = run_ranks(_autobatch_rank, ("64MiB", "32MiB"))
    for got in differ.values():  # --json: the error is JSON on stdout, on every rank
        assert got["code"] == 2
        assert json.loads(got["out"])["error"]["faults"] == [
            "every rank must pass the same arguments to batchfit autobatch, "
            "but they differ: --memory: rank 0 has '64MiB', rank 1 has '32MiB'"
        ]
    same = run_ranks(_autobatch_rank, ("64MiB", "64MiB"))
    assert same[0]["code"] == same[1]["code"] == 0
    assert json.loads(same[0]["out"])[0]["batch_size"] >= 1 and same[1]["out"] == ""
