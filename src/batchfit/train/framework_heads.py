"""The output head a framework runs per micro-batch: its log-probs and entropy from the model's logits.

NOTE [ The framework's head, not ours ]
A token budget holds only if its probe runs the head the framework runs, and the head
dominates the budget at long context (the logits are ``tokens × V``). verl 0.9.1
(``verl/workers/engine/fsdp/transformer_impl.py``, ``prepare_model_outputs``) and SkyRL 0.4.0
(``skyrl/backends/skyrl_train/workers/model_wrapper.py``, ``forward``) both:

- take the model's logits in the dtype the model computes them (bf16 under FSDP mixed
  precision), never an fp32 copy of them;
- scale them by the sampling temperature: verl out of place when it is not 1, SkyRL in place;
- compute log-probs with flash-attention's cross-entropy kernel (NOTE [ A fused kernel's
  memory is its outputs ] in :mod:`batchfit.logprobs.kernel_ce`), its backward in place —
  verl only when it computes no entropy from the same logits, SkyRL always;
- compute entropy over the vocabulary, each in its own way. verl: in the trained pass when
  ``actor.calculate_entropy`` or ``entropy_coeff != 0``, and always in the old-log-prob pass
  (``ray_trainer._compute_old_log_prob``), ``entropy_from_logits`` in the logits' dtype
  (``full``), in fp32 row chunks (``entropy_from_logits_with_chunking``: ``chunked``) or
  under activation checkpointing (``entropy_checkpointing``: ``checkpointed``). SkyRL: in
  the trained pass only (``worker.py``, ``compute_entropy=True``), ``chunked_entropy_from_logits``
  in chunks of ``logprobs_chunk_size`` tokens along the sequence, in the logits' dtype, with
  gradients only under ``use_entropy_loss``.

:func:`framework_logprobs` runs the same operations in the same order. An entropy computed
with gradients but not in the loss (verl's ``calculate_entropy`` with ``entropy_coeff: 0``)
keeps its graph, and so its saved tensors, while the framework holds it: through the
backward. What is not reproduced: verl compiles its entropy function
(``use_torch_compile``), which fuses the ``[n, V]`` temporaries away, so the eager entropy
measured here is an upper bound; without flash-attn both frameworks fall back to a
row-by-row ``log_softmax`` loop (``logprobs_from_logits_v2``), which is not modelled.

NOTE [ Heads stay in train ]
Every other fact about verl and SkyRL lives in :mod:`batchfit.frameworks`, but their heads stay
here. A head is torch code run inside the budget's probe, and the budget selects it by name
(``ProfileOptions(logprobs="verl")``, ``causal_lm_step(logprobs="skyrl")``, :data:`batchfit.train.HEADS`):
``budget`` and ``train`` sit below ``frameworks`` and may not import it, and a registry filled
from above would leave ``logprobs="verl"`` unknown to a caller that never imported
:mod:`batchfit.frameworks`. So this module holds :class:`FrameworkHead`, each framework's head
as one :class:`_HeadKind` (its defaults and what it does differently, no branch on its name),
and the lookup by name (:func:`as_framework_head`); a framework's module in
:mod:`batchfit.frameworks` declares the head it runs by that name
(:attr:`FrameworkSpec.head <batchfit.frameworks.registry.FrameworkSpec.head>`), and
:mod:`batchfit.frameworks.run_step` fills in the fields its config sets. A new framework with a
head of its own adds one entry to :data:`_KINDS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.logprobs import IGNORE_INDEX
from batchfit.logprobs.kernel_ce import kernel_logprobs
from batchfit.validation import check_choice

__all__ = ["ENTROPY_MODES", "FRAMEWORK_HEADS", "FrameworkHead", "as_framework_head", "framework_logprobs"]

#: How a pass computes entropy over the vocabulary.
ENTROPY_MODES = ("none", "full", "chunked", "checkpointed")


@dataclass(frozen=True)
class _HeadKind:
    """What one framework's head does (NOTE [ Heads stay in train ]).

    Attributes:
        defaults: the :class:`FrameworkHead` fields of the framework's default config.
        temperature_in_place: the logits are divided by the temperature in place (SkyRL),
            else out of place and only when it is not 1 (verl).
        backward_always_in_place: the cross-entropy's backward always writes over the logits
            (SkyRL), else only when no entropy reads them (verl).
        entropy: ``(mode, logits, chunk) → entropy`` for a pass that computes one.
    """

    defaults: dict[str, Any]
    temperature_in_place: bool
    backward_always_in_place: bool
    entropy: Callable[[str, torch.Tensor, int], torch.Tensor] = field(compare=False)


@dataclass(frozen=True)
class FrameworkHead:
    """The log-prob and entropy head of a framework's micro-batch (NOTE [ The framework's head, not ours ]).

    Attributes:
        framework: ``"verl"`` or ``"skyrl"`` (:data:`FRAMEWORK_HEADS`).
        entropy: how the trained pass computes entropy, one of :data:`ENTROPY_MODES`
            (SkyRL: always ``chunked``).
        entropy_grad: the trained pass's entropy keeps its graph (verl: whenever it is
            computed; SkyRL: ``use_entropy_loss``).
        entropy_in_loss: the entropy is a term of the loss (verl ``entropy_coeff != 0``,
            SkyRL ``use_entropy_loss``); otherwise it is a metric.
        entropy_chunk_size: rows (verl) or tokens (SkyRL) per entropy chunk.
        forward_entropy: how the forward-only log-prob pass computes entropy (verl's old
            log-probs: as the trained pass, ``full`` when that computes none).
        temperature: the sampling temperature the logits are divided by.

    Raises:
        InvalidArgument: an unknown framework or entropy mode, a chunk size below 1.
    """

    framework: str
    entropy: str = "none"
    entropy_grad: bool = True
    entropy_in_loss: bool = False
    entropy_chunk_size: int = 2048
    forward_entropy: str = "none"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_choice("framework", self.framework, FRAMEWORK_HEADS)
        check_choice("entropy", self.entropy, ENTROPY_MODES)
        check_choice("forward_entropy", self.forward_entropy, ENTROPY_MODES)
        if (
            isinstance(self.entropy_chunk_size, bool)
            or not isinstance(self.entropy_chunk_size, int)
            or self.entropy_chunk_size < 1
        ):
            raise InvalidArgument(
                f"entropy_chunk_size must be a positive integer, but got {self.entropy_chunk_size!r}"
            )
        if not self.temperature > 0:
            raise InvalidArgument(f"temperature must be > 0, but got {self.temperature!r}")

    @classmethod
    def default(cls, framework: str) -> FrameworkHead:
        """The framework's head under its default config (verl: no entropy in the update, entropy
        in the old-log-prob pass; SkyRL: chunked entropy without gradients, chunks of 1024)."""
        check_choice("framework", framework, FRAMEWORK_HEADS)
        return cls(framework, **_KINDS[framework].defaults)

    def describe(self) -> str:
        """One line: the framework and what its entropy does (for reports)."""
        if self.entropy == "none":
            trained = "no entropy in the update"
        else:
            use = (
                "in the loss"
                if self.entropy_in_loss
                else ("a metric with its graph" if self.entropy_grad else "a metric")
            )
            trained = f"{self.entropy} entropy {use}"
        forward = (
            "" if self.forward_entropy == "none" else f", {self.forward_entropy} entropy in the log-prob pass"
        )
        return f"{self.framework}'s head: bf16 logits, flash-attention cross-entropy, {trained}{forward}"

    def __str__(self) -> str:
        return self.framework

    def replace(self, **changes: Any) -> FrameworkHead:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


def as_framework_head(head: Any) -> FrameworkHead | None:
    """``head`` as a :class:`FrameworkHead` (``"verl"``/``"skyrl"`` are their defaults), else ``None``."""
    if isinstance(head, FrameworkHead):
        return head
    if isinstance(head, str) and head in FRAMEWORK_HEADS:
        return FrameworkHead.default(head)
    return None


def framework_logprobs(
    head: FrameworkHead, logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``labels`` (and the entropy, when this pass computes it) as ``head``'s framework does.

    The trained pass is the one run with gradients enabled; a pass under ``torch.no_grad()``
    computes ``head.forward_entropy``.

    Args:
        head: the framework's head.
        logits: ``[rows, T, V]`` as the model returned them.
        labels: ``[rows, T]`` next-token labels, ``IGNORE_INDEX`` where none.

    Returns:
        ``(logprobs, entropy)``: fp32 ``[rows, T]`` log-probs, and the ``[rows, T]`` entropy
        (fp32 for verl's chunked entropy, else the logits' dtype) or ``None``.
    """
    training = torch.is_grad_enabled()
    mode = head.entropy if training else head.forward_entropy
    kind = _KINDS[head.framework]
    if kind.temperature_in_place:
        logits.div_(head.temperature)
    elif head.temperature != 1.0:
        logits = logits / head.temperature
    entropy = None
    if mode != "none":
        with torch.enable_grad() if training and head.entropy_grad else torch.no_grad():
            entropy = kind.entropy(mode, logits, head.entropy_chunk_size)
    # verl writes the gradient over the logits only when no entropy reads them; SkyRL always
    inplace = kind.backward_always_in_place or entropy is None
    logprobs = kernel_logprobs(logits, labels, inplace_backward=inplace, ignore_index=IGNORE_INDEX)
    return logprobs, entropy


