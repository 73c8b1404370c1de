"""Per-token log-probs of a micro-batch, fused, through the model's own forward (bare, DDP or FSDP2).

NOTE [ Fused log-probs through the wrapper ]
:func:`batchfit.logprobs.logprobs_from_hidden` needs the last hidden states and the output
head's weight. Calling the decoder body (``model.model(...)``) and reading
``lm_head.weight`` directly bypasses the wrapper: ``DistributedDataParallel.forward``
(which prepares the gradient reducer) never runs, and under FSDP2 the root's parameters
(embeddings, final norm, head) are never gathered, so ``lm_head.weight`` is a shard.
:func:`model_logprobs` calls the wrapper instead and, for the duration of that one
forward, replaces the output head's ``forward`` by the fused reduction: the model's
``logits`` output is then the ``[rows, T]`` fp32 log-probs (with entropy stacked last when
asked), computed inside the forward where FSDP2 has gathered the head's weight and DDP's
hooks see every parameter. No ``[rows, T, V]`` logits ever exist.

Models whose forward transforms the logits after the head (Gemma-2's soft-capping,
Cohere's ``logit_scale``, Granite's ``logits_scaling``) would transform the log-probs
instead; they are refused.

NOTE [ Token-aligned log-probs ]
Column ``c`` of :func:`model_logprobs`'s result is ``log p(input_ids[:, c] | input_ids[:, <c])``:
the log-prob of the token *in* that column, like ``loss_mask`` marks the tokens to train
on. It is computed from the hidden state of column ``c - 1`` with the label of column ``c``
(:func:`next_token_labels`) and is 0 where the token has no previous token in its own
sequence (a sequence's first token, padding, a packed row's sequence boundaries).
Response-width fields of the prompt | response layout are the last columns of it
(NOTE [ Sequence and response columns ] in :mod:`batchfit.layout`).

NOTE [ Padded rows run without a mask ]
Causal attention needs no mask for rows whose valid tokens start in column 0: a token only
attends to earlier columns, all valid, and the padding after it is never attended. Rows of
the prompt | response layout are left-padded, and given a mask Hugging Face models build a
``[rows, 1, S, S]`` mask that sdpa cannot run with its causal kernel (on the CPU: the math
path, memory quadratic in ``S``, which the token budget's unmasked probe never held;
measured 3.7% above a budget's limit at 80 tokens, growing with the length).
:func:`model_logprobs` therefore moves each padded row's tokens to start in column 0, runs
the model without mask or positions (positions ``0 .. length − 1``, those of each
sequence), and moves the log-probs back to the columns they came from. Rows whose valid
tokens are not one contiguous span keep the mask.

NOTE [ Head chunks no longer than a sequence ]
The fused head holds two or three fp32 ``[chunk, V]`` temporaries, so its memory grows with
the chunk's length up to ``chunk_size``. A token budget is found by probing ``b`` rows of
``s`` tokens, whose fused head runs one row at a time: chunks of at most ``s`` tokens. A
packed row of many short sequences (or ``b`` padded rows, whose hidden states are one
block) chunked by ``chunk_size`` tokens would hold ``[chunk_size, V]`` temporaries where
the budget's probe at that length held ``[s, V]`` ones: measured on the tiny preset,
9.6 MB for a 320-token micro-batch whose budget limit was 7.5 MB. :func:`model_logprobs`
therefore caps the chunk at the micro-batch's longest sequence by default
(``chunk_size="auto"``), which keeps every micro-batch within what the budget measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from batchfit.errors import BatchError, InvalidArgument
from batchfit.logprobs import IGNORE_INDEX, logprobs_from_hidden
from batchfit.models.shard import unwrap

#: Config attributes of models that change the logits after the output head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

__all__ = [
    "LOGIT_TRANSFORMS",
    "MAX_CHUNK",
    "auto_chunk_size",
    "fused_output_head",
    "model_logprobs",
    "next_token_labels",
]


def _tensor_field(batch: Mapping[str, Any], key: str, *, required: bool) -> torch.Tensor | None:
    value = batch.get(key)
    if value is None:
        if required:
            raise BatchError(f"the micro-batch needs a {key!r} field, but its fields are {sorted(batch)}")
        return None
    if not isinstance(value, torch.Tensor) or value.ndim != 2:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise BatchError(f"{key} must be a 2-D tensor [rows, columns], but got {shape}")
    return value


def next_token_labels(
    batch: Mapping[str, Any],
    *,
    input_ids_key: str = "input_ids",
    attention_mask_key: str = "attention_mask",
    position_ids_key: str = "position_ids",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Labels of each column's *next* token: ``labels[:, t] = input_ids[:, t + 1]`` when it continues t's sequence.

    Column ``t + 1`` continues the sequence of column ``t`` when both are valid tokens
    (``attention_mask``, if the batch has one) and ``t + 1`` does not start a sequence
    (``position_ids[:, t + 1] > 0``, if the batch has them: packed rows restart at 0). The last
    column and every other column get ``ignore_index``.

    Args:
        batch: a micro-batch, padded rows or one packed row (:func:`batchfit.microbatch.iter_micro_batches`).
        input_ids_key, attention_mask_key, position_ids_key: the field names.
        ignore_index: the label of columns without a next token.

    Returns:
        An int64 tensor shaped like ``input_ids``.

    Raises:
        BatchError: ``input_ids`` is missing, or a field is not a 2-D tensor of its shape.

    Example:
        >>> b = {"input_ids": torch.tensor([[5, 6, 7, 8]]), "position_ids": torch.tensor([[0, 1, 0, 1]])}
        >>> next_token_labels(b).tolist()  # two packed sequences: (5, 6) and (7, 8)
        [[6, -100, 8, -100]]
    """
    ids = _tensor_field(batch, input_ids_key, required=True)
    assert ids is not None  # required above
    mask = _tensor_field(batch, attention_mask_key, required=False)
    positions = _tensor_field(batch, position_ids_key, required=False)
    for key, value in ((attention_mask_key, mask), (position_ids_key, positions)):
        if value is not None and value.shape != ids.shape:
            raise BatchError(
                f"{key} must have the shape of {input_ids_key} {tuple(ids.shape)}, but got {tuple(value.shape)}"
            )
    continues = torch.ones(ids.shape[0], max(ids.shape[1] - 1, 0), dtype=torch.bool, device=ids.device)
    if mask is not None:
        continues &= (mask[:, :-1] != 0) & (mask[:, 1:] != 0)
    if positions is not None:
        continues &= positions[:, 1:] > 0
    labels = torch.full(ids.shape, ignore_index, dtype=torch.long, device=ids.device)
    labels[:, :-1] = torch.where(continues, ids[:, 1:].long(), ignore_index)
    return labels


