"""examples/grpo_stepwise.py and ``batchfit demo``: the library's pieces composed into a step-wise GRPO loop."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os

import numpy as np
import pytest
import torch

from batchfit.cli import main
from batchfit.cli.demo import DEMO_DEFAULTS, OPTIONS, load_example
from multirank import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

example = load_example()
# small enough for seconds; budgets given, so no profiling (one test profiles)
SMALL = {
    "prompts": 4,
    "mini_batch": 2,
    "samples": 3,
    "max_prompt_len": 48,
    "max_response_len": 32,
    "token_budget": 256,
    "forward_token_budget": 1024,
    "quiet": True,
}


def small(**changes) -> object:
    return example.Settings(**{**SMALL, **changes})


# the first tier's time (issue 41): the count whatever the turns stays in the first tier
# (tests/test_minibatch.py's test_mini_batch_count_does_not_depend_on_turns), and the demo's training
@pytest.mark.slow
def test_optimizer_steps_are_the_plans_count_whatever_the_turns():
    one_turn = example.train(small(steps=2, max_turns=1))
    five_turns = example.train(small(steps=2, max_turns=5))
    sequences = [sum(s.sequences for s in r.steps) for r in (one_turn, five_turns)]
    assert sequences[0] < sequences[1]  # 24 trajectories of one turn each, then of 1-5 turns
    for result in (one_turn, five_turns):
        # 4 prompts / 2 per mini-batch × 1 epoch = 2 optimizer steps per training step, × 2 steps
        assert result.plan.optimizer_steps_per_step == 2
        assert [s.step for s in result.steps] == [1, 2, 3, 4]


def test_loss_decreases_over_optimizer_steps_on_the_learnable_reward():
    # one rollout set, four epochs over one mini-batch: the clipped surrogate falls step by step
    result = example.train(small(steps=1, mini_batch=4, samples=4, epochs=4))
    losses = [s.loss for s in result.steps]
    assert len(losses) == 4
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses


def test_rollouts_are_step_wise_prompt_response_rows_with_group_relative_advantages():
    s = small(prompts=3, samples=4)
    batch = example.synthetic_rollouts(s, step=0, vocab_size=1024)
    uids, mask = batch["uid"], batch["attention_mask"]
    assert uids == sorted(uids) and set(uids) == {0, 1, 2}  # contiguous per prompt
    assert mask.shape[1] == 48 + 32 and batch["loss_mask"].shape[1] == 32
    # response-wide fields are right-aligned: the loss mask is the response part of the attention mask
    assert torch.equal(batch["loss_mask"], mask[:, 48:].float())
    lengths = batch["loss_mask"].sum(1)
    assert lengths.min() >= 4 and lengths.max() <= 32
    assert (batch["advantages"] * (1 - batch["loss_mask"])).abs().sum() == 0


def test_every_micro_batch_peak_is_under_the_budget_profiled_on_this_machine():
    result = example.train(small(steps=1, token_budget=None, forward_token_budget=None, memory="8MiB"))
    assert result.config.max_tokens_per_micro_batch == result.budgets.training
    for log in [*result.steps, *result.forward]:
        assert log.limit_bytes is not None
        assert log.peak_bytes <= log.limit_bytes, (log, log.peak_bytes / log.limit_bytes)


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_a_response_only_head_trains_the_same_steps_under_both_caps():
    """The budget in two dimensions in the real loop: C and R profiled, both caps planned, every peak under its limit."""
    common = {"steps": 1, "token_budget": None, "forward_token_budget": None, "memory": "8MiB"}
    plain = example.train(small(**common))
    only = example.train(small(**common, response_only=True))
    b = only.budgets
    assert b.training_responses is not None and b.forward_responses is not None
    assert plain.budgets.training_responses is None
    for log in [*only.steps, *only.forward]:
        assert log.peak_bytes <= log.limit_bytes, (log, log.peak_bytes / log.limit_bytes)
    # the head ran on the loss tokens only: the same clipped surrogate, step by step
    np.testing.assert_allclose([s.loss for s in only.steps], [s.loss for s in plain.steps], rtol=1e-4, atol=1e-6)


def test_batchfit_demo_runs_the_example_and_reports_bad_values_in_one_line(capsys):
    args = ["--steps", "1", "--max-prompt-len", "48", "--max-response-len", "32", "--token-budget", "256"]
    assert main(["demo", *args, "--forward-token-budget", "1024"]) == 0
    out = capsys.readouterr().out
    assert "token budget per rank: 256 tokens" in out
    assert out.count("step ") >= 2 and "micro-batches" in out and "tok/s" in out
    assert out.strip().splitlines()[-1].startswith("ranks agree: parameter checksum ")  # one process: "(one rank)"
    assert main(["demo", "--max-turns", "9"]) == 2
    assert (
        capsys.readouterr().err == "batchfit demo: error: max_turns must be at most 5, but got max_turns=9\n"
    )


def test_demo_options_are_the_examples_settings():
    fields = [f.name for f in dataclasses.fields(example.Settings)]
    assert [name for name, _, _ in OPTIONS] == fields
    assert set(DEMO_DEFAULTS) <= set(fields)


def _params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: a collective
        out[name] = full.detach().numpy().copy()
    return out


def _fsdp2_rank(rank: int) -> dict:
    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # what the run prints, as the user sees it (rank 0 only)
        result = example.run_with_progress(small(steps=1, sharding="fsdp2", quiet=False))
    return {
        "params": _params(result.model),
        "steps": [(s.micro_batches, s.loss) for s in result.steps],
        "agree": result.ranks_agree,
        "out": out.getvalue(),
    }


# The ranks sum each gradient in another order than one process does (fp32 sums differ by up to
# n·2⁻²⁴ of the sum of the |terms|, n the tokens summed). AdamW then moves each element by
# lr·m̂/(√v̂ + eps), about lr per optimizer step whatever the gradient's scale: where a gradient is
# within a few orders of eps, its division passes that rounding to the parameter nearly whole
# (seen: 3.0e-5 on one element of 4,096 under load, against an earlier atol of 1e-5). A wrong
# gradient (a rank's share missing or weighted wrongly) turns elements by whole steps: a tenth of
# one step separates the two.
ADAMW_ORDER_ATOL = example.Settings().lr / 10


def test_two_fsdp2_ranks_end_with_identical_parameters_equal_to_one_process():
    single = example.train(small(steps=1))
    expected = _params(single.model)
    ranks = run_ranks(_fsdp2_rank, timeout=120)
    for name, value in expected.items():
        assert np.array_equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        np.testing.assert_allclose(ranks[0]["params"][name], value, atol=ADAMW_ORDER_ATOL, rtol=0, err_msg=name)
    assert ranks[0]["steps"] == ranks[1]["steps"]  # the same micro-batch count and mini-batch loss
    # rank 0 prints, and ends with the ranks' checksums compared
    assert ranks[1]["out"] == "" and ranks[0]["agree"] is ranks[1]["agree"] is True
    assert ranks[0]["out"].count("token budget per rank") == 1
    last = ranks[0]["out"].strip().splitlines()[-1]
    assert last.startswith("ranks agree: parameter checksum ") and last.endswith(" on all 2 ranks"), last
    for (_, loss), step in zip(ranks[0]["steps"], single.steps):
        assert loss == pytest.approx(step.loss, abs=1e-5)


# --------------------------------------------------------------------------- bad input, fast


def test_sharding_without_torchrun_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["demo", "--sharding", "fsdp2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not launched by torchrun (RANK is not set); run torchrun --nproc-per-node 2 -m batchfit demo --sharding fsdp2" in err


@pytest.mark.parametrize(
    ("args", "match"),
    [
        pytest.param(["--micro-batch-size", "0"], "micro_batch_size must be an integer >= 1, but got micro_batch_size=0", id="micro-batch-0"),
        pytest.param(["--token-budget", "-5"], "token_budget must be an integer >= 1, but got token_budget=-5", id="budget"),
        pytest.param(["--lr", "0"], "lr must be in (0, inf], but got lr=0.0", id="lr"),
        pytest.param(["--memory", "lots"], "memory is not a memory size or device preset", id="memory"),
    ],
)
def test_bad_values_exit_2_before_any_work(capsys, args, match):
    assert main(["demo", *args]) == 2  # no profiling ran: it would take a minute
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def _disagreeing_rank(rank: int) -> dict:
    # launched as torchrun launches: the group exists, RANK is set
    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["demo", "--sharding", "fsdp2", "--seed", str(rank), "--token-budget", "256"])
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.fill_(1.0 + rank)  # the ranks drifted apart
        model.bias.fill_(0.0)
    checksum_err = io.StringIO()
    with contextlib.redirect_stderr(checksum_err):
        agree = example.check_parameters(model, console=None)
    return {"code": code, "err": err.getvalue(), "agree": agree, "checksum_err": checksum_err.getvalue()}


def test_ranks_that_disagree_fail_on_every_rank_in_one_line():
    ranks = run_ranks(_disagreeing_rank, timeout=90)
    for got in ranks.values():
        assert got["code"] == 2
        assert got["err"] == (
            "batchfit demo: error: every rank must pass the same arguments to batchfit demo, but they differ: "
            "--seed: rank 0 has 0, rank 1 has 1\n"
        )
        # weights 1 and 2 on 6 entries: checksums 6 + 6 = 12 and 12 + 24 = 36
        assert got["agree"] is False
        assert got["checksum_err"].startswith(
            "grpo_stepwise: error: ranks differ: parameter checksums range from 1.200000000e+01 to 3.600000000e+01 over 2 ranks"
        )
