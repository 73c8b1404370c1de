"""Benchmark of the log-prob paths (naive, chunked from logits, fused from hidden).

Prints time, peak MiB, speed vs no-chunk and memory saved vs naive, like
``batchfit bench logprobs`` (whose options it accepts), then checks the issue's two targets:

- chunked from logits at chunk 1024 takes <= 1.3x the unchunked time on CPU
  (vocab 32k, seq 4096, batch 1, logits as the input);
- fused from hidden needs >= 10x less extra memory than naive at vocab 32k x seq 8192.

Usage:
    python benchmarks/logprobs.py            # the two target checks (about 1-2 minutes on 2 cores)
    python benchmarks/logprobs.py --backend estimate --vocab 131072 --seq 131072 --hidden 4096
"""

from __future__ import annotations

import sys

from batchfit.cli import main as cli_main
from batchfit.cli.bench import render_logprobs
from batchfit.train.logprobs_bench import run_logprobs_bench


def targets() -> int:
    """Measure both targets, print the tables and a verdict line per setting; 0 if all are met.

    Target 2 is reported for fp32 and bf16 weights at hidden 1024 and 4096: fp32 weights take the
    single-pass backward, bf16 weights the two-pass one that sums the weight gradient by vocabulary
    blocks (no V x H fp32 accumulator; NOTE [ Weight gradient by vocabulary blocks ]).
    """
    speed = run_logprobs_bench(
        [32768], [4096], [None, 1024], methods=["naive", "chunked"], start="logits", entropy=True, repeats=5
    )
    render_logprobs(speed)
    ratio = speed.rows[2].time_ms / speed.rows[1].time_ms  # rows: naive, chunked none, chunked 1024
    print(
        f"target 1: chunked(1024) / unchunked time = {ratio:.2f} (target <= 1.30): {'met' if ratio <= 1.3 else 'MISSED'}"
    )

    met = ratio <= 1.3
    for dtype in ("float32", "bfloat16"):
        for hidden in (1024, 4096):
            memory = run_logprobs_bench(
                [32768],
                [8192],
                [1024],
                methods=["naive", "fused"],
                backend="estimate",
                dtype=dtype,
                hidden=hidden,
            )
            saved = memory.rows[1].memory_saved_vs_naive
            mib = memory.rows[1].extra_bytes / 2**20
            verdict = "met" if saved >= 10 else "MISSED"
            print(
                f"target 2 ({dtype}, hidden {hidden}): naive extra / fused extra = {saved:.1f}x "
                f"(fused extra {mib:,.0f} MiB; target >= 10x): {verdict}"
            )
            met = met and saved >= 10
    return 0 if met else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(cli_main(["bench", "logprobs", *sys.argv[1:]]))
    sys.exit(targets())