def _output_head(model: torch.nn.Module) -> torch.nn.Module:
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise InvalidArgument(
                f"fused log-probs need logits straight from the output head, but {type(inner).__name__} transforms them after it ({name}={value!r}); compute log-probs from its logits with batchfit.logprobs.logprobs_from_logits"
            )
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise InvalidArgument(
            f"fused log-probs need a causal LM whose get_output_embeddings() is a linear head, but got a {type(inner).__name__}; pass a transformers causal LM (bare, DDP or FSDP2)"
        )
    return head


@contextlib.contextmanager
def fused_output_head(
    model: torch.nn.Module,
    labels: torch.Tensor | Callable[[], torch.Tensor],
    *,
    chunk_size: int | None = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Iterator[None]:
    """Inside the block, the output head of ``model`` returns fused log-probs of ``labels`` instead of logits.

    The head computes :func:`batchfit.logprobs.logprobs_from_hidden` of its input (the last
    hidden states) and its own ``weight``/``bias`` at the moment it runs, which under FSDP2
    is the gathered weight (NOTE [ Fused log-probs through the wrapper ]). Its output is
    ``[*labels.shape]`` fp32, or ``[*labels.shape, 2]`` (log-prob, entropy) with
    ``return_entropy``. ``labels`` may be a function that makes them, called when the head
    runs (they then do not exist during the layers' forward). Not thread-safe: the head is
    patched on the module.

    Raises:
        InvalidArgument: ``model`` has no linear output head, or transforms its logits.
    """
    head = _output_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        out = logprobs_from_hidden(
            hidden,
            head.weight,
            labels() if callable(labels) else labels,
            bias=getattr(head, "bias", None),
            chunk_size=chunk_size,
            temperature=temperature,
            return_entropy=return_entropy,
        )
        return torch.stack(out, dim=-1) if return_entropy else out.clone()

    head.forward = forward  # an instance attribute shadows the class' forward
    try:
        yield
    finally:
        del head.forward


#: The largest chunk ``chunk_size="auto"`` uses (:func:`batchfit.logprobs.logprobs_from_hidden`'s default).
MAX_CHUNK = 1024


def auto_chunk_size(batch: Mapping[str, Any], input_ids_key: str = "input_ids") -> int:
    """The micro-batch's longest sequence, at most :data:`MAX_CHUNK` tokens (NOTE [ Head chunks no longer than a sequence ]).

    A packed micro-batch says it in ``max_length``; padded rows are trimmed to their longest
    member, so their width is that length.

    Example:
        >>> auto_chunk_size({"input_ids": torch.zeros(1, 900), "max_length": 300})
        300
    """
    longest = batch.get("max_length")
    if not isinstance(longest, int) or isinstance(longest, bool):
        longest = int(batch[input_ids_key].shape[-1])
    return max(1, min(MAX_CHUNK, longest))


def model_logprobs(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    return_entropy: bool = False,
    input_ids_key: str = "input_ids",
    attention_mask_key: str = "attention_mask",
    position_ids_key: str = "position_ids",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probs of a micro-batch under ``model``, fused, through the model's own forward.

        Runs ``model(input_ids=..., attention_mask=..., position_ids=..., use_cache=False)``
        (the mask and positions when the batch has them: padded rows, or one packed row with
        ``position_ids`` restarting at 0 per sequence) with the output head replaced by
        :func:`fused_output_head`, so DDP and FSDP2 wrappers run as in any forward
        (NOTE [ Fused log-probs through the wrapper ]). Works under ``torch.no_grad()`` (old
        and reference log-probs) and with autograd (the policy loss).

        Args:
            model: a transformers causal LM, bare, ``DistributedDataParallel`` or ``fully_shard``-ed.
            batch: one micro-batch (``MicroBatch.batch``), padded or packed.
            chunk_size: tokens per chunk of the fused head; ``"auto"`` (default) is the
                micro-batch's longest sequence, at most 1024, which keeps the head within what a
                token budget measured (NOTE [ Head chunks no longer than a sequence ]); an int or
                ``None`` as :func:`batchfit.logprobs.logprobs_from_hidden`.
            temperature: as :func:`batchfit.logprobs.logprobs_from_hidden`.
            return_entropy: also return the entropy of the distribution each token was drawn from.
            input_ids_key, attention_mask_key, position_ids_key: the field names.

        Returns:
            ``[rows, T]`` fp32 log-probs, column ``c`` the log-prob of the token in column ``c``
            (NOTE [ Token-aligned log-probs ]), 0 where it has no previous token; or
            ``(logprobs, entropy)``, aligned the same way.

        Raises:
            BatchError: a missing or misshapen field.
            InvalidArgument: ``model`` has no linear output head, or transforms its logits.

        Example:
            >>> from batchfit.models import build_causal_lm
            >>> model = build_causal_lm("tiny")
            >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]])}
            >>> model_logprobs(model, batch).shape
            torch.Size([1, 3])
    """
    shifts = span_starts(batch.get(attention_mask_key))
    ids = batch[input_ids_key] if shifts is None else _roll_left(batch[input_ids_key], shifts)

    def labels() -> torch.Tensor:  # made when the head runs, not held through the layers
        if shifts is None:
            return next_token_labels(
                batch,
                input_ids_key=input_ids_key,
                attention_mask_key=attention_mask_key,
                position_ids_key=position_ids_key,
            )
        # NOTE [ Padded rows run without a mask ]: the rows moved to column 0
        return next_token_labels(
            {"input_ids": ids, "attention_mask": _roll_left(batch[attention_mask_key] != 0, shifts)}
        )

    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise InvalidArgument(
                f"chunk_size must be 'auto', a positive integer or None, but got chunk_size={chunk_size!r}"
            )
        chunk_size = auto_chunk_size(batch, input_ids_key)
    inputs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    if shifts is None:
        if batch.get(attention_mask_key) is not None:
            inputs["attention_mask"] = batch[attention_mask_key]
        if batch.get(position_ids_key) is not None:
            inputs["position_ids"] = batch[position_ids_key]
    with fused_output_head(
        model, labels, chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy
    ):
        out = model(**inputs).logits
    # the hidden state of column c - 1 predicts the token of column c: shift right by one
    shifted = torch.nn.functional.pad(out[:, :-1], (0, 0, 1, 0) if return_entropy else (1, 0))
    if shifts is not None:
        shifted = _roll_back(shifted, shifts, batch[attention_mask_key] != 0)
    if return_entropy:
        return shifted[..., 0], shifted[..., 1]
    return shifted


def span_starts(mask: Any) -> torch.Tensor | None:
    """Per row, its first valid column, when every row's valid tokens are one contiguous span.

    ``None``: no 2-D mask, or a row with holes (NOTE [ Padded rows run without a mask ]: such
    rows keep their mask).

    Example:
        >>> span_starts(torch.tensor([[0, 1, 1], [1, 1, 0]])).tolist()
        [1, 0]
    """
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] == 0:
        return None
    valid = mask != 0
    count = valid.sum(1)
    first = torch.where(count > 0, valid.int().argmax(1), 0)
    cols = torch.arange(mask.shape[1], device=mask.device)
    span = (cols >= first[:, None]) & (cols < (first + count)[:, None])
    return first if bool((span == valid).all()) else None


def _roll_left(values: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    """Row ``i`` moved left by ``shifts[i]`` columns; the columns vacated at the end are 0."""
    width = values.shape[1]
    source = torch.arange(width, device=values.device)[None, :] + shifts[:, None]
    inside = source < width
    moved = values.gather(1, source.clamp(max=width - 1))
    return torch.where(inside, moved, torch.zeros((), dtype=values.dtype, device=values.device))


def _roll_back(values: torch.Tensor, shifts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Undo :func:`_roll_left` on ``[rows, W, ...]`` outputs: each back at its column, 0 on padding."""
    width = values.shape[1]
    source = (torch.arange(width, device=values.device)[None, :] - shifts[:, None]).clamp(min=0)
    if values.ndim == 3:
        source, valid = source[..., None].expand(values.shape), valid[..., None]
    return torch.where(
        valid, values.gather(1, source), torch.zeros((), dtype=values.dtype, device=values.device)
    )
