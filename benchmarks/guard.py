"""The guard's overhead per micro-batch: the same mini-batches with and without MicroBatchGuard, in one run.

    python benchmarks/guard.py [--model tiny] [--mini-batches 8] [--rows 16] [--budget 512] [--repeats 5] [--ddp]

One process on the CPU, the tiny preset from batchfit.models in fp32, packed micro-batches
(varlen attention), a mini-batch of RL-like rows (prompt 16–64 tokens, long-tailed response up to
192) planned under a packed token budget, every micro-batch the clipped surrogate and its backward
(``micro_batch_backward``), AdamW stepped after each mini-batch. Three loops over the same
mini-batches, interleaved within every repeat so that a change in the machine's load falls on
all three:

- ``accumulate``: the loop without the guard (``accumulate`` over ``iter_micro_batches``);
- ``guard``: ``MicroBatchGuard.mini_batch`` with no peak source (what a CPU run without a tracker does);
- ``guard+peaks``: the same with a peak source and a memory model, so every micro-batch also
  reads the bytes held, takes its peak, predicts it and checks for drift (the source here is a
  counter: on CUDA it is ``DevicePeaks``, whose two allocator reads are not timed here).

With ``--ddp`` the model is wrapped in DDP over a gloo group of this one process: the guard then
also runs DDP's synchronising pass, one padding micro-batch per mini-batch (NOTE [ A micro-batch
runs out ]), which ``accumulate`` folds into its last micro-batch; real ranks add one small
all-reduce per mini-batch, the agreement, not measured here.

Prints seconds per micro-batch for each loop (the median over repeats), the guard's overhead per
micro-batch in microseconds and as a ratio to the loop without it. The model's own time varies
by more than the guard costs on a shared machine, so the three loops run once more with an empty
step (the micro-batches are cut, nothing runs on them): the difference there is the guard's
bookkeeping alone, per micro-batch, and its share of the real loop's time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from batchfit.batches import iter_micro_batches, loss_weights
from batchfit.batches.rollouts import collate_rollouts
from batchfit.models import build_causal_lm, use_varlen_attention
from batchfit.plan import plan_micro_batches
from batchfit.train import MicroBatchGuard, accumulate, initialize_optimizer_state, micro_batch_backward


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a batchfit preset (default tiny)")
    parser.add_argument("--mini-batches", type=int, default=8, help="mini-batches per loop and repeat (default 8)")
    parser.add_argument("--rows", type=int, default=16, help="rows per mini-batch (default 16)")
    parser.add_argument("--budget", type=int, default=512, help="packed token budget (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the three loops (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp", action="store_true", help="wrap the model in DDP over a one-process gloo group")
    args = parser.parse_args(argv)
    for name in ("mini_batches", "rows", "budget", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, but got {getattr(args, name)}")
    if args.budget < 256:
        parser.error(f"--budget must hold the longest row (256 tokens), but got {args.budget}")
    return args


def mini_batches(count: int, rows: int, vocab: int, seed: int) -> list[dict]:
    """``count`` mini-batches of RL-like rows with advantages, old log-probs and exact loss weights."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        prompts = [rng.integers(3, vocab, rng.integers(16, 65)) for _ in range(rows)]
        responses = [
            rng.integers(3, vocab, int(np.clip(rng.lognormal(np.log(48), 0.8), 4, 192))) for _ in range(rows)
        ]
        batch = collate_rollouts(
            prompts, responses, prompt_width=64, response_width=192,
            advantages=rng.standard_normal(rows).tolist(), old_log_probs=[-1.0] * rows,
        )  # fmt: skip
        batch["weights"] = loss_weights(batch["loss_mask"], reduction="token_mean")
        out.append(batch)
    return out


class CountingPeaks:
    """A peak source that costs two attribute reads: the guard's own path with a source, without a device."""

    current_bytes = 1_000_000

    def take(self) -> int:
        return 1_000_000


class MemoryModel:
    """A memory model's coefficients (a TokenBudget's ``memory_model``): the prediction's arithmetic per micro-batch."""

    base, linear, quadratic = 900_000.0, 200.0, 0.01


def timed_loop(kind: str, model, optimizer, minis, budget: int, empty: bool = False) -> tuple[float, int]:
    """Seconds and micro-batches of one pass over ``minis`` with loop ``kind`` (``empty``: nothing runs on them)."""

    def step(mb, plan):
        return None if empty else micro_batch_backward(model, mb, plan=plan)

    count = 0
    guard = None
    if kind != "accumulate":
        peaks = CountingPeaks() if kind == "guard+peaks" else None
        predict = None
        if peaks is not None:
            from batchfit.train.micro_batch_guard import memory_model_predictor

            predict = memory_model_predictor(MemoryModel())
        guard = MicroBatchGuard(model, budget, peaks=peaks, predict=predict)
    start = time.perf_counter()
    for mini in minis:
        lengths = mini["attention_mask"].sum(-1)
        if guard is None:
            plan = plan_micro_batches(lengths, budget, cost="packed")
            for mb in accumulate(model, iter_micro_batches(mini, plan, layout="packed"), plan.num_micro_batches):
                step(mb, plan)
            count += plan.num_micro_batches
        else:
            record = guard.mini_batch(
                plan=lambda c, lengths=lengths: plan_micro_batches(lengths, c, cost="packed"),
                micro_batches=lambda p, mini=mini: iter_micro_batches(mini, p, layout="packed"),
                run=step,
            )
            count += len(record.micro_batches)
        if not empty:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, count


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model = build_causal_lm(args.model, dtype="fp32")
    use_varlen_attention(model)
    vocab = model.config.vocab_size
    if args.ddp:
        import tempfile

        import torch.distributed as dist

        store = dist.FileStore(tempfile.mktemp(prefix="batchfit-guard-bench-"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    initialize_optimizer_state(optimizer)
    minis = mini_batches(args.mini_batches, args.rows, vocab, args.seed)
    kinds = ("accumulate", "guard", "guard+peaks")
    timed_loop("accumulate", model, optimizer, minis[:1], args.budget)  # warm-up: kernels, allocator
    per: dict[tuple[str, bool], list[float]] = {(k, e): [] for k in kinds for e in (False, True)}
    counts: dict[str, int] = {}
    for empty, rounds in ((False, args.repeats), (True, 10 * args.repeats)):
        for repeat in range(rounds):
            for kind in kinds[repeat % 3 :] + kinds[: repeat % 3]:  # each loop first in turn
                seconds, count = timed_loop(kind, model, optimizer, minis, args.budget, empty)
                per[kind, empty].append(seconds / count)
                counts[kind] = count
    threads = torch.get_num_threads()
    out(
        f"{args.model} fp32{' under DDP (1 process)' if args.ddp else ''} on the CPU ({threads} threads), {args.mini_batches} mini-batches of {args.rows} rows, "
        f"packed budget {args.budget}: {counts['accumulate']} micro-batches per loop, median of {args.repeats} repeats "
        f"(the empty step: of {10 * args.repeats})"
    )
    base = statistics.median(per["accumulate", False])
    empty_base = statistics.median(per["accumulate", True])
    out(f"{'loop':12} {'s / micro-batch':>16} {'overhead µs':>12} {'ratio':>7} {'empty step: µs':>15} {'share':>8}")
    for kind in kinds:
        median = statistics.median(per[kind, False])
        bookkeeping = statistics.median(per[kind, True]) - empty_base
        out(
            f"{kind:12} {median:16.6f} {1e6 * (median - base):12.1f} {median / base:7.4f} "
            f"{1e6 * bookkeeping:15.1f} {bookkeeping / base:8.2%}"
        )
    if args.ddp:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
