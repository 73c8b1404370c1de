"""LoRA adapters on a causal LM or value model, built with PEFT's own ``get_peft_model``.

:class:`LoraSpec` says which adapters (rank, alpha, target modules); :func:`apply_lora` wraps
a transformers model as verl and SkyRL do; :func:`lora_parameters` counts what a spec trains.
PEFT is an optional dependency (``pip install -e '.[lora]'`` in batchfit's checkout), imported only here and only
when an adapter is asked for.

NOTE [ LoRA as the frameworks build it ]
Read from verl 0.9.1 (``workers/engine/fsdp/transformer_impl.py``: ``_build_module``,
``_build_lora_module``, ``_build_fsdp_module``; ``utils/fsdp_utils.py``: ``apply_fsdp2``) and
SkyRL 0.4.0 (``backends/skyrl_train/workers/model_wrapper.py``: ``HFModelWrapper`` and
``get_llm_for_sequence_regression``; ``distributed/fsdp_strategy.py``: ``_fsdp_init_model``):

- The model: ``enable_input_require_grads()``, then ``get_peft_model(model, LoraConfig(r=rank,
  lora_alpha=alpha, target_modules=targets, bias="none"))`` with lora_dropout 0 (the default
  of both), ``task_type=CAUSAL_LM`` for the policy; SkyRL's critic passes no task type (a
  plain ``PeftModel``: PEFT's causal-LM wrapper cannot wrap a token classifier), and
  ``"all-linear"`` then adapts its value head ``score`` too. ``"all-linear"`` (the default of
  both) is every linear layer but the LM head.
- Dtypes: both build the trained model in fp32 (verl ``model_dtype: fp32`` for training,
  SkyRL ``bf16=False``) and shard it with FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``: under LoRA the frozen base is kept as fp32 shards, gathered in bf16,
  exactly as for full fine-tuning. PEFT keeps adapters in fp32 (``autocast_adapter_dtype``)
  whatever the base's dtype. With a bf16 base (``dtype="bf16"``) batchfit keeps PEFT's fp32
  adapters (PEFT's default); verl's engine would cast them to bf16 (``model_dtype: bf16``).
  Without a mixed-precision policy such adapters make PEFT cast each adapted layer's input to
  fp32, a copy kept for backward (measured: the tiny preset's activations +49% on one device);
  FSDP2's bf16 policy gathers the adapters in bf16 too, and no copy is made.
- Sharding: ``fully_shard`` per decoder layer, then the ``PeftModel`` root (verl ``apply_fsdp2``,
  SkyRL ``_fsdp_init_model``): a layer's unit holds its frozen base weights and its
  trainable adapters together. torch's FSDP2 requires one dtype among a unit's *trainable*
  parameters only (``FSDPParamGroup._init_mp_dtypes``); frozen ones get no gradient and no
  reduce-scatter. verl's ``strategy: fsdp`` (FSDP1, its generated config's default) instead
  makes every adapter a unit of its own (``get_fsdp_wrap_policy(..., is_lora=True)``), so no
  flat parameter mixes frozen and trainable weights; batchfit wraps it the same way (NOTE
  [ LoRA under FSDP1 ] in :mod:`batchfit.parallel.fsdp1`).
- The optimizer: SkyRL hands AdamW every parameter, verl the same; a frozen parameter never
  gets a gradient, so AdamW never creates its state. batchfit's optimizer holds the trainable
  parameters only (the same state, see :func:`batchfit.train.optim.default_optimizer`).
- verl computes the reference log-probs with the actor itself, adapters disabled
  (``ray_trainer``: ``ref_in_actor`` when ``lora_rank > 0``): no reference model is built.

batchfit builds the adapters on the meta device (``get_peft_model(..., low_cpu_mem_usage=True)``)
and materialises them with the base (NOTE [ Models are built on the meta device ] in
:mod:`batchfit.models.build`): on the estimate backend as fake tensors of PEFT's dtype (a
module's ``.to()`` cannot run on fake tensors), on real backends by the same allocation as the
base, then initialised by PEFT's own ``reset_lora_parameters`` (A Kaiming-uniform, B zeros)
from the build's seed. Dropout on the adapters' input (``lora_dropout > 0``) and
``exclude_modules`` are not modelled.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchfit.errors import InvalidArgument
from batchfit.validation import check_int, check_number

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_ALPHA",
    "LoraParameters",
    "LoraSpec",
    "apply_lora",
    "as_lora",
    "base_model",
    "is_peft_model",
    "lora_parameters",
    "lora_spec",
]

#: PEFT's shorthand for every linear layer but the output head (the frameworks' default).
ALL_LINEAR = "all-linear"
#: ``lora_alpha`` when none is given: verl's (``lora_alpha: 16``) and SkyRL's (``alpha: 16``) default.
DEFAULT_ALPHA = 16
#: The adapter's name inside the PEFT model (PEFT's default).
ADAPTER = "default"

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_FIELDS = {"rank": "rank", "alpha": "alpha", "targets": "targets"}


@dataclass(frozen=True)
class LoraSpec:
    """Which LoRA adapters a trained model gets.

    Attributes:
        rank: the adapters' rank ``r``; ``0`` means no LoRA (full fine-tuning).
        alpha: PEFT's ``lora_alpha`` (the update is scaled by ``alpha / rank``); it does not
            change memory. Default :data:`DEFAULT_ALPHA`.
        targets: ``"all-linear"`` (every linear layer but the LM head), or a tuple of module
            names, each matched as PEFT matches a list (the name or a dotted suffix of a module's
            path: ``("q_proj", "v_proj")``). A comma-separated string or a list is accepted.

    Raises:
        InvalidArgument: a rank that is not an integer >= 0, an alpha that is not a positive
            number, a target that is not a module name (the message names the field).

    Example:
        >>> LoraSpec(64, 128, "q_proj,v_proj").targets
        ('q_proj', 'v_proj')
        >>> LoraSpec(64).describe()
        'LoRA rank 64, alpha 16, all-linear'
    """

    rank: int
    alpha: float = DEFAULT_ALPHA
    targets: str | tuple[str, ...] = ALL_LINEAR

    def __post_init__(self) -> None:
        rank, alpha, targets = _checked(self.rank, self.alpha, self.targets, _FIELDS)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "targets", targets)

    @property
    def enabled(self) -> bool:
        """True when the spec adds adapters (``rank > 0``)."""
        return self.rank > 0

    def describe(self) -> str:
        """``"LoRA rank 64, alpha 128, all-linear"`` (``"no LoRA"`` for rank 0)."""
        if not self.enabled:
            return "no LoRA"
        targets = self.targets if isinstance(self.targets, str) else ",".join(self.targets)
        return f"LoRA rank {self.rank}, alpha {_number(self.alpha)}, {targets}"

    def to_dict(self) -> dict[str, Any]:
        """``{"rank", "alpha", "targets"}`` as plain values (targets a string or a list)."""
        targets = self.targets if isinstance(self.targets, str) else list(self.targets)
        return {"rank": self.rank, "alpha": self.alpha, "targets": targets}


def lora_spec(
    rank: Any, alpha: Any = None, targets: Any = None, *, names: Mapping[str, str] | None = None
) -> LoraSpec:
    """A :class:`LoraSpec` from loose values, errors naming the fields as the caller spells them.

    Args:
        rank, alpha, targets: as :class:`LoraSpec`; ``None`` takes the default (alpha
            :data:`DEFAULT_ALPHA`, targets ``"all-linear"``).
        names: field -> the name to use in messages, e.g. ``{"rank": "--lora-rank", ...}`` or a
            config's keys.

    Raises:
        InvalidArgument: a bad value, named as ``names`` says.

    Example:
        >>> lora_spec(8, targets=["q_proj"]).to_dict()
        {'rank': 8, 'alpha': 16, 'targets': ['q_proj']}
    """
    labels = {**_FIELDS, **(names or {})}
    alpha = DEFAULT_ALPHA if alpha is None else alpha
    targets = ALL_LINEAR if targets is None else targets
    return LoraSpec(*_checked(rank, alpha, targets, labels))


def as_lora(value: Any, name: str = "lora") -> LoraSpec | None:
    """``None``, a :class:`LoraSpec`, or a mapping of its fields (``{"rank": 64, ...}``) as a spec.

    Raises:
        InvalidArgument: another type, an unknown key, or a bad value (named ``name.field``).
    """
    if value is None or isinstance(value, LoraSpec):
        return value
    if isinstance(value, Mapping):
        fields = {f.name for f in dataclasses.fields(LoraSpec)}
        unknown = sorted(set(value) - fields)
        if unknown or "rank" not in value:
            what = f"an unknown key {unknown[0]!r}" if unknown else "no 'rank'"
            raise InvalidArgument(
                f"{name} must be a LoraSpec or a mapping of rank, alpha and targets, but got {what} in {name}={dict(value)!r}; e.g. {name}={{'rank': 64, 'alpha': 128}}"
            )
        return lora_spec(**value, names={k: f"{name}.{k}" for k in fields})
    raise InvalidArgument(
        f"{name} must be a LoraSpec, a mapping of its fields or None, but got {name}={value!r} ({type(value).__name__}); e.g. {name}=LoraSpec(rank=64, alpha=128)"
    )


def _checked(rank: Any, alpha: Any, targets: Any, names: Mapping[str, str]) -> tuple[int, Any, Any]:
    rank = check_int(names["rank"], rank)
    if rank < 0:
        raise InvalidArgument(
            f"{names['rank']} must be an integer >= 0 (0: no LoRA), but got {names['rank']}={rank}; e.g. 16, 32 or 64"
        )
    check_number(names["alpha"], alpha, low=0.0, low_open=True)
    if isinstance(alpha, float) and alpha.is_integer():
        alpha = int(alpha)
    return rank, alpha, _checked_targets(targets, names["targets"])


def _checked_targets(targets: Any, name: str) -> str | tuple[str, ...]:
    hint = f"pass {ALL_LINEAR!r} or module names such as 'q_proj,v_proj'"
    if isinstance(targets, str):
        if targets.strip() == ALL_LINEAR:
            return ALL_LINEAR
        items: Sequence[Any] = targets.split(",")
    elif isinstance(targets, Sequence) and not isinstance(targets, bytes):
        items = list(targets)
    else:
        raise InvalidArgument(
            f"{name} must be {ALL_LINEAR!r} or module names, but got {name}={targets!r}; {hint}"
        )
    out = []
    for item in items:
        word = item.strip() if isinstance(item, str) else item
        if word == ALL_LINEAR:
            raise InvalidArgument(
                f"{name}: {ALL_LINEAR!r} cannot be listed with other names, but got {name}={targets!r}; {hint}"
            )
        if not isinstance(word, str) or not _MODULE_NAME.match(word):
            raise InvalidArgument(
                f"{name} must be {ALL_LINEAR!r} or module names (letters, digits, '_', '.'), but got {name}={targets!r} with {word!r}; {hint}"
            )
        out.append(word)
    if not out:
        raise InvalidArgument(f"{name} must name at least one module, but got {name}={targets!r}; {hint}")
    return tuple(dict.fromkeys(out))


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def import_peft() -> Any:
    """The ``peft`` module.

    Raises:
        InvalidArgument: PEFT is not installed (the message says how to install it).
    """
    try:
        import peft
    except ImportError as exc:
        raise InvalidArgument(
            f"LoRA needs PEFT, which is not installed ({exc}); pip install -e '.[lora]' in batchfit's checkout (or pass lora rank 0 for full fine-tuning)"
        ) from None
    return peft


def is_peft_model(model: Any) -> bool:
    """True for a PEFT wrapper (``PeftModel`` and its task subclasses, FSDP2-wrapped or not)."""
    return (
        isinstance(model, torch.nn.Module)
        and hasattr(model, "peft_config")
        and hasattr(model, "get_base_model")
    )


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper, with its adapter layers (``model`` itself otherwise)."""
    return model.get_base_model() if is_peft_model(model) else model


