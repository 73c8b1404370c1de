"""TRL's GRPO (and RLOO) sized by batchfit: ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``steps_per_generation``.

TRL refuses ``auto_find_batch_size`` for GRPO and RLOO (a generation batch must hold whole
prompt groups), so its users guess ``per_device_train_batch_size``. :func:`grpo_config` builds a
TRL ``GRPOConfig`` (or ``RLOOConfig``) whose micro-batches fit a batchfit token budget (measured
or estimated with :func:`batchfit.budget.profile_model`) and whose numbers keep every rule TRL
checks; :func:`plan_grpo_batches` is the same arithmetic without TRL. Given a
:class:`~batchfit.budget.ModelProfile`, :func:`grpo_config` checks TRL's generation phase too (the
policy's own ``generate`` or a colocated vLLM on the same GPU: :mod:`batchfit.integrations.trl_generation`,
NOTE [ Both phases, refused not resized ]). TRL is imported only inside the functions that build
its objects (``pip install -e '.[trl]'`` in batchfit's checkout).

NOTE [ TRL's batch rules ]
Read from TRL 1.16.0, ``trl/trainer/grpo_config.py`` ``GRPOConfig.__post_init__`` (``rloo_config.py``
``RLOOConfig.__post_init__`` has the same rules, word for word):

- ``num_processes = self.world_size``; with ``steps_per_generation`` set and
  ``generation_batch_size`` not, ``generation_batch_size = per_device_train_batch_size ×
  num_processes × steps_per_generation``; both set is an error; neither set means
  ``steps_per_generation = gradient_accumulation_steps``.
- ``generation_batch_size % num_generations == 0`` (whole prompt groups), ``num_generations >= 2``.
- ``auto_find_batch_size`` is refused.
- with evaluation on, ``per_device_eval_batch_size × num_processes`` divides by
  ``num_generations_eval or num_generations`` (not sized here: the config's own check applies).

And from ``grpo_trainer.py``: ``_prepare_inputs`` generates once for the local generation batch
(``per_device_train_batch_size × steps_per_generation`` rows), shuffles it and splits it into
``steps_per_generation`` micro-batches of ``per_device_train_batch_size`` rows
(``split_tensor_dict``); an optimizer step takes ``gradient_accumulation_steps`` of them.
``_generate_and_score_completions`` left-pads the prompts and right-pads the completions to the
longest of the local generation batch, each rounded up to ``pad_to_multiple_of`` (``pad``), so a
micro-batch row is at most ``max_prompt_length + max_completion_length`` columns (each rounded
up) and a micro-batch costs ``rows × that`` tokens: a *padded* cost, whatever the real lengths
(TRL #7179). ``max_completion_length`` is TRL's own field; the prompt length is the user's
(TRL 1.16 does not truncate prompts), so it is an argument here.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

from batchfit.budget import ModelProfile, TokenBudget
from batchfit.errors import BatchConfigError, BudgetError, InvalidArgument
from batchfit.validation import check_int, check_positive_int

__all__ = [
    "SIZED_FIELDS",
    "GrpoBatchSizes",
    "UnusedRowsWarning",
    "grpo_batch_sizes",
    "grpo_config",
    "padded_row_length",
    "plan_grpo_batches",
    "token_budget_grpo_config",
]

#: The fields of TRL's config that :func:`grpo_config` sets (and so refuses from the caller),
#: with ``generation_batch_size``, which TRL derives from them (NOTE [ TRL's batch rules ]).
SIZED_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
)


class UnusedRowsWarning(UserWarning):
    """Warned by :func:`grpo_config` when TRL's divisor rule keeps the micro-batch below the rows that fit (NOTE [ The divisor rule leaves rows unused ])."""


