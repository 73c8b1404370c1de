"""Bad input files and values through the CLI: one line on stderr, exit 2, never a traceback."""

from __future__ import annotations

import json

import pytest

from batchfit.cli import main
from batchfit.models import preset_info


@pytest.fixture
def files(tmp_path):
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01bad")
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    config = dict(preset_info("tiny")["config"])
    for name, change in {
        "negative": {"hidden_size": -64},
        "heads": {"num_attention_heads": 5, "head_dim": None},
        "kv": {"num_key_value_heads": 3},
        "unknown": {"model_type": "no-such-model"},
        "rope": {"rope_scaling": {"rope_type": "bogus", "factor": 2.0}},
    }.items():
        (tmp_path / name).mkdir()
        bad = {k: v for k, v in {**config, **change}.items() if v is not None}
        (tmp_path / name / "config.json").write_text(json.dumps(bad))
    (tmp_path / "intkey.yaml").write_text("1: 2\ntrain_batch_size: 4\npolicy_mini_batch_size: 2\n")
    (tmp_path / "nullkey.yaml").write_text("trainer:\n  train_batch_size: 4\n  policy_mini_batch_size: 2\n  null: 3\n")
    (tmp_path / "notjson").mkdir()
    (tmp_path / "notjson" / "config.json").write_bytes(b"\xff\xfe not json")
    return tmp_path


CASES = [
    (["plan", "{d}/binary.yaml"], "is not UTF-8 text"),
    (["profile", "--model", "{d}/list"], "must hold a JSON object with a 'model_type' field"),
    (["profile", "--model", "{d}/negative"], "config field hidden_size must be a positive integer, but got hidden_size=-64"),
    (["profile", "--model", "{d}/heads"], "spec="),  # transformers' own check or ours, one line either way
    (["profile", "--model", "{d}/kv"], "num_key_value_heads=3 must be a positive divisor of num_attention_heads=4"),
    (["profile", "--model", "{d}/unknown"], "model_type='no-such-model'"),
    (["profile", "--model", "{d}/notjson"], "cannot read a transformers config"),
    (["profile", "--model", "{d}/rope", "--backend", "estimate"], "transformers cannot build a model from this config (KeyError: 'bogus')"),
    (["plan", "{d}/intkey.yaml"], "key 1 (int) is not a name"),
    (["plan", "{d}/nullkey.yaml"], "key None (NoneType) under 'trainer' is not a name"),
    (["profile", "--memory", "99999999999999999999999TB"], "--memory is too large"),
    (["profile", "--max-seq-len", "99999999999999999999999"], "--max-seq-len must be at most 16,777,216 tokens"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[c[1][:40] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv, message):
    assert main([a.format(d=files) for a in argv] + (["--no-progress"] if argv[0] == "profile" else [])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message in err and len(err) < 600


TASK_OK = """
import torch


class Task:
    def __init__(self, fail_in=None):
        self.model = torch.nn.Linear(4, 4)
        self.fail_in = fail_in

    def make_batch(self, batch_size, mode):
        if self.fail_in == "make_batch":
            raise ValueError("no data for mode " + mode)
        return torch.randn(batch_size, 4)

    def loss(self, model, batch):
        return model(batch).square().mean()


def make():
    return Task()


def broken_factory():
    return {}["missing"]


def broken_batch():
    return Task(fail_in="make_batch")
"""


@pytest.fixture
def task_files(tmp_path):
    (tmp_path / "syntax.py").write_text("def make(:\n    pass\n")
    (tmp_path / "raises.py").write_text("import torch\n\nraise RuntimeError('boom at import')\n")
    (tmp_path / "tasks.py").write_text(TASK_OK)
    return tmp_path


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{d}/syntax.py:make", "your task file '{d}/syntax.py' raised SyntaxError: invalid syntax"),
        ("{d}/raises.py:make", "your task file '{d}/raises.py' raised RuntimeError: boom at import at {d}/raises.py:3"),
        ("{d}/tasks.py:broken_factory", "your task factory 'broken_factory' raised KeyError: 'missing' at {d}/tasks.py:"),
        ("{d}/tasks.py:broken_batch", "your task's make_batch / loss raised ValueError: no data for mode train at {d}/tasks.py:12"),
        ("{d}/tasks.py", "name the function that makes the task: {d}/tasks.py:FUNCTION"),
        ("{d}/tasks.py:nope", "file '{d}/tasks.py' has no callable 'nope'"),
    ],
    ids=["syntax", "import", "factory", "make-batch", "no-function", "missing-function"],
)
def test_a_task_that_raises_is_named_with_its_location(task_files, capsys, spec, message):
    argv = ["autobatch", "--task", spec.format(d=task_files), "--backend", "cpu", "--memory", "1GiB"]
    argv += ["--max-bs", "8", "--fractions", "0.5", "--modes", "train", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert message.format(d=task_files) in err
    if "raised" in message:
        assert err.rstrip().endswith("add --debug for the traceback")
        assert main([*argv, "--debug"]) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.count("batchfit autobatch: error:") == 1