def apply_lora(
    model: torch.nn.Module, spec: LoraSpec, *, value_head: bool = False, name: str = "targets"
) -> torch.nn.Module:
    """Wrap ``model`` with ``spec``'s adapters as verl and SkyRL do (NOTE [ LoRA as the frameworks build it ]).

    The base's parameters are frozen; the adapters are created on the meta device
    (``low_cpu_mem_usage=True``), uninitialised: the caller materialises them
    (:func:`materialise_adapters` on fake tensors, or the base's own allocation) and then
    initialises them (:func:`reset_adapters`).

    Args:
        model: a transformers causal LM, or a value model (``value_head=True``), in training mode.
        spec: an enabled :class:`LoraSpec`.
        value_head: the model is a value-head critic (a plain ``PeftModel``, as SkyRL's critic).
        name: how messages name the targets (``"--lora-targets"`` on the command line).

    Returns:
        The ``PeftModel`` (``PeftModelForCausalLM`` for a causal LM).

    Raises:
        InvalidArgument: PEFT is missing, or a target matches no module (or one PEFT cannot
            adapt): the message lists the model's linear modules.
    """
    peft = import_peft()
    task = None if value_head else peft.TaskType.CAUSAL_LM
    targets = spec.targets if isinstance(spec.targets, str) else list(spec.targets)
    config = peft.LoraConfig(
        task_type=task, r=spec.rank, lora_alpha=spec.alpha, target_modules=targets, bias="none"
    )
    model.enable_input_require_grads()  # both frameworks call it before get_peft_model (peft #137)
    try:
        # meta adapters: PEFT then skips moving them to the base's device (a module's .to() fails on
        # fake tensors), and a fake mode's .to("meta") inside low_cpu_mem_usage would keep the device
        with torch.device("meta"), warnings.catch_warnings():
            # PEFT reads the deprecated is_gradient_checkpointing of transformers 5.x
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, config, low_cpu_mem_usage=True)
    except ValueError as exc:  # PEFT's NoMatchingPeftModuleError is one
        names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        reason = " ".join(str(exc).split())[:160]
        given = spec.targets if isinstance(spec.targets, str) else ",".join(spec.targets)
        raise InvalidArgument(
            f"{name}={given!r} cannot adapt {type(model).__name__} ({reason}); its linear modules are {', '.join(names)}: pass {ALL_LINEAR!r} or some of those"
        ) from None