@dataclass(frozen=True)
class GrpoBatchSizes:
    """The batch numbers of a TRL GRPO/RLOO run sized from a token budget.

    Attributes:
        per_device_train_batch_size: rows in one micro-batch on one process.
        gradient_accumulation_steps: micro-batches per optimizer step on each process.
        steps_per_generation: micro-batches one generation batch feeds on each process.
        num_processes: data-parallel processes (TRL's ``world_size``).
        num_generations: completions per prompt.
        row_length: the longest row a micro-batch can have (prompt + completion, padded).
        token_budget: the budget ``C`` the micro-batch was sized for (padded cost).
        largest_fitting: the most rows of ``row_length`` the budget holds; the chosen
            ``per_device_train_batch_size`` is the largest divisor of the rows each process
            trains per optimizer step not above it (:meth:`unused_rows_note` says when that is
            fewer, and :meth:`generation_batch_sizes_using_every_row` which sizes would use them).
        limit_bytes: the peak the budget's probes were held to (``None``: a bare token count).
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_processes: int
    num_generations: int
    row_length: int
    token_budget: int
    largest_fitting: int
    limit_bytes: int | None = None

    @property
    def generation_batch_size(self) -> int:
        """Sequences generated at once over all processes (TRL derives it the same way)."""
        return self.per_device_train_batch_size * self.num_processes * self.steps_per_generation

    @property
    def sequences_per_step(self) -> int:
        """Sequences in one optimizer step over all processes."""
        return self.per_device_train_batch_size * self.num_processes * self.gradient_accumulation_steps

    @property
    def micro_batch_tokens(self) -> int:
        """The padded cost of the largest micro-batch: rows × ``row_length`` (``<= token_budget``)."""
        return self.per_device_train_batch_size * self.row_length

    @property
    def optimizer_steps_per_generation(self) -> int:
        """Optimizer steps one generation batch feeds (``steps_per_generation / gradient_accumulation_steps``)."""
        return self.steps_per_generation // self.gradient_accumulation_steps

    @property
    def rows_per_step(self) -> int:
        """Rows each process trains per optimizer step (``per_device_train_batch_size × gradient_accumulation_steps``)."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def generation_batch_sizes_using_every_row(self) -> tuple[int, ...]:
        """The ``generation_batch_size`` nearest below and above this one whose micro-batches hold all :attr:`largest_fitting` rows.

        NOTE [ The divisor rule leaves rows unused ]: the micro-batch must divide :attr:`rows_per_step`,
        so it holds all ``largest_fitting`` rows only when ``generation_batch_size`` is a multiple of
        ``lcm(num_generations, optimizer_steps_per_generation × num_processes × largest_fitting)``
        (whole prompt groups, whole optimizer steps, whole micro-batches on every process).
        Empty when every row that fits is used already.

        Example:
            >>> s = plan_grpo_batches(3584, row_length=512, num_generations=8, generation_batch_size=64, num_processes=2)
            >>> s.per_device_train_batch_size, s.largest_fitting, s.generation_batch_sizes_using_every_row()  # 32 rows each: 4 of 7
            (4, 7, (56, 112))
        """
        if self.per_device_train_batch_size >= min(self.largest_fitting, self.rows_per_step):
            return ()
        step = math.lcm(self.num_generations, self.optimizer_steps_per_generation * self.num_processes * self.largest_fitting)
        below = self.generation_batch_size // step * step
        return tuple(g for g in (below, below + step) if g > 0)

    def unused_rows_note(self) -> str | None:
        """One sentence when the divisor rule keeps the micro-batch below :attr:`largest_fitting`, with the fix; else ``None``."""
        better = self.generation_batch_sizes_using_every_row()
        if not better:
            return None
        choices = " or ".join(f"generation_batch_size={g}" for g in better)
        return (
            f"{self.largest_fitting} rows of {self.row_length} tokens fit the budget of {self.token_budget:,} tokens, "
            f"but per_device_train_batch_size must divide the {self.rows_per_step} rows each process trains per "
            f"optimizer step (generation_batch_size={self.generation_batch_size} / optimizer_steps_per_generation="
            f"{self.optimizer_steps_per_generation} / {self.num_processes} process(es)), so it is "
            f"{self.per_device_train_batch_size}; {choices} would use all {self.largest_fitting}"
        )

    def config_fields(self) -> dict[str, int]:
        """The three fields to give TRL's config (it derives ``generation_batch_size`` from them)."""
        return {
            "per_device_train_batch_size": self.per_device_train_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "steps_per_generation": self.steps_per_generation,
        }


