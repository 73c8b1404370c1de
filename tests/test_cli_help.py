"""``batchfit --help`` and ``--version`` stay light (NOTE [ A light --help ] in :mod:`batchfit.cli`)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from batchfit.cli import COMMANDS, build_parser

# runs the console script's entry point and reports which heavy modules it loaded
_PROBE = """
import sys
from batchfit.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "batchfit.budget", "batchfit.cli.profile") if m in sys.modules)
print("LOADED", code, heavy, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "argv, code",
    [
        pytest.param(["--help"], 0, id="help"),
        pytest.param(["--version"], 0, id="version"),
        pytest.param([], 2, id="no-command"),
        pytest.param(["plna"], 2, id="mistyped-command"),
    ],
)
def test_help_and_version_import_no_torch(argv, code):
    # a fresh interpreter: this test process has torch loaded already
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"LOADED {code} []", done.stderr



@pytest.mark.parametrize(
    "argv, code",
    [
        pytest.param(["profile", "--help"], 0, id="profile-help"),
        pytest.param(["profile", "--max-seq-len", "x"], 2, id="profile-argument-error"),
        pytest.param(["plan", "--help"], 0, id="plan-help"),
        pytest.param(["autobatch", "--help"], 0, id="autobatch-help"),
        pytest.param(["autobatch", "--steps", "x"], 2, id="autobatch-argument-error"),
    ],
)
def test_a_commands_help_and_its_argument_errors_import_no_torch(argv, code):
    # issue 45: the parsers are built from light modules (the settings' table, the lazy packages)
    done = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    code_seen, heavy = done.stderr.strip().splitlines()[-1].split(" ", 2)[1:]
    assert int(code_seen) == code, done.stderr
    assert "'torch'" not in heavy and "'transformers'" not in heavy, done.stderr

def test_help_lists_every_command_with_its_module_s_own_help_line():
    def summaries(parser: argparse.ArgumentParser) -> dict[str, str]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: a.help for a in sub._choices_actions}

    # the light table equals what each module registers (build_parser() imports every module)
    assert summaries(build_parser()) == COMMANDS
    assert summaries(build_parser([])) == COMMANDS


def test_a_command_still_runs_after_the_light_parser(capsys):
    from batchfit.cli import main

    assert main(["--debug", "plan", "--train-batch-size", "8", "--policy-mini-batch-size", "4", "--json"]) == 0
    assert "invalid choice" not in capsys.readouterr().err
