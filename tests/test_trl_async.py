"""TRL AsyncGRPO's token_budget sized by batchfit (NOTE [ AsyncGRPO's token budget ] in batchfit.integrations.trl_async)."""

from __future__ import annotations

import pytest

from batchfit.budget import BudgetPoint, TokenBudget
from batchfit.errors import BudgetError, InvalidArgument
from batchfit.integrations.trl_async import async_grpo_config, async_token_budget


def _budget(tokens: int, *, cost: str = "packed", max_seq_len: int = 2048) -> TokenBudget:
    point = BudgetPoint(seq_len=max_seq_len, max_batch_size=1, peak_bytes=1, next_peak_bytes=2, probes=3)
    return TokenBudget(
        tokens=tokens, max_seq_len=max_seq_len, cost=cost, points=(point,), memory_model=None, probes=3,
        limit_bytes=10, usable_bytes=11, safety_margin=0.85, backend="estimate", role="policy",
    )  # fmt: skip


def test_the_token_budget_is_the_packed_budget_of_one_rank():
    assert async_token_budget(_budget(24_576), longest_sample=1536) == 24_576
    assert async_token_budget(9000, longest_sample=1536) == 9000


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        (_budget(24_576, cost="padded"), "cost='padded'; profile with cost='packed'"),
        (_budget(24_576, max_seq_len=1024), "max_seq_len=1,024, but AsyncGRPO's samples reach 1,536"),
        (1000, "AsyncGRPO would drop every longer sample"),
    ],
    ids=["padded", "probed-too-short", "below-the-longest-sample"],
)
def test_a_budget_that_would_drop_samples_or_was_not_measured_for_them_is_refused(budget, message):
    with pytest.raises(BudgetError, match=message):
        async_token_budget(budget, longest_sample=1536)


@pytest.mark.slow  # TRL is an optional package: the second tier
def test_trl_builds_the_config_with_batchfits_token_budget(tmp_path):
    pytest.importorskip("trl.experimental.async_grpo")
    config = async_grpo_config(
        _budget(24_576), max_prompt_length=512, max_completion_length=1024, output_dir=str(tmp_path), use_cpu=True
    )
    assert (type(config).__name__, config.token_budget) == ("AsyncGRPOConfig", 24_576)
    with pytest.raises(InvalidArgument, match="batchfit sets token_budget"):
        async_grpo_config(24_576, max_prompt_length=512, token_budget=4096, output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(BudgetError, match="2,560 tokens"):  # the config's default completion, 2,048, plus the prompt
        async_grpo_config(_budget(24_576, max_seq_len=2048), max_prompt_length=512, output_dir=str(tmp_path), use_cpu=True)
