"""Step-wise GRPO with batchfit on a tiny Hugging Face causal LM, on a CPU: one process, or FSDP2 under torchrun.

    python examples/grpo_stepwise.py                                          # one process
    torchrun --nproc_per_node=2 examples/grpo_stepwise.py --sharding fsdp2    # FSDP2 over 2 gloo ranks
    batchfit demo                                                             # this script, small sizes

(On a busy machine run the tiny model with ``OMP_NUM_THREADS=1``; torchrun sets it per rank.)

Every training step:

1. synthetic multi-turn rollouts: ``prompts × samples`` trajectories of 1–5 turns, one sequence
   per turn in the prompt | response layout (prompt left-padded, response right-padded), uids
   contiguous per prompt, long-tailed lengths (a few at the maximum). A trajectory's reward is
   the share of "good" tokens in its responses (learnable: the policy can come to prefer them);
   advantages are relative to the prompt's group (GRPO);
2. the old log-probs of every sequence under ``no_grad``, micro-batched under the forward-only
   budget, each rank its share, gathered on every rank;
3. per optimizer step (mini-batches of prompts × epochs: the batch plan's count, whatever the
   turns): mini-batch → data-parallel padding → exact loss weights → a token-budget plan →
   padding-free packed micro-batches → fused log-probs through the (FSDP2) model → clipped
   surrogate and its backward (``micro_batch_backward``: ``micro_batch_loss``, the step the
   token budget's probe ran; a lone sequence over the budget runs in chunks with the unsplit
   gradient, every rank in lockstep) → gradient accumulation → ``optimizer.step()``.

The token budgets are profiled on this machine, per rank for the sharding used; every
micro-batch's peak memory is measured (cpu tracker) and printed beside the budget's limit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from batchfit import BatchConfig, BatchfitError, BatchPlan, InvalidArgument
from batchfit.batches.batch import slice_batch
from batchfit.batches.microbatch import iter_micro_batches
from batchfit.batches.minibatch import mini_batch_boundaries, pad_for_data_parallel
from batchfit.batches.rollouts import collate_rollouts
from batchfit.batches.weights import loss_weights
from batchfit.budget import profile_model
from batchfit.memory import parse_memory
from batchfit.models import build_causal_lm, load_config
from batchfit.models.attention import use_varlen_attention
from batchfit.parallel import process_exit
from batchfit.parallel.distributed import check_same_arguments
from batchfit.parallel.reduce import parameter_agreement, reduce_figures
from batchfit.parallel.shard import unwrap
from batchfit.parallel.sharding import Sharding
from batchfit.plan.packing import MicroBatchPlan, plan_micro_batches
from batchfit.train import (
    CollectiveBytes,
    PeakTracker,
    accumulate,
    data_parallel_size,
    forward_logprobs,
    group_advantages,
    micro_batch_backward,
    response_columns,
)
from batchfit.train.optim import initialize_optimizer_state
from batchfit.validation import check_choice, check_int, check_number, check_positive_int

GOOD_TOKENS = 0.125  # the lowest eighth of the vocabulary (after 3 special ids) is "good"
TURN_WEIGHTS = (0.35, 0.25, 0.2, 0.12, 0.08)  # P(turns = 1..5), cut at max_turns


@dataclass
class Settings:
    """What a run does; the command line sets every field (``--max-turns`` for ``max_turns``)."""

    steps: int = 3  # training steps
    prompts: int = 8  # train_batch_size
    mini_batch: int = 4  # policy_mini_batch_size (prompts per optimizer step)
    samples: int = 4  # n_samples_per_prompt
    epochs: int = 1  # update_epochs_per_batch
    max_turns: int = 5
    max_prompt_len: int = 192  # columns: the conversation so far, left-truncated
    max_response_len: int = 128
    model: str = "tiny"  # a batchfit preset
    sharding: str = "none"  # none | ddp | fsdp2 (ddp and fsdp2: launch with torchrun)
    layout: str = "packed"  # packed (cost = sum of lengths) | padded (cost = rows × longest)
    memory: str = "64MiB"  # the simulated accelerator's memory per rank
    token_budget: int | None = None  # given: no profiling (training tokens per rank)
    forward_token_budget: int | None = None  # given: no profiling (forward-only tokens per rank)
    micro_batch_size: int | None = None  # fixed sequences per micro-batch (SkyRL) instead of a budget
    forward_micro_batch_size: int | None = None  # the same for the forward pass (default micro_batch_size)
    lr: float = 1e-3
    clip_ratio: float = 0.2
    seed: int = 0
    quiet: bool = False
    timing_only: bool = False  # no memory tracker or collective counter (they halve tokens/s)
    response_only: bool = False  # the head on the loss tokens only; budgets C and R (docs/budget.md)

    def __post_init__(self) -> None:
        for name in ("steps", "prompts", "mini_batch", "samples", "epochs", "max_response_len"):
            check_positive_int(name, getattr(self, name))
        check_int("max_prompt_len", self.max_prompt_len, minimum=32)  # questions have 8–32 tokens
        check_int("max_turns", self.max_turns, minimum=1)
        if self.max_turns > len(TURN_WEIGHTS):
            raise InvalidArgument(
                f"max_turns must be at most {len(TURN_WEIGHTS)}, but got max_turns={self.max_turns}"
            )
        check_choice("sharding", self.sharding, ("none", "ddp", "fsdp2"))
        check_choice("layout", self.layout, ("packed", "padded"))
        for name in ("token_budget", "forward_token_budget", "micro_batch_size", "forward_micro_batch_size"):
            if getattr(self, name) is not None:  # checked here, before minutes of profiling
                check_positive_int(name, getattr(self, name))
        check_number("lr", self.lr, low=0.0, low_open=True)
        check_number("clip_ratio", self.clip_ratio, low=0.0, low_open=True)
        parse_memory(self.memory, name="memory")


@dataclass
class StepLog:
    """One optimizer step; token counts summed over ranks, peaks the largest of any rank."""

    step: int  # optimizer steps so far
    training_step: int
    sequences: int  # real sequences of the mini-batch
    micro_batches: int  # per rank (the same on every rank)
    tokens_computed: int  # the tokens the model ran, padding included
    real_tokens: int  # the valid tokens of the real sequences
    seconds: float
    peak_bytes: int  # the largest micro-batch peak (the last one's includes the optimizer step)
    limit_bytes: int | None  # the training budget's limit (None: budgets given, not profiled)
    all_gather_bytes: int  # FSDP2's all-gathers on this rank
    loss: float  # the mini-batch's token-mean clipped surrogate

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.tokens_computed

    @property
    def tokens_per_second(self) -> float:
        return self.real_tokens / self.seconds


@dataclass
class ForwardLog:
    """The old-log-prob pass of one training step."""

    training_step: int
    micro_batches: int
    peak_bytes: int
    limit_bytes: int | None
    seconds: float
    all_gather_bytes: int


@dataclass
class Result:
    config: BatchConfig
    plan: BatchPlan
    budgets: Budgets
    steps: list[StepLog] = field(default_factory=list)
    forward: list[ForwardLog] = field(default_factory=list)
    model: Any = None
    ranks_agree: bool | None = None  # the ranks' parameter checksums are equal (None: not checked)


# --------------------------------------------------------------------------- rollouts


def synthetic_rollouts(s: Settings, step: int, vocab_size: int) -> dict[str, Any]:
    """One training step's sequences, the same on every rank (seeded by ``seed`` and ``step``)."""
    rng = np.random.default_rng([s.seed, step])
    good_end = 3 + int(GOOD_TOKENS * (vocab_size - 3))
    p_len, r_len = s.max_prompt_len, s.max_response_len
    prompts, responses, uids, trajectory = [], [], [], []  # one entry per sequence (turn)
    rewards: list[float] = []  # one per trajectory
    turn_p = np.array(TURN_WEIGHTS[: s.max_turns]) / sum(TURN_WEIGHTS[: s.max_turns])
    for prompt in range(s.prompts):
        question = rng.integers(3, vocab_size, rng.integers(8, 33))
        for _ in range(s.samples):
            turns = 1 + rng.choice(len(turn_p), p=turn_p)
            quality = rng.random()  # the share of good tokens this trajectory writes
            history, good, total = question, 0, 0
            for _ in range(turns):
                long_tail = int(np.clip(rng.lognormal(np.log(r_len / 8), 0.8), 4, r_len))
                length = r_len if rng.random() < 0.04 else long_tail  # a few at the maximum
                is_good = rng.random(length) < quality
                response = np.where(
                    is_good, rng.integers(3, good_end, length), rng.integers(good_end, vocab_size, length)
                )
                prompts.append(history[-p_len:])  # one sequence per turn, the history left-truncated
                responses.append(response)
                uids.append(prompt)
                trajectory.append(len(rewards))
                good, total = good + int(is_good.sum()), total + length
                observation = rng.integers(3, vocab_size, rng.integers(4, 13))  # the environment's reply
                history = np.concatenate([history, response, observation])
            rewards.append(good / total)
    # GRPO: each trajectory's reward relative to its prompt's group; every turn gets its trajectory's
    advantages = group_advantages(rewards, n=s.samples)[trajectory]
    return collate_rollouts(  # prompt | response rows; response-wide fields right-aligned
        prompts, responses, uids=uids, advantages=advantages, prompt_width=p_len, response_width=r_len
    )


