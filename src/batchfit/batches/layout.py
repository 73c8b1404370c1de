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

from batchfit.batches.batch import Batch
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
        "old_values",
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
        starts: per row, its first valid column in the aligned fields when every row's
            valid tokens are one contiguous span, else ``None`` (known on the host, so a
            model can run the rows without reading the mask back from the device).
    """

    shifts: tuple[int, ...]
    start: int
    end: int
    response_start: int | None = None
    response_end: int | None = None
    starts: tuple[int, ...] | None = None

    @property
    def width(self) -> int:
        """Sequence columns kept."""
        return self.end - self.start


def _spans(mask: Array) -> tuple[np.ndarray, np.ndarray, bool]:
    """First valid column and one past the last, per row (0, 0 for a row without a valid token), and whether every row is one span."""
    valid = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask) != 0
    any_valid = valid.any(1)
    width = valid.shape[1]
    first = np.where(any_valid, valid.argmax(1), 0)
    last = np.where(any_valid, width - valid[:, ::-1].argmax(1), 0)
    contiguous = bool(((last - first) == valid.sum(1)).all())
    return first.astype(np.int64), last.astype(np.int64), contiguous


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
    first, last, contiguous = _spans(mask)
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
    starts = tuple(int(f) for f in np.maximum(first + shifts - start, 0)) if contiguous else None
    return out, RowAlignment(tuple(int(s) for s in shifts), start, end, r_start, r_end, starts)


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
                out[row, torch.as_tensor(cols, device=out.device)] = values[i, torch.as_tensor(src, device=values.device)].to(device=out.device, dtype=out.dtype)
            else:
                out[row, cols] = _host(values)[i, src]


def _host(values: Array) -> np.ndarray:
    """``values`` as a host array (a device tensor, or one that requires grad, is copied)."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    return np.asarray(values)


# --------------------------------------------------------------------------- packed rows

# NOTE [ Packed position ids ]
# A packed row says where its sequences start in two ways: ``position_ids`` restarting at 0
# (what transformers' masks and batchfit's labels read) and ``cu_seq_lens`` (what varlen
# kernels read). :func:`pack_rows` makes both from the attention mask, never from the
# user's ``position_ids``: a common convention gives left-padded rows ``arange(W)``
# positions, which never restart at 0 once packed (the labels then cross sequence
# boundaries and attention spans the whole row). The user's positions are checked
# instead: over each sequence's valid tokens they must count up by one. Those that do
# (``0 .. l − 1``, or the arange convention's ``p .. p + l − 1``) are replaced by
# ``0 .. l − 1``, each sequence then running as it runs alone and as
# :func:`batchfit.train.model_logprobs` runs padded rows (moved to column 0, no positions);
# any other positions (rows with holes numbered across them, positions that repeat) are
# refused with :class:`~batchfit.errors.BatchError`.

#: Keys a packed micro-batch adds: the cumulative sequence lengths (int32) and the longest
#: sequence. batchfit reads them (:func:`packed_model_inputs`, the budget's probe);
#: a model gets them under the names in :data:`VARLEN_KWARGS`.
CU_SEQ_LENS = "cu_seq_lens"
MAX_LENGTH = "max_length"
POSITION_IDS = "position_ids"

