"""TRL's AsyncGRPO sized by batchfit: its ``token_budget`` from a packed token budget.

NOTE [ AsyncGRPO's token budget ]
Read from TRL 1.16.0, ``trl/experimental/async_grpo/async_grpo_trainer.py`` (``TokenBudgetBatcher``,
TRL #6092) and ``async_grpo_config.py`` (``token_budget``, its default from #6218):

- ``token_budget`` bounds the tokens one DP rank forwards in one micro-batch (a *row*): samples
  are dropped into the least-loaded row that still fits, so the number of samples per row is
  dynamic. A row is a tree of its samples (``TreeRow``): a token several samples share (their
  prompt) is forwarded once, packed with ``cu_seqlens``, so a row costs its *unique* tokens: a
  packed cost (batchfit's ``cost="packed"``), which a shared prompt only lowers.
- It is a hard cap that *drops*: "a sample longer than ``token_budget`` fits in no row and is
  dropped with a warning". Unset (``None``) it becomes the vLLM server's ``max_model_len``
  (prompt + completion) at train start, which bounds no memory at all.

So :func:`async_grpo_config` sets ``token_budget`` to the packed budget ``C`` of one rank, and
refuses a budget whose probes did not cover the longest sample (``max_prompt_length +
max_completion_length``): such a sample would be dropped, or its micro-batch not measured.
TRL is imported only to build its config (``pip install -e '.[trl]'`` in batchfit's checkout).
"""

from __future__ import annotations

from typing import Any

from batchfit.budget import ModelProfile, TokenBudget
from batchfit.errors import BudgetError, InvalidArgument
from batchfit.validation import check_positive_int

__all__ = ["async_grpo_config", "async_token_budget"]


def async_token_budget(budget: TokenBudget | ModelProfile | int, *, longest_sample: int) -> int:
    """The ``token_budget`` of AsyncGRPO for ``budget`` (NOTE [ AsyncGRPO's token budget ]): its packed tokens.

    Args:
        budget: a packed :class:`~batchfit.budget.TokenBudget` (one rank's), a
            :class:`~batchfit.budget.ModelProfile` (its ``combined`` budget), or a token count.
        longest_sample: the longest prompt + completion in tokens (vLLM's ``max_model_len``).

    Raises:
        BudgetError: a padded budget, one whose probes stopped below ``longest_sample`` (its
            ``max_seq_len``), or fewer tokens than ``longest_sample`` (TRL would drop such samples).
    """
    longest = check_positive_int("longest_sample", longest_sample)
    if isinstance(budget, ModelProfile):
        budget = budget.combined
    if isinstance(budget, TokenBudget):
        if budget.cost != "packed":
            raise BudgetError(
                "AsyncGRPO forwards each row's samples packed (a tree of unique tokens), so its token_budget is a "
                f"packed budget, but got a budget with cost={budget.cost!r}; profile with cost='packed' (--cost packed)"
            )
        if budget.max_seq_len < longest:
            raise BudgetError(
                f"the budget was probed for sequences up to max_seq_len={budget.max_seq_len:,}, but AsyncGRPO's samples "
                f"reach {longest:,} tokens (prompt + completion); profile with max_seq_len={longest:,}"
            )
        tokens = budget.tokens
    else:
        tokens = check_positive_int("budget", budget)
    if tokens < longest:
        raise BudgetError(
            f"a budget of {tokens:,} tokens is below the longest sample ({longest:,} tokens, prompt + completion): "
            "AsyncGRPO would drop every longer sample; lower max_completion_length or the prompt length, or give the "
            "model more memory (more ranks to shard over, checkpointing)"
        )
    return tokens


def async_grpo_config(
    budget: TokenBudget | ModelProfile | int,
    *,
    max_prompt_length: int,
    config_class: type | None = None,
    **config_kwargs: Any,
) -> Any:
    """TRL's ``AsyncGRPOConfig`` with ``token_budget`` sized to ``budget`` (NOTE [ AsyncGRPO's token budget ]).

    Args:
        budget: as :func:`async_token_budget`.
        max_prompt_length: the longest prompt in tokens (the config's ``max_completion_length``,
            or its default, is added to it: the longest sample).
        config_class: TRL's config class (default
            ``trl.experimental.async_grpo.AsyncGRPOConfig``).
        config_kwargs: any other field of the config; ``token_budget`` is refused (batchfit sets it).

    Returns:
        the config, built by TRL (its own checks ran).

    Raises:
        InvalidArgument: TRL (with AsyncGRPO) is not installed, ``token_budget`` given, or a bad count.
        BudgetError: as :func:`async_token_budget`.
    """
    if "token_budget" in config_kwargs:
        raise InvalidArgument(
            f"batchfit sets token_budget, but got token_budget={config_kwargs['token_budget']!r}; drop it (pass the "
            "budget instead)"
        )
    if config_class is None:
        try:
            from trl.experimental.async_grpo import AsyncGRPOConfig
        except ImportError as exc:  # the optional extra, or a TRL before AsyncGRPO
            raise InvalidArgument(
                "async_grpo_config needs TRL with AsyncGRPO (trl.experimental.async_grpo, TRL >= 1.16): pip install -e "
                "'.[trl]' in batchfit's checkout (with -c constraints-cpu.txt on a CPU-only machine)"
            ) from exc
        config_class = AsyncGRPOConfig
    from batchfit.integrations.trl import _build, _default

    completion = config_kwargs.get("max_completion_length", _default(config_class, "max_completion_length"))
    longest = check_positive_int("max_prompt_length", max_prompt_length) + check_positive_int(
        "max_completion_length", completion
    )
    return _build(config_class, config_kwargs, {"token_budget": async_token_budget(budget, longest_sample=longest)})
