"""Step-wise GRPO with batchfit on a tiny Hugging Face causal LM, on a CPU: one process, or FSDP2 under torchrun.

    python examples/grpo_stepwise.py                                    # one process
    torchrun --nproc_per_node=2 examples/grpo_stepwise.py --sharding fsdp2   # FSDP2 over 2 gloo ranks
    batchfit demo                                                       # this script, small sizes

Every training step:

1. synthetic multi-turn rollouts: ``prompts × samples`` trajectories of 1–5 turns, one sequence
   per turn in the prompt | response layout (prompt left-padded, response right-padded), uids
   contiguous per prompt, long-tailed lengths (a few at the maximum); the reward of a
   trajectory is the fraction of "good" tokens in its responses (a policy can learn to prefer
   them), advantages are group-relative per prompt (GRPO);
2. old log-probs of every sequence under ``no_grad``, micro-batched under the forward-only
   budget (the ``reference`` role's), each rank its share, gathered;
3. per optimizer step (mini-batches of prompts × epochs, the count fixed by the batch plan
   whatever the turns): mini-batch → data-parallel padding → exact loss weights → a
   token-budget micro-batch plan → padding-free packed micro-batches → fused log-probs through
   the (FSDP2-wrapped) model → clipped surrogate loss → gradient accumulation that syncs once.

The token budgets come from ``profile_model`` on this model and machine (per rank, for the
sharding used); every micro-batch's peak memory is measured by the cpu tracker and shown
beside the budget's limit.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from batchfit import BatchConfig, BatchfitError, BatchPlan, InvalidArgument
from batchfit.attention import use_varlen_attention
from batchfit.batch import slice_batch
from batchfit.loss import loss_weights
from batchfit.microbatch import iter_micro_batches
from batchfit.minibatch import mini_batch_boundaries, pad_for_data_parallel
from batchfit.models import build_causal_lm, initialize_optimizer_state, load_config
from batchfit.models.shard import unwrap
from batchfit.packing import MicroBatchPlan, plan_micro_batches
from batchfit.sharding import Sharding
from batchfit.train import (
    CollectiveBytes,
    PeakTracker,
    accumulate,
    data_parallel_size,
    forward_logprobs,
    model_logprobs,
    policy_loss,
    response_columns,
)
from batchfit.validation import check_choice, check_int, check_positive_int

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
    max_prompt_len: int = 192
    max_response_len: int = 128
    model: str = "tiny"  # a batchfit preset
    sharding: str = "none"  # none | ddp | fsdp2 (fsdp2/ddp: launch with torchrun)
    layout: str = "packed"  # packed (cost = sum of lengths) | padded (cost = rows × longest)
    memory: str = "64MiB"  # the simulated accelerator's memory per rank
    token_budget: int | None = None  # skip profiling: the training budget per rank
    forward_token_budget: int | None = None  # skip profiling: the forward-only budget per rank
    micro_batch_size: int | None = None  # fixed samples per micro-batch instead of a token budget
    lr: float = 1e-3
    clip_ratio: float = 0.2
    seed: int = 0
    quiet: bool = False

    def __post_init__(self) -> None:
        for name in (
            "steps",
            "prompts",
            "mini_batch",
            "samples",
            "epochs",
            "max_prompt_len",
            "max_response_len",
        ):
            check_positive_int(name, getattr(self, name))
        check_int("max_turns", self.max_turns, minimum=1)
        if self.max_turns > len(TURN_WEIGHTS):
            raise InvalidArgument(
                f"max_turns must be at most {len(TURN_WEIGHTS)}, but got max_turns={self.max_turns}"
            )
        if self.max_prompt_len < 32:
            raise InvalidArgument(
                f"max_prompt_len must be at least 32 (questions have 8–32 tokens), but got max_prompt_len={self.max_prompt_len}"
            )
        check_choice("sharding", self.sharding, ("none", "ddp", "fsdp2"))
        check_choice("layout", self.layout, ("packed", "padded"))


@dataclass
class StepLog:
    """One optimizer step, summed over ranks where it says so."""

    step: int  # optimizer steps so far
    training_step: int
    sequences: int  # real sequences of the mini-batch
    micro_batches: int  # per rank (the same on every rank)
    tokens_computed: int  # all ranks: tokens the model ran (padding included)
    real_tokens: int  # all ranks: valid tokens of the real sequences
    seconds: float
    peak_bytes: int  # the largest micro-batch peak of any rank (optimizer step included)
    limit_bytes: int | None  # the training budget's limit
    all_gather_bytes: int  # this rank's
    loss: float

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


@dataclass
class Result:
    config: BatchConfig
    plan: BatchPlan
    steps: list[StepLog] = field(default_factory=list)
    forward: list[ForwardLog] = field(default_factory=list)
    model: Any = None
    token_budget: int = 0
    forward_token_budget: int = 0


# --------------------------------------------------------------------------- rollouts


def synthetic_rollouts(s: Settings, step: int, vocab_size: int) -> dict[str, Any]:
    """One training step's sequences: the same on every rank (seeded by ``seed`` and ``step``)."""
    rng = np.random.default_rng([s.seed, step])
    good_end = 3 + int(GOOD_TOKENS * (vocab_size - 3))
    p_len, r_len = s.max_prompt_len, s.max_response_len
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    uids: list[int] = []
    advantages: list[float] = []
    turn_weights = np.array(TURN_WEIGHTS[: s.max_turns])
    for prompt in range(s.prompts):
        question = rng.integers(3, vocab_size, rng.integers(8, 33))
        rewards, counts = [], []
        for _ in range(s.samples):
            turns = 1 + rng.choice(len(turn_weights), p=turn_weights / turn_weights.sum())
            quality = rng.random()  # share of good tokens this trajectory writes
            history, good, total = question, 0, 0
            for _ in range(turns):
                length = (
                    r_len
                    if rng.random() < 0.04
                    else int(np.clip(rng.lognormal(np.log(r_len / 8), 0.8), 4, r_len))
                )
                is_good = rng.random(length) < quality
                response = np.where(
                    is_good, rng.integers(3, good_end, length), rng.integers(good_end, vocab_size, length)
                )
                rows.append((history[-p_len:], response))
                good, total = good + int(is_good.sum()), total + length
                observation = rng.integers(3, vocab_size, rng.integers(4, 13))
                history = np.concatenate([history, response, observation])
            rewards.append(good / total)
            counts.append(turns)
        r = np.array(rewards)
        group_advantage = (r - r.mean()) / (r.std() + 1e-6)  # GRPO: relative to the prompt's group
        for a, turns in zip(group_advantage, counts):
            uids += [prompt] * turns
            advantages += [float(a)] * turns  # every turn of a trajectory gets its advantage
    n = len(rows)
    input_ids = torch.zeros(n, p_len + r_len, dtype=torch.long)
    attention_mask = torch.zeros(n, p_len + r_len, dtype=torch.long)
    for i, (prompt_ids, response_ids) in enumerate(rows):
        input_ids[i, p_len - len(prompt_ids) : p_len] = torch.from_numpy(prompt_ids)  # left-padded prompt
        input_ids[i, p_len : p_len + len(response_ids)] = torch.from_numpy(
            response_ids
        )  # right-padded response
        attention_mask[i, p_len - len(prompt_ids) : p_len + len(response_ids)] = 1
    loss_mask = attention_mask[:, p_len:].float()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0) * attention_mask,
        "loss_mask": loss_mask,  # response-wide fields: right-aligned with the sequence
        "advantages": torch.tensor(advantages)[:, None] * loss_mask,
        "uid": uids,
    }


