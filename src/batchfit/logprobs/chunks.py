"""Argument checks, token chunking and the per-chunk math shared by the log-prob functions.

Both :mod:`~batchfit.logprobs.from_logits` and :mod:`~batchfit.logprobs.from_hidden` reduce a
chunk of logits ``x`` (``[c, V]``, any float dtype) to per-token fp32 log-probs and entropies,
and in backward turn the upstream gradients into the fp32 gradient of that chunk. Nothing here
writes into a tensor it did not create (see NOTE [ No in-place writes to saved tensors ]).

NOTE [ No in-place writes to saved tensors ]
SkyRL #1648: an entropy backward modified in place a tensor that another autograd function had
saved, and ``backward()`` failed with "one of the variables needed for gradient computation has
been modified by an inplace operation". Here every in-place operation targets a temporary the
function allocated itself in the same call (a chunk's fp32 copy, its softmax, its gradient), and
the gradient of the input is a fresh tensor. Inputs are saved by reference and only read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_int, check_number, check_positive_int

IGNORE_INDEX = -100


def check_chunk_size(chunk_size: Any) -> int | None:
    """Return ``chunk_size`` (a positive int) or ``None`` (no chunking); else raise InvalidArgument."""
    if chunk_size is None:
        return None
    return check_positive_int("chunk_size", chunk_size)


def check_temperature(temperature: Any) -> float:
    """Return ``temperature`` as a float > 0; else raise InvalidArgument."""
    # high=inf: validation.check_number cannot format high=None in its message (reported)
    return check_number("temperature", temperature, low=0.0, low_open=True, high=math.inf)


def check_float_tensor(name: str, value: Any, *, min_dim: int) -> torch.Tensor:
    """Return ``value`` if it is a floating-point tensor with at least ``min_dim`` dims; else raise."""
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, but got {name} of type {type(value).__name__}")
    if not value.is_floating_point():
        raise InvalidArgument(
            f"{name} must be a floating-point tensor, but got {name}.dtype={value.dtype}; cast it with .float()"
        )
    if value.dim() < min_dim:
        raise InvalidArgument(
            f"{name} must have at least {min_dim} dimensions, but got {name}.shape={tuple(value.shape)}"
        )
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions run in: fp32 for fp32 and narrower inputs, fp64 for fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def is_fake(t: torch.Tensor) -> bool:
    """True for tensors without data (FakeTensorMode or device ``meta``): values cannot be read."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return t.device.type == "meta" or _is_fake(t)


def check_labels(labels: Any, token_shape: tuple[int, ...], vocab: int, ignore_index: Any) -> torch.Tensor:
    """Validate labels against the token shape and vocabulary; return them flattened to ``[N]`` int64.

    Args:
        labels: integer tensor of shape ``token_shape``; each entry in ``[0, vocab)`` or ``ignore_index``.
        token_shape: the leading shape of the logits (or hidden states), e.g. ``(B, S)``.
        vocab: the vocabulary size ``V``.
        ignore_index: the label value that marks a token without a log-prob.

    Returns:
        ``labels`` as a contiguous int64 tensor of shape ``[N]``, ``N = prod(token_shape)``.

    Raises:
        InvalidArgument: not an integer tensor, wrong shape, or a label out of range (the first one
            is named with its position). The range check reads the values (one device sync); it is
            skipped for fake and meta tensors, which have none.
    """
    ignore_index = check_int("ignore_index", ignore_index)
    if not isinstance(labels, torch.Tensor):
        raise InvalidArgument(
            f"labels must be a torch.Tensor, but got labels of type {type(labels).__name__}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise InvalidArgument(
            f"labels must be an integer tensor, but got labels.dtype={labels.dtype}; cast it with .long()"
        )
    if tuple(labels.shape) != tuple(token_shape):
        raise InvalidArgument(
            f"labels.shape must equal the token shape {tuple(token_shape)} of the logits/hidden states, "
            f"but got labels.shape={tuple(labels.shape)}"
        )
    flat = labels.reshape(-1).long()
    if flat.numel() and not is_fake(flat):
        bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
        if bool(bad.any()):
            pos = int(bad.nonzero()[0, 0])
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), tuple(token_shape)))
            raise InvalidArgument(
                f"labels must be in [0, {vocab}) (the vocabulary size) or ignore_index={ignore_index}, "
                f"but got labels[{', '.join(map(str, where))}]={int(flat[pos])}"
            )
    return flat.contiguous()


