"""Junk through every CLI door ends clean: one line per fault on stderr, a defined exit code, no traceback.

Each class of the reliability run of issue 21 (alias bombs, huge and deep files, huge integers,
nulls and zeros where counts go, sections that are values, negative GPU counts, tasks that
exit or return junk, stdout full or closed, a report write that fails) has a case here. Every
case fails before any probe runs, so each is bounded by construction (a few seconds; the
timeouts are generous limits, not measurements).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from batchfit.cli import main
from batchfit.fileio import MAX_DEPTH, MAX_INPUT_BYTES, MAX_NODES, parse_yaml, replacing
from batchfit.models import preset_info
from multirank import scaled

REPO = Path(__file__).resolve().parents[1]
SKYRL = (REPO / "examples" / "skyrl_ppo.yaml").read_text()
VERL = (REPO / "examples" / "verl_grpo.yaml").read_text()


def _bomb(levels: int, width: int = 9) -> str:
    """A "billion laughs" YAML: ``width ** (levels + 1)`` values from a few hundred bytes."""
    lines = ["train_batch_size: 4", "policy_mini_batch_size: 2", f"a: &a [{', '.join(['x'] * width)}]"]
    prev = "a"
    for i in range(levels):
        name = f"l{i}"
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * width)}]")
        prev = name
    return "\n".join(lines) + "\n"


def _nested(key: str, value: object) -> dict:
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


@pytest.fixture
def junk(tmp_path):
    """A folder of junk files, by name."""
    import yaml

    (tmp_path / "bomb.yaml").write_text(_bomb(9))  # 9**10 values from ~350 bytes
    (tmp_path / "recursive.yaml").write_text("train_batch_size: 4\na: &a [1, *a]\n")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 200 + "]" * 200 + "\n")
    (tmp_path / "deep.json").write_text('{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    (tmp_path / "bigint.yaml").write_text(f"train_batch_size: {'9' * 5000}\npolicy_mini_batch_size: 2\n")
    (tmp_path / "bigint.json").write_text(f'{{"train_batch_size": {"9" * 5000}, "policy_mini_batch_size": 2}}')
    for name in ("huge.yaml", "huge.json", "huge.sh"):
        with open(tmp_path / name, "wb") as f:  # sparse: MAX_INPUT_BYTES + 1 bytes that take no disk
            f.truncate(MAX_INPUT_BYTES + 1)
    (tmp_path / "epochs_flat.yaml").write_text(
        "train_batch_size: 4\npolicy_mini_batch_size: 2\nupdate_epochs_per_batch: null\n"
    )
    skyrl = yaml.safe_load(SKYRL)
    verl = yaml.safe_load(VERL)
    skyrl["trainer"]["policy"]["model"]["path"] = "tiny"
    for name, base, change in (
        ("epochs_skyrl.yaml", skyrl, _nested("trainer.update_epochs_per_batch", None)),
        ("epochs_verl.yaml", verl, _nested("actor_rollout_ref.actor.ppo_epochs", None)),
        ("sp0_verl.yaml", verl, _nested("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 0)),
        ("generator_skyrl.yaml", skyrl, {"generator": "hello"}),
        ("nodes_verl.yaml", verl, _nested("trainer.nnodes", "x")),
        ("strategy_skyrl.yaml", skyrl, _nested("trainer.strategy", -1)),
        (
            "critic_skyrl.yaml",
            skyrl,
            {"trainer": {"placement": {"critic_num_nodes": -1, "critic_num_gpus_per_node": -8}}},
        ),
    ):
        (tmp_path / name).write_text(yaml.safe_dump(_merge(base, change)))
    for name, base, change in (  # issue 28: a string where a count goes, a list where a section goes
        ("n_verl.yaml", verl, _nested("actor_rollout_ref.rollout.n", "--8")),
        ("trainer_list_skyrl.yaml", skyrl, {"trainer": [1, 2]}),
        ("policy_list_skyrl.yaml", skyrl, _nested("trainer.policy", ["a"])),
    ):
        (tmp_path / name).write_text(yaml.safe_dump(_merge(base, change)))
    (tmp_path / "dashdash.yaml").write_text("train_batch_size: --5\npolicy_mini_batch_size: 2\n")
    (tmp_path / "nul.yaml").write_text("train_batch_size: 4\npolicy_mini_batch_size: 2\x00\n")
    (tmp_path / "nul_skyrl.yaml").write_text(SKYRL.replace("trainer:", "trainer:\x00", 1))
    (tmp_path / "output_int.yaml").write_text("output: 5\n")
    os.mkfifo(tmp_path / "fifo.yaml")  # no writer: opening it would block forever
    (tmp_path / "autobatch_bomb.yaml").write_text(_bomb(9).replace("train_batch_size: 4\npolicy_mini_batch_size: 2\n", ""))
    config = dict(preset_info("tiny")["config"])
    for name, change in {
        "kv0": {"num_key_value_heads": 0},
        "headdim0": {"head_dim": 0},
        "headdimneg": {"head_dim": -8},
        "kvneg": {"num_key_value_heads": -2},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
    (tmp_path / "bert").mkdir()  # a masked-LM encoder, as transformers writes its config.json
    (tmp_path / "bert" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["BertForMaskedLM"],
                "model_type": "bert",
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 1000,
            }
        )
    )
    (tmp_path / "bigintmodel").mkdir()
    text = json.dumps(config)
    (tmp_path / "bigintmodel" / "config.json").write_text(text[:-1] + f', "x": {"9" * 5000}}}')
    return tmp_path


def _merge(base: dict, change: dict) -> dict:
    out = dict(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


HUGE = "9" * 5000
# (argv, exit code, what the one line says); {d} is the junk folder
CASES = [
    # inputs bounded before parsing (NOTE [ Untrusted input files ])
    (["plan", "{d}/bomb.yaml"], 2, f"holds more than {MAX_NODES:,} values (YAML aliases expanded)"),
    (["plan", "{d}/recursive.yaml"], 2, "has a recursive alias *a (line 2)"),
    (["plan", "{d}/deep.yaml"], 2, f"nests mappings or lists more than {MAX_DEPTH} deep"),
    (["plan", "{d}/deep.json"], 2, f"nests mappings or lists more than {MAX_DEPTH} deep"),
    (["plan", "{d}/bigint.yaml"], 2, "has an integer of 5,000 digits at line 1"),
    (["plan", "{d}/bigint.json"], 2, "has an integer of 5,000 digits"),
    (["plan", "{d}/huge.yaml"], 2, "is larger than 4 MiB (4.0 MiB)"),
    (["plan", "{d}/huge.json"], 2, "is larger than 4 MiB"),
    (["plan", "{d}/huge.sh"], 2, "is larger than 4 MiB"),
    (["profile", "--config", "{d}/bomb.yaml"], 2, "YAML aliases expanded"),
    (["plan", "{d}/fifo.yaml"], 2, "is not a regular file (a pipe or a device)"),
    (["plan", "/dev/zero"], 2, "is not a regular file (a pipe or a device)"),
    (["autobatch", "--config", "{d}/fifo.yaml"], 2, "is not a regular file (a pipe or a device)"),
    (["autobatch", "--config", "{d}/autobatch_bomb.yaml"], 2, "YAML aliases expanded"),
    (["autobatch", "--config", "{d}/huge.yaml"], 2, "is larger than 4 MiB"),
    (["plan", "--train-batch-size", HUGE, "--policy-mini-batch-size", "2"], 2, "must be an integer >= 1"),
    (["profile", "--model", "{d}/bigintmodel"], 2, "has an integer of 5,000 digits"),
    (["profile", "--memory", HUGE], 2, "--memory is not a memory size: got 5,000 characters"),
    (["autobatch", "--reserve", HUGE], 2, "--reserve is not a memory size: got 5,000 characters"),
    (["profile", "--model", HUGE], 2, "spec must be a preset"),
    (["profile", "--calibration", "{d}/deep.json"], 2, "calibration file"),
    (["profile", "--calibration", "{d}/huge.json"], 2, "is larger than 4 MiB"),
    # counts that would never end
    (["bench", "logprobs", "--repeats", "99999999999999999999"], 2, "--repeats must be an integer <= 1,000"),
    (["bench", "logprobs", "--seed", HUGE[:30]], 2, "--seed must be an integer <="),
    (["autobatch", "--steps", "99999999999999"], 2, "--steps must be at most 1,000"),
    (["autobatch", "--config", "{d}/output_int.yaml"], 2, "--output must be a name, but got output=5 (int)"),
    # nulls and zeros where counts go
    (["plan", "{d}/epochs_flat.yaml"], 2, "update_epochs_per_batch=None must be an integer >= 1"),
    (["plan", "{d}/epochs_skyrl.yaml"], 2, "trainer.update_epochs_per_batch=None must be an integer >= 1"),
    (["plan", "{d}/epochs_verl.yaml"], 2, "actor_rollout_ref.actor.ppo_epochs=None must be an integer >= 1"),
    (
        ["plan", "--train-batch-size", "4", "--policy-mini-batch-size", "2", "--update-epochs-per-batch", "none"],
        2,
        "--update-epochs-per-batch None must be an integer >= 1",  # the flag as given (issue 40)
    ),
    (
        ["profile", "--config", "{d}/epochs_skyrl.yaml", "--emit", "skyrl"],
        2,
        "trainer.update_epochs_per_batch=None must be an integer >= 1",
    ),
    (
        ["plan", "{d}/sp0_verl.yaml"],
        2,
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=0 must be an integer >= 1",
    ),
    # wrong answers that were exit 0
    (["plan", "{d}/generator_skyrl.yaml"], 2, "'generator' is a section of SkyRL"),
    (["plan", "{d}/critic_skyrl.yaml"], 2, "trainer.placement.critic_num_nodes=-1 must be an integer >= 1"),
    (["profile", "--config", "{d}/nodes_verl.yaml"], 2, "the config's trainer.nnodes='x' must be an integer >= 1"),
    (["profile", "--config", "{d}/strategy_skyrl.yaml"], 2, "the config's training strategy=-1 must be a name"),
    # model configs
    (["profile", "--model", "{d}/kv0"], 2, "num_key_value_heads=0 must be a positive divisor"),
    (["profile", "--model", "{d}/kvneg"], 2, "num_key_value_heads=-2 must be a positive divisor"),
    (["profile", "--model", "{d}/headdim0"], 2, "config field head_dim must be a positive integer"),
    (["profile", "--model", "{d}/headdimneg"], 2, "but got head_dim=-8"),
    (["profile", "--world-size", str(2**40)], 2, "--world-size must be an integer <= 1,048,576"),
    # issue 28: bytes YAML refuses, strings that are no integer, lists where sections go, no causal LM
    (["plan", "{d}/nul.yaml"], 2, "is not valid YAML (could not be parsed: unacceptable character #x0000"),
    # examples/skyrl_ppo.yaml: four lines of comments, then "trainer:"
    (["profile", "--config", "{d}/nul_skyrl.yaml"], 2, "special characters are not allowed at line 5)"),
    (["autobatch", "--config", "{d}/nul.yaml"], 2, "unacceptable character #x0000"),
    (["plan", "{d}/dashdash.yaml"], 2, "train_batch_size='--5' must be an integer >= 1, not a str"),
    (["plan", "{d}/n_verl.yaml"], 2, "actor_rollout_ref.rollout.n='--8' must be an integer >= 1, not a str"),
    (
        ["plan", "--train-batch-size=--5", "--policy-mini-batch-size", "2"],
        2,
        "--train-batch-size --5 must be an integer >= 1, not a str",  # the flag as typed (issue 40)
    ),
    (
        ["plan", "{d}/trainer_list_skyrl.yaml"],
        2,
        "trainer=[1, 2]: 'trainer' is a section of SkyRL 0.4.0's config, not a list; set the keys below it",
    ),
    (
        ["profile", "--config", "{d}/policy_list_skyrl.yaml"],
        2,
        "trainer.policy=['a']: 'trainer.policy' is a section of SkyRL 0.4.0's config, not a list",
    ),
    (
        ["profile", "--model", "{d}/bert", "--backend", "estimate", "--reserve", "0"],
        2,
        "architectures=['BertForMaskedLM'] (model_type='bert') is not a causal language model (bert is an encoder "
        "or encoder-decoder family); batchfit builds decoder-only causal LMs with transformers' "
        "AutoModelForCausalLM, such as LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ),
    # a default named as a default (item 8)
    (["profile", "--memory", "300MiB", "--world-size", "1"], 2, "leaves nothing once the default reserve of 337.75 MiB"),
    (
        ["autobatch", "--memory", "300MiB", "--backend", "estimate"],
        2,
        "leaves nothing once the default reserve of 337.75 MiB",
    ),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argv", "code", "message"), CASES, ids=[" ".join(c[0])[:48] for c in CASES])
def test_junk_ends_in_one_line_per_fault_and_a_defined_exit_code(junk, capsys, argv, code, message):
    extra = ["--no-progress"] if argv[0] in ("profile", "autobatch", "bench") else []
    assert main([a.format(d=junk) for a in argv] + extra) == code
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and "reserve_bytes=" not in err
    assert all(line.startswith("batchfit") for line in err.splitlines()), err
    assert len(err) < 2000


@pytest.mark.timeout(60)
def test_an_alias_bomb_is_refused_while_composing(junk):
    """The bomb's 9**10 values are never built: the count stops it within the limit's work."""
    import time

    from batchfit.errors import InvalidArgument

    started = time.process_time()
    with pytest.raises(InvalidArgument, match="YAML aliases expanded"):
        parse_yaml(_bomb(30), "f")  # 9**31 values if it were built
    assert time.process_time() - started < 30  # CPU seconds: a bomb that expands would never end


def test_aliases_within_the_limits_still_load():
    assert parse_yaml("a: &a {x: 1}\nb: *a\nc: [*a, *a]\n", "f") == {
        "a": {"x": 1},
        "b": {"x": 1},
        "c": [{"x": 1}, {"x": 1}],
    }


def test_an_alias_does_not_deepen_past_the_limit():
    from batchfit.errors import InvalidArgument

    inner = "[" * 20 + "]" * 20
    with pytest.raises(InvalidArgument, match="more than 32 deep"):
        parse_yaml(f"a: &a {inner}\nb: {'[' * 20}*a{']' * 20}\n", "f")


# ---- AutoBatch tasks that exit or return junk: the task's error, exit 2 ----

TASKS = """
import sys
import torch


