"""A budget in two dimensions: probes with a stated response share, a response cap that holds, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.budget import ProfileOptions, find_token_budget
from batchfit.budget.causal_lm_probe import causal_lm_step, synthetic_rollout
from batchfit.budget.probe import candidate_lengths, response_cap, response_tokens
from batchfit.errors import InvalidArgument
from batchfit.memory import get_backend
from batchfit.models import build_causal_lm
from batchfit.plan import plan_micro_batches

# a vocabulary large enough that the head matters beside the trunk
WIDE = {"vocab_size": 4096}


@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    fraction=st.one_of(st.none(), st.floats(0.01, 1.0)),
)
@settings(max_examples=60, deadline=None)
def test_a_synthetic_rollout_holds_the_stated_response_share(lengths, fraction):
    batch = synthetic_rollout(lengths, vocab_size=50, response_fraction=fraction, mask_dtype=torch.long)
    valid = batch["attention_mask"].sum(-1).tolist()
    responses = batch["loss_mask"].sum(-1).tolist()
    assert valid == lengths
    assert responses == [response_tokens(n, fraction) for n in lengths]
    for n, r in zip(lengths, responses):
        assert r <= max(n - 1, 0)  # the first token is never predicted
        if fraction is not None and n > 1:
            assert r >= min(n - 1, fraction * n - 1e-9)
    # prompt | response: the response fields are the sequence's last columns, the prompt left-padded
    width = batch["input_ids"].shape[1]
    mask = batch["attention_mask"]
    cols = batch["loss_mask"].shape[1]
    for row, (n, r) in enumerate(zip(lengths, responses)):
        first = int(mask[row].nonzero()[0])
        assert mask[row, first : first + n].all()
        assert r == 0 or first + n - r == width - cols  # the response starts where the response fields do
    assert batch["loss_mask"].dtype == torch.long


def test_response_tokens_counts_exactly():
    assert [response_tokens(10, f) for f in (0.2, 0.5, 1.0, 1 / 17)] == [2, 5, 9, 1]
    assert response_tokens(8192, 0.2) == 1639  # ⌈1638.4⌉, no float drift
    assert response_tokens(1, 0.9) == 0 and response_tokens(5) == 4


def _tiny_step(backend, **kwargs):
    model = build_causal_lm("tiny", backend=backend, **WIDE)
    return causal_lm_step(model, backend=backend, logprobs="full", **kwargs)


@pytest.mark.parametrize("cost", ["padded", "packed"])
def test_a_response_only_probe_estimates_to_the_byte_of_the_cpu_backend(cost):
    """The estimate backend keeps the integer loss mask's values: it gathers the rows the cpu run gathers."""
    peaks = []
    for backend in (get_backend("cpu"), get_backend("estimate", memory_limit="80GiB", reserve_bytes=0, round_to=1)):
        step = _tiny_step(backend, cost=cost, only_loss_tokens=True, response_fraction=0.25)
        m = step.measure([96, 96, 40])
        peaks.append((m.peak_bytes, m.breakdown))
    assert peaks[0] == peaks[1]


def test_the_response_only_head_needs_less_than_the_full_head_at_a_small_share():
    backend = get_backend("cpu")
    lengths = [256, 256]
    full = _tiny_step(backend).measure(lengths).peak_bytes
    every = _tiny_step(backend, only_loss_tokens=True).measure(lengths).peak_bytes
    fifth = _tiny_step(backend, only_loss_tokens=True, response_fraction=0.2).measure(lengths).peak_bytes
    assert fifth < every < full


def test_the_budget_reports_the_response_cap_of_its_binding_candidates():
    backend = get_backend("cpu", memory_limit="96MiB", reserve_bytes=0)
    step = _tiny_step(backend, cost="packed", only_loss_tokens=True, response_fraction=0.2)
    budget = find_token_budget(step, max_seq_len=256, cost="packed", seq_lens=[256, 64])
    assert budget.response_fraction == 0.2
    for point in budget.points:
        candidate = candidate_lengths(point.tokens, point.seq_len, "packed")
        assert point.response_tokens == response_cap(step, candidate) == sum(response_tokens(n, 0.2) for n in candidate)
    assert budget.response_tokens == min(p.response_tokens for p in budget.points)
    assert budget.to_dict()["response_tokens"] == budget.response_tokens
    # without the response-only head there is no second cap
    plain = find_token_budget(_tiny_step(backend, cost="packed"), max_seq_len=256, cost="packed", seq_lens=[256])
    assert plain.response_tokens is None and plain.response_fraction is None
    assert budget.tokens > plain.tokens  # the head no longer pays for prompt tokens


@given(data=st.data())
@settings(max_examples=5, deadline=None)
def test_micro_batches_planned_with_both_caps_fit(data):
    """The box guarantee: a micro-batch with <= C tokens and <= R response tokens fits, whatever its shares."""
    backend = get_backend("cpu", memory_limit="96MiB", reserve_bytes=0)
    step = _tiny_step(backend, cost="packed", only_loss_tokens=True, response_fraction=0.2)
    budget = _BUDGET.get("b") or _BUDGET.setdefault(
        "b", find_token_budget(step, max_seq_len=256, cost="packed", seq_lens=[256, 64])
    )
    n = data.draw(st.integers(2, 24))  # up to 6,144 tokens: both caps bind (C = 3,516, R = 714 here)
    lengths = data.draw(st.lists(st.integers(2, 256), min_size=n, max_size=n))
    shares = data.draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n))
    responses = [max(1, response_tokens(length, share)) for length, share in zip(lengths, shares)]
    plan = plan_micro_batches(
        lengths,
        token_budget=budget.tokens,
        cost="packed",
        response_lengths=responses,
        response_budget=budget.response_tokens,
    )
    for group in plan.ranks[0]:
        picked, held = [lengths[i] for i in group], [responses[i] for i in group]
        measured = _measure(step, picked, held)
        assert measured <= budget.limit_bytes, (picked, held, measured, budget.limit_bytes)