def padded_row_length(max_prompt_length: int, max_completion_length: int, pad_to_multiple_of: int | None = None) -> int:
    """The longest row TRL's GRPO trains on: prompt and completion, each padded up to ``pad_to_multiple_of``.

    NOTE [ TRL's batch rules ]: prompts are left-padded and completions right-padded separately.

    Raises:
        InvalidArgument: a length below 1, or ``pad_to_multiple_of`` not ``None`` nor a positive integer.

    Example:
        >>> padded_row_length(100, 250, 64)  # 128 + 256
        384
    """
    prompt = check_positive_int("max_prompt_length", max_prompt_length)
    completion = check_positive_int("max_completion_length", max_completion_length)
    if pad_to_multiple_of is None:
        return prompt + completion
    multiple = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
    return math.ceil(prompt / multiple) * multiple + math.ceil(completion / multiple) * multiple


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def plan_grpo_batches(
    tokens: int,
    *,
    row_length: int,
    num_generations: int,
    generation_batch_size: int,
    num_processes: int = 1,
    optimizer_steps_per_generation: int = 1,
    limit_bytes: int | None = None,
) -> GrpoBatchSizes:
    """Size TRL's micro-batches under a padded token budget, keeping every rule of NOTE [ TRL's batch rules ].

    One generation batch of ``generation_batch_size`` sequences (over all processes) feeds
    ``optimizer_steps_per_generation`` optimizer steps (1: on-policy, one step per generation;
    more: the generation batch is cut into that many mini-batches). The micro-batch is the
    largest ``per_device_train_batch_size`` whose padded cost (rows × ``row_length``) stays within
    ``tokens`` and that divides the rows each process trains per optimizer step, so that
    ``gradient_accumulation_steps`` and ``steps_per_generation`` are whole numbers.

    Args:
        tokens: the token budget ``C`` (padded cost: rows × longest row) of one micro-batch.
        row_length: the longest row (:func:`padded_row_length`).
        num_generations: completions per prompt (TRL's ``num_generations``, at least 2).
        generation_batch_size: sequences generated at once over all processes.
        num_processes: data-parallel processes.
        optimizer_steps_per_generation: optimizer steps one generation batch feeds.
        limit_bytes: the peak the budget was held to, kept in the result for reports.

    Returns:
        :class:`GrpoBatchSizes`; ``steps_per_generation == optimizer_steps_per_generation ×
        gradient_accumulation_steps``.

    Raises:
        InvalidArgument: a count that is not a positive integer.
        BudgetError: one row of ``row_length`` costs more than ``tokens``.
        BatchConfigError: every rule the numbers break, each naming the fields, values and a fix.

    Example:
        >>> s = plan_grpo_batches(4096, row_length=512, num_generations=8, generation_batch_size=64, num_processes=2)
        >>> s.per_device_train_batch_size, s.gradient_accumulation_steps, s.steps_per_generation  # 8 rows fit, 32 per process
        (8, 4, 4)
    """
    tokens = check_positive_int("tokens", tokens)
    row_length = check_positive_int("row_length", row_length)
    num_generations = check_positive_int("num_generations", num_generations)
    generation_batch_size = check_positive_int("generation_batch_size", generation_batch_size)
    num_processes = check_positive_int("num_processes", num_processes)
    k = check_positive_int("optimizer_steps_per_generation", optimizer_steps_per_generation)
    if limit_bytes is not None:
        limit_bytes = check_int("limit_bytes", limit_bytes, minimum=0)
    cap = tokens // row_length
    if cap < 1:
        raise BudgetError(
            f"one row of row_length={row_length} tokens (max_prompt_length + max_completion_length, padded) costs "
            f"more than the token budget of {tokens}; lower max_completion_length or the prompt length, or profile "
            "with more memory, activation checkpointing or a sharded model"
        )
    faults = []
    if num_generations < 2:
        faults.append(
            f"num_generations={num_generations}: GRPO needs at least 2 completions per prompt for its advantages "
            "(TRL's GRPOConfig); set num_generations >= 2"
        )
    if generation_batch_size % num_generations:
        lower = generation_batch_size // num_generations * num_generations
        faults.append(
            f"generation_batch_size={generation_batch_size} must be a multiple of num_generations={num_generations} "
            f"(whole prompt groups, TRL's GRPOConfig); use {lower or num_generations} or "
            f"{lower + num_generations}"
        )
    if generation_batch_size % k:
        faults.append(
            f"generation_batch_size={generation_batch_size} must split into optimizer_steps_per_generation={k} "
            f"equal optimizer steps; use a multiple of {k}"
        )
    elif (generation_batch_size // k) % num_processes:
        per_step = generation_batch_size // k
        faults.append(
            f"each optimizer step's {per_step} sequences (generation_batch_size={generation_batch_size} / "
            f"optimizer_steps_per_generation={k}) must split evenly over num_processes={num_processes}; use a "
            f"generation_batch_size that is a multiple of {k * num_processes}"
        )
    if faults:
        raise BatchConfigError(faults)
    rows_per_step = generation_batch_size // k // num_processes
    rows = _largest_divisor_at_most(rows_per_step, cap)
    accumulation = rows_per_step // rows
    return GrpoBatchSizes(
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=k * accumulation,
        num_processes=num_processes,
        num_generations=num_generations,
        row_length=row_length,
        token_budget=tokens,
        largest_fitting=cap,
        limit_bytes=limit_bytes,
    )


def _budget_tokens(budget: TokenBudget | ModelProfile | int) -> tuple[int, int | None, int | None]:
    """``(tokens, max_seq_len, limit_bytes)`` of a padded budget."""
    if isinstance(budget, ModelProfile):
        budget = budget.combined
    if isinstance(budget, TokenBudget):
        if budget.cost != "padded":
            raise BudgetError(
                f"TRL pads every micro-batch to its longest row, so its budget must count padded tokens, but got "
                f"a budget with cost={budget.cost!r}; profile with cost='padded' (--cost padded)"
            )
        return budget.tokens, budget.max_seq_len, budget.limit_bytes
    return check_positive_int("budget", budget), None, None


def _config_class(name: str) -> type:
    try:
        import trl
    except ImportError as exc:  # the optional extra
        raise InvalidArgument("batchfit.integrations.trl needs TRL: pip install -e '.[trl]' in batchfit's checkout (with -c constraints-cpu.txt on a CPU-only machine)") from exc
    return getattr(trl, name)


def _default(config_class: type, name: str) -> Any:
    for f in dataclasses.fields(config_class):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else f.default_factory()
    raise InvalidArgument(f"{config_class.__name__} has no field {name!r}")


def grpo_config(
    budget: TokenBudget | ModelProfile | int,
    *,
    max_prompt_length: int,
    generation_batch_size: int,
    optimizer_steps_per_generation: int = 1,
    config_class: type | None = None,
    model: Any = None,
    **config_kwargs: Any,
) -> Any:
    """TRL's ``GRPOConfig`` (or ``config_class``, e.g. ``RLOOConfig``) with its micro-batches sized to ``budget``.

    ``config_kwargs`` are the config's own fields, as for TRL; ``num_generations``,
    ``max_completion_length`` and ``pad_to_multiple_of`` are read from them (or the class
    defaults), and the number of processes from the config TRL builds (its ``world_size``:
    under ``torchrun``, every rank calls this and gets the same numbers). The sizes are
    :func:`plan_grpo_batches`'s; :func:`grpo_batch_sizes` of the result gives them back.

    Given a :class:`~batchfit.budget.ModelProfile`, both phases of the run are checked on the
    config TRL built (:func:`~batchfit.integrations.trl_generation.check_trl_phases`): a colocated
    vLLM's reserve must be in the profile (profile with
    :func:`~batchfit.integrations.trl_generation.trl_engine_reserve`), and generating
    ``generation_batch_size`` sequences must fit beside the trainer's state. What does not fit is
    refused, with both figures and the largest ``generation_batch_size`` that fits; it is never
    resized (NOTE [ Both phases, refused not resized ]).

    Args:
        budget: a padded :class:`~batchfit.budget.TokenBudget` (one rank's), a
            :class:`~batchfit.budget.ModelProfile` (its ``combined`` budget; both phases checked) or
            a token count (the training phase only).
        max_prompt_length: the longest prompt in tokens (TRL does not truncate prompts), of the
            whole dataset: :func:`batchfit.integrations.trl_prompts.longest_prompt` reads it from
            every row as ``GRPOTrainer`` tokenizes it.
        generation_batch_size: sequences generated at once over all processes.
        optimizer_steps_per_generation: optimizer steps one generation batch feeds.
        config_class: TRL's config class (default ``trl.GRPOConfig``).
        model: the model the profile measured (preset, directory, hub id, config or module),
            for the generation phase's KV cache; default the profile's own name (pass it when the
            profile was taken of a model object).
        config_kwargs: any other field of the config (``output_dir``, ``num_generations``, …);
            the fields batchfit sets (:data:`SIZED_FIELDS`) are refused.

    Returns:
        the config, built by TRL (so TRL's own checks ran on it).

    Warns:
        UnusedRowsWarning: the micro-batch is below the rows that fit, because it must divide the
            rows each process trains per optimizer step; the message names the
            ``generation_batch_size`` values that would use them all (NOTE [ The divisor rule
            leaves rows unused ]).

    Raises:
        InvalidArgument: TRL is not installed, a field of :data:`SIZED_FIELDS` was given,
            ``auto_find_batch_size=True``, or a bad count.
        BudgetError: a budget that counts packed tokens, or one row does not fit, or the row
            is longer than the budget's ``max_seq_len``; a profile without the colocated vLLM's
            reserve (the message gives it), or whose model's config cannot be read (pass ``model``).
        DoesNotFitError: the generation phase does not fit (one line: what it needs, the limit, the
            largest ``generation_batch_size`` that fits and the vLLM fraction that would).
        BatchConfigError: the numbers break TRL's rules (NOTE [ TRL's batch rules ]).

    Example (needs TRL)::

        profile = profile_model(model, max_seq_len=512, backend="estimate", memory_limit="24GiB")
        args = grpo_config(profile, max_prompt_length=128, generation_batch_size=64,
                           output_dir="out", num_generations=8, max_completion_length=384)
    """
    config_class = _config_class("GRPOConfig") if config_class is None else config_class
    _check_config_kwargs(config_kwargs)
    tokens, max_seq_len, limit_bytes = _budget_tokens(budget)
    num_generations = config_kwargs.get("num_generations", _default(config_class, "num_generations"))
    completion = config_kwargs.get("max_completion_length", _default(config_class, "max_completion_length"))
    multiple = config_kwargs.get("pad_to_multiple_of", _default(config_class, "pad_to_multiple_of"))
    row_length = padded_row_length(max_prompt_length, completion, None if multiple in (None, "auto") else multiple)
    if max_seq_len is not None and row_length > max_seq_len:
        raise BudgetError(
            f"a row of {row_length} tokens (max_prompt_length={max_prompt_length} + max_completion_length="
            f"{completion}) is longer than the budget covers (max_seq_len={max_seq_len}); profile with "
            f"max_seq_len={row_length}"
        )
    sizes = plan_grpo_batches(
        tokens,
        row_length=row_length,
        num_generations=num_generations,
        generation_batch_size=generation_batch_size,
        num_processes=_world_size(config_class, num_generations, config_kwargs),
        optimizer_steps_per_generation=optimizer_steps_per_generation,
        limit_bytes=limit_bytes,
    )
    args = _build(config_class, config_kwargs, sizes.config_fields())
    if isinstance(budget, ModelProfile):
        _check_phases(budget, args, model, max_prompt_length, generation_batch_size, optimizer_steps_per_generation)
    note = sizes.unused_rows_note()
    if note is not None:  # NOTE [ The divisor rule leaves rows unused ]: said, not silent
        warnings.warn(note, UnusedRowsWarning, stacklevel=2)
    return args


def _check_phases(
    profile: ModelProfile, args: Any, model: Any, max_prompt_length: int, generation_batch_size: int, k: int
) -> None:
    """Both phases of the run TRL's built config ``args`` describes (NOTE [ Both phases, refused not resized ])."""
    from batchfit.integrations.trl_generation import check_trl_phases, trl_config_fields

    check_trl_phases(
        profile,
        model=model,
        max_prompt_length=max_prompt_length,
        generation_batch_size=generation_batch_size,
        optimizer_steps_per_generation=k,
        **trl_config_fields(args),
    )


def _check_config_kwargs(config_kwargs: dict[str, Any]) -> None:
    given = sorted(set(SIZED_FIELDS) & set(config_kwargs))
    if given:
        raise InvalidArgument(
            f"batchfit sets {', '.join(SIZED_FIELDS[:3])}, but got {given[0]}={config_kwargs[given[0]]!r}; drop it "
            "(pass generation_batch_size and optimizer_steps_per_generation instead)"
        )
    if config_kwargs.get("auto_find_batch_size"):
        raise InvalidArgument(
            "auto_find_batch_size=True halves the batch on OOM and breaks TRL's prompt groups (TRL refuses it for "
            "GRPO and RLOO); drop it: batchfit sizes the batch from the budget"
        )


def _world_size(config_class: type, num_generations: int, config_kwargs: dict[str, Any]) -> int:
    """TRL's ``world_size``, read from a config TRL builds (one whole prompt group per process passes its checks)."""
    probe = _build(
        config_class,
        config_kwargs,
        {
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "generation_batch_size": None,
            "steps_per_generation": num_generations,
        },
    )
    return probe.world_size


def _build(config_class: type, config_kwargs: dict[str, Any], sized: dict[str, Any]) -> Any:
    """``config_class(**config_kwargs, **sized)``, TRL's and transformers' refusals raised as :class:`InvalidArgument`.

    NOTE [ bf16 on a machine without it ]: TRL's configs default ``bf16`` to ``not fp16``
    (``trl/trainer/base_config.py`` ``__post_init__``, TRL 1.16), and transformers'
    ``TrainingArguments._validate_args`` then refuses a machine without bf16 on a GPU
    ("Your setup doesn't support bf16/gpu", unless ``use_cpu``) using
    ``transformers.utils.is_torch_bf16_gpu_available``; the same check is made here first, so
    the refusal names the field, where its value came from and the fixes.
    """
    _check_bf16(config_class, config_kwargs)
    try:
        return config_class(**config_kwargs, **sized)
    except ValueError as exc:
        if isinstance(exc, InvalidArgument | BatchConfigError | BudgetError):
            raise
        raise InvalidArgument(
            f"{config_class.__name__} refused the fields given: {exc} (fix the field it names; batchfit set "
            f"{', '.join(f'{k}={v}' for k, v in sized.items() if v is not None)})"
        ) from exc


def _bf16_available() -> bool:
    """transformers' own test of bf16 on this machine (``TrainingArguments._validate_args``'s)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(is_torch_bf16_gpu_available() or is_torch_xla_available())


def _check_bf16(config_class: type, config_kwargs: dict[str, Any]) -> None:
    """NOTE [ bf16 on a machine without it ]."""
    names = {f.name for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else set()
    if "bf16" not in names or config_kwargs.get("use_cpu"):
        return
    given = config_kwargs.get("bf16", _default(config_class, "bf16"))
    bf16 = (not config_kwargs.get("fp16", False)) if given is None else bool(given)  # TRL's base_config rule
    if not bf16 and not config_kwargs.get("bf16_full_eval"):
        return
    if _bf16_available():
        return
    where = "bf16=True" if given else f"bf16={given!r}, which {config_class.__name__} turns into True when fp16 is not set"
    raise InvalidArgument(
        f"{config_class.__name__} trains in bf16 ({where}), but this machine has no GPU with bf16 "
        "(transformers' is_torch_bf16_gpu_available() is False: no GPU, or one older than Ampere), and "
        "transformers refuses it; call grpo_config on the machine that trains, or pass use_cpu=True (bf16 on the "
        "CPU) or bf16=False (fp32)"
    )


def token_budget_grpo_config(
    *,
    generation_batch_size: int,
    optimizer_steps_per_generation: int = 1,
    config_class: type | None = None,
    profile: ModelProfile | None = None,
    max_prompt_length: int | None = None,
    model: Any = None,
    **config_kwargs: Any,
) -> Any:
    """TRL's ``GRPOConfig`` for :class:`~batchfit.integrations.trl_packed.TokenBudgetGRPOTrainer`: one TRL micro-batch per optimizer step.

    ``per_device_train_batch_size`` is every row one optimizer step trains on a process,
    ``gradient_accumulation_steps`` is 1 and ``steps_per_generation`` is
    ``optimizer_steps_per_generation``: the trainer cuts each step's rows into packed
    micro-batches under its token budget, so TRL's micro-batch is no longer what bounds memory.
    TRL's rules hold as for :func:`grpo_config` (NOTE [ TRL's batch rules ]). Given the
    trainer's ``profile`` (and ``max_prompt_length``), TRL's generation phase is checked as
    :func:`grpo_config` checks it: the token budget bounds the micro-batches, not the generation.

    Raises:
        InvalidArgument, BatchConfigError: as :func:`grpo_config`; ``profile`` without ``max_prompt_length``.
        BudgetError, DoesNotFitError: the generation phase, as :func:`grpo_config`.
    """
    config_class = _config_class("GRPOConfig") if config_class is None else config_class
    _check_config_kwargs(config_kwargs)
    num_generations = config_kwargs.get("num_generations", _default(config_class, "num_generations"))
    # every row of a step in one TRL micro-batch: rows of one token under a budget of the whole generation batch
    sizes = plan_grpo_batches(
        check_positive_int("generation_batch_size", generation_batch_size),
        row_length=1,
        num_generations=num_generations,
        generation_batch_size=generation_batch_size,
        num_processes=_world_size(config_class, num_generations, config_kwargs),
        optimizer_steps_per_generation=optimizer_steps_per_generation,
    )
    if profile is not None and max_prompt_length is None:
        raise InvalidArgument(
            "the generation phase needs the longest prompt, but got profile= without max_prompt_length; pass "
            "max_prompt_length (TRL does not truncate prompts)"
        )
    args = _build(config_class, config_kwargs, sizes.config_fields())
    if profile is not None:
        _check_phases(profile, args, model, max_prompt_length, generation_batch_size, optimizer_steps_per_generation)
    return args


def grpo_batch_sizes(config: Any, *, row_length: int, token_budget: int, limit_bytes: int | None = None) -> GrpoBatchSizes:
    """The :class:`GrpoBatchSizes` a built TRL config holds (for reports and checks)."""
    rows = config.per_device_train_batch_size
    return GrpoBatchSizes(
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        steps_per_generation=config.steps_per_generation,
        num_processes=config.world_size,
        num_generations=config.num_generations,
        row_length=row_length,
        token_budget=token_budget,
        largest_fitting=token_budget // row_length,
        limit_bytes=limit_bytes,
    )