#: What transformers' attention functions read for a packed row (flash-attention's varlen
#: path, ``modeling_flash_attention_utils``, and batchfit's varlen attention).
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class PackedRows:
    """Where the tokens of a packed row came from (see :func:`pack_rows`).

    Attributes:
        columns: per sequence, the original sequence columns of its valid tokens, in order.
    """

    columns: tuple[np.ndarray, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens per sequence."""
        return tuple(len(c) for c in self.columns)

    @property
    def offsets(self) -> np.ndarray:
        """``cu_seq_lens``: where each sequence starts in the packed row, then the total."""
        return np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)


def pack_rows(
    rows: Batch,
    roles: FieldRoles,
    *,
    attention_mask_key: str = "attention_mask",
    pad_values: Mapping[str, Any] | None = None,
    indices: Sequence[int] | None = None,
) -> tuple[dict[str, Any], PackedRows]:
    """One padding-free row: the valid tokens of every row, concatenated in row order.

    Token fields become ``[1, T, ...]`` (``T`` = total valid tokens); response fields are
    packed per token too, each token taking the response column that belongs to it
    (NOTE [ Sequence and response columns ]) or the field's fill value (prompt tokens);
    ``position_ids`` are made, restarting at 0 for each sequence (a batch's own
    ``position_ids`` are checked, not copied: NOTE [ Packed position ids ]);
    ``cu_seq_lens`` (int32, ``[rows + 1]``) and ``max_length`` are added for varlen
    kernels. The attention mask is dropped: run the row with :func:`packed_model_inputs`
    (``MicroBatch.model_inputs()``), which a Hugging Face model runs within each sequence.
    Other per-sample fields (lists, per-sequence scalars) keep one entry per sequence.

    ``indices`` (the rows' input indices, for error messages) names the rows as the batch numbers them.

    Returns:
        ``(packed fields, PackedRows)``.

    Raises:
        BatchError: the batch's ``position_ids`` do not count up by one over a row's valid
            tokens (NOTE [ Packed position ids ]).
    """
    mask = rows[attention_mask_key]
    valid = np.asarray(mask.detach().cpu() if isinstance(mask, torch.Tensor) else mask) != 0
    columns = tuple(np.nonzero(row)[0] for row in valid)
    packed = PackedRows(columns)
    row_index = np.concatenate([np.full(len(c), i) for i, c in enumerate(columns)]).astype(np.int64)
    col_index = np.concatenate(columns).astype(np.int64) if columns else np.zeros(0, np.int64)
    fills = dict(pad_values or {})
    out: dict[str, Any] = {k: v for k, v in rows.items() if k not in roles.token and k not in roles.response}
    for key in roles.token:
        if key == attention_mask_key:
            continue
        out[key] = _gather(rows[key], row_index, col_index)[None]
    if roles.response:
        offset = roles.width - int(roles.response_width or 0)
        response_col = col_index - offset
        inside = response_col >= 0
        for key in roles.response:
            value = rows[key]
            picked = _gather(value, row_index, np.clip(response_col, 0, value.shape[1] - 1))
            out[key] = _where(inside, picked, fills.get(key, 0))[None]
    given = rows.get(POSITION_IDS)
    if given is not None:
        _check_positions(given, packed, row_index, col_index, indices)
    positions = np.concatenate([np.arange(len(c)) for c in columns] or [np.zeros(0)]).astype(np.int64)
    out[POSITION_IDS] = torch.as_tensor(positions, device=_device(mask))[None]
    out[CU_SEQ_LENS] = torch.as_tensor(packed.offsets, dtype=torch.int32, device=_device(mask))
    out[MAX_LENGTH] = max(packed.lengths, default=0)
    return out, packed


def _check_positions(
    given: Any, packed: PackedRows, row_index: np.ndarray, col_index: np.ndarray, indices: Sequence[int] | None
) -> None:
    """Refuse ``position_ids`` that do not count up by one over each row's valid tokens (NOTE [ Packed position ids ])."""
    if not _is_array(given) or given.ndim != 2:
        shape = tuple(given.shape) if _is_array(given) else type(given).__name__
        raise BatchError(
            f"{POSITION_IDS} must be a 2-D tensor [rows, columns] for layout='packed', but got {shape}; "
            f"drop it from the batch: the packed layout makes its own positions"
        )
    values = _host(_gather(given, row_index, col_index)).astype(np.int64)
    offsets = packed.offsets
    inner = np.ones(max(len(values) - 1, 0), dtype=bool)
    starts = offsets[1:-1][(offsets[1:-1] > 0) & (offsets[1:-1] < len(values))]
    inner[starts - 1] = False  # a step from one sequence into the next
    bad = np.flatnonzero((np.diff(values) != 1) & inner)
    if bad.size:
        row = int(np.searchsorted(offsets, bad[0], side="right") - 1)
        seq = values[offsets[row] : offsets[row + 1]]
        where = f"row {indices[row]} of the batch" if indices and row < len(indices) else f"micro-batch row {row}"
        shown = ", ".join(str(int(v)) for v in seq[:8]) + (", ..." if len(seq) > 8 else "")
        raise BatchError(
            f"position_ids of {where} are [{shown}] over its {len(seq)} valid tokens "
            f"(columns {packed.columns[row][:8].tolist()}{'...' if len(seq) > 8 else ''}): they do not count up by one, "
            "so the packed row cannot restart them at 0 per sequence as they were meant; "
            "drop position_ids from the batch (the packed layout makes 0 .. length - 1 for each sequence) "
            "or run these rows with layout='padded'"
        )


def packed_model_inputs(
    fields: Mapping[str, Any], *, input_ids_key: str = "input_ids", position_ids_key: str = POSITION_IDS
) -> dict[str, Any]:
    """The keyword arguments a transformers model runs a packed row with, each sequence attending only to itself.

    ``input_ids`` and ``position_ids`` (restarting at 0 per sequence), the varlen kwargs
    transformers' attention reads (:data:`VARLEN_KWARGS`, from ``cu_seq_lens`` and
    ``max_length`` when the row has them) and ``use_cache=False``: transformers splits a
    packed row into its sequences only when no cache is made (with a cache, ``eager`` and
    ``sdpa`` attend across the whole row; NOTE [ Packed rows need varlen attention ] in
    :mod:`batchfit.models.attention`).

    Raises:
        BatchError: ``fields`` has no ``input_ids_key`` or ``position_ids_key`` tensor.
    """
    for key in (input_ids_key, position_ids_key):
        if not isinstance(fields.get(key), torch.Tensor):
            raise BatchError(
                f"a packed row needs a {key!r} tensor, but its fields are {sorted(fields)}; make it with iter_micro_batches(layout='packed')"
            )
    inputs: dict[str, Any] = {"input_ids": fields[input_ids_key], "position_ids": fields[position_ids_key]}
    cu = fields.get(CU_SEQ_LENS)
    if isinstance(cu, torch.Tensor):
        inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu)
        longest = fields.get(MAX_LENGTH)
        if isinstance(longest, int) and not isinstance(longest, bool):
            inputs.update(max_length_q=longest, max_length_k=longest)
    inputs["use_cache"] = False
    return inputs


def padded_model_inputs(
    fields: Mapping[str, Any],
    *,
    input_ids_key: str = "input_ids",
    attention_mask_key: str = "attention_mask",
    position_ids_key: str = POSITION_IDS,
) -> dict[str, Any]:
    """The keyword arguments a transformers model runs padded rows with.

    ``input_ids``, the attention mask, ``position_ids`` (the batch's own, else counted from
    the mask: ``0 .. l − 1`` over each row's valid tokens, whichever side the padding is on)
    and ``use_cache=False``.

    Raises:
        BatchError: ``fields`` has no ``input_ids_key`` tensor.
    """
    ids = fields.get(input_ids_key)
    if not isinstance(ids, torch.Tensor):
        raise BatchError(f"the micro-batch needs a {input_ids_key!r} tensor, but its fields are {sorted(fields)}")
    inputs: dict[str, Any] = {"input_ids": ids}
    mask = fields.get(attention_mask_key)
    if isinstance(mask, torch.Tensor):
        inputs["attention_mask"] = mask
    positions = fields.get(position_ids_key)
    if isinstance(positions, torch.Tensor):
        inputs["position_ids"] = positions
    elif isinstance(mask, torch.Tensor) and mask.ndim == 2:
        inputs["position_ids"] = ((mask != 0).long().cumsum(-1) - 1).clamp(min=0)
    inputs["use_cache"] = False
    return inputs


def _device(value: Array) -> torch.device:
    return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")


def _gather(value: Array, rows: np.ndarray, cols: np.ndarray) -> Array:
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(rows, device=value.device), torch.as_tensor(cols, device=value.device)]
    return value[rows, cols]


