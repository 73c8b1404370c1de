"""Row layouts of RL rollouts: which fields are per token, how they align, and trimming that keeps the cap.

NOTE [ Sequence and response columns ]
SkyRL and verl lay a rollout out as prompt (left-padded to ``P`` columns) | response
(right-padded to ``R`` columns). Fields come in two widths::

    sequence  W = P + R   input_ids, attention_mask, position_ids      . . p p p | r r r . .
    response  R           loss_mask, advantages, old_log_probs               | r r r . .

A response-width field is **right-aligned with the sequence**: its column ``j`` belongs to
sequence column ``W - R + j`` (the model's log-probs of the last ``R`` positions). Trimming a
micro-batch must cut both widths consistently and may never leave the sequence narrower
than a response field. Rows of such a micro-batch span more columns than their length
(a short prompt with a long response and a long prompt with a short one), so cutting only
the columns no row uses leaves ``rows × width`` up to about twice the planned
``rows × longest``. :func:`align_rows` therefore moves each row right so that rows end in
the same column (response fields move with their row, so the alignment above still holds),
then keeps the last ``longest`` sequence columns and the response columns that belong to
them: ``rows × width == rows × longest``, the planned padded cost. Without response fields
a batch whose rows all start (or all end) in one column is only trimmed, keeping its
padding side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchfit.batch import Batch
from batchfit.errors import BatchError

#: Fields treated as response-width (right-aligned with the sequence) when narrower than the
#: sequence, without being named: SkyRL's and verl's per-token training fields.
RESPONSE_FIELD_NAMES = frozenset(
    {
        "loss_mask",
        "response_mask",
        "action_mask",
        "responses",
        "advantages",
        "returns",
        "values",
        "rewards",
        "token_level_rewards",
        "token_level_scores",
        "old_log_probs",
        "old_action_log_probs",
        "action_log_probs",
        "base_action_log_probs",
        "ref_log_prob",
        "ref_log_probs",
        "rollout_log_probs",
        "rollout_logprobs",
        "entropy",
        "weights",
    }
)

Array = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class FieldRoles:
    """Which per-sample fields are per token, and how wide.

    Attributes:
        width: the sequence width ``W`` (the attention mask's second dimension).
        token: sequence-width fields (second dimension ``W``).
        response: response-width fields (second dimension ``response_width``), right-aligned
            with the sequence (NOTE [ Sequence and response columns ]).
        response_width: ``R``, or ``None`` without response fields.
    """

    width: int
    token: tuple[str, ...]
    response: tuple[str, ...]
    response_width: int | None


def _is_array(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def field_roles(
    batch: Batch,
    *,
    attention_mask_key: str = "attention_mask",
    token_fields: Sequence[str] | None = None,
    response_fields: Sequence[str] | None = None,
) -> FieldRoles | None:
    """Classify the per-token fields of ``batch``.

    Defaults: every tensor/array of two or more dimensions whose second dimension is the
    mask's width is a token field; one narrower than that whose name is in
    :data:`RESPONSE_FIELD_NAMES` is a response field; any other field is left alone. Name
    the fields (``token_fields``, ``response_fields``) where the names or widths are
    ambiguous; named fields replace the guess for their role.

    Returns:
        :class:`FieldRoles`, or ``None`` when ``batch`` has no 2-D ``attention_mask_key``.

    Raises:
        BatchError: a named field is missing, not a tensor of two or more dimensions, a
            token field not ``W`` wide, response fields of different widths or wider than
            the sequence, or a field named in both roles.
    """
    mask = batch.get(attention_mask_key)
    if not _is_array(mask) or mask.ndim != 2:
        return None
    width = int(mask.shape[1])
    per_token = {k: v for k, v in batch.items() if _is_array(v) and v.ndim >= 2}
    for role, names in (("token_fields", token_fields), ("response_fields", response_fields)):
        for name in names or ():
            if name not in per_token:
                raise BatchError(
                    f"{role} names {name!r}, but the batch has no tensor field {name!r} of two or more dimensions; fields: {sorted(per_token)}"
                )
    if token_fields is not None and response_fields is not None:
        both = sorted(set(token_fields) & set(response_fields))
        if both:
            raise BatchError(f"a field cannot be both a token and a response field, but got {both}")
    if token_fields is None:
        token = tuple(k for k, v in per_token.items() if v.shape[1] == width and k not in (response_fields or ()))
    else:
        token = tuple(dict.fromkeys([*token_fields, attention_mask_key]))
        for name in token:
            if per_token[name].shape[1] != width:
                raise BatchError(
                    f"token field {name!r} must be {width} columns wide like {attention_mask_key!r}, but got shape {tuple(per_token[name].shape)}; name it in response_fields if it is response-width"
                )
    if response_fields is None:
        response = tuple(
            k for k, v in per_token.items() if k in RESPONSE_FIELD_NAMES and v.shape[1] < width and k not in token
        )
    else:
        response = tuple(response_fields)
    widths = {int(per_token[k].shape[1]) for k in response}
    if len(widths) > 1:
        raise BatchError(
            f"response fields must share one width, but got {({k: int(per_token[k].shape[1]) for k in response})}; name the response fields explicitly"
        )
    r = widths.pop() if widths else None
    if r is not None and r > width:
        raise BatchError(
            f"response fields must not be wider than the sequence ({width} columns), but got width {r} for {list(response)}"
        )
    return FieldRoles(width=width, token=token, response=response, response_width=r)


@dataclass(frozen=True)
class RowAlignment:
    """How :func:`align_rows` placed a micro-batch's rows (enough to write outputs back).

    Attributes:
        shifts: per row, the columns it moved right (``0`` = unmoved).
        start, end: the sequence columns kept, ``[start, end)``, counted after the shift.
        response_start, response_end: the response columns kept (after the shift), or
            ``None`` without response fields.
    """

    shifts: tuple[int, ...]
    start: int
    end: int
    response_start: int | None = None
    response_end: int | None = None

    @property
    def width(self) -> int:
        """Sequence columns kept."""
        return self.end - self.start


def _spans(mask: Array) -> tuple[np.ndarray, np.ndarray]:
    """First valid column and one past the last, per row (0, 0 for a row without a valid token)."""
    valid = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask) != 0
    any_valid = valid.any(1)
    width = valid.shape[1]
    first = np.where(any_valid, valid.argmax(1), 0)
    last = np.where(any_valid, width - valid[:, ::-1].argmax(1), 0)
    return first.astype(np.int64), last.astype(np.int64)


def _shift(value: Array, shifts: np.ndarray, fill: Any) -> Array:
    """Move row ``i`` of ``value`` right by ``shifts[i]`` columns, filling with ``fill``."""
    if not shifts.any():
        return value
    width = value.shape[1]
    source = np.arange(width)[None, :] - shifts[:, None]
    keep = source >= 0
    source = np.clip(source, 0, width - 1)
    if isinstance(value, torch.Tensor):
        index = torch.as_tensor(source, device=value.device)
        inside = torch.as_tensor(keep, device=value.device)
        extra = value.ndim - 2
        index = index.view(*index.shape, *([1] * extra)).expand(value.shape)
        inside = inside.view(*inside.shape, *([1] * extra)).expand(value.shape)
        moved = value.gather(1, index)
        return torch.where(inside, moved, torch.as_tensor(fill, dtype=value.dtype, device=value.device))
    extra = value.ndim - 2
    index = np.broadcast_to(source.reshape(*source.shape, *([1] * extra)), value.shape)
    inside = np.broadcast_to(keep.reshape(*keep.shape, *([1] * extra)), value.shape)
    return np.where(inside, np.take_along_axis(value, index, axis=1), np.asarray(fill, dtype=value.dtype))


def align_rows(
    rows: Batch,
    roles: FieldRoles,
    *,
    attention_mask_key: str = "attention_mask",
    pad_values: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], RowAlignment]:
    """Trim a micro-batch's rows to ``rows × longest`` columns, keeping every field aligned.

    See NOTE [ Sequence and response columns ]. Rows move right (with response fields
    present always to the sequence's last column, else only when their starts and their
    ends both differ) and the kept columns are the last ``longest`` span; vacated columns
    take the field's ``pad_values`` entry (default 0). Slices are views when no row moves.

    Returns:
        ``(rows, alignment)``: the new fields and how they were placed.
    """
    mask = rows[attention_mask_key]
    first, last = _spans(mask)
    longest = int((last - first).max()) if len(first) else 0
    fills = dict(pad_values or {})
    width = roles.width
    if roles.response:
        shifts = np.where(last > 0, width - last, 0)
    elif len(set(first.tolist())) <= 1 or len(set(last.tolist())) <= 1:
        shifts = np.zeros(len(first), dtype=np.int64)
    else:
        shifts = last.max() - last
    shifts = shifts.astype(np.int64)
    end = int((last + shifts).max()) if len(first) else width
    start = max(0, end - max(longest, 1))
    out = dict(rows)
    for key in roles.token:
        out[key] = _shift(rows[key], shifts, fills.get(key, 0))[:, start:end]
    r_start = r_end = None
    if roles.response:
        offset = width - int(roles.response_width or 0)  # response column j <-> sequence column offset + j
        r_start, r_end = max(0, start - offset), max(0, end - offset)
        for key in roles.response:
            out[key] = _shift(rows[key], shifts, fills.get(key, 0))[:, r_start:r_end]
    return out, RowAlignment(tuple(int(s) for s in shifts), start, end, r_start, r_end)


def write_back(
    out: Array,
    values: Array,
    alignment: RowAlignment,
    indices: Sequence[int],
    *,
    response: bool = False,
) -> None:
    """Write per-token outputs of an aligned micro-batch into the mini-batch's full-width tensor.

    ``values[i, c]`` (a sequence-width output, e.g. log-probs computed on the micro-batch's
    ``input_ids``, or with ``response=True`` a response-width one) goes to
    ``out[indices[i], original column]``, undoing the trim and the row's shift; columns that
    were padding vacated by the shift are skipped. In place.

    Raises:
        BatchError: ``values`` does not have the micro-batch's shape, or ``response=True``
            for a micro-batch without response fields.
    """
    if response and alignment.response_start is None:
        raise BatchError("write_back(response=True) needs a micro-batch with response fields, but it has none")
    lo = int(alignment.response_start if response else alignment.start)  # type: ignore[arg-type]
    hi = int(alignment.response_end if response else alignment.end)  # type: ignore[arg-type]
    if values.shape[0] != len(indices) or values.shape[1] != hi - lo:
        raise BatchError(
            f"values must be [{len(indices)}, {hi - lo}, ...] like the micro-batch's {'response' if response else 'sequence'} fields, but got shape {tuple(values.shape)}"
        )
    full = out.shape[1]
    for i, (row, shift) in enumerate(zip(indices, alignment.shifts)):
        columns = np.arange(lo, hi) - shift  # original columns
        keep = (columns >= 0) & (columns < full)
        if keep.any():
            cols = columns[keep]
            src = np.nonzero(keep)[0]
            if isinstance(out, torch.Tensor):
                out[row, torch.as_tensor(cols, device=out.device)] = values[i, torch.as_tensor(src, device=values.device)].to(out.dtype)
            else:
                out[row, cols] = np.asarray(values)[i, src]