def _verl_entropy_of_mode(mode: str, logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """verl's entropy in ``mode`` (``full``, ``chunked``, ``checkpointed``)."""
    if mode == "chunked":
        return _verl_chunked_entropy(logits, chunk)
    if mode == "checkpointed" and torch.is_grad_enabled():
        # verl calls checkpoint() without use_reentrant: the reentrant implementation
        return torch.utils.checkpoint.checkpoint(_verl_entropy, logits, use_reentrant=True)
    return _verl_entropy(logits)


def _verl_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x) − Σ softmax(x)·x`` over the vocabulary, in the logits' dtype."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _verl_chunked_entropy(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`_verl_entropy` in fp32 over ``chunk`` rows of the flattened tokens at a time."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.zeros(flat.shape[0], device=logits.device)
    for start in range(0, flat.shape[0], chunk):
        block = flat[start : start + chunk].float()
        probs = torch.softmax(block, dim=-1)
        out[start : start + chunk] = torch.logsumexp(block, dim=-1) - (probs * block).sum(-1)
    return out.view(logits.shape[:-1])


def _skyrl_entropy_of_mode(mode: str, logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """SkyRL's entropy: always chunked along the sequence, whatever ``mode`` says."""
    del mode
    return _skyrl_chunked_entropy(logits, chunk)


def _skyrl_chunked_entropy(logits: torch.Tensor, chunk: int) -> torch.Tensor:
    """``−Σ p·log p`` from ``log_softmax``, ``chunk`` tokens of the sequence at a time, in the logits' dtype."""
    out = torch.zeros(logits.shape[:-1], dtype=logits.dtype, device=logits.device)
    for start in range(0, logits.shape[1], chunk):
        logp = torch.log_softmax(logits[:, start : start + chunk], dim=-1)
        out[:, start : start + chunk] = -(logp.exp() * logp).sum(-1)
    return out


# Each framework's head, by the name :class:`FrameworkHead` and the budget's options take
# (NOTE [ Heads stay in train ]); verl 0.9.1 and SkyRL 0.4.0, the code cited in the module's
# NOTE [ The framework's head, not ours ].
_KINDS: dict[str, _HeadKind] = {
    "verl": _HeadKind(
        defaults={"forward_entropy": "full"},
        temperature_in_place=False,
        backward_always_in_place=False,
        entropy=_verl_entropy_of_mode,
    ),
    "skyrl": _HeadKind(
        defaults={"entropy": "chunked", "entropy_grad": False, "entropy_chunk_size": 1024},
        temperature_in_place=True,
        backward_always_in_place=True,
        entropy=_skyrl_entropy_of_mode,
    ),
}
#: The frameworks whose head :class:`FrameworkHead` runs.
FRAMEWORK_HEADS = tuple(_KINDS)
