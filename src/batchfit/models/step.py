"""Ready-made training steps for a causal LM (policy) or a value-head model (critic).

A :class:`TrainingStep` runs one forward + backward (+ optimizer step) on random tokens of
a given shape, creating its inputs on ``backend.device`` inside ``backend.context()``, so
the same step serves the cpu, estimate and cuda backends:

    backend = get_backend("estimate", memory_limit="h100-80gb")
    model = build_causal_lm("qwen2.5-0.5b", backend=backend, dtype="bf16")
    step = causal_lm_step(model, backend=backend)
    m = backend.measure(lambda: step(4, 8192), register=step.persistent)
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from batchfit.errors import InvalidArgument
from batchfit.memory import Backend, MemoryMeasurement, labels
from batchfit.memory.registration import (
    COMMUNICATION,
    GRADIENTS,
    LOGPROB_HEAD,
    OPTIMIZER_STATE,
    OPTIMIZER_STEP,
    PARAMETERS,
    plain_tensors,
)
from batchfit.models.build import resolve_backend
from batchfit.models.shard import unwrap
from batchfit.sharding import Sharding
from batchfit.validation import check_choice, check_int, check_positive_int

OPTIMIZERS = ("adamw", "sgd")
LOGPROBS = ("full", "chunked", "fused")
"""How the policy step computes log-probs: ``full`` materialises fp32 ``[B, S, V]`` log-softmax;
``chunked`` uses :func:`batchfit.logprobs.logprobs_from_logits`; ``fused`` uses
:func:`batchfit.logprobs.logprobs_from_hidden` and never builds the logits."""


class TrainingStep:
    """One training step of ``model`` on random tokens: ``step(batch_size, seq_len)``.

    Policy (``critic=False``): per-token log-probs of the next token from ``log_softmax``
    of the fp32 logits, loss = minus the masked mean of ``exp(logp - old_logp) × advantage``
    (the shape of a PPO/GRPO policy loss), over a micro-batch holding what a trainer's does
    (NOTE [ The probe holds an RL micro-batch ]).
    Critic (``critic=True``): values ``model(...).logits[..., 0]`` in fp32, loss = masked
    mean squared error against random returns. Then backward, then ``optimizer.step()`` and
    ``zero_grad(set_to_none=False)``, so the state after a call equals the state before it:
    the gradients stay allocated between calls, as they do between the micro-batches of a
    gradient accumulation (NOTE [ Gradients are resident between micro-batches ]).
    Forward-only (``forward_only=True``, a reference model or the old-log-prob pass):
    ``eval()`` and ``no_grad`` log-probs, no backward, no optimizer step.

    The step labels what it runs for the tracked backends (NOTE [ Phases and regions ]):
    the phases ``forward``, ``backward`` and ``optimizer``, and the regions
    ``logprob_head`` (from the head's input to the loss, and back to the head's input
    gradient) and ``optimizer_step`` (the optimizer's temporaries).

    Attributes:
        model: the module trained (an ``FSDPModule`` or DDP wrapper when sharded).
        optimizer: the optimizer (state already initialised) or ``None``.
        backend: the :class:`~batchfit.memory.Backend` the step was built for.
        critic: value-head loss instead of the policy loss.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        persistent: ``(model, optimizer, *communication buffers)``, to register with
            ``backend.measure``; ``categories`` gives each one's breakdown category.
        categories: one entry per ``persistent`` object (``None`` = default categories).
        host_categories: categories held in host memory (CPU offload), see
            :meth:`batchfit.memory.Backend.measure`.
        sharding: the model's :class:`~batchfit.sharding.Sharding`.
        logprobs: one of :data:`LOGPROBS`.
        forward_only: log-probs under ``no_grad`` only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        backend: Backend,
        optimizer: torch.optim.Optimizer | None,
        critic: bool,
        vocab_size: int,
        logprobs: str = "full",
        forward_only: bool = False,
    ):
        self.model = model
        self.logprobs = logprobs
        self.forward_only = forward_only
        self.backend = backend
        self.optimizer = optimizer
        self.critic = critic
        self.vocab_size = vocab_size
        self.sharding: Sharding = getattr(model, "batchfit_sharding", None) or Sharding()
        comm = tuple(getattr(model, "batchfit_comm_buffers", ()))
        state: tuple[Any, ...] = (model,) if optimizer is None else (model, optimizer)
        self.persistent: tuple[Any, ...] = (*state, *comm)
        self.categories: tuple[str | None, ...] = (None,) * len(state) + (COMMUNICATION,) * len(comm)
        self.host_categories: tuple[str, ...] = HOST_CATEGORIES if self.sharding.offload == "cpu" else ()
        self._head = _head_module(unwrap(model))
        self._position_hooks = _install_position_hooks(unwrap(model))
        if logprobs == "fused" and not critic:
            _attach_fused_logprobs(unwrap(model))

    def measure(self, batch_size: int, seq_len: int) -> MemoryMeasurement:
        """Measure one call ``self(batch_size, seq_len)`` on :attr:`backend`, state registered.

        Returns:
            The backend's :class:`~batchfit.memory.MemoryMeasurement` (``fits=False`` when
            it ran out of the backend's memory).
        """
        return self.backend.measure(
            lambda: self(batch_size, seq_len),
            register=self.persistent,
            categories=self.categories,
            host_categories=self.host_categories,
        )

    def __call__(self, batch_size: int, seq_len: int) -> None:
        """Run one step on ``batch_size`` random sequences of ``seq_len`` tokens.

        Raises:
            InvalidArgument: ``batch_size < 1``, or ``seq_len`` below 2 (policy) / 1 (critic).
        """
        batch_size = check_positive_int("batch_size", batch_size)
        seq_len = check_int("seq_len", seq_len, minimum=1 if self.critic else 2)
        with self.backend.context():
            if self.forward_only:
                self.model.eval()
                with torch.no_grad(), labels.phase(labels.FORWARD):
                    labels.set_position(labels.EMBED)
                    self._loss(batch_size, seq_len)
                return
            self.model.train()
            with labels.phase(labels.FORWARD):
                labels.set_position(labels.EMBED)
                loss = self._loss(batch_size, seq_len)
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

    def _loss(self, batch_size: int, seq_len: int) -> torch.Tensor:
        # A function of its own so that every intermediate not saved for backward dies here.
        device = self.backend.device
        # NOTE [ The probe holds an RL micro-batch ]: the fields a trainer's micro-batch
        # carries besides the token ids (attention mask, loss mask, advantages and old
        # log-probs, or returns) are created too: a micro-batch at the budget filled a
        # forward pass 0.2% past the limit when the probe held the ids alone.
        input_ids = torch.randint(0, self.vocab_size, (batch_size, seq_len), device=device)
        attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)  # noqa: F841 - held
        with _head_region(self._head), warnings.catch_warnings():
            # FSDP2 warns when a wrapped module returns a view (log-probs, values); the step
            # never writes to one in place
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
            if self.critic:
                returns = torch.randn(batch_size, seq_len, device=device)
                mask = torch.ones(batch_size, seq_len, device=device)
                values = self.model(input_ids=input_ids, use_cache=False).logits[..., 0].float()
                return ((values - returns).square() * mask).sum() / mask.sum()
            mask = torch.ones(batch_size, seq_len - 1, device=device)
            advantages = torch.randn(batch_size, seq_len - 1, device=device)
            old_logprobs = torch.zeros(batch_size, seq_len - 1, device=device)
            logprobs = self._logprobs(input_ids)
            ratio = (logprobs - old_logprobs).exp()  # the PPO/GRPO importance ratio
            return -(ratio * advantages * mask).sum() / mask.sum()

    def _logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Log-probs of each next token, ``[B, S - 1]`` fp32, the way ``self.logprobs`` says."""
        labels_ = input_ids[:, 1:]
        if self.logprobs == "fused":
            return unwrap(self.model).batchfit_fused_logprobs(input_ids)
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        if self.logprobs == "chunked":
            from batchfit.logprobs import logprobs_from_logits

            return logprobs_from_logits(logits[:, :-1], labels_)
        return token_logprobs(logits[:, :-1], labels_)


# Categories that CPU offload keeps in host memory (FSDP2 CPUOffloadPolicy: sharded
# parameters, sharded gradients, optimizer state and the optimizer step run on the CPU).
HOST_CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER_STATE, OPTIMIZER_STEP)


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


def _fused_logprobs(self: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Bound to the model as ``batchfit_fused_logprobs``: log-probs from hidden states, no logits."""
    from batchfit.logprobs import logprobs_from_hidden

    body = self.get_decoder() if hasattr(self, "get_decoder") else self.model
    hidden = body(input_ids=input_ids, use_cache=False).last_hidden_state
    head = self.get_output_embeddings()
    labels.set_region(LOGPROB_HEAD)
    labels.set_position(labels.HEAD)
    _end_region_on_grad(hidden)
    return logprobs_from_hidden(hidden[:, :-1], head.weight, input_ids[:, 1:], bias=head.bias)


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


