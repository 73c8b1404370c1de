"""Per-token log-probs (and values) of a micro-batch through the model's own forward (bare, DDP or FSDP2).

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
(NOTE [ Sequence and response columns ] in :mod:`batchfit.batches.layout`).

NOTE [ Padded rows run without a mask ]
Causal attention needs no mask for rows whose valid tokens start in column 0: a token only
attends to earlier columns, all valid, and the padding after it is never attended. Rows of
the prompt | response layout are left-padded, and given a mask Hugging Face models build a
``[rows, 1, S, S]`` mask that sdpa cannot run with its causal kernel (on the CPU: the math
path, memory quadratic in ``S``; measured 3.7% more memory than the causal kernel at 80
tokens, growing with the length). :func:`model_logprobs` therefore moves each padded row's tokens to start in column 0, runs
the model without mask or positions (positions ``0 .. length − 1``, those of each
sequence), and moves the log-probs back to the columns they came from. Rows whose valid
tokens are not one contiguous span keep the mask.

NOTE [ Head chunks no longer than a sequence ]
The fused and chunked heads hold two or three fp32 ``[chunk, V]`` temporaries, so the head's
memory grows with the chunk up to ``chunk_size``. With ``chunk_size="auto"`` a micro-batch's
chunk is its longest sequence, at most :data:`MAX_CHUNK` tokens: a micro-batch of short
sequences never holds more head memory than the budget's probe at the longest length held
(the probe runs this function, NOTE [ One micro-batch step ] in :mod:`batchfit.budget.causal_lm_probe`),
and short micro-batches hold less.

NOTE [ Response-only head ]
The loss reads log-probs (and entropy) only where ``loss_mask`` is set; prompts, system
messages and tool outputs carry 0. With ``only_loss_tokens=True``, :func:`model_logprobs`
runs the output head only on the hidden rows that predict those tokens: column ``c`` of the
result comes from the hidden state of column ``c - 1`` (NOTE [ Token-aligned log-probs ]), so
the rows gathered are those whose *next* column is in the loss mask (and continues their
sequence). The loss mask is read in the micro-batch's own layout: response-width and
right-aligned with the sequence for prompt | response rows (NOTE [ Sequence and response
columns ]), per token in a packed row. The gathered ``[K, H]`` rows run through the fused
head (:func:`batchfit.logprobs.logprobs_from_hidden` with ``positions``) or, for the other
heads, through the head's own forward and then the head's reduction; the ``[K]`` results
are scattered back to ``[rows, W]`` with 0 elsewhere. The gathering happens inside the head's
forward, called by the model as always, so DDP's reducer and FSDP2's all-gather of the head's
weight (and the reduce-scatter of its gradient) run as for the full head. At the selected
columns values and gradients equal the full head's; memory and time of the head scale with
the loss tokens. The row index is read from the loss mask (one device sync); on the
estimate backend an integer or bool loss mask made from host data keeps its values (NOTE
[ Integer tensors keep their values ]), so the estimate runs the same gather (equal to the
cpu backend to the byte); a float mask there has no values and is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils._mode_utils import no_dispatch

from batchfit.batches.layout import packed_model_inputs
from batchfit.batches.microbatch import MicroBatch
from batchfit.errors import BatchError, InvalidArgument
from batchfit.logprobs import IGNORE_INDEX, logprobs_from_hidden, logprobs_from_logits
from batchfit.logprobs.chunks import (
    check_temperature,
    gather_tokens,
    is_fake,
    position_index,
    scatter_tokens,
)
from batchfit.memory.shadow_values import shadow_of
from batchfit.models.attention import check_packed_attention, warn_if_masked
from batchfit.models.ulysses import sequence_group
from batchfit.parallel.sequence import group_rank, group_size
from batchfit.parallel.sequence_split import gather_packed, sequence_shard, split_packed
from batchfit.parallel.shard import unwrap
from batchfit.train.framework_heads import (
    FRAMEWORK_HEADS,
    FrameworkHead,
    as_framework_head,
    framework_logprobs,
)
from batchfit.train.trl_head import trl_logprobs_from_hidden
from batchfit.validation import check_choice

#: Config attributes of models that change the logits after the output head.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

#: How :func:`model_logprobs` turns the last hidden states into log-probs: batchfit's three,
#: then the frameworks' own (NOTE [ The framework's head, not ours ]), then TRL's (NOTE [ TRL's head ]).
HEADS = ("full", "chunked", "fused", *FRAMEWORK_HEADS, "trl")

__all__ = [
    "HEADS",
    "LOGIT_TRANSFORMS",
    "MAX_CHUNK",
    "auto_chunk_size",
    "check_head",
    "fused_output_head",
    "model_logprobs",
    "model_values",
    "next_token_labels",
    "trl_output_head",
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
        batch: a micro-batch, padded rows or one packed row (:func:`batchfit.batches.microbatch.iter_micro_batches`).
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
    positions: torch.Tensor | Callable[[], torch.Tensor] | None = None,
) -> Iterator[None]:
    """Inside the block, the output head of ``model`` returns fused log-probs of ``labels`` instead of logits.

    The head computes :func:`batchfit.logprobs.logprobs_from_hidden` of its input (the last
    hidden states) and its own ``weight``/``bias`` at the moment it runs, which under FSDP2
    is the gathered weight (NOTE [ Fused log-probs through the wrapper ]). Its output is
    ``[*labels.shape]`` fp32, or ``[*labels.shape, 2]`` (log-prob, entropy) with
    ``return_entropy``. ``labels`` may be a function that makes them, called when the head
    runs (they then do not exist during the layers' forward). With ``positions`` (a mask of
    the labels' shape, or a function making it) only the hidden rows where it is non-zero
    run through the head, the others get 0 (NOTE [ Response-only head ]). Not thread-safe:
    the head is patched on the module; an accelerate hook on it keeps running around the
    fused forward, and the head's instance attributes are restored as found on exit (NOTE
    [ The head's instance attributes are left as found ]).

    Raises:
        InvalidArgument: ``model`` has no linear output head, or transforms its logits.
    """
    head = _output_head(model)

    def make(own: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            out = logprobs_from_hidden(
                hidden,
                head.weight,
                labels() if callable(labels) else labels,
                bias=getattr(head, "bias", None),
                chunk_size=chunk_size,
                temperature=temperature,
                return_entropy=return_entropy,
                positions=positions() if callable(positions) else positions,
            )
            return torch.stack(out, dim=-1) if return_entropy else out.clone()

        return forward

    with _replaced_forward(head, make):
        yield


@contextlib.contextmanager
def trl_output_head(
    model: torch.nn.Module,
    labels: Callable[[], torch.Tensor],
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> Iterator[None]:
    """Inside the block, the output head of ``model`` returns TRL's log-probs of ``labels()`` (NOTE [ TRL's head ]).

    As :func:`fused_output_head`, with TRL's own kernel (:func:`batchfit.train.trl_head.trl_logprobs_from_hidden`)
    and its vocabulary chunk; GRPO's entropy is computed whatever ``return_entropy`` (TRL always asks for it)
    and returned stacked last only when asked.

    Raises:
        InvalidArgument: ``model`` has no linear output head, or transforms its logits; TRL is not installed.
    """
    head = _output_head(model)

    def make(own: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            out = trl_logprobs_from_hidden(
                hidden, head.weight, getattr(head, "bias", None), labels(), temperature=temperature
            )
            return out if return_entropy else out[..., 0]

        return forward

    with _replaced_forward(head, make):
        yield


@contextlib.contextmanager
def _replaced_forward(
    head: torch.nn.Module,
    make: Callable[[Callable[[torch.Tensor], torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]],
) -> Iterator[None]:
    """Inside the block, ``head``'s forward is ``make(its own forward)``; module hooks keep running around it."""
    # NOTE [ The head's instance attributes are left as found ]: accelerate's hooks (device
    # maps, offload) replace the head's forward by an instance attribute that runs the hook
    # around ``_old_forward``; under such a hook the fused forward goes in ``_old_forward``, so
    # the hook still moves the weight in and the output out. Whatever attribute is replaced
    # is put back as it was (or deleted only when batchfit added it).
    name = "_old_forward" if "_hf_hook" in head.__dict__ and "_old_forward" in head.__dict__ else "forward"
    missing = object()
    own = head.__dict__.get(name, missing)
    original = type(head).forward.__get__(head) if own is missing else own
    setattr(head, name, make(original))  # an instance attribute shadows the class' forward
    try:
        yield
    finally:
        if own is missing:
            head.__dict__.pop(name, None)
        else:
            setattr(head, name, own)


