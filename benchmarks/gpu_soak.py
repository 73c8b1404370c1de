"""The budget over a whole run on the device: RL micro-batches at the budget, the allocator watched.

    python benchmarks/gpu_soak.py                  # qwen2.5-0.5b and 1.5b × caching / expandable segments, ~4.5 min on an H200
    python benchmarks/gpu_soak.py --models qwen2.5-0.5b --micro-batches 200 --minutes 10 --out soak/
    bash benchmarks/gpu_session.sh                 # with gpu_check.py: the next GPU session's one device command

A confirm (``batchfit profile --confirm``, ``benchmarks/gpu_check.py``) runs one step at the
budget from an empty cache. A training run holds the caching allocator's state after hundreds
of shapes: what ``reserved − allocated`` grows to over a run is what the margin has to cover
(issue 39; NOTE [ The margin's evidence ] in ``batchfit.memory.cuda_untracked``). For each
model and each allocator setting (``caching``: ``PYTORCH_CUDA_ALLOC_CONF`` unset;
``expandable_segments``: ``expandable_segments:True``, each in its own process, since the
setting is read when CUDA starts) this:

1. takes the budget a user would: the estimate backend's (``profile_model(..., backend="estimate",
   memory_limit=<the device's total bytes>, cost="packed")``, margin 0.85 for both settings), once per
   model (the second setting's process reuses the first's);
2. trains for real at that budget: step-wise GRPO-like rollouts whose lengths are long-tailed
   and drawn afresh each training step from a distribution that itself changes every step
   (:func:`rl_lengths`, seeded), mini-batches along prompts, exact loss weights, packed
   micro-batches under the budget (``plan_micro_batches``, ``iter_micro_batches``, varlen
   attention), ``batchfit.train.micro_batch_loss`` and its backward with the gradients
   accumulated (resident, as the budget's probe assumed), AdamW stepping at each mini-batch's end;
3. records after every micro-batch (and optimizer step) ``memory_allocated``,
   ``memory_reserved``, ``max_memory_allocated`` and ``max_memory_reserved`` (the peaks reset
   after each read) and the device's free memory, and every out of memory (caught, recorded,
   the mini-batch dropped, the run going on with the next one);
4. prints per run whether margin 0.85 held (no out of memory, and the reserved peak within the
   memory the budget left the allocator, ``memory − reserve``), the reserved − allocated at the
   peaks and between micro-batches, the peak as a fraction of the usable memory, and the
   calibrated margin the run implies by :func:`batchfit.memory.calibration.calibrated_limits`'
   formula (NOTE [ Calibrated reserve and margin ]); and writes one calibration file per
   allocator setting (the worst of its models' terms), its ``allocator`` field naming the setting.

``--micro-batches`` bounds each run (model × setting); ``--minutes`` bounds the whole soak: each
run gets an equal share of the time left, stops cleanly before a micro-batch that would pass its
share, and reports what it has. Without a GPU it prints one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

SCRIPT = Path(__file__).resolve()
SRC = SCRIPT.parents[1] / "src"
DEFAULT_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
#: The allocator settings soaked and the ``PYTORCH_CUDA_ALLOC_CONF`` each runs under (``None``: unset).
ALLOCATOR_CONFS: dict[str, str | None] = {"caching": None, "expandable_segments": "expandable_segments:True"}
#: Micro-batches per run (model × allocator setting): 4 runs, 240 in all by default.
DEFAULT_MICRO_BATCHES = 60
#: The whole soak's time, minutes: an H200 runs the default in about this (docs/budget.md, "The soak").
DEFAULT_MINUTES = 4.5
#: The margin soaked, under both settings: issue 39's question is whether it holds (the default with
#: expandable segments; NOTE [ The allocator's share ] in batchfit.memory.cuda_untracked gives 0.83 without).
MARGIN = 0.85
#: P(turns = 1..5) of a trajectory (as examples/grpo_stepwise.py).
TURN_WEIGHTS = (0.35, 0.25, 0.2, 0.12, 0.08)
#: PPO's clip, as the budget's probe runs it.
CLIP_RATIO = 0.2
#: Micro-batches whose predicted peak is at least this share of the budget's limit give the measured/predicted ratio.
RATIO_FROM = 0.5
#: A run stops after this many out-of-memory errors (each costs the allocator a cache flush and a retry).
MAX_OOMS = 20
#: A run with less time than this left is skipped; a run past its share by this much is killed.
MIN_RUN_SECONDS = 30.0
KILL_AFTER_SECONDS = 60.0
NO_GPU = "no GPU on this machine (torch.cuda.is_available() is False): nothing to soak; exit 0"


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """One training step's rollouts: ``prompts × samples`` trajectories of 1 to ``max_turns`` turns, one sequence per turn."""

    prompts: int = 16  # train_batch_size
    samples: int = 8  # n_samples_per_prompt
    mini_batch: int = 4  # policy_mini_batch_size: prompts per optimizer step
    max_turns: int = 4
    max_prompt_len: int = 2048  # a turn's prompt: the conversation so far, left-truncated
    max_response_len: int = 2048

    def __post_init__(self) -> None:
        from batchfit.errors import InvalidArgument
        from batchfit.validation import check_int, check_positive_int

        for name in ("prompts", "samples", "mini_batch", "max_response_len"):
            check_positive_int(name, getattr(self, name))
        check_int("max_prompt_len", self.max_prompt_len, minimum=16)  # questions of 8 tokens and more
        check_int("max_turns", self.max_turns, minimum=1, maximum=len(TURN_WEIGHTS))
        if self.prompts % self.mini_batch:
            raise InvalidArgument(
                f"prompts must be a multiple of mini_batch, but got prompts={self.prompts} and "
                f"mini_batch={self.mini_batch}; pass e.g. prompts={self.mini_batch * max(1, self.prompts // self.mini_batch)}"
            )

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a step can hold: the budget's ``max_seq_len``."""
        return self.max_prompt_len + self.max_response_len