def _where(inside: np.ndarray, value: Array, fill: Any) -> Array:
    if isinstance(value, torch.Tensor):
        keep = torch.as_tensor(inside, device=value.device).view(-1, *([1] * (value.ndim - 1)))
        return torch.where(keep, value, torch.as_tensor(fill, dtype=value.dtype, device=value.device))
    keep = inside.reshape(-1, *([1] * (value.ndim - 1)))
    return np.where(keep, value, np.asarray(fill, dtype=value.dtype))


def unpack(values: Array, packed: PackedRows, *, fill: Any = 0) -> Array:
    """Per-token outputs of a packed row (``[1, T, ...]`` or ``[T, ...]``) as right-padded rows ``[n, longest, ...]``.

    Row ``i`` holds sequence ``i``'s outputs in its first ``lengths[i]`` columns, ``fill`` after.

    Raises:
        BatchError: ``values`` does not hold ``T`` tokens.
    """
    total = int(packed.offsets[-1])
    batched = values.ndim >= 2 and values.shape[0] == 1 and values.shape[1] == total
    flat = values[0] if batched else values
    if flat.shape[0] != total:
        raise BatchError(f"values must hold the packed row's {total} tokens, but got shape {tuple(values.shape)}")
    lengths = packed.lengths
    longest = max(lengths, default=0)
    shape = (len(lengths), longest, *flat.shape[1:])
    if isinstance(flat, torch.Tensor):
        out = torch.full(shape, fill, dtype=flat.dtype, device=flat.device)
    else:
        out = np.full(shape, fill, dtype=flat.dtype)
    for i, (start, length) in enumerate(zip(packed.offsets[:-1], lengths)):
        out[i, :length] = flat[int(start) : int(start) + length]
    return out


def write_back_packed(out: Array, values: Array, packed: PackedRows, indices: Sequence[int]) -> None:
    """Write per-token outputs of a packed row into the mini-batch's full-width tensor, at each token's column.

    Raises:
        BatchError: ``values`` does not hold the packed row's tokens.
    """
    rows = unpack(values, packed)
    for i, (row, cols) in enumerate(zip(indices, packed.columns)):
        if isinstance(out, torch.Tensor):
            out[row, torch.as_tensor(cols, device=out.device)] = rows[i, : len(cols)].to(device=out.device, dtype=out.dtype)
        else:
            out[row, cols] = _host(rows)[i, : len(cols)]