@contextlib.contextmanager
def _gathered_output_head(model: torch.nn.Module, index: torch.Tensor) -> Iterator[None]:
    """Inside the block, the output head runs only on the hidden rows ``index`` (flat): its logits are ``[1, K, V]``.

    The head's own forward runs on the gathered rows, inside the call the model makes, so
    FSDP2's and DDP's hooks around the head (or its root) run as for the full head (NOTE
    [ Response-only head ]).
    """
    head = _output_head(model)

    def make(own: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            return own(gather_tokens(hidden, index))[None]

        return forward

    with _replaced_forward(head, make):
        yield


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


def _fields(batch: Any) -> Mapping[str, Any]:
    """The per-sample fields of a :class:`~batchfit.batches.MicroBatch` or of a mapping."""
    if isinstance(batch, MicroBatch):
        return batch.batch
    if not isinstance(batch, Mapping):
        raise BatchError(
            f"batch must be a MicroBatch or a mapping of per-sample fields, but got a {type(batch).__name__}"
        )
    return batch


def _row_starts(batch: Any, fields: Mapping[str, Any], attention_mask_key: str) -> np.ndarray | None:
    """Each padded row's first valid column when every row's valid tokens are one span, else ``None``.

    A :class:`~batchfit.batches.MicroBatch` knows it on the host (its rows were laid out
    there: no device sync, and it works on the estimate backend's fake tensors); a mapping is
    read from its attention mask (:func:`span_starts`).
    """
    if isinstance(batch, MicroBatch) and batch.alignment is not None and batch.alignment.starts is not None:
        return np.asarray(batch.alignment.starts, dtype=np.int64)
    return span_starts(fields.get(attention_mask_key))


class _TokenAligned:
    """How a micro-batch runs through the model so that outputs come back token-aligned.

    NOTE [ Padded rows run without a mask ] and NOTE [ Token-aligned log-probs ]: padded
    rows whose valid tokens are one span move to start in column 0 and run without a mask;
    packed rows run with their ``position_ids`` (and the ``cu_seq_lens`` varlen kernels
    read); rows with holes keep their mask. :attr:`inputs` is what the model is called with,
    :meth:`labels` the next-token labels in the columns the model sees, :meth:`restore` puts
    per-column outputs of the model back at the micro-batch's columns, shifted so that
    column ``c`` holds what the hidden state of ``c - 1`` predicts about token ``c``.
    """

    def __init__(self, model: torch.nn.Module, batch: Any, keys: tuple[str, str, str]):
        input_ids_key, attention_mask_key, position_ids_key = keys
        fields = _fields(batch)
        self.fields, self.keys = fields, keys
        self.group = sequence_group(unwrap(model))
        self.shard: Any = None  # this rank's columns of a row split over a sequence-parallel group
        ids = fields.get(input_ids_key)
        _tensor_field(fields, input_ids_key, required=True)
        starts = _row_starts(batch, fields, attention_mask_key)
        self.shifts: torch.Tensor | None = None
        if starts is not None and starts.any():
            # the values on the device, from the mask (shape-only ops: also on fake tensors)
            self.shifts = (fields[attention_mask_key] != 0).int().argmax(1)
            ids = _roll_left(ids, self.shifts)
        self.ids = ids
        mask, positions = fields.get(attention_mask_key), fields.get(position_ids_key)
        if mask is None and isinstance(positions, torch.Tensor):  # a packed row
            # positions, the varlen kwargs and use_cache=False (NOTE [ Packed position ids ])
            self.inputs: dict[str, Any] = packed_model_inputs(
                fields, input_ids_key=input_ids_key, position_ids_key=position_ids_key
            )
            check_packed_attention(unwrap(model), self.inputs)  # NOTE [ Packed rows must not attend across sequences ]
            warn_if_masked(unwrap(model))  # NOTE [ Packed rows need varlen attention ]
        if group_size(self.group) > 1:
            self._split(fields, mask is None and isinstance(positions, torch.Tensor))
        elif mask is not None or not isinstance(positions, torch.Tensor):
            self.inputs = {"input_ids": ids, "use_cache": False}
            if starts is None:  # rows with holes keep their mask (and positions)
                if mask is not None:
                    self.inputs["attention_mask"] = mask
                if positions is not None:
                    self.inputs["position_ids"] = positions
        self.starts = starts

    def _split(self, fields: Mapping[str, Any], packed: bool) -> None:
        """This rank's columns of the packed row: inputs and labels cut alike (NOTE [ A packed row split over a group ])."""
        input_ids_key, _, position_ids_key = self.keys
        if not packed:
            raise BatchError(
                f"sequence parallelism (a group of {group_size(self.group)} ranks) splits packed rows only, but the "
                "micro-batch has padded rows; make it with iter_micro_batches(layout='packed')"
            )
        self.full_labels = self.labels()  # on the whole row: a rank's last label is the next rank's first token
        row = {key: fields[key] for key in (input_ids_key, position_ids_key, "cu_seq_lens", "max_length") if key in fields}
        row["labels"] = self.full_labels
        self.shard = sequence_shard(int(self.ids.shape[1]), group_size(self.group), group_rank(self.group))
        local = split_packed(row, self.shard, input_ids_key=input_ids_key, position_ids_key=position_ids_key)
        self.local_labels = local["labels"]
        self.inputs = packed_model_inputs(local, input_ids_key=input_ids_key, position_ids_key=position_ids_key)

    def loss_positions(self, loss_mask_key: str) -> torch.Tensor:
        """``[rows, T]`` bool in the model's columns: the hidden rows whose next token is in the loss mask (NOTE [ Response-only head ]).

        Raises:
            BatchError: no 2-D ``loss_mask_key`` tensor with the batch's rows, or one wider than the sequence.
        """
        mask = self.fields.get(loss_mask_key)
        rows, width = self.ids.shape
        if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise BatchError(
                f"only_loss_tokens needs a 2-D tensor field {loss_mask_key!r} (the loss mask), but got {shape}; "
                f"fields: {sorted(self.fields)}; pass loss_mask_key or only_loss_tokens=False"
            )
        if mask.shape[0] != rows or mask.shape[1] > width:
            raise BatchError(
                f"{loss_mask_key} must be [{rows}, R] with R <= {width} (response-width, right-aligned with the sequence, "
                f"or per token), but got shape {tuple(mask.shape)}"
            )
        wanted = torch.nn.functional.pad(mask != 0, (width - mask.shape[1], 0))  # at the sequence's columns
        if self.shifts is not None:
            wanted = _roll_left(wanted, self.shifts)
        predicts = torch.nn.functional.pad(wanted[:, 1:], (0, 1))  # column c predicts the token of c + 1
        if self.shard is not None:
            predicts &= self.full_labels != IGNORE_INDEX
            return split_packed({self.keys[0]: self.ids, "predicts": predicts}, self.shard)["predicts"]
        return predicts & (self.labels() != IGNORE_INDEX)

    def labels(self) -> torch.Tensor:
        """Next-token labels of the columns the model runs (``IGNORE_INDEX`` where none): this rank's under sequence parallelism."""
        if self.shard is not None:
            return self.local_labels
        input_ids_key, attention_mask_key, position_ids_key = self.keys
        if self.shifts is None:
            return next_token_labels(
                self.fields,
                input_ids_key=input_ids_key,
                attention_mask_key=attention_mask_key,
                position_ids_key=position_ids_key,
            )
        valid = _roll_left(self.fields[attention_mask_key] != 0, self.shifts)
        return next_token_labels({"input_ids": self.ids, "attention_mask": valid})

    def restore(self, out: torch.Tensor) -> torch.Tensor:
        """``out[:, c]`` (about the token after column ``c``) moved to column ``c + 1``, back at the batch's columns.

        Under sequence parallelism ``out`` holds this rank's columns; every rank's are gathered first.
        """
        if self.shard is not None:
            out = gather_packed(out, self.shard, self.group)
        shifted = torch.nn.functional.pad(out[:, :-1], (0, 0, 1, 0) if out.ndim == 3 else (1, 0))
        if self.shifts is not None:
            shifted = _roll_back(shifted, self.shifts, self.fields[self.keys[1]] != 0)
        return shifted


def check_head(name: str, head: Any) -> str | FrameworkHead:
    """``head`` checked: a name of :data:`HEADS` or a :class:`~batchfit.train.framework_heads.FrameworkHead`.

    Raises:
        InvalidArgument: anything else, naming ``name``, the value and the choices.
    """
    if isinstance(head, FrameworkHead):
        return head
    return check_choice(name, head, HEADS)


def model_logprobs(
    model: torch.nn.Module,
    batch: Any,
    *,
    head: str | FrameworkHead = "fused",
    chunk_size: int | str | None = "auto",
    temperature: float = 1.0,
    return_entropy: bool = False,
    only_loss_tokens: bool = False,
    loss_mask_key: str = "loss_mask",
    input_ids_key: str = "input_ids",
    attention_mask_key: str = "attention_mask",
    position_ids_key: str = "position_ids",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probs of a micro-batch under ``model``, through the model's own forward.

    Runs ``model(input_ids=..., use_cache=False, ...)`` — with the attention mask or the
    packed ``position_ids`` (and ``cu_seq_lens``) when the rows need them (NOTE [ Padded rows
    run without a mask ]) — so DDP and FSDP2 wrappers run as in any forward (NOTE [ Fused
    log-probs through the wrapper ]). Works under ``torch.no_grad()`` (old and reference
    log-probs) and with autograd (the policy loss). A token budget's probe runs this very
    function on a micro-batch of its shape (:mod:`batchfit.budget.causal_lm_probe`).

    Args:
        model: a transformers causal LM, bare, ``DistributedDataParallel`` or ``fully_shard``-ed.
        batch: one micro-batch: a :class:`~batchfit.batches.MicroBatch` from
            :func:`~batchfit.batches.iter_micro_batches` (its row layout is known on the host:
            no device sync) or its ``.batch`` mapping (read from the attention mask), padded
            rows or one packed row.
        head: how the output head makes log-probs, one of :data:`HEADS`: ``"fused"``
            (default; :func:`batchfit.logprobs.logprobs_from_hidden` inside the head, never
            ``[rows, T, V]`` logits), ``"chunked"`` (the model's logits, then
            :func:`batchfit.logprobs.logprobs_from_logits` chunk by chunk) or ``"full"``
            (``log_softmax`` of the fp32 logits, as plain PyTorch code does); ``"verl"``,
            ``"skyrl"`` or a :class:`~batchfit.train.framework_heads.FrameworkHead`: what that
            framework runs on the model's logits (its entropy per its config; ``temperature``
            and ``chunk_size`` are the head's own); ``"trl"``: TRL's own fused kernel with its
            chunk (NOTE [ TRL's head ] in :mod:`batchfit.train.trl_head`; needs TRL).
        chunk_size: tokens per chunk of the fused or chunked head; ``"auto"`` (default) is the
            micro-batch's longest sequence, at most 1024 (NOTE [ Head chunks no longer than a
            sequence ]); an int or ``None`` as :func:`batchfit.logprobs.logprobs_from_hidden`.
        temperature: as :func:`batchfit.logprobs.logprobs_from_hidden`.
        return_entropy: also return the entropy of the distribution each token was drawn from.
        only_loss_tokens: run the output head only for the tokens in the batch's loss mask
            (NOTE [ Response-only head ]): same values and gradients there, 0 elsewhere;
            the head's memory and time scale with the loss tokens. Default ``False``: every
            token, as before.
        loss_mask_key: the loss mask's field (response-width and right-aligned, or per token
            in a packed row); read only with ``only_loss_tokens``.
        input_ids_key, attention_mask_key, position_ids_key: the field names.

    Returns:
        ``[rows, T]`` fp32 log-probs, column ``c`` the log-prob of the token in column ``c``
        (NOTE [ Token-aligned log-probs ]), 0 where it has no previous token (and, with
        ``only_loss_tokens``, where the loss mask is 0); or
        ``(logprobs, entropy)``, aligned the same way (a framework head's entropy is
        ``None`` when its pass computes none).

    Raises:
        BatchError: a missing or misshapen field (the loss mask with ``only_loss_tokens``).
        InvalidArgument: an unknown ``head`` or ``chunk_size``; ``model`` has no linear output
            head, or transforms its logits; ``only_loss_tokens`` with a fake loss mask whose values
            were not kept (a float mask on the estimate backend).

    Example:
        >>> from batchfit.models import build_causal_lm
        >>> model = build_causal_lm("tiny")
        >>> batch = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]])}
        >>> model_logprobs(model, batch).shape
        torch.Size([1, 3])
    """
    head = check_head("head", head)
    run = _TokenAligned(model, batch, (input_ids_key, attention_mask_key, position_ids_key))
    if head == "trl":
        if only_loss_tokens:
            raise InvalidArgument(
                "head='trl' scores every position, as TRL's fused head does without Triton (NOTE [ TRL's head ]), "
                "but got only_loss_tokens=True; drop only_loss_tokens (response_only) or pick head='fused'"
            )
        with trl_output_head(model, run.labels, temperature=temperature, return_entropy=return_entropy):
            out = run.restore(model(**run.inputs).logits)
        return (out[..., 0], out[..., 1]) if return_entropy else out
    if only_loss_tokens:
        return _loss_token_logprobs(model, run, head, chunk_size, temperature, return_entropy, loss_mask_key)
    framework = as_framework_head(head)
    if framework is not None:
        _output_head(model)  # logits straight from a linear head, as the frameworks read them
        logp, entropy = framework_logprobs(framework, model(**run.inputs).logits, run.labels())
        logp = run.restore(logp)
        if return_entropy:
            return logp, None if entropy is None else run.restore(entropy)
        return logp
    chunk = _chunk_size(chunk_size, run.fields, input_ids_key)
    if head == "fused":
        with fused_output_head(
            model, run.labels, chunk_size=chunk, temperature=temperature, return_entropy=return_entropy
        ):
            out = run.restore(model(**run.inputs).logits)
    else:
        _output_head(model)  # the same refusals as the fused head: logits straight from a linear head
        logits = model(**run.inputs).logits
        out = run.restore(_from_logits(logits, run.labels(), head, chunk, temperature, return_entropy))
    if return_entropy:
        return out[..., 0], out[..., 1]
    return out


def _loss_token_logprobs(
    model: torch.nn.Module,
    run: _TokenAligned,
    head: str | FrameworkHead,
    chunk_size: int | str | None,
    temperature: float,
    return_entropy: bool,
    loss_mask_key: str,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`model_logprobs` with the head run only on the loss tokens' rows (NOTE [ Response-only head ])."""
    chunk = _chunk_size(chunk_size, run.fields, run.keys[0])
    if head == "fused":
        with fused_output_head(
            model,
            run.labels,
            chunk_size=chunk,
            temperature=temperature,
            return_entropy=return_entropy,
            positions=lambda: run.loss_positions(loss_mask_key),
        ):
            out = run.restore(model(**run.inputs).logits)
        return (out[..., 0], out[..., 1]) if return_entropy else out
    labels = run.labels()
    index = position_index(run.loss_positions(loss_mask_key), tuple(labels.shape))
    picked = labels.reshape(-1).index_select(0, index)[None]  # [1, K]
    with _gathered_output_head(model, index):
        logits = model(**run.inputs).logits  # [1, K, V]

    def back(values: torch.Tensor) -> torch.Tensor:  # [1, K, ...] -> [rows, T, ...] at the batch's columns
        return run.restore(scatter_tokens(values[0], index, labels.numel()).view(*labels.shape, *values.shape[2:]))

    framework = as_framework_head(head)
    if framework is not None:
        logp, entropy = framework_logprobs(framework, logits, picked)
        if return_entropy:
            return back(logp), None if entropy is None else back(entropy)
        return back(logp)
    out = back(_from_logits(logits, picked, head, chunk, temperature, return_entropy))
    return (out[..., 0], out[..., 1]) if return_entropy else out