class Task:
    def __init__(self, kind):
        self.kind = kind
        self.model = torch.nn.Sequential() if kind == "noparams" else torch.nn.Linear(4, 4)
        if kind == "junkopt":
            self.make_optimizer = lambda parameters: 5

    def make_batch(self, batch_size, mode):
        return torch.randn(batch_size, 4)

    def loss(self, model, batch):
        out = model(batch)
        if self.kind == "float":
            return 0.5
        if self.kind == "vector":
            return out.mean(0)
        if self.kind == "nograd":
            return out.mean().detach()
        if self.kind == "exit":
            sys.exit(0)
        return out.square().mean()


def make(kind="ok"):
    return lambda: Task(kind)


ok, floatloss, vector, nograd = make(), make("float"), make("vector"), make("nograd")
noparams, junkopt, exits = make("noparams"), make("junkopt"), make("exit")
"""
TASK_ARGS = ["--backend", "cpu", "--memory", "64MiB", "--max-bs", "2", "--modes", "train", "--steps", "1"]


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tasks.py").write_text(TASKS)
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("exits_at_import.py:make", "your task file 'exits_at_import.py' raised SystemExit: sys.exit(0)"),
        ("sys:exit", "your task factory 'exit' raised SystemExit"),
        ("tasks.py:exits", "your task's make_batch / loss raised SystemExit"),
        ("tasks.py:floatloss", "loss(model, batch) returned float, not a tensor"),
        ("tasks.py:vector", "returned a tensor of shape (4,), not a scalar"),
        ("tasks.py:nograd", "returned a tensor without gradients"),
        ("tasks.py:noparams", "has no parameters that require gradients"),
        ("tasks.py:junkopt", "make_optimizer returned int, not a torch.optim.Optimizer"),
    ],
)
def test_a_task_that_exits_or_returns_junk_is_the_tasks_error(tasks, capsys, spec, message):
    assert main(["autobatch", "--task", spec, *TASK_ARGS, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


@pytest.mark.timeout(120)
def test_a_task_run_shows_one_progress_line_per_trial_when_stderr_is_no_terminal(tasks, capsys):
    assert main(["autobatch", "--task", "tasks.py:ok", *TASK_ARGS]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("batchfit autobatch: tasks.py:ok: train @ 0.8: batch ") for line in lines)


def test_profile_progress_is_a_line_per_probe_with_the_time_left(capsys):
    from types import SimpleNamespace

    from batchfit.budget import Probe
    from batchfit.cli.probe_progress import ProbeProgress

    console = SimpleNamespace(is_terminal=False)
    probe = Probe(batch_size=4, seq_len=256, peak_bytes=1, fits=True)
    with ProbeProgress(console, True) as callback:
        callback(SimpleNamespace(role="policy", probe=probe, probes=1))
        callback(SimpleNamespace(role="policy", probe=None, length_index=0, n_lengths=4, seq_len=256, max_batch_size=4, probes=1))
        callback(SimpleNamespace(role="policy", probe=None, length_index=3, n_lengths=4, seq_len=32, max_batch_size=9, probes=4))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "batchfit profile: policy: probe 1: 4×256 = 1,024 tokens fits"
    assert lines[1].startswith("batchfit profile: policy: length 1/4 done (s=256, largest fitting 4×256 = 1,024 tokens); ")
    assert "left" in lines[1] and "left" not in lines[2]  # the last length leaves nothing to wait for


# ---- files the CLI writes: a failed write leaves the old file (NOTE [ Writes replace, never truncate ]) ----

ROW = {
    "mode": "train",
    "memory_fraction": 0.8,
    "batch_size": 4,
    "max_batch_size": 8,
    "capped_by_max_batch_size": False,
    "peak_bytes": 100,
    "target_bytes": 200,
    "limit_bytes": 250,
    "trials": 2,
    "max_trials": 5,
    "backend": "cpu",
    "world_size": 1,
    "trial_log": [{"batch_size": 4, "peak_bytes": 100, "fits": True, "exact": True}],
}


def test_a_report_write_that_fails_leaves_the_old_report_and_no_partial_file(tmp_path, monkeypatch):
    from batchfit.autobatch import report
    from batchfit.errors import InvalidArgument

    old = tmp_path / "old.csv"
    old.write_text("the user's old report\n")
    calls = []

    def failing(log):
        calls.append(log)
        if len(calls) == 2:  # the first row is written, the second fails as a full disk would
            raise OSError(errno.EFBIG, "File too large")
        return "1:100:fit"

    monkeypatch.setattr(report, "trial_log_text", failing)
    with pytest.raises(InvalidArgument, match=r"output cannot be written: .*File too large.*unchanged"):
        report.write_report(old, [ROW, ROW, ROW])
    assert old.read_text() == "the user's old report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]


def test_a_report_replaces_the_old_one_and_keeps_its_permissions(tmp_path):
    from batchfit.autobatch.report import write_report

    old = tmp_path / "old.jsonl"
    old.write_text("old\n")
    old.chmod(0o640)
    write_report(old, [ROW])
    assert json.loads(old.read_text())["batch_size"] == 4
    assert old.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"]


def test_replacing_writes_through_to_a_device(tmp_path):
    with replacing(os.devnull) as path:
        assert str(path) == os.devnull  # /dev/null is written, never replaced


# ---- Ctrl-C: the report is the old one, untouched, or the new one, complete, and the line says which ----


def _interrupted(capsys, argv) -> str:
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("batchfit: interrupted; ") and "Traceback" not in err, err
    return err


@pytest.mark.timeout(120)
def test_an_interrupt_while_the_report_is_written_leaves_the_old_one_and_says_so(tasks, capsys, monkeypatch):
    from batchfit.autobatch import report

    old = tasks / "old.csv"
    old.write_bytes(b"the user's old report\r\n")
    calls, real = [], report.trial_log_text

    def interrupted(log):
        calls.append(log)
        if len(calls) == 2:  # the first row is written, Ctrl-C comes in the second
            raise KeyboardInterrupt
        return real(log)

    monkeypatch.setattr(report, "trial_log_text", interrupted)
    argv = ["autobatch", "--task", "tasks.py:ok", *TASK_ARGS, "--modes", "train,val", "--no-progress"]
    err = _interrupted(capsys, [*argv, "--output", str(old)])
    assert f"--output {str(old)!r} was not written: the file there before is unchanged" in err
    assert len(calls) == 2 and old.read_bytes() == b"the user's old report\r\n"
    assert sorted(p.name for p in tasks.iterdir() if p.name.startswith(".old")) == []  # no partial file
    new = tasks / "new.csv"
    calls.clear()
    err = _interrupted(capsys, [*argv, "--output", str(new)])
    assert f"--output {str(new)!r} was not written (no file, and no partial file, is there)" in err
    assert not new.exists()


@pytest.mark.timeout(120)
def test_an_interrupt_after_the_report_replaced_the_old_one_says_it_is_the_new_one(tasks, capsys, monkeypatch):
    import batchfit.fileio

    old = tasks / "old.csv"
    old.write_text("the user's old report\n")
    real = os.replace

    def then_interrupted(src, dst):
        real(src, dst)
        raise KeyboardInterrupt  # the report is in place; Ctrl-C comes before the table is printed

    monkeypatch.setattr(batchfit.fileio.os, "replace", then_interrupted)
    argv = ["autobatch", "--task", "tasks.py:ok", *TASK_ARGS, "--no-progress", "--output", str(old)]
    err = _interrupted(capsys, argv)
    assert f"--output {str(old)!r} holds the new, complete report (written before the interrupt)" in err
    monkeypatch.setattr(batchfit.fileio.os, "replace", real)
    rows = old.read_text().splitlines()
    assert rows[0].split(",")[:2] == ["mode", "memory_fraction"] and len(rows) == 2  # header + train @ 0.8


SIGINT_AFTER_FIRST_TRIAL = """
import signal, subprocess, sys
argv = [sys.executable, "-m", "batchfit", "autobatch", *sys.argv[1:]]
child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
first = child.stderr.readline()  # a progress line: the search has started, the report is next
child.send_signal(signal.SIGINT)
print(child.wait(), first.strip(), child.stderr.read().strip(), sep="\\n")
"""


# the first tier's time (issue 41): two Python starts and a search; the interrupts before and after the
# report's replace stay in the first tier (test_an_interrupt_while_the_report_is_written_*, _after_*)
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigint_during_autobatch_leaves_the_old_report_or_the_new_complete_one_as_the_line_says(tmp_path):
    old = tmp_path / "old.csv"
    old.write_bytes(b"the user's old report\n")
    argv = ["--task", "causal-lm", "--backend", "cpu", "--memory", "64MiB", "--output", str(old)]
    done = subprocess.run(
        [sys.executable, "-c", SIGINT_AFTER_FIRST_TRIAL, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=scaled(200),
    )
    code, first, said = done.stdout.rstrip("\n").split("\n", 2)
    assert first.startswith("batchfit autobatch: causal-lm: "), done.stdout + done.stderr
    if code == "0":  # the search ended before the signal came (a loaded machine): the new report, whole
        assert "Traceback" not in said and "interrupted" not in said, said
        assert old.read_text().startswith("mode,memory_fraction,")
    else:
        # progress lines already on their way when the signal came, then the one line that ends the run
        *progress, said = said.split("\n")
        assert all(line.startswith("batchfit autobatch: causal-lm: ") for line in progress), progress
        assert code == "130" and "Traceback" not in said, said
        if "was not written: the file there before is unchanged" in said:
            assert old.read_bytes() == b"the user's old report\n"
        else:
            assert "holds the new, complete report" in said, said
            assert old.read_text().startswith("mode,memory_fraction,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]


WRITE_UNDER_LIMIT = """
import sys
from batchfit.autobatch.report import write_report
row = {row!r}
write_report(sys.argv[1], [row] * 2000)
"""


@pytest.mark.timeout(120)
def test_a_report_over_the_file_size_limit_leaves_the_old_one(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("the user's old report\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    done = subprocess.run(
        [sys.executable, "-c", WRITE_UNDER_LIMIT.format(row=ROW), str(old)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        timeout=scaled(100),
    )
    assert done.returncode != 0 and "output cannot be written" in done.stderr, done.stderr
    assert old.read_text() == "the user's old report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]


# ---- stdout that cannot be written: one line on stderr, a defined code, never a traceback ----

PLAN = [sys.executable, "-m", "batchfit", "plan", "--json", "--policy-mini-batch-size", "2", "--train-batch-size"]


def _run(argv, **kwargs):
    return subprocess.run(argv, stderr=subprocess.PIPE, text=True, timeout=scaled(100), **kwargs)


class _Broken:
    """A stdout whose writes fail as ``error`` (a full disk, a pipe its reader closed)."""

    def __init__(self, error: OSError):
        self.error = error

    def write(self, text: str) -> int:
        raise self.error

    def flush(self) -> None:
        raise self.error

    def isatty(self) -> bool:
        return False


PLAN_ARGS = ["plan", "--json", "--policy-mini-batch-size", "2", "--train-batch-size"]


@pytest.mark.parametrize(
    ("size", "error", "code", "said"),
    [
        ("4", OSError(errno.ENOSPC, "No space left on device"), 2, "cannot write the output to stdout (No space left"),
        ("x", OSError(errno.ENOSPC, "No space left on device"), 2, "--train-batch-size x must"),
        ("4", BrokenPipeError(errno.EPIPE, "Broken pipe"), 0, ""),
        ("x", BrokenPipeError(errno.EPIPE, "Broken pipe"), 2, "--train-batch-size x must"),
    ],
    ids=["full", "full-fault", "closed-pipe", "closed-pipe-fault"],
)
def test_a_stdout_that_fails_is_at_most_one_line_and_a_defined_code(monkeypatch, capsys, size, error, code, said):
    monkeypatch.setattr(sys, "stdout", _Broken(error))
    assert main([*PLAN_ARGS, size]) == code
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == (1 if said else 0), err


@pytest.mark.timeout(120)
def test_a_full_stdout_in_a_real_process_is_one_line_and_exit_2():
    """The interpreter's own flush at exit must not fail again ("Exception ignored ...")."""
    with open("/dev/full", "w") as full:
        done = _run([*PLAN, "x"], stdout=full)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "--train-batch-size x must" in done.stderr, done.stderr


# the first tier's time (issue 41): a Python start; the closed pipe in this process
# (test_a_stdout_that_fails_is_at_most_one_line_and_a_defined_code) and the full stdout's real process stay
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_closed_stdout_is_one_line_and_exit_2():
    done = _run([*PLAN, "4"], preexec_fn=lambda: os.close(1))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "batchfit: error: cannot write the output to stdout (stdout is closed); redirect it to a file or pipe "
        "that accepts it"
    )


# the first tier's time (issue 41): a Python start; a task that exits in this process stays
# (test_a_task_that_exits_or_returns_junk_is_the_tasks_error)
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_task_that_exits_is_exit_2_in_a_real_process(tmp_path):
    done = _run(
        [sys.executable, "-m", "batchfit", "autobatch", "--task", "sys:exit", *TASK_ARGS],
        stdout=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "raised SystemExit" in done.stderr and "Traceback" not in done.stderr


def test_a_closed_stderr_still_gives_the_exit_code(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # what Python sets when started with 2>&-
    assert main(["plan", "--train-batch-size", "x", "--policy-mini-batch-size", "2"]) == 2
    assert sys.stderr is None  # put back as it was