class _RowViews(Sequence):
    """The 2-D ``[S, D]`` row views ``x[b0, ..., b_k]`` of a ``[..., S, D]`` tensor, made on access.

    Making thousands of views costs thousands of (fake) ops; :func:`chunks` only touches the
    rows it yields (NOTE [ Fake chunks skip the steady state ]).
    """

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.lead = tuple(x.shape[:-2])
        self.row_length = x.shape[-2]

    def __len__(self) -> int:
        return math.prod(self.lead)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        index = []
        for size in reversed(self.lead):
            k, r = divmod(k, size)
            index.append(r)
        return self.x[tuple(reversed(index))]


def rows(x: torch.Tensor) -> Sequence[torch.Tensor]:
    """Cover the tokens of ``x`` (``[..., D]``) in order with 2-D views ``[n_i, D]``, copying nothing.

    A tensor whose leading dims merge into one (contiguous, or a row slice of one) gives one
    view; otherwise (e.g. ``logits[:, :-1]``) one view per row ``[S, D]``, made on access.
    """
    if x.dim() == 1:
        return [x.unsqueeze(0)]
    if x.dim() == 2:
        return [x]
    try:
        return [x.view(-1, x.shape[-1])]
    except (RuntimeError, ValueError):  # fake tensors raise ValueError where real ones raise RuntimeError
        return _RowViews(x)