def _chunk_size(chunk_size: int | str | None, fields: Mapping[str, Any], input_ids_key: str) -> int | None:
    if isinstance(chunk_size, str):
        if chunk_size != "auto":
            raise InvalidArgument(
                f"chunk_size must be 'auto', a positive integer or None, but got chunk_size={chunk_size!r}"
            )
        return auto_chunk_size(fields, input_ids_key)
    return chunk_size


def _from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    head: str,
    chunk_size: int | None,
    temperature: float,
    return_entropy: bool,
) -> torch.Tensor:
    """``[rows, T]`` (or ``[rows, T, 2]`` with entropy) fp32 from the model's logits, chunked or in full."""
    if head == "chunked":
        out = logprobs_from_logits(
            logits, labels, chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy
        )
        return torch.stack(out, dim=-1) if return_entropy else out
    check_temperature(temperature)
    logp_all = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)
    ignored = labels == IGNORE_INDEX
    logp = logp_all.gather(-1, labels.masked_fill(ignored, 0)[..., None])[..., 0].masked_fill(ignored, 0.0)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.stack((logp, entropy), dim=-1)


def model_values(
    model: torch.nn.Module,
    batch: Any,
    *,
    input_ids_key: str = "input_ids",
    attention_mask_key: str = "attention_mask",
    position_ids_key: str = "position_ids",
) -> torch.Tensor:
    """Token-aligned values of a micro-batch under a value-head ``model`` (a critic), through its own forward.

    The value model's output of column ``c - 1`` (the state before token ``c`` is drawn)
    goes to column ``c``, like :func:`model_logprobs`; 0 where a token has no previous token
    in its sequence. The rows run as :func:`model_logprobs` runs them.

    Args:
        model: a value-head model (one output per token, e.g. ``build_causal_lm(value_head=True)``
            or any transformers token classifier with ``num_labels=1``), bare, DDP or FSDP2.
        batch: as :func:`model_logprobs`.
        input_ids_key, attention_mask_key, position_ids_key: the field names.

    Returns:
        ``[rows, T]`` fp32 values.

    Raises:
        BatchError: a missing or misshapen field.
        InvalidArgument: ``model`` does not output one value per token.
    """
    run = _TokenAligned(model, batch, (input_ids_key, attention_mask_key, position_ids_key))
    out = model(**run.inputs).logits
    if out.ndim != 3 or out.shape[-1] != 1:
        raise InvalidArgument(
            f"model_values needs a value-head model with one output per token, but {type(unwrap(model)).__name__} returned shape {tuple(out.shape)}; build it with build_causal_lm(..., value_head=True)"
        )
    continues = run.labels() != IGNORE_INDEX  # column c + 1 continues c's sequence
    values = torch.where(continues, out[..., 0].float(), 0.0)
    return run.restore(values)


def span_starts(mask: Any) -> np.ndarray | None:
    """Per row, its first valid column, when every row's valid tokens are one contiguous span.

    ``None``: no 2-D mask, or a row with holes (NOTE [ Padded rows run without a mask ]: such
    rows keep their mask). Reads the mask (one device sync); on the estimate backend, the
    values an integer mask kept (NOTE [ Integer tensors keep their values ]); a fake mask
    without them gives ``None``.

    Example:
        >>> span_starts(torch.tensor([[0, 1, 1], [1, 1, 0]])).tolist()
        [1, 0]
    """
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2 or mask.shape[0] == 0:
        return None
    if is_fake(mask):
        real = shadow_of(mask)
        if real is None:
            return None
        with no_dispatch():  # a real tensor, read outside the fake mode
            valid = real.detach().cpu().numpy() != 0
    else:
        valid = mask.detach().cpu().numpy() != 0
    count = valid.sum(1)
    first = np.where(count > 0, valid.argmax(1), 0)
    cols = np.arange(valid.shape[1])
    span = (cols >= first[:, None]) & (cols < (first + count)[:, None])
    return first.astype(np.int64) if bool((span == valid).all()) else None


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
