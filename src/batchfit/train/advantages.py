"""Group-relative advantages of GRPO and RLOO's leave-one-out baseline, from one reward per rollout.

Rollouts of one prompt form a group (``n_samples_per_prompt`` of them, or the rows sharing a
uid). :func:`group_advantages` gives each rollout its reward minus its group's mean
(``"grpo"``, divided by the group's standard deviation plus ``epsilon`` when ``normalize``),
or minus the mean of the *other* rollouts of its group (``"rloo"``). A group of one has no
baseline: its advantage is 0 (never NaN). Broadcast the result over the response tokens
with :func:`batchfit.batches.rollouts.collate_rollouts` (``advantages=...``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_bool, check_choice, check_int, check_number, describe

__all__ = ["ESTIMATORS", "group_advantages", "group_ids"]

ESTIMATORS = ("grpo", "rloo")


def group_ids(uids: Sequence[Any] | None, n: int | None, count: int) -> torch.Tensor:
    """A group index per rollout (0, 1, …) from ``uids`` (equal uids: one group) or ``n`` per group.

    Raises:
        InvalidArgument: neither or both given, ``n`` that does not divide ``count``, or
            ``uids`` of another length.
    """
    if (uids is None) == (n is None):
        raise InvalidArgument(
            "pass either uids (the prompt id of each rollout) or n (rollouts per prompt, contiguous), but got "
            + ("neither" if uids is None else "both")
        )
    if n is not None:
        n = check_int("n", n, minimum=1)
        if count % n:
            raise InvalidArgument(
                f"n must divide the number of rollouts, but got n={n} for {count} rewards; pass uids when groups differ in size"
            )
        return torch.arange(count) // n
    items = uids.tolist() if isinstance(uids, torch.Tensor) else list(uids)  # type: ignore[union-attr]
    if len(items) != count:
        raise InvalidArgument(f"uids must hold one prompt id per reward ({count}), but got {len(items)}")
    index: dict[Any, int] = {}
    try:
        return torch.tensor([index.setdefault(u, len(index)) for u in items], dtype=torch.long)
    except TypeError:
        raise InvalidArgument(f"uids must be hashable prompt ids (ints or strings), but got uids={describe(uids)}") from None


def group_advantages(
    rewards: Any,
    *,
    uids: Sequence[Any] | None = None,
    n: int | None = None,
    estimator: str = "grpo",
    normalize: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Each rollout's reward relative to the other rollouts of its prompt.

    ``grpo``: ``(r - mean_g)``, divided by ``std_g + epsilon`` when ``normalize`` (population
    standard deviation, as GRPO's reference code and SkyRL/verl compute it per group).
    ``rloo``: ``r - (sum_g - r) / (n_g - 1)``, the mean of the group's other rollouts
    (``normalize`` then divides by ``std_g + epsilon`` too). Every group sums to 0; a group of
    one, or of equal rewards, gets 0.

    Args:
        rewards: one finite number per rollout (list, 1-D tensor or array).
        uids: the prompt id of each rollout (any order), or
        n: rollouts per prompt, the groups contiguous (``n_samples_per_prompt``).
        estimator: ``"grpo"`` or ``"rloo"`` (:data:`ESTIMATORS`).
        normalize: divide by the group's standard deviation (plus ``epsilon``).
        epsilon: > 0; keeps a group of equal rewards at 0 instead of 0/0.

    Returns:
        A 1-D float32 tensor, one advantage per rollout, in the rewards' order.

    Raises:
        InvalidArgument: bad rewards (not 1-D, not finite), groups or settings.

    Example:
        >>> group_advantages([1.0, 0.0, 0.5, 0.5], n=2, normalize=False).tolist()
        [0.5, -0.5, 0.0, 0.0]
        >>> group_advantages([1.0, 0.0, 3.0], n=3, estimator="rloo", normalize=False).tolist()
        [-0.5, -2.0, 2.5]
    """
    r = _rewards(rewards)
    estimator = check_choice("estimator", estimator, ESTIMATORS)
    normalize = check_bool("normalize", normalize)
    epsilon = check_number("epsilon", epsilon, low=0.0, low_open=True)
    groups = group_ids(uids, n, len(r))
    k = int(groups.max()) + 1 if len(r) else 0
    size = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, torch.ones_like(r))
    total = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, r)
    mean = (total / size)[groups]
    low = torch.full((k,), torch.inf, dtype=torch.float64).scatter_reduce_(0, groups, r, "amin")
    high = torch.full((k,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, groups, r, "amax")
    # equal rewards: exactly 0 (the mean's rounding would leave ~1e-17, scaled up by 1/epsilon)
    centred = torch.where((low == high)[groups], torch.zeros_like(r), r - mean)
    if estimator == "rloo":
        m = size[groups]
        # r - (sum - r)/(m - 1) = (r - mean) · m/(m - 1); 0 for a group of one
        centred = torch.where(m > 1, centred * m / (m - 1).clamp(min=1), torch.zeros_like(r))
    if normalize:
        var = torch.zeros(k, dtype=torch.float64).index_add_(0, groups, (r - mean) ** 2) / size
        centred = centred / (var.sqrt()[groups] + epsilon)
    return centred.to(torch.float32)


def _rewards(rewards: Any) -> torch.Tensor:
    if isinstance(rewards, torch.Tensor):
        r = rewards.detach().to("cpu", torch.float64)
    else:
        try:
            r = torch.as_tensor(rewards, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidArgument(f"rewards must be one number per rollout, but got rewards={describe(rewards)}") from None
    if r.ndim != 1:
        raise InvalidArgument(f"rewards must be 1-D (one number per rollout), but got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        i = int((~torch.isfinite(r)).nonzero()[0])
        raise InvalidArgument(f"rewards must be finite, but got rewards[{i}]={float(r[i])}")
    return r
