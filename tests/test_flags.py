"""Launch commands as configs (batchfit/frameworks/flags.py): the shell read, not run; the trainers' parsers rebuilt."""

from __future__ import annotations

import pytest

from batchfit.errors import BatchConfigError
from batchfit.frameworks.flags import (
    detect_framework,
    flag_spec,
    is_command_file,
    parse_command,
    read_command,
)
from batchfit.frameworks.registry import command_frameworks


def _write(tmp_path, text, name="run.sh"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_script_expands_continuations_comments_variables_and_arrays(tmp_path):
    path = _write(
        tmp_path,
        """#!/bin/bash
set -ex
MODEL=/models/qwen   # a comment
export N=8
ROLLOUT_ARGS=(
   --rollout-batch-size 32   # prompts
   --n-samples-per-prompt ${N}
)
JSON="{
  \\"a\\": 1
}"
python3 train.py \\
   --hf-checkpoint $MODEL \\
   ${ROLLOUT_ARGS[@]} \\
   --global-batch-size ${GBS:-256} \\
   --prompt-data "/data/with space.jsonl"
""",
    )
    command = read_command(path)
    assert command.launcher == "train.py"
    assert command.args == (
        "--hf-checkpoint",
        "/models/qwen",
        "--rollout-batch-size",
        "32",
        "--n-samples-per-prompt",
        "8",
        "--global-batch-size",
        "256",  # ${GBS:-256}: GBS is not set, the default is
        "--prompt-data",
        "/data/with space.jsonl",
    )
    assert not command.unresolved
    assert any("MODEL=/models/qwen" in note and "N=8" in note for note in command.notes)


def test_the_last_assignment_wins_and_undefined_arrays_are_noted(tmp_path):
    path = _write(
        tmp_path,
        'NUM_GPUS=$(nvidia-smi -L | wc -l)\nif [ -z "$NUM_GPUS" ]; then\n  NUM_GPUS=4\nfi\n'
        "source scripts/models/x.sh\npython -m openrlhf.cli.train_ppo_ray --actor.num_gpus_per_node ${NUM_GPUS} ${MODEL_ARGS[@]}\n",
    )
    command = read_command(path)
    assert command.launcher == "openrlhf.cli.train_ppo_ray"
    assert command.args == ("--actor.num_gpus_per_node", "4")
    assert any("the array MODEL_ARGS is not defined in the file" in note for note in command.notes)


def test_an_args_file_is_the_arguments_and_its_trainer_is_told_from_the_flags(tmp_path):
    openrlhf = read_command(_write(tmp_path, "--rollout.batch_size 8\n--train.batch_size 16\n", "o.args"))
    slime = read_command(_write(tmp_path, "--rollout-batch-size 8 --global-batch-size 16\n", "s.txt"))
    assert openrlhf.launcher is None and detect_framework(openrlhf) == "openrlhf"
    assert detect_framework(slime) == "slime"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        pytest.param("echo hello\n", "holds no launch command and no flags", id="nothing"),
        pytest.param("python train.py --a 'open\n", "unclosed quote", id="unclosed-quote"),
        pytest.param("--foo 1 --bar 2\n", "cannot tell the trainer", id="unknown-trainer"),
    ],
)
def test_unreadable_commands_are_one_fault(tmp_path, text, match):
    with pytest.raises(BatchConfigError, match=match):
        detect_framework(read_command(_write(tmp_path, text)))


def test_a_missing_file_names_itself(tmp_path):
    with pytest.raises(BatchConfigError, match="does not exist"):
        read_command(tmp_path / "nope.sh")


def test_yaml_and_json_are_not_commands():
    assert not is_command_file("a.yaml") and not is_command_file("b.JSON") and not is_command_file("c.yml")
    assert is_command_file("run.sh") and is_command_file("args.txt") and is_command_file("args")


def test_an_unresolved_value_is_a_fault_for_a_read_flag_and_dropped_otherwise(tmp_path):
    spec = flag_spec("openrlhf")
    command = read_command(
        _write(
            tmp_path,
            "python -m openrlhf.cli.train_ppo_ray --logger.wandb.key ${WANDB_KEY} --train.batch_size 16\n",
        )
    )
    parsed = parse_command(command, spec, read=frozenset({"train.batch_size"}))
    assert parsed.values["train.batch_size"] == 16 and "logger.wandb.key" not in parsed.given
    assert parsed.notes == (
        "not read (shell variables the file does not set): --logger.wandb.key ${WANDB_KEY}",
    )
    command = read_command(
        _write(tmp_path, "python -m openrlhf.cli.train_ppo_ray --train.batch_size ${TBS}\n")
    )
    with pytest.raises(
        BatchConfigError, match=r"--train.batch_size \$\{TBS\}: the file does not set that shell variable"
    ):
        parse_command(command, spec, read=frozenset({"train.batch_size"}))


def test_an_unresolved_value_inside_an_array_is_still_seen(tmp_path):
    command = read_command(
        _write(
            tmp_path,
            "ARGS=(\n --train.batch_size ${TBS}\n)\npython -m openrlhf.cli.train_ppo_ray ${ARGS[@]}\n",
        )
    )
    assert command.unresolved == {1: "${TBS}"}
    with pytest.raises(BatchConfigError, match=r"--train.batch_size \$\{TBS\}"):
        parse_command(command, flag_spec("openrlhf"), read=frozenset({"train.batch_size"}))


def test_the_rebuilt_parser_keeps_types_actions_and_defaults():
    spec = flag_spec("openrlhf")
    parser = spec.parser()
    args = parser.parse_args(["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "8192"])
    assert getattr(args, "train.dynamic_batch_enable") is True
    assert getattr(args, "train.max_tokens_per_gpu") == 8192
    assert getattr(args, "train.batch_size") == 128  # OpenRLHF 0.11.2's default
    slime = flag_spec("slime").parser()
    assert slime.parse_args(["--rollout-batch-size", "4", "--no-offload-train"]).offload_train is False


@pytest.mark.parametrize("framework", [spec.name for spec in command_frameworks()])
def test_the_shipped_flag_data_names_its_source_and_generator(framework):
    spec = flag_spec(framework)
    assert spec.framework == framework and spec.version and spec.source
    assert len(spec.flags) > 100 and len(spec.by_flag) >= len(spec.flags)
