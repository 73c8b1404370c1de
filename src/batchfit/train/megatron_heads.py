"""The log-prob and entropy heads the RL frameworks run on the last Megatron stage's ``[b, s, V/t]`` logits.

:class:`MegatronHead` names a framework's head and its options; :func:`head_outputs` runs it on
the logits ``GPTModel`` returns without labels, as the framework's Megatron worker does, and
gives the per-token log-probs (and the entropy where the head computes one).
:func:`head_loss` is the per-token loss a training step backpropagates. The default head,
``"megatron"``, is Megatron's own: ``GPTModel`` given ``labels`` runs its vocab-parallel
cross-entropy (:mod:`batchfit.train.megatron_step`), and nothing here runs.

NOTE [ Framework heads under Megatron ]
Every framework builds its model as Megatron-LM's ``get_model`` does, in
``megatron.core.transformer.module.Float16Module`` when it trains in bf16 (verl 0.9.1
``utils/megatron_utils.py`` l. 240, mbridge 0.15.1 ``core/util.py`` l. 156, slime through
Megatron-LM's ``get_model``, SkyRL through Megatron-Bridge's ``provide_distributed_model``), whose
forward casts the last stage's output to fp32 (``float16_to_fp32``, ``module.py`` l. 495): the
head starts from an fp32 copy of the ``[b, s, V/t]`` logits, 4 B a logit, and the bf16 logits
are freed (the output layer saves its input, not its output). Then, per framework:

- ``verl`` (verl 0.9.1, ``workers/engine/megatron/transformer_impl.py``
  ``_lm_head_logits_processor``): with entropy, ``logits.clone()`` and
  ``vocab_parallel_entropy(logits)`` (or ``vocab_parallel_entropy_with_chunking(logits,
  chunk_size=entropy_from_logits_chunk_size)`` under ``entropy_from_logits_with_chunking``), then
  ``vocab_parallel_log_probs_from_logits(clone, label)``, Megatron's vocab-parallel cross-entropy
  negated (``utils/megatron/tensor_parallel.py``). verl's own functions run here, loaded from the
  installed file (:func:`verl_tensor_parallel`). Entropy is computed in the old-log-prob pass
  always (``ray_trainer._compute_old_log_prob``: ``calculate_entropy=True``), never for the
  reference, and in the update when ``actor.calculate_entropy`` or ``entropy_coeff != 0``, with
  its graph (``workers/utils/losses.py`` subtracts ``entropy_coeff × entropy`` whenever it exists).
- ``skyrl`` (SkyRL ``a9564572``, ``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py``,
  called by ``workers/megatron/megatron_model_wrapper.py``): log-probs by
  ``from_parallel_logits_to_logprobs``: ``ChunkedDistributedLogprob`` over sequence chunks of
  ``logprobs_chunk_size`` (1024; SkyRL #1610) when that splits the sequence, else
  ``DistributedLogprob`` (an fp32 copy, its log-softmax and its softmax saved), ``inference_only``
  in the forward pass; in the update an entropy follows, always (a metric), with its graph only
  under ``use_entropy_loss`` (``torch.set_grad_enabled``), by SkyRL's ``vocab_parallel_entropy``
  in sequence chunks (``vocab_entropy_chunk_size``: 0 sizes them to ``vocab_entropy_chunk_memory_mb``,
  512 MiB at 4 × the logits' bytes a token). The forward pass computes no entropy. SkyRL is not
  installed here: the functions below (``_skyrl_*``) are SkyRL's, as SkyRL writes them.
  ``fused_lm_head_logprob``: NOTE [ SkyRL's fused LM head ] below.
- ``slime`` (slime ``624b824a``, ``slime/backends/megatron_utils/loss.py``
  ``get_log_probs_and_entropy`` and ``slime/utils/ppo_utils.py`` ``calculate_log_probs_and_entropy``):
  the logits as one ``[T, V/t]`` row (slime packs a micro-batch into one row; our rows are
  flattened, a view), in chunks of ``log_probs_chunk_size`` tokens (``-1``: none, the default),
  each through ``_VocabParallelLogProbEntropy``: log-probs and entropy from one softmax, computed
  in place in one ``[T, V/t]`` fp32 buffer. Entropy in the update always (``policy_loss_function``:
  ``with_entropy=True``), with its graph only when ``entropy_coef != 0``; in the forward pass under
  ``use_rollout_entropy``. slime is not installed either: the ``_slime_*`` functions below are its own.

NOTE [ SkyRL's fused LM head ]
Under ``trainer.fused_lm_head_logprob`` (SkyRL a9564572, ``megatron_model_wrapper.py``
``_fused_lm_head_output_processor``) ``GPTModel`` skips its output layer: the last stage returns the
``[b, s, h]`` hidden states (gathered over the tensor-parallel group under sequence parallelism, as
the layer would), which ``Float16Module`` casts to fp32, and the output layer's weight is kept
beside them. ``FusedLinearChunkedDistributedLogprob`` then computes each ``logprobs_chunk_size``
chunk's ``[b, c, V/t]`` logits from them, its log-softmax and target, and saves only the hidden
states and the weight; its backward recomputes each chunk and accumulates ``grad_hidden`` and an
fp32 ``grad_weight`` (``[V/t, h]``). No ``[b, s, V/t]`` tensor exists. The update's entropy is a
metric without graph (SkyRL raises for ``use_entropy_loss``), by
``_fused_vocab_parallel_entropy_from_hidden`` in the same chunks; SkyRL takes it over the response
tokens, here over every token (the same chunk-sized peak once the response is longer than a
chunk). megatron-core 0.16.1 has no ``output_processor`` hook, so the probe replaces the output
layer's ``forward`` for the call (:mod:`batchfit.train.megatron_step`). The Triton backend
(``fused_lm_head_logprob_backend: triton``) is not modelled: it needs CUDA.

SkyRL's backwards (this one's and ``ChunkedDistributedLogprob``'s) select the targets that fall in
the rank's vocabulary shard (``masked_select``): one index and one gradient per such token, so a
rank's bytes depend on where the labels fall. A probe of a SkyRL head draws every token from the
first shard (:class:`batchfit.budget.megatron_probe.MegatronStep`): the simulated rank holds the
most, the others less.

Two kernels of a GPU run are modelled as it runs them, not as a CPU would: verl's and SkyRL's
entropy compile ``(softmax * logits).sum(-1)`` (``torch.compile``, one fused reduction, no
``[T, V/t]`` product) and slime's takes ``torch.einsum`` on CUDA for the same reason; here both are
``torch.einsum("...v,...v->...", ...)`` (:func:`fused_mul_reduce`), which torch computes as a
batched matrix product, without the product. The temperature (an in-place division) is left out.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_choice

#: The heads a Megatron step can run: Megatron's own cross-entropy, and each framework's.
MEGATRON_HEADS = ("megatron", "verl", "skyrl", "slime")

#: The weight of the entropy in the loss of a head whose entropy has a graph (its value changes no byte).
ENTROPY_COEFF = 1e-3


@dataclass(frozen=True)
class MegatronHead:
    """A framework's head on the last stage's logits (NOTE [ Framework heads under Megatron ]).

    Attributes:
        framework: one of :data:`MEGATRON_HEADS`; ``"megatron"`` is Megatron's own cross-entropy.
        entropy: the head computes the entropy (verl ``calculate_entropy``, SkyRL's update,
            slime's update and ``use_rollout_entropy``).
        entropy_grad: in a training step, the entropy keeps its graph (verl: whenever it is
            computed; SkyRL ``use_entropy_loss``; slime ``entropy_coef != 0``).
        chunk_size: tokens per chunk of the log-probs (SkyRL ``logprobs_chunk_size``, slime
            ``log_probs_chunk_size``) or of verl's entropy (``entropy_from_logits_chunk_size``
            under ``entropy_from_logits_with_chunking``); ``None``: not chunked.
        entropy_chunk_size: SkyRL's ``vocab_entropy_chunk_size`` (``0``: sized to
            ``entropy_chunk_memory_mb``; ``None``: not chunked).
        entropy_chunk_memory_mb: SkyRL's ``vocab_entropy_chunk_memory_mb``.
        fused: SkyRL's ``fused_lm_head_logprob``: the model returns the last stage's hidden
            states and the head folds the output layer into its ``chunk_size`` chunks (no
            ``[b, s, V/t]`` logits, NOTE [ SkyRL's fused LM head ]).

    Raises:
        InvalidArgument: an unknown framework, a chunk size below 1, an entropy option on
            ``"megatron"``, verl's entropy without its graph, ``fused`` on another head than
            SkyRL's or with the entropy's graph (SkyRL refuses ``use_entropy_loss`` there).
    """

    framework: str = "megatron"
    entropy: bool = False
    entropy_grad: bool = False
    chunk_size: int | None = None
    entropy_chunk_size: int | None = None
    entropy_chunk_memory_mb: int = 512
    fused: bool = False

    def __post_init__(self) -> None:
        check_choice("framework", self.framework, MEGATRON_HEADS)
        for name in ("chunk_size", "entropy_chunk_size"):
            value = getattr(self, name)
            low = 0 if name == "entropy_chunk_size" else 1
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise InvalidArgument(f"{name} must be an integer >= {low} or None, but got {name}={value!r}")
        if self.framework == "megatron" and (self.entropy or self.chunk_size is not None):
            raise InvalidArgument(
                f"head 'megatron' is Megatron's own cross-entropy (no entropy, no chunks), but got entropy={self.entropy!r}, "
                f"chunk_size={self.chunk_size!r}; pick a framework's head (one of {', '.join(MEGATRON_HEADS[1:])})"
            )
        if self.fused and self.framework != "skyrl":
            raise InvalidArgument(
                f"fused=True is SkyRL's fused_lm_head_logprob, but got framework={self.framework!r}; pass framework='skyrl'"
            )
        if self.fused and self.entropy_grad:
            raise InvalidArgument(
                "SkyRL's fused LM head computes its entropy as a metric without graph (megatron_model_wrapper.py raises "
                "NotImplementedError for use_entropy_loss), but got entropy_grad=True; pass entropy_grad=False"
            )
        if self.framework == "verl" and self.entropy and not self.entropy_grad:
            raise InvalidArgument(
                "verl differentiates its entropy whenever it computes one (losses.py subtracts entropy_coeff × entropy), "
                "but got entropy=True, entropy_grad=False; pass entropy_grad=True"
            )

    @classmethod
    def default(cls, framework: str, *, forward_only: bool = False) -> MegatronHead:
        """The framework's head under its default config, for the update or the forward pass of old log-probs.

        verl: entropy in the old-log-prob pass, none in the update (``entropy_coeff: 0``). SkyRL:
        chunks of 1024, an entropy without graph in the update, auto-sized chunks. slime: one
        chunk, an entropy without graph in the update, none in the forward pass.
        """
        check_choice("framework", framework, MEGATRON_HEADS)
        if framework == "verl":
            return cls("verl", entropy=forward_only, entropy_grad=forward_only)
        if framework == "skyrl":
            return cls("skyrl", entropy=not forward_only, chunk_size=1024, entropy_chunk_size=0)
        if framework == "slime":
            return cls("slime", entropy=not forward_only)
        return cls()

    @property
    def is_default(self) -> bool:
        """Megatron's own head: ``GPTModel`` given labels."""
        return self.framework == "megatron"

    def describe(self) -> dict[str, Any]:
        """The head as plain values (for a report); ``fused`` only when on."""
        return {
            "framework": self.framework,
            "entropy": self.entropy,
            "entropy_grad": self.entropy_grad,
            "chunk_size": self.chunk_size,
            "entropy_chunk_size": self.entropy_chunk_size,
            **({"fused": True} if self.fused else {}),
        }


def as_megatron_head(head: str | MegatronHead | None, *, forward_only: bool = False) -> MegatronHead:
    """``head`` as a :class:`MegatronHead`: a name takes the framework's defaults (:meth:`MegatronHead.default`).

    Raises:
        InvalidArgument: an unknown name, or something else than a name or a head.
    """
    if head is None:
        return MegatronHead()
    if isinstance(head, MegatronHead):
        return head
    if isinstance(head, str):
        return MegatronHead.default(head, forward_only=forward_only)
    raise InvalidArgument(
        f"head must be one of {', '.join(MEGATRON_HEADS)} or a MegatronHead, but got head of type {type(head).__name__}"
    )


@dataclass(frozen=True)
class MegatronHeads:
    """The head each pass of a framework's Megatron run computes (NOTE [ Framework heads under Megatron ]).

    What a framework's config selects, pass by pass (slime: ``--entropy-coef``,
    ``--use-rollout-entropy``, ``--log-probs-chunk-size``), carried to the probe as
    ``ProfileOptions(logprobs=MegatronHeads(...))`` under ``Sharding("megatron")``.

    Attributes:
        update: the policy's training step.
        old_log_probs: the policy's forward-only pass (``policy_forward``).
        reference: the reference model's forward-only pass.

    Raises:
        InvalidArgument: a field that is not a :class:`MegatronHead`.
    """

    update: MegatronHead
    old_log_probs: MegatronHead
    reference: MegatronHead

    def __post_init__(self) -> None:
        for name in ("update", "old_log_probs", "reference"):
            if not isinstance(getattr(self, name), MegatronHead):
                raise InvalidArgument(
                    f"MegatronHeads.{name} must be a MegatronHead, but got {type(getattr(self, name)).__name__}"
                )

    def for_role(self, role: str) -> MegatronHead:
        """The head of ``role``'s pass: the update for a trained role, the old log-probs' for ``policy_forward``
        (and a critic's passes, which compute no log-probs), the reference's for ``reference``."""
        if role == "reference":
            return self.reference
        return self.update if role in ("policy", "critic") else self.old_log_probs


def verl_tensor_parallel() -> ModuleType:
    """verl's ``verl/utils/megatron/tensor_parallel.py``, imported, or loaded from its file when ``import verl`` fails.

    ``verl/__init__.py`` imports ``ray``; the module itself needs only torch and megatron-core,
    so it is loaded by path from the installed package when ray is missing.

    Raises:
        InvalidArgument: verl is not installed.
    """
    return _verl_tensor_parallel()


@functools.cache
def _verl_tensor_parallel() -> ModuleType:
    try:
        from verl.utils.megatron import tensor_parallel

        return tensor_parallel
    except ImportError:
        pass
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgument("head 'verl' runs verl's own functions, but verl is not installed; pip install verl")
    path = f"{next(iter(spec.submodule_search_locations))}/utils/megatron/tensor_parallel.py"
    name = "batchfit._verl_megatron_tensor_parallel"
    loader = importlib.util.spec_from_file_location(name, path)
    if loader is None or loader.loader is None:
        raise InvalidArgument(f"head 'verl' runs verl's own functions, but {path} cannot be loaded; reinstall verl")
    module = importlib.util.module_from_spec(loader)
    sys.modules[name] = module
    loader.loader.exec_module(module)
    return module


def fused_mul_reduce(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(dim=-1, keepdim=True)`` without the product: what a GPU's compiled kernel holds (NOTE [ Framework heads under Megatron ])."""
    return torch.einsum("...v,...v->...", a, b).unsqueeze(-1)


@contextlib.contextmanager
def compiled_mul_reduce() -> Iterator[None]:
    """``torch.compile`` of a function named ``mul_reduce`` gives :func:`fused_mul_reduce` (verl's and SkyRL's entropy); others pass through."""
    original = torch.compile

    def compile(model: Any = None, **kwargs: Any) -> Any:
        def wrap(fn: Any) -> Any:
            return fused_mul_reduce if getattr(fn, "__name__", "") == "mul_reduce" else original(fn, **kwargs)

        return wrap if model is None else wrap(model)

    torch.compile = compile  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original


def _fp32(logits: torch.Tensor) -> torch.Tensor:
    """``Float16Module``'s ``float16_to_fp32`` on the last stage's output."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def head_outputs(head: MegatronHead, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The framework's log-probs ``[b, s]`` (fp32) and entropy (``None`` without) from ``[b, s, V/t]`` logits.

    Runs with the grad mode of the caller: under ``torch.no_grad()`` the forward pass of old
    log-probs (SkyRL's ``inference_only``), with grad a training step's head (the entropy's graph
    per :attr:`MegatronHead.entropy_grad`). Call it on every tensor-parallel rank at once.

    Raises:
        InvalidArgument: the default head (Megatron's own runs inside ``GPTModel``).
    """
    if head.is_default:
        raise InvalidArgument("head 'megatron' runs inside GPTModel (given labels); head_outputs runs a framework's head")
    logits = _fp32(logits)
    with compiled_mul_reduce():
        if head.framework == "verl":
            return _verl(head, logits, target)
        if head.framework == "skyrl":
            return _skyrl(head, logits, target)
        return _slime(head, logits, target)


def fused_head_outputs(
    head: MegatronHead, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SkyRL's fused head (:attr:`MegatronHead.fused`): log-probs ``[b, s]`` and the entropy metric from the last
    stage's ``[b, s, h]`` hidden states and the output layer's ``[V/t, h]`` weight (NOTE [ SkyRL's fused LM head ]).

    Raises:
        InvalidArgument: a head that is not fused.
    """
    if not head.fused:
        raise InvalidArgument(f"fused_head_outputs runs SkyRL's fused LM head, but got head {head.describe()}; use head_outputs")
    import torch.distributed as dist
    from megatron.core import parallel_state

    hidden = _fp32(hidden)  # Float16Module casts the last stage's output, the hidden states here too
    group = parallel_state.get_tensor_model_parallel_group()
    local = int(weight.shape[0])
    start = dist.get_rank(group) * local
    seq = int(hidden.shape[1])
    chunk = head.chunk_size if head.chunk_size is not None and head.chunk_size < seq else seq
    # from_parallel_hidden_to_logprobs (model_utils.py l. 713), on labels already shifted
    log_probs = _SkyrlFusedLinearChunkedDistributedLogprob.apply(
        hidden, weight, target, start, start + local, chunk, group, not torch.is_grad_enabled()
    ).contiguous()
    entropy = None
    if head.entropy:  # the update's metric: megatron_model_wrapper.py, torch.set_grad_enabled(use_entropy_loss=False)
        with torch.no_grad():
            entropy = _skyrl_fused_entropy_from_hidden(hidden, weight, group, chunk_size=head.chunk_size)
    return log_probs, entropy


def head_loss(
    head: MegatronHead, logits: torch.Tensor, target: torch.Tensor, *, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token loss ``[b, s]`` of a training step: ``-log_probs``, minus :data:`ENTROPY_COEFF` × entropy where it has a graph.

    A fused head (:attr:`MegatronHead.fused`) takes the hidden states as ``logits`` and the output layer's ``weight``.
    """
    if head.fused:
        if weight is None:
            raise InvalidArgument("a fused head needs the output layer's weight; pass weight=")
        log_probs, entropy = fused_head_outputs(head, logits, weight, target)
    else:
        log_probs, entropy = head_outputs(head, logits, target)
    loss = -log_probs
    if entropy is not None and entropy.requires_grad:
        loss = loss - ENTROPY_COEFF * entropy
    return loss


def _verl(head: MegatronHead, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    # verl 0.9.1 transformer_impl.py _lm_head_logits_processor, in its order
    tp = verl_tensor_parallel()
    entropy = None
    if head.entropy:
        logits_bak = logits.clone()
        if head.chunk_size is not None:
            entropy = tp.vocab_parallel_entropy_with_chunking(logits, chunk_size=head.chunk_size)
        else:
            entropy = tp.vocab_parallel_entropy(logits)
    else:
        logits_bak = logits
    return tp.vocab_parallel_log_probs_from_logits(logits_bak, target), entropy


def _vocab_range(logits: torch.Tensor) -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = int(logits.shape[-1])
    return rank * local, (rank + 1) * local, group


def _skyrl(head: MegatronHead, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    start, end, group = _vocab_range(logits)
    training = torch.is_grad_enabled()
    log_probs = _skyrl_from_parallel_logits_to_logprobs(
        logits, target, start, end, group, inference_only=not training, chunk_size=head.chunk_size
    )
    entropy = None
    if head.entropy:  # megatron_model_wrapper.py: with torch.set_grad_enabled(use_entropy_loss)
        with torch.set_grad_enabled(training and head.entropy_grad):
            entropy = _skyrl_vocab_parallel_entropy(
                logits, chunk_size=head.entropy_chunk_size, chunk_memory_mb=head.entropy_chunk_memory_mb
            )
    return log_probs, entropy


def _slime(head: MegatronHead, logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, _, group = _vocab_range(logits)
    rows, seq, local = logits.shape
    log_probs, entropy = _slime_calculate_log_probs_and_entropy(
        logits.reshape(rows * seq, local),  # slime's one packed row, squeezed: [T, V/t]
        target.reshape(rows * seq),
        group,
        with_entropy=head.entropy,
        chunk_size=-1 if head.chunk_size is None else head.chunk_size,
        with_entropy_grad=head.entropy_grad,
    )
    log_probs = log_probs.reshape(rows, seq)  # [T, 1] → [b, s]
    return log_probs, None if entropy is None else entropy.reshape(rows, seq)

# --- SkyRL's functions --------------------------------------------------------------------------
# NOTE [ SkyRL's and slime's functions, copied ]
# Neither SkyRL nor slime is installed here (their packages pull in ray, vLLM and their workers),
# so the functions their Megatron workers call are copied below, statement for statement, from
# SkyRL a9564572eb8e91076be43c1bd5e4615e3de17265 (2026-08-21),
# ``skyrl/backends/skyrl_train/distributed/megatron/model_utils.py`` (Apache-2.0, ported there from
# NeMo-Aligner by way of NeMo-RL) and slime 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21),
# ``slime/utils/ppo_utils.py`` (Apache-2.0). Departures: SkyRL's ``from_parallel_logits_to_logprobs``
# takes the labels (already the next tokens) instead of rolling the input ids, and has no context
# parallelism; slime's head takes no top-p keep mask; both entropy reductions run as a GPU runs
# them (NOTE [ Framework heads under Megatron ]).


@torch.no_grad()
def _skyrl_distributed_log_softmax(vocab_parallel_logits: torch.Tensor, group: Any) -> torch.Tensor:
    """SkyRL's ``_compute_distributed_log_softmax`` (model_utils.py l. 29)."""
    import torch.distributed as dist

    logits_max = torch.amax(vocab_parallel_logits, dim=-1, keepdim=True)
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    vocab_parallel_logits = vocab_parallel_logits - logits_max
    sum_exp_logits = vocab_parallel_logits.exp().sum(-1, keepdim=True).float()
    dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
    return vocab_parallel_logits - sum_exp_logits.log_().to(vocab_parallel_logits.dtype)


class _SkyrlDistributedLogprob(torch.autograd.Function):
    """SkyRL's ``DistributedLogprob`` (model_utils.py l. 66)."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
                vocab_end_index: int, group: Any, inference_only: bool = False) -> torch.Tensor:  # fmt: skip
        import torch.distributed as dist

        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        vocab_parallel_logits = vocab_parallel_logits.to(dtype=torch.float32)
        log_probs = _skyrl_distributed_log_softmax(vocab_parallel_logits, group=group)
        softmax_output = log_probs.exp()
        log_probs = torch.gather(log_probs, -1, masked_target.unsqueeze(-1)).squeeze(-1)
        log_probs[target_mask] = 0.0
        dist.all_reduce(log_probs, op=dist.ReduceOp.SUM, group=group)
        if not inference_only:
            ctx.save_for_backward(softmax_output, target_mask, masked_target)
        return log_probs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grad_output = grad_outputs[0]
        softmax, target_mask, masked_target = ctx.saved_tensors
        if softmax.ndim == 3:
            B, S, V = softmax.shape
            row = torch.arange(B, device=softmax.device).view(-1, 1).expand(-1, S).reshape(-1)
            col = torch.arange(S, device=softmax.device).expand(B, -1).reshape(-1)
            flat_idx = (row * S + col) * V
            flat_chosen = flat_idx.masked_select(~target_mask.reshape(-1)) + masked_target.masked_select(~target_mask)
            grad_input = softmax.neg()
            grad_input = grad_input.mul_(grad_output.unsqueeze(-1))
            grad_output_selected = grad_output.masked_select(~target_mask)
            grad_input.view(-1).scatter_add_(0, flat_chosen, grad_output_selected)
        else:
            V = softmax.size(-1)
            is_chosen = (~target_mask).unsqueeze(-1) * torch.nn.functional.one_hot(masked_target, num_classes=V)
            grad_input = is_chosen.float().sub_(softmax)
            grad_input.mul_(grad_output.unsqueeze(-1))
        return grad_input, None, None, None, None, None, None


class _SkyrlChunkedDistributedLogprob(torch.autograd.Function):
    """SkyRL's ``ChunkedDistributedLogprob`` (model_utils.py l. 141): the fp32 cast and softmax per sequence chunk."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
                vocab_end_index: int, chunk_size: int, tp_group: Any, inference_only: bool = False) -> torch.Tensor:  # fmt: skip
        import torch.distributed as dist

        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_log_probs = []
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            logits = vocab_parallel_logits[:, chunk_start:chunk_end, :]
            logits = logits.to(dtype=torch.float32)
            log_probs = _skyrl_distributed_log_softmax(logits, group=tp_group)
            log_probs = torch.gather(log_probs, -1, masked_target[:, chunk_start:chunk_end].unsqueeze(-1)).squeeze(-1)
            log_probs[target_mask[:, chunk_start:chunk_end]] = 0.0
            dist.all_reduce(log_probs, op=dist.ReduceOp.SUM, group=tp_group)
            all_log_probs.append(log_probs)
        log_probs = torch.cat(all_log_probs, dim=1)
        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, target_mask, masked_target)
            ctx.chunk_size = chunk_size
            ctx.tp_group = tp_group
        return log_probs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        grad_output = grad_outputs[0]
        vocab_parallel_logits, target_mask, masked_target = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        tp_group = ctx.tp_group
        partition_vocab_size = int(vocab_parallel_logits.shape[-1])
        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        batch_size = int(vocab_parallel_logits.shape[0])
        grad_input = torch.empty(
            (batch_size, seq_size, partition_vocab_size), dtype=torch.float32, device=vocab_parallel_logits.device
        )
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            chunk_len = chunk_end - chunk_start
            logits = vocab_parallel_logits[:, chunk_start:chunk_end, :]
            logits = logits.to(dtype=torch.float32)
            softmax_output = _skyrl_distributed_log_softmax(logits, group=tp_group)
            softmax_output = softmax_output.exp()
            chunk_target_mask = target_mask[:, chunk_start:chunk_end]
            chunk_masked_target = masked_target[:, chunk_start:chunk_end]
            chunk_grad_output = grad_output[:, chunk_start:chunk_end]
            row = torch.arange(batch_size, device=softmax_output.device).view(-1, 1).expand(-1, chunk_len).reshape(-1)
            col = torch.arange(chunk_len, device=softmax_output.device).expand(batch_size, -1).reshape(-1)
            flat_idx = (row * chunk_len + col) * partition_vocab_size
            valid_mask = ~chunk_target_mask
            flat_chosen = flat_idx.masked_select(valid_mask.reshape(-1)) + chunk_masked_target.masked_select(valid_mask)
            chunk_grad_input = softmax_output.neg_()
            chunk_grad_input.mul_(chunk_grad_output.unsqueeze(-1))
            grad_output_selected = chunk_grad_output.masked_select(valid_mask)
            chunk_grad_input.view(-1).scatter_add_(0, flat_chosen, grad_output_selected)
            grad_input[:, chunk_start:chunk_end, :] = chunk_grad_input
        return grad_input, None, None, None, None, None, None


def _skyrl_from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: Any,
    inference_only: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """SkyRL's ``from_parallel_logits_to_logprobs`` (model_utils.py l. 487) on shifted labels, without context parallelism."""
    # SkyRL: chunking only when it splits the sequence (one chunk would save the logits and
    # recompute the softmax in backward, ~3x the peak of DistributedLogprob's ~2x)
    seq_len_local = vocab_parallel_logits.shape[1]
    if chunk_size is not None and chunk_size < seq_len_local:
        logprobs = _SkyrlChunkedDistributedLogprob.apply(
            vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group, inference_only
        ).contiguous()
    else:
        logprobs = _SkyrlDistributedLogprob.apply(
            vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group, inference_only
        ).contiguous()
    return logprobs


class _SkyrlFusedLinearChunkedDistributedLogprob(torch.autograd.Function):
    """SkyRL's ``FusedLinearChunkedDistributedLogprob`` (model_utils.py l. 275): the output layer folded into the chunks."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab_start_index: int,
                vocab_end_index: int, chunk_size: int, tp_group: Any, inference_only: bool = False) -> torch.Tensor:  # fmt: skip
        import torch.distributed as dist

        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        seq_size = int(hidden.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_log_probs = []
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            logits = torch.matmul(hidden[:, chunk_start:chunk_end, :].to(weight.dtype), weight.t()).to(dtype=torch.float32)
            log_probs = _skyrl_distributed_log_softmax(logits, group=tp_group)
            log_probs = torch.gather(log_probs, -1, masked_target[:, chunk_start:chunk_end].unsqueeze(-1)).squeeze(-1)
            log_probs[target_mask[:, chunk_start:chunk_end]] = 0.0
            all_log_probs.append(log_probs)
        log_probs = torch.cat(all_log_probs, dim=1)
        dist.all_reduce(log_probs, op=dist.ReduceOp.SUM, group=tp_group)
        if not inference_only:
            ctx.save_for_backward(hidden, weight, target_mask, masked_target)
            ctx.chunk_size = chunk_size
            ctx.tp_group = tp_group
        return log_probs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_output = grad_outputs[0]
        hidden, weight, target_mask, masked_target = ctx.saved_tensors
        chunk_size, tp_group = ctx.chunk_size, ctx.tp_group
        partition_vocab_size, hidden_size = int(weight.shape[0]), int(weight.shape[1])
        batch_size, seq_size = int(hidden.shape[0]), int(hidden.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros((partition_vocab_size, hidden_size), dtype=torch.float32, device=weight.device)
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            chunk_len = chunk_end - chunk_start
            h_chunk = hidden[:, chunk_start:chunk_end, :]
            logits = torch.matmul(h_chunk.to(weight.dtype), weight.t()).to(dtype=torch.float32)
            softmax_output = _skyrl_distributed_log_softmax(logits, group=tp_group).exp_()
            chunk_target_mask = target_mask[:, chunk_start:chunk_end]
            chunk_masked_target = masked_target[:, chunk_start:chunk_end]
            chunk_grad_output = grad_output[:, chunk_start:chunk_end]
            row = torch.arange(batch_size, device=softmax_output.device).view(-1, 1).expand(-1, chunk_len).reshape(-1)
            col = torch.arange(chunk_len, device=softmax_output.device).expand(batch_size, -1).reshape(-1)
            flat_idx = (row * chunk_len + col) * partition_vocab_size
            valid_mask = ~chunk_target_mask
            flat_chosen = flat_idx.masked_select(valid_mask.reshape(-1)) + chunk_masked_target.masked_select(valid_mask)
            grad_logits = softmax_output.neg_()
            grad_logits.mul_(chunk_grad_output.unsqueeze(-1))
            grad_output_selected = chunk_grad_output.masked_select(valid_mask)
            grad_logits.view(-1).scatter_add_(0, flat_chosen, grad_output_selected)
            grad_logits = grad_logits.to(dtype=weight.dtype)
            grad_hidden[:, chunk_start:chunk_end, :] = torch.matmul(grad_logits, weight)
            grad_logits_2d = grad_logits.reshape(-1, partition_vocab_size)
            h_2d = h_chunk.reshape(-1, hidden_size)
            grad_weight.add_(torch.matmul(grad_logits_2d.t(), h_2d.to(dtype=grad_logits.dtype)).to(torch.float32))
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def _skyrl_fused_entropy_from_hidden(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, tp_group: Any, chunk_size: int | None = None
) -> torch.Tensor:
    """SkyRL's ``_fused_vocab_parallel_entropy_from_hidden`` (model_utils.py l. 1090), at temperature 1, over every token."""
    import torch.distributed as dist

    rows, seq = int(hidden.shape[0]), int(hidden.shape[1])
    out = torch.empty((rows, seq), dtype=torch.float32, device=hidden.device)
    eff = chunk_size if (chunk_size is not None and chunk_size < seq) else seq
    for c0 in range(0, seq, eff):
        c1 = min(seq, c0 + eff)
        logits = torch.matmul(hidden[:, c0:c1, :].to(lm_head_weight.dtype), lm_head_weight.t()).to(torch.float32)
        logits_max = logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        exp = (logits - logits_max).exp_()
        sum_exp = exp.sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_exp, group=tp_group)
        softmax = exp / sum_exp
        sum_softmax_times_logits = (softmax * logits).sum(dim=-1, keepdim=True)
        dist.all_reduce(sum_softmax_times_logits, group=tp_group)
        out[:, c0:c1] = (logits_max + sum_exp.log() - sum_softmax_times_logits).squeeze(-1)
    return out


class _SkyrlVocabParallelEntropy(torch.autograd.Function):
    """SkyRL's ``_VocabParallelEntropy`` (model_utils.py l. 1316; verl's forward, a backward that leaves the logits alone)."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        @torch.compile(dynamic=True)
        def mul_reduce(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return (a * b).sum(dim=-1, keepdim=True)

        logits_max = vocab_parallel_logits.max(dim=-1, keepdim=True).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
        normalized_vocab_parallel_logits = vocab_parallel_logits - logits_max
        normalized_exp_logits = normalized_vocab_parallel_logits.exp_()
        normalized_sum_exp_logits = normalized_exp_logits.sum(dim=-1, keepdim=True)
        dist.all_reduce(normalized_sum_exp_logits, group=mpu.get_tensor_model_parallel_group())
        softmax_logits = normalized_exp_logits.div_(normalized_sum_exp_logits)
        sum_softmax_times_logits = mul_reduce(softmax_logits, vocab_parallel_logits)
        dist.all_reduce(sum_softmax_times_logits, group=mpu.get_tensor_model_parallel_group())
        entropy = logits_max + normalized_sum_exp_logits.log() - sum_softmax_times_logits
        ctx.save_for_backward(vocab_parallel_logits, softmax_logits, sum_softmax_times_logits)
        return entropy.squeeze(dim=-1)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        vocab_parallel_logits, softmax_logits, sum_softmax_times_logits = ctx.saved_tensors
        softmax_logits.mul_(sum_softmax_times_logits - vocab_parallel_logits)
        softmax_logits.mul_(grad_output.unsqueeze(dim=-1))
        return softmax_logits


def _skyrl_resolve_vocab_entropy_chunk_size(
    vocab_parallel_logits: torch.Tensor, chunk_size: int | None, chunk_memory_mb: int, peak_factor: int = 4
) -> int | None:
    """SkyRL's ``_resolve_vocab_entropy_chunk_size`` (model_utils.py l. 1352)."""
    if chunk_size is None:
        return None
    seq_len = int(vocab_parallel_logits.shape[-2])
    if seq_len <= 0:
        return None
    if chunk_size > 0:
        return chunk_size if chunk_size < seq_len else None
    budget_bytes = int(chunk_memory_mb) * 1024 * 1024
    leading_elements = 1
    for n in vocab_parallel_logits.shape[:-2]:
        leading_elements *= int(n)
    bytes_per_token = (
        leading_elements * int(vocab_parallel_logits.shape[-1]) * vocab_parallel_logits.element_size() * peak_factor
    )
    if bytes_per_token <= 0:
        return None
    auto_chunk = max(1, min(seq_len, budget_bytes // bytes_per_token))
    auto_chunk = 1 << (auto_chunk.bit_length() - 1)  # _floor_power_of_two
    return auto_chunk if auto_chunk < seq_len else None


def _skyrl_vocab_parallel_entropy(
    vocab_parallel_logits: torch.Tensor, chunk_size: int | None = None, chunk_memory_mb: int = 512
) -> torch.Tensor:
    """SkyRL's ``vocab_parallel_entropy`` (model_utils.py l. 1388): per sequence chunk."""
    resolved_chunk_size = _skyrl_resolve_vocab_entropy_chunk_size(vocab_parallel_logits, chunk_size, chunk_memory_mb)
    if resolved_chunk_size is None:
        return _SkyrlVocabParallelEntropy.apply(vocab_parallel_logits)
    entropy_chunks = []
    seq_len = int(vocab_parallel_logits.shape[-2])
    for start in range(0, seq_len, resolved_chunk_size):
        end = min(start + resolved_chunk_size, seq_len)
        entropy_chunks.append(_SkyrlVocabParallelEntropy.apply(vocab_parallel_logits[..., start:end, :]))
    return torch.cat(entropy_chunks, dim=-1)


# --- slime's functions (NOTE [ SkyRL's and slime's functions, copied ]) ----------------------------


def _slime_all_reduce(tensor: torch.Tensor, op: Any, process_group: Any) -> None:
    """slime's ``_maybe_all_reduce`` (ppo_utils.py l. 174)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=op, group=process_group)


class _SlimeVocabParallelLogProbEntropy(torch.autograd.Function):
    """slime's ``_VocabParallelLogProbEntropy`` (ppo_utils.py l. 187), without the top-p keep mask."""

    @staticmethod
    def forward(ctx: Any, vocab_parallel_logits: torch.Tensor, target: torch.Tensor, process_group: Any,
                with_entropy: bool, with_entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        import torch.distributed as dist

        with_entropy_grad = with_entropy and with_entropy_grad
        vocab_parallel_logits = vocab_parallel_logits.float()
        seq_len, vocab_parallel_size = vocab_parallel_logits.shape
        rank = dist.get_rank(group=process_group) if dist.is_initialized() else 0  # _get_vocab_parallel_rank_size
        vocab_start_index = rank * vocab_parallel_size
        vocab_end_index = vocab_start_index + vocab_parallel_size
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target_1d = (target - vocab_start_index).clone()
        masked_target_1d[target_mask] = 0
        arange_1d = torch.arange(seq_len, device=vocab_parallel_logits.device)

        def vocab_parallel_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            logits_max = logits.max(dim=-1, keepdim=True).values
            _slime_all_reduce(logits_max, dist.ReduceOp.MAX, process_group)
            normalized_logits = logits - logits_max
            predicted_logits = normalized_logits.view(-1, vocab_parallel_size)[arange_1d, masked_target_1d]
            exp_logits = normalized_logits.exp_()
            sum_exp_logits = exp_logits.sum(dim=-1, keepdim=True)
            _slime_all_reduce(sum_exp_logits, dist.ReduceOp.SUM, process_group)
            softmax = exp_logits.div_(sum_exp_logits)
            return predicted_logits, sum_exp_logits, softmax, logits_max

        entropy = vocab_parallel_logits.new_zeros((0,))
        entropy_softmax = vocab_parallel_logits.new_empty((0,))
        sum_softmax_times_logits = vocab_parallel_logits.new_empty((0,))
        predicted_logits, log_prob_sum_exp_logits, log_prob_softmax, log_prob_logits_max = vocab_parallel_softmax(
            vocab_parallel_logits
        )
        if with_entropy:
            entropy_softmax = log_prob_softmax
            # slime's CUDA branch: torch.einsum("ij,ij->i", softmax, logits), no product buffer
            sum_softmax_times_logits = torch.einsum("ij,ij->i", entropy_softmax, vocab_parallel_logits).unsqueeze(-1)
            _slime_all_reduce(sum_softmax_times_logits, dist.ReduceOp.SUM, process_group)
            entropy = log_prob_logits_max + log_prob_sum_exp_logits.log() - sum_softmax_times_logits
            entropy = entropy.squeeze(dim=-1)
        predicted_logits = predicted_logits.masked_fill_(target_mask, 0.0).unsqueeze(-1)
        _slime_all_reduce(predicted_logits, dist.ReduceOp.SUM, process_group)
        log_prob = predicted_logits - log_prob_sum_exp_logits.log()
        if not with_entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.with_entropy_grad = with_entropy_grad
        saved_entropy_softmax = entropy_softmax if with_entropy_grad else vocab_parallel_logits.new_empty((0,))
        saved_sum_softmax_times_logits = (
            sum_softmax_times_logits if with_entropy_grad else vocab_parallel_logits.new_empty((0,))
        )
        saved_logits = vocab_parallel_logits if with_entropy_grad else vocab_parallel_logits.new_empty((0,))
        ctx.save_for_backward(
            log_prob_softmax, target_mask, masked_target_1d, saved_entropy_softmax, saved_sum_softmax_times_logits, saved_logits
        )
        return log_prob, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_prob: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
        (log_prob_softmax, target_mask, masked_target_1d, entropy_softmax, sum_softmax_times_logits,
         vocab_parallel_logits) = ctx.saved_tensors  # fmt: skip
        if grad_log_prob is None:
            raise RuntimeError("_VocabParallelLogProbEntropy expected a materialized grad_log_prob")
        grad_entropy_input = None
        if ctx.with_entropy_grad and grad_entropy is not None and grad_entropy.numel() > 0:
            grad_entropy_input = sum_softmax_times_logits - vocab_parallel_logits
            grad_entropy_input.mul_(entropy_softmax)
            grad_entropy_input.mul_(grad_entropy.reshape(-1, 1))
        vocab_parallel_size = log_prob_softmax.size(-1)
        grad_input = log_prob_softmax.neg_()
        grad_2d = grad_input.view(-1, vocab_parallel_size)
        arange_1d = torch.arange(grad_2d.size(0), device=grad_2d.device)
        target_update = (~target_mask).to(dtype=grad_2d.dtype)
        grad_2d[arange_1d, masked_target_1d] += target_update
        grad_input.mul_(grad_log_prob.reshape(-1, 1))
        if grad_entropy_input is not None:
            grad_input.add_(grad_entropy_input)
        return grad_input, None, None, None, None


def _slime_calculate_log_probs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    tp_group: Any,
    with_entropy: bool = False,
    chunk_size: int = -1,
    with_entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """slime's ``calculate_log_probs_and_entropy`` (ppo_utils.py l. 718) with ``_calculate_log_probs_and_entropy_chunk``."""

    def one_chunk(logits_chunk: torch.Tensor, tokens_chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_prob, entropy = _SlimeVocabParallelLogProbEntropy.apply(
            logits_chunk, tokens_chunk, tp_group, with_entropy, with_entropy_grad
        )
        return log_prob, entropy if with_entropy else None

    logits = logits.contiguous()
    entropy = None
    if chunk_size > 0:
        num_chunks = (logits.size(0) - 1) // chunk_size + 1
        log_probs, entropy_chunks = [], []
        for tokens_chunk, logits_chunk in zip(tokens.chunk(num_chunks, dim=0), logits.chunk(num_chunks, dim=0), strict=True):
            log_prob, entropy_chunk = one_chunk(logits_chunk, tokens_chunk)
            log_probs.append(log_prob)
            if entropy_chunk is not None:
                entropy_chunks.append(entropy_chunk)
        log_prob = torch.cat(log_probs, dim=0)
        if entropy_chunks:
            entropy = torch.cat(entropy_chunks, dim=0)
    else:
        log_prob, entropy = one_chunk(logits, tokens)
    return log_prob, entropy


__all__ = [
    "ENTROPY_COEFF",
    "MEGATRON_HEADS",
    "MegatronHead",
    "MegatronHeads",
    "as_megatron_head",
    "compiled_mul_reduce",
    "fused_head_outputs",
    "fused_mul_reduce",
    "head_loss",
    "head_outputs",
    "verl_tensor_parallel",
]
