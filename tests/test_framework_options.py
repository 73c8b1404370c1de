"""frameworks/config_options.py: a framework config becomes ProfileOptions in one function, the caller's choices first."""

from __future__ import annotations

import pytest

from batchfit.budget.choices import Choices
from batchfit.budget.options import ProfileOptions
from batchfit.budget.settings import FLAGS
from batchfit.errors import InvalidArgument, Vocabulary
from batchfit.frameworks import read_run_config
from batchfit.frameworks.config_options import run_profile_options, sharding_strategy

CLI = Vocabulary(FLAGS)
VERL = "examples/verl_grpo.yaml"


def test_the_callers_choice_wins_then_the_config_then_the_defaults():
    run = read_run_config(VERL)
    chosen = Choices(max_seq_len=1024, offload="none")
    defaults = Choices(max_seq_len=8192, gradient_checkpointing=False, world_size=8)
    made = run_profile_options(run, chosen, defaults)
    assert made.options.max_seq_len == 1024  # the caller's, below the config's own
    assert made.options.sharding.world_size == run.world_size  # the config's, before the default 8
    assert made.options.sharding.strategy == sharding_strategy(run)
    assert made.options.gradient_checkpointing is bool(run.gradient_checkpointing)
    assert any("below the config's longest sequence" in w for w in made.run.warnings)


def test_a_choice_that_was_not_made_leaves_the_librarys_default():
    options = Choices(max_seq_len=64).options()
    assert options == ProfileOptions(max_seq_len=64)


def test_emit_profiles_packed_rows_and_refuses_padded_in_the_callers_words():
    run = read_run_config(VERL)
    assert run_profile_options(run, Choices(), Choices(max_seq_len=64), emit="verl").options.cost == "packed"
    with pytest.raises(InvalidArgument, match=r"^--emit verl writes token budgets .*: drop --cost padded$"):
        run_profile_options(run, Choices(cost="padded"), emit="verl", vocabulary=CLI)
    with pytest.raises(InvalidArgument, match=r"^emit='verl' writes token budgets .*: drop cost='padded'$"):
        run_profile_options(run, Choices(cost="padded"), emit="verl")


@pytest.mark.parametrize(
    "vocabulary, message",
    [
        pytest.param(None, "max_seq_len must be an integer >= 1, but got max_seq_len=0", id="keywords"),
        pytest.param(CLI, "--max-seq-len must be an integer >= 1, but got --max-seq-len=0", id="flags"),
    ],
)
def test_a_bad_value_is_named_as_the_caller_wrote_it(vocabulary, message):
    with pytest.raises(InvalidArgument, match=message):
        ProfileOptions(max_seq_len=0, vocabulary=vocabulary)