def materialise_adapters(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every parameter still on the meta device (the adapters) an uninitialised tensor on ``device``.

    Called inside a fake mode (the estimate backend's context), the tensors are fake. Dtype,
    shape and ``requires_grad`` are kept.
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.device.type == "meta":
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(fresh, requires_grad=param.requires_grad)


def reset_adapters(model: torch.nn.Module) -> None:
    """Initialise every adapter with PEFT's own ``reset_lora_parameters`` (A Kaiming-uniform, B zeros).

    Random fills draw from the global generator, or from a seed inside
    :func:`batchfit.models.build.seeded_fills`.
    """
    from peft.tuners.lora import LoraLayer

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for adapter in (*module.lora_A.keys(), *module.lora_embedding_A.keys()):
                    module.reset_lora_parameters(adapter, True)


@dataclass(frozen=True)
class LoraParameters:
    """What a :class:`LoraSpec` trains on a model: the adapters' parameters and the whole model's.

    Attributes:
        spec: the spec.
        trainable: parameters of the adapters (all that is trained).
        total: parameters of the model with its adapters (tied weights once).
    """

    spec: LoraSpec
    trainable: int
    total: int

    @property
    def fraction(self) -> float:
        """``trainable / total``."""
        return self.trainable / self.total if self.total else 0.0

    def describe(self) -> str:
        """``"LoRA rank 64, alpha 128, all-linear: 40,370,176 trainable parameters of 7,655,986,688 (0.53%)"``."""
        return (
            f"{self.spec.describe()}: {self.trainable:,} trainable parameters of {self.total:,} "
            f"({100 * self.fraction:.2f}%)"
        )

    def to_dict(self) -> dict[str, Any]:
        """The spec's fields with ``trainable_parameters`` and ``total_parameters``."""
        return {**self.spec.to_dict(), "trainable_parameters": self.trainable, "total_parameters": self.total}


def lora_parameters(
    config: Any, spec: LoraSpec, *, value_head: bool = False, name: str = "targets"
) -> LoraParameters:
    """Count what ``spec`` trains on the model ``config`` describes (built on the meta device: no memory).

    Args:
        config: a transformers ``PretrainedConfig`` (:func:`batchfit.models.load_config`).
        spec: an enabled :class:`LoraSpec`.
        value_head: count on the value-head critic instead of the causal LM.
        name: how messages name the targets.

    Raises:
        InvalidArgument: as :func:`apply_lora`.

    Example:
        >>> from batchfit.models import load_config
        >>> lora_parameters(load_config("tiny"), LoraSpec(8)).trainable
        18688
    """
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from batchfit.models.specs import quiet_transformers_logs

    config = copy.deepcopy(config)
    config.use_cache = False
    if value_head:
        config.num_labels = 1
    factory = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with torch.device("meta"), quiet_transformers_logs():
        model = apply_lora(factory.from_config(config), spec, value_head=value_head, name=name)
    params = list(dict.fromkeys(model.parameters()))
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return LoraParameters(spec=spec, trainable=trainable, total=sum(p.numel() for p in params))