# --------------------------------------------------------------------------- the loop


def train(
    s: Settings,
    budgets: Budgets | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    on_setup: Callable[[Result], None] | None = None,
) -> Result:
    """Run ``s.steps`` training steps; an initialised process group means data parallelism over it.

    ``budgets``: the token budgets per rank (default: :func:`token_budgets`, profiled here).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharding = sharding_of(s)
    torch.manual_seed(s.seed)  # the same initial weights on every rank (FSDP2 shards them)
    model = build_causal_lm(s.model, dtype="fp32", sharding=sharding)
    if s.layout == "packed":
        use_varlen_attention(unwrap(model))  # packed rows attend per sequence, no T × T mask
    if budgets is None:
        budgets = token_budgets(s, sharding, model)
    micro = {"micro_train_batch_size_per_gpu": s.micro_batch_size} if s.micro_batch_size else {}
    config = BatchConfig(
        train_batch_size=s.prompts,
        policy_mini_batch_size=s.mini_batch,
        n_samples_per_prompt=s.samples,
        update_epochs_per_batch=s.epochs,
        max_tokens_per_micro_batch=None if micro else budgets.training,
        world_size=world,
        step_wise=True,
        **micro,
    )
    result = Result(config, config.plan(), budgets)  # plan() raises one error listing every fault
    if on_setup is not None:
        on_setup(result)
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    initialize_optimizer_state(optimizer)  # the state exists before the first measured step
    dp = data_parallel_size(model)
    vocab_size = load_config(s.model).vocab_size

    def plan(lengths: torch.Tensor, tokens: int, fixed: int | None, responses: Any = None, cap: int | None = None) -> MicroBatchPlan:
        if fixed is not None:  # SkyRL's micro-batching, for comparison (benchmarks/e2e.py)
            return fixed_size_plan(lengths, fixed, dp, s.max_prompt_len + s.max_response_len)
        return plan_micro_batches(  # a sequence over the budget runs alone, in chunks (exact gradient)
            lengths,
            tokens,
            dp_size=dp,
            cost="packed" if s.layout == "packed" else "padded",
            oversize="split",
            # a response-only head's second cap: at most R loss tokens per micro-batch
            response_lengths=None if cap is None else responses,
            response_budget=cap,
        )

    trim = s.micro_batch_size is None  # fixed micro-batches run full width, as SkyRL runs them
    for t in range(s.steps):
        batch = synthetic_rollouts(s, t, vocab_size)

        # old log-probs: forward only, under its own (larger) budget; every row on every rank
        start = time.perf_counter()
        forward_plan = plan(
            batch["attention_mask"].sum(-1),
            budgets.forward,
            s.forward_micro_batch_size or s.micro_batch_size,
            (batch["loss_mask"] != 0).sum(-1),
            budgets.forward_responses,
        )
        old = torch.zeros(batch["input_ids"].shape)  # in host memory, like the rollouts
        with meters(s, model, optimizer, host=(batch, old)) as (comm, peaks):
            forward_logprobs(
                model, batch, forward_plan, rank, layout=s.layout, trim=trim, out=old, only_loss_tokens=s.response_only
            )
            peak = peaks.take()
        batch["old_log_probs"] = response_columns(old, s.max_response_len)  # the response columns
        result.forward.append(
            ForwardLog(
                training_step=t,
                micro_batches=forward_plan.num_micro_batches,
                peak_bytes=int(reduce_figures({"peak": peak}, "max")["peak"]),
                limit_bytes=budgets.forward_limit,
                seconds=time.perf_counter() - start,
                all_gather_bytes=comm.take()[0]["all_gather"],
            )
        )

        for _epoch in range(s.epochs):
            for lo, hi in mini_batch_boundaries(batch["uid"], s.mini_batch):  # whole prompts
                start = time.perf_counter()
                mini, _ = pad_for_data_parallel(slice_batch(batch, lo, hi), dp)  # cheap pad rows
                # one weight per token over the whole mini-batch: any split gives its gradient
                mini["weights"] = loss_weights(mini["loss_mask"], reduction="token_mean")
                lengths = mini["attention_mask"].sum(-1)
                responses = (mini["loss_mask"] != 0).sum(-1)
                mb_plan = plan(lengths, budgets.training, s.micro_batch_size, responses, budgets.training_responses)
                micro_batches = iter_micro_batches(mini, mb_plan, rank, layout=s.layout, trim=trim)
                loss_sum, computed, real, peak = 0.0, 0, 0, 0
                with meters(s, model, optimizer, host=mini) as (comm, peaks):
                    for mb in accumulate(model, micro_batches, mb_plan.num_micro_batches):
                        # fused log-probs through the (FSDP2) forward, then the clipped surrogate:
                        # the step the token budget's probe ran
                        loss = micro_batch_backward(
                            model, mb, plan=mb_plan, clip_ratio=s.clip_ratio, scale=dp, only_loss_tokens=s.response_only
                        )
                        loss_sum += loss.item() / dp
                        computed += mb.batch["input_ids"].numel()
                        real += sum(int(lengths[i]) for i in mb.indices if i < hi - lo)  # not pad rows
                        if mb.position < mb_plan.num_micro_batches - 1:
                            peak = max(peak, peaks.take())
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    peak = max(peak, peaks.take())  # the last micro-batch and the optimizer step
                # token counts summed over ranks, the peak the largest of any rank
                totals = reduce_figures(
                    {"loss": loss_sum, "computed": computed, "real": real, "peak": peak},
                    {"loss": "sum", "computed": "sum", "real": "sum", "peak": "max"},
                )
                log = StepLog(
                    step=len(result.steps) + 1,
                    training_step=t,
                    sequences=hi - lo,
                    micro_batches=mb_plan.num_micro_batches,
                    tokens_computed=int(totals["computed"]),
                    real_tokens=int(totals["real"]),
                    seconds=time.perf_counter() - start,
                    peak_bytes=int(totals["peak"]),
                    limit_bytes=budgets.training_limit,
                    all_gather_bytes=comm.take()[0]["all_gather"],
                    loss=totals["loss"],
                )
                result.steps.append(log)
                if on_step is not None:
                    on_step(log)
    result.model = model
    return result


# --------------------------------------------------------------------------- budgets and baselines


@dataclass(frozen=True)
class Budgets:
    """Token budgets per rank and the bytes a micro-batch under each may hold (``None``: given, not profiled)."""

    training: int
    forward: int
    training_limit: int | None = None
    forward_limit: int | None = None
    training_responses: int | None = None  # the response cap R of a response-only head (None: no second cap)
    forward_responses: int | None = None


def token_budgets(s: Settings, sharding: Sharding, model: torch.nn.Module | None = None) -> Budgets:
    """The training and forward-only token budgets per rank for ``sharding``, measured on this machine.

    One :func:`profile_model` call profiles the model (``model``, else the preset
    ``s.model``) for both: its probes run this loop's own micro-batch step (fused log-probs,
    the clipped surrogate, backward, AdamW with the gradients resident; under FSDP2 the
    unsharded gradients of the backward included) and its old-log-prob pass, on
    micro-batches laid out as this loop lays them out. Every rank calls this (the probes
    run in lockstep); budgets given in ``s`` are used as they are.
    """
    if s.token_budget is not None and s.forward_token_budget is not None:
        return Budgets(s.token_budget, s.forward_token_budget)
    profile = profile_model(
        s.model if model is None else model,
        forward_too=True,  # policy and policy_forward (old log-probs, training state resident)
        max_seq_len=s.max_prompt_len + s.max_response_len,
        backend="cpu",
        memory_limit=s.memory,
        dtype="fp32",
        logprobs="fused",
        cost="packed" if s.layout == "packed" else "padded",
        sharding=sharding,
        response_only=s.response_only,
        # the probes' share of loss tokens: the longest prompt and response's (docs/budget.md)
        response_fraction=s.max_response_len / (s.max_prompt_len + s.max_response_len) if s.response_only else None,
    )
    train, forward = profile.train, profile.forward
    return Budgets(
        s.token_budget or train.tokens,
        s.forward_token_budget or forward.tokens,
        train.limit_bytes,
        forward.limit_bytes,
        train.response_tokens,
        forward.response_tokens,
    )


def sharding_of(s: Settings) -> Sharding:
    """FSDP2 in fp32 (no mixed precision, so it equals one process), DDP or none, over the process group."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return Sharding(s.sharding, world_size=world, mixed_precision="none" if s.sharding == "fsdp2" else None)