_BUDGET: dict[str, object] = {}


def _measure(step, lengths, responses):
    """The peak of the step's packed micro-batch of exactly these sequences and response tokens."""
    from batchfit.batches.microbatch import iter_micro_batches

    rollout = synthetic_rollout(
        lengths, vocab_size=WIDE["vocab_size"], response_lengths=responses, mask_dtype=torch.long
    )
    assert rollout["loss_mask"].sum(-1).tolist() == list(responses)
    plan = plan_micro_batches(lengths, token_budget=sum(lengths), cost="packed")
    (mb,) = iter_micro_batches(rollout, plan, 0, layout="packed")
    return step.backend.measure(lambda: step.run(mb), register=step.persistent, categories=step.categories).peak_bytes


def test_options_refuse_a_share_without_the_response_only_head():
    with pytest.raises(InvalidArgument, match=r"response_fraction=0.2 is read only by the response-only head.*response_only=True"):
        ProfileOptions(max_seq_len=64, response_fraction=0.2)
    for bad in (0, -0.1, 1.5, float("nan"), "0.2", True):
        with pytest.raises(InvalidArgument, match="response_fraction"):
            ProfileOptions(max_seq_len=64, response_only=True, response_fraction=bad)
    with pytest.raises(InvalidArgument, match="response_only must be True or False"):
        ProfileOptions(max_seq_len=64, response_only="yes")
    assert ProfileOptions(max_seq_len=64, response_only=True, response_fraction=1).response_fraction == 1.0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchfit", "profile", *args], capture_output=True, text=True, timeout=600
    )


TINY = ["--model", "tiny", "--max-seq-len", "256", "--backend", "estimate", "--memory", "1GiB", "--world-size", "1",
        "--sharding", "none", "--no-progress"]


@pytest.mark.slow
def test_the_cli_reports_the_response_cap():
    out = _cli(*TINY, "--response-only", "--response-fraction", "0.2", "--json")
    assert out.returncode == 0, out.stderr
    policy = json.loads(out.stdout)["budgets"]["policy"]
    assert policy["response_fraction"] == 0.2 and 0 < policy["response_tokens"] < policy["tokens"]
    text = _cli(*TINY, "--response-only", "--response-fraction", "0.2")
    assert text.returncode == 0, text.stderr
    assert "response cap R = " in text.stdout and "response share 0.2" in text.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--response-fraction", "0.2"], "--response-fraction 0.2 is read only by the response-only head; add --response-only"),
        # the first tier's time (issue 41): a Python start each; the refusal above is the same one-line exit 2
        pytest.param(
            ["--response-only", "--response-fraction", "0"], "--response-fraction must be", marks=pytest.mark.slow
        ),
        pytest.param(
            ["--response-only", "--response-fraction", "nan"], "--response-fraction must be", marks=pytest.mark.slow
        ),
    ],
)
def test_the_cli_refuses_bad_response_flags_in_one_line(flags, message):
    out = _cli(*TINY, *flags)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_framework_configs_give_their_response_share(tmp_path):
    from batchfit.frameworks import read_run_config

    verl = read_run_config("examples/verl_grpo.yaml")
    assert verl.response_fraction == pytest.approx(3072 / 4096)
    skyrl = read_run_config("examples/skyrl_ppo.yaml")
    assert skyrl.response_fraction == skyrl.max_response_len / skyrl.max_seq_len


def test_emit_refuses_a_response_cap_no_framework_has_a_key_for(tmp_path):
    # every framework bounds total tokens and runs its head over every token (tests/test_emit.py, response-share)
    from batchfit.budget.options import ProfileOptions
    from batchfit.frameworks import read_run_config
    from batchfit.frameworks.emit import EmitError, check_emit

    run = read_run_config("examples/verl_grpo.yaml")
    options = ProfileOptions(max_seq_len=4096, sharding="fsdp2", cost="packed", response_only=True)
    for target in ("verl", "skyrl", "openrlhf", "slime"):
        with pytest.raises(EmitError, match=f"--emit {target} cannot carry --response-only: .* response tokens"):
            check_emit(run, options, target)


def test_a_step_that_does_not_fit_names_the_response_only_head_as_a_remedy():
    backend = get_backend("cpu")
    assert any("response_only=True" in str(r) for r in _tiny_step(backend).remedies())
    assert not any("response_only=True" in str(r) for r in _tiny_step(backend, only_loss_tokens=True).remedies())


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_forward_log_probs_of_the_loss_tokens_equal_the_full_heads(layout):
    from batchfit.models.attention import use_varlen_attention
    from batchfit.train import forward_logprobs, response_columns
    from microbatch_helpers import tiny_lm

    model = tiny_lm("llama")
    if layout == "packed":
        use_varlen_attention(model)
    batch = synthetic_rollout([30, 17, 9, 24], vocab_size=64, response_fraction=0.4, mask_dtype=torch.long)
    plan = plan_micro_batches(batch["attention_mask"].sum(-1), token_budget=48, cost="packed")
    width = batch["loss_mask"].shape[1]
    with torch.no_grad():
        full = forward_logprobs(model, batch, plan, layout=layout)
        only = forward_logprobs(model, batch, plan, layout=layout, only_loss_tokens=True)
    mask = batch["loss_mask"] != 0
    torch.testing.assert_close(response_columns(only, width)[mask], response_columns(full, width)[mask], atol=1e-5, rtol=1e-5)
    assert only.count_nonzero() == mask.sum() < full.count_nonzero()  # the prompts' log-probs were not computed