def _install_position_hooks(model: torch.nn.Module) -> list[Any]:
    """Label each op with its position in the layer stack (NOTE [ Phases and regions ]).

    Forward: a layer's pre-hook sets its position. Backward: a hook on each layer's output
    gradient sets the layer's position when its backward starts, and one on the first
    layer's input gradient sets ``embed``. Recomputation under activation checkpointing
    runs in the backward phase and leaves the labels alone. Models without a layer list
    get no positions.
    """
    from batchfit.models.shard import decoder_layers

    try:
        layers = decoder_layers(model)
    except InvalidArgument:
        return []
    depth = len(layers)
    handles = []

    def on_grad(position: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            labels.set_position(position)

        return hook

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
    return handles


def _attach_fused_logprobs(model: torch.nn.Module) -> None:
    """Give ``model`` the fused log-prob method; under FSDP2 it runs as a forward (parameters gathered)."""
    if hasattr(model, "batchfit_fused_logprobs"):
        return
    model.batchfit_fused_logprobs = types.MethodType(_fused_logprobs, model)
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, "batchfit_fused_logprobs")


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits.float())`` gathered at ``tokens``: shape ``tokens.shape``.

    The plain version: it materialises fp32 ``[B, S, V]`` log-probs (the memory-bounded
    ones live in :mod:`batchfit.logprobs`).
    """
    return F.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def initialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazy state now, for the parameters that have none, leaving everything else as it was.

    A zero-learning-rate step on zero gradients runs over the parameters without state
    only (the others have ``grad=None`` during it, so the optimizer skips them: their
    moments and step counts are untouched); the new states' step counters are then set
    back to 0, so bias correction starts as if no step had run. Parameters and their
    gradients are unchanged (AdamW's decoupled weight decay multiplies by
    ``1 - lr * wd = 1``). Without this, the first measured step would also allocate the
    state and a single profile would miss it on later steps (SkyRL #1060).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fresh = [p for p in params if not optimizer.state.get(p)]
    if not fresh:
        return
    fresh_ids = {id(p) for p in fresh}
    saved_grads = [p.grad for p in params]
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in fresh_ids else None
        for group in optimizer.param_groups:
            group["lr"] = 0.0 if not isinstance(group["lr"], torch.Tensor) else group["lr"] * 0
        with torch.no_grad():
            optimizer.step()
        for p in fresh:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                state["step"].zero_()
            elif "step" in state:
                state["step"] = 0
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in zip(params, saved_grads):
            p.grad = grad


def causal_lm_step(
    model: torch.nn.Module,
    *,
    backend: Any,
    optimizer: str | torch.optim.Optimizer | None = "auto",
    critic: bool | None = None,
    vocab_size: int | None = None,
    lr: float = 1e-6,
    logprobs: str = "full",
    forward_only: bool = False,
) -> TrainingStep:
    """The training step function for ``model`` on ``backend``, optimizer state initialised.

    Args:
        model: built by :func:`batchfit.models.build_causal_lm` with the same ``backend``
            (or any transformers causal LM / token classifier on ``backend.device``).
        backend: the :class:`~batchfit.memory.Backend` (or its name) to measure with.
        optimizer: ``"adamw"`` (``foreach=True``, the CUDA default, on every backend),
            ``"sgd"`` (momentum 0.9), an optimizer over ``model``'s parameters, or ``None``
            (forward + backward only); ``"auto"`` (default) is ``"adamw"`` for a training
            step and ``None`` for a forward-only one.
        critic: value-head loss; default: ``True`` iff ``model`` is a token classifier with
            one label (``build_causal_lm(value_head=True)``).
        vocab_size: token ids are drawn below this; default ``model.config.vocab_size``.
        lr: learning rate of a created optimizer.
        logprobs: how the policy loss computes log-probs, one of :data:`LOGPROBS`
            (``"fused"`` needs a model with ``get_output_embeddings()`` and a decoder body).
        forward_only: a forward-only step: ``eval()``, ``no_grad`` log-probs (or values),
            no backward and no optimizer step. With an ``optimizer`` its state is created and
            registered all the same: the old-log-prob or value pass of a model being trained
            runs with that state resident; pass ``optimizer=None`` for a frozen reference.

    Returns:
        A :class:`TrainingStep`; ``step.persistent`` is what to register with
        ``backend.measure``.

    Raises:
        InvalidArgument: the model's tensors do not belong to ``backend`` (fake vs real,
            or another estimate backend's fake mode), an unknown optimizer name, ``critic``
            inconsistent with the model, a bad ``vocab_size``.

    Example:
        >>> from batchfit.memory import get_backend
        >>> from batchfit.models import build_causal_lm
        >>> backend = get_backend("cpu")
        >>> step = causal_lm_step(build_causal_lm("tiny", backend=backend), backend=backend)
        >>> backend.measure(lambda: step(2, 16), register=step.persistent).fits
        True
    """
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
    logprobs = check_choice("logprobs", logprobs, LOGPROBS)
    if isinstance(optimizer, str) and optimizer == "auto":
        optimizer = None if forward_only else "adamw"
    opt = _make_optimizer(model, optimizer, lr, chosen)
    step = TrainingStep(
        model,
        backend=chosen,
        optimizer=opt,
        critic=bool(critic),
        vocab_size=vocab_size,
        logprobs=logprobs,
        forward_only=bool(forward_only),
    )
    if not forward_only:
        with chosen.context():
            allocate_gradients(model)
    if step.sharding.strategy == "ddp" and model is not unwrap(model) and not forward_only:
        # DDP re-buckets gradients in the forward after its first backward (allocating in
        # C++); two steps now keep that out of every measured step (NOTE [ DDP gradient buckets ]).
        for _ in range(2):
            step(1, 2)
    return step


def allocate_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter without one a zero ``.grad`` (a sharded one for FSDP2).

    NOTE [ Gradients are resident between micro-batches ]
    A trainer accumulates gradients over the micro-batches of an optimizer step: from the
    second micro-batch on, the whole gradient (each rank's shard under FSDP2, which
    reduce-scatters and adds into it after every backward) is on the device for the entire
    forward and backward. A step measured from ``grad=None`` misses it wherever its peak
    falls before the last gradient is created — in the forward, or early in the backward:
    a trainer built on the budget went 9% over it on the tiny model. So a training step is
    measured with its gradients allocated before and kept after (``zero_grad`` with
    ``set_to_none=False``): every micro-batch of an accumulation fits, the first included.
    """
    for p in unwrap(model).parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def default_optimizer(parameters: Any, lr: float = 1e-6) -> torch.optim.Optimizer:
    """The optimizer every batchfit step trains with: AdamW with ``foreach=True``.

    ``foreach`` is what PyTorch picks by default on CUDA; on the CPU (and so under the
    estimate backend's fake CPU tensors) its default is the per-parameter loop, whose
    temporaries are smaller, so it is set explicitly: an estimate predicts the CUDA step.
    """
    return torch.optim.AdamW(parameters, lr=lr, foreach=True)


def _make_optimizer(
    model: torch.nn.Module, optimizer: Any, lr: float, backend: Backend
) -> torch.optim.Optimizer | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    else:
        check_choice("optimizer", optimizer, OPTIMIZERS)
        params = [p for p in unwrap(model).parameters() if p.requires_grad]
        if optimizer == "adamw":
            opt = default_optimizer(params, lr=lr)
        else:
            opt = torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
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
    fake_mode = getattr(backend, "fake_mode", None)
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
