"""One table of profile settings (NOTE [ One table of profile settings ] in batchfit.budget.settings), one resolver
for every caller (NOTE [ One resolver for every caller ] in batchfit.frameworks.profile_request), and the JSON a user
gets: the same from Python and from the command line (issue 41, part 1)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path

import pytest

import batchfit
from batchfit.budget.choices import Choices
from batchfit.budget.model_profile import ROLES
from batchfit.budget.options import ProfileOptions
from batchfit.budget.settings import FLAGS, PROSE_FLAGS, SETTINGS, flag_vocabulary
from batchfit.cli import main
from batchfit.cli.profile import add_parser
from batchfit.errors import InvalidArgument
from batchfit.frameworks.profile_request import resolve_request
from batchfit.memory import DEFAULT_ESTIMATE_TARGET
from batchfit.memory.cuda_untracked import ALLOCATOR_MARGINS, ALLOCATORS
from batchfit.models.lora import LoraSpec
from batchfit.parallel.sharding import Sharding

SRC = Path(batchfit.__file__).resolve().parent
FAST = {"model": "tiny", "max_seq_len": 512, "backend": "estimate", "memory_limit": "1GiB"}
FAST_FLAGS = ["--model", "tiny", "--max-seq-len", "512", "--backend", "estimate", "--memory", "1GiB", "--no-progress"]


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser()
    sub = root.add_subparsers()
    add_parser(sub)
    return sub.choices["profile"]


def test_the_profile_command_has_one_flag_per_row_of_the_table_and_no_other():
    actions = [a for a in _parser()._actions if not isinstance(a, argparse._HelpAction)]
    assert len(actions) == len(SETTINGS)
    assert [a.option_strings[0] for a in actions] == [row.flag for row in SETTINGS]
    assert [a.dest for a in actions] == [row.name for row in SETTINGS]


def test_no_module_of_the_command_line_adds_a_profile_flag_by_hand():
    calls = [
        node
        for node in ast.walk(ast.parse((SRC / "cli" / "profile.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
    ]
    assert calls == []


def test_every_row_lands_on_a_field_of_its_home():
    homes = {
        "options": {f.name for f in dataclasses.fields(ProfileOptions)},
        "sharding": {f.name for f in dataclasses.fields(Sharding)},
        "lora": {f.name for f in dataclasses.fields(LoraSpec)},
    }
    for row in SETTINGS:
        if row.home in homes:
            assert row.attribute in homes[row.home], row


def test_the_help_says_the_libraries_own_values():
    by_name = {row.name: row for row in SETTINGS}
    assert ",".join(ROLES) in by_name["roles"].help
    assert DEFAULT_ESTIMATE_TARGET in by_name["memory_limit"].help
    margins = ", ".join(f"{ALLOCATOR_MARGINS[a]:g} for {a}" for a in ALLOCATORS)
    assert margins in by_name["safety_margin"].help
    assert by_name["allocator"].metavar == "|".join(ALLOCATORS)


def test_the_vocabulary_is_the_tables_flags():
    assert {row.name: row.flag for row in SETTINGS} == FLAGS
    assert set(PROSE_FLAGS) <= set(FLAGS) and "model" not in PROSE_FLAGS and "dtype" not in PROSE_FLAGS


def test_choices_take_the_options_and_the_shardings_own_fields_and_nothing_else():
    options = Choices(max_seq_len=1024, strategy="fsdp2").or_(Choices(max_seq_len=8192, world_size=4)).options()
    assert (options.max_seq_len, options.sharding.strategy, options.sharding.world_size) == (1024, "fsdp2", 4)
    assert Choices(offload=None) == {}  # None is not a choice
    with pytest.raises(InvalidArgument, match="no setting 'max_len'"):
        Choices(max_len=1024)


def test_a_python_caller_and_the_command_line_resolve_the_same_request():
    args = _parser().parse_args([*FAST_FLAGS, "--sharding", "zero2", "--world-size", "4", "--gradient-checkpointing"])
    from batchfit.cli.profile_runs import request_from_args

    from_cli = request_from_args(args)
    from_python = resolve_request(**FAST, sharding="zero2", world_size=4, gradient_checkpointing=True, progress=False)
    assert from_cli.options == from_python.options
    assert (from_cli.model, from_cli.roles, from_cli.memory_defaulted) == (from_python.model, from_python.roles, False)


def test_the_resolver_names_settings_in_its_callers_words():
    with pytest.raises(InvalidArgument) as keywords:
        resolve_request(backend="cpu", model="tiny", max_seq_len=64)
    assert str(keywords.value).startswith("memory_limit is required with backend='cpu'")
    with pytest.raises(InvalidArgument) as flags:
        resolve_request(backend="cpu", model="tiny", max_seq_len=64, vocabulary=flag_vocabulary())
    assert str(flags.value).startswith("--memory is required with --backend cpu")
    with pytest.raises(InvalidArgument, match="no setting 'memory'"):
        resolve_request(memory="80GiB")


def test_a_request_reads_the_memory_once_into_bytes():
    request = resolve_request(**{**FAST, "reserve_bytes": "0"})
    assert request.options.reserve_bytes == 0
    assert request.options.memory_bytes == 2**30
    defaulted = resolve_request(model="tiny", max_seq_len=512, backend="estimate")
    assert defaulted.memory_defaulted and defaulted.options.memory_limit == DEFAULT_ESTIMATE_TARGET


def test_the_command_lines_json_is_the_librarys_document(capsys, monkeypatch):
    # the command prints its answer's to_dict(), and a Python caller resolves the same request (the test above):
    # the document a Python caller gets is the command's (one profile run, captured, not two)
    from batchfit.frameworks.profile_request import ProfileRequest

    answers = []
    profile = ProfileRequest.profile
    monkeypatch.setattr(ProfileRequest, "profile", lambda self, **kw: answers.append(profile(self, **kw)) or answers[-1])
    small = ["--model", "tiny", "--backend", "cpu", "--memory", "24MiB", "--max-seq-len", "64", "--no-progress"]
    assert main(["profile", *small, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(answers[0].to_dict()))
    assert printed["schema_version"] == 2 and printed["budget_provenance"] == "measured"
    request = resolve_request(model="tiny", backend="cpu", memory_limit="24MiB", max_seq_len=64, progress=False)
    assert request.options == answers[0].request.options


@pytest.mark.slow  # a config's every pass: 15-35 s
def test_a_configs_json_is_the_librarys_document_too(tmp_path, capsys):
    config = tmp_path / "verl.yaml"
    config.write_text(
        "data: {train_batch_size: 16, max_prompt_length: 64, max_response_length: 192}\n"
        "actor_rollout_ref:\n"
        "  model: {path: tiny, use_remove_padding: true, enable_gradient_checkpointing: true}\n"
        "  actor: {strategy: fsdp2, ppo_mini_batch_size: 8, use_dynamic_bsz: true, ppo_max_token_len_per_gpu: 4096}\n"
        "  rollout: {n: 4}\n"
        "algorithm: {adv_estimator: grpo}\n"
        "trainer: {nnodes: 1, n_gpus_per_node: 8}\n",
        encoding="utf-8",
    )
    flags = ["--config", str(config), "--memory", "1GiB", "--engine-reserve", "0", "--emit", "verl"]
    assert main(["profile", *flags, "--json", "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    answer = resolve_request(config=str(config), memory_limit="1GiB", engine_reserve="0", emit="verl").profile()
    assert printed == json.loads(json.dumps(answer.to_dict()))
    assert printed["emit"] and printed["schema_version"] == 2



def test_the_emit_flag_lists_every_registered_framework():
    from batchfit.frameworks.registry import framework_names

    assert {row.name: row for row in SETTINGS}["emit"].metavar == "|".join(framework_names())
