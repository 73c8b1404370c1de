"""AutoBatch: trials and wall time of the model-guided search vs. plain bisection, for several models.

For each task × mode × target fraction it prints the batch size found, the peak as a share of
the target, the trials used, the guaranteed bound (ceil(log2(max-min+1)) + 3), the trials plain
bisection needs for the same answer (the same monotone verdicts, no memory model), and the
wall time. Every search also checks its own answer: size+1 was measured over the target.

    python benchmarks/autobatch.py            # all cases (about a minute on 2 CPU cores)
    python benchmarks/autobatch.py --quick    # the tiny cpu-backend cases only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from batchfit.autobatch import search_largest, sweep
from batchfit.autobatch.builtin_tasks import causal_lm, vision_cnn
from batchfit.memory import format_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from autobatch_task import make_task

CASES = [
    # (name, factory, backend, memory, quick)
    ("tiny causal LM, seq 128", lambda: causal_lm(seq_len=128), "cpu", "64MiB", True),
    ("conv-net 32x32, width 16", vision_cnn, "cpu", "64MiB", True),
    ("example text encoder, seq 64", make_task, "cpu", "64MiB", True),
    (
        "qwen2.5-0.5b bf16, seq 1024",
        lambda: causal_lm(model="qwen2.5-0.5b", seq_len=1024, dtype="bf16"),
        "estimate",
        "h100-80gb",
        False,
    ),
]


def bisection_trials(answer: int, low: int, high: int) -> int:
    """Trials plain bisection (min first, then midpoints) takes to reach ``answer``."""
    return len(search_largest(lambda n: n <= answer, low=low, high=high).trials)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="only the tiny cpu-backend cases")
    parser.add_argument("--max-bs", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: intra-op threads only contend on a shared machine
    print(
        f"{'task':32} {'backend':>8} {'memory':>10} {'mode':>5} {'frac':>4} {'batch':>6} "
        f"{'peak/target':>11} {'trials':>6} {'bound':>5} {'bisect':>6} {'next over':>9} {'seconds':>7}"
    )
    totals = [0, 0]
    for name, factory, backend, memory, quick in CASES:
        if args.quick and not quick:
            continue
        results: list = []
        times: list[float] = []
        last = time.perf_counter()

        def tick(mode: str, fraction: float, trial: object, times: list[float] = times) -> None:
            nonlocal last
            now = time.perf_counter()
            times.append(now - last)
            last = now

        results = sweep(
            factory,
            fractions=[0.6, 0.8],
            modes=["train", "val"],
            backend=backend,
            memory_limit=memory,
            max_batch_size=args.max_bs,
            progress=tick,
        )
        done = 0
        for r in results:
            n = len(r.trials)
            seconds = sum(times[done : done + n])
            done += n
            plain = bisection_trials(r.batch_size, 1, args.max_bs)
            totals[0] += n
            totals[1] += plain
            nxt = r.next_peak_bytes
            over = "-" if nxt is None else ("yes" if nxt > r.target_bytes else "NO")
            print(
                f"{name:32} {backend:>8} {format_bytes(r.limit_bytes):>10} {r.mode:>5} {r.memory_fraction:>4g} "
                f"{r.batch_size:>6} {r.peak_bytes / r.target_bytes:>11.1%} {n:>6} {r.max_trials:>5} {plain:>6} "
                f"{over:>9} {seconds:>7.2f}"
            )
    print(f"\ntrials in total: model-guided {totals[0]}, plain bisection {totals[1]}")


if __name__ == "__main__":
    main()
