"""The token budget's probe: one micro-batch of the trainer's own step, on a synthetic RL micro-batch.

NOTE [ One micro-batch step ]
A token budget is only worth what its probe is worth, so the probe does not imitate a
trainer's micro-batch: it is one. :meth:`TrainingStep.micro_batch` lays out a synthetic
rollout of the sequence lengths asked for (the prompt | response layout of SkyRL and verl,
with the response-width fields a trainer's micro-batch carries: ``loss_mask``, ``weights``
from :func:`batchfit.batches.loss_weights`, ``advantages`` and ``old_log_probs`` for a
policy, ``returns`` and ``old_values`` for a critic), plans it into one micro-batch with
:func:`batchfit.plan.plan_micro_batches` and cuts it with
:func:`batchfit.batches.iter_micro_batches` (padded rows for ``cost="padded"``, one packed
row for ``cost="packed"``), on the host. A measured call then copies the micro-batch's
fields to the device and runs what a trainer runs for it, through the wrapped model:
:func:`batchfit.train.micro_batch_loss` (the log-prob head the run uses, the clipped
policy loss or the value loss), ``backward()`` and ``optimizer.step()``, with the rank's
gradients resident before and after (NOTE [ Gradients are resident between micro-batches ]
in :mod:`batchfit.train.optim`): the state of every micro-batch of an accumulation after
the first. A forward-only pass (old log-probs, values, a reference) runs
:func:`batchfit.train.micro_batch_outputs` under ``no_grad``, as
:func:`batchfit.train.forward_logprobs` does for each of its micro-batches.

Every response token is trained on (one prompt token per sequence), the upper bound of
the response-width fields. On the estimate backend a packed row's ``cu_seq_lens`` is read
from the host tensor (varlen attention reads its values, which fake tensors do not have)
while a fake copy holds its bytes.

Example:
    >>> from batchfit.memory import get_backend
    >>> from batchfit.models import build_causal_lm
    >>> backend = get_backend("cpu")
    >>> step = causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend)
    >>> step.measure([16, 16]).fits
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.batches.layout import CU_SEQ_LENS
from batchfit.batches.microbatch import MicroBatch, iter_micro_batches
from batchfit.batches.weights import loss_weights
from batchfit.budget.probe import response_tokens
from batchfit.errors import InvalidArgument, Phrase, Setting
from batchfit.memory import Backend, MemoryMeasurement, labels
from batchfit.memory.categories import (
    COMMUNICATION,
    GRADIENTS,
    LOGPROB_HEAD,
    OFFLOADED_ACTIVATIONS,
    OPTIMIZER_STATE,
    OPTIMIZER_STEP,
    PARAMETERS,
    plain_tensors,
)
from batchfit.models.attention import use_varlen_attention
from batchfit.models.build import resolve_backend
from batchfit.models.ulysses import use_ulysses_attention
from batchfit.parallel.distributed import is_distributed
from batchfit.parallel.sequence import sequence_parallel_group
from batchfit.parallel.shard import decoder_layers, sharding_of, unwrap
from batchfit.parallel.shard_state import shard_state, zero_state
from batchfit.parallel.sharding import Sharding
from batchfit.parallel.strategies import scale_out_strategy
from batchfit.parallel.zero import ZeroOptimizer
from batchfit.patching import undo_all
from batchfit.plan.packing import COSTS, plan_micro_batches
from batchfit.train.activation_offload import MIN_LAYERS as MIN_OFFLOAD_LAYERS
from batchfit.train.activation_offload import activation_offload as offloading_activations
from batchfit.train.micro_batch_step import micro_batch_loss, micro_batch_outputs
from batchfit.train.model_outputs import HEADS, check_head
from batchfit.train.optim import allocate_gradients, default_optimizer, initialize_optimizer_state
from batchfit.validation import check_choice, check_number, check_positive_int

OPTIMIZERS = ("adamw", "sgd")
#: How the policy's log-probs are computed (:data:`batchfit.train.HEADS`): ``full`` materialises
#: fp32 ``[rows, T, V]`` log-softmax, ``chunked`` uses :func:`batchfit.logprobs.logprobs_from_logits`,
#: ``fused`` :func:`batchfit.logprobs.logprobs_from_hidden` and never builds the logits.
LOGPROBS = HEADS
#: PPO's clip of the policy ratio and of the value, as the probe's losses run them.
CLIP_RATIO = 0.2
VALUE_CLIP = 0.2

# Categories that CPU offload keeps in host memory (FSDP2 CPUOffloadPolicy: sharded
# parameters, sharded gradients, optimizer state and the optimizer step run on the CPU).
HOST_CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, OPTIMIZER_STEP)


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What one micro-batch step runs besides its model, backend and optimizer: :func:`causal_lm_step`'s keywords, declared once.

    :func:`causal_lm_step` takes these fields as keywords, checks them and gives the
    :class:`TrainingStep` them resolved (``critic`` and ``vocab_size`` read from the model);
    the step reads them as its own attributes (``step.critic``, ``step.cost``, …).

    Attributes:
        critic: value loss; ``None`` (default): ``True`` iff the model is a token classifier with
            one label (``build_causal_lm(value_head=True)``).
        vocab_size: token ids are drawn below this; ``None`` (default): ``model.config.vocab_size``.
        logprobs: the policy's log-prob head, one of :data:`LOGPROBS` (default ``"full"``, as
            :class:`~batchfit.budget.ProfileOptions`: what SkyRL and verl run by default).
        cost: ``"padded"`` or ``"packed"``: the micro-batch layout the trainer's plans use; a
            packed one runs with varlen attention (:func:`batchfit.models.use_varlen_attention`,
            what a trainer of packed rows sets).
        forward_only: a forward-only step: ``no_grad`` log-probs (or values), no backward and
            no optimizer step. With an ``optimizer`` its state is created and registered all
            the same: the old-log-prob or value pass of a model being trained runs with that
            state resident; pass ``optimizer=None`` for a frozen reference.
        only_loss_tokens: the policy's head runs only on the loss tokens
            (:func:`batchfit.train.model_logprobs`'s ``only_loss_tokens``; NOTE [ Response-only
            head ]); ignored for a critic. The micro-batch's loss mask is then an integer
            tensor, whose values the estimate backend keeps.
        response_fraction: each probed sequence's share of response (loss) tokens, in
            ``(0, 1]`` (:func:`~batchfit.budget.probe.response_tokens`); ``None``: every token but
            the first, the most a sequence can have.
        activation_offload: offload what each decoder layer saves for backward to host memory
            as verl's ``enable_activation_offload`` does (NOTE [ Activation offload as verl runs
            it ] in :mod:`batchfit.train.activation_offload`; with checkpointing on, the layers'
            checkpointed inputs); the host copies are counted in ``host_bytes``, not in the
            device peak. A forward-only step saves nothing and ignores it.
    """

    critic: bool | None = None
    vocab_size: int | None = None
    logprobs: str = "full"
    cost: str = "padded"
    forward_only: bool = False
    only_loss_tokens: bool = False
    response_fraction: float | None = None
    activation_offload: bool = False


