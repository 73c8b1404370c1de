"""Rollouts (prompt ids, response ids, rewards, per-token values) laid out as batchfit's rows.

:func:`collate_rollouts` builds the prompt | response layout of NOTE [ Sequence and response
columns ] in :mod:`batchfit.batches.layout`: each prompt left-padded to ``P`` columns, each
response right-padded to ``R``; ``input_ids``, ``attention_mask`` and ``position_ids`` are
``P + R`` wide, ``loss_mask`` and every per-token field ``R`` wide and right-aligned with the
sequence (response column ``j`` is sequence column ``P + j``, the token whose log-prob the
model gives at the last ``R`` positions). What every RL loop otherwise writes by hand.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from batchfit.errors import BatchError
from batchfit.validation import check_int, describe

__all__ = ["collate_rollouts"]


def _ids(name: str, rows: Any) -> list[np.ndarray]:
    """Token-id rows as 1-D int64 arrays (lists, tuples, tensors or arrays of ints)."""
    if isinstance(rows, (torch.Tensor, np.ndarray)) or not isinstance(rows, Sequence) or isinstance(rows, str):
        raise BatchError(
            f"{name} must be a list of token-id sequences (one per rollout: a list, 1-D tensor or array of ints), but got {name}={describe(rows)}"
        )
    out = []
    for i, row in enumerate(rows):
        arr = row.detach().cpu().numpy() if isinstance(row, torch.Tensor) else np.asarray(row)
        if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
            raise BatchError(
                f"{name}[{i}] must be a 1-D sequence of token ids (ints), but got {describe(row)}"
            )
        out.append(arr.astype(np.int64))
    return out


def _per_token(name: str, values: Any, lengths: list[int]) -> torch.Tensor | list[np.ndarray]:
    """One value per rollout (a scalar, broadcast over its response) or one per response token."""
    if isinstance(values, (torch.Tensor, np.ndarray)) and values.ndim in (1, 2):
        values = values.tolist() if values.ndim == 1 else list(values)  # 2-D: one row per rollout
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise BatchError(
            f"{name} must hold one value per rollout (a number, or one number per response token), but got {name}={describe(values)}"
        )
    if len(values) != len(lengths):
        raise BatchError(
            f"{name} must hold one entry per rollout ({len(lengths)}), but got {len(values)}; pass one value or one row of per-token values per response"
        )
    rows = []
    for i, (value, n) in enumerate(zip(values, lengths)):
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            rows.append(np.full(n, float(value)))
            continue
        arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if arr.ndim == 0 and np.issubdtype(arr.dtype, np.number):
            rows.append(np.full(n, float(arr)))
            continue
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.number):
            raise BatchError(f"{name}[{i}] must be a number or a 1-D row of numbers, but got {describe(value)}")
        if len(arr) != n:
            raise BatchError(
                f"{name}[{i}] must hold one value per response token ({n}), but got {len(arr)}; per-token values follow the response, not the prompt"
            )
        rows.append(arr.astype(np.float64))
    return rows


def collate_rollouts(
    prompts: Sequence[Any],
    responses: Sequence[Any],
    *,
    pad_id: int = 0,
    rewards: Sequence[float] | None = None,
    uids: Sequence[Any] | None = None,
    prompt_width: int | None = None,
    response_width: int | None = None,
    dtype: torch.dtype = torch.float32,
    **per_token: Any,
) -> dict[str, Any]:
    """Lay rollouts out as prompt (left-padded) | response (right-padded) rows, batchfit's batch.

    Args:
        prompts: one token-id sequence per rollout (list, 1-D tensor or array of ints).
        responses: the generated ids of each rollout (at least one token each).
        pad_id: the id written in padding columns (masked out; any valid id).
        rewards: one number per rollout, kept as a 1-D ``rewards`` tensor (feed it to
            :func:`batchfit.train.advantages.group_advantages`).
        uids: the prompt id of each rollout (rollouts of one prompt contiguous), kept as the
            ``uid`` list that :func:`~batchfit.batches.mini_batch_boundaries` cuts along.
        prompt_width, response_width: ``P`` and ``R`` (default: the longest prompt and
            response); a fixed width keeps shapes equal from step to step.
        dtype: the dtype of ``loss_mask`` and of the per-token fields.
        **per_token: response-width fields, e.g. ``old_log_probs=..., advantages=...``: per
            rollout either one number (broadcast over its response tokens, as GRPO's
            advantages are) or one number per response token. Zero outside the response.

    Returns:
        ``{"input_ids", "attention_mask", "position_ids"}`` (``N × (P + R)``, int64;
        positions count from 0 at the first prompt token, 0 in padding), ``loss_mask``
        (``N × R``, 1 on response tokens), each per-token field (``N × R``), and ``rewards``
        / ``uid`` when given.

    Raises:
        BatchError: rows that are not sequences of ints, counts that differ, an empty
            response, a prompt or response wider than the width given, or per-token values
            that do not match their response's length.

    Example:
        >>> b = collate_rollouts([[5, 6], [7]], [[8], [9, 10]], advantages=[0.5, -0.5])
        >>> b["input_ids"].tolist()
        [[5, 6, 8, 0], [0, 7, 9, 10]]
        >>> b["position_ids"].tolist()
        [[0, 1, 2, 0], [0, 0, 1, 2]]
        >>> b["advantages"].tolist()
        [[0.5, 0.0], [-0.5, -0.5]]
    """
    prompt_rows, response_rows = _ids("prompts", prompts), _ids("responses", responses)
    n = len(prompt_rows)
    if len(response_rows) != n:
        raise BatchError(f"prompts and responses must pair up, but got {n} prompts and {len(response_rows)} responses")
    if n == 0:
        raise BatchError("collate_rollouts needs at least one rollout, but got prompts=[] and responses=[]")
    pad_id = check_int("pad_id", pad_id, minimum=0)
    for i, row in enumerate(response_rows):
        if len(row) == 0:
            raise BatchError(f"responses[{i}] is empty; every rollout needs at least one response token (drop the rollout)")
    longest_p = max(len(r) for r in prompt_rows)
    longest_r = max(len(r) for r in response_rows)
    p = longest_p if prompt_width is None else check_int("prompt_width", prompt_width, minimum=0)
    r = longest_r if response_width is None else check_int("response_width", response_width, minimum=1)
    if longest_p > p:
        i = next(i for i, row in enumerate(prompt_rows) if len(row) > p)
        raise BatchError(
            f"prompts[{i}] has {len(prompt_rows[i])} tokens, more than prompt_width={p}; raise prompt_width or left-truncate the prompt (row[-prompt_width:])"
        )
    if longest_r > r:
        i = next(i for i, row in enumerate(response_rows) if len(row) > r)
        raise BatchError(
            f"responses[{i}] has {len(response_rows[i])} tokens, more than response_width={r}; raise response_width or cut the response"
        )
    lengths = [len(row) for row in response_rows]
    fields = {name: _per_token(name, values, lengths) for name, values in per_token.items()}
    input_ids = np.full((n, p + r), pad_id, dtype=np.int64)
    attention_mask = np.zeros((n, p + r), dtype=np.int64)
    for i, (prompt, response) in enumerate(zip(prompt_rows, response_rows)):
        start, end = p - len(prompt), p + len(response)
        input_ids[i, start:p] = prompt
        input_ids[i, p:end] = response
        attention_mask[i, start:end] = 1
    mask = torch.from_numpy(attention_mask)
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0) * mask,
        "loss_mask": mask[:, p:].to(dtype),
    }
    for name, rows in fields.items():
        if name in out:
            raise BatchError(f"{name!r} is a field collate_rollouts builds itself; name the per-token field otherwise")
        values = np.zeros((n, r))
        for i, row in enumerate(rows):
            values[i, : len(row)] = row
        out[name] = torch.from_numpy(values).to(dtype)
    if rewards is not None:
        reward = _scalars("rewards", rewards, n)
        out["rewards"] = torch.tensor(reward, dtype=dtype)
    if uids is not None:
        if isinstance(uids, (str, bytes)) or not isinstance(uids, (Sequence, torch.Tensor, np.ndarray)):
            raise BatchError(f"uids must hold one prompt id per rollout, but got uids={describe(uids)}")
        uid_list = uids.tolist() if isinstance(uids, (torch.Tensor, np.ndarray)) else list(uids)
        if len(uid_list) != n:
            raise BatchError(f"uids must hold one prompt id per rollout ({n}), but got {len(uid_list)}")
        out["uid"] = uid_list
    return out


def _scalars(name: str, values: Any, n: int) -> list[float]:
    """One finite number per rollout."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise BatchError(f"{name} must be 1-D (one number per rollout), but got shape {tuple(values.shape)}")
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise BatchError(f"{name} must hold one number per rollout, but got {name}={describe(values)}")
    if len(values) != n:
        raise BatchError(f"{name} must hold one number per rollout ({n}), but got {len(values)}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not np.isfinite(v):
            raise BatchError(f"{name} must hold finite numbers, but got {name}[{i}]={describe(v)}")
        out.append(float(v))
    return out