def chunks(parts: Sequence[torch.Tensor], chunk_size: int | None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, stop, view)``: consecutive token ranges of at most ``chunk_size`` rows.

    ``parts`` come from :func:`rows`; ``start``/``stop`` index the flattened tokens. A chunk never
    spans two parts; ``chunk_size=None`` yields each part whole. O(N / chunk_size) views.

    Fake tensors (memory estimation) skip the steady state (NOTE [ Fake chunks skip the steady state ]).
    """
    ranges: list[tuple[int, int, int, int, int]] = []  # (start, stop, part index, i, j)
    offset = 0
    lengths = [parts.row_length] * len(parts) if isinstance(parts, _RowViews) else [p.shape[0] for p in parts]
    for k, n in enumerate(lengths):
        step = n if chunk_size is None else chunk_size
        for i in range(0, n, max(step, 1)):
            j = min(i + step, n)
            ranges.append((offset + i, offset + j, k, i, j))
        offset += n
    if len(parts) and is_fake(parts.x if isinstance(parts, _RowViews) else parts[0]):
        ranges = _without_steady_state(ranges)
    for start, stop, k, i, j in ranges:
        yield start, stop, parts[k][i:j]


# NOTE [ Fake chunks skip the steady state ]
# Under FakeTensorMode (the estimate backend) values do not exist, only allocations, and every
# chunk of a loop allocates and frees the same sizes: after two chunks of one size the live-byte
# pattern repeats exactly (the second chunk already overlaps what the first left alive). Running
# the rest of a run of equal-size chunks would only repeat the same peak, at a cost of dozens of
# fake ops per chunk (minutes for millions of tokens). So fake loops run the first two chunks of
# each run of equal sizes and the last chunk of each part, and of many equal parts (the rows of
# `logits[:, :-1]`) only the first two and the last; the outputs of skipped chunks stay
# unwritten, which fake tensors cannot tell. The estimate still equals the real peak to the byte
# (tests/test_logprobs.py::test_estimate_with_many_chunks_equals_cpu_peak).


def _without_steady_state(ranges: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int, int]]:
    parts: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for r in ranges:
        parts.setdefault(r[2], []).append(r)
    groups = list(parts.values())
    if len(groups) > 3 and len({tuple(r[1] - r[0] for r in g) for g in groups}) == 1:
        groups = [*groups[:2], groups[-1]]  # equal parts repeat too: the first two and the last
    kept = []
    for group in groups:
        run_size, run_length = None, 0
        for n, r in enumerate(group):
            size = r[1] - r[0]
            run_length = run_length + 1 if size == run_size else 1
            run_size = size
            if run_length <= 2 or n == len(group) - 1:
                kept.append(r)
    return kept


def chunk_forward(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    valid: torch.Tensor | None,
    temperature: float,
    want_entropy: bool,
    *,
    own: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reduce one chunk of logits to fp32 ``(lse, logp, entropy)`` of ``softmax(x / T)``.

    Args:
        x: ``[c, V]`` logits, any float dtype; only read unless ``own``.
        labels: ``[c]`` int64 labels with ignored entries already replaced by 0, or ``None``.
        valid: ``[c]`` bool, False where the label was ``ignore_index`` (logp set to 0).
        temperature: ``T > 0``.
        want_entropy: compute the entropy too.
        own: ``x`` is the caller's own temporary and may be overwritten (saves one ``[c, V]``).

    Returns:
        ``lse`` ``[c]`` = logsumexp(x / T), ``logp`` ``[c]`` (``None`` without labels) and
        ``entropy`` ``[c]`` (``None`` unless wanted), all in :func:`compute_dtype` (fp32; fp64
        for fp64 input). Temporaries: at most two fp32
        ``[c, V]`` tensors.
    """
    m = x.amax(dim=1, keepdim=True).to(compute_dtype(x.dtype))
    # z = (x - max x) / T, so that exp(z) cannot overflow
    if own and x.dtype == m.dtype:
        z = x.sub_(m)  # the caller's temporary (the projected chunk): no second [c, V] tensor
        if temperature != 1.0:
            z.div_(temperature)
    else:
        z = torch.add(-m, x, alpha=1.0).div_(temperature) if temperature != 1.0 else x - m
    m = m / temperature
    target = z.gather(1, labels.unsqueeze(1)).squeeze(1) if labels is not None else None
    if want_entropy:
        e = torch.exp(z)
        s = e.sum(dim=1)
        log_s = torch.log(s)
        # H = -sum p log p with p = e / s, log p = z - log s  =>  H = log s - sum(e * z) / s
        entropy = log_s - e.mul_(z).sum(dim=1) / s
        del e
    else:
        entropy = None
        log_s = torch.log(z.exp_().sum(dim=1))  # z is this function's own temporary
    logp = None
    if target is not None:
        logp = torch.where(valid, target - log_s, torch.zeros_like(log_s))
    lse = m.squeeze(1) + log_s
    return lse, logp, entropy


def chunk_backward(
    x: torch.Tensor,
    labels: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    *,
    own: bool = False,
    column_offset: int | None = None,
) -> torch.Tensor:
    """The gradient ``[c, V]`` (in :func:`compute_dtype`) w.r.t. the chunk's logits ``x``, recomputing its softmax.

    With ``u = x / T``, ``p = softmax(u)``:
    ``d logp_y / d u_j = [j = y] - p_j`` and ``d H / d u_j = -p_j (log p_j + H)``;
    both are divided by ``T``. ``grad_logp`` must already be 0 at ignored tokens (and ``labels``
    0 there). ``x`` is only read unless ``own`` (the caller's temporary, then overwritten);
    temporaries: two ``[c, V]`` tensors in the compute dtype (one if ``own``).

    Every column depends only on its own logit and the per-token ``lse``/``entropy``, so ``x`` may
    also be a tile ``[c, w]`` of vocabulary columns ``[column_offset, column_offset + w)``:
    ``labels`` stay global and only those inside the tile get their ``[j = y]`` term.
    ``column_offset=None`` means ``x`` holds every column.
    """
    # log p = x / T - lse, in the compute dtype (lse's)
    if own and x.dtype == lse.dtype:
        logp_all = x.div_(temperature) if temperature != 1.0 else x  # the caller's temporary
        logp_all.sub_(lse.unsqueeze(1))
    else:
        logp_all = torch.add(-lse.unsqueeze(1), x, alpha=1.0 / temperature)
    p = torch.exp(logp_all)
    if grad_entropy is not None:
        g = logp_all.add_(entropy.unsqueeze(1)).mul_(p).mul_(-grad_entropy.unsqueeze(1))
        if grad_logp is not None:
            g.addcmul_(p, grad_logp.unsqueeze(1), value=-1.0)
        del p
    else:
        del logp_all
        g = p.mul_(-grad_logp.unsqueeze(1))
    if grad_logp is not None:
        if column_offset is None:
            g.scatter_add_(1, labels.unsqueeze(1), grad_logp.unsqueeze(1))
        else:
            local = labels - column_offset
            hit = (local >= 0) & (local < g.shape[1])
            g.scatter_add_(
                1, torch.where(hit, local, 0).unsqueeze(1), torch.where(hit, grad_logp, 0.0).unsqueeze(1)
            )
    if temperature != 1.0:
        g.div_(temperature)
    return g


