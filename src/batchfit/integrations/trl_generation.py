"""TRL's generation phase on the trainer's GPU: its peak, the colocated vLLM's share, and the check of both phases.

TRL's GRPO (and RLOO) generates between training steps on the very GPU that trains: with the
policy's own ``generate`` (the default), or a vLLM engine inside the trainer's process
(``use_vllm=True, vllm_mode="colocate"``), or a vLLM server on GPUs of its own
(``vllm_mode="server"``). A token budget bounds the training step only; this module bounds the
generation phase too. :func:`kv_cache_bytes` and :func:`generation_phase_bytes` are the
arithmetic (no TRL, no torch work); :func:`measure_prefill_bytes` measures the prefill with the
estimate backend; :func:`trl_engine_reserve` gives what a TRL run's vLLM keeps on each GPU while
the trainer steps (profile with it: ``profile_model(..., engine=trl_engine_reserve(...))``);
:func:`check_trl_phases` checks a :class:`~batchfit.budget.ModelProfile` against both phases,
which :func:`batchfit.integrations.trl.grpo_config` calls. Nothing here imports TRL.

NOTE [ How TRL generates ]
Read from TRL 1.16.0 (``trl/trainer/grpo_trainer.py``, ``trl/generation/vllm_generation.py``,
``trl/models/utils.py``):

- **One local generation batch at once.** ``get_train_dataloader`` (grpo_trainer.py l. 1258-1275)
  yields ``per_device_train_batch_size × steps_per_generation`` rows per process, which is
  ``generation_batch_size / num_processes`` (NOTE [ TRL's batch rules ] in
  :mod:`batchfit.integrations.trl`); ``_prepare_inputs`` (l. 1522-1548) generates for all of them
  once and splits the result into micro-batches afterwards.
- **Without vLLM** ``_generate_single_turn`` (l. 1814-1875) left-pads every local prompt into one
  tensor (``pad(..., padding_side="left", pad_to_multiple_of=...)``) and calls
  ``unwrapped_model.generate(**generate_inputs, generation_config=self.generation_config)`` once,
  under ``torch.no_grad()``, with gradient checkpointing switched off
  (``_unwrap_model_for_generation``, models/utils.py l. 135-138). The rows are never chunked:
  ``generation_kwargs`` only reach the ``GenerationConfig`` (l. 1155-1175:
  ``max_new_tokens=max_completion_length, do_sample=True``, ``top_p``, ``top_k``, ``temperature``,
  ``cache_implementation``). ``use_transformers_continuous_batching`` runs ``generate_batch``
  (l. 1784-1808), a paged cache sized by its own config: not modelled here.
- **The trainer's state meanwhile**: parameters (a LoRA model's frozen base too), buffers, and
  the optimizer state from the first optimizer step on. Gradients are freed: transformers'
  ``Trainer`` calls ``model.zero_grad()`` after every optimizer step (transformers 5.24
  ``trainer.py`` l. 1954, ``set_to_none``), and TRL generates at the first micro-batch of an
  optimizer step (``steps_per_generation`` is a multiple of ``gradient_accumulation_steps``).
- **Colocated vLLM** (vllm_generation.py l. 311-368): ``LLM(gpu_memory_utilization=
  vllm_gpu_memory_utilization, max_num_seqs=per_device_train_batch_size ×
  vllm_tensor_parallel_size × steps_per_generation`` (grpo_trainer.py l. 1124-1126)``,
  distributed_executor_backend="external_launcher", enable_sleep_mode=vllm_enable_sleep_mode)``:
  in the trainer's own process (no CUDA context of its own), vLLM's default CUDA graphs. With
  ``vllm_enable_sleep_mode`` it sleeps at level 2 after creation and after every generate
  (l. 365-368, 750-752) and wakes ``weights`` before a weight sync (l. 489-491) and
  ``kv_cache`` before generating (l. 704-705); without it, weights, KV cache and graphs stay
  resident through the training step. vLLM refuses to start unless
  ``gpu_memory_utilization × total`` is free (:func:`batchfit.budget.engine.check_awake_phase`).
- **Server mode**: the engine runs elsewhere (``vllm_client``); nothing on the trainer's GPUs.

NOTE [ What generate holds ]
transformers 5.24, ``generation/utils.py`` ``_sample`` (l. 3200-3290) and ``cache_utils.py``:

- The KV cache, ``DynamicCache`` (l. 2326): per layer keys and values
  ``[rows, num_key_value_heads, tokens, head_dim]`` in the compute dtype (``DynamicLayer``,
  l. 104-138); a sliding-window layer keeps at most its window (``DynamicSlidingWindowLayer``,
  l. 196-250; counted as the whole window); an MLA model (DeepSeek-V3) caches full keys of
  ``qk_nope_head_dim + qk_rope_head_dim`` and values of ``v_head_dim`` per head. The last forward
  holds ``prompt + completion - 1`` positions. Each step ``torch.cat``'s the new token onto a
  layer's keys, then its values: the old tensor lives until the new one replaces it, so one
  layer's keys are held twice for a moment.
- The prefill: one forward of ``rows × prompt`` tokens with ``logits_to_keep=1`` (l. 2952-2956),
  its MLP and attention temporaries far above a decode step's.
- Sampling: each step copies the last logits to fp32, runs the logits processors (none with TRL's
  defaults: temperature 1, ``top_k=0``, ``top_p=1``), takes the probabilities and samples; the
  previous step's copy and probabilities live until they are rebound, so they sit beside the next
  forward's ``torch.cat``. ``input_ids`` and the attention mask grow by ``torch.cat`` (int64, old
  and new beside each other), and the positions are computed per row from the mask.

What is measured and what is arithmetic:

- *measured by the profile*: the trainer's resident state (its breakdown's ``parameters``,
  ``buffers``, ``optimizer_state`` and ``communication`` at the policy's binding point);
- *measured here* (estimate backend, :func:`measure_prefill_bytes`): the prefill, a ``no_grad``
  forward of ``rows × prompt`` tokens of the profiled model (its dtype, LoRA, FSDP sharding) with
  a left-padded attention mask, ``generate``'s per-row positions, ``use_cache=True`` and
  ``logits_to_keep=1``, its cache included; deep uniform models from two shallow depths (NOTE
  [ Peak memory is affine in depth ]);
- *arithmetic*: the KV cache at its longest (:func:`kv_cache_bytes`), the ``torch.cat`` of one
  layer's keys beside the previous step's sampling (:data:`PREVIOUS_STEP_BYTES_PER_LOGIT`), the
  sampling step (:meth:`Sampling.step_bytes`: the logits in the compute dtype +
  :data:`SAMPLING_BYTES_PER_LOGIT`, + :data:`PROCESSOR_BYTES_PER_LOGIT` with a logits processor,
  + :data:`TOP_P_BYTES_PER_LOGIT` with ``top_p < 1``, per row and vocabulary entry) and the ids,
  mask and positions (:data:`TOKEN_BYTES_PER_ROW` per row and position). The constants were read
  off the live tensors of real CPU ``generate`` runs (tiny Llama, vocabulary 8,192, fp32: at the
  sampling peak the step's logits, its fp32 copy, the previous copy and probabilities, 16 B per
  logit; with ``top_p=0.9`` 38 B); ``tests/test_trl_generation.py`` holds the whole prediction
  against real ``generate`` runs under the cpu tracker (0.3–4.5% above, never below).

The peak is the resident state + the larger of the prefill's bytes and the last decode step's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.budget import ModelProfile
from batchfit.budget.engine import EngineReserve, awake_engine_bytes, check_awake_phase, engine_reserve
from batchfit.errors import BudgetError, DoesNotFitError, InvalidArgument
from batchfit.memory.sizes import format_bytes, parse_memory
from batchfit.plan.placement import RolloutEngine
from batchfit.validation import check_bool, check_choice, check_int, check_number, check_positive_int

__all__ = [
    "GENERATION_WAYS",
    "PHASE_FIELDS",
    "PREVIOUS_STEP_BYTES_PER_LOGIT",
    "PROCESSOR_BYTES_PER_LOGIT",
    "RESIDENT_CATEGORIES",
    "SAMPLING_BYTES_PER_LOGIT",
    "SAMPLING_FIELDS",
    "TOKEN_BYTES_PER_ROW",
    "TOP_P_BYTES_PER_LOGIT",
    "VLLM_MODES",
    "GenerationPhase",
    "Sampling",
    "check_trl_phases",
    "generation_phase_bytes",
    "generation_way",
    "kv_cache_bytes",
    "measure_prefill_bytes",
    "resident_bytes",
    "trl_config_fields",
    "trl_engine_reserve",
    "trl_rollout_engine",
]

#: How TRL generates (NOTE [ How TRL generates ]): the policy's own ``generate``, a vLLM engine in the
#: trainer's process, a vLLM server on other GPUs, transformers' continuous batching (not modelled).
GENERATION_WAYS = ("transformers", "vllm_colocate", "vllm_server", "continuous_batching")
#: TRL's ``vllm_mode`` values (``grpo_config.py``).
VLLM_MODES = ("colocate", "server")
#: The profile's categories the trainer keeps on the GPU while it generates (NOTE [ How TRL generates ]).
RESIDENT_CATEGORIES = ("parameters", "buffers", "optimizer_state", "communication")
#: Sampling's bytes per row and vocabulary entry beside the step's logits (in the compute dtype): their fp32
#: copy, the probabilities and the previous step's fp32 copy, not yet rebound (NOTE [ What generate holds ]).
SAMPLING_BYTES_PER_LOGIT = 12
#: What a logits processor adds (temperature, top-k, min-p, repetition penalty): its output, and the previous step's.
PROCESSOR_BYTES_PER_LOGIT = 8
#: What ``top_p < 1`` adds beyond that: the sort's values and int64 indices, the cumulative sum.
TOP_P_BYTES_PER_LOGIT = 16
#: What the previous step's sampling still holds while the next forward runs: its fp32 logits and probabilities.
PREVIOUS_STEP_BYTES_PER_LOGIT = 8
#: ``input_ids``, the attention mask and the positions per row and position: int64, the first two old and new beside each other in ``torch.cat``.
TOKEN_BYTES_PER_ROW = 40


# ---------------------------------------------------------------- the arithmetic


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def _itemsize(dtype: Any) -> int:
    from batchfit.dtypes import parse_dtype

    return parse_dtype(dtype).itemsize


def _kv_widths(config: Any) -> tuple[int, int]:
    """Elements per token and layer of the cached keys and of the cached values (NOTE [ What generate holds ])."""
    heads = int(config.num_attention_heads)
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_nope_head_dim", None):
        # MLA as transformers runs it: full keys (nope + rope) and values per head are cached
        return heads * (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)), heads * int(config.v_head_dim)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    width = int(kv_heads) * int(head_dim)
    return width, width


def _layer_tokens(config: Any, tokens: int) -> list[int]:
    """The positions each decoder layer caches: ``tokens``, or at most its window for a sliding or chunked layer."""
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    out = []
    for kind in list(types)[:layers]:
        if kind in ("sliding_attention", "chunked_attention"):
            window = config.sliding_window if kind == "sliding_attention" else config.attention_chunk_size
            out.append(min(tokens, int(window)))
        else:
            out.append(tokens)
    return out


def kv_cache_bytes(config: Any, *, rows: int, tokens: int, dtype: Any = "bf16") -> int:
    """Bytes of transformers' ``DynamicCache`` holding ``rows`` sequences of ``tokens`` positions (NOTE [ What generate holds ]).

    Per layer ``2 × rows × num_key_value_heads × tokens × head_dim`` elements (keys and values),
    ``head_dim`` the config's own or ``hidden_size / num_attention_heads``; a sliding-window
    layer caches at most its window.

    Args:
        config: the model's transformers config (:func:`batchfit.models.load_config`).
        rows: sequences generated at once.
        tokens: positions cached per sequence (prompt + completion).
        dtype: the compute dtype (``"bf16"``, ``torch.float32``, ...).

    Raises:
        InvalidArgument: a count that is not a positive integer, or an unknown dtype.

    Example:
        >>> from batchfit.models import load_config
        >>> kv_cache_bytes(load_config("llama-3.1-8b"), rows=1, tokens=1)  # 32 layers × 2 × 8 heads × 128 × 2 B
        131072
    """
    rows = check_positive_int("rows", rows)
    tokens = check_positive_int("tokens", tokens)
    config = _text_config(config)
    keys, values = _kv_widths(config)
    return rows * sum(_layer_tokens(config, tokens)) * (keys + values) * _itemsize(dtype)


def _largest_cat(config: Any, rows: int, tokens: int, itemsize: int) -> int:
    """One layer's keys at ``tokens`` positions: what a decode step's ``torch.cat`` holds twice for a moment."""
    keys, values = _kv_widths(config)
    return rows * max(_layer_tokens(config, tokens)) * max(keys, values) * itemsize


@dataclass(frozen=True)
class Sampling:
    """TRL's sampling fields (``GRPOConfig``'s, TRL 1.16's defaults), as they change what a sampling step holds.

    ``generate`` adds a logits processor for a temperature other than 1, ``top_k`` not 0 (``None``
    is transformers' default, 50), ``top_p`` below 1, a ``min_p`` and a repetition penalty other
    than 1; with none, the step's logits are only copied to fp32 and turned into probabilities.

    Raises:
        InvalidArgument: a value outside its range (named as TRL names it).
    """

    temperature: float = 1.0
    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, low=0.0, low_open=True)
        if self.top_k is not None:
            check_int("top_k", self.top_k, minimum=0)
        check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        if self.min_p is not None:
            check_number("min_p", self.min_p, low=0.0, high=1.0)
        check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)

    @property
    def processors(self) -> bool:
        """``generate`` runs at least one logits processor."""
        return (
            self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.min_p is not None
            or self.repetition_penalty != 1.0
        )  # fmt: skip

    def step_bytes(self, rows: int, vocab_size: int, itemsize: int) -> int:
        """What a sampling step holds: ``rows × vocab × (itemsize + 12 [+ 8 processors] [+ 16 top_p])``."""
        per_logit = itemsize + SAMPLING_BYTES_PER_LOGIT
        per_logit += (PROCESSOR_BYTES_PER_LOGIT if self.processors else 0) + (TOP_P_BYTES_PER_LOGIT if self.top_p < 1 else 0)
        return rows * vocab_size * per_logit

    def previous_bytes(self, rows: int, vocab_size: int) -> int:
        """What the previous step's sampling holds during the next forward (its fp32 logits, probabilities, scores)."""
        return rows * vocab_size * (PREVIOUS_STEP_BYTES_PER_LOGIT + (PROCESSOR_BYTES_PER_LOGIT // 2 if self.processors else 0))


@dataclass(frozen=True)
class GenerationPhase:
    """One process's memory while TRL generates, term by term; ``fits`` compares ``needed_bytes`` with ``available_bytes``.

    Attributes:
        way: how TRL generates, one of :data:`GENERATION_WAYS`.
        rows: the sequences one process generates at once (``generation_batch_size / num_processes``).
        prompt_tokens: the longest prompt, padded as TRL pads it.
        completion_tokens: ``max_completion_length``.
        resident_bytes: the trainer's state kept on the GPU meanwhile (and other colocated models').
        kv_cache_bytes: the KV cache at its longest (``prompt + completion - 1`` positions; 0 with vLLM).
        prefill_bytes: the prefill's own peak (its cache included), measured, with sampling and ids.
        decode_bytes: the last decode step's own peak: the KV cache, one layer's keys twice, sampling, ids
            (and the gathered layers of a sharded model).
        engine_bytes: the colocated vLLM's share while it generates (``gpu_memory_utilization × total``).
        untracked_bytes: the trainer's memory outside its tensors (CUDA context, workspaces), vLLM only.
        limit_bytes: what ``needed_bytes`` may reach: the profile's limit (generate), the device (vLLM).
        engine_weight_bytes: the served model's weights on one GPU (vLLM colocate; 0 otherwise).
        engine_rows: the rows of ``prompt + completion`` tokens vLLM's KV share holds at once (vLLM colocate).
        min_fraction, max_fraction: the ``vllm_gpu_memory_utilization`` the engine needs (its weights and
            one row's KV cache) and the most the trainer's state leaves (vLLM colocate; ``None`` otherwise).
        description: the model and dtype the KV cache was counted for, for messages.
    """

    way: str
    rows: int
    prompt_tokens: int
    completion_tokens: int
    resident_bytes: int
    kv_cache_bytes: int = 0
    prefill_bytes: int = 0
    decode_bytes: int = 0
    engine_bytes: int = 0
    untracked_bytes: int = 0
    limit_bytes: int | None = None
    engine_weight_bytes: int = 0
    engine_rows: int | None = None
    min_fraction: float | None = None
    max_fraction: float | None = None
    description: str = ""

    @property
    def needed_bytes(self) -> int:
        """The phase's peak: resident + the larger of prefill and decode (generate), resident + untracked + vLLM's share."""
        if self.way == "transformers":
            return self.resident_bytes + max(self.prefill_bytes, self.decode_bytes)
        if self.way == "vllm_colocate":
            return self.resident_bytes + self.untracked_bytes + self.engine_bytes
        return 0

    @property
    def fits(self) -> bool:
        """The phase fits (always, where there is no limit or nothing is on the trainer's GPU)."""
        return self.limit_bytes is None or self.needed_bytes <= self.limit_bytes

    def describe(self) -> str:
        """The terms in words, one line."""
        if self.way == "vllm_server":
            return "vLLM server on GPUs of its own: nothing on the trainer's GPU"
        if self.way == "continuous_batching":
            return "transformers' continuous batching (paged cache sized by its own config): not modelled"
        head = f"{self.rows} rows of up to {self.prompt_tokens} + {self.completion_tokens} tokens"
        if self.way == "vllm_colocate":
            return (
                f"{head} in the colocated vLLM: its share {format_bytes(self.engine_bytes)} + the trainer's state "
                f"{format_bytes(self.resident_bytes)} + {format_bytes(self.untracked_bytes)} outside its tensors = "
                f"{format_bytes(self.needed_bytes)} of {format_bytes(self.limit_bytes)}"
            )
        return (
            f"{head} in one generate: the trainer's state {format_bytes(self.resident_bytes)} + the larger of the "
            f"prefill {format_bytes(self.prefill_bytes)} and the last decode step {format_bytes(self.decode_bytes)} "
            f"(KV cache {format_bytes(self.kv_cache_bytes)}{', ' + self.description if self.description else ''}) = "
            f"{format_bytes(self.needed_bytes)} of the limit {format_bytes(self.limit_bytes)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The terms, the peak and the verdict (JSON-ready)."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        out.update(needed_bytes=self.needed_bytes, fits=self.fits)
        return out


def generation_phase_bytes(
    config: Any,
    *,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    resident_bytes: int,
    prefill_bytes: int,
    dtype: Any = "bf16",
    sampling: Sampling | None = None,
    gathered_bytes: int = 0,
    limit_bytes: int | None = None,
) -> GenerationPhase:
    """The peak of TRL's ``generate`` on one process (NOTE [ What generate holds ]): arithmetic around a measured prefill.

    With ``T = prompt + completion - 1`` positions in the last forward, ``decode_bytes`` = the KV
    cache at ``T`` + the ids and mask (:data:`TOKEN_BYTES_PER_ROW` per row and position) + the
    larger of (one layer's keys at ``T - 1``, the ``torch.cat``, beside the previous step's
    sampling) and the sampling step itself (:meth:`Sampling.step_bytes`) + ``gathered_bytes``;
    ``prefill_bytes`` gets its ids and mask added.

    Args:
        config: the model's transformers config.
        rows: sequences generated at once on the process.
        prompt_tokens: the longest prompt, padded (TRL left-pads to ``pad_to_multiple_of``).
        completion_tokens: ``max_completion_length``.
        resident_bytes: the trainer's state on the GPU meanwhile (:data:`RESIDENT_CATEGORIES` of a profile).
        prefill_bytes: the prefill forward's own peak, its cache included (:func:`measure_prefill_bytes`).
        dtype: the compute dtype (the KV cache's and the logits').
        sampling: TRL's sampling fields (default: TRL's defaults, no logits processor).
        gathered_bytes: the layers a sharded model gathers for each forward (the prefill measurement's).
        limit_bytes: the limit the peak is compared with (``None``: none).

    Raises:
        InvalidArgument: a count that is not a positive integer, a negative byte count or a bad dtype.

    Example:
        >>> from batchfit.models import load_config
        >>> phase = generation_phase_bytes(load_config("tiny"), rows=2, prompt_tokens=8, completion_tokens=9,
        ...                                resident_bytes=1000, prefill_bytes=0, dtype="fp32")
        >>> phase.kv_cache_bytes  # 2 rows × 16 positions × 2 layers × 2 (keys, values) × 2 heads × 16 × 4 B
        16384
    """
    rows = check_positive_int("rows", rows)
    prompt = check_positive_int("prompt_tokens", prompt_tokens)
    completion = check_positive_int("completion_tokens", completion_tokens)
    resident = check_int("resident_bytes", resident_bytes, minimum=0)
    prefill = check_int("prefill_bytes", prefill_bytes, minimum=0)
    gathered = check_int("gathered_bytes", gathered_bytes, minimum=0)
    sampling = Sampling() if sampling is None else sampling
    if not isinstance(sampling, Sampling):
        raise InvalidArgument(f"sampling must be a Sampling or None, but got a {type(sampling).__name__}")
    if limit_bytes is not None:
        limit_bytes = check_int("limit_bytes", limit_bytes, minimum=0)
    itemsize = _itemsize(dtype)
    text = _text_config(config)
    longest = prompt + completion - 1  # the last forward's positions
    kv = kv_cache_bytes(text, rows=rows, tokens=longest, dtype=dtype)
    vocab = int(text.vocab_size)
    cat = _largest_cat(text, rows, max(longest - 1, 1), itemsize) + sampling.previous_bytes(rows, vocab)
    step = sampling.step_bytes(rows, vocab, itemsize)
    decode = kv + TOKEN_BYTES_PER_ROW * rows * longest + max(cat, step) + gathered
    return GenerationPhase(
        way="transformers",
        rows=rows,
        prompt_tokens=prompt,
        completion_tokens=completion,
        resident_bytes=resident,
        kv_cache_bytes=kv,
        prefill_bytes=prefill + TOKEN_BYTES_PER_ROW * rows * prompt,
        decode_bytes=decode,
        limit_bytes=limit_bytes,
        description=f"{_kv_words(text)}, {_dtype_words(dtype)}",
    )


def _kv_words(config: Any) -> str:
    """``32 layers × 8 KV heads × head_dim 128`` (or an MLA model's widths), for messages."""
    layers = int(config.num_hidden_layers)
    if getattr(config, "kv_lora_rank", None) and getattr(config, "qk_nope_head_dim", None):
        keys, values = _kv_widths(config)
        return f"{layers} layers × {keys} key and {values} value elements per token (MLA)"
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return f"{layers} layers × {kv_heads} KV heads × head_dim {head_dim}"


def _dtype_words(dtype: Any) -> str:
    from batchfit.dtypes import parse_dtype

    return str(parse_dtype(dtype)).removeprefix("torch.")


# ---------------------------------------------------------------- the prefill, measured


class _PrefillStep:
    """The prefill of one built model as a step :class:`~batchfit.budget.depth.DepthExtrapolatedStep` can extrapolate."""

    def __init__(self, model: Any, backend: Any):
        self.model, self.backend = model, backend

    def measure(self, lengths: Sequence[int]) -> Any:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        rows, prompt = len(lengths), max(lengths)
        be, model = self.backend, self.model
        net = model.module if isinstance(model, DistributedDataParallel) else model  # TRL generates unwrapped

        def prefill() -> Any:
            with be.context(), torch.no_grad():
                ids = torch.zeros(rows, prompt, dtype=torch.long, device=be.device)
                mask = torch.ones(rows, prompt, dtype=torch.long, device=be.device)
                mask[0, 0] = 0  # TRL left-pads: the masked path (sdpa with a mask, GQA's keys repeated)
                # generate's positions per row, from the mask (transformers 5.24 prepare_inputs_for_generation,
                # generation/utils.py l. 679-709): RoPE's cos and sin per row too
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                return net(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)

        return be.measure(prefill, register=(self.model,))


@dataclass(frozen=True)
class _Prefill:
    own_bytes: int  # the prefill's peak beyond the registered model
    gathered_bytes: int  # the layers a sharded model gathered at that peak


def measure_prefill_bytes(
    model: Any,
    *,
    rows: int,
    prompt_tokens: int,
    dtype: Any = "bf16",
    lora: Any = None,
    sharding: Any = None,
    experts_implementation: str | None = None,
    routing: str | None = None,
    backend: Any = "estimate",
) -> int:
    """The prefill's own peak on one process: a ``no_grad`` forward of ``rows × prompt_tokens``, its KV cache included.

    Measured with the estimate backend (fake tensors, no memory, the CUDA attention kernel's
    choice), the model built as :func:`~batchfit.budget.profile_model` builds it (``dtype``,
    ``lora``, ``sharding``; a deep model of identical layers from two shallow depths), with TRL's
    left-padded attention mask, ``use_cache=True`` and ``logits_to_keep=1``, as ``generate``'s
    prefill runs (NOTE [ What generate holds ]). The model's own state is left out.
    ``backend="cpu"`` runs the forward for real instead (a small model: the same tracker, the CPU's
    own attention kernels), to compare with a real ``generate`` on the CPU.

    Raises:
        InvalidArgument: a bad model, count, dtype, LoRA spec or sharding.
    """
    return _measure_prefill(
        model, rows=rows, prompt_tokens=prompt_tokens, dtype=dtype, lora=lora, sharding=sharding,
        experts_implementation=experts_implementation, routing=routing, backend=backend,
    ).own_bytes  # fmt: skip


def _measure_prefill(
    model: Any,
    *,
    rows: int,
    prompt_tokens: int,
    dtype: Any,
    lora: Any,
    sharding: Any,
    experts_implementation: str | None = None,
    routing: str | None = None,
    backend: Any = "estimate",
) -> _Prefill:
    from batchfit.budget.depth import build_depth_steps
    from batchfit.budget.model_profile import depth_plan, simulated_world_for
    from batchfit.dtypes import parse_dtype
    from batchfit.memory import get_backend
    from batchfit.memory.categories import GATHERED_PARAMETERS, STATE_CATEGORIES
    from batchfit.models import build_causal_lm, load_config
    from batchfit.parallel.sharding import Sharding, as_sharding

    rows = check_positive_int("rows", rows)
    prompt = check_positive_int("prompt_tokens", prompt_tokens)
    torch_dtype = parse_dtype(dtype)
    plan = Sharding() if sharding is None else as_sharding(sharding)
    if plan.spec.gathers_layers:  # every layer gathered in turn, over simulated ranks; generation is never split
        plan = dataclasses.replace(plan, sequence_parallel=1)
    else:  # DDP and ZeRO keep whole parameters on each rank, and TRL generates with the unwrapped model
        plan = Sharding()
    config = load_config(model)
    be = get_backend(check_choice("backend", backend, ("estimate", "cpu")), memory_limit=None, reserve_bytes=1)
    depth, extrapolate = depth_plan(config, be, None, plan)

    def make(n_layers: int) -> _PrefillStep:
        overrides = {} if n_layers == depth else {"num_hidden_layers": n_layers}
        net = build_causal_lm(
            config, backend=be, dtype=torch_dtype, lora=lora, sharding=plan,
            experts_implementation=experts_implementation, routing=routing, **overrides,
        )  # fmt: skip
        return _PrefillStep(net, be)

    with simulated_world_for(be, plan):
        step = build_depth_steps(make, depth) if extrapolate else make(depth)
        measured = step.measure([prompt] * rows)
    state = sum(v for k, v in measured.breakdown.items() if k in STATE_CATEGORIES and k != GATHERED_PARAMETERS)
    return _Prefill(
        own_bytes=max(0, measured.peak_bytes - state),
        gathered_bytes=int(measured.breakdown.get(GATHERED_PARAMETERS, 0)),
    )


# ---------------------------------------------------------------- vLLM as TRL runs it


def generation_way(*, use_vllm: bool = False, vllm_mode: str = "colocate", use_transformers_continuous_batching: bool = False) -> str:
    """How TRL generates from its config fields: one of :data:`GENERATION_WAYS` (NOTE [ How TRL generates ])."""
    if check_bool("use_vllm", use_vllm):
        mode = check_choice("vllm_mode", vllm_mode, VLLM_MODES)
        return "vllm_colocate" if mode == "colocate" else "vllm_server"
    if check_bool("use_transformers_continuous_batching", use_transformers_continuous_batching):
        return "continuous_batching"
    return "transformers"


_ENGINE_KEYS = {
    "memory_fraction": "vllm_gpu_memory_utilization",
    "tensor_parallel": "vllm_tensor_parallel_size",
    "sleeps": "vllm_enable_sleep_mode",
    "max_num_seqs": "max_num_seqs",
}


def trl_rollout_engine(
    *,
    generation_batch_size: int,
    num_processes: int = 1,
    use_vllm: bool = False,
    vllm_mode: str = "colocate",
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_enable_sleep_mode: bool = False,
    vllm_tensor_parallel_size: int = 1,
) -> RolloutEngine | None:
    """The vLLM engine a TRL run builds, from its ``GRPOConfig`` fields (TRL 1.16's defaults); ``None`` without vLLM.

    Colocated: in the trainer's process (``own_process=False``), ``max_num_seqs`` =
    ``per_device_train_batch_size × vllm_tensor_parallel_size × steps_per_generation`` =
    ``generation_batch_size / num_processes × vllm_tensor_parallel_size``, asleep at level 2 with
    ``vllm_enable_sleep_mode`` (NOTE [ How TRL generates ]). Server mode: not colocated.

    Raises:
        InvalidArgument: a bad field (named as TRL names it).
    """
    gbs = check_positive_int("generation_batch_size", generation_batch_size)
    processes = check_positive_int("num_processes", num_processes)
    way = generation_way(use_vllm=use_vllm, vllm_mode=vllm_mode)
    if not way.startswith("vllm"):
        return None
    sleeps = check_bool("vllm_enable_sleep_mode", vllm_enable_sleep_mode)
    tp = check_positive_int("vllm_tensor_parallel_size", vllm_tensor_parallel_size)
    return RolloutEngine(
        name="vllm",
        colocated=way == "vllm_colocate",
        tensor_parallel=tp,
        memory_fraction=vllm_gpu_memory_utilization,
        sleeps=sleeps,
        sleep_level=2 if sleeps else None,
        max_num_seqs=max(1, gbs // processes) * tp,
        own_process=False,
        keys=_ENGINE_KEYS,
    )


def _device_bytes(memory_limit: Any) -> int | None:
    if memory_limit is not None:
        return parse_memory(memory_limit, name="memory_limit")
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[1])
    return None


def trl_engine_reserve(
    model: Any,
    *,
    memory_limit: Any,
    generation_batch_size: int,
    num_processes: int = 1,
    use_vllm: bool = False,
    vllm_mode: str = "colocate",
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_enable_sleep_mode: bool = False,
    vllm_tensor_parallel_size: int = 1,
) -> EngineReserve:
    """What a TRL run's vLLM keeps on each GPU while the trainer steps: profile the run with it.

    The fields are ``GRPOConfig``'s (TRL 1.16's defaults). Colocated without
    ``vllm_enable_sleep_mode`` the engine keeps its whole share, ``ceil(vllm_gpu_memory_utilization
    × total)``; asleep (level 2) its CUDA-graph pool and, at ``vllm_tensor_parallel_size > 1``, its
    communicators (NOTE [ What a sleeping engine keeps ] in :mod:`batchfit.budget.engine`; no CUDA
    context of its own: it runs in the trainer's process). Without vLLM or in server mode: nothing.

    Args:
        model: the served model (a preset, directory, hub id, config or module): its layers size the graph pool.
        memory_limit: one GPU's memory (``"a100-40gb"``, bytes); ``None``: the CUDA device's own.
        generation_batch_size: TRL's ``generation_batch_size`` (it sets vLLM's ``max_num_seqs``).
        num_processes: TRL's processes (its ``world_size``).

    Returns:
        :class:`~batchfit.budget.engine.EngineReserve`; pass it as ``profile_model(..., engine=...)``
        (or its ``bytes`` as ``engine_reserve=``, ``--engine-reserve``).

    Raises:
        InvalidArgument: a bad field, or an awake engine on a device of unknown size.

    Example:
        >>> r = trl_engine_reserve("tiny", memory_limit="a100-40gb", generation_batch_size=64, use_vllm=True)
        >>> r.bytes == math.ceil(0.3 * 40536 * 2**20)  # awake: TRL's default share of the device
        True
    """
    from batchfit.models import load_config

    engine = trl_rollout_engine(
        generation_batch_size=generation_batch_size, num_processes=num_processes, use_vllm=use_vllm,
        vllm_mode=vllm_mode, vllm_gpu_memory_utilization=vllm_gpu_memory_utilization,
        vllm_enable_sleep_mode=vllm_enable_sleep_mode, vllm_tensor_parallel_size=vllm_tensor_parallel_size,
    )  # fmt: skip
    if engine is None:
        return EngineReserve()
    config = load_config(model) if engine.colocated and engine.sleeps else None
    return engine_reserve(engine, _text_config(config) if config is not None else None, device_bytes=_device_bytes(memory_limit))


# ---------------------------------------------------------------- both phases of a profiled run


#: ``GRPOConfig``'s sampling fields (also read from its ``generation_kwargs``, which override them: grpo_trainer.py l. 1171-1172).
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
#: ``GRPOConfig``'s fields :func:`check_trl_phases` takes as they are.
PHASE_FIELDS = (
    "num_generations", "max_completion_length", "pad_to_multiple_of", "use_vllm", "vllm_mode",
    "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "vllm_tensor_parallel_size",
    "use_transformers_continuous_batching",
)  # fmt: skip


def trl_config_fields(config: Any) -> dict[str, Any]:
    """The keyword arguments of :func:`check_trl_phases` that a built TRL ``GRPOConfig`` (or ``RLOOConfig``) holds.

    Read after TRL's ``__post_init__`` (``pad_to_multiple_of="auto"`` resolved, ``world_size`` known);
    ``generation_kwargs`` override the sampling fields, as TRL merges them.
    """
    out = {name: getattr(config, name) for name in PHASE_FIELDS}
    out["num_processes"] = int(config.world_size)
    extra = getattr(config, "generation_kwargs", None) or {}
    if not isinstance(extra, dict):  # the CLI's JSON string is parsed by TRL's own __post_init__
        extra = {}
    out["sampling"] = Sampling(**{name: extra.get(name, getattr(config, name)) for name in SAMPLING_FIELDS})
    return out




def _policy_budget(profile: ModelProfile) -> Any:
    budget = profile.budgets.get("policy")
    if budget is None:
        raise BudgetError(
            f"TRL trains the policy, but this profile has no policy budget: it profiled roles {', '.join(profile.budgets)}; "
            "profile with roles='policy'"
        )
    return budget


def resident_bytes(profile: ModelProfile) -> int:
    """The trainer's state on the GPU while TRL generates: :data:`RESIDENT_CATEGORIES` at the policy's binding point."""
    breakdown = _policy_budget(profile).breakdown
    return int(sum(breakdown.get(c, 0) for c in RESIDENT_CATEGORIES))


def _generation_config(profile: ModelProfile, model: Any) -> Any:
    from batchfit.models import load_config

    spec = profile.model if model is None else model
    try:
        return load_config(spec)
    except InvalidArgument as exc:
        raise BudgetError(
            f"the generation phase needs the model's config, but the profile names the model {profile.model!r}, which is "
            f"not a preset, a directory or a hub id ({exc}); pass model= the model (or its config) the profile measured"
        ) from None


def _served_weight_bytes(profile: ModelProfile, config: Any, itemsize: int, tp: int) -> int:
    """The served model's weights on one GPU: its parameters (LoRA merged into the base) in the compute dtype, over TP."""
    if profile.lora is not None:
        params = profile.lora.total - profile.lora.trainable
    else:
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    return math.ceil(params * itemsize / tp)


def _floor2(x: float) -> float:
    return math.floor(100 * x + 1e-9) / 100


def _ceil2(x: float) -> float:
    return math.ceil(100 * x - 1e-9) / 100


def _valid_generation_sizes(requested: int, num_generations: int, num_processes: int, k: int) -> list[int]:
    """The generation batch sizes up to ``requested`` TRL's rules allow (NOTE [ TRL's batch rules ]), ascending."""
    step = math.lcm(num_generations, k * num_processes)
    return list(range(step, requested + 1, step))


def check_trl_phases(
    profile: ModelProfile,
    *,
    model: Any = None,
    max_prompt_length: int,
    max_completion_length: int,
    generation_batch_size: int,
    num_generations: int,
    num_processes: int = 1,
    optimizer_steps_per_generation: int = 1,
    pad_to_multiple_of: int | None = None,
    sampling: Sampling | None = None,
    use_vllm: bool = False,
    vllm_mode: str = "colocate",
    vllm_gpu_memory_utilization: float = 0.3,
    vllm_enable_sleep_mode: bool = False,
    vllm_tensor_parallel_size: int = 1,
    use_transformers_continuous_batching: bool = False,
) -> GenerationPhase:
    """Check a TRL run's training phase and generation phase against ``profile``; give the generation phase's terms.

    NOTE [ Both phases, refused not resized ]
    ``generation_batch_size`` is a training hyperparameter (prompts per generation × completions),
    not a memory knob: :func:`~batchfit.integrations.trl.grpo_config` keeps it and sizes the
    micro-batches under it. So when the generation phase does not fit, batchfit refuses, with
    both figures (what the phase needs, the limit) and what would fit: the largest
    ``generation_batch_size`` TRL's rules allow that fits, and, for ``generate``, the
    ``vllm_gpu_memory_utilization`` range a colocated vLLM would fit in. It never resizes it.

    - **training phase**: a colocated vLLM keeps :func:`trl_engine_reserve` on the GPU while the
      trainer steps; the profile must have taken at least that off (``profile.engine_bytes``).
    - **generation phase, generate** (``use_vllm=False``): the trainer's resident state + the
      larger of the measured prefill and the last decode step (:func:`generation_phase_bytes`) must
      stay within the profile's limit (the policy budget's ``limit_bytes``).
    - **generation phase, colocated vLLM**: vLLM's share ``vllm_gpu_memory_utilization × total``
      must be free beside the trainer's resident state and its untracked memory
      (:func:`~batchfit.budget.engine.check_awake_phase`), and must hold the served model's weights
      and one row's KV cache, or vLLM refuses to start.
    - **server mode**: nothing on the trainer's GPU. Continuous batching: not modelled (nothing checked).

    Args:
        profile: the policy's :class:`~batchfit.budget.ModelProfile` (one rank's).
        model: the model the profile measured (preset, directory, hub id, config or module);
            default the profile's own name.
        max_prompt_length, max_completion_length: the longest prompt and completion, in tokens.
        generation_batch_size: sequences generated at once over all processes.
        num_generations: completions per prompt.
        num_processes: TRL's processes (its ``world_size``).
        optimizer_steps_per_generation: optimizer steps one generation batch feeds.
        sampling: TRL's sampling fields (:class:`Sampling`; default TRL's defaults).
        pad_to_multiple_of, use_vllm, vllm_mode, vllm_gpu_memory_utilization,
        vllm_enable_sleep_mode, vllm_tensor_parallel_size, use_transformers_continuous_batching:
            ``GRPOConfig``'s fields (TRL 1.16's defaults).

    Returns:
        the :class:`GenerationPhase` (it fits).

    Raises:
        BudgetError: the profile lacks the engine's training-phase reserve (the message gives the
            reserve to profile with), has no policy budget, or names a model whose config cannot be read.
        DoesNotFitError: the generation phase does not fit: one line with what it needs, the limit,
            and the largest ``generation_batch_size`` (and vLLM fraction) that would fit.
        InvalidArgument: a bad field.
    """
    if not isinstance(profile, ModelProfile):
        raise InvalidArgument(f"profile must be a ModelProfile (batchfit.budget.profile_model), but got a {type(profile).__name__}")
    gbs = check_positive_int("generation_batch_size", generation_batch_size)
    generations = check_positive_int("num_generations", num_generations)
    processes = check_positive_int("num_processes", num_processes)
    k = check_positive_int("optimizer_steps_per_generation", optimizer_steps_per_generation)
    completion = check_positive_int("max_completion_length", max_completion_length)
    prompt = check_positive_int("max_prompt_length", max_prompt_length)
    if pad_to_multiple_of is not None:  # TRL left-pads the prompts to the multiple (NOTE [ How TRL generates ])
        multiple = check_positive_int("pad_to_multiple_of", pad_to_multiple_of)
        prompt = math.ceil(prompt / multiple) * multiple
    if gbs % processes:
        raise InvalidArgument(
            f"generation_batch_size={gbs} must split evenly over num_processes={processes} (TRL's GRPOConfig); use a "
            f"multiple of {processes}"
        )
    way = generation_way(use_vllm=use_vllm, vllm_mode=vllm_mode,
                         use_transformers_continuous_batching=use_transformers_continuous_batching)  # fmt: skip
    rows = gbs // processes
    budget = _policy_budget(profile)
    config = _generation_config(profile, model)
    engine_fields = {
        "use_vllm": use_vllm, "vllm_mode": vllm_mode, "vllm_gpu_memory_utilization": vllm_gpu_memory_utilization,
        "vllm_enable_sleep_mode": vllm_enable_sleep_mode, "vllm_tensor_parallel_size": vllm_tensor_parallel_size,
    }  # fmt: skip
    device = _device_bytes(profile.memory_limit)
    _check_training_phase(profile, config, model, device, gbs, processes, engine_fields)
    trainer = resident_bytes(profile)
    # the profile's limit already leaves out the colocated models' state; vLLM's checks are against the device
    beside = trainer + profile.resident_bytes
    dtype = profile.compute_dtype or profile.dtype
    if way in ("vllm_server", "continuous_batching"):
        return GenerationPhase(way=way, rows=rows, prompt_tokens=prompt, completion_tokens=completion, resident_bytes=trainer)
    if way == "vllm_colocate":
        return _check_vllm_phase(profile, config, device, rows, prompt, completion, beside, dtype, engine_fields, gbs, processes)

    def phase(local_rows: int, measure: bool = True) -> GenerationPhase:
        measured = _Prefill(0, 0)
        if measure:
            measured = _measure_prefill(
                config, rows=local_rows, prompt_tokens=prompt, dtype=profile.dtype,
                lora=None if profile.lora is None else profile.lora.spec, sharding=profile.sharding,
                experts_implementation=None if profile.moe is None else profile.moe.implementation,
                routing=None if profile.moe is None else profile.moe.routing,
            )  # fmt: skip
        return generation_phase_bytes(
            config, rows=local_rows, prompt_tokens=prompt, completion_tokens=completion, resident_bytes=trainer,
            prefill_bytes=measured.own_bytes, dtype=dtype, sampling=sampling, gathered_bytes=measured.gathered_bytes,
            limit_bytes=budget.limit_bytes,
        )  # fmt: skip

    def fits(size: int) -> bool:
        # the arithmetic alone (decode, no prefill measured) is a lower bound: measure only what it lets through
        return phase(size // processes, measure=False).fits and phase(size // processes).fits

    asked = phase(rows)
    if asked.fits:
        return asked
    sizes = _valid_generation_sizes(gbs - 1, generations, processes, k)
    largest = _largest_fitting_size(sizes, fits)
    if largest is None:
        smallest = sizes[0] if sizes else gbs
        fix = (
            f"no generation_batch_size fits: even {smallest} ({max(1, smallest // processes)} rows per process) "
            "does not; shorten max_completion_length or max_prompt_length"
        )
    else:
        fix = f"the largest generation_batch_size that fits is {largest} ({largest // processes} rows per process)"
    window = _vllm_window(profile, config, device, beside, prompt, completion, dtype, vllm_tensor_parallel_size)
    if window is not None:
        fix += (
            f", or generate with vLLM beside the trainer: use_vllm=True, vllm_gpu_memory_utilization between "
            f"{window[0]:g} and {window[1]:g} (with vllm_enable_sleep_mode=True; profile with "
            "engine=trl_engine_reserve(...))"
        )
    raise DoesNotFitError(
        f"TRL generates its whole local generation batch in one generate call: generation_batch_size={gbs} over "
        f"num_processes={processes} is {rows} rows of up to {prompt} + {completion} tokens, whose KV cache "
        f"({format_bytes(asked.kv_cache_bytes)}) beside the trainer's {format_bytes(asked.resident_bytes)} of state "
        f"peaks at {format_bytes(asked.needed_bytes)} (prefill {format_bytes(asked.prefill_bytes)}, last decode step "
        f"{format_bytes(asked.decode_bytes)}), more than the limit of {format_bytes(asked.limit_bytes)}; {fix}",
        needed=asked.needed_bytes,
        available=asked.limit_bytes,
    )


def _largest_fitting_size(sizes: Sequence[int], fits: Any) -> int | None:
    """The largest of ascending ``sizes`` that ``fits`` (monotone), by bisection; ``None`` when none does."""
    lo, hi = -1, len(sizes)  # sizes[lo] fits (lo = -1: none known), sizes[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            lo = mid
        else:
            hi = mid
    return sizes[lo] if lo >= 0 else None


def _check_training_phase(
    profile: ModelProfile, config: Any, model: Any, device: int | None, gbs: int, processes: int, fields: dict[str, Any]
) -> None:
    """The profile's engine term covers what the colocated vLLM keeps while the trainer steps."""
    engine = trl_rollout_engine(generation_batch_size=gbs, num_processes=processes, **fields)
    if engine is None or not engine.colocated:
        return
    if not engine.sleeps and device is None:
        raise InvalidArgument(
            "the colocated vLLM stays awake (vllm_enable_sleep_mode=False), so it keeps a share of the device, but the "
            "profile has no memory_limit; profile with memory_limit (--memory)"
        )
    need = engine_reserve(engine, _text_config(config), device_bytes=device)
    if profile.engine_bytes >= need.bytes:
        return
    spec = profile.model if model is None else model
    name = repr(spec) if isinstance(spec, str) else "model"  # a module or a config: the caller's own name for it
    call = ", ".join(f"{k}={v!r}" for k, v in fields.items() if k != "vllm_mode" or v != "colocate")
    raise BudgetError(
        f"TRL's colocated vLLM keeps {format_bytes(need.bytes)} on each GPU while the trainer steps "
        f"({need.describe()}), but the profile takes off {format_bytes(profile.engine_bytes)} for a rollout engine; "
        f"profile with engine=trl_engine_reserve({name}, memory_limit={device}, generation_batch_size={gbs}, "
        f"num_processes={processes}, {call}) (engine_reserve={need.bytes}, --engine-reserve {need.bytes})"
    )


def _vllm_kv_row(config: Any, prompt: int, completion: int, dtype: Any, tp: int) -> int:
    return math.ceil(kv_cache_bytes(_text_config(config), rows=1, tokens=prompt + completion, dtype=dtype) / tp)


def _vllm_window(
    profile: ModelProfile, config: Any, device: int | None, resident: int, prompt: int, completion: int, dtype: Any, tp: int
) -> tuple[float, float] | None:
    """The ``vllm_gpu_memory_utilization`` range a colocated vLLM needs and the trainer leaves, or ``None`` when empty."""
    if device is None:
        return None
    itemsize = _itemsize(dtype)
    need = _served_weight_bytes(profile, _text_config(config), itemsize, tp) + _vllm_kv_row(config, prompt, completion, dtype, tp)
    low, high = _ceil2(need / device), _floor2((device - resident - profile.reserve_bytes) / device)
    return (low, high) if low <= high else None


def _check_vllm_phase(
    profile: ModelProfile,
    config: Any,
    device: int | None,
    rows: int,
    prompt: int,
    completion: int,
    resident: int,
    dtype: Any,
    fields: dict[str, Any],
    gbs: int,
    processes: int,
) -> GenerationPhase:
    engine = trl_rollout_engine(generation_batch_size=gbs, num_processes=processes, **fields)
    fraction = engine.memory_fraction
    if device is None:
        raise InvalidArgument(
            "a colocated vLLM takes vllm_gpu_memory_utilization of the device, but the profile has no memory_limit; "
            "profile with memory_limit (--memory)"
        )
    tp = engine.tensor_parallel
    itemsize = _itemsize(dtype)
    weights = _served_weight_bytes(profile, _text_config(config), itemsize, tp)
    row = _vllm_kv_row(config, prompt, completion, dtype, tp)
    share = awake_engine_bytes(engine, device)
    low = _ceil2((weights + row) / device)
    high = _floor2((device - resident - profile.reserve_bytes) / device)
    window = f"between {low:g} and {high:g}" if low <= high else None
    elsewhere = "use vllm_mode='server' (vLLM on GPUs of its own)"
    check_awake_phase(
        engine,
        device_bytes=device,
        trainer_bytes=resident,
        untracked_bytes=profile.reserve_bytes,
        fix=(
            f"{elsewhere}; vLLM itself needs {low:g} or more for its {format_bytes(weights)} of weights and one row's "
            f"{format_bytes(row)} of KV cache" + ("" if window else ", so no fraction fits beside the trainer")
        ),
    )
    if share < weights + row:
        hint = f"raise vllm_gpu_memory_utilization to {window}" if window else (
            f"no fraction fits beside the trainer's {format_bytes(resident)} of state; {elsewhere}"
        )
        raise DoesNotFitError(
            f"the colocated vLLM cannot hold the model: vllm_gpu_memory_utilization={fraction:g} gives it "
            f"{format_bytes(share)} of {format_bytes(device)} per GPU, but its weights take {format_bytes(weights)} and one "
            f"row of {prompt} + {completion} tokens {format_bytes(row)} of KV cache (vLLM refuses to start); {hint}",
            needed=weights + row,
            available=share,
        )
    return GenerationPhase(
        way="vllm_colocate",
        rows=rows,
        prompt_tokens=prompt,
        completion_tokens=completion,
        resident_bytes=resident,
        engine_bytes=share,
        untracked_bytes=profile.reserve_bytes,
        limit_bytes=device,
        engine_weight_bytes=weights,
        engine_rows=(share - weights) // row,
        min_fraction=low,
        max_fraction=high,
    )