@dataclass(frozen=True)
class StepLengths:
    """The sequences of one training step: prompt id, prompt and response tokens of each, and the step's distribution.

    Attributes:
        uids: the prompt of each sequence (a prompt's sequences contiguous, any number each).
        prompts, responses: tokens of each sequence's prompt and response.
        median: the median of this step's untruncated response lengths (before clipping).
        sigma: the log-normal spread of this step's response lengths.
        truncated: the share of this step's responses cut at ``max_response_len``.
    """

    uids: np.ndarray
    prompts: np.ndarray
    responses: np.ndarray
    median: float
    sigma: float
    truncated: float

    @property
    def lengths(self) -> np.ndarray:
        return self.prompts + self.responses


def rl_lengths(step: int, workload: Workload, seed: int = 0) -> StepLengths:
    """The sequence lengths of training step ``step``: long-tailed, step-wise, from a distribution drawn anew each step.

    As RL rollouts come: each step draws its own response distribution (a log-normal whose
    median is ``max_response_len / 6`` times ``exp(N(0, 0.35))``, spread ``U(0.7, 1.1)``, and a
    share ``U(2%, 8%)`` of responses cut at ``max_response_len``, as generations that hit the
    limit are), then each of ``prompts`` questions (log-normal, median ``max_prompt_len / 16``)
    gets ``samples`` trajectories of 1 to ``max_turns`` turns; each turn is one sequence whose
    prompt is the conversation so far (question, earlier responses and the environment's
    replies of 16–256 tokens), left-truncated to ``max_prompt_len``. Deterministic in
    ``(seed, step)``; every prompt ≤ ``max_prompt_len``, every response in ``[1, max_response_len]``.
    """
    w = workload
    rng = np.random.default_rng([seed, step])
    median = w.max_response_len / 6 * math.exp(rng.normal(0.0, 0.35))
    sigma = float(rng.uniform(0.7, 1.1))
    truncated = float(rng.uniform(0.02, 0.08))
    turn_p = np.array(TURN_WEIGHTS[: w.max_turns]) / sum(TURN_WEIGHTS[: w.max_turns])
    uids, prompts, responses = [], [], []
    for prompt in range(w.prompts):
        question = int(np.clip(rng.lognormal(math.log(w.max_prompt_len / 16), 0.6), 8, w.max_prompt_len // 2))
        for _ in range(w.samples):
            history = question
            for _ in range(1 + int(rng.choice(len(turn_p), p=turn_p))):
                if rng.random() < truncated:
                    response = w.max_response_len
                else:
                    response = int(
                        np.clip(round(rng.lognormal(math.log(median), sigma)), 1, w.max_response_len)
                    )
                uids.append(prompt)
                prompts.append(min(history, w.max_prompt_len))
                responses.append(response)
                history += response + int(rng.integers(16, 257))  # the environment's reply
    return StepLengths(
        uids=np.array(uids, dtype=np.int64),
        prompts=np.array(prompts, dtype=np.int64),
        responses=np.array(responses, dtype=np.int64),
        median=float(median),
        sigma=sigma,
        truncated=truncated,
    )


def rollout_batch(
    lengths: StepLengths, workload: Workload, vocab_size: int, *, seed: int = 0, step: int = 0
) -> dict[str, Any]:
    """The rollouts of ``lengths`` as a trainer holds them on the host: prompt | response rows, random tokens, GRPO fields."""
    from batchfit.batches.rollouts import collate_rollouts

    rng = np.random.default_rng([seed, step, 1])
    n = len(lengths.uids)
    return collate_rollouts(
        [rng.integers(3, vocab_size, int(k)) for k in lengths.prompts],
        [rng.integers(3, vocab_size, int(k)) for k in lengths.responses],
        uids=lengths.uids.tolist(),
        advantages=rng.standard_normal(n).tolist(),  # one per sequence, broadcast over its response
        old_log_probs=(-rng.random(n)).tolist(),
        prompt_width=workload.max_prompt_len,
        response_width=workload.max_response_len,
    )


# --------------------------------------------------------------------------- the budget


@dataclass(frozen=True)
class SoakBudget:
    """The token budget soaked and what it promised: its limit, the usable memory, its memory model.

    Attributes:
        tokens: ``C``, the most tokens a packed micro-batch holds.
        memory_limit: the device's bytes the budget was searched for.
        reserve_bytes: what the budget kept off it for memory outside torch's allocator.
        usable_bytes: ``memory_limit − reserve_bytes``: what the allocator may reserve.
        limit_bytes: the peak the budget allowed a micro-batch (``safety_margin × usable_bytes``).
        safety_margin: the margin soaked.
        base, linear, quadratic: the budget's memory model ``peak ≈ base + linear·Σl + quadratic·Σl²``
            over a packed micro-batch's lengths (all 0 when the budget was given, not searched).
        source: ``estimate``, ``cpu`` (the backend it was searched on) or ``given``.
        seconds: how long the search took.
    """

    tokens: int
    memory_limit: int
    reserve_bytes: int
    usable_bytes: int
    limit_bytes: int
    safety_margin: float
    base: float = 0.0
    linear: float = 0.0
    quadratic: float = 0.0
    source: str = "given"
    seconds: float = 0.0

    def predict(self, lengths: Sequence[int]) -> float:
        """The memory model's peak for a packed micro-batch of ``lengths``; 0 when there is no model."""
        if not (self.linear or self.quadratic):
            return 0.0
        return self.base + self.linear * sum(lengths) + self.quadratic * sum(n * n for n in lengths)

    @classmethod
    def given(cls, tokens: int, memory_limit: int) -> SoakBudget:
        """A budget given on the command line: no reserve, the default margin, no memory model."""
        return cls(tokens, memory_limit, 0, memory_limit, int(MARGIN * memory_limit), MARGIN)


def search_budget(
    model: str,
    workload: Workload,
    *,
    memory_limit: int,
    backend: str = "estimate",
    dtype: str = "bf16",
    logprobs: str = "full",
) -> SoakBudget:
    """The policy's packed budget as a user gets it: ``profile_model`` on ``backend`` against ``memory_limit``, sharding none."""
    from batchfit.budget import profile_model

    start = time.perf_counter()
    profile = profile_model(
        model, backend=backend, memory_limit=memory_limit, sharding="none", max_seq_len=workload.max_seq_len,
        cost="packed", dtype=dtype, logprobs=logprobs, safety_margin=MARGIN,
    )  # fmt: skip
    budget = profile.budgets["policy"]
    fit = budget.memory_model
    return SoakBudget(
        tokens=int(budget.tokens),
        memory_limit=int(memory_limit),
        reserve_bytes=int(memory_limit - budget.usable_bytes),
        usable_bytes=int(budget.usable_bytes),
        limit_bytes=int(budget.limit_bytes),
        safety_margin=float(budget.safety_margin),
        base=0.0 if fit is None else float(fit.base),
        linear=0.0 if fit is None else float(fit.linear),
        quadratic=0.0 if fit is None else float(fit.quadratic),
        source=backend,
        seconds=time.perf_counter() - start,
    )


# --------------------------------------------------------------------------- reading memory


class CudaMeter:
    """The caching allocator's statistics after each piece of the loop; the peaks reset at each read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = int(torch.cuda.get_device_properties(device).total_memory)

    def mini_batch(self, host: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> dict[str, int]:
        """``allocated``, ``reserved`` (now), ``peak_allocated``, ``peak_reserved`` (since the last read) and ``free``."""
        d = self.device
        free, _ = torch.cuda.mem_get_info(d)
        out = {
            "allocated": int(torch.cuda.memory_allocated(d)),
            "reserved": int(torch.cuda.memory_reserved(d)),
            "peak_allocated": int(torch.cuda.max_memory_allocated(d)),
            "peak_reserved": int(torch.cuda.max_memory_reserved(d)),
            "free": int(free),
        }
        torch.cuda.reset_peak_memory_stats(d)
        return out

    def expandable_segments(self) -> bool | None:
        """Whether the allocator's segments are expandable (``memory_snapshot``), ``None`` when it does not say."""
        try:
            segments = torch.cuda.memory_snapshot()
        except RuntimeError:  # a diagnostic only: a torch that cannot snapshot does not stop the soak
            return None
        flags = [s.get("is_expandable") for s in segments if s.get("device", 0) == self.device.index]
        if not flags or any(f is None for f in flags):
            return None
        return any(flags)


class CpuMeter:
    """The cpu tracker (:class:`batchfit.train.PeakTracker`) in the CUDA statistics' place: no allocator, so reserved = allocated."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, total: int):
        self.model, self.optimizer, self.total = model, optimizer, int(total)
        self._tracker: Any = None

    @contextlib.contextmanager
    def mini_batch(self, host: Any) -> Iterator[None]:
        from batchfit.train import PeakTracker

        with PeakTracker(self.model, self.optimizer, host=host) as tracker:
            self._tracker = tracker
            try:
                yield
            finally:
                self._tracker = None

    def reset(self) -> None:
        if self._tracker is not None:
            self._tracker.take()

    def read(self) -> dict[str, int]:
        peak, now = (
            (self._tracker.take(), self._tracker.current_bytes) if self._tracker is not None else (0, 0)
        )
        return {
            "allocated": now,
            "reserved": now,
            "peak_allocated": peak,
            "peak_reserved": peak,
            "free": self.total - now,
        }

    def expandable_segments(self) -> bool | None:
        return None


# --------------------------------------------------------------------------- the loop


def _on_device(mb: Any, device: torch.device) -> Any:
    fields = {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.batch.items()
    }
    return dataclasses.replace(mb, batch=fields)


def train_micro_batch(model: torch.nn.Module, mb: Any, device: torch.device, logprobs: str) -> None:
    """One micro-batch of the trainer's step: its fields to the device, the clipped surrogate, backward (gradients accumulate)."""
    from batchfit.train import micro_batch_loss

    mb = _on_device(mb, device)
    loss = micro_batch_loss(model, mb, head=logprobs, clip_ratio=CLIP_RATIO)
    loss.backward()


def _oom(exc: BaseException, where: str, meter: Any, **at: Any) -> dict[str, Any]:
    """What an out of memory leaves to read: where, the message's first line, the peaks it reached (plain values only)."""
    message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    return {"kind": "oom", "where": where, **at, "message": message, **meter.read()}


def run_soak(
    model_name: str,
    budget: SoakBudget,
    workload: Workload,
    *,
    micro_batches: int,
    deadline: float,
    device: str = "cuda",
    dtype: str = "bf16",
    logprobs: str = "full",
    seed: int = 0,
    lr: float = 1e-6,
    on_mini_batch: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``model_name`` at ``budget`` until ``micro_batches`` micro-batches ran or ``deadline`` (``time.time()``) nears.

    Returns a JSON-ready dict: ``records`` (one per micro-batch, ``kind="micro_batch"``, and per
    optimizer step, ``kind="optimizer_step"``: the meter's reading, and for a micro-batch its
    ``step``, ``mini_batch``, ``position``, ``sequences``, ``tokens``, ``longest``, ``predicted``
    (the budget's memory model), ``seconds``), ``ooms`` (``kind="oom"``: where, the message, the
    peaks reached and what is held after), counts, ``stopped_by`` (``micro_batches``, ``minutes``
    or ``ooms``: :data:`MAX_OOMS` of them), ``expandable_segments`` (what the allocator's segments are, cuda) and times.
    ``on_mini_batch`` gets the state so far after each mini-batch (to write it down).

    Only an out of memory is caught (NOTE [ What counts as OOM ] in ``batchfit.memory.base``):
    it is recorded, the mini-batch's partial gradients are zeroed (gradients stay allocated, as
    between any two mini-batches), and the run goes on with the next mini-batch.
    """
    from batchfit.batches.batch import slice_batch
    from batchfit.batches.microbatch import iter_micro_batches
    from batchfit.batches.minibatch import mini_batch_boundaries
    from batchfit.batches.weights import loss_weights
    from batchfit.memory import get_backend, is_out_of_memory
    from batchfit.models import build_causal_lm
    from batchfit.models.attention import use_varlen_attention
    from batchfit.plan.packing import plan_micro_batches
    from batchfit.train import accumulate, allocate_gradients, default_optimizer, initialize_optimizer_state

    started = time.time()
    if device == "cuda":
        backend = get_backend("cuda")
        dev = backend.device
        model = build_causal_lm(model_name, backend=backend, dtype=dtype, seed=seed)
    else:
        dev = torch.device("cpu")
        model = build_causal_lm(model_name, dtype=dtype, seed=seed)
    # packed rows attend per sequence (NOTE [ Packed rows need varlen attention ])
    use_varlen_attention(model)
    optimizer = default_optimizer(model.parameters(), lr=lr)
    initialize_optimizer_state(optimizer)
    allocate_gradients(model)  # NOTE [ Gradients are resident between micro-batches ]
    meter: Any = CudaMeter(dev) if device == "cuda" else CpuMeter(model, optimizer, budget.memory_limit)
    vocab_size = int(model.config.vocab_size)
    state: dict[str, Any] = {
        "records": [], "ooms": [], "micro_batches": 0, "optimizer_steps": 0,
        "stopped_by": None, "expandable_segments": None, "setup_seconds": time.time() - started,
    }  # fmt: skip
    records, ooms = state["records"], state["ooms"]
    seconds: list[float] = []
    segments_read = False

    def stop_now() -> str | None:
        if state["micro_batches"] >= micro_batches:
            return "micro_batches"
        if len(ooms) >= MAX_OOMS:
            return "ooms"
        expected = sum(seconds) / len(seconds) if seconds else 0.0
        return "minutes" if time.time() + expected > deadline else None

    step = 0
    while state["stopped_by"] is None:
        lengths = rl_lengths(step, workload, seed)
        batch = rollout_batch(lengths, workload, vocab_size, seed=seed, step=step)
        for k, (lo, hi) in enumerate(mini_batch_boundaries(batch["uid"], workload.mini_batch)):
            state["stopped_by"] = stop_now()
            if state["stopped_by"] is not None:
                break
            mini = slice_batch(batch, lo, hi)
            mini["weights"] = loss_weights(mini["loss_mask"], reduction="token_mean")
            seq_lens = mini["attention_mask"].sum(-1)
            plan = plan_micro_batches(seq_lens, budget.tokens, cost="packed")
            failed: dict[str, Any] | None = None
            with meter.mini_batch(host=mini):
                meter.reset()
                micro = iter_micro_batches(mini, plan, 0, layout="packed")
                for mb in accumulate(model, micro, plan.num_micro_batches):
                    state["stopped_by"] = stop_now()
                    if state["stopped_by"] is not None:
                        break
                    lens = [int(seq_lens[i]) for i in mb.indices]
                    at = {
                        "step": step,
                        "mini_batch": k,
                        "position": mb.position,
                        "sequences": len(lens),
                        "tokens": sum(lens),
                    }
                    begun = time.perf_counter()
                    try:
                        train_micro_batch(model, mb, dev, logprobs)
                        if device == "cuda":
                            torch.cuda.synchronize(dev)
                    except Exception as exc:  # NOTE [ What counts as OOM ]: anything else is a bug, re-raised
                        if not is_out_of_memory(exc):
                            raise
                        failed = _oom(exc, "micro_batch", meter, **at)
                    if failed is not None:
                        break
                    seconds.append(time.perf_counter() - begun)
                    records.append({
                        "kind": "micro_batch", **at, "longest": max(lens), "predicted": budget.predict(lens),
                        **meter.read(), "seconds": seconds[-1],
                    })  # fmt: skip
                    state["micro_batches"] += 1
                if failed is None and state["stopped_by"] is None:
                    try:
                        optimizer.step()
                    except Exception as exc:  # NOTE [ What counts as OOM ]
                        if not is_out_of_memory(exc):
                            raise
                        failed = _oom(exc, "optimizer_step", meter, step=step, mini_batch=k)
                    if failed is None:
                        state["optimizer_steps"] += 1
                        records.append(
                            {"kind": "optimizer_step", "step": step, "mini_batch": k, **meter.read()}
                        )
                # the next mini-batch starts from zeroed gradients, kept allocated; a dropped or stopped
                # mini-batch's partial gradients go with them
                optimizer.zero_grad(set_to_none=False)
            if failed is not None:
                gc.collect()
                after = meter.read()
                failed.update(allocated_after=after["allocated"], reserved_after=after["reserved"])
                ooms.append(failed)
            if not segments_read and (records or ooms):  # once the allocator holds segments
                state["expandable_segments"], segments_read = meter.expandable_segments(), True
            if on_mini_batch is not None:
                on_mini_batch(state)
        step += 1
    state["training_steps"] = len({r["step"] for r in records if r["kind"] == "micro_batch"})
    state["seconds"] = time.time() - started
    return state


# --------------------------------------------------------------------------- what a run shows


def summarize(run: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one run (model × allocator setting) from its records; pure arithmetic, JSON-ready.

    - ``peak_allocated_bytes`` / ``peak_reserved_bytes``: the largest ``max_memory_allocated`` /
      ``max_memory_reserved`` of any record (out-of-memory records included: what was reached).
    - ``overhead_bytes`` = reserved peak − allocated peak, and ``overhead_fraction`` of the
      allocated peak: the run's ``reserved − allocated`` as a calibration defines it (the caching
      allocator's ``f``, NOTE [ Calibrated reserve and margin ]).
    - ``largest_gap_bytes``: the largest ``memory_reserved − memory_allocated`` read after a
      micro-batch or step (what the cache holds between them).
    - ``untracked_bytes``: the largest ``total − free − reserved`` (memory outside torch's allocator).
    - ``peak_of_usable`` / ``reserved_of_usable`` / ``peak_of_limit``: the peaks over the budget's
      usable memory (``memory − reserve``) and its limit; ``left_bytes`` = total − untracked −
      reserved peak.
    - ``estimate_ratio``: the largest measured / predicted peak of the micro-batches predicted at
      :data:`RATIO_FROM` of the limit or more (the budget's memory model); ``None`` without any.
    - ``margin_held``: no out of memory and the reserved peak within the usable memory; ``None``
      when no micro-batch ran.
    - ``calibrated_margin``: :func:`batchfit.memory.calibration.calibrated_limits` of this run alone
      (:func:`soak_calibration`), ``None`` when no micro-batch ran.
    """
    from batchfit.memory.calibration import calibrated_limits

    budget, f = run["budget"], _figures(run)
    records = list(run.get("records", ()))
    steps = [r for r in records if r["kind"] == "micro_batch"]
    usable, peak, reserved = int(budget["usable_bytes"]), f["peak_allocated_bytes"], f["peak_reserved_bytes"]
    calibration = soak_calibration([run])
    return {
        "model": run["model"],
        "allocator": run["allocator"],
        "micro_batches": len(steps),
        "optimizer_steps": sum(r["kind"] == "optimizer_step" for r in records),
        "training_steps": len({r["step"] for r in steps}),
        "ooms": len(run.get("ooms", ())),
        "tokens_per_micro_batch": round(sum(r["tokens"] for r in steps) / len(steps)) if steps else 0,
        **f,
        "peak_of_usable": peak / usable,
        "reserved_of_usable": reserved / usable,
        "peak_of_limit": peak / budget["limit_bytes"],
        "left_bytes": int(run["device_total_bytes"]) - f["untracked_bytes"] - reserved,
        "margin_held": None if not steps else (not run.get("ooms") and reserved <= usable),
        "calibrated_margin": None if calibration is None else calibrated_limits(calibration).safety_margin,
    }


def _figures(run: Mapping[str, Any]) -> dict[str, Any]:
    """The terms of :func:`summarize` that :func:`soak_calibration` takes too."""
    budget, total = run["budget"], int(run["device_total_bytes"])
    seen = [*run.get("records", ()), *run.get("ooms", ())]
    peak = max((int(r["peak_allocated"]) for r in seen), default=0)
    reserved = max((int(r["peak_reserved"]) for r in seen), default=0)
    near = RATIO_FROM * budget["limit_bytes"]
    big = [r for r in seen if r["kind"] == "micro_batch" and r["predicted"] > 0 and r["predicted"] >= near]
    return {
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": reserved,
        "overhead_bytes": reserved - peak,
        "overhead_fraction": (reserved - peak) / peak if peak else 0.0,
        "largest_gap_bytes": max((int(r["reserved"]) - int(r["allocated"]) for r in seen), default=0),
        "untracked_bytes": max(
            (max(0, total - int(r["free"]) - int(r["reserved"])) for r in seen), default=0
        ),
        "estimate_ratio": max((r["peak_allocated"] / r["predicted"] for r in big), default=None),
    }


def soak_calibration(runs: Sequence[Mapping[str, Any]]) -> Any:
    """One :class:`~batchfit.memory.calibration.Calibration` from ``runs`` of one device and one allocator setting, each term at its worst.

    ``untracked_bytes``, ``allocator_overhead_bytes`` and ``_fraction`` and ``estimate_ratio``
    (1 when no micro-batch was predicted near the limit) are the largest of the runs' (the terms
    of :func:`summarize`); ``runs`` holds each run's largest micro-batch (its predicted and
    measured peaks); ``allocator`` is the setting when every run ran under it and its segments
    agreed (``""`` otherwise, and on cpu). ``None`` when no micro-batch ran.

    Raises:
        InvalidArgument: runs of different devices, backends or allocator settings.
    """
    from batchfit.errors import InvalidArgument
    from batchfit.memory.calibration import Calibration, ConfirmedRun

    ran = [r for r in runs if any(x["kind"] == "micro_batch" for x in r.get("records", ()))]
    if not ran:
        return None
    for key in ("device", "device_total_bytes", "backend", "allocator"):
        values = sorted({str(r[key]) for r in ran})
        if len(values) > 1:
            raise InvalidArgument(
                f"a calibration comes from one device and one allocator setting, but the runs differ in {key} "
                f"({', '.join(values)}); calibrate each apart"
            )
    figures = [_figures(r) for r in ran]
    confirmed = []
    for run in ran:
        top = max(
            (x for x in run["records"] if x["kind"] == "micro_batch"), key=lambda x: x["peak_allocated"]
        )
        if top["predicted"] >= 1:
            confirmed.append(
                ConfirmedRun(
                    role="policy", seq_len=int(top["longest"]), tokens=int(top["tokens"]),
                    estimated_bytes=int(top["predicted"]), measured_bytes=int(top["peak_allocated"]),
                    reserved_bytes=int(top["peak_reserved"]) if run["backend"] == "cuda" else None,
                )
            )  # fmt: skip
    first = ran[0]
    verified = first["backend"] == "cuda" and all(r.get("allocator_verified") for r in ran)
    return Calibration(
        backend=first["backend"],
        device=first["device"],
        device_total_bytes=int(first["device_total_bytes"]),
        untracked_bytes=max(f["untracked_bytes"] for f in figures),
        allocator_overhead_bytes=max(f["overhead_bytes"] for f in figures),
        allocator_overhead_fraction=round(max(f["overhead_fraction"] for f in figures), 6),
        estimate_ratio=round(max(f["estimate_ratio"] or 1.0 for f in figures), 6),
        runs=tuple(confirmed),
        model=", ".join(dict.fromkeys(r["model"] for r in ran)),
        torch_version=str(first.get("torch_version", "")),
        batchfit_version=str(first.get("batchfit_version", "")),
        allocator=first["allocator"] if verified else "",
    )


def describe(summary: Mapping[str, Any], run: Mapping[str, Any]) -> list[str]:
    """A run's summary in a few lines."""
    from batchfit.memory import format_bytes

    s, b = summary, run["budget"]
    head = f"{s['model']}, {s['allocator']}"
    if run.get("error"):
        head += f": {run['error']}"
    lines = [
        f"{head}: {s['micro_batches']} micro-batches ({s['training_steps']} training steps, {s['optimizer_steps']} optimizer "
        f"steps, {s['tokens_per_micro_batch']:,} tokens each on average), {s['ooms']} out of memory, "
        f"{run.get('seconds', 0):.0f} s, stopped by {run.get('stopped_by')}",
        f"  budget {b['tokens']:,} tokens ({b['source']}; limit {format_bytes(b['limit_bytes'])} = {b['safety_margin']:g} × "
        f"{format_bytes(b['usable_bytes'])} usable of {format_bytes(b['memory_limit'])})",
    ]
    if not s["micro_batches"]:
        return lines
    ratio = "—" if s["estimate_ratio"] is None else f"{s['estimate_ratio']:.4f}"
    held = {True: "yes", False: "NO", None: "—"}[s["margin_held"]]
    lines += [
        f"  peak allocated {format_bytes(s['peak_allocated_bytes'])} ({s['peak_of_usable']:.3f} of usable, "
        f"{s['peak_of_limit']:.3f} of the limit), reserved {format_bytes(s['peak_reserved_bytes'])} "
        f"({s['reserved_of_usable']:.3f} of usable); left on the device {format_bytes(s['left_bytes'])}",
        f"  reserved − allocated at the peaks {format_bytes(s['overhead_bytes'])} ({s['overhead_fraction']:.1%} of "
        f"allocated), between micro-batches up to {format_bytes(s['largest_gap_bytes'])}; outside torch's allocator "
        f"{format_bytes(s['untracked_bytes'])}; measured / predicted {ratio}",
        f"  margin {MARGIN:g} held: {held}; calibrated margin {'—' if s['calibrated_margin'] is None else s['calibrated_margin']}",
    ]
    return lines


# --------------------------------------------------------------------------- one run, in its own process


def child_main(args: argparse.Namespace) -> int:
    """One run (model × allocator setting), in the process whose environment holds the setting; writes ``args.result``."""
    from batchfit.memory.calibration import allocator_setting, process_allocator_setting

    started = time.time()
    result: dict[str, Any] = {
        "model": args.model, "allocator": args.allocator, "backend": args.device,
        "allocator_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "allocator_setting": process_allocator_setting(),
        "torch_version": str(torch.__version__), "batchfit_version": _batchfit_version(), "error": None,
        "records": [], "ooms": [],
    }  # fmt: skip

    def write(state: Mapping[str, Any] | None = None) -> None:
        from batchfit.fileio import write_text

        if state is not None:
            result.update(state)
        write_text(
            args.result, json.dumps(result)
        )  # replaced whole: a run killed meanwhile leaves the last one

    try:
        workload = _workload(args)
        if args.device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
            total = int(torch.cuda.get_device_properties(device).total_memory)
            result["device"] = str(torch.cuda.get_device_name(device))
        else:
            from batchfit.memory import parse_memory

            total, result["device"] = int(parse_memory(args.memory, name="memory")), "cpu"
        result["device_total_bytes"] = total
        if args.budget_json:
            budget = SoakBudget(**json.loads(args.budget_json))
        elif args.token_budget:
            budget = SoakBudget.given(args.token_budget, total)
        else:
            budget = search_budget(
                args.model, workload, memory_limit=total, backend="estimate" if args.device == "cuda" else "cpu",
                dtype=args.dtype, logprobs=args.logprobs,
            )  # fmt: skip
        result["budget"], result["workload"] = asdict(budget), asdict(workload)
        write()
        state = run_soak(
            args.model, budget, workload, micro_batches=args.micro_batches, deadline=args.deadline, device=args.device,
            dtype=args.dtype, logprobs=args.logprobs, seed=args.seed, on_mini_batch=write,
        )  # fmt: skip
        result.update(state)
        getter = getattr(
            torch._C, "_accelerator_getAllocatorSettings", None
        )  # torch's own reading, where it has one
        result["torch_allocator_settings"] = (
            getter() if getter is not None and args.device == "cuda" else None
        )
        asked = allocator_setting(ALLOCATOR_CONFS[args.allocator])
        segments = state.get("expandable_segments")
        # the setting ran when the process asked for it and the allocator's segments agree (None: they do not say)
        result["allocator_verified"] = result["allocator_setting"] == asked and (
            segments is None or segments == (asked == "expandable_segments")
        )
    except Exception as exc:  # the parent reports it; the records so far stay in the file
        result["error"] = (
            f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ''}"
        )
        result["seconds"] = time.time() - started
        write()
        raise
    result["seconds"] = time.time() - started
    write()
    return 0


def _batchfit_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("batchfit")
    except PackageNotFoundError:  # run from a source tree (PYTHONPATH=src)
        return ""


def _workload(args: argparse.Namespace) -> Workload:
    return Workload(
        prompts=args.prompts, samples=args.samples, mini_batch=args.mini_batch, max_turns=args.max_turns,
        max_prompt_len=args.max_prompt_len, max_response_len=args.max_response_len,
    )  # fmt: skip


# --------------------------------------------------------------------------- the soak: every run, then the files


def child_env(allocator: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a run's process: ``allocator``'s ``PYTORCH_CUDA_ALLOC_CONF`` alone, and this checkout's ``src`` first on the path."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)  # one name only: which one torch reads first depends on its release
    conf = ALLOCATOR_CONFS[allocator]
    if conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(command: list[str], env: dict[str, str], timeout: float) -> tuple[int | None, str]:
    """Run one run's process: its exit code (``None``: killed at ``timeout``) and the end of its stderr."""
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return None, err[-2000:]
    return done.returncode, done.stderr[-2000:]


def soak(args: argparse.Namespace, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every run of ``args.models`` × ``args.allocators``, each in its own process; the summaries and calibration files.

    Writes ``args.out``/``soak.json`` (every run's records and summary; again after each run)
    and ``calibration-<allocator>.json`` per setting that ran. Returns what ``soak.json`` holds.
    """
    from batchfit.memory.calibration import calibrated_limits

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    begun = time.time()
    end = begun + 60.0 * args.minutes
    jobs = [(m, a) for m in args.models for a in args.allocators]
    budgets: dict[str, str] = {}
    doc: dict[str, Any] = {"settings": _settings(args), "runs": [], "calibrations": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, allocator) in enumerate(jobs):
            share = (end - time.time()) / (len(jobs) - i)
            if share < MIN_RUN_SECONDS:
                run = _empty_run(
                    model,
                    allocator,
                    args,
                    f"skipped: {end - time.time():.0f} s of --minutes {args.minutes:g} left",
                )
            else:
                result = Path(tmp) / f"{model}-{allocator}.json"
                command = [sys.executable, str(SCRIPT), "--child", "--model", model, "--allocator", allocator,
                           "--deadline", f"{time.time() + share:.3f}", "--result", str(result),
                           *_child_flags(args)]  # fmt: skip
                if model in budgets:
                    command += ["--budget-json", budgets[model]]
                code, err = run_child(command, child_env(allocator), share + KILL_AFTER_SECONDS)
                run = _read_run(result) or _empty_run(model, allocator, args, None)
                if code is None:
                    run["error"] = (
                        f"killed {KILL_AFTER_SECONDS:.0f} s after its share of the time ({share:.0f} s)"
                    )
                elif code != 0 and not run.get("error"):
                    run["error"] = f"exit {code}"
                if code != 0:
                    run["stderr"] = err
                if run.get("budget") and model not in budgets:
                    budgets[model] = json.dumps(run["budget"])
            if run.get("budget") and run.get("device_total_bytes"):
                run["summary"] = summarize(run)
                for line in describe(run["summary"], run):
                    echo(line)
            else:
                echo(f"{model}, {allocator}: {run.get('error')}")
            doc["runs"].append(run)
            _write(out / "soak.json", doc)
    for allocator in args.allocators:
        runs = [r for r in doc["runs"] if r["allocator"] == allocator and r.get("summary")]
        calibration = soak_calibration(runs) if runs else None
        if calibration is None:
            continue
        path = out / f"calibration-{allocator}.json"
        calibration.save(path)
        margin = calibrated_limits(calibration).safety_margin
        doc["calibrations"][allocator] = {"path": str(path), "safety_margin": margin, **calibration.to_dict()}
        note = (
            ""
            if calibration.allocator
            else (", cpu: no allocator" if calibration.backend == "cpu" else ", setting unverified")
        )
        echo(
            f"calibration ({allocator}{note}): {path}, margin {margin:g} = 0.98 / "
            f"({max(1.0, calibration.estimate_ratio):.4f} × {1 + calibration.allocator_overhead_fraction:.4f})"
        )
    held = [r["summary"]["margin_held"] for r in doc["runs"] if r.get("summary")]
    doc["seconds"] = time.time() - begun
    echo(
        f"margin {MARGIN:g} held in {sum(h is True for h in held)} of {len(jobs)} runs "
        f"({sum(h is False for h in held)} did not, {len(jobs) - sum(h is not None for h in held)} without a measurement); "
        f"{doc['seconds']:.0f} s in all"
    )
    _write(out / "soak.json", doc)
    return doc


def _read_run(path: Path) -> dict[str, Any] | None:
    """A run's result file, ``None`` when it wrote none (or none that reads)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, doc: Mapping[str, Any]) -> None:
    from batchfit.fileio import write_text

    write_text(path, json.dumps(doc, indent=1) + "\n")


def _empty_run(model: str, allocator: str, args: argparse.Namespace, error: str | None) -> dict[str, Any]:
    return {
        "model": model,
        "allocator": allocator,
        "backend": args.device,
        "records": [],
        "ooms": [],
        "error": error,
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("models", "allocators", "micro_batches", "minutes", "device", "dtype", "logprobs", "seed", "token_budget",
            "prompts", "samples", "mini_batch", "max_turns", "max_prompt_len", "max_response_len")  # fmt: skip
    return {k: getattr(args, k) for k in keys}


def _child_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--micro-batches", str(args.micro_batches), "--device", args.device, "--dtype", args.dtype,
             "--logprobs", args.logprobs, "--seed", str(args.seed), "--memory", str(args.memory)]  # fmt: skip
    for name in ("prompts", "samples", "mini_batch", "max_turns", "max_prompt_len", "max_response_len"):
        flags += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.token_budget:
        flags += ["--token-budget", str(args.token_budget)]
    return flags


# --------------------------------------------------------------------------- command line


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def build_parser() -> argparse.ArgumentParser:
    w = Workload()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models",
        type=_names,
        default=list(DEFAULT_MODELS),
        help="comma-separated presets (default: %(default)s)",
    )
    p.add_argument(
        "--allocators",
        type=_names,
        default=list(ALLOCATOR_CONFS),
        help="comma-separated: caching, expandable_segments (default: both)",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=DEFAULT_MICRO_BATCHES,
        help="per model × allocator (default: %(default)s)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help="the whole soak's time; each run stops cleanly in its share (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default="gpu-soak",
        help="folder for soak.json and the calibration files (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default="bf16", help="parameter dtype (default: bf16, the budget's default without fsdp2)"
    )
    p.add_argument(
        "--logprobs",
        default="full",
        help="the log-prob head: full (default, as the budget's), chunked, fused",
    )
    p.add_argument(
        "--prompts", type=int, default=w.prompts, help="prompts per training step (default: %(default)s)"
    )
    p.add_argument(
        "--samples", type=int, default=w.samples, help="trajectories per prompt (default: %(default)s)"
    )
    p.add_argument(
        "--mini-batch",
        type=int,
        default=w.mini_batch,
        help="prompts per optimizer step (default: %(default)s)",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=w.max_turns,
        help="turns per trajectory, at most (default: %(default)s)",
    )
    p.add_argument("--max-prompt-len", type=int, default=w.max_prompt_len, help="(default: %(default)s)")
    p.add_argument("--max-response-len", type=int, default=w.max_response_len, help="(default: %(default)s)")
    # for tests and a CPU's smoke run: the loop on the cpu tracker; a given budget; one run's process
    hidden = argparse.SUPPRESS
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=hidden)
    p.add_argument("--memory", default="64MiB", help=hidden)
    p.add_argument("--token-budget", type=int, default=None, help=hidden)
    p.add_argument("--child", action="store_true", help=hidden)
    p.add_argument("--model", help=hidden)
    p.add_argument("--allocator", choices=tuple(ALLOCATOR_CONFS), help=hidden)
    p.add_argument("--deadline", type=float, default=math.inf, help=hidden)
    p.add_argument("--result", help=hidden)
    p.add_argument("--budget-json", help=hidden)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    if importlib.util.find_spec("batchfit") is None:  # run from a checkout without PYTHONPATH=src
        sys.path.insert(0, str(SRC))
    unknown = [a for a in args.allocators if a not in ALLOCATOR_CONFS]
    if unknown or not args.allocators:
        parser.error(
            f"--allocators must name caching and/or expandable_segments, but got {','.join(args.allocators)!r}"
        )
    if not args.models:
        parser.error("--models must name at least one model preset, but got none")
    if args.micro_batches < 1 or args.minutes <= 0:
        parser.error(
            f"--micro-batches must be >= 1 and --minutes > 0, but got {args.micro_batches} and {args.minutes:g}"
        )
    try:
        _workload(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.device == "cuda":
        print(f"gpu_soak: {', '.join(args.models)} × {', '.join(args.allocators)}, {args.micro_batches} micro-batches each, "
              f"at most {args.minutes:g} min; torch {torch.__version__}", flush=True)  # fmt: skip
    soak(args, echo=lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