# NOTE [ Only the positions the loss reads ]
# An RL loss reads log-probs (and entropy) only where its loss mask is set: response tokens, not
# the prompt, system messages or tool outputs. ``positions`` (a mask of the token shape) makes the
# head run only there: the selected rows of the hidden states (or of the model's logits) are
# gathered into one ``[K, H]`` block, reduced as before, and the ``[K]`` results are scattered back
# to the token shape with 0 elsewhere. Each selected token's value is computed from its own row
# alone, so it equals the full head's value there; the gradient of an unselected row is 0 (the
# full head's too, when the loss reads only the selected ones). Memory and time of the head then
# scale with ``K``, not with every token. The row index is read from the mask (one device sync),
# so the mask must hold values: a fake tensor has them only where its fake mode kept them (the
# estimate backend keeps those of integer and bool tensors made from host data).
#
# NOTE [ Asking a fake mask for its values ]
# Whether a fake mask's values are known is the fake mode's business, not this package's: the
# core imports no measuring code. So the index of a fake (or meta) mask is simply asked for, and
# a mode without the values refuses ``nonzero``: torch's FakeTensorMode with
# ``DynamicOutputShapeException``, the estimate backend's mode with ``UnknownValuesError``
# (NOTE [ Integer tensors keep their values ] in ``batchfit.memory.shadow_values``), the meta
# device with ``NotImplementedError``. All three are RuntimeErrors, caught only around that one
# call on a fake mask and turned into the InvalidArgument that says what to do.


def position_index(positions: Any, token_shape: tuple[int, ...]) -> torch.Tensor:
    """The flat int64 indices (ascending) of the non-zero entries of ``positions``, a mask of ``token_shape``.

    See NOTE [ Only the positions the loss reads ].

    Raises:
        InvalidArgument: not a tensor of ``token_shape``, or a fake tensor whose values were not kept.
    """
    if not isinstance(positions, torch.Tensor):
        raise InvalidArgument(
            f"positions must be a torch.Tensor mask of the token shape {tuple(token_shape)}, but got positions of type {type(positions).__name__}"
        )
    if tuple(positions.shape) != tuple(token_shape):
        raise InvalidArgument(
            f"positions must have the token shape {tuple(token_shape)} of the labels, but got positions.shape={tuple(positions.shape)}"
        )
    selected = positions.reshape(-1) != 0
    if not is_fake(positions):
        return selected.nonzero().reshape(-1)
    try:  # NOTE [ Asking a fake mask for its values ]
        return selected.nonzero().reshape(-1)
    except RuntimeError as e:
        raise InvalidArgument(
            "positions must hold values (the head runs only where they are non-zero), but got a fake tensor "
            "whose values are not known; make the mask from host data (an integer or bool tensor, whose values "
            "the estimate backend keeps), or run the full head"
        ) from e


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``x`` (``[..., D]``) flattened over its leading dims: ``[K, D]`` (differentiable)."""
    return x.reshape(-1, x.shape[-1]).index_select(0, index)


def scatter_tokens(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """``[count, ...]`` zeros with ``values[k]`` at row ``index[k]`` (differentiable w.r.t. ``values``)."""
    out = torch.zeros((count, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_copy(0, index, values)
