"""benchmarks/speed.py: the budgets it compares, the verdicts it gives, the base it picks (no profile run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_helpers import load_script

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"


@pytest.fixture(scope="module")
def speed():
    return load_script(_PATH, "speed_benchmark", register=True)


REPORT = {
    "profiles": {
        "policy": {
            "budgets": {
                "policy": {"tokens": 88239, "response_tokens": None, "trials": [{"tokens": 4096}]},
                "policy_forward": {"tokens": 60608, "response_tokens": None, "tokens_per_gpu": 30304},
            },
            "combined": {"tokens": 60608},
        }
    },
    "yours": [{"tokens": 24000}],
}


def test_budgets_are_every_tokens_field_but_the_probes(speed):
    found = speed.budgets_of(REPORT)
    assert found[".profiles.policy.budgets.policy.tokens"] == 88239
    assert found[".profiles.policy.budgets.policy_forward.tokens_per_gpu"] == 30304
    assert found[".profiles.policy.combined.tokens"] == 60608
    assert found[".yours[0].tokens"] == 24000
    assert not any("trials" in path for path in found)  # a probe's tokens are not a budget


def _row(speed, base: dict, new: dict):
    row = speed.Row("x", ("profile",))
    row.runs = [
        speed.Run("base", 2.0, 1.5, 0, json.dumps(base), ""),
        speed.Run("new", 1.0, 0.5, 0, json.dumps(new), ""),
    ]
    return row


def test_a_row_says_whether_the_budgets_and_the_json_are_the_same(speed):
    same = _row(speed, REPORT, REPORT)
    assert same.same_budgets and same.same_json and same.ratio() == 0.5 and same.ratio(cpu=True) == 0.5 / 1.5
    other_probes = json.loads(json.dumps(REPORT))
    other_probes["profiles"]["policy"]["budgets"]["policy"]["trials"] = []
    row = _row(speed, REPORT, other_probes)
    assert row.same_budgets and not row.same_json
    other_budget = json.loads(json.dumps(REPORT))
    other_budget["profiles"]["policy"]["combined"]["tokens"] = 60607
    assert _row(speed, REPORT, other_budget).same_budgets is False


def test_the_base_is_the_commit_named_or_head_n_back(speed):
    head = speed._git("rev-parse", "HEAD")
    assert speed.resolve_base("HEAD", None) == head
    assert speed.resolve_base(None, 1) == speed._git("rev-parse", "HEAD~1")


def test_a_bad_repeat_or_command_is_a_usage_error(speed, capsys):
    with pytest.raises(SystemExit) as exc:
        speed.main(["--repeat", "0"])
    assert exc.value.code == 2 and "--repeat must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.main(["--commands", "mian"])
    assert "'mian'" in capsys.readouterr().err