# --------------------------------------------------------------------------- set-up


def token_budgets(
    s: Settings, sharding: Sharding, max_seq_len: int
) -> tuple[int, int, int | None, int | None]:
    """``(training, forward-only)`` token budgets per rank and their byte limits, measured on this machine."""
    if s.token_budget is not None and s.forward_token_budget is not None:
        return s.token_budget, s.forward_token_budget, None, None
    from batchfit.budget.profile import profile_model

    profile = profile_model(
        s.model,
        max_seq_len=max_seq_len,
        roles=("policy", "reference"),
        backend="cpu",
        memory_limit=s.memory,
        dtype="fp32",
        logprobs="fused",
        cost="packed" if s.layout == "packed" else "padded",
        sharding=sharding,
    )
    policy, reference = profile.budgets["policy"], profile.budgets["reference"]
    return (
        s.token_budget or policy.tokens,
        s.forward_token_budget or reference.tokens,
        policy.limit_bytes,
        reference.limit_bytes,
    )


def fixed_size_plan(lengths: torch.Tensor, micro_batch_size: int, dp_size: int) -> MicroBatchPlan:
    """SkyRL's micro-batching: each rank's contiguous share, ``micro_batch_size`` sequences at a time."""
    n = len(lengths)
    share = -(-n // dp_size)
    ranks, costs = [], []
    for r in range(dp_size):
        own = list(range(r * share, min((r + 1) * share, n)))
        groups = [tuple(own[i : i + micro_batch_size]) for i in range(0, len(own), micro_batch_size)]
        ranks.append(groups)
        costs.append([len(g) * int(lengths[list(g)].max()) for g in groups])
    count = max(len(g) for g in ranks)
    for g, c in zip(ranks, costs):  # equal counts: padding micro-batches
        g += [()] * (count - len(g))
        c += [1] * (count - len(c))
    return MicroBatchPlan(
        ranks=tuple(tuple(g) for g in ranks),
        costs=tuple(tuple(c) for c in costs),
        token_budget=max(max(c) for c in costs),
        cost="padded",
        lengths=lengths.numpy().astype(np.int64),
    )


def _sum_over_ranks(*values: float) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _max_over_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# --------------------------------------------------------------------------- training


def train(
    s: Settings,
    on_step: Callable[[StepLog], None] | None = None,
    on_setup: Callable[[Result], None] | None = None,
) -> Result:
    """Run ``s.steps`` training steps; the process group, if any, must be initialised by the caller."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sharding = Sharding(
        s.sharding, world_size=world, mixed_precision=None if s.sharding != "fsdp2" else "none"
    )
    max_seq_len = s.max_prompt_len + s.max_response_len
    budget, forward_budget, limit, forward_limit = token_budgets(s, sharding, max_seq_len)
    config = BatchConfig(
        train_batch_size=s.prompts,
        policy_mini_batch_size=s.mini_batch,
        n_samples_per_prompt=s.samples,
        update_epochs_per_batch=s.epochs,
        world_size=world,
        step_wise=True,
        **(
            {"micro_train_batch_size_per_gpu": s.micro_batch_size}
            if s.micro_batch_size
            else {"max_tokens_per_micro_batch": budget}
        ),
    )
    plan = config.plan()  # raises one BatchConfigError listing every fault
    result = Result(config=config, plan=plan, token_budget=budget, forward_token_budget=forward_budget)
    if on_setup is not None:
        on_setup(result)

    torch.manual_seed(s.seed)  # the same initial weights on every rank (FSDP2 shards them)
    model = build_causal_lm(s.model, dtype="fp32", sharding=sharding)
    if s.layout == "packed":
        use_varlen_attention(unwrap(model))  # packed rows attend per sequence, no T × T mask
    optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    initialize_optimizer_state(optimizer)  # the state exists before the first measured step
    dp = data_parallel_size(model)
    cost = "packed" if s.layout == "packed" else "padded"
    vocab = load_config(s.model).vocab_size

    def micro_plan(lengths: torch.Tensor, tokens: int, size: int | None) -> MicroBatchPlan:
        if size is not None:
            return fixed_size_plan(lengths, size, dp)
        return plan_micro_batches(lengths, tokens, dp_size=dp, cost=cost)

    done = 0
    for t in range(s.steps):
        batch = synthetic_rollouts(s, t, vocab)
        lengths = batch["attention_mask"].sum(-1)

        # old log-probs: forward only, its own (larger) budget, every row gathered on every rank
        start = time.perf_counter()
        fwd_plan = micro_plan(lengths, forward_budget, s.micro_batch_size)
        with PeakTracker(model, optimizer) as peaks:
            logp = forward_logprobs(model, batch, fwd_plan, rank, layout=s.layout)
            fwd_peak = peaks.take()
        batch["old_log_probs"] = response_columns(logp, s.max_response_len)
        result.forward.append(
            ForwardLog(
                t,
                fwd_plan.num_micro_batches,
                _max_over_ranks(fwd_peak),
                forward_limit,
                time.perf_counter() - start,
            )
        )

        for _epoch in range(s.epochs):
            for lo, hi in mini_batch_boundaries(batch["uid"], s.mini_batch):
                start = time.perf_counter()
                mini, _n_pad = pad_for_data_parallel(slice_batch(batch, lo, hi), dp)
                mini["weights"] = loss_weights(mini["loss_mask"], reduction="token_mean")
                mini_lengths = mini["attention_mask"].sum(-1)
                mb_plan = micro_plan(mini_lengths, budget, s.micro_batch_size)
                micro = iter_micro_batches(mini, mb_plan, rank, layout=s.layout, model=model)
                loss_sum, computed, real, peak = 0.0, 0, 0, 0
                with CollectiveBytes() as comm, PeakTracker(model, optimizer) as peaks:
                    for mb in accumulate(model, micro, mb_plan.num_micro_batches):
                        logp = model_logprobs(model, mb.batch)
                        loss = policy_loss(logp, mb.batch, clip_ratio=s.clip_ratio, scale=dp)
                        loss.backward()
                        loss_sum += loss.item() / dp
                        computed += mb.batch["input_ids"].numel()
                        real += sum(int(mini_lengths[i]) for i in mb.indices if i < hi - lo)
                        if mb.position < mb_plan.num_micro_batches - 1:
                            peak = max(peak, peaks.take())
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    peak = max(peak, peaks.take())  # the last micro-batch and the optimizer step
                gathered = comm.take()[0]["all_gather"]
                done += 1
                loss_total, computed_total, real_total = _sum_over_ranks(loss_sum, computed, real)
                log = StepLog(
                    step=done,
                    training_step=t,
                    sequences=hi - lo,
                    micro_batches=mb_plan.num_micro_batches,
                    tokens_computed=int(computed_total),
                    real_tokens=int(real_total),
                    seconds=time.perf_counter() - start,
                    peak_bytes=_max_over_ranks(peak),
                    limit_bytes=limit,
                    all_gather_bytes=gathered,
                    loss=loss_total,
                )
                result.steps.append(log)
                if on_step is not None:
                    on_step(log)
    result.model = model
    return result


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """One option per :class:`Settings` field (``--max-turns`` for ``max_turns``)."""
    p = argparse.ArgumentParser(prog="grpo_stepwise", description=__doc__.splitlines()[0])
    for name, value in asdict(Settings()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            p.add_argument(flag, action="store_true")
        elif name in ("sharding", "layout"):
            p.add_argument(
                flag,
                default=value,
                choices=("none", "ddp", "fsdp2") if name == "sharding" else ("packed", "padded"),
            )
        else:
            p.add_argument(
                flag, type=type(value) if value is not None else int, default=value, metavar=name.upper()
            )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        settings = Settings(**vars(parser.parse_args(argv)))
        return run_settings(settings)
    except BatchfitError as exc:  # bad values: one line, exit 2
        parser.error(str(exc))


def run_settings(s: Settings) -> int:
    """Run ``s`` with a progress display; joins the torchrun process group for ``ddp``/``fsdp2``."""
    started = False
    if s.sharding != "none" and not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        started = True
    try:
        run_with_progress(s)
    finally:
        if started:
            dist.destroy_process_group()
    return 0


def run_with_progress(s: Settings) -> Result:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    show = not s.quiet and (not dist.is_initialized() or dist.get_rank() == 0)
    console = Console(quiet=not show, soft_wrap=True)
    progress = Progress(
        TextColumn("optimizer steps"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=not show,
    )
    task = None

    def on_setup(result: Result) -> None:
        nonlocal task
        plan = result.plan
        console.print(
            f"[bold]token budget per rank[/]: {result.token_budget:,} tokens (training), {result.forward_token_budget:,} (forward only), layout {s.layout}, {s.memory} per rank"
        )
        console.print(str(plan))
        task = progress.add_task("train", total=s.steps * plan.optimizer_steps_per_step)
        progress.start()

    def on_step(log: StepLog) -> None:
        limit = "" if log.limit_bytes is None else f" / {log.limit_bytes / 2**20:.1f} MiB"
        progress.console.print(
            f"step {log.step:3d}  micro-batches {log.micro_batches:3d}  padding {log.padding_fraction:6.1%}  "
            f"{log.tokens_per_second:8,.0f} tok/s  peak {log.peak_bytes / 2**20:6.1f} MiB{limit}  loss {log.loss:+.4f}"
        )
        progress.advance(task)

    try:
        return train(s, on_step=on_step, on_setup=on_setup)
    finally:
        progress.stop()


if __name__ == "__main__":
    raise SystemExit(main())