_SETTINGS = frozenset(f.name for f in dataclasses.fields(StepSettings))


class TrainingStep:
    """One micro-batch of a trainer's step on a synthetic RL micro-batch: ``step.measure(lengths)``.

    See NOTE [ One micro-batch step ]. ``lengths`` are the micro-batch's sequence lengths
    (``[s] * b`` for ``b`` rows of ``s`` tokens); every call plans them into one micro-batch
    of cost ``len × longest`` (padded) or ``sum`` (packed).

    The step labels what it runs for the tracked backends (NOTE [ Phases and regions ]):
    the phases ``forward``, ``backward`` and ``optimizer``, positions in the layer stack,
    and the regions ``logprob_head`` (from the head's input to the loss, and back to the
    head's input gradient) and ``optimizer_step`` (the optimizer's temporaries).

    Attributes:
        model: the module trained (an ``FSDPModule`` or DDP wrapper when sharded).
        optimizer: the optimizer (state already initialised) or ``None``.
        backend: the :class:`~batchfit.memory.Backend` the step was built for.
        settings: its :class:`StepSettings`, resolved (``critic`` and ``vocab_size`` set,
            ``activation_offload`` off for a forward-only step); each field reads as an
            attribute of the step too: ``critic``, ``vocab_size``, ``logprobs``, ``cost``,
            ``forward_only``, ``only_loss_tokens``, ``response_fraction``, ``activation_offload``.
        persistent: ``(model, optimizer, *communication buffers)``, to register with
            ``backend.measure``; ``categories`` gives each one's breakdown category.
        categories: one entry per ``persistent`` object (``None`` = default categories).
        host_categories: categories held in host memory (CPU offload), see
            :meth:`batchfit.memory.Backend.measure`.
        sharding: the model's :class:`~batchfit.parallel.Sharding`.
    """

    def __init__(
        self, model: torch.nn.Module, *, backend: Backend, optimizer: torch.optim.Optimizer | None, settings: StepSettings
    ):
        self.model = model
        self.settings = dataclasses.replace(  # no_grad saves nothing to offload
            settings, activation_offload=settings.activation_offload and not settings.forward_only
        )
        self._offloaded: Any = None
        self.backend = backend
        self.optimizer = optimizer
        recorded = shard_state(model)  # how batchfit.parallel.shard_model sharded it, if it did
        self.sharding: Sharding = recorded.sharding if recorded is not None else Sharding()
        comm = recorded.comm_buffers if recorded is not None else ()
        state: tuple[Any, ...] = (model,) if optimizer is None else (model, optimizer)
        zero = zero_state(model)  # ZeRO's master partition and gradient buffer (batchfit.parallel.zero)
        extra = () if zero is None or optimizer is None else zero.state_buffers()
        self.persistent: tuple[Any, ...] = (*state, *comm, *(t for t, _ in extra))
        self.categories: tuple[str | None, ...] = (
            (None,) * len(state) + (COMMUNICATION,) * len(comm) + tuple(c for _, c in extra)
        )
        self.host_categories: tuple[str, ...] = HOST_CATEGORIES if self.sharding.offload == "cpu" else ()
        if self.activation_offload:
            self.host_categories += (OFFLOADED_ACTIVATIONS,)
        self._head = _head_module(unwrap(model))
        self._layers = _layer_stack(unwrap(model))

    def __getattr__(self, name: str) -> Any:
        """A field of :attr:`settings` read as the step's own attribute (``step.critic``, ``step.cost``, …)."""
        settings = self.__dict__.get("settings")
        if settings is not None and name in _SETTINGS:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def remedies(self) -> list[str | Phrase]:
        """What would make a longer sequence fit, leaving out what this step already does.

        Each names its settings by keyword (NOTE [ Messages in the caller's vocabulary ] in
        :mod:`batchfit.errors`): the CLI writes them as its flags.
        """
        model = unwrap(self.model)
        # transformers 5.x renamed is_gradient_checkpointing (now deprecated) to is_activation_checkpointing
        name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else "is_gradient_checkpointing"
        out: list[str | Phrase] = [Phrase("reduce ", Setting("max_seq_len"))]
        if not self.forward_only and not getattr(model, name, False):  # no_grad keeps no activations to drop
            out.append(Phrase("enable gradient checkpointing (", Setting("gradient_checkpointing", True), ")"))
        # verl offloads nothing below MIN_LAYERS layers (NOTE [ Activation offload as verl runs it ])
        deep = len(getattr(self, "_layers", ())) >= MIN_OFFLOAD_LAYERS
        if deep and not self.forward_only and not getattr(self, "activation_offload", False):
            out.append(
                Phrase("offload each layer's saved activations to the host (", Setting("activation_offload", True), ")")
            )
        if self.logprobs in ("full", "chunked") and not self.critic:
            out.append(Phrase("compute log-probs fused from the hidden states (", Setting("logprobs", "fused"), ")"))
        if not self.only_loss_tokens and not self.critic:
            out.append(Phrase("run the head only on the loss tokens (", Setting("response_only", True), ")"))
        sharding = self.sharding
        if not sharding.spec.scale_out:
            more = {"strategy": scale_out_strategy().name, "world_size": None}
            out.append(Phrase("shard the model over more ranks (", Setting("sharding", more), ")"))
        elif sharding.offload != "cpu":
            state = {"strategy": sharding.strategy, "world_size": sharding.world_size, "offload": "cpu"}
            out.append(Phrase("offload the sharded state to the CPU (", Setting("sharding", state), ")"))
        out.append(Phrase("give more memory (", Setting("memory_limit"), ", ", Setting("safety_margin"), ")"))
        return out

    def micro_batch(self, lengths: Sequence[int]) -> MicroBatch:
        """The micro-batch of sequences of ``lengths`` tokens, laid out on the host as a trainer's plan cuts it.

        Raises:
            InvalidArgument: no lengths, or a length that is not a positive integer.
        """
        lengths = _check_lengths(lengths)
        rollout = synthetic_rollout(
            lengths,
            vocab_size=self.vocab_size,
            critic=self.critic,
            response_fraction=self.response_fraction,
            mask_dtype=torch.long if self.only_loss_tokens else torch.float32,
        )
        cost = len(lengths) * max(lengths) if self.cost == "padded" else sum(lengths)
        plan = plan_micro_batches(lengths, token_budget=cost, cost=self.cost)
        (mb,) = iter_micro_batches(rollout, plan, 0, layout="packed" if self.cost == "packed" else "padded")
        return mb

    def measure(self, lengths: Sequence[int]) -> MemoryMeasurement:
        """Measure one call ``self(lengths)`` on :attr:`backend`, state registered.

        Returns:
            The backend's :class:`~batchfit.memory.MemoryMeasurement` (``fits=False`` when
            it ran out of the backend's memory).
        """
        mb = self.micro_batch(lengths)
        # NOTE [ One rank runs out ] (batchfit.budget.guard): a sharded step on real ranks is never
        # stopped by a tracker on one rank only; it runs to the end, its peak judged after
        sharded = self.sharding.distributed and is_distributed()
        with self.backend.running_to_the_end() if sharded else contextlib.nullcontext():
            measured = self.backend.measure(
                lambda: self.run(mb),
                register=self.persistent,
                categories=self.categories,
                host_categories=self.host_categories,
            )
        offloaded, self._offloaded = self._offloaded, None
        if offloaded is not None and self.backend.reads_device:
            # the device's allocator never sees the host copies: the most they held (NOTE [ Activation
            # offload as verl runs it ]); the tracked backends count them at the device's peak
            measured = dataclasses.replace(measured, host_bytes=measured.host_bytes + offloaded.host_peak_bytes)
        return measured

    def measure_state(self) -> MemoryMeasurement:
        """Measure the state the step keeps between its calls (parameters, gradients, optimizer state), running nothing.

        The registered state is live all along, so its categories are the same as at any
        step's peak; :func:`~batchfit.budget.model_profile.resident_state_bytes` reads them
        without paying for a step.
        """
        return self.backend.measure(
            lambda: None, register=self.persistent, categories=self.categories, host_categories=self.host_categories
        )

    def __call__(self, lengths: Sequence[int]) -> None:
        """Run the step once on a micro-batch of sequences of ``lengths`` tokens (unmeasured)."""
        self.run(self.micro_batch(lengths))

    @property
    def loss_options(self) -> dict[str, Any]:
        """What the step passes :func:`batchfit.train.micro_batch_loss` besides the model and the micro-batch."""
        return {"critic": self.critic, "head": self.logprobs, "only_loss_tokens": self.only_loss_tokens}

    def run(self, mb: MicroBatch) -> None:
        """Copy ``mb``'s fields to the device and run the trainer's step on it (NOTE [ One micro-batch step ])."""
        options = self.loss_options
        if self.only_loss_tokens:
            _check_values_kept(mb, self.backend)
        # NOTE [ A step leaves no hooks ]
        with self.backend.context(), _quiet_fsdp_views(), _position_hooks(self._layers):
            mb, _held = on_device(mb, self.backend)
            if self.forward_only:
                with torch.no_grad(), labels.phase(labels.FORWARD), _head_region(self._head):
                    labels.set_position(labels.EMBED)
                    micro_batch_outputs(self.model, mb, **options)
                return
            with offloading_activations(self.model) if self.activation_offload else contextlib.nullcontext() as off:
                self._offloaded = off
                with labels.phase(labels.FORWARD), _head_region(self._head):
                    labels.set_position(labels.EMBED)
                    loss = micro_batch_loss(self.model, mb, clip_ratio=CLIP_RATIO, value_clip=VALUE_CLIP, **options)
                with labels.phase(labels.BACKWARD), labels.region(LOGPROB_HEAD):
                    # the head's input-gradient hook ends the region (see _head_region); the
                    # layers' gradient hooks move the position down the stack
                    labels.set_position(labels.HEAD)
                    loss.backward()
                del loss
            with labels.phase(labels.OPTIMIZER), labels.region(OPTIMIZER_STEP):
                if self.optimizer is not None:
                    self.optimizer.step()
                # NOTE [ Gradients are resident between micro-batches ]
                self.model.zero_grad(set_to_none=False)