def fixed_size_plan(lengths: torch.Tensor, size: int, dp_size: int, width: int) -> MicroBatchPlan:
    """SkyRL's micro-batching: each rank's contiguous share, ``size`` rows at a time, ``width`` columns each."""
    n = len(lengths)
    share = -(-n // dp_size)
    ranks = [
        [
            tuple(range(i, min(i + size, (r + 1) * share, n)))
            for i in range(r * share, min((r + 1) * share, n), size)
        ]
        for r in range(dp_size)
    ]
    count = max(len(micro) for micro in ranks)
    ranks = [micro + [()] * (count - len(micro)) for micro in ranks]  # equal counts: padding micro-batches
    return MicroBatchPlan(
        ranks=tuple(tuple(micro) for micro in ranks),
        costs=tuple(tuple(len(g) * width if g else 1 for g in micro) for micro in ranks),
        token_budget=size * width,
        cost="padded",
        lengths=lengths.numpy().astype(np.int64),
    )


# --------------------------------------------------------------------------- measuring


@contextlib.contextmanager
def meters(
    s: Settings, model: torch.nn.Module, optimizer: torch.optim.Optimizer, host: Any
) -> Iterator[tuple[Any, Any]]:
    """``(collective bytes, peak tracker)`` around a block of the loop; inert with ``timing_only``.

    The rollouts (``host``) stay in host memory, as a trainer keeps them; micro-batches are
    what the accelerator holds.
    """
    if s.timing_only:
        yield _Off(({"all_gather": 0}, {})), _Off(0)
        return
    with CollectiveBytes() as comm, PeakTracker(model, optimizer, host=host) as peaks:
        yield comm, peaks


class _Off:
    def __init__(self, value: Any):
        self.value = value

    def take(self) -> Any:
        return self.value


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """One option per :class:`Settings` field (``--max-turns`` for ``max_turns``)."""
    p = argparse.ArgumentParser(prog="grpo_stepwise", description=__doc__.splitlines()[0])
    choices = {"sharding": ("none", "ddp", "fsdp2"), "layout": ("packed", "padded")}
    for name, value in asdict(Settings()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        elif name in choices:
            p.add_argument(flag, default=value, choices=choices[name])
        else:
            p.add_argument(
                flag, type=type(value) if value is not None else int, default=value, metavar=name.upper()
            )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        return run_settings(Settings(**vars(parser.parse_args(argv))))
    except BatchfitError as exc:  # bad values: one line, exit 2
        parser.error(str(exc))


def run_settings(s: Settings) -> int:
    """Run ``s`` with a progress display; joins torchrun's process group for ``ddp`` and ``fsdp2``.

    Returns 0, or 1 when the ranks end with different parameters.
    """
    joined = s.sharding != "none" and not dist.is_initialized()
    if joined and "RANK" not in os.environ:
        raise InvalidArgument(
            f"sharding={s.sharding!r} runs on several ranks, but this process was not launched by torchrun "
            f"(RANK is not set); run torchrun --nproc_per_node=2 examples/grpo_stepwise.py --sharding {s.sharding}"
        )
    if joined:
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        process_exit.note_joined()  # ends without finalizing (NOTE [ A collective's worker outlives the interpreter ])
    try:
        if joined:  # ranks that disagree would plan differently and deadlock: one line on every rank instead
            flags = {"--" + k.replace("_", "-"): v for k, v in asdict(s).items()}
            check_same_arguments(flags, what="grpo_stepwise.py")
        return 0 if run_with_progress(s).ranks_agree else 1
    finally:
        if joined:
            dist.destroy_process_group()


def run_with_progress(s: Settings) -> Result:
    """:func:`train` with a rich progress bar and one line per optimizer step (rank 0 prints)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    show = not s.quiet and (not dist.is_initialized() or dist.get_rank() == 0)
    console = Console(quiet=not show, soft_wrap=True)
    columns = (TextColumn("optimizer steps"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    progress = Progress(*columns, console=console, disable=not show)
    task = progress.add_task("train", total=None)

    def on_setup(result: Result) -> None:
        b = result.budgets
        caps = "" if b.training_responses is None else (
            f"; response-only head: at most {b.training_responses:,} / {b.forward_responses:,} loss tokens"
        )
        console.print(
            f"token budget per rank: {b.training:,} tokens (training), {b.forward:,} (forward only){caps}; "
            f"layout {s.layout}, {s.memory} per rank, sharding {s.sharding}"
        )
        console.print(str(result.plan), markup=False)
        progress.update(task, total=s.steps * result.plan.optimizer_steps_per_step)
        progress.start()

    def on_step(log: StepLog) -> None:
        limit = "" if log.limit_bytes is None else f" / {log.limit_bytes / 2**20:.1f} MiB"
        progress.console.print(
            f"step {log.step:3d}  micro-batches {log.micro_batches:3d}  padding {log.padding_fraction:6.1%}  "
            f"{log.tokens_per_second:8,.0f} tok/s  peak {log.peak_bytes / 2**20:6.1f} MiB{limit}  loss {log.loss:+.4f}"
        )
        progress.advance(task)

    try:
        result = train(s, on_step=on_step, on_setup=on_setup)
    finally:
        progress.stop()
    result.ranks_agree = check_parameters(result.model, console)
    return result


def check_parameters(model: torch.nn.Module, console: Any) -> bool:
    """Whether every rank ends with the same parameters: one all-reduce of a checksum (every rank calls it).

    Prints ``ranks agree: parameter checksum … on all N ranks`` on ``console`` (rank 0's);
    when they differ, every rank writes the range of checksums to stderr.
    """
    agreement = parameter_agreement(model)
    if not agreement.equal:
        sys.stderr.write(f"grpo_stepwise: error: {agreement}\n")
        return False
    console.print(str(agreement))
    return True


if __name__ == "__main__":
    code = main()
    if process_exit.joined():  # gloo's worker may still be letting go of the last collective
        process_exit.exit_after_collectives(code)
    raise SystemExit(code)
