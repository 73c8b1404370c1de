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