def check_response_fraction(fraction: Any, name: str = "response_fraction") -> float | None:
    """``None``, or a share of response tokens in ``(0, 1]`` as a float.

    Raises:
        InvalidArgument: anything else, naming ``name``.
    """
    if fraction is None:
        return None
    return check_number(name, fraction, low=0.0, high=1.0, low_open=True)


def synthetic_rollout(
    lengths: Sequence[int],
    *,
    vocab_size: int,
    critic: bool = False,
    seed: int = 0,
    response_fraction: float | None = None,
    mask_dtype: torch.dtype = torch.float32,
    response_lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A rollout batch of one sequence per length in the prompt | response layout, on the host.

    Each sequence of ``L`` tokens is a prompt and :func:`~batchfit.budget.probe.response_tokens` ``(L,
    response_fraction)`` response tokens (one prompt token when ``response_fraction`` is
    ``None``): prompts left-padded to the longest prompt, responses right-padded to the
    longest response (``[n, W]`` ``input_ids`` and ``attention_mask``); the response-width
    fields are ``[n, R]`` (at least one column): ``loss_mask`` (1 on every response token,
    of ``mask_dtype``), ``weights`` (token mean), and ``advantages`` and ``old_log_probs``
    for a policy, ``returns`` and ``old_values`` for a critic. Random tokens from a seeded
    generator. ``response_lengths`` (each in ``[0, L − 1]``) sets each sequence's response
    tokens instead of ``response_fraction``.
    """
    n = len(lengths)
    lens = torch.as_tensor(list(lengths))
    if response_lengths is None:
        response_lengths = [response_tokens(length, response_fraction) for length in lengths]
    responses = torch.as_tensor(list(response_lengths))
    prompts = lens - responses
    prompt_width, response = int(prompts.max()), max(int(responses.max()), 1)
    width = prompt_width + int(responses.max())
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, width), generator=generator)
    columns = torch.arange(width)
    start = prompt_width - prompts  # left-padded prompts: each sequence starts here
    attention_mask = ((columns[None, :] >= start[:, None]) & (columns[None, :] < (prompt_width + responses)[:, None])).long()
    loss_mask = (torch.arange(response)[None, :] < responses[:, None]).to(mask_dtype)
    batch: dict[str, Any] = {
        "input_ids": ids * attention_mask,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "weights": loss_weights(loss_mask, reduction="token_mean"),
    }
    noise = torch.randn((2, n, response), generator=generator) * loss_mask
    if critic:
        batch.update(returns=noise[0], old_values=noise[1])
    else:
        batch.update(advantages=noise[0], old_log_probs=-noise[1].abs())
    return batch


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence) or not lengths:
        raise InvalidArgument(
            f"lengths must be a non-empty sequence of sequence lengths, but got lengths={lengths!r}; pass e.g. [4096, 4096]"
        )
    return [check_positive_int(f"lengths[{i}]", n) for i, n in enumerate(lengths)]


def on_device(mb: MicroBatch, backend: Backend) -> tuple[MicroBatch, list[torch.Tensor]]:
    """``mb`` with its tensors copied to ``backend.device`` (inside the measured call: the trainer's micro-batch bytes).

    Returns the micro-batch and the copies to hold alive beside it: on the estimate backend a
    packed row's ``cu_seq_lens`` stays the host tensor in the micro-batch (varlen attention
    reads its values, which fake tensors do not have) while its fake copy holds its bytes.
    """
    fake = backend.simulated
    fields: dict[str, Any] = {}
    held: list[torch.Tensor] = []
    for key, value in mb.batch.items():
        if not isinstance(value, torch.Tensor):
            fields[key] = value
            continue
        copy = value.to(backend.device, copy=True)
        if fake and key == CU_SEQ_LENS:
            fields[key] = value
            held.append(copy)
        else:
            fields[key] = copy
    return dataclasses.replace(mb, batch=fields), held


def _check_values_kept(mb: MicroBatch, backend: Backend) -> None:
    """The estimate backend must keep the token ids' values for a response-only head to gather by them.

    Raises:
        InvalidArgument: the micro-batch's ``input_ids`` are larger than the values the
            backend's fake mode keeps (:data:`batchfit.memory.shadow_values.SHADOW_LIMIT_BYTES`).
    """
    limit = backend.kept_values_bytes
    ids = mb.batch.get("input_ids")
    if limit is None or not isinstance(ids, torch.Tensor):
        return
    if ids.numel() * ids.element_size() > limit:
        raise InvalidArgument(
            f"a response-only head gathers the rows its loss mask names, and the estimate backend keeps token values "
            f"up to {limit // ids.element_size():,} tokens per micro-batch, but this probe holds {ids.numel():,} "
            "(the budget is larger still); profile with less memory, a larger model, or the cpu backend"
        )


@contextlib.contextmanager
def _quiet_fsdp_views() -> Iterator[None]:
    """FSDP2 warns when a wrapped module returns a view (log-probs, values); the step never writes to one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        yield


def _head_module(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output head: the LM head (``get_output_embeddings``) or a value head (``score``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        head = getattr(model, "score", None) or getattr(model, "classifier", None)
    return head if isinstance(head, torch.nn.Module) else None


def _end_region_on_grad(hidden: torch.Tensor) -> None:
    """In backward, end the head region once the gradient of the head's input exists."""
    if hidden.requires_grad:

        def end(grad: torch.Tensor) -> None:
            labels.set_region(None)

        hidden.register_hook(end)


@contextlib.contextmanager
def _head_region(head: torch.nn.Module | None) -> Iterator[None]:
    """Label what the head and the loss create as ``logprob_head`` (forward and backward).

    Forward: from the head's input (a forward pre-hook) to the end of the block. Backward:
    the caller sets the region when ``backward()`` starts; a hook on the head's input ends
    it when that input's gradient exists.
    """

    def start(module: torch.nn.Module, args: tuple) -> None:
        labels.set_region(LOGPROB_HEAD)
        labels.set_position(labels.HEAD)
        if args and isinstance(args[0], torch.Tensor):
            _end_region_on_grad(args[0])

    handle = head.register_forward_pre_hook(start) if head is not None else None
    try:
        yield
    finally:
        labels.set_region(None)
        if handle is not None:
            handle.remove()


def _layer_position(index: int, depth: int) -> str:
    """``layer-first``/``layer-last`` ``+0``/``+1`` for the two layers at each end, ``layers-middle`` between."""
    if index <= 1 and index < depth - 2:
        return f"{labels.LAYER_FIRST}+{index}"
    if index >= depth - 2:
        return f"{labels.LAYER_LAST}-{depth - 1 - index}"
    return labels.LAYERS_MIDDLE


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "last_hidden_state", None)


def _layer_stack(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model``'s decoder layers, ``[]`` for a model without a layer list (it gets no positions)."""
    try:
        return list(decoder_layers(model))
    except InvalidArgument:
        return []


@contextlib.contextmanager
def _position_hooks(layers: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Label each op with its position in the layer stack while inside (NOTE [ Phases and regions ]).

    Forward: a layer's pre-hook sets its position. Backward: a hook on each layer's output
    gradient sets the layer's position when its backward starts, and one on the first
    layer's input gradient sets ``embed``. Recomputation under activation checkpointing
    runs in the backward phase and leaves the labels alone.

    NOTE [ A step leaves no hooks ]
    The module hooks a step needs are registered for one run of it and removed when it
    ends, also when it raises (a probe out of memory, an interrupt): the model a user
    passed to :func:`causal_lm_step` has the hooks it had before, between calls and after
    the step is dropped. The gradient hooks go on tensors of that run, which die with it.
    """
    depth = len(layers)
    handles: list[Any] = []

    def on_grad(position: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            labels.set_position(position)

        return hook

    try:
        for index, layer in enumerate(layers):
            position = _layer_position(index, depth)

            def pre(module: torch.nn.Module, args: tuple, position: str = position, index: int = index) -> None:
                if labels.coarse_phase() != labels.FORWARD:
                    return
                labels.set_position(position)
                first = _first_tensor(args)
                if index == 0 and first is not None and first.requires_grad:
                    first.register_hook(on_grad(labels.EMBED))

            def post(module: torch.nn.Module, args: tuple, out: Any, position: str = position) -> None:
                if labels.coarse_phase() != labels.FORWARD:
                    return
                first = _first_tensor(out)
                if first is not None and first.requires_grad:
                    first.register_hook(on_grad(position))

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))
        yield
    finally:
        undo_all(handle.remove for handle in reversed(handles))


def _make_optimizer(
    model: torch.nn.Module, optimizer: Any, lr: float, backend: Backend
) -> torch.optim.Optimizer | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        check_choice("optimizer", optimizer, OPTIMIZERS)
        zero = zero_state(model)
        # ZeRO: the optimizer steps the fp32 master partition (batchfit.parallel.zero)
        params = [zero.master] if zero is not None else [p for p in unwrap(model).parameters() if p.requires_grad]
        if optimizer == "adamw":
            opt = default_optimizer(params, lr=lr)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
        if zero is not None:
            with backend.context():
                initialize_optimizer_state(opt)
            zero.bucket_region = functools.partial(labels.region, COMMUNICATION)  # ZeRO-2's bucket, in the backward
            return ZeroOptimizer(zero, opt)
    with backend.context():
        initialize_optimizer_state(opt)
    return opt


def _is_value_model(model: torch.nn.Module) -> bool:
    model = unwrap(model)
    config = getattr(model, "config", None)
    return (
        type(model).__name__.endswith("ForTokenClassification") and getattr(config, "num_labels", None) == 1
    )


def _check_model_on_backend(model: torch.nn.Module, backend: Backend) -> None:
    param = next(model.parameters(), None)
    if param is None:
        return
    param = next(plain_tensors(param))  # a sharded parameter's local shard
    fake_mode = backend.fake_mode
    if fake_mode is not None:
        if not isinstance(param, FakeTensor) or param.fake_mode is not fake_mode:
            raise InvalidArgument(
                f"model must be built inside this backend's context() for backend={backend.name!r} (fake tensors), but got a model with {type(param).__name__} parameters from elsewhere; build it with build_causal_lm(..., backend=backend)"
            )
    elif isinstance(param, FakeTensor):
        raise InvalidArgument(
            f"model has fake parameters (built for the estimate backend) but got backend={backend.name!r}; build the model with build_causal_lm(..., backend=backend)"
        )
    elif param.device.type != backend.device.type:
        raise InvalidArgument(
            f"model parameters are on {param.device} but backend={backend.name!r} creates inputs on {backend.device}; build the model with build_causal_lm(..., backend=backend)"
        )


def causal_lm_step(
    model: torch.nn.Module,
    *,
    backend: Any,
    optimizer: str | torch.optim.Optimizer | None = "auto",
    lr: float = 1e-6,
    **settings: Any,
) -> TrainingStep:
    """The budget's probe for ``model`` on ``backend``: a :class:`TrainingStep`, optimizer state initialised.

    Args:
        model: built by :func:`batchfit.models.build_causal_lm` with the same ``backend``
            (or any transformers causal LM / token classifier on ``backend.device``).
        backend: the :class:`~batchfit.memory.Backend` (or its name) to measure with.
        optimizer: ``"adamw"`` (``foreach=True``, the CUDA default, on every backend),
            ``"sgd"`` (momentum 0.9), an optimizer over ``model``'s parameters, or ``None``
            (forward + backward only); ``"auto"`` (default) is ``"adamw"`` for a training
            step and ``None`` for a forward-only one.
        lr: learning rate of a created optimizer.
        **settings: the fields of :class:`StepSettings` by keyword, each described there, with
            its defaults: ``critic``, ``vocab_size``, ``logprobs``, ``cost``, ``forward_only``,
            ``only_loss_tokens``, ``response_fraction``, ``activation_offload``.

    Returns:
        A :class:`TrainingStep`; ``step.persistent`` is what to register with
        ``backend.measure``.

    Raises:
        InvalidArgument: the model's tensors do not belong to ``backend`` (fake vs real,
            or another estimate backend's fake mode), an unknown optimizer, head or cost,
            ``critic`` inconsistent with the model, a bad ``vocab_size`` or
            ``response_fraction``.
        TypeError: a keyword that is no field of :class:`StepSettings`.
    """
    unknown = sorted(set(settings) - _SETTINGS)
    if unknown:
        raise TypeError(
            f"causal_lm_step() got an unexpected keyword argument {unknown[0]!r}; it takes model, backend, optimizer, "
            f"lr and the fields of StepSettings: {', '.join(f.name for f in dataclasses.fields(StepSettings))}"
        )
    asked = StepSettings(**settings)
    critic, vocab_size, cost = asked.critic, asked.vocab_size, asked.cost
    chosen = resolve_backend(backend)
    if chosen is None:
        raise InvalidArgument(
            "backend must be a Backend or a backend name, but got backend=None; pass the backend the model was built with"
        )
    _check_model_on_backend(model, chosen)
    is_value_model = _is_value_model(model)
    if critic is None:
        critic = is_value_model
    elif critic and not is_value_model:
        raise InvalidArgument(
            f"critic=True needs a value-head model (one output per token), but got a {type(model).__name__}; build it with build_causal_lm(..., value_head=True)"
        )
    if vocab_size is None:
        vocab_size = getattr(getattr(unwrap(model), "config", None), "vocab_size", None)
        if vocab_size is None:
            raise InvalidArgument(
                f"vocab_size is required when the model has no config.vocab_size, but got vocab_size=None for a {type(model).__name__}"
            )
    vocab_size = check_positive_int("vocab_size", vocab_size)
    logprobs = check_head("logprobs", asked.logprobs)
    cost = check_choice("cost", cost, COSTS)
    response_fraction = check_response_fraction(asked.response_fraction)
    for flag in ("only_loss_tokens", "activation_offload"):
        if not isinstance(getattr(asked, flag), bool):
            raise InvalidArgument(f"{flag} must be True or False, but got {flag}={getattr(asked, flag)!r}")
    forward_only = asked.forward_only
    if isinstance(optimizer, str) and optimizer == "auto":
        optimizer = None if forward_only else "adamw"
    opt = _make_optimizer(model, optimizer, lr, chosen)
    sequence_parallel = sharding_of(model).sequence_parallel
    if sequence_parallel > 1:
        if cost != "packed":
            raise InvalidArgument(
                f"sequence_parallel={sequence_parallel} splits packed micro-batches (verl and SkyRL need padding removed "
                f"for it), but got cost={cost!r}; use cost='packed'"
            )
        # NOTE [ Ulysses sequence parallelism ]: each rank runs its share of the packed micro-batch
        use_ulysses_attention(unwrap(model), sequence_parallel_group(sequence_parallel))
    elif cost == "packed":
        use_varlen_attention(unwrap(model))  # packed rows attend per sequence, no T × T mask
    resolved = dataclasses.replace(
        asked,
        critic=bool(critic),
        vocab_size=vocab_size,
        logprobs=logprobs,
        cost=cost,
        forward_only=bool(forward_only),
        only_loss_tokens=asked.only_loss_tokens and not critic,
        response_fraction=response_fraction,
    )
    step = TrainingStep(model, backend=chosen, optimizer=opt, settings=resolved)
    if not forward_only:
        with chosen.context():
            allocate_gradients(model)
    if step.sharding.spec.warmup_steps and model is not unwrap(model) and not forward_only:
        # DDP re-buckets gradients in the forward after its first backward (allocating in
        # C++); two steps now keep that out of every measured step (NOTE [ DDP gradient buckets ]).
        for _ in range(step.sharding.spec.warmup_steps):
            step([2])
    return step
