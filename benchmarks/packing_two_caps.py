"""Micro-batch count under two caps (tokens and response tokens) against the 2-D lower bound.

    python benchmarks/packing_two_caps.py [--n 2048] [--dp 8] [--max-len 8192] [--seed 0]

RL-like rollouts: a prompt of 256–4096 tokens (log-normal) and a long-tailed response
(log-normal, 5% truncated at the response limit), so the prompt:response ratio varies from
sequence to sequence. For each cost, token budget (2× and 4× the longest sequence) and
response budget (a fraction of the token budget, at least the largest response), prints
micro-batches per rank ÷ a bound ``B`` no plan beats (``plan.lower_bound``, the larger of the
token and response bounds; for ``padded`` also the one-cap count, optimal under the token cap
alone), both bounds, the one-cap plan's count and its micro-batches over the response cap,
and the planning time.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from batchfit.plan.packing import plan_micro_batches


def rollouts(n: int, max_len: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, response lengths) of ``n`` RL-like sequences of at most ``max_len`` tokens."""
    prompt = np.clip(rng.lognormal(np.log(900), 0.7, n).astype(np.int64), 256, max_len // 2)
    limit = max_len - prompt
    response = np.clip(rng.lognormal(np.log(700), 1.0, n).astype(np.int64), 1, None)
    truncated = rng.random(n) < 0.05
    response = np.where(truncated, limit, np.minimum(response, limit))
    return prompt + response, response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    lens, resp = rollouts(args.n, args.max_len, rng)
    print(f"{args.n} sequences, longest {lens.max()}, mean {lens.mean():.0f}, mean response {resp.mean():.0f} "
          f"(response fraction {resp.sum() / lens.sum():.2f}), dp {args.dp}")
    print(f"{'cost':7} {'C':>6} {'R':>6} {'count':>6} {'LB':>5} {'count/B':>8} {'tok-LB':>6} {'resp-LB':>7} "
          f"{'1cap':>5} {'1cap viol':>9} {'seconds':>8}")
    ratios = []
    for cost in ("packed", "padded"):
        for mult in (2, 4):
            budget = mult * args.max_len
            rbudgets = sorted({max(int(frac * budget), int(resp.max())) for frac in (0.25, 0.4, 0.5, 0.6, 1.0)})
            for rbudget in rbudgets:
                one = plan_micro_batches(lens, budget, dp_size=args.dp, cost=cost)
                t0 = time.perf_counter()
                plan = plan_micro_batches(
                    lens, budget, dp_size=args.dp, cost=cost, response_lengths=resp, response_budget=rbudget
                )
                seconds = time.perf_counter() - t0
                tok_lb = one.lower_bound
                resp_lb = -(-int(resp.sum()) // (args.dp * rbudget))
                violations = sum(
                    sum(int(resp[list(mb)].sum()) > rbudget for mb in rank if mb) for rank in one.ranks
                )
                # padded: the one-cap count is the optimum under the token cap alone, a sharper bound
                bound = max(plan.lower_bound, one.num_micro_batches if cost == "padded" else 0)
                ratio = plan.num_micro_batches / bound
                ratios.append((cost, ratio))
                print(f"{cost:7} {budget:6} {rbudget:6} {plan.num_micro_batches:6} {plan.lower_bound:5} "
                      f"{ratio:8.3f} {tok_lb:6} {resp_lb:7} {one.num_micro_batches:5} {violations:9} {seconds:8.3f}")
    for cost in ("packed", "padded"):
        worst = max(r for c, r in ratios if c == cost)
        print(f"{cost}: worst count/B {worst:.3f}")


if __name__ == "__main__":
    main()
