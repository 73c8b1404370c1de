"""batchfit.errors: messages that name settings in the caller's vocabulary, and the does-not-fit error's numbers."""

from __future__ import annotations

import argparse
import pickle
import types

import pytest
import torch

from batchfit.budget.causal_lm_probe import TrainingStep
from batchfit.budget.probe import GENERIC_REMEDIES
from batchfit.budget.settings import FLAGS
from batchfit.cli.profile import add_parser
from batchfit.errors import KEYWORDS, DoesNotFitError, Phrase, Setting, Vocabulary
from batchfit.parallel.sharding import Sharding

CLI = Vocabulary(FLAGS)


@pytest.mark.parametrize(
    "setting, keyword, flag",
    [
        pytest.param(Setting("max_seq_len"), "max_seq_len", "--max-seq-len", id="name-only"),
        pytest.param(Setting("logprobs", "fused"), "logprobs='fused'", "--logprobs fused", id="value"),
        pytest.param(Setting("memory_limit"), "memory_limit", "--memory", id="renamed-flag"),
        pytest.param(Setting("response_only", True), "response_only=True", "--response-only", id="switch-on"),
        pytest.param(
            Setting("gradient_checkpointing", False), "gradient_checkpointing=False", "--no-gradient-checkpointing",
            id="switch-off",
        ),
        pytest.param(
            Setting("sharding", {"strategy": "fsdp2", "world_size": 8, "offload": "cpu"}),
            "sharding=Sharding('fsdp2', world_size=8, offload='cpu')",
            "--sharding fsdp2 --world-size 8 --offload cpu",
            id="sharding-fields",
        ),
        pytest.param(
            Setting("sharding", {"strategy": "fsdp2", "world_size": None}),
            "sharding=Sharding('fsdp2', world_size=N)",
            "--sharding fsdp2 --world-size N",
            id="sharding-to-choose",
        ),
        pytest.param(Setting("seq_lens", [8, 4]), "seq_lens=[8, 4]", "seq_lens=[8, 4]", id="no-flag-keeps-keyword"),
    ],
)
def test_a_setting_is_said_as_a_keyword_argument_or_as_the_commands_flag(setting, keyword, flag):
    assert (KEYWORDS.say(setting), CLI.say(setting)) == (keyword, flag)


def test_settings_said_together_read_as_arguments_or_as_one_command_line():
    both = (Setting("sharding", {"strategy": "fsdp2", "world_size": 16}), Setting("gradient_checkpointing", True))
    phrase = Phrase("it fits with ", both, " (one sequence per rank)")
    assert str(phrase) == "it fits with sharding=Sharding('fsdp2', world_size=16), gradient_checkpointing=True (one sequence per rank)"
    assert phrase.say(CLI) == "it fits with --sharding fsdp2 --world-size 16 --gradient-checkpointing (one sequence per rank)"
    assert phrase.changes(CLI) == ["--sharding fsdp2 --world-size 16 --gradient-checkpointing"]


def _step(**changes):
    """The attributes TrainingStep.remedies reads, without building a model."""
    fields = dict(model=torch.nn.Linear(1, 1), forward_only=False, logprobs="full", critic=False, only_loss_tokens=False)
    return types.SimpleNamespace(**{**fields, "sharding": Sharding(), **changes})


@pytest.mark.parametrize(
    "step",
    [
        pytest.param(_step(), id="one-device"),
        pytest.param(_step(sharding=Sharding("fsdp2", world_size=8)), id="fsdp2"),
        pytest.param(_step(critic=True, forward_only=True), id="critic-values"),
    ],
)
def test_every_setting_a_remedy_names_is_a_flag_of_batchfit_profile(step):
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    options = {o for action in sub.choices["profile"]._actions for o in action.option_strings}
    remedies = [*TrainingStep.remedies(step), *GENERIC_REMEDIES]
    names = []
    for remedy in remedies:
        for part in remedy.parts:
            if isinstance(part, Setting):
                names += [part.name] + (list(part.value) if part.name == "sharding" else [])
    names = [n for n in names if n != "strategy"]  # the sharding strategy is --sharding's value
    assert names and all(FLAGS[n] in options for n in names), names
    said = " ".join(r.say(CLI) for r in remedies)
    assert "_" not in said.replace("--", "")  # no keyword name is left in the command's vocabulary


def test_an_fsdp2_step_offers_cpu_offload_and_a_forward_pass_no_checkpointing():
    said = [r.say(CLI) for r in TrainingStep.remedies(_step(sharding=Sharding("fsdp2", world_size=8)))]
    assert "offload the sharded state to the CPU (--sharding fsdp2 --world-size 8 --offload cpu)" in said
    assert "enable gradient checkpointing (--gradient-checkpointing)" in said
    forward = [r.say(CLI) for r in TrainingStep.remedies(_step(forward_only=True))]
    assert not any("checkpointing" in r for r in forward)  # no_grad saves no activations to drop


def test_a_does_not_fit_error_keeps_its_numbers_when_its_message_changes():
    error = DoesNotFitError(
        Phrase("one sequence of ", Setting("max_seq_len", 512), " does not fit"),
        needed=30, available=20, breakdown={"activations": 30}, reserve_bytes=5, usable_bytes=25,
        remedies=[Phrase("reduce ", Setting("max_seq_len"))],
    )  # fmt: skip
    error.world_size_hint = 4
    assert str(error) == "one sequence of max_seq_len=512 does not fit; to make it fit: reduce max_seq_len"
    assert error.say(CLI) == "one sequence of --max-seq-len 512 does not fit; to make it fit: reduce --max-seq-len"
    moved = error.replace(Phrase("policy: ", *error.message.parts))
    assert str(moved).startswith("policy: one sequence of max_seq_len=512")
    assert moved.to_dict(CLI) == {
        "needed_bytes": 30, "limit_bytes": 20, "reserve_bytes": 5, "usable_bytes": 25, "breakdown": {"activations": 30},
        "remedies": [{"text": "reduce --max-seq-len", "change": ["--max-seq-len"]}], "world_size_hint": 4,
    }  # fmt: skip
    assert str(pickle.loads(pickle.dumps(error))) == str(error)  # crosses process boundaries as its text
    plain = DoesNotFitError("even low=1 does not fit", needed=2, available=1)  # free text still works
    assert str(plain) == plain.say(CLI) == "even low=1 does not fit" and plain.remedies == ()


def test_a_replaced_profile_request_keeps_naming_settings_as_its_caller_does():
    from batchfit.budget.options import ProfileOptions

    options = ProfileOptions(max_seq_len=1024, vocabulary=CLI)
    with pytest.raises(ValueError, match=r"^--max-seq-len") as from_cli:
        options.replace(gradient_checkpointing=False).replace(max_seq_len=0)
    with pytest.raises(ValueError, match=r"^max_seq_len") as from_python:
        ProfileOptions(max_seq_len=1024).replace(max_seq_len=0)
    assert "--max-seq-len" not in str(from_python.value) and "--max-seq-len" in str(from_cli.value)
